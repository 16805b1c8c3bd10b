"""torchrl_grpo: Group Relative Policy Optimization for torchrl.

* :class:`MCAdvantage`: a replay-buffer transform that queues trajectories by group and writes
  group-relative advantages when a group is complete (a drop-in for torchrl's).
* :mod:`torchrl_grpo.advantages`: the estimators as pure functions on tensors.
"""

from torchrl_grpo.advantages import (
    group_mean,
    group_relative_advantage,
    group_std,
    trajectory_returns,
)
from torchrl_grpo.transform import MCAdvantage, MCAdvantageSelector

__version__ = "0.1.0"

__all__ = [
    "MCAdvantage",
    "MCAdvantageSelector",
    "group_mean",
    "group_relative_advantage",
    "group_std",
    "trajectory_returns",
]
