"""Trajectories that cross insertions: the unfinished tails, held until their trajectory ends.

A torchrl collector cuts its batches every ``frames_per_batch`` steps, so a trajectory can start
in one insertion and end in a later one. Every step carries its trajectory's id (torchrl's
``("collector", "traj_ids")``, unique across a collector's workers). :func:`join` splits an
insertion by id, joins each piece with the tail held for its id, and returns the trajectories
that are now complete, each contiguous and in the order their last step arrived, ready to be
read; the pieces that do not end with a done step become (or extend) held tails. Only the
unfinished steps of an insertion are kept (one copy, a chunk of
:mod:`~torchrl_grpo.mcadvantage.store`), and a tail's pieces are gathered once more when its
trajectory completes: an insertion's cost depends on what it brings and completes, not on how
much is held.

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
from tensordict import LazyStackedTensorDict, TensorDictBase, lazy_stack
from torch import Tensor

from torchrl_grpo.mcadvantage.host import read_ints
from torchrl_grpo.mcadvantage.options import TrajectoryKeys
from torchrl_grpo.mcadvantage.read import fail_checks
from torchrl_grpo.mcadvantage.records import LAST_COUNT, TAIL_ID, TRAJ, Joined, Tails
from torchrl_grpo.mcadvantage.registry import ENDED, GIVEN_UP, RUNNING, IdRegistry
from torchrl_grpo.mcadvantage.steps import DenseSteps, RaggedSteps, Steps, get_entry
from torchrl_grpo.mcadvantage.store import CHUNK, LENGTH, LENIENT, OFFSET, ranges
from torchrl_grpo.mcadvantage.warn import warn

__all__ = ["drop", "held_steps", "join", "streamed", "tail_index"]

_NO_IDS = torch.zeros(0, dtype=torch.long)


def streamed(tails: Tails, tensordict: TensorDictBase, keys: TrajectoryKeys):
    """The insertion as steps to read by trajectory id (dense, or a lazy stack of ragged steps:
    the turns of dialogs, token sequences of different lengths), else ``None`` (it is then
    split at its done flags)."""
    if keys.traj is None or keys.traj not in tensordict.keys(include_nested=True):
        return None
    if isinstance(tensordict, LazyStackedTensorDict):
        try:
            return tensordict.contiguous()
        except RuntimeError:  # ragged steps: kept as a lazy stack of steps
            return tensordict if tensordict.batch_dims == 1 else _step_stack(tensordict)
    return tensordict


def _step_stack(tensordict: TensorDictBase) -> LazyStackedTensorDict:
    """A lazy stack ``[B, T]`` of ragged steps as one lazy stack of its steps, row after row."""
    return lazy_stack([step for row in tensordict.unbind(0) for step in row.unbind(0)])


def _steps(tensordict: TensorDictBase) -> Steps:
    """Steps of a dense TensorDict, or of a lazy stack of ragged steps."""
    if isinstance(tensordict, LazyStackedTensorDict):
        return RaggedSteps(list(tensordict.unbind(0)))
    return DenseSteps(tensordict)


def join(
    tails: Tails, tensordict: TensorDictBase, keys: TrajectoryKeys, clock: int, checks=()
) -> Joined:
    """Split ``tensordict`` by trajectory id and join it with the held tails.

    Args:
        tails: what is held before the insertion.
        tensordict: the insertion, dense: ``[N]`` steps, or ``[B, T]`` rows (a collector's
            layout: each row one environment's steps, in time order).
        keys: where the ids, done flags and (optionally) step counts are.
        clock: the insertion's number (a new tail's ``STARTED_AT``).
        checks: checks of the insertion's values
            (:func:`~torchrl_grpo.mcadvantage.read.arrival_checks`: its rewards are finite),
            read with the join's sizes; one that fails raises before anything is joined.

    Returns:
        The completed trajectories, in the order their last step comes in the row-major
        flattened input (each contiguous, its group id at its first step), and the next tails.

    Raises:
        KeyError: a key is missing.
        ValueError: an id that already ended comes back, a done step inside an id's steps, a
            step count that does not continue, or a per-step entry of the wrong shape.
    """
    registry = tails.registry if tails.registry is not None else IdRegistry()
    flat, ids, done, count = _per_step_entries(tensordict, keys, keep_all=True)
    sums = [check.sum for check in checks]  # (1,) each
    if not ids.shape[0]:  # nothing to split
        fail_checks(checks, [bits for (bits,) in read_ints(*sums)])
        return _join_read(tails, tensordict, keys, clock)
    split = _split(tails._replace(registry=registry), ids, done, count)
    *known, bits = read_ints(*split.read, torch.cat(sums) if sums else None)
    fail_checks(checks, bits or [])  # a non-finite reward: refused as it arrives
    if any(known[:_RARE]):  # a check failed, frames not collected, ids restarted or given up
        return _join_read(tails, tensordict, keys, clock)
    sizes = _JoinSizes(*known[_RARE:])
    return _joined(tails._replace(registry=registry), flat, split, sizes, count, clock)


def _join_read(tails: Tails, tensordict: TensorDictBase, keys: TrajectoryKeys, clock: int):
    """:func:`join` step after step, reading what each step needs: the path of an input that
    needs a closer look (a check that failed and names its cause, frames a collector did not
    collect, ids that restarted or were given up)."""
    registry = tails.registry if tails.registry is not None else IdRegistry()
    flat, ids, done, count = _per_step_entries(tensordict, keys)
    pieces = _split_by_id(ids, done, keys)
    sorted_count = None if count is None else count[pieces.order]
    status = registry.status(pieces.ids)  # (p,)
    tails, status, restarted = _restarts(tails, pieces, sorted_count, status, keys.group)
    if bool((status == ENDED).any()):
        raise ValueError(
            f"MCAdvantage: trajectory id {int(pieces.ids[status == ENDED][0])} under "
            f"{keys.traj!r} ended in an earlier insertion and arrives again: ids must not be "
            "reused (the ids of several collectors writing one buffer must not overlap). After "
            "a restart whose collector numbers trajectories from 0 again, give the steps a step "
            "counter (torchrl's StepCounter: a trajectory that starts at step 0 is taken for a "
            "new one), or call transform.forget_trajectory_ids() once the checkpoint is loaded "
            "(with SameStartGroups: env.transform.resume(transform), which also plays again "
            "the episodes that were running)."
        )
    given_up = status == GIVEN_UP  # continuations of evicted tails: left out, counted
    completes = pieces.last_done & ~given_up  # (p,)
    held, slot = tail_index(tails, pieces.ids)  # (p,) whether each piece continues a held tail
    if sorted_count is not None:
        _check_counts(sorted_count, pieces, held & ~given_up, slot, tails, keys, given_up)
    done_pieces = completes.nonzero().squeeze(1)  # (c,) in the order of their last step
    done_pieces = done_pieces[torch.argsort(pieces.order[pieces.ends[done_pieces]])]
    ended = pieces.ids[done_pieces]
    complete = None
    if done_pieces.numel():
        index = pieces.order[ranges(pieces.starts[done_pieces], pieces.lengths[done_pieces])]
        complete = _complete(tails, flat, index, pieces.lengths[done_pieces], ended)
    open_pieces = (~completes & ~given_up).nonzero().squeeze(1)  # (o,)
    last_count = None
    if sorted_count is not None and open_pieces.numel():
        last_count = sorted_count[pieces.ends[open_pieces]]
    new_tails = _next_tails(
        tails._replace(registry=registry),
        leaving=pieces.ids[completes | given_up],
        flat=flat,
        index=pieces.order[ranges(pieces.starts[open_pieces], pieces.lengths[open_pieces])],
        ids=pieces.ids[open_pieces],
        lengths=pieces.lengths[open_pieces],
        last_count=last_count,
        clock=clock,
    )
    dropped = int(pieces.lengths[given_up].sum()) if bool(given_up.any()) else 0
    if restarted[0].numel():  # said once nothing can reject the insertion any more
        _warn_restarted(keys, *restarted[:2], restarted[3])
    return Joined(
        complete=complete,
        tails=new_tails,
        ended=ended,
        dropped_steps=dropped + restarted[1],
        dropped_tails=restarted[0].numel(),
        restarted=restarted[2],
        stranded=len(set(restarted[3])),
    )


def _warn_restarted(keys: TrajectoryKeys, ids: Tensor, steps: int, groups: list) -> None:
    """Held tails given up because their ids start again at step 0 (a collector started again,
    a checkpoint loaded): their groups lost a member and can no longer complete."""
    named = f"the groups {sorted(set(groups), key=str)[:8]}" if groups else "their groups"
    warn(
        f"MCAdvantage: trajectory ids {ids.tolist()[:8]} under {keys.traj!r} start again at "
        "step 0 while unfinished trajectories with these ids are held: taken for new "
        f"trajectories (a collector started again?); the {steps} held steps are given up "
        f"(evicted_steps), and {named} they belong to can no longer complete (counted in "
        "stranded_groups) unless those episodes are played again: after loading a checkpoint, "
        "call SameStartGroups.resume(transform) (env.transform.resume) before the collector "
        "starts."
    )


#: How many of :class:`_Split`'s values are flags: any set sends the insertion to the step by
#: step path (:func:`_join_read`).
_RARE = 6


class _Split(NamedTuple):
    """An insertion split by trajectory id without reading anything: each piece's tensors are
    padded to ``(N,)`` (the pieces first, then a padding of empty pieces), and ``read`` lists
    what the host needs: the ``_RARE`` flags, then :class:`_JoinSizes`."""

    order: Tensor  # (N,) the steps grouped by id, in input order within an id
    starts: Tensor  # (N,) the first step of each piece, in ``order``
    ends: Tensor  # (N,) its last step, in ``order``
    lengths: Tensor  # (N,) its steps (0: padding)
    ids: Tensor  # (N,) its trajectory id
    completes: Tensor  # (N,) bool: it ends with a done step
    opens: Tensor  # (N,) bool: it does not (a piece, not padding)
    held: Tensor  # (N,) bool: it continues a held tail, ``slot`` its row of ``meta``
    slot: Tensor
    closing: Tensor | None  # (P,) bool: the held pieces whose trajectory completes
    closed: Tensor | None  # (H,) bool: the held tails that complete
    read: tuple


class _JoinSizes(NamedTuple):
    """What :func:`join` reads of a :class:`_Split` once its flags are clear."""

    complete: int  # pieces that complete their trajectory
    opens: int  # pieces that do not
    complete_steps: int  # the steps of the first (their held steps not counted)
    open_steps: int  # the steps of the second
    top: int  # one more than the largest id that completes (0: none)
    fresh: int  # open pieces that start a new tail
    closed: int  # held tails that complete
    closing: int  # their held pieces
    closing_steps: int  # and steps
    left_steps: int  # the held steps of the tails that stay
    used: list | None  # (C,) pieces that complete taken from each chunk of the tails' store
    left: list | None  # (C,) pieces left in each


def _split(tails: Tails, ids: Tensor, done: Tensor, count: Tensor | None) -> _Split:
    """The pieces of an insertion (each id's steps, in input order), the checks of
    :func:`_join_read` as flags, and the sizes of what completes and what stays held."""
    num = ids.shape[0]
    order = torch.argsort(ids, stable=True)  # (N,) grouped by id, input order within an id
    sorted_ids, sorted_done = ids[order], done[order]
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    torch.ne(sorted_ids[1:], sorted_ids[:-1], out=first[1:])
    last = first.roll(-1)  # the step before the next piece's first (the last step: last)
    starts = torch.nonzero_static(first, size=num, fill_value=num).view(-1)  # (N,) padded
    ends = torch.nonzero_static(last, size=num, fill_value=num - 1).view(-1)
    lengths = ends - starts + 1  # (N,) 0 for the padding
    piece_ids = sorted_ids[starts.clamp_max(num - 1)]
    real = lengths > 0
    completes = sorted_done[ends] & real
    opens = real & ~completes
    held, slot = tail_index(tails, piece_ids)
    held &= real
    flags = [
        (ids < 0).sum(),  # frames a preemptive collector did not collect
        (sorted_done & ~last).sum(),  # a done step inside an id's steps
        ((tails.registry.status(piece_ids) != RUNNING) & real).sum(),  # ended, given up
        *_count_flags(tails, count, order, first, starts, held, slot, real),
    ]
    closing, closed, store = _closing(tails, held & completes, slot)
    top = torch.where(completes, piece_ids + 1, 0).max()
    sizes = [
        completes.sum(),
        opens.sum(),
        (lengths * completes).sum(),
        (lengths * opens).sum(),
        top,
        (opens & ~held).sum(),
        *store,
    ]
    split = (order, starts, ends, lengths, piece_ids, completes, opens, held, slot)
    return _Split(*split, closing, closed, (*flags, *sizes))


def _count_flags(tails: Tails, count, order, first, starts, held, slot, real) -> list:
    """With a step counter, how many pieces restart a held tail (step 0 while one is held),
    do not continue their tail's count (or start without step 0), or skip a step: flags of
    :func:`_split` (``None`` without a counter)."""
    if count is None:
        return [None, None, None]
    sorted_count = count[order]
    first_count = sorted_count[starts.clamp_max(count.shape[0] - 1)]  # (N,)
    expected = torch.zeros_like(first_count)
    if tails.num_tails:
        tail_last = tails.meta[slot, LAST_COUNT]  # -1 where the tail was held without counts
        continued = torch.where(tail_last >= 0, tail_last + 1, first_count)
        expected = torch.where(held, continued, expected)
    restarted = held & (first_count == 0)
    gaps = ~first & (sorted_count - sorted_count.roll(1) != 1)
    return [restarted.sum(), ((first_count != expected) & real).sum(), gaps.sum()]


def _closing(tails: Tails, closes: Tensor, slot: Tensor) -> tuple:
    """``(closing, closed, sizes)``: which held pieces and tails complete with the pieces
    ``closes`` (their rows ``slot``), and the sizes :class:`_JoinSizes` reads of them."""
    if not tails.num_tails:
        return None, None, (0, 0, 0, 0, None, None)
    rows = tails.num_tails
    closed = torch.zeros(rows + 1, dtype=torch.bool)
    closed.index_fill_(0, torch.where(closes, slot, rows), True)
    closed = closed[:rows]  # (H,)
    _, tail = tail_index(tails, tails.pieces[:, TRAJ].contiguous())
    closing = closed[tail]  # (P,)
    chunk, lengths = tails.pieces[:, CHUNK], tails.pieces[:, LENGTH]
    num = len(tails.chunks.steps)
    used = torch.zeros(num, dtype=torch.long).index_add_(0, chunk, closing.long())
    left = torch.zeros(num, dtype=torch.long).index_add_(0, chunk, (~closing).long())
    closing_steps = (lengths * closing).sum()
    sizes = (closed.sum(), closing.sum(), closing_steps, lengths.sum() - closing_steps, used, left)
    return closing, closed, sizes


def _joined(tails: Tails, flat, split: _Split, sizes: _JoinSizes, count, clock: int) -> Joined:
    """:func:`join` from the split and what was read of it."""
    order, starts, lengths, piece_ids = split.order, split.starts, split.lengths, split.ids
    done_pieces = torch.nonzero_static(split.completes, size=sizes.complete).view(-1)  # (c,)
    done_pieces = done_pieces[torch.argsort(order[split.ends[done_pieces]])]  # by last step
    ended = piece_ids[done_pieces]
    complete = None
    if sizes.complete:
        index = order[ranges(starts[done_pieces], lengths[done_pieces], sizes.complete_steps)]
        complete = _complete(
            tails, flat, index, lengths[done_pieces], ended, known=(split.closing, sizes)
        )
    open_pieces = torch.nonzero_static(split.opens, size=sizes.opens).view(-1)  # (o,)
    last_count = None
    if count is not None and sizes.opens:
        last_count = count[order[split.ends[open_pieces]]]
    new_tails = _next_tails(
        tails,
        leaving=ended,
        flat=flat,
        index=order[ranges(starts[open_pieces], lengths[open_pieces], sizes.open_steps)],
        ids=piece_ids[open_pieces],
        lengths=lengths[open_pieces],
        last_count=last_count,
        clock=clock,
        known=(split, sizes),
    )
    return Joined(complete, new_tails, ended, 0, top=sizes.top)


def _restarts(tails: Tails, pieces: _Pieces, count: Tensor | None, status: Tensor, group=None):
    """Pieces whose first step is step 0 start new trajectories, whatever their id did before: a
    collector started again (after a restart) numbers its trajectories from 0 again. Held tails
    of those ids are given up (warned, counted). Without a step counter nothing is told apart.

    Returns:
        ``(tails, status, (ids of the tails given up, their steps, ids to mark running, the
        group id of each tail given up))``.
    """
    none = (_NO_IDS, 0, _NO_IDS, [])
    if count is None:
        return tails, status, none
    fresh = count[pieces.starts] == 0  # (p,)
    if not bool(fresh.any()):
        return tails, status, none
    reused = pieces.ids[fresh & (status != RUNNING)]  # ended or given up before: running again
    status = status.masked_fill(fresh, RUNNING)
    held, _ = tail_index(tails, pieces.ids)
    stale = held & fresh
    if not bool(stale.any()):
        return tails, status, (_NO_IDS, 0, reused, [])
    ids = pieces.ids[stale]
    steps = int(tails.pieces[torch.isin(tails.pieces[:, TRAJ], ids), LENGTH].sum())
    groups = _tail_groups(tails, ids, group)
    tails, _ = drop(tails, ~torch.isin(tails.meta[:, TAIL_ID], ids))
    return tails, status, (ids, steps, reused, groups)


def _tail_groups(tails: Tails, ids: Tensor, key) -> list:
    """The group id of each held tail of ``ids``, read at its first step (``[]`` without a
    group key or where the steps lack it)."""
    if key is None:
        return []
    traj = tails.pieces[:, TRAJ]
    at = torch.isin(traj, ids).nonzero().squeeze(1)  # (k,) their pieces, in arrival order
    _, inverse = torch.unique(traj[at], return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), traj.shape[0], dtype=torch.long)
    first = first.scatter_reduce(0, inverse, at, "amin")  # (u,) each tail's first piece
    spans = tails.pieces[first]
    steps = tails.chunks.take(spans[:, CHUNK], spans[:, OFFSET]).output()
    value = steps.get(key, None)
    if value is None:
        return []
    if isinstance(value, Tensor):
        return value.reshape(first.shape[0], -1)[:, 0].tolist()
    return list(value.tolist() if hasattr(value, "tolist") else value)


def tail_index(tails: Tails, ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(held, slot)``: whether each of ``ids`` has a held tail, and its row of ``meta``."""
    if not tails.num_tails:
        return torch.zeros(ids.shape, dtype=torch.bool), torch.zeros_like(ids)
    column = tails.meta[:, TAIL_ID].contiguous()
    slot = torch.searchsorted(column, ids).clamp_max(tails.num_tails - 1)
    return tails.meta[slot, TAIL_ID] == ids, slot


def held_steps(tails: Tails) -> tuple[TensorDictBase | None, Tensor]:
    """Every held step, tail after tail (in ``meta`` order), and ``(H,)`` steps per tail."""
    _, slot = tail_index(tails, tails.pieces[:, TRAJ].contiguous())
    lengths = torch.zeros(tails.num_tails, dtype=torch.long)
    lengths.index_add_(0, slot, tails.pieces[:, LENGTH])
    if not tails.num_tails:
        return None, lengths
    pieces = tails.pieces[torch.argsort(slot, stable=True)]
    return tails.chunks.gather(pieces).output(), lengths


def drop(tails: Tails, keep: Tensor) -> tuple[Tails, Tensor]:
    """``tails`` without the rows of ``meta`` where ``keep`` is False, and the dropped ids."""
    gone = tails.meta[~keep, TAIL_ID]
    leaving = torch.isin(tails.pieces[:, TRAJ], gone)
    kept, dropped = tails.pieces[~leaving], tails.pieces[leaving, CHUNK]
    chunks, pieces = tails.chunks.tidy(kept, dropped, LENIENT)
    return tails._replace(chunks=chunks, pieces=pieces, meta=tails.meta[keep]), gone


class _Pieces:
    """An insertion's steps grouped by trajectory id: piece ``i`` is steps
    ``order[starts[i] : starts[i] + lengths[i]]`` of the flat input, of trajectory ``ids[i]``."""

    __slots__ = ("order", "ids", "starts", "lengths", "ends", "last_done")

    def __init__(self, order, ids, starts, lengths, last_done):
        self.order, self.ids, self.starts, self.lengths = order, ids, starts, lengths
        self.ends = starts + lengths - 1  # (p,) last step of each piece, in ``order``
        self.last_done = last_done  # (p,) whether the piece ends with a done step


def _per_step_entries(tensordict: TensorDictBase, keys: TrajectoryKeys, keep_all: bool = False):
    """The flat steps (frames a preemptive collector did not fill left out, unless
    ``keep_all``: then not looked at), and their ids, done flags and step counts (``None``
    without a counter), each ``(N,)`` on the CPU."""
    shape = tensordict.batch_size
    flat = tensordict.reshape(-1) if len(shape) > 1 else tensordict  # ragged steps: already 1-D
    ids = _per_step(flat, keys.traj, "trajectory id", shape).long()  # (N,)
    done = _per_step(flat, keys.done, "done", shape).bool()  # (N,)
    count = None
    if keys.count is not None and flat.get(keys.count, None) is not None:
        count = _per_step(flat, keys.count, "step count", shape).long()
    valid = ids >= 0
    if not keep_all and not bool(valid.all()):  # frames a preemptive collector did not fill
        keep = valid.nonzero().squeeze(1)
        flat, ids, done = flat[keep], ids[keep], done[keep]
        count = None if count is None else count[keep]
    return flat, ids, done, count


def _split_by_id(ids: Tensor, done: Tensor, keys: TrajectoryKeys) -> _Pieces:
    """Each id's steps, in input order; a done step inside one is an error."""
    order = torch.argsort(ids, stable=True)  # (N,) grouped by id, input order within an id
    sorted_ids = ids[order]
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    torch.ne(sorted_ids[1:], sorted_ids[:-1], out=first[1:])
    starts = first.nonzero().squeeze(1)  # (p,) positions in `order`
    lengths = torch.diff(starts, append=starts.new_full((1,), ids.shape[0]))  # (p,)
    ends = starts + lengths - 1
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
    return _Pieces(order, sorted_ids[starts], starts, lengths, sorted_done[ends])


def _per_step(flat: TensorDictBase, key, role: str, shape: torch.Size) -> Tensor:
    value = get_entry(flat, key, role)
    if not isinstance(value, Tensor) or value.numel() != flat.shape[0]:
        raise ValueError(
            f"MCAdvantage: {key!r} must hold one {role} per step, got shape "
            f"{tuple(getattr(value, 'shape', ()))} for a batch of {tuple(shape)}."
        )
    return value.reshape(-1).cpu()  # bookkeeping is on the CPU (see mcadvantage/read.py)


def _check_counts(count, pieces: _Pieces, held, slot, tails: Tails, keys, skip) -> None:
    """Step counts: 0 at a new trajectory's first step, +1 from a tail to its continuation, and
    +1 from step to step inside a piece."""
    starts = pieces.starts
    first_count = count[starts]  # (p,)
    expected = torch.zeros_like(first_count)
    if tails.num_tails:
        tail_last = tails.meta[slot, LAST_COUNT]  # -1 where the tail was held without counts
        continued = torch.where(tail_last >= 0, tail_last + 1, first_count)
        expected = torch.where(held, continued, expected)
    wrong = (first_count != expected) & ~skip  # given-up trajectories are left out anyway
    if bool(wrong.any()):
        i = int(wrong.nonzero()[0])
        what = (
            f"continues a held tail whose last step count was {int(expected[i]) - 1}"
            if bool(held[i])
            else "starts a trajectory (no tail is held for it)"
        )
        raise ValueError(
            f"MCAdvantage: trajectory id {int(pieces.ids[i])} {what}, but its first step here "
            f"has {keys.count!r}={int(first_count[i])}: its earlier part is missing."
        )
    within = torch.ones_like(count, dtype=torch.bool)
    within[starts] = False  # the first step of a piece is checked above
    if bool(skip.any()):
        within[ranges(starts[skip], pieces.lengths[skip])] = False
    gap = within & (torch.diff(count, prepend=count[:1]) != 1)
    if bool(gap.any()):
        at = int(gap.nonzero()[0])
        piece = int(torch.searchsorted(starts, at, right=True)) - 1
        raise ValueError(
            f"MCAdvantage: trajectory id {int(pieces.ids[piece])} goes from {keys.count!r}="
            f"{int(count[at - 1])} to {int(count[at])}: steps are missing."
        )


def _complete(tails: Tails, flat, index: Tensor, lengths: Tensor, ids: Tensor, known=None):
    """Trajectories ``ids`` as their held pieces then their new steps (``flat[index]``,
    trajectory after trajectory, ``lengths`` each), one after the other: one concatenation of
    the chunks involved and the insertion, and one indexing (held chunks are small: only the
    unfinished pieces of an insertion). ``known``: ``(closing, sizes)`` of :func:`join`, which
    say which held pieces complete, from which chunks (else found here, reading them)."""
    if known is None:
        held = torch.isin(tails.pieces[:, TRAJ], ids) if tails.num_tails else None
        if held is None or not bool(held.any()):
            return flat[index]
        pieces, renumber, held_steps = tails.pieces[held], None, None
    else:
        closing, sizes = known
        if not sizes.closing:
            return flat[index]
        rows = torch.nonzero_static(closing, size=sizes.closing).view(-1)
        pieces, held_steps = tails.pieces.index_select(0, rows), sizes.closing_steps
        used = [c for c, taken in enumerate(sizes.used) if taken]
        renumber = torch.zeros(len(sizes.used), dtype=torch.long)  # (C,) chunk -> its place
        renumber[torch.tensor(used)] = torch.arange(len(used))
    sorted_ids, rank = torch.sort(ids)
    position = rank[torch.searchsorted(sorted_ids, pieces[:, TRAJ].contiguous())]  # (P',)
    by_trajectory = torch.argsort(position, stable=True)  # arrival order kept within one
    pieces, position = pieces[by_trajectory], position[by_trajectory]
    held_lengths = torch.zeros_like(lengths).index_add_(0, position, pieces[:, LENGTH])
    if renumber is None:
        used, local = torch.unique(pieces[:, CHUNK], return_inverse=True)  # the chunks involved
        used = used.tolist()
    else:
        local = renumber[pieces[:, CHUNK]]
    chunks = tails.chunks.add(_steps(flat))  # the insertion as the last chunk
    whole, starts = chunks.concatenated([*used, len(tails.chunks.steps)])
    total = held_lengths + lengths  # (c,)
    out_start = torch.cumsum(total, 0) - total
    steps = int(total.sum()) if held_steps is None else held_steps + index.shape[0]
    out = torch.empty(steps, dtype=torch.long)
    old = ranges(starts[local] + pieces[:, OFFSET], pieces[:, LENGTH], held_steps)
    out[ranges(out_start, held_lengths, held_steps)] = old
    out[ranges(out_start + held_lengths, lengths, index.shape[0])] = starts[-1] + index
    return whole.take(out).output()


def _next_tails(
    tails: Tails, *, leaving, flat, index, ids, lengths, last_count, clock, known=None
) -> Tails:
    """``tails`` without the trajectories ``leaving``, with the unfinished pieces (``flat[index]``,
    ``lengths`` steps each, of trajectories ``ids``) appended as one new chunk. ``known``:
    ``(split, sizes)`` of :func:`join`, which say which tails leave and how many stay or
    start (else found here, reading them)."""
    pieces, meta, chunks = tails.pieces, tails.meta, tails.chunks
    dropped, tidy = pieces[:0, CHUNK], {}
    if known is None and leaving.numel() and tails.num_tails:
        left = torch.isin(pieces[:, TRAJ], leaving)
        pieces, dropped = pieces[~left], pieces[left, CHUNK]
        meta = meta[~torch.isin(meta[:, TAIL_ID], leaving)]
    elif known is not None:
        split, sizes = known
        if sizes.closed:
            kept = torch.nonzero_static(~split.closing, size=pieces.shape[0] - sizes.closing)
            pieces = pieces.index_select(0, kept.view(-1))
            kept = torch.nonzero_static(~split.closed, size=meta.shape[0] - sizes.closed)
            meta = meta.index_select(0, kept.view(-1))
        emptied = [c for c, k in enumerate(sizes.left or ()) if not k and chunks.sizes[c]]
        tidy = dict(emptied=emptied, live=sizes.left_steps + sizes.open_steps)
    if ids.numel():
        offset = torch.cumsum(lengths, 0) - lengths
        number = torch.full_like(offset, len(chunks.steps))
        pieces = torch.cat([pieces, torch.stack([number, offset, lengths, ids], 1)])
        chunks = chunks.add(_steps(flat[index]))
        meta = _held_meta(meta, ids, last_count, clock, known)
    chunks, pieces = chunks.tidy(pieces, None if tidy else dropped, LENIENT, **tidy)
    return Tails(chunks=chunks, pieces=pieces, meta=meta, registry=tails.registry)


def _held_meta(meta: Tensor, ids: Tensor, last_count, clock: int, known) -> Tensor:
    """``meta`` once the unfinished pieces of ``ids`` are held: a continued tail's last count
    moves on, a new tail gets a row (kept sorted by id)."""
    held, slot = tail_index(Tails(meta=meta), ids)
    counts = torch.full_like(ids, -1) if last_count is None else last_count
    if known is None:
        continued, fresh = int(held.sum()), int((~held).sum())
    else:
        fresh = known[1].fresh
        continued = ids.shape[0] - fresh
    if continued:  # continued tails: their last count moves on
        rows = torch.nonzero_static(held, size=continued).view(-1)
        meta = meta.clone()
        meta[slot[rows], LAST_COUNT] = counts[rows]
    if fresh:
        rows = torch.nonzero_static(~held, size=fresh).view(-1)
        started = torch.full((fresh,), clock, dtype=torch.long)
        meta = torch.cat([meta, torch.stack([ids[rows], started, counts[rows]], 1)])
        meta = meta[torch.argsort(meta[:, TAIL_ID])]
    return meta
