"""What is held back: the memory limits, and a warning when no group ever completes.

``Limits(max_groups=...)`` bounds the incomplete groups held, ``Limits(max_age=...)`` how many
insertions a group (from its first trajectory) or an unfinished trajectory (from its first step)
may wait.
Past them, :func:`apply_limits` gives up the oldest (counted in ``evicted_*``, with a
``RuntimeWarning``), or, with ``on_overflow="raise"``, rejects the insertion before anything
changed. Given-up trajectory ids are marked so that their later steps are left out.

:func:`warn_if_stuck` says, once, when :data:`STUCK_AFTER` insertions have completed no group
while trajectories pile up: the usual cause is a group size the data cannot fill (each id
receives fewer than ``grpo_size`` trajectories).
"""

from __future__ import annotations

import torch

from torchrl_grpo.mcadvantage import pending as pending_
from torchrl_grpo.mcadvantage import tails as tails_
from torchrl_grpo.mcadvantage.host import read_ints
from torchrl_grpo.mcadvantage.options import Limits
from torchrl_grpo.mcadvantage.records import STARTED_AT, State
from torchrl_grpo.mcadvantage.registry import GIVEN_UP
from torchrl_grpo.mcadvantage.store import LENGTH
from torchrl_grpo.mcadvantage.warn import warn

__all__ = ["STUCK_AFTER", "apply_limits", "evict_groups", "warn_if_stuck"]

#: The insertion at which :func:`warn_if_stuck` looks, once.
STUCK_AFTER = 20


def apply_limits(limits: Limits, state: State, marks: tuple) -> tuple[State, tuple]:
    """``state`` (after an insertion, its clock counting it) within ``limits``, and the ids to
    mark: ``marks`` and the given-up tails'.

    Raises:
        RuntimeError: with ``on_overflow="raise"``, if anything would be given up.
    """
    if limits.max_groups is None and limits.max_age is None:
        return state, marks
    pending, groups, trajectories = evict_groups(limits, state.pending, state.insertions)
    tails, unfinished, steps = state.tails, 0, 0
    if limits.max_age is not None and tails.num_tails:
        old = state.insertions - 1 - tails.meta[:, STARTED_AT] >= limits.max_age  # (H,)
        if bool(old.any()):
            if limits.on_overflow == "raise":
                raise RuntimeError(
                    f"MCAdvantage: {int(old.sum())} unfinished trajectories are older than "
                    f"Limits' max_age={limits.max_age}; the insertion was rejected and nothing "
                    "changed."
                )
            before = int(tails.pieces[:, LENGTH].sum())
            tails, gone = tails_.drop(tails, ~old)
            steps = before - int(tails.pieces[:, LENGTH].sum())
            unfinished = gone.shape[0]
            marks = (*marks, (gone, GIVEN_UP))
    if not groups and not steps:
        return state, marks
    also = f" and {unfinished} unfinished trajectories" if steps else ""
    warn(
        f"MCAdvantage: {groups} incomplete group(s) ({trajectories} trajectories){also} exceed "
        f"Limits(max_groups={limits.max_groups}, max_age={limits.max_age}); the "
        "oldest were dropped (see evicted_groups)."
    )
    stats = dict(state.stats)
    stats["evicted_groups"] += groups
    stats["evicted_trajectories"] += trajectories + unfinished
    stats["evicted_steps"] += steps
    return state._replace(pending=pending, tails=tails, stats=stats), marks


def evict_groups(limits: Limits, pending, clock: int):
    """Give up the incomplete groups past ``limits`` (those that started first go first).

    Args:
        limits: the bounds, and what to do past them.
        pending: what is held after an insertion.
        clock: the insertions so far, this one included.

    Returns:
        ``(pending, groups, trajectories)``: what stays, and how many groups and trajectories
        went.

    Raises:
        RuntimeError: with ``on_overflow="raise"``, if any group would be evicted.
    """
    if pending.num_pending == 0:
        return pending, 0, 0
    q = pending.num_pending
    codes, _ = pending.ids.codes()  # (Q,) codes in [0, G), G <= Q
    counts = torch.zeros(q, dtype=torch.long).index_add_(0, codes, torch.ones_like(codes))
    present = counts > 0  # (Q,) codes that name a group
    first = pending_.first_arrivals(pending, codes, q, clock)  # (Q,) oldest arrival
    evicted = torch.zeros(q, dtype=torch.bool)
    if limits.max_age is not None:
        evicted |= (clock - 1 - first >= limits.max_age) & present
        if limits.min_group_size is not None:  # released short by the next insertion instead
            evicted &= counts < limits.min_group_size
    kept, groups = read_ints((present & ~evicted).sum(), evicted.sum())  # read at once
    excess = 0 if limits.max_groups is None else kept - limits.max_groups
    if excess > 0:  # the groups that started first go, ties by arrival of their ids
        order = torch.argsort(first.masked_fill(evicted, -1), stable=True)  # absent ones last
        evicted[order[: groups + excess]] = True
        groups += excess
    if not groups:
        return pending, 0, 0
    gone = evicted[codes]  # (Q,)
    trajectories = int(gone.sum())
    if limits.on_overflow == "raise":
        raise RuntimeError(
            f"MCAdvantage: {groups} incomplete group(s) ({trajectories} trajectories) exceed "
            f"Limits(max_groups={limits.max_groups}, max_age={limits.max_age}); the "
            "insertion was rejected and nothing changed."
        )
    return pending_.drop(pending, ~gone), groups, trajectories


def warn_if_stuck(grpo_size: int, state: State) -> None:
    """At insertion :data:`STUCK_AFTER`, warn if no group has completed yet while at least four
    groups' worth of trajectories are held back, with the counts and the likely causes."""
    pending = state.pending
    if state.insertions != STUCK_AFTER or state.stats["completed_groups"]:
        return
    if pending.num_pending < 4 * grpo_size:
        return
    counts = pending.ids.counts()
    warn(
        f"MCAdvantage: {STUCK_AFTER} insertions and no group has completed: {len(counts)} "
        f"groups hold {pending.num_pending} trajectories, at most {max(counts)} in one, and a "
        f"group completes at grpo_size={grpo_size} trajectories of one id. If each id gets "
        "fewer (SameStartGroups(group_size) below grpo_size, resets that used seeds before the "
        "collector started (check_env_specs: call SameStartGroups.rewind() after it), prompts "
        "repeated fewer times), groups never complete: match grpo_size to the data, or bound "
        "what is held (limits=Limits(max_groups=..., max_age=...)). If the trajectories of "
        "many groups just arrive interleaved, their groups complete later: nothing is wrong."
    )


def warn_if_over_repeated(grpo_size: int, most: int, over: int) -> None:
    """Warn if one insertion brings more trajectories of one group than ``grpo_size`` (``most``,
    the most of one group; ``over``, the groups above ``grpo_size``): they make several groups of
    that id (prompts repeated more times than the group size, a ``SameStartGroups(group_size)``
    above ``grpo_size``), whose advantages are then relative to a part of the samples only."""
    if most <= grpo_size:
        return
    warn(
        f"MCAdvantage: this insertion brings {most} trajectories of one group id, more than "
        f"grpo_size={grpo_size} ({over} id(s) above it): each id forms several groups of "
        f"{grpo_size}, each normalised on its own. If every prompt is repeated {most} times "
        f"(DatasetChatEnv's repeats, SameStartGroups' group_size), set grpo_size={most}; if "
        "an id is reused on purpose, nothing is wrong."
    )
