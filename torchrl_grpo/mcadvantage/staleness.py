"""Staleness: how many policy versions behind the data is, and what is too old to group.

In asynchronous GRPO the trajectories of one group may be sampled by policy versions far apart
(collectors sample while the trainer updates the weights). torchrl's ``PolicyVersion`` transform
writes the version of each step (``policy_version``); the transform reads it at each
trajectory's first step (:func:`~torchrl_grpo.mcadvantage.read.read_versions`). The *lag* of a
trajectory is ``reference - version``, the reference being the version the trainer sets
(``consumer_version``, as torchrl's ``StalenessAwareSampler``) or else the newest version read so
far. With ``max_policy_lag=K``, :func:`drop_stale` drops, at each insertion, the pending and the
incoming trajectories that lag by more than ``K`` (``stale_trajectories``): a group then
completes only with trajectories recent enough. :func:`lag_stats` reports the lags of the groups
an insertion completes, and their spread of versions, for a logger to plot.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchrl_grpo.mcadvantage import pending as pending_
from torchrl_grpo.mcadvantage.host import read_ints
from torchrl_grpo.mcadvantage.options import Options
from torchrl_grpo.mcadvantage.records import NO_VERSION, VERSION, Insertion, Pending, Rounds, State
from torchrl_grpo.mcadvantage.store import ranges

__all__ = ["drop_stale", "keep_trajectories", "lag_stats", "reference"]


def reference(options: Options, newest: int | None) -> int | None:
    """The version lags are measured against: the trainer's, else the newest read so far."""
    consumer = options.staleness.consumer_version
    return newest if consumer is None else int(consumer)


def drop_stale(options: Options, state: State, batch: Insertion | None):
    """``(state, batch)`` after an insertion's versions are read: the newest version updated,
    and, with ``max_policy_lag``, the pending and incoming trajectories that lag by more than it
    left out (counted in ``stale_trajectories``). ``batch`` becomes ``None`` if none is left."""
    max_lag = options.staleness.max_lag
    if max_lag is None and (batch is None or batch.versions is None):
        return state, batch  # nothing read, nothing bounded: the usual case, at no cost
    newest = state.newest_version
    if batch is not None and batch.versions is not None:
        top = batch.newest if batch.newest is not None else int(batch.versions.max())
        newest = top if newest is None else max(newest, top)
        state = state._replace(newest_version=newest)
    ref = reference(options, newest)
    if max_lag is None or ref is None:
        return state, batch
    pending = state.pending
    stale_pending = stale_incoming = None  # how many lag too much, read at once
    if pending.num_pending:
        stale_pending = _stale(pending.spans[:, VERSION], ref, max_lag)
    if batch is not None and batch.versions is not None:
        stale_incoming = _stale(batch.versions, ref, max_lag)
    gone_pending, gone_incoming = read_ints(
        None if stale_pending is None else stale_pending.sum(),
        None if stale_incoming is None else stale_incoming.sum(),
    )
    if gone_pending:
        pending = pending_.drop(pending, ~stale_pending)
    if gone_incoming:
        batch = keep_trajectories(batch, ~stale_incoming)
    gone = (gone_pending or 0) + (gone_incoming or 0)
    if gone:
        stats = {**state.stats, "stale_trajectories": state.stats["stale_trajectories"] + gone}
        state = state._replace(pending=pending, stats=stats)
    return state, batch


def _stale(versions: Tensor, ref: int, max_lag: int) -> Tensor:
    # known versions more than max_lag behind ref (NO_VERSION is never stale; no overflow)
    known = versions != NO_VERSION
    return known & (ref - torch.where(known, versions, ref) > max_lag)


def keep_trajectories(batch: Insertion, keep: Tensor) -> Insertion | None:
    """The insertion with only the trajectories where ``keep`` is True (``None`` if none).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_grpo.mcadvantage.ids import TensorIds
        >>> from torchrl_grpo.mcadvantage.steps import DenseSteps
        >>> batch = Insertion(
        ...     steps=DenseSteps(TensorDict(x=torch.arange(5), batch_size=[5])),
        ...     starts=torch.tensor([0, 2]), lengths=torch.tensor([2, 3]), width=0,
        ...     group_ids=TensorIds(torch.tensor([[7], [8]])), rewards=torch.arange(5.0),
        ...     reward_lengths=torch.tensor([2, 3]), reward_width=None, num_steps=5,
        ...     num_trajectories=2, versions=torch.tensor([1, 4]))
        >>> kept = keep_trajectories(batch, torch.tensor([False, True]))
        >>> kept.steps.data["x"], kept.rewards, kept.starts, kept.width, kept.versions
        (tensor([2, 3, 4]), tensor([2., 3., 4.]), tensor([0]), 3, tensor([4]))
    """
    index = keep.nonzero().squeeze(1)  # (n',)
    if not index.numel():
        return None
    lengths = batch.lengths.index_select(0, index)
    reward_lengths = batch.reward_lengths.index_select(0, index)
    reward_starts = torch.cumsum(batch.reward_lengths, 0) - batch.reward_lengths
    rewards = batch.rewards[ranges(reward_starts.index_select(0, index), reward_lengths)]
    return Insertion(
        steps=batch.steps.take(ranges(batch.starts.index_select(0, index), lengths)),
        starts=torch.cumsum(lengths, 0) - lengths,
        lengths=lengths,
        width=_common(lengths) or 0,
        group_ids=batch.group_ids.select(index),
        rewards=rewards,
        reward_lengths=reward_lengths,
        reward_width=None if batch.reward_width is None else _common(reward_lengths) or 0,
        num_steps=int(lengths.sum()),
        num_trajectories=index.numel(),
        versions=None if batch.versions is None else batch.versions.index_select(0, index),
    )


def _common(lengths: Tensor) -> int | None:
    # the length every entry has, or None
    first = int(lengths[0])
    return first if bool((lengths == first).all()) else None


def lag_stats(
    stats: dict, pending: Pending, batch: Insertion, rounds: Rounds, ref: int | None
) -> dict:
    """``stats`` with the lag statistics (:data:`~torchrl_grpo.mcadvantage.stats.LAG_STATS`:
    the least, largest and mean lag of their trajectories, and the largest spread of versions
    inside one group) of the groups ``rounds`` completes (unchanged when they
    complete none, or none of their trajectories has a version). ``pending`` is what the
    rounds were numbered with (pending first, then ``batch``)."""
    if ref is None or not rounds.num_rounds:
        return stats
    incoming = batch.versions
    if incoming is None:
        incoming = torch.full((batch.num_trajectories,), NO_VERSION, dtype=torch.long)
    versions = torch.cat([pending.spans[:, VERSION], incoming]).index_select(0, rounds.members)
    known = versions != NO_VERSION
    versions, group = versions.double(), rounds.member_round
    size = (rounds.num_rounds,)
    top = torch.full(size, -torch.inf, dtype=torch.float64).scatter_reduce(
        0, group, versions.masked_fill(~known, -torch.inf), "amax"
    )
    bottom = torch.full(size, torch.inf, dtype=torch.float64).scatter_reduce(
        0, group, versions.masked_fill(~known, torch.inf), "amin"
    )
    lag = ref - versions
    count = known.sum()
    values = torch.stack(  # read at once (lags are whole numbers: their sum is exact)
        [
            count.double(),
            lag.masked_fill(~known, torch.inf).min(),
            lag.masked_fill(~known, -torch.inf).max(),
            lag.masked_fill(~known, 0.0).sum() / count,
            (top - bottom).masked_fill(~torch.isfinite(top), -torch.inf).max(),
        ]
    ).tolist()
    if not values[0]:
        return stats
    names = ("policy_lag_min", "policy_lag_max", "policy_lag_mean", "policy_version_spread")
    return {**stats, **dict(zip(names, values[1:]))}
