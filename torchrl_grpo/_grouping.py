"""Which trajectories form complete groups: group codes, rounds, candidate selection, eviction.

No advantage math here, and no TensorDict but the table of candidates that torchrl's selector
reads. Trajectories are numbered pending first (``0 .. Q-1``,
in arrival order) then incoming (``Q .. Q+n-1``); a group id becomes a dense integer *code*. The
result of an insertion is a :class:`Rounds` record: the trajectories released, the released
group ("round") of each, and the trajectories that leave the pending store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from tensordict import TensorDict, lazy_stack
from torch import Tensor
from torchrl.objectives.llm import MCAdvantageSelector

from torchrl_grpo import _pending

if TYPE_CHECKING:
    from torchrl_grpo._pending import Pending, Returns
    from torchrl_grpo._reading import Insertion
    from torchrl_grpo._release import GroupFilter


class Rounds(NamedTuple):
    """The groups an insertion releases."""

    members: Tensor  # (M,) released trajectories, increasing (pending first, then incoming)
    member_round: Tensor  # (M,) the released group of each member, in [0, num_rounds)
    num_rounds: int
    consumed: Tensor | None  # (Q + n,) bool: leave the pending store; None: none does
    given_up: int = 0  # candidate groups full without an accepted subset (torchrl: dropped)
    rescued: int = 0  # accepted only thanks to oversampling (torchrl's rescued_groups)
    unselected: int = 0  # candidates of selected groups left out (torchrl's counter)
    selected: int = 0  # groups the candidate selection selected (each attempt, as torchrl)
    filtered: bool = False  # the group filters were applied when the rounds were chosen


_NONE = torch.zeros(0, dtype=torch.long)
NOTHING = Rounds(members=_NONE, member_round=_NONE, num_rounds=0, consumed=None)


class Selection(NamedTuple):
    """torchrl's oversampling: collect candidates, let a selector pick a group among them."""

    candidate_group_size: int
    min_size: int  # candidates needed before the first attempt
    selector: MCAdvantageSelector

    def runs(self, group_size: int, trajectory_return: str | None) -> bool:
        """Whether selection can differ from taking each group's first ``group_size`` arrivals.

        torchrl consults the selector only with a ``trajectory_return``; and with as many
        candidates as the group size, its own selector keeps them all, in order, or rejects them
        by ``keep_return_bounds`` (a filter applied when the group is released instead).
        """
        return trajectory_return is not None and (
            self.candidate_group_size > group_size or type(self.selector) is not MCAdvantageSelector
        )


class Limits(NamedTuple):
    """Bounds on what is held back (``None``: no bound)."""

    max_groups: int | None
    max_age: int | None  # in insertions
    on_overflow: str  # "drop_oldest" or "raise"

    @property
    def active(self) -> bool:
        return self.max_groups is not None or self.max_age is not None


class Eviction(NamedTuple):
    state: Pending
    groups: int
    trajectories: int


def group_codes(
    pending: Tensor | list | None, incoming: Tensor | list
) -> tuple[Tensor, Tensor | None]:
    """A dense integer code per trajectory (pending first), equal iff the group ids are.

    Also returns the stable order of the trajectories by code (grouped, in arrival order within a
    group) when finding the codes sorted them anyway, else ``None``.

    Args:
        pending: the ``(Q, k)`` tensor ids or ``Q`` strings of the pending trajectories (``None``
            or empty: none).
        incoming: the ``(n, k)`` tensor ids or ``n`` strings of the incoming ones.

    Returns:
        ``(codes, order)``: ``(Q + n,)`` int64 codes in ``[0, groups)``, and an order or ``None``.
    """
    if isinstance(incoming, list):  # prompts: one dictionary
        table: dict = {}
        codes = [table.setdefault(k, len(table)) for k in _pending.as_list(pending) + incoming]
        return torch.tensor(codes, dtype=torch.long), None
    keys = (
        incoming
        if pending is None or pending.numel() == 0
        else torch.cat([pending, incoming.to(torch.promote_types(pending.dtype, incoming.dtype))])
    )
    if keys.shape[1] > 1:
        return torch.unique(keys, dim=0, return_inverse=True)[1], None
    keys = keys.reshape(-1)
    if not keys.is_floating_point() and keys.dtype != torch.bool and keys.numel():
        low, high = (int(v) for v in torch.aminmax(keys))
        if high - low <= 4 * keys.numel() + 1024:  # compact ids (seeds, indices): no sort
            shifted = keys - low
            present = torch.zeros(high - low + 1, dtype=torch.bool).index_fill_(0, shifted, True)
            return (torch.cumsum(present, 0) - 1).index_select(0, shifted), None
    sorted_keys, order = torch.sort(keys, stable=True)
    starts_group = torch.ones_like(sorted_keys, dtype=torch.bool)
    torch.ne(sorted_keys[1:], sorted_keys[:-1], out=starts_group[1:])
    codes = torch.empty_like(order)
    codes[order] = torch.cumsum(starts_group, 0) - 1
    return codes, order


def find_rounds(state: Pending, batch: Insertion, size: int) -> Rounds:
    """Every complete round of ``size`` trajectories of one group, pending ones included.

    A group's trajectories, in arrival order, form rounds of ``size``; every full round is
    released, the rest stays pending.
    """
    if batch.num_trajectories == 1:
        return _one_more(state, batch, size)
    codes, order = group_codes(state.keys, batch.group_ids)  # (Q + n,)
    counts = torch.bincount(codes)  # (G,) trajectories of each group, pending included
    fewest, most = (int(c) for c in torch.aminmax(counts))
    if most < size:  # nothing can complete
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
    consumed = rank < (counts // size * size)[codes]
    members = consumed.nonzero().squeeze(-1)
    # Rounds numbered by (group, round); members of a round share group and rank // size.
    round_start = torch.cumsum(counts // size, 0) - counts // size  # (G,)
    member_round = round_start[codes[members]] + rank[members] // size
    return Rounds(members, member_round, int((counts // size).sum()), consumed)


def _one_more(state: Pending, batch: Insertion, size: int) -> Rounds:
    """:func:`find_rounds` for one incoming trajectory: its group completes, or it waits.

    Pending groups hold fewer than ``size`` trajectories, so the newcomer completes its group
    exactly when ``size - 1`` of its group are pending; then all of them are the round.
    """
    q = state.num_pending
    if q == 0:
        return NOTHING if size > 1 else Rounds(_ZERO, _ZERO, 1, _TRUE)
    if isinstance(batch.group_ids, list):  # prompts: compared in Python
        prompt = batch.group_ids[0]
        same = torch.tensor([k == prompt for k in state.keys], dtype=torch.bool)
    else:
        same = state.keys == batch.group_ids  # (Q, k)
        if same.shape[1] > 1:
            same = same.all(1, keepdim=True)
        same = same.view(-1)  # (Q,)
    if int(same.count_nonzero()) + 1 < size:
        return NOTHING
    consumed = torch.cat([same, _TRUE])
    members = consumed.nonzero().squeeze(-1)
    return Rounds(members, torch.zeros_like(members), 1, consumed)


_TRUE = torch.ones(1, dtype=torch.bool)  # shared constants (never written to)
_ZERO = torch.zeros(1, dtype=torch.long)


def select_candidates(
    state: Pending,
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
        state: the pending trajectories.
        batch: the incoming ones.
        selection: sizes and the selector.
        group_size: ``grpo_size``.
        returns: ``(Q + n,)`` the returns of pending ++ incoming, ``torchrl`` ones included.
        group_filter: which picks are kept.
    """
    codes, _ = group_codes(state.keys, batch.group_ids)  # (Q + n,)
    num_pending, size, selector = state.num_pending, group_size, selection.selector
    queues: dict[int, list[int]] = {}
    for j, code in enumerate(codes[:num_pending].tolist()):
        queues.setdefault(code, []).append(j)
    consumed = torch.zeros(codes.shape[0], dtype=torch.bool)
    picks: list[list[int]] = []
    given_up = rescued = unselected = selected = 0
    for j, code in enumerate(codes[num_pending:].tolist(), start=num_pending):
        queue = queues.setdefault(code, [])
        queue.append(j)
        if len(queue) < selection.min_size:
            continue
        candidates = TensorDict({"return": returns.torchrl[queue]}, [len(queue)])
        if any(k != "return" for k in selector.in_keys):
            trajectories = [_pending.trajectory(state, batch, i) for i in queue]
            candidates["trajectories"] = lazy_stack(trajectories)
        picked = selector.select(
            candidates.select(*selector.in_keys, strict=True),
            group_size=size,
            keep_return_bounds=group_filter.keep_return_bounds,
        )
        pick = None if picked is None else [queue[i] for i in picked]
        if pick is not None and group_filter.selects(returns.value[pick], returns.torchrl[pick]):
            selected += 1  # torchrl counts these before its last test, at every attempt
            if len(queue) > size:
                first = queue[:size]
                first_ok = group_filter.selects(returns.value[first], returns.torchrl[first])
                rescued += int(not first_ok)
                unselected += len(queue) - size
        else:
            pick = None
        if pick is not None and group_filter.keeps_selected(returns.torchrl[pick]):
            picks.append(pick)
        elif len(queue) == selection.candidate_group_size:
            given_up += 1
        else:
            continue
        consumed[queue] = True
        queue.clear()
    members = torch.tensor([m for pick in picks for m in pick], dtype=torch.long)
    member_round = torch.arange(len(picks)).repeat_interleave(size)
    members, order = torch.sort(members)  # released in arrival order, as complete rounds are
    return Rounds(
        members,
        member_round[order],
        len(picks),
        consumed,
        given_up=given_up,
        rescued=rescued,
        unselected=unselected,
        selected=selected,
        filtered=True,
    )


def evict(state: Pending, limits: Limits) -> Eviction:
    """Give up the incomplete groups past ``limits`` (those that started first go first).

    Args:
        state: what is held after an insertion (its ``insertions`` clock already counts it).
        limits: the bounds, and what to do past them.

    Returns:
        The state without the evicted groups, and how many groups and trajectories went.

    Raises:
        RuntimeError: with ``on_overflow="raise"``, if any group would be evicted.
    """
    if state.num_pending == 0:
        return Eviction(state, 0, 0)
    codes, _ = group_codes(None, state.keys)  # (Q,)
    num = int(codes.max()) + 1
    first = torch.full((num,), state.insertions, dtype=torch.long)
    first = first.scatter_reduce(0, codes, state.arrival, reduce="amin")  # (G,) oldest arrival
    evicted = torch.zeros(num, dtype=torch.bool)
    if limits.max_age is not None:
        evicted |= state.insertions - 1 - first >= limits.max_age
    if limits.max_groups is not None:
        excess = int((~evicted).sum()) - limits.max_groups
        if excess > 0:  # the groups that started first go, ties by arrival of their ids
            order = torch.argsort(first.masked_fill(evicted, -1), stable=True)
            evicted[order[: int(evicted.sum()) + excess]] = True
    if not evicted.any():
        return Eviction(state, 0, 0)
    gone = evicted[codes]  # (Q,)
    groups, trajectories = int(evicted.sum()), int(gone.sum())
    if limits.on_overflow == "raise":
        raise RuntimeError(
            f"MCAdvantage: {groups} incomplete group(s) ({trajectories} trajectories) exceed "
            f"max_pending_groups={limits.max_groups} / max_pending_age={limits.max_age}; the "
            "insertion was rejected and nothing changed."
        )
    return Eviction(_pending.drop(state, ~gone), groups, trajectories)
