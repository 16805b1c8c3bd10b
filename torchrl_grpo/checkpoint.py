"""Checkpoints that a killed save cannot tear.

**A checkpoint folder.** :func:`save_checkpoint` writes every piece of a run's state (a replay
buffer, the state dicts...) into a new folder beside the target, then swaps it into place;
:func:`load_checkpoint` reads one back after checking it. The protocol, for
``save_checkpoint("run/checkpoint", pieces, stamp)``:

1. the pieces go into ``run/checkpoint.tmp-<pid>-<random>/``, each carrying the ``stamp``
   (an object with ``dumps`` into its own sub-folder, with ``stamp.json``; anything else with
   ``torch.save`` into ``<name>.pt``, as ``{"stamp": stamp, "value": value}``), and every file
   and folder is flushed to disk (``fsync``);
2. ``checkpoint.json`` is written last (the stamp, and each file's size and SHA-256), flushed:
   a folder holding it is complete;
3. the swap: the previous ``run/checkpoint`` is renamed ``run/checkpoint.old``, the new folder
   renamed ``run/checkpoint``, ``run/checkpoint.old`` and leftovers of killed saves removed.

A process killed at any point leaves one complete checkpoint to load: before the swap,
``run/checkpoint`` is the previous one; between the two renames, :func:`find_checkpoint` takes
the complete folder of the highest stamp among ``run/checkpoint.old`` and the new one; after,
the new one. Loading refuses, naming the cause and loading nothing, a folder with no complete
checkpoint, pieces whose stamps differ (pieces of different saves: a torn checkpoint), and a
file whose size or SHA-256 is not what the save wrote (truncated or changed since). One
process saves into a folder at a time.

The storages a replay buffer of this package may hold that torchrl cannot save (an empty tensor
storage, a list storage) are saved by the checkpointers of :mod:`torchrl_grpo.storages`
(:class:`~torchrl_grpo.storages.EmptyStorageCheckpointer`,
:class:`~torchrl_grpo.storages.RowsCheckpointer`, :func:`~torchrl_grpo.storages.allow_empty_dumps`),
importable from here too.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from torchrl_grpo.storages import (
    EmptyStorageCheckpointer as EmptyStorageCheckpointer,
)
from torchrl_grpo.storages import RowsCheckpointer as RowsCheckpointer
from torchrl_grpo.storages import allow_empty_dumps as allow_empty_dumps

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "EmptyStorageCheckpointer",
    "RowsCheckpointer",
    "allow_empty_dumps",
    "find_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

# --- checkpoint folders: written aside, swapped into place, checked when read -------------------

MANIFEST = "checkpoint.json"  # written last: a folder holding it is a complete checkpoint
_STAMP = "stamp.json"  # a folder piece's stamp
_FORMAT = 1
#: The private seam of the fault tests (``test/faults``): called with the name of each write of
#: a save once it is done (``"piece buffer"``, ``"manifest"``, ``"moved aside"``,
#: ``"in place"``, ``"removed"``), so that a test can kill the process there.
_after_write: Callable[[str], None] | None = None


class CheckpointError(RuntimeError):
    """A checkpoint refused: none complete, pieces of different saves, a file changed since."""


class Checkpoint(NamedTuple):
    """What :func:`load_checkpoint` read.

    Attributes:
        stamp: the stamp every piece carries (what the writer counted: batches trained...).
        folder: the folder it was read from (``<folder>.old`` or a ``.tmp-`` folder after a
            save killed between its renames).
        values: each piece: the object saved with ``torch.save``, or the folder of a piece
            saved with ``dumps`` (pass it to the object's ``loads``).
    """

    stamp: int
    folder: Path
    values: dict[str, Any]


def save_checkpoint(folder: str | os.PathLike, pieces: Mapping[str, Any], stamp: int) -> Path:
    """Write ``pieces`` as one checkpoint in ``folder``, replacing the one there in one swap.

    A kill at any point leaves a complete checkpoint, the previous one or this one, never a
    mix (the protocol: :mod:`torchrl_grpo.checkpoint`).

    Args:
        folder: where the checkpoint goes (created; its parent too).
        pieces: ``{name: value}``; a value with ``dumps(path)`` (a replay buffer; a
            ``TensorDict`` too, read back with ``TensorDict.load``) is saved into the
            sub-folder ``name``, any other with ``torch.save`` into ``name.pt``. Names are
            plain file names.
        stamp: a non-negative integer every piece carries, e.g. the batches trained so far.

    Returns:
        ``folder``, as a ``Path``.

    Raises:
        ValueError: a bad name or stamp (nothing written).
        CheckpointError: ``folder`` holds something that is not a checkpoint (nothing written,
            nothing removed).

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from torchrl_grpo.checkpoint import load_checkpoint, save_checkpoint
        >>> with tempfile.TemporaryDirectory() as run:
        ...     _ = save_checkpoint(Path(run) / "checkpoint", {"state": {"step": 3}}, stamp=3)
        ...     _ = save_checkpoint(Path(run) / "checkpoint", {"state": {"step": 4}}, stamp=4)
        ...     saved = load_checkpoint(Path(run) / "checkpoint")
        ...     print(sorted(p.name for p in Path(run).iterdir()))
        ['checkpoint']
        >>> saved.stamp, saved.values["state"]
        (4, {'step': 4})
    """
    folder = Path(folder)
    _check_pieces(pieces, stamp)
    old = _aside(folder)
    _check_replaceable(folder, old)
    folder.parent.mkdir(parents=True, exist_ok=True)
    new = folder.with_name(f"{folder.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    new.mkdir()
    try:
        files = {name: _write_piece(new, name, value, stamp) for name, value in pieces.items()}
        manifest = {"format": _FORMAT, "stamp": stamp, "pieces": files}
        _write_bytes(new / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync_dir(new)
        _written("manifest")
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    _swap(new, folder, old)
    return folder


def find_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The complete checkpoint :func:`save_checkpoint` left for ``folder``, or ``None``.

    ``folder`` itself when it is complete; else, after a save killed between its renames, the
    complete one of the highest stamp among ``<folder>.old`` and ``<folder>.tmp-*``.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from torchrl_grpo.checkpoint import find_checkpoint, save_checkpoint
        >>> with tempfile.TemporaryDirectory() as run:
        ...     _ = save_checkpoint(Path(run) / "checkpoint", {"state": {}}, stamp=1)
        ...     _ = (Path(run) / "checkpoint").rename(Path(run) / "checkpoint.old")  # a kill
        ...     print(find_checkpoint(Path(run) / "checkpoint").name)
        checkpoint.old
    """
    folder = Path(folder)
    if _stamp_of(folder) is not None:
        return folder
    candidates = [_aside(folder), *sorted(folder.parent.glob(f"{folder.name}.tmp-*"))]
    complete = [(_stamp_of(path), path) for path in candidates]
    complete = [(stamp, path) for stamp, path in complete if stamp is not None]
    return max(complete, key=lambda pair: pair[0])[1] if complete else None


def load_checkpoint(folder: str | os.PathLike, *, weights_only: bool = True) -> Checkpoint:
    """Read the checkpoint :func:`save_checkpoint` wrote for ``folder``, after checking it.

    Every piece must carry the manifest's stamp, and every file the size and SHA-256 the save
    recorded; nothing outside is changed, so a refusal loses nothing.

    Args:
        folder: as given to :func:`save_checkpoint` (:func:`find_checkpoint` finds the
            complete one after a killed save).
        weights_only: passed to ``torch.load`` for the ``.pt`` pieces; ``False`` for pieces
            holding other objects than tensors and plain containers (load only checkpoints
            you wrote).

    Returns:
        A :class:`Checkpoint`: the stamp, the folder read, and each piece (the folder of a
        ``dumps`` piece: ``rb.loads(checkpoint.values["buffer"])``).

    Raises:
        CheckpointError: no complete checkpoint; a piece that cannot be read; pieces whose
            stamps differ (named, with their stamps); a file whose size or SHA-256 differs.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> from torchrl_grpo.checkpoint import load_checkpoint, save_checkpoint
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(8))
        >>> _ = rb.extend(TensorDict(x=torch.arange(3), batch_size=[3]))
        >>> with tempfile.TemporaryDirectory() as run:
        ...     _ = save_checkpoint(Path(run) / "ckpt", {"buffer": rb, "state": {"n": 3}}, 3)
        ...     saved = load_checkpoint(Path(run) / "ckpt")
        ...     restored = ReplayBuffer(storage=LazyTensorStorage(8))
        ...     restored.loads(saved.values["buffer"])
        >>> saved.stamp, saved.values["state"], restored[:]["x"]
        (3, {'n': 3}, tensor([0, 1, 2]))
    """
    asked = Path(folder)
    found = find_checkpoint(asked)
    if found is None:
        raise CheckpointError(_none_found(asked))
    manifest = _read_manifest(found)
    values, stamps = {}, {}
    for name, entry in manifest["pieces"].items():
        stamps[name], values[name] = _read_piece(found, name, entry, weights_only)
    torn = {name: stamp for name, stamp in stamps.items() if stamp != manifest["stamp"]}
    if torn:
        same = sorted(set(stamps) - set(torn))
        raise CheckpointError(
            f"checkpoint {found}: its pieces carry different stamps: "
            + ", ".join(f"{name!r} {stamp}" for name, stamp in torn.items())
            + f", while {same or 'its manifest'} carry {manifest['stamp']}: pieces of different "
            "saves (a torn checkpoint); nothing was loaded."
        )
    for name, entry in manifest["pieces"].items():
        _check_files(found, name, entry)
    return Checkpoint(manifest["stamp"], found, values)


def _check_pieces(pieces: Mapping[str, Any], stamp: int) -> None:
    if isinstance(stamp, bool) or not isinstance(stamp, int) or stamp < 0:
        raise ValueError(f"save_checkpoint: the stamp must be an integer >= 0, got {stamp!r}.")
    if not pieces:
        raise ValueError("save_checkpoint: no pieces to save.")
    for name in pieces:
        plain = isinstance(name, str) and name and Path(name).name == name
        if not plain or name.startswith(".") or name in (MANIFEST, _STAMP):
            raise ValueError(
                f"save_checkpoint: piece name {name!r} is not a plain file name (no folder, no "
                f"leading dot, not {MANIFEST!r})."
            )


def _aside(folder: Path) -> Path:
    return folder.with_name(f"{folder.name}.old")


def _check_replaceable(folder: Path, old: Path) -> None:
    """Refuse to replace what is not a checkpoint, or to lose the only complete one."""
    mine = _stamp_of(folder) is not None
    if folder.exists() and not mine and any(folder.iterdir()):
        raise CheckpointError(
            f"save_checkpoint: {folder} exists and is not a checkpoint written by "
            f"save_checkpoint (no {MANIFEST}): it is left as it is; remove it or save elsewhere."
        )
    if folder.exists() and not mine and _stamp_of(old) is not None:
        raise CheckpointError(  # an empty folder beside the complete previous checkpoint
            f"save_checkpoint: {folder} is empty and {old} holds the last complete checkpoint: "
            "remove the empty folder first; nothing was written."
        )


def _written(what: str) -> None:
    if _after_write is not None:
        _after_write(what)


def _swap(new: Path, folder: Path, old: Path) -> None:
    """``new`` in place of ``folder``: the previous one moved aside first, removed last."""
    if old.exists() and folder.exists():  # a kill after a swap, before its removal
        shutil.rmtree(old)
    if folder.exists():
        if any(folder.iterdir()):
            folder.rename(old)
        else:
            folder.rmdir()
        _fsync_dir(folder.parent)
        _written("moved aside")
    new.rename(folder)
    _fsync_dir(folder.parent)
    _written("in place")
    shutil.rmtree(old, ignore_errors=True)
    for left in folder.parent.glob(f"{folder.name}.tmp-*"):  # of killed saves
        shutil.rmtree(left, ignore_errors=True)
    _written("removed")


def _write_piece(root: Path, name: str, value: Any, stamp: int) -> dict:
    """Write one piece with its stamp, flushed; its manifest entry (kind, files)."""
    if hasattr(value, "dumps"):
        path, kind = root / name, "folder"
        value.dumps(path)
        (path / _STAMP).write_text(json.dumps({"stamp": stamp}))
        files = sorted(p for p in path.rglob("*") if p.is_file())
        for file in files:
            _fsync_file(file)
        for directory in [path, *(p for p in path.rglob("*") if p.is_dir())]:
            _fsync_dir(directory)
    else:
        path, kind = root / f"{name}.pt", "file"
        with open(path, "wb") as file:
            torch.save({"stamp": stamp, "value": value}, file)
            file.flush()
            os.fsync(file.fileno())
        files = [path]
    entry = {"kind": kind, "files": {str(f.relative_to(root)): _digest(f) for f in files}}
    _written(f"piece {name}")
    return entry


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    """Make the names in ``path`` durable (where the system allows opening a folder)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _digest(path: Path) -> dict:
    sha = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            sha.update(block)
    return {"size": path.stat().st_size, "sha256": sha.hexdigest()}


def _stamp_of(folder: Path) -> int | None:
    """The stamp of a complete checkpoint folder (its manifest read), else ``None``."""
    try:
        return int(json.loads((folder / MANIFEST).read_text())["stamp"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _none_found(folder: Path) -> str:
    if (folder / "state.pt").exists() and not (folder / MANIFEST).exists():
        return (
            f"{folder}: no {MANIFEST}: written in place by an earlier version, or a save that "
            "was interrupted; its pieces cannot be told to belong together, so it is not loaded."
        )
    return f"no complete checkpoint at {folder} (nor {_aside(folder).name}, nor a .tmp- folder)."


def _read_manifest(folder: Path) -> dict:
    manifest = json.loads((folder / MANIFEST).read_text())
    if manifest.get("format") != _FORMAT or not isinstance(manifest.get("pieces"), dict):
        raise CheckpointError(
            f"checkpoint {folder}: {MANIFEST} has format {manifest.get('format')!r}; this "
            f"version reads format {_FORMAT}."
        )
    return manifest


def _read_piece(root: Path, name: str, entry: dict, weights_only: bool) -> tuple[Any, Any]:
    """``(stamp, value)`` of one piece; a :class:`CheckpointError` if it cannot be read."""
    try:
        if entry["kind"] == "folder":
            return json.loads((root / name / _STAMP).read_text())["stamp"], root / name
        blob = torch.load(root / f"{name}.pt", weights_only=weights_only)
        return blob["stamp"], blob["value"]
    except Exception as error:  # noqa: BLE001 - every cause is named in the refusal
        sizes = _sizes(root, entry)
        raise CheckpointError(
            f"checkpoint {root}: piece {name!r} cannot be read ({type(error).__name__}: "
            f"{error}){sizes}; nothing was loaded."
        ) from error


def _sizes(root: Path, entry: dict) -> str:
    """The files whose size is not the manifest's, as a clause of a refusal."""
    wrong = []
    for relative, want in entry["files"].items():
        path = root / relative
        size = path.stat().st_size if path.exists() else None
        if size != want["size"]:
            got = "missing" if size is None else f"{size} bytes"
            wrong.append(f"{relative}: {got}, {want['size']} written")
    return f" [{'; '.join(wrong)}]" if wrong else ""


def _check_files(root: Path, name: str, entry: dict) -> None:
    for relative, want in entry["files"].items():
        path = root / relative
        got = _digest(path) if path.exists() else None
        if got == want:
            continue
        what = "is missing"
        if got is not None:
            what = (
                f"has {got['size']} bytes and SHA-256 {got['sha256'][:12]}..., where the save "
                f"wrote {want['size']} bytes, {want['sha256'][:12]}..."
            )
        raise CheckpointError(
            f"checkpoint {root}: {relative} (piece {name!r}) {what} (truncated or changed "
            "since the save); nothing was loaded."
        )
