"""Which trajectory ids have ended (or been given up), for trajectories that cross insertions."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ENDED", "GIVEN_UP", "RUNNING", "IdRegistry"]

RUNNING, ENDED, GIVEN_UP = 0, 1, 2  # what the registry knows of an id


class IdRegistry:
    """Which trajectory ids have ended (or been given up): one byte per id, grown by doubling.

    An id is marked once its trajectory is released or evicted, and marked running again only
    when a collector that started again reuses it for a trajectory starting at step 0.
    Successive states share it (marking, the only write, happens when an insertion commits), so
    that keeping it costs nothing per insertion.

    Examples:
        >>> import torch
        >>> registry = IdRegistry()
        >>> registry.mark(torch.tensor([2]), ENDED)
        >>> registry.status(torch.tensor([0, 2, 9])).tolist() == [RUNNING, ENDED, RUNNING]
        True
    """

    def __init__(self, marks: Tensor | None = None):
        self.marks = torch.zeros(0, dtype=torch.uint8) if marks is None else marks

    def status(self, ids: Tensor) -> Tensor:
        """``(n,)`` uint8: ``RUNNING`` (never ended, or never seen), ``ENDED`` or ``GIVEN_UP``."""
        size = self.marks.shape[0]
        if not size:
            return torch.zeros(ids.shape, dtype=torch.uint8)
        marked = self.marks.index_select(0, ids.clamp(0, size - 1).reshape(-1)).view(ids.shape)
        return marked.masked_fill((ids < 0) | (ids >= size), RUNNING)

    def mark(self, ids: Tensor, value: int, top: int | None = None) -> None:
        """Record ``value`` for ``ids`` (ids that ended, or were given up); ``top``, one more
        than the largest of them, when the caller read it (else it is read here)."""
        if ids.numel() == 0:
            return
        top = int(ids.max()) + 1 if top is None else top
        if top > self.marks.shape[0]:
            grown = torch.zeros(max(top, 2 * self.marks.shape[0]), dtype=torch.uint8)
            grown[: self.marks.shape[0]] = self.marks
            self.marks = grown
        self.marks[ids] = value
