"""The trajectories held back until their group is complete: a store, no advantage math.

What an insertion leaves pending is kept as it came (a chunk of
:mod:`~torchrl_grpo.mcadvantage.store`, never copied), each pending trajectory a span of it, in
arrival order, with its group id and its returns. Every function returns a new
:class:`~torchrl_grpo.mcadvantage.records.Pending`; none changes the one it is given.

Trajectories are numbered pending first (``0 .. Q-1``) then incoming (``Q .. Q+n-1``), as the
grouping step numbers them.
"""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDictBase
from torch import Tensor

from torchrl_grpo.mcadvantage import returns as returns_
from torchrl_grpo.mcadvantage.ids import GroupIds
from torchrl_grpo.mcadvantage.records import (
    NO_VERSION,
    QUEUED_AT,
    VERSION,
    Insertion,
    Pending,
    Returns,
)
from torchrl_grpo.mcadvantage.steps import Steps
from torchrl_grpo.mcadvantage.store import CHUNK, LENGTH, OFFSET, ranges

__all__ = ["append", "drop", "first_arrivals", "gather", "remaining", "trajectory"]

_NO_CHUNKS = torch.zeros(0, dtype=torch.long)


def gather(pending: Pending, batch: Insertion | None, members: Tensor) -> Steps:
    """All steps of trajectories ``members`` (increasing numbers of pending ++ incoming), in
    order: the insertion itself when all of it is taken and nothing is pending, else one
    concatenation of contiguous pieces (views where they can be)."""
    q = pending.num_pending
    if q == 0 and batch is not None and members.numel() == batch.num_trajectories:
        return batch.steps  # all of the insertion, as it came: no copy
    from_pending = int((members < q).sum())  # members are increasing: pending ones first
    parts = pending.chunks.parts(pending.spans[members[:from_pending]]) if from_pending else []
    incoming = members[from_pending:] - q
    if incoming.numel() and incoming.numel() == batch.num_trajectories:
        parts.append(batch.steps)  # all of the insertion, as it came
    elif incoming.numel():
        parts.append(batch.steps.take(ranges(batch.starts[incoming], batch.lengths[incoming])))
    return Steps.cat(parts)


def trajectory(pending: Pending, batch: Insertion | None, j: int) -> TensorDictBase:
    """Trajectory ``j`` of pending ++ incoming, as one TensorDict (a lazy stack if ragged)."""
    return gather(pending, batch, torch.tensor([j])).output()


def append(
    pending: Pending,
    steps: Steps,
    *,
    offset: Tensor,
    lengths: Tensor,
    ids: GroupIds,
    returns: Returns,
    queued_at: int,
    versions: Tensor | None = None,
) -> Pending:
    """``pending`` with the trajectories of ``steps`` (a new chunk) queued after the others:
    trajectory ``i`` is steps ``offset[i] : offset[i] + lengths[i]``, sampled by policy version
    ``versions[i]`` (``None``: unknown)."""
    number = len(pending.chunks.steps)
    if lengths.shape[0] == 1:  # one trajectory: its span from Python ints (numpy builds a
        # small tensor from a literal a few times faster than torch.tensor does)
        version = NO_VERSION if versions is None else int(versions)
        row = [[number, int(offset), int(lengths), queued_at, version]]
        span = torch.from_numpy(np.array(row, dtype=np.int64))
    else:
        span = torch.empty(lengths.shape[0], 5, dtype=torch.long)
        for column, value in ((CHUNK, number), (OFFSET, offset), (LENGTH, lengths)):
            span[:, column] = value
        span[:, QUEUED_AT] = queued_at
        span[:, VERSION] = NO_VERSION if versions is None else versions
    held = pending.ids is not None and pending.num_pending
    return Pending(
        chunks=pending.chunks.add(steps),
        spans=torch.cat([pending.spans, span]),
        ids=pending.ids.cat(ids) if held else ids,
        returns=returns_.concat(pending.returns, returns) if held else returns,
        ragged=pending.ragged,
    )


def drop(pending: Pending, keep: Tensor) -> Pending:
    """``pending`` without the trajectories where ``keep`` is False; the chunks left with none
    are released (see :meth:`~torchrl_grpo.mcadvantage.store.Chunks.tidy`)."""
    kept, dropped = _without(pending, keep)
    return _tidy(kept, dropped)


def _without(pending: Pending, keep: Tensor) -> tuple[Pending, Tensor]:
    """``pending`` without the trajectories where ``keep`` is False, their chunks still held,
    and the chunk numbers of those dropped."""
    kept = keep.nonzero().squeeze(1)  # (Q',) the trajectories that stay
    exact = pending.returns.torchrl
    without = Pending(
        chunks=pending.chunks,
        spans=pending.spans.index_select(0, kept),
        ids=pending.ids.select(kept),
        returns=Returns(
            pending.returns.value.index_select(0, kept),
            None if exact is None else exact.index_select(0, kept),
        ),
        ragged=pending.ragged,
    )
    return without, pending.spans[~keep, CHUNK]


def _tidy(pending: Pending, dropped: Tensor | None) -> Pending:
    chunks, spans = pending.chunks.tidy(pending.spans, dropped)
    return pending._replace(chunks=chunks, spans=spans)


def remaining(
    pending: Pending, batch: Insertion, consumed: Tensor | None, incoming: Returns, clock: int
) -> Pending:
    """What is pending after an insertion: the pending and incoming trajectories that no
    released group consumed.

    Args:
        pending: what was held before the insertion.
        batch: the insertion.
        consumed: ``(Q + n,)`` bool, the trajectories that leave (released or given up);
            ``None``: none does.
        incoming: the incoming trajectories' returns.
        clock: the insertion's number (the incoming trajectories' ``QUEUED_AT``).
    """
    q = pending.num_pending
    ragged = pending.ragged or batch.steps.ragged
    if ragged != pending.ragged:
        pending = pending._replace(ragged=ragged)
    if consumed is None:  # everything stays: queue the insertion as it came, no copy
        return _queue(pending, batch, None, incoming, clock)
    if q == 0 and bool(consumed.all()):  # everything released: nothing left to hold
        return Pending(ragged=ragged)
    keep_pending, keep_incoming = ~consumed[:q], ~consumed[q:]
    dropped = _NO_CHUNKS
    if not bool(keep_pending.all()):
        pending, dropped = _without(pending, keep_pending)
    if bool(keep_incoming.any()):
        pending = _queue(pending, batch, keep_incoming, incoming, clock)
    return _tidy(pending, dropped)


def _queue(
    pending: Pending, batch: Insertion, keep: Tensor | None, incoming: Returns, clock: int
) -> Pending:
    """``pending`` with the incoming trajectories ``keep`` (all for ``None``) queued: the
    insertion as it came when all stay, else one take of theirs."""
    if keep is None or bool(keep.all()):
        return append(
            pending,
            batch.steps,
            offset=batch.starts,
            lengths=batch.lengths,
            ids=batch.group_ids,
            returns=incoming,
            queued_at=clock,
            versions=batch.versions,
        )
    lengths = batch.lengths[keep]
    return append(
        pending,
        batch.steps.take(ranges(batch.starts[keep], lengths)),
        offset=torch.cumsum(lengths, 0) - lengths,
        lengths=lengths,
        ids=batch.group_ids.select(keep.nonzero().squeeze(1)),
        returns=returns_.take(incoming, keep),
        queued_at=clock,
        versions=None if batch.versions is None else batch.versions[keep],
    )


def first_arrivals(pending: Pending, codes: Tensor, num_groups: int, clock: int) -> Tensor:
    """``(G,)`` the insertion that queued each group's first pending trajectory (``clock`` for
    a group with none pending): where its age starts.

    Args:
        codes: ``(Q,)`` the group code of each pending trajectory, in ``[0, num_groups)``.
        clock: the insertions so far, the current one included.
    """
    first = torch.full((num_groups,), clock, dtype=torch.long)
    return first.scatter_reduce(0, codes, pending.spans[:, QUEUED_AT], reduce="amin")
