"""Checkpoints of a replay buffer whose groups are all still pending.

``MCAdvantage`` keeps incomplete groups out of storage, so early in a run (or with large groups)
the storage can be empty while the transform holds data. torchrl's tensor storages refuse to
``dumps`` before their first write ("Cannot save a non-initialized storage"), which makes
``ReplayBuffer.dumps`` fail before the transform is even asked for its state.
:func:`allow_empty_dumps` wraps the storage's checkpointer so that an empty storage is recorded as
empty, and everything else is delegated unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

from torchrl.data.replay_buffers.checkpointers import StorageCheckpointerBase

__all__ = ["EmptyStorageCheckpointer", "allow_empty_dumps"]

_MARKER = "empty_storage.json"


class EmptyStorageCheckpointer(StorageCheckpointerBase):
    """A storage checkpointer that can save and restore a storage nothing was written to yet.

    Args:
        inner: the storage's own checkpointer, used whenever the storage holds data.

    Examples:
        >>> import tempfile
        >>> from torchrl.data import LazyTensorStorage
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
        self.inner = inner

    def register_save_hook(self, hook):
        self.inner.register_save_hook(hook)

    def register_load_hook(self, hook):
        self.inner.register_load_hook(hook)

    def dumps(self, storage, path):
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        marker = path / _MARKER
        if not getattr(storage, "initialized", True):
            marker.write_text(json.dumps({"empty": True}))
            return
        marker.unlink(missing_ok=True)
        self.inner.dumps(storage, path)

    def loads(self, storage, path):
        if (Path(path) / _MARKER).exists():
            if len(storage):
                storage._empty()
            return
        self.inner.loads(storage, path)


def allow_empty_dumps(replay_buffer):
    """Let ``replay_buffer.dumps`` / ``loads`` work while its storage is still empty.

    Wraps the storage's checkpointer in :class:`EmptyStorageCheckpointer` (once). Call it on the
    buffer you save and on the buffer you load into.

    Args:
        replay_buffer: a torchrl ``ReplayBuffer``.

    Returns:
        The same buffer.

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> from torchrl_grpo import MCAdvantage
        >>> def buffer():
        ...     transform = MCAdvantage(grpo_size=2, prompt_key="seed")
        ...     rb = ReplayBuffer(storage=LazyTensorStorage(10))
        ...     return allow_empty_dumps(rb.append_transform(transform)), transform
        >>> step = TensorDict(seed=torch.tensor([3]), next=TensorDict(
        ...     reward=torch.ones(1, 1), done=torch.ones(1, 1, dtype=torch.bool), batch_size=[1]
        ... ), batch_size=[1])
        >>> rb, transform = buffer()
        >>> _ = rb.extend(step)  # half a group: the storage is still empty
        >>> with tempfile.TemporaryDirectory() as path:
        ...     rb.dumps(path)
        ...     restored, restored_transform = buffer()
        ...     restored.loads(path)
        >>> len(restored), restored_transform.queued_trajectories
        (0, 1)
    """
    storage = replay_buffer.storage
    if not isinstance(storage.checkpointer, EmptyStorageCheckpointer):
        storage.checkpointer = EmptyStorageCheckpointer(storage.checkpointer)
    return replay_buffer
