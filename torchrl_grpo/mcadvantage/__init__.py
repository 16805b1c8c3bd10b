"""The replay-buffer transform: :class:`MCAdvantage` and what it runs on one insertion.

How the folder reads (each module one step, :mod:`.insert` the order of an insertion):

* :mod:`.transform`: the torchrl-facing class (arguments, attributes, statistics, checkpoints);
* :mod:`.estimators`: how advantages are computed, one object (:class:`GroupRelative`,
  :class:`RewardToGo`, :class:`StepGroups`, :class:`Distillation`, a user's :class:`Estimator`);
* :mod:`.options`: the checked settings, one frozen record;
* :mod:`.records`: the records passed from step to step, and the state (data only);
* :mod:`.insert`: one insertion, top to bottom; :mod:`.replica`: where the state lives;
* the steps: :mod:`.tails` (trajectories across insertions), :mod:`.read` (the input read and
  checked), :mod:`.returns`, :mod:`.groups` (complete groups), :mod:`.release` (advantages
  written), :mod:`.filters`, :mod:`.stats`, :mod:`.pending` (what is held back),
  :mod:`.limits` (memory limits), :mod:`.distillation` (a teacher's per-token
  advantages);
* the pieces they share: :mod:`.steps` (dense or ragged steps), :mod:`.ids` (group ids),
  :mod:`.store` (the chunked store), :mod:`.registry` (ended trajectory ids);
* :mod:`.state_io` (checkpoints), :mod:`.shared` (the owner process of a shared transform),
  :mod:`.ray_actor` (the state in a Ray actor: :class:`RayMCAdvantage`), :mod:`.queues` (the
  view of the pending groups).
"""

from torchrl_grpo.mcadvantage.estimators import (
    ESTIMATORS,
    Distillation,
    Estimator,
    GroupRelative,
    RewardToGo,
    StepGroups,
)
from torchrl_grpo.mcadvantage.options import Limits, Staleness, TrajectoryIds
from torchrl_grpo.mcadvantage.queues import PendingGroups
from torchrl_grpo.mcadvantage.ray_actor import RayMCAdvantage
from torchrl_grpo.mcadvantage.transform import MCAdvantage, MCAdvantageSelector

__all__ = [
    "ESTIMATORS",
    "Distillation",
    "Estimator",
    "GroupRelative",
    "Limits",
    "MCAdvantage",
    "MCAdvantageSelector",
    "PendingGroups",
    "RayMCAdvantage",
    "RewardToGo",
    "Staleness",
    "StepGroups",
    "TrajectoryIds",
]
