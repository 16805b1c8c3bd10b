"""Group ids: prompts (strings) or tensor ids (a reset seed, an index), decided once, when read.

:class:`TensorIds` holds one row of ``k`` values per trajectory, compared by value;
:class:`PromptIds` one string per trajectory. Both offer what grouping needs (a dense integer
code per trajectory, equal iff the ids are; counts per group; selection and concatenation), so
the steps that group trajectories never ask which kind they hold.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchrl_grpo._segments import group_codes, lexicographic_codes

__all__ = ["GroupIds", "PromptIds", "TensorIds"]


class GroupIds:
    """One group id per trajectory, in arrival order; ``len`` is their number."""

    __slots__ = ("values",)
    kind = ""

    def __init__(self, values):
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def codes(
        self, before: GroupIds | None = None, bounds: tuple[int, int] | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """A dense integer code for each id of ``before`` (pending trajectories) then of these
        (incoming ones), equal iff the ids are; and the stable order of the trajectories by code
        (grouped, arrival order within a group) when finding the codes sorted them, else
        ``None``. ``bounds``: ``(low, high)`` known to hold every integer id of both (read with
        the input), so that nothing is read here."""
        raise NotImplementedError


class TensorIds(GroupIds):
    """``(n, k)`` tensor ids on the CPU; ``bounds``, ``(low, high)`` known on the host to hold
    every (integer) id, or ``None``: what codes them through a table without reading their
    range back (:func:`~torchrl_grpo.mcadvantage.read.read_insertion` reads it with the input).
    A selection keeps them (they then hold its ids loosely)."""

    __slots__ = ("bounds",)
    kind = "tensors"

    def __init__(self, values, bounds: tuple[int, int] | None = None):
        self.values, self.bounds = values, bounds

    def with_bounds(self, bounds: tuple[int, int] | None) -> TensorIds:
        return TensorIds(self.values, bounds)

    @property
    def width(self) -> int:
        return self.values.shape[1]

    @property
    def family(self) -> str:
        """The kind of number: ``"bool"``, ``"integer"``, ``"floating"`` or ``"complex"``; ids of
        one family compare by exact value in their common dtype."""
        dtype = self.values.dtype
        if dtype == torch.bool:
            return "bool"
        if dtype.is_complex:
            return "complex"
        return "floating" if dtype.is_floating_point else "integer"

    def cat(self, other: TensorIds) -> TensorIds:
        """These ids then ``other``'s, in their common dtype (ids of one family: nothing is
        rounded)."""
        held, incoming = self.values, other.values
        if held.dtype != incoming.dtype:
            dtype = torch.promote_types(held.dtype, incoming.dtype)
            held, incoming = held.to(dtype), incoming.to(dtype)
        return TensorIds(torch.cat([held, incoming]), _union(self.bounds, other.bounds))

    def select(self, index: Tensor) -> TensorIds:
        return TensorIds(self.values.index_select(0, index), self.bounds)

    def codes(
        self, before: GroupIds | None = None, bounds: tuple[int, int] | None = None
    ) -> tuple[Tensor, Tensor | None]:
        keys = self.values
        if bounds is None:  # those the ids know, if they all do
            bounds = self.bounds
            if before is not None and len(before):
                bounds = _union(bounds, getattr(before, "bounds", None))
        if before is not None and len(before):
            pending = before.values
            keys = torch.cat([pending, keys.to(torch.promote_types(pending.dtype, keys.dtype))])
        if keys.shape[1] > 1:
            if keys.dtype.is_complex:  # no sort
                return torch.unique(keys, dim=0, return_inverse=True)[1], None
            return lexicographic_codes(keys), None
        return group_codes(keys.reshape(-1), bounds=bounds)

    def same_as(self, one: TensorIds) -> Tensor:
        """``(n,)`` bool: which of these ids equal the one id of ``one``."""
        same = self.values == one.values  # (n, k)
        if same.shape[1] > 1:
            same = same.all(1, keepdim=True)
        return same.view(-1)

    def counts(self) -> list[int]:
        """Trajectories per distinct id."""
        if not len(self):
            return []
        return torch.bincount(self.codes()[0]).tolist()  # unique(dim=0) is 10x slower

    def python(self) -> list:
        """Each id as torchrl's queues key it: a number, or a tuple for several values."""
        return [row[0] if len(row) == 1 else tuple(row) for row in self.values.tolist()]

    def to_plain(self) -> Tensor:
        return self.values


class PromptIds(GroupIds):
    """One string per trajectory."""

    __slots__ = ()
    kind = "strings"

    def cat(self, other: PromptIds) -> PromptIds:
        return PromptIds(self.values + other.values)

    def select(self, index: Tensor) -> PromptIds:
        return PromptIds([self.values[i] for i in index.tolist()])

    def codes(
        self, before: GroupIds | None = None, bounds: tuple[int, int] | None = None
    ) -> tuple[Tensor, None]:
        table: dict = {}
        everything = (before.values if before is not None else []) + self.values
        codes = [table.setdefault(k, len(table)) for k in everything]
        return torch.tensor(codes, dtype=torch.long), None

    def same_as(self, one: PromptIds) -> Tensor:
        prompt = one.values[0]
        return torch.tensor([k == prompt for k in self.values], dtype=torch.bool)

    def counts(self) -> list[int]:
        counts: dict = {}
        for key in self.values:
            counts[key] = counts.get(key, 0) + 1
        return list(counts.values())

    def python(self) -> list:
        return list(self.values)

    def to_plain(self) -> list:
        return list(self.values)


def _union(one: tuple | None, other: tuple | None) -> tuple[int, int] | None:
    """Bounds holding both (``None`` unless both are known)."""
    if one is None or other is None:
        return None
    return min(one[0], other[0]), max(one[1], other[1])


def ids_from_plain(plain) -> GroupIds | None:
    """The ids a checkpoint saved (:meth:`GroupIds.to_plain`); ``None`` for none."""
    if plain is None:
        return None
    if isinstance(plain, list):
        return PromptIds(list(plain))
    return TensorIds(plain.cpu())
