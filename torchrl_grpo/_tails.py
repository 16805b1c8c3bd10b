"""Trajectories that cross insertions: the unfinished tails held until their trajectory ends.

A torchrl collector cuts its batches every ``frames_per_batch`` steps, so a trajectory can start
in one insertion and end in a later one. Every step carries its trajectory's id (torchrl's
``("collector", "traj_ids")``, unique across a collector's workers). :func:`join` splits an
insertion by id, joins each piece with the tail held for its id, and returns the trajectories
that are now complete, each contiguous and in the order their last step arrived, ready for
:func:`~torchrl_grpo._reading.read_insertion`; the pieces that do not end with a done step become
(or extend) held tails. Only the unfinished steps of an insertion are kept (one copy when they
arrive), and a tail's pieces are gathered once more when its trajectory completes: the cost of an
insertion depends on what it brings and completes, not on how much is held.

What the ids and an optional step counter let :func:`join` check, before anything changes:

* an id whose trajectory already ended (or was given up) comes back: ``ValueError``;
* a done step in the middle of an id's steps (an id reused within one insertion): ``ValueError``;
* with a step counter (torchrl's ``StepCounter`` writes ``"step_count"``): a trajectory whose first
  step is not step 0 (its earlier part is missing), a continuation that does not continue its
  tail's count, or a gap inside a piece: ``ValueError``. Without one, a continuation whose earlier
  part never arrived cannot be told from a new trajectory.

Negative ids are torchrl's marker of frames a preemptive collector did not collect: those steps
are not data and are left out.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from tensordict import NestedKey, TensorDictBase
from torch import Tensor

from torchrl_grpo._reading import on_one_device

CHUNK, OFFSET, LENGTH, TRAJ = range(4)  # the columns of ``Tails.pieces``
ID, ARRIVAL, LAST_COUNT = range(3)  # the columns of ``Tails.meta``
RUNNING, ENDED, GIVEN_UP = 0, 1, 2  # what the registry knows of an id
_NO_PIECES = torch.zeros(0, 4, dtype=torch.long)
_NO_META = torch.zeros(0, 3, dtype=torch.long)


class IdRegistry:
    """Which trajectory ids have ended (or been given up): one byte per id, grown by doubling.

    Monotonic: an id is marked once its trajectory is released or evicted, and never unmarked.
    Successive states share it (marking, the only write, happens when an insertion commits), so
    that keeping it costs nothing per insertion.
    """

    def __init__(self, marks: Tensor | None = None):
        self.marks = torch.zeros(0, dtype=torch.uint8) if marks is None else marks

    def status(self, ids: Tensor) -> Tensor:
        """``(n,)`` uint8: ``RUNNING`` (never ended, or never seen), ``ENDED`` or ``GIVEN_UP``."""
        out = torch.zeros(ids.shape, dtype=torch.uint8)
        known = ids < self.marks.shape[0]
        out[known] = self.marks[ids[known]]
        return out

    def mark(self, ids: Tensor, value: int) -> None:
        if ids.numel() == 0:
            return
        top = int(ids.max()) + 1
        if top > self.marks.shape[0]:
            grown = torch.zeros(max(top, 2 * self.marks.shape[0]), dtype=torch.uint8)
            grown[: self.marks.shape[0]] = self.marks
            self.marks = grown
        self.marks[ids] = value


class Tails(NamedTuple):
    """The held tails: what arrived of the trajectories that have not ended yet.

    Tail ``h`` (trajectory id ``meta[h, ID]``) is the concatenation of its pieces in arrival
    order; piece ``p`` is steps ``offset : offset + length`` of ``chunks[chunk]``, a flat
    TensorDict of the unfinished steps one insertion left (``None`` once no piece points to it).
    ``meta`` is sorted by id.
    """

    chunks: tuple = ()
    pieces: Tensor = _NO_PIECES  # (P, 4): chunk, offset, length, trajectory id; arrival order
    meta: Tensor = _NO_META  # (H, 3): id, insertion of the first step, last step count (-1: none)
    registry: IdRegistry | None = None

    @property
    def num_tails(self) -> int:
        return self.meta.shape[0]

    @property
    def num_steps(self) -> int:
        return int(self.pieces[:, LENGTH].sum()) if self.pieces.shape[0] else 0

    @property
    def ids(self) -> Tensor:
        return self.meta[:, ID]

    def index(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """``(held, slot)``: whether each of ``ids`` has a held tail, and its row of ``meta``."""
        if not self.num_tails:
            return torch.zeros(ids.shape, dtype=torch.bool), torch.zeros_like(ids)
        slot = torch.searchsorted(self.meta[:, ID].contiguous(), ids).clamp_max(self.num_tails - 1)
        return self.meta[slot, ID] == ids, slot

    def steps(self) -> tuple[TensorDictBase | None, Tensor]:
        """Every held step, tail after tail (in ``meta`` order), and ``(H,)`` steps per tail."""
        _, slot = self.index(self.pieces[:, TRAJ].contiguous())
        lengths = torch.zeros(self.num_tails, dtype=torch.long).index_add_(
            0, slot, self.pieces[:, LENGTH]
        )
        if not self.num_tails:
            return None, lengths
        return _gather(self.chunks, self.pieces[torch.argsort(slot, stable=True)]), lengths


class TrajectoryKeys(NamedTuple):
    """What :func:`join` reads on every step."""

    traj: NestedKey  # the trajectory id
    done: NestedKey
    count: NestedKey | None  # a step counter (0 at a trajectory's first step), if any


class Joined(NamedTuple):
    """The outcome of :func:`join`, applied to the state only when the insertion commits."""

    complete: TensorDictBase | None  # (M,) steps of the completed trajectories, or None
    tails: Tails  # the tails held after the insertion
    ended: Tensor  # (c,) ids of the completed trajectories (to mark in the registry)
    dropped_steps: int  # steps of given-up trajectories that arrived and were left out


def join(tails: Tails, tensordict: TensorDictBase, keys: TrajectoryKeys, insertion: int) -> Joined:
    """Split ``tensordict`` by trajectory id and join it with the held tails.

    Args:
        tails: what is held before the insertion.
        tensordict: the insertion, dense: ``[N]`` steps, or ``[B, T]`` rows (a collector's
            layout: each row one environment's steps, in time order).
        keys: where the ids, done flags and (optionally) step counts are.
        insertion: the insertion clock (the tails' age is counted from it).

    Returns:
        The completed trajectories, in the order their last step comes in the row-major
        flattened input (each contiguous, its group id at its first step), and the next tails.

    Raises:
        KeyError: a key is missing.
        ValueError: an id that already ended comes back, a done step inside an id's steps, a
            step count that does not continue, or a per-step entry of the wrong shape.
    """
    registry = tails.registry if tails.registry is not None else IdRegistry()
    shape = tensordict.batch_size
    flat = tensordict.reshape(-1) if len(shape) > 1 else tensordict
    ids = _per_step(flat, keys.traj, "trajectory id", shape).long()  # (N,)
    done = _per_step(flat, keys.done, "done", shape).bool()  # (N,)
    count = None
    if keys.count is not None and flat.get(keys.count, None) is not None:
        count = _per_step(flat, keys.count, "step count", shape).long()
    valid = ids >= 0
    if not bool(valid.all()):  # frames a preemptive collector did not fill: not data
        keep = valid.nonzero().squeeze(1)
        flat, ids, done = flat[keep], ids[keep], done[keep]
        count = None if count is None else count[keep]

    # pieces: each id's steps, in input order
    order = torch.argsort(ids, stable=True)  # (N,) grouped by id, input order within an id
    sorted_ids = ids[order]
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    torch.ne(sorted_ids[1:], sorted_ids[:-1], out=first[1:])
    starts = first.nonzero().squeeze(1)  # (p,) positions in `order`
    lengths = torch.diff(starts, append=starts.new_full((1,), ids.shape[0]))  # (p,)
    ends = starts + lengths - 1
    piece_ids = sorted_ids[starts]  # (p,) increasing
    sorted_done = done[order]
    inner = sorted_done.clone()
    inner[ends] = False
    if bool(inner.any()):
        at = int(inner.nonzero()[0])
        raise ValueError(
            f"MCAdvantage: trajectory id {int(sorted_ids[at])} under {keys.traj!r} has a done "
            "step before its last step in this insertion: an id must name one trajectory "
            "(it was reused after its trajectory ended)."
        )
    status = registry.status(piece_ids)  # (p,)
    if bool((status == ENDED).any()):
        raise ValueError(
            f"MCAdvantage: trajectory id {int(piece_ids[status == ENDED][0])} under "
            f"{keys.traj!r} ended in an earlier insertion and arrives again: ids must not be "
            "reused (the ids of several collectors writing one buffer must not overlap)."
        )
    given_up = status == GIVEN_UP  # continuations of evicted tails: left out, counted
    completes = sorted_done[ends] & ~given_up  # (p,)
    held, slot = tails.index(piece_ids)  # (p,) whether each piece continues a held tail
    sorted_count = None if count is None else count[order]
    if sorted_count is not None:
        _check_counts(
            sorted_count, starts, held & ~given_up, slot, tails, piece_ids, keys, given_up
        )

    # what completes: held pieces ++ this insertion's piece, in the order of their last step
    done_pieces = completes.nonzero().squeeze(1)  # (c,)
    done_pieces = done_pieces[torch.argsort(order[ends[done_pieces]])]
    ended = piece_ids[done_pieces]
    complete = None
    if done_pieces.numel():
        new_index = order[_ranges(starts[done_pieces], lengths[done_pieces])]  # (K,) in `flat`
        complete = _assemble(tails, flat, new_index, lengths[done_pieces], ended)

    # the next tails: those not completed, extended by the unfinished pieces
    leaving = piece_ids[completes | given_up]
    open_pieces = (~completes & ~given_up).nonzero().squeeze(1)  # (o,)
    new_chunk = None
    if open_pieces.numel():
        new_chunk = flat[order[_ranges(starts[open_pieces], lengths[open_pieces])]]
    last_count = None
    if sorted_count is not None and open_pieces.numel():
        last_count = sorted_count[ends[open_pieces]]
    new_tails = _next_tails(
        tails,
        leaving=leaving,
        chunk=new_chunk,
        ids=piece_ids[open_pieces],
        lengths=lengths[open_pieces],
        last_count=last_count,
        insertion=insertion,
        registry=registry,
    )
    dropped = int(lengths[given_up].sum()) if bool(given_up.any()) else 0
    return Joined(complete=complete, tails=new_tails, ended=ended, dropped_steps=dropped)


def drop(tails: Tails, keep: Tensor) -> tuple[Tails, Tensor]:
    """``tails`` without the rows of ``meta`` where ``keep`` is False, and the dropped ids."""
    gone = tails.meta[~keep, ID]
    pieces = tails.pieces[~torch.isin(tails.pieces[:, TRAJ], gone)]
    chunks, pieces = _compact(tails.chunks, pieces)
    return tails._replace(chunks=chunks, pieces=pieces, meta=tails.meta[keep]), gone


# --- helpers ------------------------------------------------------------------------------------


def _per_step(flat: TensorDictBase, key: NestedKey, role: str, shape: torch.Size) -> Tensor:
    value = flat.get(key, None)
    if value is None:
        raise KeyError(
            f"MCAdvantage: the {role} key {key!r} is missing from the input "
            f"(keys: {sorted(map(str, flat.keys(True, True)))})."
        )
    if not isinstance(value, Tensor) or value.numel() != flat.shape[0]:
        raise ValueError(
            f"MCAdvantage: {key!r} must hold one {role} per step, got shape "
            f"{tuple(getattr(value, 'shape', ()))} for a batch of {tuple(shape)}."
        )
    return value.reshape(-1).cpu()  # bookkeeping is on the CPU (see torchrl_grpo._reading)


def _check_counts(count, starts, held, slot, tails, piece_ids, keys, skip) -> None:
    """Step counts: 0 at a new trajectory's first step, +1 from a tail to its continuation, and
    +1 from step to step inside a piece."""
    first_count = count[starts]  # (p,)
    expected = torch.zeros_like(first_count)
    if tails.num_tails:
        tail_last = tails.meta[slot, LAST_COUNT]  # -1 where the tail was held without counts
        expected = torch.where(held, torch.where(tail_last >= 0, tail_last + 1, first_count), expected)  # fmt: skip
    wrong = (first_count != expected) & ~skip  # given-up trajectories are left out anyway
    if bool(wrong.any()):
        i = int(wrong.nonzero()[0])
        what = (
            f"continues a held tail whose last step count was {int(expected[i]) - 1}"
            if bool(held[i])
            else "starts a trajectory (no tail is held for it)"
        )
        raise ValueError(
            f"MCAdvantage: trajectory id {int(piece_ids[i])} {what}, but its first step here has "
            f"{keys.count!r}={int(first_count[i])}: its earlier part is missing."
        )
    within = torch.ones_like(count, dtype=torch.bool)
    within[starts] = False  # the first step of a piece is checked above
    if bool(skip.any()):
        within[_ranges(starts[skip], torch.diff(starts, append=starts.new_full((1,), count.shape[0]))[skip])] = False  # fmt: skip
    gap = within & (torch.diff(count, prepend=count[:1]) != 1)
    if bool(gap.any()):
        at = int(gap.nonzero()[0])
        piece = int(torch.searchsorted(starts, at, right=True)) - 1
        raise ValueError(
            f"MCAdvantage: trajectory id {int(piece_ids[piece])} goes from {keys.count!r}="
            f"{int(count[at - 1])} to {int(count[at])}: steps are missing."
        )


def _gather(chunks: tuple, pieces: Tensor) -> TensorDictBase:
    """The steps of ``pieces``, in that order: one indexing per chunk involved, then one
    reordering (never one slice per piece)."""
    if pieces.shape[0] == 1:
        c, o, n = pieces[0, :3].tolist()
        return chunks[c][o : o + n]
    lengths = pieces[:, LENGTH]
    step_chunk = torch.repeat_interleave(pieces[:, CHUNK], lengths)  # (K,) in output order
    step_pos = _ranges(pieces[:, OFFSET], lengths)  # (K,) position in its chunk
    by_chunk = torch.argsort(step_chunk, stable=True)
    chunk_ids, counts = torch.unique_consecutive(step_chunk[by_chunk], return_counts=True)
    parts = [
        chunks[c][pos]
        for c, pos in zip(chunk_ids.tolist(), step_pos[by_chunk].split(counts.tolist()))
    ]
    data = parts[0] if len(parts) == 1 else torch.cat(on_one_device(parts))  # (K,) by chunk
    if bool((by_chunk[1:] > by_chunk[:-1]).all()):  # already in output order
        return data
    return data[torch.argsort(by_chunk)]


def _assemble(tails: Tails, flat, new_index: Tensor, new_lengths: Tensor, ids: Tensor):
    """Trajectories ``ids`` as their held pieces then their new steps (``flat[new_index]``,
    trajectory after trajectory, ``new_lengths`` each), one after the other: one concatenation of
    the chunks involved and the insertion, and one indexing."""
    held = torch.isin(tails.pieces[:, TRAJ], ids) if tails.num_tails else None
    if held is None or not bool(held.any()):
        return flat[new_index]
    pieces = tails.pieces[held]
    sorted_ids, rank = torch.sort(ids)
    position = rank[torch.searchsorted(sorted_ids, pieces[:, TRAJ].contiguous())]  # (P',)
    by_trajectory = torch.argsort(position, stable=True)  # arrival order kept within one
    pieces, position = pieces[by_trajectory], position[by_trajectory]
    old_lengths = torch.zeros_like(new_lengths).index_add_(0, position, pieces[:, LENGTH])
    # the sources: the chunks the pieces are in, then the insertion
    used, local = torch.unique(pieces[:, CHUNK], return_inverse=True)
    sources = [tails.chunks[c] for c in used.tolist()]
    sizes = torch.tensor([len(c) for c in sources])
    base = torch.cumsum(sizes, 0) - sizes  # (u,) where each chunk starts in the concatenation
    old_index = _ranges(base[local] + pieces[:, OFFSET], pieces[:, LENGTH])  # (K',)
    total = old_lengths + new_lengths  # (c,)
    out_start = torch.cumsum(total, 0) - total
    index = torch.empty(int(total.sum()), dtype=torch.long)
    index[_ranges(out_start, old_lengths)] = old_index
    index[_ranges(out_start + old_lengths, new_lengths)] = int(sizes.sum()) + new_index
    return torch.cat(on_one_device([*sources, flat]))[index]


def _next_tails(tails, *, leaving, chunk, ids, lengths, last_count, insertion, registry) -> Tails:
    """``tails`` without the trajectories ``leaving``, with the unfinished pieces of ``chunk``
    (``lengths`` steps each, of trajectories ``ids``) appended."""
    pieces, meta = tails.pieces, tails.meta
    if leaving.numel() and tails.num_tails:
        pieces = pieces[~torch.isin(pieces[:, TRAJ], leaving)]
        meta = meta[~torch.isin(meta[:, ID], leaving)]
    chunks = tails.chunks
    if chunk is not None:
        offset = torch.cumsum(lengths, 0) - lengths
        chunk_index = torch.full_like(offset, len(chunks))
        pieces = torch.cat([pieces, torch.stack([chunk_index, offset, lengths, ids], 1)])
        chunks = (*chunks, chunk)
        held = Tails(meta=meta).index(ids)
        counts = torch.full_like(ids, -1) if last_count is None else last_count
        if bool(held[0].any()):  # continued tails: their last count moves on
            meta = meta.clone()
            meta[held[1][held[0]], LAST_COUNT] = counts[held[0]]
        fresh = ~held[0]
        if bool(fresh.any()):
            rows = torch.stack([ids[fresh], torch.full_like(ids[fresh], insertion), counts[fresh]], 1)  # fmt: skip
            meta = torch.cat([meta, rows])
            meta = meta[torch.argsort(meta[:, ID])]
    chunks, pieces = _compact(chunks, pieces)
    return Tails(chunks=chunks, pieces=pieces, meta=meta, registry=registry)


def _compact(chunks: tuple, pieces: Tensor) -> tuple[tuple, Tensor]:
    """Chunks no piece points to, released; renumbered once most slots are empty."""
    if not pieces.shape[0]:
        return (), pieces
    used = torch.zeros(len(chunks), dtype=torch.bool).index_fill_(0, pieces[:, CHUNK], True)
    if len(chunks) > 2 * int(used.sum()) + 8:
        renumber = torch.cumsum(used, 0) - 1
        pieces = pieces.clone()
        pieces[:, CHUNK] = renumber[pieces[:, CHUNK]]
        return tuple(c for c, u in zip(chunks, used.tolist()) if u), pieces
    return tuple(c if u else None for c, u in zip(chunks, used.tolist())), pieces


def _ranges(starts: Tensor, lengths: Tensor) -> Tensor:
    """Concatenate ``arange(s, s + l)`` for each pair, without a Python loop."""
    total = int(lengths.sum())
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.arange(total) - torch.repeat_interleave(offsets - starts, lengths)
