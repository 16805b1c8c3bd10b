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
from torchrl_grpo.mcadvantage.host import read_ints
from torchrl_grpo.mcadvantage.ids import GroupIds
from torchrl_grpo.mcadvantage.records import (
    NO_VERSION,
    QUEUED_AT,
    VERSION,
    Insertion,
    Pending,
    Returns,
    Sizes,
)
from torchrl_grpo.mcadvantage.steps import Steps
from torchrl_grpo.mcadvantage.store import CHUNK, LENGTH, OFFSET, ranges

__all__ = [
    "append",
    "drop",
    "first_arrivals",
    "gather",
    "remaining",
    "taking",
    "trajectory",
]

_NO_CHUNKS = torch.zeros(0, dtype=torch.long)


def gather(
    pending: Pending, batch: Insertion | None, members: Tensor, sizes: Sizes | None = None
) -> Steps:
    """All steps of trajectories ``members`` (increasing numbers of pending ++ incoming), in
    order: the insertion itself when all of it is taken and nothing is pending, else one
    concatenation of contiguous pieces (views where they can be). ``sizes``: what the members
    take, read with them (else read here)."""
    q = pending.num_pending
    if q == 0 and batch is not None and members.numel() == batch.num_trajectories:
        return batch.steps  # all of the insertion, as it came: no copy
    if sizes is None:
        [from_pending] = read_ints((members < q).sum())  # increasing: pending ones first
    else:
        from_pending = sizes.pending
    parts = []
    if from_pending:
        taken = None if sizes is None else sizes.taken
        parts = pending.chunks.parts(pending.spans[members[:from_pending]], taken)
    incoming = members[from_pending:] - q
    if incoming.numel() and incoming.numel() == batch.num_trajectories:
        parts.append(batch.steps)  # all of the insertion, as it came
    elif incoming.numel():
        total = None if sizes is None else sizes.incoming_steps
        index = ranges(batch.starts[incoming], batch.lengths[incoming], total)
        parts.append(batch.steps.take(index))
    return Steps.cat(parts)


def trajectory(pending: Pending, batch: Insertion | None, j: int) -> TensorDictBase:
    """Trajectory ``j`` of pending ++ incoming, as one TensorDict (a lazy stack if ragged)."""
    return gather(pending, batch, torch.tensor([j])).output()


def append(
    pending: Pending,
    steps: Steps,
    *,
    offset: Tensor | int,
    lengths: Tensor | int,
    ids: GroupIds,
    returns: Returns,
    queued_at: int,
    versions: Tensor | None = None,
) -> Pending:
    """``pending`` with the trajectories of ``steps`` (a new chunk) queued after the others:
    trajectory ``i`` is steps ``offset[i] : offset[i] + lengths[i]``, sampled by policy version
    ``versions[i]`` (``None``: unknown). One trajectory's ``offset`` and ``lengths`` may be
    Python ints."""
    number = len(pending.chunks.steps)
    if isinstance(lengths, int) and versions is None:  # one trajectory: its span from Python
        # ints (numpy builds a small tensor from a literal a few times faster than torch does)
        row = [[number, offset, lengths, queued_at, NO_VERSION]]
        span = torch.from_numpy(np.array(row, dtype=np.int64))
    else:
        lengths, offset = torch.as_tensor(lengths).reshape(-1), torch.as_tensor(offset)
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


def _without(pending: Pending, keep: Tensor, kept: int | None = None):
    """``pending`` without the trajectories where ``keep`` is False, their chunks still held,
    and the chunk numbers of those dropped (``None`` when ``kept``, how many stay, is given:
    the caller then knows which chunks emptied)."""
    if kept is None:
        index = keep.nonzero().squeeze(1)  # (Q',) the trajectories that stay
    else:
        index = torch.nonzero_static(keep, size=kept).squeeze(1)
    exact = pending.returns.torchrl
    without = Pending(
        chunks=pending.chunks,
        spans=pending.spans.index_select(0, index),
        ids=pending.ids.select(index),
        returns=Returns(
            pending.returns.value.index_select(0, index),
            None if exact is None else exact.index_select(0, index),
        ),
        ragged=pending.ragged,
    )
    return without, None if kept is not None else pending.spans[~keep, CHUNK]


def _tidy(pending: Pending, dropped: Tensor | None, **known) -> Pending:
    chunks, spans = pending.chunks.tidy(pending.spans, dropped, **known)
    return pending._replace(chunks=chunks, spans=spans)


def remaining(
    pending: Pending,
    batch: Insertion,
    consumed: Tensor | None,
    incoming: Returns,
    clock: int,
    sizes: Sizes | None = None,
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
        sizes: how many leave, read with ``consumed`` (else read here).
    """
    ragged = pending.ragged or batch.steps.ragged
    if ragged != pending.ragged:
        pending = pending._replace(ragged=ragged)
    if consumed is None:  # everything stays: queue the insertion as it came, no copy
        held = _queue(pending, batch, None, incoming, clock)
    elif sizes is None:
        held = _remaining_read(pending, batch, consumed, incoming, clock)
    else:
        held = _remaining(pending, batch, consumed, incoming, clock, sizes)
    if held.num_pending and batch.id_range is not None:  # the ids' range read with the input
        low, high, read_with = batch.id_range  # (and these pending ids)
        if held.ids.bounds != (low, high) and (not pending.num_pending or pending.ids is read_with):
            held = held._replace(ids=held.ids.with_bounds((low, high)))
    return held


def _remaining(pending, batch, consumed, incoming, clock, sizes: Sizes) -> Pending:
    """:func:`remaining` with the sizes read with the rounds."""
    q = pending.num_pending
    n = batch.num_trajectories
    if q == 0 and sizes.incoming == n:  # everything released: nothing left to hold
        return Pending(ragged=pending.ragged)
    held = pending.chunks.sizes  # the chunks no span holds any more, read with the rounds
    emptied = [c for c, left in enumerate(sizes.left or ()) if not left and held[c]]
    if sizes.pending:
        pending, _ = _without(pending, ~consumed[:q], q - sizes.pending)
    kept = (n - sizes.incoming, batch.num_steps - sizes.incoming_steps)
    if kept[0]:
        pending = _queue(pending, batch, ~consumed[q:], incoming, clock, kept)
    return _tidy(pending, None, emptied=emptied, live=sizes.left_steps + kept[1])


def _remaining_read(pending, batch, consumed, incoming, clock) -> Pending:
    """:func:`remaining` without the sizes: read here."""
    q = pending.num_pending
    if q == 0 and bool(consumed.all()):  # everything released: nothing left to hold
        return Pending(ragged=pending.ragged)
    keep_pending, keep_incoming = ~consumed[:q], ~consumed[q:]
    dropped = _NO_CHUNKS
    if not bool(keep_pending.all()):
        pending, dropped = _without(pending, keep_pending)
    if bool(keep_incoming.any()):
        pending = _queue(pending, batch, keep_incoming, incoming, clock)
    return _tidy(pending, dropped)


def _queue(
    pending: Pending,
    batch: Insertion,
    keep: Tensor | None,
    incoming: Returns,
    clock: int,
    kept: tuple[int, int] | None = None,
) -> Pending:
    """``pending`` with the incoming trajectories ``keep`` (all for ``None``) queued: the
    insertion as it came when all stay, else one take of theirs. ``kept``: how many
    trajectories and steps stay, when known."""
    n = batch.num_trajectories
    everything = keep is None or (bool(keep.all()) if kept is None else kept[0] == n)
    if everything:
        lone = n == 1 and batch.versions is None  # its span from Python ints
        return append(
            pending,
            batch.steps,
            offset=0 if lone else batch.starts,
            lengths=batch.num_steps if lone else batch.lengths,
            ids=batch.group_ids,
            returns=incoming,
            queued_at=clock,
            versions=batch.versions,
        )
    if kept is None:
        index = keep.nonzero().squeeze(1)
    else:
        index = torch.nonzero_static(keep, size=kept[0]).squeeze(1)
    lengths = batch.lengths.index_select(0, index)
    total = None if kept is None else kept[1]
    return append(
        pending,
        batch.steps.take(ranges(batch.starts.index_select(0, index), lengths, total)),
        offset=torch.cumsum(lengths, 0) - lengths,
        lengths=lengths,
        ids=batch.group_ids.select(index),
        returns=returns_.take(incoming, index),
        queued_at=clock,
        versions=None if batch.versions is None else batch.versions.index_select(0, index),
    )


def taking(pending: Pending, taken: Tensor, steps: Tensor | None = None) -> tuple:
    """What releasing the pending trajectories ``taken`` (``(Q,)`` bool) takes from the store
    and leaves, as tensors to read: ``(C,)`` steps taken from each chunk, ``(C,)`` spans left in
    each, and the steps held in all (taken or not). ``steps``: the taken ones' steps (``(Q,)``,
    0 where not taken)."""
    chunk, lengths = pending.spans[:, CHUNK], pending.spans[:, LENGTH]
    steps = lengths * taken if steps is None else steps
    num = len(pending.chunks.steps)
    per_chunk = torch.zeros(num, dtype=torch.long).index_add_(0, chunk, steps)
    left = torch.zeros(num, dtype=torch.long).index_add_(0, chunk, (~taken).long())
    return per_chunk, left, lengths.sum()


def first_arrivals(pending: Pending, codes: Tensor, num_groups: int, clock: int) -> Tensor:
    """``(G,)`` the insertion that queued each group's first pending trajectory (``clock`` for
    a group with none pending): where its age starts.

    Args:
        codes: ``(Q,)`` the group code of each pending trajectory, in ``[0, num_groups)``.
        clock: the insertions so far, the current one included.
    """
    first = torch.full((num_groups,), clock, dtype=torch.long)
    return first.scatter_reduce(0, codes, pending.spans[:, QUEUED_AT], reduce="amin")
