"""Replay-buffer storages torchrl cannot save, saved.

**Buffers torchrl cannot save.** ``MCAdvantage`` keeps incomplete groups out of storage, so
early in a run (or with large groups) the storage can be empty while the transform holds data.
torchrl's tensor storages refuse to ``dumps`` before their first write ("Cannot save a
non-initialized storage"), which makes ``ReplayBuffer.dumps`` fail before the transform is even
asked for its state. :class:`EmptyStorageCheckpointer` records an empty storage as empty, in the
form torchrl's own checkpointer loads back, and delegates everything else unchanged.
``MCAdvantage`` puts it on the storage of the buffer that inserts through it (at its first
insertion, or when it is appended to the buffer), so no call is needed;
:func:`allow_empty_dumps` does it by hand, e.g. for a buffer that no ``MCAdvantage`` has written
through yet in this process.

torchrl 0.14.1 cannot save a ``ListStorage`` or ``LazyStackStorage`` (the storage of LLM rows of
different lengths) at all: its checkpointer raises ``NotImplementedError``, and the storage's own
``state_dict`` loses the text and the ``Tokens`` classes. :class:`RowsCheckpointer` saves the
rows as they are (``torch.save``, a pickle); the same wrapper puts it on such a storage.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tensordict import TensorDictBase
from torchrl.data import (
    ListStorageCheckpointer,
    StorageCheckpointerBase,
    TensorStorageCheckpointer,
)

from torchrl_grpo._compat import write_empty_tensor_storage

__all__ = ["EmptyStorageCheckpointer", "RowsCheckpointer", "allow_empty_dumps"]

_MARKER = "empty_storage.json"
_ROWS = "rows.pt"


class RowsCheckpointer(StorageCheckpointerBase):
    """Saves a ``ListStorage`` or ``LazyStackStorage``: its rows as they are, in one file.

    torchrl 0.14.1's checkpointer of these storages raises ``NotImplementedError``. This one
    writes the rows (tensordicts with text, ``Tokens`` and ragged tensors; any Python object in a
    ``ListStorage``) with ``torch.save`` into ``rows.pt`` and reads them back into an empty
    storage in their order. The file is a pickle: load only checkpoints you wrote.

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from torchrl.data import LazyStackStorage, ReplayBuffer
        >>> from torchrl_grpo.storages import allow_empty_dumps
        >>> rows = [TensorDict(tokens=torch.arange(n), query=f"q{n}") for n in (3, 5)]
        >>> rb = allow_empty_dumps(ReplayBuffer(storage=LazyStackStorage(8)))
        >>> rb.extend(lazy_stack(rows))
        tensor([0, 1])
        >>> with tempfile.TemporaryDirectory() as path:
        ...     rb.dumps(path)  # torchrl alone: NotImplementedError
        ...     restored = allow_empty_dumps(ReplayBuffer(storage=LazyStackStorage(8)))
        ...     restored.loads(path)
        >>> restored[1]["tokens"], restored[1]["query"]
        (tensor([0, 1, 2, 3, 4]), 'q5')
    """

    def dumps(self, storage, path):
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        rows = storage.get(list(range(len(storage)))) if len(storage) else []
        if isinstance(rows, TensorDictBase):  # LazyStackStorage reads them as one lazy stack
            rows = rows.unbind(0)
        torch.save({"rows": list(rows)}, path / _ROWS)

    def loads(self, storage, path):
        rows = torch.load(Path(path) / _ROWS, weights_only=False)["rows"]
        if len(storage):
            raise RuntimeError(
                f"RowsCheckpointer loads into an empty storage; this one holds {len(storage)} "
                "rows (build a fresh buffer to load a checkpoint into)."
            )
        if rows:
            storage.set(list(range(len(rows))), rows)


class EmptyStorageCheckpointer(StorageCheckpointerBase):
    """A storage checkpointer that can save and restore a storage nothing was written to yet.

    Args:
        inner: the storage's own checkpointer, used whenever the storage holds data.

    Examples:
        >>> import tempfile
        >>> from torchrl.data import LazyTensorStorage
        >>> from torchrl_grpo.storages import EmptyStorageCheckpointer
        >>> storage = LazyTensorStorage(10)
        >>> storage.checkpointer = EmptyStorageCheckpointer(storage.checkpointer)
        >>> with tempfile.TemporaryDirectory() as path:
        ...     storage.dumps(path)  # torchrl's own checkpointer raises here
        ...     storage.loads(path)
        >>> len(storage)
        0
    """

    def __init__(self, inner: StorageCheckpointerBase):
        super().__init__()
        if isinstance(inner, ListStorageCheckpointer):  # torchrl's raises NotImplementedError
            inner = RowsCheckpointer()
        self.inner = inner

    def register_save_hook(self, hook):
        self.inner.register_save_hook(hook)

    def register_load_hook(self, hook):
        self.inner.register_load_hook(hook)

    def dumps(self, storage, path):
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        marker = path / _MARKER
        rows = isinstance(self.inner, RowsCheckpointer)
        if not getattr(storage, "initialized", True) or (not len(storage) and not rows):
            # nothing written yet, or emptied (torchrl's own would warn, its cursor unset)
            write_empty_tensor_storage(path)  # what torchrl's own checkpointer loads as empty
            marker.write_text(json.dumps({"empty": True}))
            return
        marker.unlink(missing_ok=True)
        self.inner.dumps(storage, path)

    def loads(self, storage, path):
        path = Path(path)
        if (path / _MARKER).exists():  # torchrl's reader of the empty record: length 0
            TensorStorageCheckpointer().loads(storage, path)
            return
        self.inner.loads(storage, path)


def allow_empty_dumps(replay_buffer):
    """Let ``replay_buffer.dumps`` work while its storage is still empty, and on list storages.

    Wraps the storage's checkpointer in :class:`EmptyStorageCheckpointer` (once), which saves a
    ``ListStorage`` or ``LazyStackStorage`` with :class:`RowsCheckpointer`.
    ``MCAdvantage`` does this itself for the buffer it is appended to or writes through; call it
    for a buffer saved before any insertion reached it in this process. A buffer built as usual
    loads the result without it.

    Args:
        replay_buffer: a torchrl ``ReplayBuffer``.

    Returns:
        The same buffer.

    Examples:
        >>> import tempfile
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> from torchrl_grpo.storages import allow_empty_dumps
        >>> rb = allow_empty_dumps(ReplayBuffer(storage=LazyTensorStorage(10)))
        >>> with tempfile.TemporaryDirectory() as path:
        ...     rb.dumps(path)  # torchrl alone raises: nothing was ever written
        ...     restored = ReplayBuffer(storage=LazyTensorStorage(10))
        ...     restored.loads(path)  # a plain buffer reads it back
        >>> len(restored)
        0
    """
    storage = replay_buffer.storage
    if not isinstance(storage.checkpointer, EmptyStorageCheckpointer):
        storage.checkpointer = EmptyStorageCheckpointer(storage.checkpointer)
    return replay_buffer
