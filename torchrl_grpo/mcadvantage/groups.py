"""Which trajectories form complete groups: rounds of ``grpo_size``, or torchrl's candidate
selection. No advantage math here.

Trajectories are numbered pending first (``0 .. Q-1``, in arrival order) then incoming
(``Q .. Q+n-1``); each group id becomes a dense integer code
(:meth:`~torchrl_grpo.mcadvantage.ids.GroupIds.codes`). The result is a
:class:`~torchrl_grpo.mcadvantage.records.Rounds` record: the trajectories released, the released
group ("round") of each, and the trajectories that leave the pending store.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, lazy_stack
from torch import Tensor

from torchrl_grpo.mcadvantage import filters, limits
from torchrl_grpo.mcadvantage import pending as pending_
from torchrl_grpo.mcadvantage.host import read_ints
from torchrl_grpo.mcadvantage.options import GroupFilter, Selection
from torchrl_grpo.mcadvantage.pending import first_arrivals, trajectory
from torchrl_grpo.mcadvantage.records import Insertion, Pending, Returns, Rounds, Sizes
from torchrl_grpo.mcadvantage.store import LENGTH

__all__ = ["NOTHING", "find_rounds", "select_candidates"]

_NONE = torch.zeros(0, dtype=torch.long)
_TRUE = torch.ones(1, dtype=torch.bool)  # shared constants (never written to)
_ZERO = torch.zeros(1, dtype=torch.long)
#: No group completes.
NOTHING = Rounds(members=_NONE, member_round=_NONE, num_rounds=0, consumed=None)


def find_rounds(
    pending: Pending,
    batch: Insertion,
    size: int,
    short: tuple[int, int, int] | None = None,
    also: tuple = (),
) -> Rounds:
    """Every complete round of ``size`` trajectories of one group, pending ones included.

    A group's trajectories, in arrival order, form rounds of ``size``; every full round is
    released, the rest stays pending. The counts that decide it, and the sizes of what the
    rounds take and leave (:class:`~torchrl_grpo.mcadvantage.records.Sizes`), are read on the
    host at once; a group holding more than one round (an id reused) reads its members' ranks.

    Args:
        short: ``(min_size, max_age, clock)`` (``min_group_size``): a group whose first pending
            trajectory arrived ``max_age`` insertions or more before insertion ``clock`` and
            that holds at least ``min_size`` trajectories (fewer than ``size``) is released as
            one round of what it holds: the runs that failed or timed out never come.
        also: the caller's tensors to read on the host with the rounds' counts (their values
            in ``Rounds.also``), so that it reads nothing more.
    """
    if batch.num_trajectories == 1 and short is None:
        return _one_more(pending, batch, size, also)
    q = pending.num_pending
    before = pending.ids if q else None
    codes, order = batch.group_ids.codes(before, _bounds(batch, before))  # (Q + n,)
    counts = _count(codes, codes.shape[0])  # (Q + n,) trajectories of each code, pending included
    size_of = counts.index_select(0, codes)  # (Q + n,) of each one's group
    aged = _aged_short(pending, codes, counts, size, short)  # (Q + n,) released short, or None
    per_group = counts // size if aged is None else counts // size + aged.long()  # rounds
    consumed = size_of == size  # the members, unless a group holds more than one round
    if aged is not None:
        consumed |= aged.index_select(0, codes)
    fewest, most = torch.aminmax(size_of)
    values = read_ints(
        *also,
        fewest,
        most,
        None if aged is None else aged.any(),
        per_group.sum(),
        *_taking(pending, batch, consumed, aged),
    )
    also, values = values[: len(also)], values[len(also) :]
    fewest, most, aged_any, num_rounds = values[:4]
    if most < size and not aged_any:  # nothing can complete
        return _nothing(also)
    if most > size:  # a group of several rounds: its members by rank
        if batch.num_trajectories > size:  # candidate selection (not here) takes more
            limits.warn_if_over_repeated(size, *read_ints(*_repeated(codes, q, size)))
        return _by_rank(codes, counts, order, size, aged, per_group)._replace(also=also)
    sizes = _sizes(batch, q, num_rounds * size, *values[4:])
    if fewest == size:  # every group present is exactly complete: one round each
        members, member_round = torch.arange(codes.shape[0]), codes
    else:
        members = torch.nonzero_static(consumed, size=sizes.pending + sizes.incoming).view(-1)
        round_start = torch.cumsum(per_group, 0) - per_group  # (Q + n,) each complete group
        member_round = round_start.index_select(0, codes.index_select(0, members))  # a round
    return Rounds(members, member_round, num_rounds, consumed, sizes=sizes, also=also)


def _bounds(batch: Insertion, before) -> tuple[int, int] | None:
    """Bounds of the group ids of ``before`` (the pending ones) and ``batch``, when read with
    the input against the same pending ids."""
    if batch.id_range is None:
        return None
    low, high, held = batch.id_range
    return (low, high) if before is None or before is held else None


def _nothing(also: list) -> Rounds:
    """:data:`NOTHING`, with the values the caller asked to read along."""
    return NOTHING._replace(also=also) if also else NOTHING


def _count(codes: Tensor, num: int) -> Tensor:
    """``(num,)`` how many of ``codes`` have each value (``bincount``'s, its size known)."""
    return torch.zeros(num, dtype=torch.long).index_add_(0, codes, torch.ones_like(codes))


def _repeated(codes: Tensor, q: int, size: int) -> tuple[Tensor, Tensor]:
    """The most trajectories of one group the insertion brings (codes ``q`` on), and how many
    groups it brings more than ``size`` of."""
    counts = _count(codes[q:], codes.shape[0])
    return counts.max(), (counts > size).sum()


def _taking(pending: Pending, batch: Insertion, consumed: Tensor, aged) -> tuple:
    """What the trajectories ``consumed`` (``(Q + n,)``, the rounds' members unless a group
    holds several rounds) take and leave, as tensors to read (``None`` where the host knows
    it): their number (else rounds times ``size``: no ``aged`` group), all their steps and the
    longest (else every one is the insertion's common length), and what the pending store's
    chunks give and keep (:func:`~torchrl_grpo.mcadvantage.pending.taking`)."""
    q = pending.num_pending
    members = None if aged is None else consumed.sum()
    if not q and batch.width:
        return members, None, None, None, None, None
    lengths = batch.lengths if not q else torch.cat([pending.spans[:, LENGTH], batch.lengths])
    released = lengths * consumed  # (Q + n,) steps of each released trajectory, else 0
    store = pending_.taking(pending, consumed[:q], released[:q]) if q else (None, None, None)
    return members, released.sum(), released.max(), *store


def _sizes(batch, q: int, in_rounds: int, members, steps, longest, taken, left, held) -> Sizes:
    """:class:`Sizes` from what :func:`_taking` read (``in_rounds``: the members when each
    round has ``size``; ``held``: the pending steps)."""
    members = in_rounds if members is None else members
    if steps is None:  # nothing pending, every trajectory of the insertion as long
        longest = batch.width
        steps = longest * members
    width = longest if longest * members == steps else 0
    if not q:
        return Sizes(0, members, 0, steps, width, None, None, 0, longest)
    from_pending, from_store = q - sum(left), sum(taken)
    return Sizes(
        from_pending,
        members - from_pending,
        from_store,
        steps - from_store,
        width,
        taken,
        left,
        held - from_store,
        longest,
    )


def _by_rank(codes, counts, order, size: int, aged, per_group) -> Rounds:
    """:func:`find_rounds` when a group holds more than one round: each trajectory's arrival
    rank in its group decides its round (reading the members' number)."""
    total = codes.shape[0]
    if order is None:  # by group, arrival order within a group
        order = torch.argsort(codes, stable=True)
    first = torch.cumsum(counts, 0) - counts  # (G,) position of each group's first in `order`
    rank = torch.empty_like(codes)
    rank[order] = torch.arange(total) - first[codes[order]]  # (Q + n,) arrival rank in its group
    consumed = rank < ((counts // size) * size)[codes]
    if aged is not None:
        consumed |= aged[codes]
    members = consumed.nonzero().squeeze(-1)
    # Rounds numbered by (group, round); members of a round share group and rank // size.
    round_start = torch.cumsum(per_group, 0) - per_group  # (G,)
    member_round = round_start[codes[members]] + rank[members] // size
    return Rounds(members, member_round, int(per_group.sum()), consumed)


def _aged_short(pending: Pending, codes, counts, size: int, short) -> Tensor | None:
    """``(G,)`` the groups released short (see :func:`find_rounds`), or ``None`` without
    ``short`` or a pending trajectory."""
    if short is None or not pending.num_pending:
        return None
    min_size, max_age, clock = short
    first = first_arrivals(pending, codes[: pending.num_pending], counts.shape[0], clock)  # (G,)
    return (clock - 1 - first >= max_age) & (counts >= min_size) & (counts < size)


def _one_more(pending: Pending, batch: Insertion, size: int, also: tuple) -> Rounds:
    """:func:`find_rounds` for one incoming trajectory: its group completes, or it waits.

    Pending groups hold fewer than ``size`` trajectories, so the newcomer completes its group
    exactly when ``size - 1`` of its group are pending; then all of them are the round. What
    the round takes from the store is read only then (a second read, once a group).
    """
    steps = batch.num_steps
    if pending.num_pending == 0:
        also = read_ints(*also)
        if size > 1:
            return _nothing(also)
        sizes = Sizes(0, 1, 0, steps, steps, None, None, 0, steps)
        return Rounds(_ZERO, _ZERO, 1, _TRUE, sizes=sizes, also=also)
    same = pending.ids.same_as(batch.group_ids)  # (Q,)
    *also, held = read_ints(*also, same.count_nonzero())
    if held + 1 < size:
        return _nothing(also)
    consumed = torch.cat([same, _TRUE])
    members = torch.nonzero_static(consumed, size=held + 1).squeeze(1)
    taken_steps = pending.spans[:, LENGTH] * same
    values = read_ints(taken_steps.max(), *pending_.taking(pending, same, taken_steps))
    longest, taken, left, held_steps = values
    from_store = sum(taken)
    every = from_store == held * steps and (longest == steps or not held)  # as long as it
    width = steps if every else 0
    left_steps, longest = held_steps - from_store, max(longest, steps)
    sizes = Sizes(held, 1, from_store, steps, width, taken, left, left_steps, longest)
    return Rounds(members, torch.zeros_like(members), 1, consumed, sizes=sizes, also=also)


def select_candidates(
    pending: Pending,
    batch: Insertion,
    selection: Selection,
    group_size: int,
    returns: Returns,
    group_filter: GroupFilter,
) -> Rounds:
    """torchrl's oversampled candidate groups: the selector is tried at every arrival.

    As torchrl does, trajectory after trajectory: once a group holds ``min_size`` candidates,
    ``selection.selector`` picks ``group_size`` of them (seeing the returns as torchrl computes
    them); a pick that ``group_filter`` accepts is released, and a group that reaches
    ``candidate_group_size`` candidates without one is given up.

    Args:
        pending: the pending trajectories.
        batch: the incoming ones.
        selection: sizes and the selector.
        group_size: ``grpo_size``.
        returns: ``(Q + n,)`` the returns of pending ++ incoming, ``torchrl`` ones included.
        group_filter: which picks are kept.
    """
    q = pending.num_pending
    codes, _ = batch.group_ids.codes(pending.ids if q else None)  # (Q + n,)
    queues: dict[int, list[int]] = {}
    for j, code in enumerate(codes[:q].tolist()):
        queues.setdefault(code, []).append(j)
    consumed = torch.zeros(codes.shape[0], dtype=torch.bool)
    picks: list[list[int]] = []
    counts = dict(given_up=0, rescued=0, unselected=0, selected=0)
    for j, code in enumerate(codes[q:].tolist(), start=q):
        queue = queues.setdefault(code, [])
        queue.append(j)
        if len(queue) < selection.min_size:
            continue
        pick = _attempt(pending, batch, queue, selection, group_size, returns, group_filter)
        if pick is not None:
            _count_pick(counts, queue, group_size, returns, group_filter)
        if pick is not None and filters.keeps_selected(group_filter, returns.torchrl[pick]):
            picks.append(pick)
        elif len(queue) == selection.candidate_group_size:
            counts["given_up"] += 1
        else:
            continue
        consumed[queue] = True
        queue.clear()
    members = torch.tensor([m for pick in picks for m in pick], dtype=torch.long)
    member_round = torch.arange(len(picks)).repeat_interleave(group_size)
    members, order = torch.sort(members)  # released in arrival order, as complete rounds are
    return Rounds(members, member_round[order], len(picks), consumed, filtered=True, **counts)


def _attempt(pending, batch, queue, selection, group_size, returns, group_filter):
    """The selector's pick among the candidates ``queue`` if selection accepts it, else
    ``None``."""
    selector = selection.selector
    candidates = TensorDict({"return": returns.torchrl[queue]}, [len(queue)])
    if any(key != "return" for key in selector.in_keys):
        candidates["trajectories"] = lazy_stack([trajectory(pending, batch, i) for i in queue])
    picked = selector.select(
        candidates.select(*selector.in_keys, strict=True),
        group_size=group_size,
        keep_return_bounds=group_filter.keep_return_bounds,
    )
    pick = None if picked is None else [queue[i] for i in picked]
    if pick is None or not filters.selects(
        group_filter, returns.value[pick], returns.torchrl[pick]
    ):
        return None
    return pick


def _count_pick(counts: dict, queue: list, group_size: int, returns, group_filter) -> None:
    """torchrl's counters of an accepted pick, counted at every attempt as torchrl does: a
    selected group, rescued when its first ``group_size`` candidates would have failed."""
    counts["selected"] += 1
    if len(queue) > group_size:
        first = queue[:group_size]
        first_ok = filters.selects(group_filter, returns.value[first], returns.torchrl[first])
        counts["rescued"] += int(not first_ok)
        counts["unselected"] += len(queue) - group_size
