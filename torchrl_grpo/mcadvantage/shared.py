"""Shared mode: the transform's state lives in one owner process, and every writer calls it.

:meth:`MCAdvantage.share_memory_ <torchrl_grpo.MCAdvantage.share_memory_>` (called by
``ReplayBuffer(shared=True)``) hands the transform's settings and state to an *owner*: a process
started once per process that shares (spawned, as torchrl's managers are), which keeps them as a
:class:`~torchrl_grpo.mcadvantage.replica.Replica` and serves requests over a Unix socket.
Writers (any process the transform is pickled to: spawned workers, Ray tasks on the same machine)
send each insertion there and get back
what it releases; the trainer's reads (statistics, the pending groups, checkpoints) are requests
too. So an insertion ships what it brings and what it releases, never the pending state: its cost
does not depend on how much is pending.

An insertion that releases nothing is one exchange: the owner inserts it under its lock, commits,
and answers; whatever then happens to the writer, all of it is in the state, pending. An insertion
that releases groups commits only once the writer has taken what it releases::

    writer                         owner (its lock held from (2) to (4))
    (1) request: the steps  ──►   (2) insert into its state (not yet committed)
                            ◄──       reply: the released steps
    (3) ack                 ──►   (4) commit: the new state becomes the state
                            ◄──       done
    returns the released steps

A writer that dies before (3), killed (SIGKILL) included, closes its socket: the owner sees it at
once, keeps the state it had (the insertion is wholly out), and goes on with the other writers; a
request that did not arrive whole is dropped. A writer that stops answering (suspended) holds the
lock for at most ``TORCHRL_GRPO_SHARED_TIMEOUT`` seconds (default 60): the owner then forgets
the insertion and closes the connection, and that writer's call raises ``TimeoutError`` (it never
returns steps the owner did not commit). A writer killed after (3) has its insertion in the
state; the released steps it was taking to storage are lost with it (the window between a
transform and the storage write is torchrl's replay buffer's, not this module's).

The steps travel as numpy arrays in a pickle (a TensorDict of CPU tensors, nested TensorDicts and
non-tensor entries), several times faster than pickling the TensorDict; anything else (lazy
stacks of ragged steps) is pickled as it is.

Test hook: ``TORCHRL_GRPO_SHARED_TEST_PAUSE="<where>:<file>[:<seconds>]"`` makes a writer create
``<file>`` and sleep (for ever, or ``<seconds>``) at ``<where>`` of each insertion: ``request``
(half of the request sent), ``reply`` (the request sent, the reply not read); and of an insertion
that releases groups, ``ack`` (the reply read, the owner's lock held for it) or ``done``
(acknowledged, before the owner's last word); so that a test can kill it there.
"""

from __future__ import annotations

import functools
import gc
import hmac
import multiprocessing as mp
import os
import pickle
import secrets
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import warnings
import weakref
from functools import partial
from multiprocessing.connection import wait

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from torchrl_grpo.mcadvantage.replica import OPERATIONS, Replica
from torchrl_grpo.mcadvantage.warn import recorded, reissue

_HEADER = struct.Struct("<Q")
_ACK, _DONE = b"A", b"D"
# what a reply says: rejected (raised, nothing changed), accepted (committed; a call's result),
# released (the released steps, committed once acknowledged)
_REJECTED, _ACCEPTED, _RELEASED = range(3)
_PAUSE_ENV = "TORCHRL_GRPO_SHARED_TEST_PAUSE"
_TIMEOUT_ENV = "TORCHRL_GRPO_SHARED_TIMEOUT"

# --- the steps on the wire ------------------------------------------------------------------------

_NUMPY = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    }
)


def _as_array(tensor: torch.Tensor):
    """A numpy view of a plain CPU tensor, or the tensor itself (pickled by torch)."""
    if (
        type(tensor) is torch.Tensor
        and tensor.dtype in _NUMPY
        and tensor.device.type == "cpu"
        and tensor.layout is torch.strided
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
    ):
        return tensor.numpy()
    return tensor


def _plain(td: TensorDictBase):
    """``td`` as ``(batch_size, device, {key: array | nested | object})``, or ``None`` when it is
    not a plain TensorDict (then it is pickled as it is)."""
    if type(td) is not TensorDict or any(name is not None for name in td.names):
        return None
    entries = {}
    for key, value in td.items():
        if isinstance(value, torch.Tensor):
            entries[key] = _as_array(value)
        elif type(value) is TensorDict:
            nested = _plain(value)
            if nested is None:
                return None
            entries[key] = nested
        else:  # non-tensor data, stacks of it, tensorclasses: as they are
            entries[key] = (value,)
    return tuple(td.batch_size), td.device, entries


def _from_plain(plain) -> TensorDict:
    batch_size, device, entries = plain
    source = {}
    for key, value in entries.items():
        if isinstance(value, np.ndarray):
            source[key] = torch.from_numpy(value)
        elif isinstance(value, tuple) and len(value) == 3:
            source[key] = _from_plain(value)
        elif isinstance(value, tuple):
            source[key] = value[0]
        else:
            source[key] = value
    return TensorDict(source, batch_size=batch_size, device=device)


def encode(data) -> bytes:
    """The bytes of ``data`` (``None``, or steps): see :func:`decode`."""
    plain = _plain(data) if isinstance(data, TensorDictBase) else None
    return pickle.dumps((plain is not None, data if plain is None else plain), protocol=5)


def decode(payload) -> object:
    is_plain, value = pickle.loads(payload)
    return _from_plain(value) if is_plain else value


# --- framing --------------------------------------------------------------------------------------


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)))
    sock.sendall(payload)


def _recv_exactly(sock: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the peer closed the connection")
        got += n
    return buf


def _recv(sock: socket.socket) -> bytearray:
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    return _recv_exactly(sock, size)


# --- the writer's side ----------------------------------------------------------------------------


class OwnerGone(ConnectionError):
    """The owner process of a shared transform cannot be reached."""


class Owner:
    """A handle on one shared transform in an owner process; pickled with the transform.

    It offers the operations of the :class:`~torchrl_grpo.mcadvantage.replica.Replica` it
    stands for (:data:`~torchrl_grpo.mcadvantage.replica.OPERATIONS`, and :meth:`insert`), each
    run in the owner. Each thread of each process opens its own connection on first use.
    """

    def __init__(self, address: str, authkey: bytes, key: str):
        self.address, self.authkey, self.key = address, authkey, key
        self._local = threading.local()

    def __getstate__(self):
        return {"address": self.address, "authkey": self.authkey, "key": self.key}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local = threading.local()

    def _socket(self) -> socket.socket:
        local = self._local
        sock = getattr(local, "sock", None)
        if sock is None or local.pid != os.getpid():  # none yet, or inherited through a fork
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.address)
                sock.sendall(self.authkey)
            except OSError as err:
                sock.close()
                raise OwnerGone(
                    f"MCAdvantage: the owner process of this shared transform cannot be reached "
                    f"at {self.address} ({err}); it ends with the process that shared the "
                    "transform."
                ) from err
            local.sock, local.pid = sock, os.getpid()
        return sock

    def _drop(self) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            sock.close()
        self._local.sock = None

    def _exchange(self, request: bytes, pause: str | None = None) -> bytearray:
        sock = self._socket()
        try:
            if pause == "request":  # the test hook: half of the request, then wait to be killed
                half = len(request) // 2
                sock.sendall(_HEADER.pack(len(request)) + request[:half])
                _pause()
                sock.sendall(request[half:])
            else:
                _send(sock, request)
            if pause == "reply":
                _pause()
            return _recv(sock)
        except (OSError, EOFError) as err:
            self._drop()
            raise OwnerGone(
                f"MCAdvantage: lost the owner process of this shared transform ({err!r})."
            ) from err

    def __getattr__(self, name: str):
        if name in OPERATIONS:
            return functools.partial(self.call, name)
        raise AttributeError(name)

    def call(self, name: str, *args):
        """The replica's operation ``name`` with ``args``, in the owner."""
        reply = self._exchange(pickle.dumps((self.key, name, args), protocol=5))
        kind, value, caught = pickle.loads(reply)
        reissue(caught)
        if kind == _REJECTED:
            raise value
        return value

    def insert(self, tensordict: TensorDictBase, check=None):
        """One insertion in the owner: the steps it releases (or ``None``); raises what the
        insertion raises. ``check(steps)`` sees the released steps before they are
        acknowledged, and may refuse them by raising: the connection is then dropped, so the
        owner forgets the insertion (as when a writer dies before acknowledging)."""
        pause = _pause_point()
        request = pickle.dumps((self.key, None, encode(tensordict)), protocol=5)
        kind, value, caught = pickle.loads(self._exchange(request, pause))
        if kind != _RELEASED:  # rejected (nothing changed), or held back (committed)
            reissue(caught)
            if kind == _REJECTED:
                raise value
            return None
        sock, out = self._local.sock, decode(value)
        if check is not None:
            try:
                check(out)
            except BaseException:
                self._drop()
                raise
        try:
            if pause == "ack":  # holding the owner's lock
                _pause()
            sock.sendall(_ACK)
            if pause == "done":  # committed
                _pause()
            done = _recv_exactly(sock, 1)
        except (OSError, EOFError) as err:
            self._drop()
            raise TimeoutError(
                "MCAdvantage: the owner process gave up this insertion (no acknowledgement within "
                f"{_TIMEOUT_ENV} seconds, or the connection broke): nothing of it was kept."
            ) from err
        if done != _DONE:
            raise OwnerGone(
                f"MCAdvantage: unexpected reply {bytes(done)!r} from the owner process."
            )
        reissue(caught)
        return out

    def forget(self) -> None:
        """Drop the shared state from the owner (when the transform that shared it is gone)."""
        try:
            self.call("forget")
        except Exception:  # the owner may be gone already (interpreter exit)
            pass


def _pause_point() -> str | None:
    spec = os.environ.get(_PAUSE_ENV)
    return None if spec is None else spec.split(":", 1)[0]


def _pause() -> None:
    _, path, *seconds = os.environ[_PAUSE_ENV].split(":")
    with open(path, "w"):
        pass
    time.sleep(float(seconds[0]) if seconds else 10**6)


def _timeout() -> float:
    return float(os.environ.get(_TIMEOUT_ENV, "60"))


# --- the owner's side -----------------------------------------------------------------------------

_server: dict = {}  # this process's owner: pid, address, authkey, process
_server_lock = threading.Lock()


def share(replica: Replica) -> Owner:
    """Hand ``replica`` (a transform's local settings and state) to this process's owner,
    started on first use.

    The owner waits ``TORCHRL_GRPO_SHARED_TIMEOUT`` seconds (read now; default 60) for a writer's
    acknowledgement before it gives up the writer's insertion.
    """
    with _server_lock:
        if _server.get("pid") != os.getpid() or not _server["process"].is_alive():
            _server.update(_start(), pid=os.getpid())
        address, authkey = _server["address"], _server["authkey"]
    with replica.lock:
        try:
            payload = pickle.dumps((replica.options, replica.state), protocol=5)
        except (pickle.PicklingError, AttributeError, TypeError) as err:
            raise TypeError(
                "MCAdvantage.share_memory_: the transform goes to its owner process by pickling, "
                f"and it cannot be pickled ({err}); a custom candidate_selector must be defined at "
                "module level."
            ) from err
    owner = Owner(address, authkey, secrets.token_hex(8))
    owner.call("register", payload, _timeout())
    return owner


def _start() -> dict:
    folder = tempfile.mkdtemp(prefix="torchrl_grpo-")  # private (0700): only this user connects
    address = os.path.join(folder, "owner.sock")
    authkey = secrets.token_bytes(32)
    ctx = mp.get_context("spawn")
    ready, child_end = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=_serve, args=(address, authkey, child_end), name="MCAdvantage-owner", daemon=True
    )
    process.start()
    child_end.close()
    try:
        started = ready.poll(120) and ready.recv() == address
    except EOFError:  # it ended while starting
        started = False
    if not started:
        process.kill()
        raise RuntimeError(
            f"MCAdvantage: the owner process did not start (exit code {process.exitcode})."
        )
    return {"address": address, "authkey": authkey, "process": process}


def _serve(address: str, authkey: bytes, ready) -> None:
    """The owner process: serve until the process that started it ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer (as managers do)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # (how its parent ends it at exit)
    torch.set_num_threads(1)
    # The process holds the pending state, many small objects that live long, and each request
    # makes more: collect the young ones less often, and never look at what the imports made
    # (this halves the owner's time per insertion).
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    server = _Server(authkey)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    threading.Thread(target=server.accept, args=(listener,), daemon=True).start()
    ready.send(address)
    ready.close()
    try:
        wait([mp.parent_process().sentinel])
    finally:
        os.unlink(address)
        os.rmdir(os.path.dirname(address))


class _Server:
    """The replicas of the owner process and the one lock over them."""

    def __init__(self, authkey: bytes):
        self.authkey = authkey
        self.replicas: dict = {}
        self.timeouts: dict = {}
        self.lock = threading.RLock()

    def accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:  # out of file descriptors, say: the next writer may find some
                time.sleep(0.1)
                continue
            threading.Thread(target=self.serve, args=(sock,), daemon=True).start()

    def serve(self, sock: socket.socket) -> None:
        """One writer's connection (a thread of a process), until it closes."""
        with sock:
            try:
                if not hmac.compare_digest(bytes(_recv_exactly(sock, 32)), self.authkey):
                    return
                while True:
                    key, name, payload = pickle.loads(_recv(sock))
                    if name is None:
                        if not self.insert(sock, key, payload):
                            return
                    else:
                        _send(sock, self.call(key, name, payload))
            except (OSError, EOFError):  # the writer is gone: a half-sent request is dropped
                return

    def call(self, key: str, name: str, args: tuple) -> bytes:
        if name == "forget":
            # Without the lock: a transform's finalizer runs wherever the collector finds it
            # garbage, possibly in a writer whose insertion holds the lock (awaiting its
            # acknowledgement); waiting for the lock there would stall that writer until the
            # timeout and lose its insertion. (Two dict pops: atomic.)
            self.replicas.pop(key, None)
            self.timeouts.pop(key, None)
            return _reply(_ACCEPTED, None, ())
        with self.lock, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if name == "register":
                    value = self.register(key, *args)
                elif name in OPERATIONS:
                    value = getattr(self.get(key), name)(*args)
                else:
                    raise AttributeError(f"MCAdvantage: no operation {name!r} in the owner.")
                return _reply(_ACCEPTED, value, caught)
            except Exception as err:  # raised in the caller
                return _reply(_REJECTED, _picklable(err), caught)

    def register(self, key: str, payload: bytes, timeout: float) -> None:
        options, state = pickle.loads(payload)
        self.replicas[key] = Replica(options, state, lock=self.lock)
        self.timeouts[key] = timeout

    def get(self, key: str) -> Replica:
        try:
            return self.replicas[key]
        except KeyError:
            raise OwnerGone(
                "MCAdvantage: the owner holds no such shared transform any more (the transform "
                "that shared it was garbage-collected)."
            ) from None

    def insert(self, sock: socket.socket, key: str, payload: bytes) -> bool:
        """One insertion (see the module's docstring); ``False`` when the writer is gone."""
        with self.lock:
            kind, reply, commit = self.attempt(key, payload)
            if kind == _RELEASED:
                return self.deliver(sock, key, reply, commit)
        _send(sock, reply)
        return True

    def attempt(self, key: str, payload: bytes) -> tuple:
        """The insertion against the state: ``(kind, reply, commit)``. One that releases
        nothing is committed at once: all of it is then in the state, where a lost reply cannot
        lose it."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                replica = self.get(key)
                outcome = replica.attempt(decode(payload))
                released = None if outcome.out is None else encode(outcome.out)
            except Exception as err:  # rejected: nothing changed
                return _REJECTED, _reply(_REJECTED, _picklable(err), caught), None
        if released is None:
            replica.commit(outcome)
            return _ACCEPTED, _reply(_ACCEPTED, None, caught), None
        return _RELEASED, _reply(_RELEASED, released, caught), partial(replica.commit, outcome)

    def deliver(self, sock: socket.socket, key: str, reply: bytes, commit) -> bool:
        """Send the released steps; commit once the writer acknowledges them (the lock held)."""
        sock.settimeout(self.timeouts.get(key))
        try:
            _send(sock, reply)
            if _recv_exactly(sock, 1) != _ACK:
                return False
        except (OSError, EOFError):  # gone or silent: the insertion is forgotten
            return False
        finally:
            sock.settimeout(None)
        commit()
        sock.sendall(_DONE)
        return True


def _reply(kind: int, value, caught) -> bytes:
    return pickle.dumps((kind, value, recorded(caught)), protocol=5)


def _picklable(err: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


def finalize_with(transform, owner: Owner) -> None:
    """Forget the shared state when ``transform`` (the one that shared it) is collected (not at
    exit: the owner ends with this process)."""
    weakref.finalize(transform, owner.forget).atexit = False
