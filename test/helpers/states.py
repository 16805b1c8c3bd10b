"""The transform's internal records built by hand, for the tests of its step modules: a pending
store of one-step trajectories with given group ids, and an insertion read as the transform
reads one."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torchrl.objectives.llm import MCAdvantageSelector

from helpers.trajectories import trajectory
from torchrl_grpo.mcadvantage.estimators import GroupRelative
from torchrl_grpo.mcadvantage.ids import PromptIds, TensorIds
from torchrl_grpo.mcadvantage.options import (
    GroupFilter,
    Keys,
    Limits,
    Options,
    Selection,
    TrajectoryKeys,
)
from torchrl_grpo.mcadvantage.read import read_insertion
from torchrl_grpo.mcadvantage.records import Pending, Returns
from torchrl_grpo.mcadvantage.steps import DenseSteps
from torchrl_grpo.mcadvantage.store import Chunks

KEYS = Keys(group="seed", reward=("next", "reward"), done=("next", "done"), advantage="advantage")


def ids_of(values):
    if isinstance(values[0], str):
        return PromptIds(list(values))
    return TensorIds(torch.tensor(values).reshape(len(values), -1))


def store(ids, arrival=None):
    """A store of one-step trajectories with these group ids (and insertion of arrival)."""
    if not ids:
        return Pending()
    n = len(ids)
    arrival = torch.zeros(n, dtype=torch.long) if arrival is None else torch.tensor(arrival)
    spans = torch.stack(
        [
            torch.zeros(n, dtype=torch.long),
            torch.arange(n),
            torch.ones(n, dtype=torch.long),
            arrival,
        ],
        1,
    )
    return Pending(
        chunks=Chunks().add(DenseSteps(TensorDict(step=torch.arange(n), batch_size=[n]))),
        spans=spans,
        ids=ids_of(ids),
        returns=Returns(torch.zeros(n, dtype=torch.float64), None),
    )


def insertion(ids, rewards=None, key="seed"):
    rewards = rewards or [0.0] * len(ids)
    trajs = [trajectory(g, [r], key=key) for g, r in zip(ids, rewards)]
    return read_insertion(torch.cat(trajs), KEYS._replace(group=key), Pending())


def options_of(
    *, estimator=None, group_filter=None, keys=KEYS, size=2, trajectory_return=None
) -> Options:
    """Settings for one step's test: GRPO's estimator, no filter, no limit, unless given."""
    return Options(
        grpo_size=size,
        verbose=False,
        keys=keys,
        trajectory_keys=TrajectoryKeys(traj=None, done=keys.done, count=None),
        trajectory_return=trajectory_return,
        estimator=estimator or GroupRelative(),
        group_filter=group_filter or GroupFilter(None, None),
        selection=Selection(size, size, MCAdvantageSelector()),
        limits=Limits(None, None, "drop_oldest"),
    )


def read(*trajs, state=None):
    """The trajectories as one insertion, read against ``state`` (default: nothing pending)."""
    return read_insertion(torch.cat(trajs), KEYS, state or Pending())


def hold(pending, batch, clock=0):
    """``pending`` with the whole insertion ``batch`` queued, nothing released; the returns are
    ``10 * Q + (0, 1, 2, ...)``, ``Q`` the trajectories held before."""
    from torchrl_grpo.mcadvantage.pending import remaining

    start = 10.0 * pending.num_pending
    value = torch.arange(batch.num_trajectories, dtype=torch.float64) + start
    return remaining(pending, batch, None, Returns(value, None), clock)


def uids(steps):
    """The ``uid`` of each of ``steps`` (dense or ragged), in order."""
    if steps.ragged:
        return [int(step["uid"]) for step in steps.data]
    return steps.data["uid"].tolist()
