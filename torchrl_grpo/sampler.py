"""Minibatches of whole groups: each stored row once per epoch, a group's rows together.

A GRPO step trains on its batch for a few epochs of minibatches. torchrl's
``SamplerWithoutReplacement`` draws rows independently, so the ``G`` completions of a prompt
land in different minibatches, and a scorer that computes each shared prompt once
(``LeanTransformersWrapper``'s shared-prefix scoring) computes it again in every minibatch that
holds one of them. torchrl's ``PromptGroupSampler`` keeps groups together but draws with
replacement (RePO's replay), so an epoch does not see every row once. :class:`GroupSampler`
does both: an epoch is a shuffled order of the stored groups, packed whole into minibatches of
at most ``batch_size`` rows.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tensordict import NestedKey, is_tensor_collection
from torchrl.data.replay_buffers.samplers import Sampler

__all__ = ["GroupSampler", "group_minibatches"]


def _hashable(value) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return json.dumps(value) if isinstance(value, list) else value


def group_minibatches(
    groups: list, batch_size: int, *, shuffle: bool = True, generator=None
) -> list[torch.Tensor]:
    """One epoch of minibatches of whole groups: row indices, each row once.

    The rows with equal ``groups[i]`` form a group; the groups are shuffled (or kept in the
    order they first appear) and packed whole, in that order, into minibatches of at most
    ``batch_size`` rows. A group larger than ``batch_size`` is cut into consecutive minibatches.

    Args:
        groups (list): each row's group (ints, strings, tensors or lists).
        batch_size (int): most rows per minibatch.

    Keyword Args:
        shuffle (bool): shuffle the groups. Defaults to ``True``.
        generator (torch.Generator, optional): for the shuffle.

    Returns:
        list[torch.Tensor]: the row indices of each minibatch.

    Examples:
        >>> from torchrl_grpo.sampler import group_minibatches
        >>> [b.tolist() for b in group_minibatches([0, 1, 0, 2, 1, 2, 0], 4, shuffle=False)]
        [[0, 2, 6], [1, 4, 3, 5]]
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
    rows: dict[Any, list[int]] = {}
    for position, value in enumerate(groups):
        rows.setdefault(_hashable(value), []).append(position)
    ordered = [torch.tensor(r, dtype=torch.long) for r in rows.values()]
    if shuffle:
        ordered = [ordered[i] for i in torch.randperm(len(ordered), generator=generator).tolist()]
    batches, current = [], []
    for group in ordered:
        if current and sum(map(len, current)) + len(group) > batch_size:
            batches.append(torch.cat(current))
            current = []
        current.append(group)
        while sum(map(len, current)) > batch_size:  # a group larger than a minibatch
            flat = torch.cat(current)
            batches.append(flat[:batch_size])
            current = [flat[batch_size:]]
    if current:
        batches.append(torch.cat(current))
    return batches


class GroupSampler(Sampler):
    """Each stored row once per epoch; the rows of a group in the same minibatch.

    The groups are the stored rows with equal values at ``group_key`` (a prompt id, a task id,
    the prompt text). An epoch shuffles the groups and packs them whole, in that order, into
    minibatches of at most ``batch_size`` rows: a minibatch holds fewer rows when the next
    group does not fit (with groups of ``G`` rows and a ``batch_size`` that is a multiple of
    ``G``, every minibatch is full). A group larger than ``batch_size`` is cut into consecutive
    minibatches, with one warning. When the epoch's last minibatch is drawn :attr:`ran_out` is
    set (iterating the buffer stops there, as with torchrl's ``SamplerWithoutReplacement``) and
    the next draw starts a new epoch; adding data to the buffer starts a new one too.

    Args:
        group_key (NestedKey): the stored entry naming each row's group. Defaults to
            ``"query"`` (torchrl's ``PromptGroupSampler`` default).

    Keyword Args:
        shuffle (bool): shuffle the groups each epoch (the buffer's generator, if it has one).
            ``False`` keeps the order in which the groups were first stored. Defaults to ``True``.

    Raises:
        TypeError: the storage's rows are not tensor collections (torchrl's ``ListStorage``).
        KeyError: the stored rows have no ``group_key`` (the message names it).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyStackStorage, ReplayBuffer
        >>> rb = ReplayBuffer(storage=LazyStackStorage(12), batch_size=8,
        ...                   sampler=GroupSampler("prompt_id"))
        >>> _ = rb.extend(TensorDict(prompt_id=torch.arange(12) // 4, row=torch.arange(12),
        ...                          batch_size=[12]))
        >>> epoch = [batch["prompt_id"].tolist() for batch in rb]
        >>> sorted(row for batch in epoch for row in batch) == sorted(rb[:]["prompt_id"].tolist())
        True
        >>> all(len(set(batch)) * 4 == len(batch) for batch in epoch)  # whole groups only
        True
    """

    def __init__(self, group_key: NestedKey = "query", *, shuffle: bool = True):
        self.group_key = group_key
        self.shuffle = bool(shuffle)
        self._batches: list[torch.Tensor] = []
        self._ran_out = False
        self._warned = False

    @property
    def ran_out(self) -> bool:
        """Whether the epoch's last minibatch has been drawn."""
        return self._ran_out

    @ran_out.setter
    def ran_out(self, value: bool) -> None:
        self._ran_out = bool(value)

    def group_values(self, storage) -> list:
        """Each stored row's ``group_key`` value (a ragged entry, such as
        ``("tokens", "prompt")`` in a ``LazyStackStorage``, one tensor per row).

        Args:
            storage: a torchrl storage whose slices are tensor collections.

        Returns:
            list: one value per stored row.
        """
        data = storage[:]
        if not is_tensor_collection(data):
            raise TypeError(
                f"GroupSampler reads {self.group_key!r} from the stored rows; this storage's "
                f"slices are {type(data).__name__}, not tensor collections (use LazyStackStorage "
                "or LazyTensorStorage)."
            )
        try:
            values = data.get(self.group_key, None)
        except RuntimeError:  # ragged rows of a lazy stack
            values = data.get(self.group_key, None, as_list=True)
        if values is None:
            raise KeyError(
                f"GroupSampler: the stored rows have no {self.group_key!r}; keep the group's "
                f"entry in the buffer (stored keys: {sorted(map(str, data.keys(True, True)))})."
            )
        return values.tolist() if hasattr(values, "tolist") else list(values)

    def _epoch(self, storage, batch_size: int) -> list[torch.Tensor]:
        values = self.group_values(storage)
        largest = max(Counter(map(_hashable, values)).values())
        if largest > batch_size and not self._warned:
            warnings.warn(
                f"GroupSampler: a group of {largest} rows is larger than "
                f"batch_size={batch_size}; its rows span consecutive minibatches (raise "
                "batch_size to keep it whole).",
                stacklevel=3,
            )
            self._warned = True
        return group_minibatches(values, batch_size, shuffle=self.shuffle, generator=self._rng)

    def sample(self, storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        """The next minibatch of the epoch (a new epoch when the last one ran out).

        Args:
            storage: the buffer's storage.
            batch_size (int): most rows per minibatch.

        Returns:
            tuple[torch.Tensor, dict]: the stored rows' indices and an empty info dict.
        """
        if len(storage) == 0:
            raise RuntimeError("GroupSampler: the storage is empty; nothing to sample.")
        if not self._batches:
            self._batches = self._epoch(storage, batch_size)
        index = self._batches.pop(0)
        self._ran_out = not self._batches
        return index, {}

    def extend(self, index: torch.Tensor) -> None:
        """New rows: the next draw starts a new epoch over every stored row."""
        self._batches = []

    def add(self, index: int) -> None:
        """A new row: the next draw starts a new epoch over every stored row."""
        self._batches = []

    def _empty(self) -> None:
        self._batches, self._ran_out = [], False

    def state_dict(self) -> dict[str, Any]:
        """The minibatches left in the epoch."""
        return {"batches": [b.tolist() for b in self._batches], "ran_out": self._ran_out}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s epoch."""
        self._batches = [torch.tensor(b, dtype=torch.long) for b in state_dict["batches"]]
        self._ran_out = bool(state_dict["ran_out"])

    def dumps(self, path) -> None:
        """Write :meth:`state_dict` as ``sampler_metadata.json`` under ``path``."""
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "sampler_metadata.json").write_text(json.dumps(self.state_dict()))

    def loads(self, path) -> None:
        """Read what :meth:`dumps` wrote."""
        self.load_state_dict(json.loads((Path(path) / "sampler_metadata.json").read_text()))

    def __repr__(self) -> str:
        return f"GroupSampler(group_key={self.group_key!r}, shuffle={self.shuffle})"
