"""The transform's counters: torchrl's ``MCAdvantage`` statistics, and those of its limits.

The counters are a plain dict in the state, replaced (never changed in place) by each insertion
that goes through, so that a rejected one changes none of them. What they need of the
returns (:func:`tally`) is read with the counts of the rounds; the completed groups' statistics
(:func:`group_stats`) stay 0-d tensors until the counters are read (:func:`snapshot`,
:func:`plain`): an insertion reads nothing of its own for them.
"""

from __future__ import annotations

import struct

import torch
from torch import Tensor

from torchrl_grpo.advantages import Segments
from torchrl_grpo.mcadvantage.host import read_ints
from torchrl_grpo.mcadvantage.records import Insertion, Released, Rounds, State
from torchrl_grpo.mcadvantage.store import LENGTH

__all__ = [
    "GROUP_STATS",
    "LAG_STATS",
    "STAT_NAMES",
    "count",
    "fresh_stats",
    "group_stats",
    "plain",
    "snapshot",
    "tally",
]

STAT_NAMES = (
    "completed_trajectories",
    "completed_decisions",
    "trajectory_return_sum",
    "trajectory_return_max",
    "successful_trajectories",
    "completed_groups",
    "written_groups",
    "dropped_groups",
    "rescued_groups",
    "selected_trajectories",
    "unselected_trajectories",
    # beyond torchrl: groups given up on by the memory limits (``max_pending_*``)
    "evicted_groups",
    "evicted_trajectories",
    # beyond torchrl: steps of unfinished trajectories given up (``traj_key``), held or arriving
    "evicted_steps",
    # beyond torchrl: trajectories left out for lagging more than ``max_policy_lag`` versions
    "stale_trajectories",
    # beyond torchrl: groups released with fewer than grpo_size trajectories (min_group_size)
    "short_groups",
    # beyond torchrl: groups whose unfinished trajectories a collector started again gave up
    # (a restart without SameStartGroups.resume): they can no longer complete
    "stranded_groups",
)
#: Beyond the counters: the policy lags of the groups the last insertion that completed any
#: completed (see :mod:`~torchrl_grpo.mcadvantage.staleness`); absent until known.
LAG_STATS = ("policy_lag_min", "policy_lag_max", "policy_lag_mean", "policy_version_spread")
#: Beyond the counters, with a return mode: the groups the last insertion that completed any
#: completed, their returns' mean and (Bessel) std averaged over the groups, as Trinity-RFT logs
#: them; absent until known.
GROUP_STATS = ("group_return_mean", "group_return_std")


def fresh_stats() -> dict:
    """Every counter at its start value (torchrl's, plus the eviction and staleness counters).

    Examples:
        >>> fresh_stats()["trajectory_return_max"], "policy_lag_max" in fresh_stats()
        (-inf, False)
    """
    stats = dict.fromkeys(STAT_NAMES, 0)
    stats["trajectory_return_sum"] = 0.0
    stats["trajectory_return_max"] = float("-inf")
    return stats


def tally(batch: Insertion, returns: Tensor, trajectory_return: str | None) -> tuple:
    """What :func:`count` needs of the incoming trajectories, as int64 tensors to read: the
    bits of the float64 sum and maximum of their summed rewards (torchrl sums the rewards,
    whatever the return mode) and how many are positive; one trajectory's sum alone. Empty
    without a return mode."""
    if trajectory_return is None:
        return ()
    if trajectory_return == "sum":
        sums = returns
    else:
        runs = Segments(None, lengths=batch.reward_lengths, width=batch.reward_width)
        sums = runs.sum(batch.rewards.double())  # (n,)
    if sums.shape[0] == 1:  # one value: read once
        return (sums.view(torch.int64).squeeze(0),)
    return sums.sum().view(torch.int64), sums.max().view(torch.int64), (sums > 0).sum()


def count(
    stats: dict,
    batch: Insertion,
    returns: Tensor,
    rounds: Rounds,
    released: Released,
    *,
    trajectory_return: str | None,
    group_size: int,
    tallied: list | None = None,
) -> dict:
    """The counters after an insertion (a new dict).

    Args:
        stats: before the insertion.
        batch: the insertion.
        returns: ``(n,)`` the incoming trajectories' float64 returns.
        rounds: the groups it completed.
        released: how many of them were selected and written.
        trajectory_return: the return mode (``None``: per-step samples).
        group_size: ``grpo_size``.
        tallied: :func:`tally`, read on the host (else read here).
    """
    stats = dict(stats)
    stats["completed_trajectories"] += batch.num_trajectories
    stats["completed_decisions"] += batch.num_steps
    if trajectory_return is not None:
        if tallied is None:
            tallied = read_ints(*tally(batch, returns, trajectory_return))
        if len(tallied) == 1:  # one trajectory
            total = most = _float(tallied[0])
            successful = int(total > 0)
        else:
            total, most, successful = _float(tallied[0]), _float(tallied[1]), tallied[2]
        stats["trajectory_return_sum"] += total
        stats["trajectory_return_max"] = max(stats["trajectory_return_max"], most)
        stats["successful_trajectories"] += successful
        stats["selected_trajectories"] += (rounds.selected + released.selected) * group_size
    stats["completed_groups"] += rounds.num_rounds + rounds.given_up
    stats["written_groups"] += released.written
    stats["dropped_groups"] += rounds.num_rounds - released.written + rounds.given_up
    stats["rescued_groups"] += rounds.rescued
    stats["unselected_trajectories"] += rounds.unselected
    return stats


def _float(bits: int) -> float:
    """The float64 whose bits are ``bits`` (a signed 64-bit integer)."""
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def group_stats(stats: dict, returns: Tensor, rounds: Rounds, group_size: int) -> dict:
    """The counters with the completed groups' :data:`GROUP_STATS` and ``short_groups``.

    Args:
        returns: ``(Q + n,)`` float64, the returns of pending ++ incoming trajectories.
        rounds: the groups the insertion completed.
        group_size: ``grpo_size``: a round with fewer members is a short group.
    """
    groups = Segments(rounds.member_round, rounds.num_rounds)
    values = returns[rounds.members]  # (M,)
    size = groups.count  # (R,)
    mean = groups.sum(values) / size
    square = groups.sum((values - groups.expand(mean)).square())
    std = (square / (size - 1).clamp_min(1)).sqrt()  # a group of one: 0
    return {  # 0-d tensors, read with the counters
        **stats,
        "short_groups": stats["short_groups"] + (size < group_size).sum(),
        "group_return_mean": mean.mean(),
        "group_return_std": std.mean(),
    }


def snapshot(state: State) -> dict:
    """The counters and the sizes of what is held: every name of torchrl's ``get_stats()``,
    and ``held_trajectories`` / ``held_steps`` of the unfinished tails."""
    stats = plain(state.stats)
    pending, tails = state.pending, state.tails
    counts = pending.ids.counts() if pending.num_pending else []
    stats.update(
        queued_groups=len(counts),
        queued_trajectories=pending.num_pending,
        max_queued_trajectories_per_group=max(counts, default=0),
        held_trajectories=tails.num_tails,
        held_steps=int(tails.pieces[:, LENGTH].sum()) if tails.pieces.shape[0] else 0,
    )
    return stats


def plain(stats: dict) -> dict:
    """The counters as Python numbers: those left as tensors by the insertions read at once.

    Examples:
        >>> import torch
        >>> plain({"written_groups": 2, "trajectory_return_sum": torch.tensor(1.5)})
        {'written_groups': 2, 'trajectory_return_sum': 1.5}
    """
    names = [name for name, value in stats.items() if isinstance(value, Tensor)]
    if not names:
        return dict(stats)
    values = torch.stack([stats[name].double() for name in names]).tolist()
    read = {
        name: value if stats[name].is_floating_point() else int(value)
        for name, value in zip(names, values)
    }
    return {**stats, **read}
