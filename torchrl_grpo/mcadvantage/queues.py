"""``MCAdvantage.queues``: the pending groups, as a live mapping ``group id -> trajectories``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping

from tensordict import TensorDictBase

__all__ = ["PendingGroups"]


class PendingGroups(MutableMapping):
    """The pending groups of an :class:`~torchrl_grpo.MCAdvantage`, by group id: a live view.

    What torchrl's ``MCAdvantage.queues`` is used for works on it, under the transform's lock:
    ``len``, iteration (group ids, in order of first arrival), ``group in queues``,
    ``queues[group]`` (the group's trajectory TensorDicts in arrival order, as a tuple), and
    dropping pending trajectories with ``queues.clear()``, ``del queues[group]`` or
    ``queues.pop(group)`` (statistics are kept, as in torchrl). Trajectories are added by
    inserting them (``rb.extend``): setting an item raises ``TypeError``, and so does changing
    the tuple of a group.

    Group ids are as in torchrl: the prompt string, a Python number for a one-element tensor id,
    a tuple for a larger one.

    Args:
        replica: returns where the transform's state lives now (its own process, or the owner
            process of a shared transform).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_grpo import MCAdvantage
        >>> t = MCAdvantage(grpo_size=2, prompt_key="seed")
        >>> for seed in (3, 5):
        ...     _ = t.inv(TensorDict(seed=torch.tensor([seed]), next=TensorDict(
        ...         reward=torch.ones(1, 1), done=torch.ones(1, 1, dtype=torch.bool),
        ...         batch_size=[1]), batch_size=[1]))
        >>> list(t.queues), len(t.queues[5])
        ([3, 5], 1)
        >>> del t.queues[3]
        >>> t.queued_groups
        1
        >>> t.queues.clear()
        >>> t.queued_trajectories
        0
    """

    def __init__(self, replica: Callable):
        self._replica = replica

    def __getitem__(self, group) -> tuple[TensorDictBase, ...]:
        return self._replica().trajectories(group)

    def __contains__(self, group) -> bool:
        return group in self._replica().group_ids()

    def __iter__(self) -> Iterator:
        return iter(dict.fromkeys(self._replica().group_ids()))

    def __len__(self) -> int:
        return self._replica().stats()["queued_groups"]

    def __delitem__(self, group) -> None:
        self._replica().drop_group(group)

    def __setitem__(self, group, trajectories) -> None:
        raise TypeError(
            "MCAdvantage.queues is filled by inserting trajectories (rb.extend / transform.inv); "
            "it can be read, and emptied with clear(), del or pop()."
        )

    def pop(self, group, *default):
        """Remove a group and return its trajectories (``default`` if it is not pending)."""
        return self._replica().pop_group(group, *default)

    def clear(self) -> None:
        """Drop every pending trajectory and unfinished tail (as
        :meth:`MCAdvantage.clear_queues <torchrl_grpo.MCAdvantage.clear_queues>`)."""
        self._replica().clear()

    def __repr__(self) -> str:
        sizes: dict = {}
        for key in self._replica().group_ids():
            sizes[key] = sizes.get(key, 0) + 1
        return f"PendingGroups({sizes})"
