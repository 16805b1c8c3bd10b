"""A replay buffer with this package's transform, built as a user builds one (the checkpoint and
the storage tests save and restore it)."""

from __future__ import annotations

from torchrl.data import LazyTensorStorage, ReplayBuffer

from torchrl_grpo import MCAdvantage


def make_buffer(storage=LazyTensorStorage, through_constructor=False, **kw):
    """A buffer built as a user builds one: no call other than torchrl's."""
    transform = MCAdvantage(4, prompt_key="seed", trajectory_return="sum", **kw)
    if through_constructor:
        return ReplayBuffer(storage=storage(1000), transform=transform), transform
    return ReplayBuffer(storage=storage(1000)).append_transform(transform), transform
