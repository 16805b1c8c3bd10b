"""Loss terms of GRPO and its published variants, as pure functions on tensors.

Everything here takes plain tensors shaped ``(B, T)`` -- ``B`` sequences of ``T`` (padded)
tokens -- and, where padding matters, a boolean ``mask`` of the same shape that is ``True`` on
real tokens. No TensorDict, no keys, no modules: :class:`torchrl_grpo.GRPOLoss` fetches the
tensors and calls these functions.

Conventions:

* ``log_ratio`` is ``log pi_theta(a) - log pi_old(a)``; every ratio is handled in log space and
  clamped there, as :class:`torchrl.objectives.ClipPPOLoss` does, so that the two agree to the
  last bit.
* Surrogates return a per-token *loss* (the negated objective), to be reduced by one of the
  aggregations below.
* The functions never read padded entries in a way that can leak: callers are expected to have
  replaced padded values by finite numbers (``GRPOLoss`` writes zeros there), and every mean
  divides by the number of real tokens or non-empty sequences only.

References:

* PPO: Schulman et al., 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347.
* GRPO: Shao et al., 2024, "DeepSeekMath", arXiv:2402.03300.
* DAPO: Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
  arXiv:2503.14476.
* Dr. GRPO: Liu et al., 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
  arXiv:2503.20783.
* GSPO: Zheng et al., 2025, "Group Sequence Policy Optimization", arXiv:2507.18071.
* CISPO: MiniMax, 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
  Attention", arXiv:2506.13585.
* Dual clip: Ye et al., 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
  Learning", arXiv:1912.09729.
* KL estimators: Schulman, 2020, "Approximating KL Divergence",
  http://joschu.net/blog/kl-approx.html.
* Truncated importance sampling: Yao et al., 2025, "Your Efficient RL Framework Secretly Brings
  You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl.
* SAPO: Gao et al., 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347.
* IcePop: Ling Team, 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
  Thinking Model" (Ring-1T), arXiv:2510.18855.
* Off-policy sequence masking: DeepSeek-AI, 2025, "DeepSeek-V3.2", arXiv:2512.02556, Eq. 9.
* Decoupled PPO: Fu et al., 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning
  System for Language Reasoning", arXiv:2505.24298; Hilton et al., 2022, "Batch size-invariance
  for policy optimization", arXiv:2110.00641.
* High-entropy tokens: Wang et al., 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens
  Drive Effective Reinforcement Learning for LLM Reasoning", arXiv:2506.01939.
* DPPO: "Rethinking the Trust Region in LLM RL", 2026, arXiv:2602.04879 (verl's ``dppo_tv`` /
  ``dppo_kl``).
* Two-sided clip: Prime Intellect, 2025, "INTELLECT-2: A Reasoning Model Trained Through
  Globally Decentralized Reinforcement Learning", arXiv:2505.07291 (TRL's ``delta``).
* VESPO: 2026, arXiv:2602.10693 (TRL's ``loss_type="vespo"``).
* Adaptive entropy: He et al., 2025, "Skywork Open Reasoner 1 Technical Report",
  arXiv:2505.22312 (TRL's ``use_adaptive_entropy``).
* Mismatch diagnostics and the sequence veto: verl's ``rollout_corr_helper`` (0.9.0).

The package, one section a module: ``aggregations`` (masked means, the aggregations and their
sums), ``ratios`` (ratio levels, the inference corrections, the behaviour weight),
``objectives`` (the surrogates), ``kl`` (the estimators and the KL trust region), ``selection``
(tokens and sequences kept, dropped or vetoed; the adaptive entropy coefficient),
``rejection`` (verl's rejection modes, its perplexity metrics, DPPO's and VESPO's diagnostics) and
``diagnostics`` (ESS, clip fractions). Every public name is imported here: import them from
``torchrl_grpo.loss_terms``.

Shapes are checked at the top of the functions that combine per-token and per-sequence tensors
(rlax's habit): a ``(B,)`` advantage against a ``(B, T)`` ratio raises a ``ValueError`` instead
of broadcasting into a ``(B, B)`` loss.
"""

import warnings

from torchrl_grpo.loss_terms.aggregations import (
    AGGREGATION_SUMS,
    AGGREGATIONS,
    aggregate_seq_mean_token_mean,
    aggregate_seq_mean_token_sum,
    aggregate_seq_mean_token_sum_norm,
    aggregate_token_mean,
    aggregate_token_sum,
    aggregation_sum,
    masked_mean,
    register_aggregation,
)
from torchrl_grpo.loss_terms.diagnostics import (
    clip_fractions,
    effective_sample_size,
)
from torchrl_grpo.loss_terms.kl import (
    KL_ESTIMATORS,
    importance_weighted_kl,
    k3_kl_token_estimate,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_trust_region_mask,
    top_k_reverse_kl,
)
from torchrl_grpo.loss_terms.objectives import (
    MAX_LOG_RATIO,
    OBJECTIVES,
    SAPO_TEMPERATURES,
    VESPO_K,
    VESPO_LAMBDA,
    ObjectiveFn,
    cispo_loss,
    dual_clip_loss,
    ppo_clip_loss,
    sapo_loss,
    two_sided_clip_loss,
    vespo_loss,
)
from torchrl_grpo.loss_terms.ratios import (
    INFERENCE_CORRECTIONS,
    RATIO_LEVELS,
    RatioLevel,
    decoupled_behaviour_weight,
    mask_importance_weight,
    sequence_log_ratio,
    sequence_sum_log_ratio,
    truncate_importance_weight,
    truncated_is_weight,
)
from torchrl_grpo.loss_terms.rejection import (
    REJECTION_MODES,
    RejectionMode,
    dppo_truncation_fraction,
    perplexity_metrics,
    rejection_mask,
    vespo_phi_sequence_mean,
)
from torchrl_grpo.loss_terms.selection import (
    TRUST_REGIONS,
    adaptive_entropy_coeff,
    dppo_kl_mask,
    dppo_tv_mask,
    high_entropy_token_mask,
    inference_mismatch,
    masked_quantile,
    off_policy_sequence_mask,
    sequence_veto_mask,
)

__all__ = [
    "REJECTION_MODES",
    "RejectionMode",
    "dppo_truncation_fraction",
    "perplexity_metrics",
    "rejection_mask",
    "vespo_phi_sequence_mean",
    "ObjectiveFn",
    "RatioLevel",
    "SAPO_TEMPERATURES",
    "VESPO_K",
    "VESPO_LAMBDA",
    "AGGREGATIONS",
    "AGGREGATION_SUMS",
    "INFERENCE_CORRECTIONS",
    "KL_ESTIMATORS",
    "MAX_LOG_RATIO",
    "OBJECTIVES",
    "RATIO_LEVELS",
    "TRUST_REGIONS",
    "adaptive_entropy_coeff",
    "aggregate_token_sum",
    "aggregate_seq_mean_token_mean",
    "aggregate_seq_mean_token_sum",
    "aggregate_seq_mean_token_sum_norm",
    "aggregate_token_mean",
    "aggregation_sum",
    "register_aggregation",
    "cispo_loss",
    "clip_fractions",
    "decoupled_behaviour_weight",
    "dppo_kl_mask",
    "dppo_tv_mask",
    "dual_clip_loss",
    "effective_sample_size",
    "high_entropy_token_mask",
    "importance_weighted_kl",
    "inference_mismatch",
    "k3_kl_token_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_trust_region_mask",
    "mask_importance_weight",
    "masked_mean",
    "masked_quantile",
    "off_policy_sequence_mask",
    "ppo_clip_loss",
    "sapo_loss",
    "sequence_log_ratio",
    "sequence_sum_log_ratio",
    "sequence_veto_mask",
    "top_k_reverse_kl",
    "truncate_importance_weight",
    "truncated_is_weight",
    "two_sided_clip_loss",
    "vespo_loss",
]


def __getattr__(name: str):
    # ``Objective`` named this callable alias and the variant base of the loss: the alias is
    # ``ObjectiveFn`` now, the variant ``torchrl_grpo.loss.variants.Objective``
    if name == "Objective":
        warnings.warn(
            "torchrl_grpo.loss_terms.Objective is deprecated: the callable alias is ObjectiveFn "
            "(the variant base is torchrl_grpo.loss.variants.Objective).",
            DeprecationWarning,
            stacklevel=2,
        )
        return ObjectiveFn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
