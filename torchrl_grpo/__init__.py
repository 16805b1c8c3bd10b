"""torchrl_grpo: Group Relative Policy Optimization for torchrl.

* :class:`MCAdvantage`: a replay-buffer transform that queues trajectories by group and writes
  group-relative advantages when a group is complete (a drop-in for torchrl's).
* :class:`GRPOLoss` and its presets: a critic-free ``ClipPPOLoss`` with the published variants.
* :class:`SameStartGroups`: a torchrl env transform that resets every seed G times and stamps
  each step with it, so that collectors deliver same-start groups for control tasks.
* :class:`TokenCategorical`: token log-probs and entropy for large vocabularies, memory-lean;
  :class:`HiddenTokenCategorical`: the same from hidden states and the output layer, chunk by
  chunk, without the logits.
* :class:`LeanTransformersWrapper`: torchrl's ``TransformersWrapper`` that scores tokens from
  hidden states, so that a GRPO step on torchrl's LLM stack never builds the logits.
* :class:`GroupSampler`: minibatches of whole groups, each stored row once per epoch, so that a
  group's shared prompt is scored once per minibatch.
* :class:`OverlongPenalty`: DAPO's soft overlong penalty, a reward transform.
* :func:`evaluate`: a policy's returns over N whole episodes of any torchrl env (each played to
  its own end, counted once), as an :class:`Evaluation`.
* :mod:`torchrl_grpo.advantages` and :mod:`torchrl_grpo.loss_terms`: the math, as pure functions.
"""

from torchrl_grpo.advantages import (
    group_mean,
    group_relative_advantage,
    group_std,
    trajectory_returns,
)
from torchrl_grpo.envs import SameStartGroups
from torchrl_grpo.evaluation import Evaluation, evaluate
from torchrl_grpo.llm import HiddenLLMMaskedCategorical, LeanTransformersWrapper
from torchrl_grpo.loss import (
    DAPO,
    CISPOLoss,
    CISPOLossOutput,
    DAPOLoss,
    DAPOLossOutput,
    DPPOLoss,
    DrGRPOLoss,
    GRPOLoss,
    GRPOLossOutput,
    GSPOLoss,
    LLMLossOutput,
    LUSPOLoss,
    SAPOLoss,
    TopKDistillationLoss,
    VESPOLoss,
    k3_kl_token_estimate,
)
from torchrl_grpo.mcadvantage import MCAdvantage, MCAdvantageSelector, RayMCAdvantage
from torchrl_grpo.rewards import OverlongPenalty
from torchrl_grpo.sampler import GroupSampler
from torchrl_grpo.token_dist import (
    HiddenTokenCategorical,
    TokenCategorical,
    log_probs_at_from_hidden,
    token_log_prob_entropy,
    token_log_prob_entropy_from_hidden,
    top_log_probs_from_hidden,
)

__version__ = "0.1.0"

__all__ = [
    "CISPOLoss",
    "CISPOLossOutput",
    "DAPO",
    "DAPOLoss",
    "DAPOLossOutput",
    "DPPOLoss",
    "DrGRPOLoss",
    "Evaluation",
    "GroupSampler",
    "GRPOLoss",
    "GRPOLossOutput",
    "GSPOLoss",
    "HiddenLLMMaskedCategorical",
    "HiddenTokenCategorical",
    "LLMLossOutput",
    "LUSPOLoss",
    "LeanTransformersWrapper",
    "MCAdvantage",
    "MCAdvantageSelector",
    "OverlongPenalty",
    "RayMCAdvantage",
    "SAPOLoss",
    "SameStartGroups",
    "TokenCategorical",
    "TopKDistillationLoss",
    "VESPOLoss",
    "evaluate",
    "group_mean",
    "group_relative_advantage",
    "group_std",
    "k3_kl_token_estimate",
    "log_probs_at_from_hidden",
    "token_log_prob_entropy",
    "token_log_prob_entropy_from_hidden",
    "top_log_probs_from_hidden",
    "trajectory_returns",
]
