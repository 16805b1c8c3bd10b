"""A transform's state in a Ray actor: :class:`RayMCAdvantage`, writers on any machine of a Ray
cluster completing one set of groups.

The actor holds a :class:`~torchrl_grpo.mcadvantage.replica.Replica` (the transform's options
and state); :class:`RayOwner`, the transform's handle on it, offers the replica's
:data:`~torchrl_grpo.mcadvantage.replica.OPERATIONS` and ``insert``, as the owner process of a
shared transform does (:mod:`~torchrl_grpo.mcadvantage.shared`).

An insertion is two calls when it releases groups, and one when it does not:

1. ``attempt(steps)``: the actor inserts them into a copy of its state. If nothing is released,
   it commits at once and the call returns ``None``. Otherwise it keeps the new state under a
   token and returns the released steps, uncommitted.
2. the writer checks the released steps against its buffer (a release larger than the storage,
   ``rb.add``: see :mod:`~torchrl_grpo.mcadvantage.buffer`); then ``commit(token)`` makes the
   new state the state, unless another call changed the state in between: the writer then
   attempts again on the new state (optimistic concurrency; the actor never waits for a writer,
   so a writer that dies between the two calls holds nothing and loses nothing that was not
   its own).

Errors raised in the actor are raised in the writer as they are (not as Ray's wrapped task
error), and the warnings of the actor's replica (evictions, stuck groups) are issued in the
writer.
"""

from __future__ import annotations

import itertools
import pickle
import warnings

from tensordict import TensorDictBase

from torchrl_grpo.mcadvantage.replica import OPERATIONS, Replica
from torchrl_grpo.mcadvantage.transform import MCAdvantage
from torchrl_grpo.mcadvantage.warn import recorded, reissue

__all__ = ["RayMCAdvantage"]

#: Operations that change nothing: they do not invalidate an uncommitted attempt.
READ_ONLY = frozenset({"stats", "counter", "group_ids", "trajectories", "to_plain"})
#: How many times a writer attempts an insertion that others keep overtaking.
MAX_ATTEMPTS = 100
#: Uncommitted attempts kept by the actor (those of writers that died are forgotten this way).
KEPT_ATTEMPTS = 64


class ReplicaActor:
    """The Ray actor's class: one replica, and the uncommitted attempts of its writers."""

    def __init__(self, payload: bytes):
        options, state = pickle.loads(payload)
        self.replica = Replica(options, state)
        self.version = 0  # each commit and each change moves it on
        self.attempts: dict = {}
        self.tokens = itertools.count()

    def call(self, name: str, args: tuple) -> tuple:
        """The replica's operation ``name``: ``(error or None, value, warnings)``."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if name not in OPERATIONS:
                    raise AttributeError(f"MCAdvantage: no operation {name!r} in the Ray actor.")
                value = getattr(self.replica, name)(*args)
            except Exception as err:  # raised in the writer
                return err, None, recorded(caught)
            if name not in READ_ONLY:
                self.version += 1
        return None, value, recorded(caught)

    def attempt(self, tensordict: TensorDictBase) -> tuple:
        """Insert without committing what releases: ``(error, (token, released), warnings)``."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                outcome = self.replica.attempt(tensordict)
            except Exception as err:  # rejected: nothing changed
                return err, None, recorded(caught)
        if outcome.out is None:  # nothing released: committed now, a lost reply loses nothing
            self.replica.commit(outcome)
            self.version += 1
            return None, (None, None), recorded(caught)
        token = next(self.tokens)
        self.attempts[token] = (self.version, outcome)
        while len(self.attempts) > KEPT_ATTEMPTS:
            del self.attempts[next(iter(self.attempts))]
        return None, (token, outcome.out), recorded(caught)

    def commit(self, token: int) -> bool:
        """Commit the attempt ``token``; ``False`` if the state changed since it was made."""
        version, outcome = self.attempts.pop(token, (None, None))
        if version != self.version:
            return False
        self.replica.commit(outcome)
        self.version += 1
        return True

    def discard(self, token: int) -> None:
        """Forget the attempt ``token`` (its writer refused the release)."""
        self.attempts.pop(token, None)


class RayOwner:
    """A transform's handle on its :class:`ReplicaActor`; pickled with the transform, so that
    every copy of it on any Ray worker calls the same actor."""

    def __init__(self, actor, ray):
        self.actor, self._ray = actor, ray

    def __getstate__(self):
        return {"actor": self.actor}

    def __setstate__(self, state):
        import ray

        self.actor, self._ray = state["actor"], ray

    def __getattr__(self, name: str):
        if name in OPERATIONS:
            return lambda *args: self.call(name, *args)
        raise AttributeError(name)

    def _get(self, ref):
        error, value, caught = self._ray.get(ref)
        reissue(caught)
        if error is not None:
            raise error
        return value

    def call(self, name: str, *args):
        """The replica's operation ``name`` with ``args``, in the actor."""
        return self._get(self.actor.call.remote(name, args))

    def insert(self, tensordict: TensorDictBase, check=None) -> TensorDictBase | None:
        """One insertion in the actor: the steps it releases (or ``None``). ``check(steps)``
        sees the released steps before they are committed, and may refuse them by raising."""
        for _ in range(MAX_ATTEMPTS):
            token, out = self._get(self.actor.attempt.remote(tensordict))
            if token is None:
                return None
            if check is not None:
                try:
                    check(out)
                except BaseException:
                    self.actor.discard.remote(token)
                    raise
            if self._ray.get(self.actor.commit.remote(token)):
                return out
        raise RuntimeError(
            f"RayMCAdvantage: {MAX_ATTEMPTS} attempts of one insertion were each overtaken by "
            "another writer's commit; nothing of it was kept."
        )


class RayMCAdvantage(MCAdvantage):
    """:class:`~torchrl_grpo.MCAdvantage` whose pending groups and statistics live in a Ray
    actor: writers on every machine of a Ray cluster complete one set of groups.

    A drop-in for ``torchrl.objectives.llm.RayMCAdvantage`` (same arguments), with every
    argument of :class:`~torchrl_grpo.MCAdvantage`. Copies of the transform (pickled to Ray
    workers, or to the processes of a collector) call the same actor. When the whole replay
    buffer is torchrl's ``RayReplayBuffer``, pass ``transform_factory=MCAdvantage`` to it
    instead: the transform then runs in the buffer's actor, with one Ray call per insertion
    where this one makes one or two (see :mod:`~torchrl_grpo.mcadvantage.ray_actor`).

    Every positional and keyword argument of :class:`~torchrl_grpo.MCAdvantage` is taken, and:

    Args:
        ray_init_config (dict, optional): keyword arguments of ``ray.init`` when Ray is not
            running yet.
        remote_config (dict, optional): keyword arguments of ``ray.remote`` for the actor
            (default ``{"num_cpus": 1}``).
        actor_name (str, optional): a named actor: the one of that name if it exists (its state
            is then that actor's; this transform's arguments are not sent), otherwise a new one.

    Examples:
        >>> import ray, torch
        >>> from tensordict import TensorDict
        >>> from torchrl_grpo import RayMCAdvantage
        >>> def trajectory(seed, reward):
        ...     return TensorDict(
        ...         seed=torch.tensor([seed]),
        ...         next=TensorDict(reward=torch.tensor([[reward]]), done=torch.tensor([[True]]),
        ...                         batch_size=[1]),
        ...         batch_size=[1],
        ...     )
        >>> t = RayMCAdvantage(2, prompt_key="seed", ray_init_config={
        ...     "num_cpus": 1, "include_dashboard": False, "log_to_driver": False})
        >>> t.inv(trajectory(0, 0.0)) is None, t.queued_trajectories
        (True, 1)
        >>> t.inv(trajectory(0, 1.0))["advantage"].reshape(-1)
        tensor([-0.7071,  0.7071])
        >>> t.close(); ray.shutdown()
    """

    def __init__(
        self,
        *args,
        ray_init_config: dict | None = None,
        remote_config: dict | None = None,
        actor_name: str | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        import ray  # the `dist` extra

        if not ray.is_initialized():
            ray.init(**(ray_init_config or {}))
        self._owns_actor = True
        actor = None
        if actor_name is not None:
            try:
                actor = ray.get_actor(actor_name)
                self._owns_actor = False
            except ValueError:  # no actor of that name yet
                pass
        if actor is None:
            remote = ray.remote(**(remote_config or {"num_cpus": 1}))(ReplicaActor)
            if actor_name is not None:
                remote = remote.options(name=actor_name)
            replica = self._replica
            actor = remote.remote(pickle.dumps((replica.options, replica.state), protocol=5))
        self._replica = RayOwner(actor, ray)

    def share_memory_(self) -> RayMCAdvantage:
        """Nothing to do: the state is already in the actor, which every copy calls."""
        return self

    def close(self) -> None:
        """End the actor this transform created (not a named one it found)."""
        if isinstance(self._replica, RayOwner) and self._owns_actor:
            self._replica._ray.kill(self._replica.actor)
