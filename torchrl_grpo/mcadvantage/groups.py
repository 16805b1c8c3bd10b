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

from torchrl_grpo.mcadvantage import filters, limits
from torchrl_grpo.mcadvantage.options import GroupFilter, Selection
from torchrl_grpo.mcadvantage.pending import first_arrivals, trajectory
from torchrl_grpo.mcadvantage.records import Insertion, Pending, Returns, Rounds

__all__ = ["NOTHING", "find_rounds", "select_candidates"]

_NONE = torch.zeros(0, dtype=torch.long)
_TRUE = torch.ones(1, dtype=torch.bool)  # shared constants (never written to)
_ZERO = torch.zeros(1, dtype=torch.long)
#: No group completes.
NOTHING = Rounds(members=_NONE, member_round=_NONE, num_rounds=0, consumed=None)


def find_rounds(
    pending: Pending, batch: Insertion, size: int, short: tuple[int, int, int] | None = None
) -> Rounds:
    """Every complete round of ``size`` trajectories of one group, pending ones included.

    A group's trajectories, in arrival order, form rounds of ``size``; every full round is
    released, the rest stays pending.

    Args:
        short: ``(min_size, max_age, clock)`` (``min_group_size``): a group whose first pending
            trajectory arrived ``max_age`` insertions or more before insertion ``clock`` and
            that holds at least ``min_size`` trajectories (fewer than ``size``) is released as
            one round of what it holds: the runs that failed or timed out never come.
    """
    if batch.num_trajectories == 1 and short is None:
        return _one_more(pending, batch, size)
    before = pending.ids if pending.num_pending else None
    codes, order = batch.group_ids.codes(before)  # (Q + n,)
    counts = torch.bincount(codes)  # (G,) trajectories of each group, pending included
    n = batch.num_trajectories
    if n > size:  # candidate selection (not here) takes more on purpose
        limits.warn_if_over_repeated(size, torch.bincount(codes[-n:]))
    aged = _aged_short(pending, codes, counts, size, short)  # (G,) released short, or None
    fewest, most = (int(c) for c in torch.aminmax(counts))
    if most < size and aged is None:  # nothing can complete
        return NOTHING
    total = codes.shape[0]
    if fewest == most == size:  # every group present is exactly complete: one round each
        everything = torch.ones(total, dtype=torch.bool)
        return Rounds(torch.arange(total), codes, counts.shape[0], everything)
    if order is None:  # by group, arrival order within a group
        order = torch.argsort(codes, stable=True)
    first = torch.cumsum(counts, 0) - counts  # (G,) position of each group's first in `order`
    rank = torch.empty_like(codes)
    rank[order] = torch.arange(total) - first[codes[order]]  # (Q + n,) arrival rank in its group
    full = counts // size  # (G,) full rounds of each group
    consumed = rank < (full * size)[codes]
    per_group = full
    if aged is not None:
        consumed |= aged[codes]
        per_group = full + aged.long()
    members = consumed.nonzero().squeeze(-1)
    # Rounds numbered by (group, round); members of a round share group and rank // size.
    round_start = torch.cumsum(per_group, 0) - per_group  # (G,)
    member_round = round_start[codes[members]] + rank[members] // size
    return Rounds(members, member_round, int(per_group.sum()), consumed)


def _aged_short(pending: Pending, codes, counts, size: int, short) -> torch.Tensor | None:
    """``(G,)`` the groups released short (see :func:`find_rounds`), or ``None`` if none is."""
    if short is None or not pending.num_pending:
        return None
    min_size, max_age, clock = short
    first = first_arrivals(pending, codes[: pending.num_pending], counts.shape[0], clock)  # (G,)
    aged = (clock - 1 - first >= max_age) & (counts >= min_size) & (counts < size)
    return aged if bool(aged.any()) else None


def _one_more(pending: Pending, batch: Insertion, size: int) -> Rounds:
    """:func:`find_rounds` for one incoming trajectory: its group completes, or it waits.

    Pending groups hold fewer than ``size`` trajectories, so the newcomer completes its group
    exactly when ``size - 1`` of its group are pending; then all of them are the round.
    """
    if pending.num_pending == 0:
        return NOTHING if size > 1 else Rounds(_ZERO, _ZERO, 1, _TRUE)
    same = pending.ids.same_as(batch.group_ids)  # (Q,)
    if int(same.count_nonzero()) + 1 < size:
        return NOTHING
    consumed = torch.cat([same, _TRUE])
    members = consumed.nonzero().squeeze(-1)
    return Rounds(members, torch.zeros_like(members), 1, consumed)


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
