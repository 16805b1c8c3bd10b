"""``torchrl_grpo.transform``: the transform's import path of earlier versions, kept so that user
code keeps working. The transform lives in :mod:`torchrl_grpo.mcadvantage`."""

from torchrl_grpo.mcadvantage import MCAdvantage, MCAdvantageSelector, PendingGroups

__all__ = ["MCAdvantage", "MCAdvantageSelector", "PendingGroups"]
