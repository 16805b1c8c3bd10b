"""The variants that leave tokens out of the loss or weigh them: ``corrections=[...]``.

Two stages (see :mod:`torchrl_grpo.loss.variants.base`): *excluded* tokens
(:class:`~torchrl_grpo.loss.variants.Exclusion`) leave the loss terms and the aggregation's
denominator (:class:`KLMask`, :class:`TruncatedCompletions`,
:class:`InferenceVeto`); *zeroed or weighted* tokens
(:class:`~torchrl_grpo.loss.variants.Factor`) keep their place in the denominator, as the
papers write them (:class:`Decoupled`, :class:`InferenceCorrection`, :class:`TIS`,
:class:`OffPolicyMask`, :class:`TrustRegion`, :class:`TopEntropy`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from torchrl_grpo.loss.variants.base import (
    Exclusion,
    Factor,
    Step,
    check_range,
    lookup,
    masked_fraction,
)
from torchrl_grpo.loss_terms import (
    INFERENCE_CORRECTIONS,
    TRUST_REGIONS,
    decoupled_behaviour_weight,
    dppo_truncation_fraction,
    high_entropy_token_mask,
    kl_trust_region_mask,
    off_policy_sequence_mask,
    rejection_mask,
    sequence_veto_mask,
)

__all__ = [
    "INFERENCE_CORRECTION_BOUNDS",
    "TIS",
    "TRUST_REGION_BOUNDS",
    "Decoupled",
    "InferenceCorrection",
    "InferenceVeto",
    "KLMask",
    "OffPolicyMask",
    "Rejection",
    "TopEntropy",
    "TruncatedCompletions",
    "TrustRegion",
]

#: The inference band when ``InferenceCorrection`` is given no bounds: TRL's
#: ``vllm_importance_sampling_clip_min`` / ``_clip_max`` defaults.
INFERENCE_CORRECTION_BOUNDS = (None, 3.0)
#: DPPO's bounds ``(delta_low, delta_high)`` when none are given: verl's DPPO recipe
#: (``examples/dppo_trainer``: 0.15 for the total variation, 0.05 for the binary KL).
TRUST_REGION_BOUNDS = {"dppo_tv": (0.15, 0.15), "dppo_kl": (0.05, 0.05)}


def _log_weight(step: Step) -> torch.Tensor:
    """``log pi_old - log pi_inference`` per token: the trainer against the sampler."""
    return step.x.old_log_prob - step.x.inference_log_prob


# --- excluded: out of the loss terms and of the denominator --------------------------------------


@dataclass(frozen=True)
class KLMask(Exclusion):
    """torchrl's KL-Mask: tokens whose ``0.5 * (log pi_theta - log pi_old)**2`` exceeds
    ``threshold`` leave the loss terms (:func:`~torchrl_grpo.loss_terms.kl_trust_region_mask`).
    torchrl's ``kl_mask_threshold``; schedulable as ``loss.kl_mask_threshold``.

    Examples:
        >>> from torchrl_grpo.loss.variants import KLMask
        >>> KLMask(0.1).buffers()
        {'kl_mask_threshold': 0.1}
    """

    threshold: float
    slot: ClassVar[str] = "kl_mask"
    ranges: ClassVar[dict] = {"kl_mask_threshold": ("positive", 0.0)}

    def buffers(self):
        return {"kl_mask_threshold": self.threshold}

    def exclude(self, step: Step):
        x = step.x
        return kl_trust_region_mask(
            x.log_prob - step.ratio_base, step.values["kl_mask_threshold"]
        ), {}


@dataclass(frozen=True)
class TruncatedCompletions(Exclusion):
    """Truncated completions leave the loss (TRL's ``mask_truncated_completions``, DAPO's
    overlong filtering). Reads ``truncated`` (per sequence or per token); with an LLM wrapper
    and no such entry, a completion is truncated when its last token is neither the
    tokenizer's EOS nor its pad token (TRL's rule). Reports ``truncated_fraction``.

    Examples:
        >>> from torchrl_grpo.loss.variants import TruncatedCompletions
        >>> TruncatedCompletions().metrics()
        ('truncated_fraction',)
    """

    slot: ClassVar[str] = "truncated"
    reads: ClassVar[tuple[str, ...]] = ("truncated",)

    def metrics(self):
        return ("truncated_fraction",)

    def exclude(self, step: Step):
        x = step.x
        truncated = (x.truncated & x.mask).any(-1)  # (B,)
        fraction = (truncated.sum() / x.mask.any(-1).sum()).to(x.log_prob.dtype)
        return ~x.truncated, {"truncated_fraction": fraction}


@dataclass(frozen=True)
class InferenceVeto(Exclusion):
    """The veto: a sequence whose worst token's mismatch ``rho - 1 - log rho`` (``rho =
    pi_old / pi_inference``) exceeds ``threshold`` leaves the loss terms
    (:func:`~torchrl_grpo.loss_terms.sequence_veto_mask`; verl's ``seq_max_k3`` rejection).
    Reads ``inference_log_prob``; reports ``inference_vetoed_fraction``; schedulable as
    ``loss.inference_veto_threshold``.

    Examples:
        >>> from torchrl_grpo.loss.variants import InferenceVeto
        >>> InferenceVeto(0.5).reads
        ('inference_log_prob',)
    """

    threshold: float
    slot: ClassVar[str] = "veto"
    reads: ClassVar[tuple[str, ...]] = ("inference_log_prob",)
    ranges: ClassVar[dict] = {"inference_veto_threshold": ("positive", 0.0)}

    def buffers(self):
        return {"inference_veto_threshold": self.threshold}

    def metrics(self):
        return ("inference_vetoed_fraction",)

    def exclude(self, step: Step):
        x = step.x
        kept = sequence_veto_mask(
            _log_weight(step), x.mask, step.values["inference_veto_threshold"]
        )
        vetoed = (x.mask.any(-1) & ~kept.any(-1)).sum() / x.mask.any(-1).sum()
        return kept, {"inference_vetoed_fraction": vetoed.to(x.log_prob.dtype)}


@dataclass(frozen=True)
class Rejection(Exclusion):
    """verl's rejection (``rollout_rs`` / ``rollout_rs_threshold``): the tokens or sequences a
    mode of :data:`~torchrl_grpo.loss_terms.REJECTION_MODES` rejects leave the loss terms and
    the token mean's denominator, as in verl's default (decoupled) mode, which writes the
    result over its ``response_mask`` (:func:`~torchrl_grpo.loss_terms.rejection_mask`).
    Reads ``inference_log_prob``; reports ``inference_rejected_fraction``, the share of real
    tokens rejected.

    Args:
        modes (str or Sequence[str]): ``"token_k1"``, ``"seq_mean_k3"``...; chained as verl
            (``"token_k1,seq_max_k2"``: a token stays only if every mode keeps it).
        thresholds (float, str or Sequence): one entry for every mode or one per mode; an upper
            bound, or for a ``k1`` mode a band ``"low_high"`` (``"0.5_2.0"``).

    Examples:
        >>> from torchrl_grpo.loss.variants import Rejection
        >>> Rejection("token_k1,seq_max_k2", "0.4_1.8,3.0").metrics()
        ('inference_rejected_fraction',)
    """

    modes: str | tuple[str, ...]
    thresholds: float | str | tuple
    slot: ClassVar[str] = "rejection"
    reads: ClassVar[tuple[str, ...]] = ("inference_log_prob",)

    def __post_init__(self):
        probe = torch.zeros(1, 1)  # checks the modes and thresholds now, as verl's parser
        rejection_mask(probe, probe.bool(), self.modes, self.thresholds)

    def metrics(self):
        return ("inference_rejected_fraction",)

    def exclude(self, step: Step):
        x = step.x
        keep = rejection_mask(_log_weight(step), x.mask, self.modes, self.thresholds)
        return keep, {"inference_rejected_fraction": masked_fraction(keep, x)}


# --- zeroed or weighted in loss_objective, kept in the denominator -------------------------------


@dataclass(frozen=True)
class Decoupled(Factor):
    """Decoupled PPO (AReaL): the ratio and its clip are taken against ``proximal_log_prob``
    (the policy before this update), and each token's objective is weighted by ``pi_prox /
    pi_behav`` (:func:`~torchrl_grpo.loss_terms.decoupled_behaviour_weight`).

    Args:
        behaviour_weight_cap (float, optional): tokens whose behaviour weight exceeds it are
            zeroed (AReaL's ``behav_imp_weight_cap``, ``> 1``). Schedulable as
            ``loss.behaviour_weight_cap``.

    Examples:
        >>> from torchrl_grpo.loss.variants import Decoupled
        >>> Decoupled(behaviour_weight_cap=5.0).metrics()
        ('behaviour_masked_fraction',)
    """

    behaviour_weight_cap: float | None = None
    slot: ClassVar[str] = "decoupled"
    reads: ClassVar[tuple[str, ...]] = ("proximal_log_prob",)
    ranges: ClassVar[dict] = {"behaviour_weight_cap": ("greater than", 1.0)}

    def buffers(self):
        return {"behaviour_weight_cap": self.behaviour_weight_cap}

    def metrics(self):
        return ("behaviour_masked_fraction",)

    def factor(self, step: Step):
        x = step.x
        cap = step.values["behaviour_weight_cap"]
        weight, keep = decoupled_behaviour_weight(x.proximal_log_prob, x.old_log_prob, cap)
        return weight, keep, {"behaviour_masked_fraction": masked_fraction(keep, x)}


class _Inference(Factor):
    """A weight against the inference engine, ``rho = pi_old / pi_inference``, truncated or
    masked outside a band; reports ``inference_masked_fraction``."""

    slot: ClassVar[str] = "inference_correction"
    reads: ClassVar[tuple[str, ...]] = ("inference_log_prob",)

    def metrics(self):
        return ("inference_masked_fraction",)

    def _apply(self, fn, step: Step, low, high):
        x = step.x
        weight, keep = fn(_log_weight(step), x.mask, low, high)
        return weight, keep, {"inference_masked_fraction": masked_fraction(keep, x)}


@dataclass(frozen=True)
class InferenceCorrection(_Inference):
    """Correct the trainer/inference mismatch with ``rho = pi_old / pi_inference`` (TRL's
    ``vllm_importance_sampling_mode``): each token's objective is multiplied by the weight (0
    where masked).

    Args:
        mode (str or callable): a key of
            :data:`~torchrl_grpo.loss_terms.INFERENCE_CORRECTIONS` (``"token_truncate"``: TIS;
            ``"sequence_truncate"``; ``"token_mask"``: IcePop; ``"sequence_mask"``: TRL's
            default) or ``(log_weight, mask, low, high) -> (weight, keep)``.
        bounds (tuple, optional): ``(low, high)``, either ``None`` for none. Defaults to
            ``(None, 3.0)`` (TRL's). Schedulable as ``loss.inference_correction_low`` /
            ``_high``.

    Examples:
        >>> from torchrl_grpo.loss.variants import InferenceCorrection
        >>> InferenceCorrection("token_mask", (0.5, 5.0)).buffers()
        {'inference_correction_low': 0.5, 'inference_correction_high': 5.0}
    """

    mode: str | Callable = "sequence_mask"
    bounds: tuple[float | None, float | None] | None = None
    ranges: ClassVar[dict] = {
        "inference_correction_low": ("non-negative", 0.0),
        "inference_correction_high": ("positive", 0.0),
    }

    def __post_init__(self):
        lookup(INFERENCE_CORRECTIONS, self.mode, "inference_correction")
        given = self.bounds
        low, high = INFERENCE_CORRECTION_BOUNDS if given is None else given
        if (low is not None and not low >= 0) or (high is not None and not high > 0):
            raise ValueError(
                f"inference_correction_bounds must be a low >= 0 and a high > 0, got {given}."
            )
        if low is not None and high is not None and low >= high:
            raise ValueError(f"inference_correction_bounds must have low < high, got {given}.")
        object.__setattr__(self, "bounds", (low, high))

    def buffers(self):
        low, high = self.bounds
        return {"inference_correction_low": low, "inference_correction_high": high}

    def factor(self, step: Step):
        fn = lookup(INFERENCE_CORRECTIONS, self.mode, "inference_correction")
        low, high = (
            step.values["inference_correction_low"],
            step.values["inference_correction_high"],
        )
        return self._apply(fn, step, low, high)


@dataclass(frozen=True)
class TIS(_Inference):
    """Truncated importance sampling (Yao et al., 2025): each token's loss times ``min(pi_old /
    pi_inference, cap)``, without gradient; ``InferenceCorrection("token_truncate", (None,
    cap))`` with the cap schedulable as ``loss.tis_cap``.

    Examples:
        >>> from torchrl_grpo.loss.variants import TIS
        >>> TIS(2.0).buffers()
        {'tis_cap': 2.0}
    """

    cap: float
    ranges: ClassVar[dict] = {"tis_cap": ("positive", 0.0)}

    def buffers(self):
        return {"tis_cap": self.cap}

    def factor(self, step: Step):
        return self._apply(
            INFERENCE_CORRECTIONS["token_truncate"], step, None, step.values["tis_cap"]
        )


@dataclass(frozen=True)
class OffPolicyMask(Factor):
    """DeepSeek-V3.2's off-policy sequence masking: a sequence with a negative advantage whose
    mean ``log pi_inference - log pi_theta`` exceeds ``threshold`` is zeroed
    (:func:`~torchrl_grpo.loss_terms.off_policy_sequence_mask`; TRL's
    ``off_policy_mask_threshold``). Reads ``inference_log_prob`` (``sample_log_prob`` when
    absent); schedulable as ``loss.off_policy_mask_threshold``.

    Examples:
        >>> from torchrl_grpo.loss.variants import OffPolicyMask
        >>> OffPolicyMask(0.05).fallback
        True
    """

    threshold: float
    slot: ClassVar[str] = "off_policy_mask"
    reads: ClassVar[tuple[str, ...]] = ("inference_log_prob",)
    fallback: ClassVar[bool] = True
    ranges: ClassVar[dict] = {"off_policy_mask_threshold": ("positive", 0.0)}

    def buffers(self):
        return {"off_policy_mask_threshold": self.threshold}

    def metrics(self):
        return ("off_policy_masked_fraction",)

    def factor(self, step: Step):
        x = step.x
        threshold = step.values["off_policy_mask_threshold"]
        keep = off_policy_sequence_mask(
            x.log_prob, x.inference_log_prob, x.advantage, x.mask, threshold
        )
        return None, keep, {"off_policy_masked_fraction": masked_fraction(keep, x)}


@dataclass(frozen=True)
class TrustRegion(Factor):
    """DPPO's trust region on the probabilities: a token whose probability moved past the bound
    in its advantage's direction is zeroed, measured against the policy the ratio is taken
    against.

    Args:
        mode (str or callable): ``"dppo_tv"`` (:func:`~torchrl_grpo.loss_terms.dppo_tv_mask`),
            ``"dppo_kl"`` (:func:`~torchrl_grpo.loss_terms.dppo_kl_mask`) or ``(log_prob,
            old_log_prob, advantage, mask, low, high) -> keep``.
        bounds (float or tuple, optional): ``(delta_low, delta_high)`` (a float for both).
            Defaults to ``0.15`` for ``"dppo_tv"``, ``0.05`` for ``"dppo_kl"``; required for a
            callable. Schedulable as ``loss.trust_region_low`` / ``_high``.

    Examples:
        >>> from torchrl_grpo.loss.variants import TrustRegion
        >>> TrustRegion("dppo_kl").buffers()
        {'trust_region_low': 0.05, 'trust_region_high': 0.05}
    """

    mode: str | Callable = "dppo_tv"
    bounds: float | tuple[float, float] | None = None
    slot: ClassVar[str] = "trust_region"
    ranges: ClassVar[dict] = {
        "trust_region_low": ("positive", 0.0),
        "trust_region_high": ("positive", 0.0),
    }

    def __post_init__(self):
        lookup(TRUST_REGIONS, self.mode, "trust_region")
        bounds = self.bounds
        if bounds is None:
            if callable(self.mode):
                raise ValueError("a callable trust_region needs trust_region_bounds=(low, high).")
            bounds = TRUST_REGION_BOUNDS[self.mode]
        low, high = bounds if isinstance(bounds, (tuple, list)) else (bounds, bounds)
        check_range("trust_region_low", low, self.ranges)
        check_range("trust_region_high", high, self.ranges)
        object.__setattr__(self, "bounds", (float(low), float(high)))

    def buffers(self):
        low, high = self.bounds
        return {"trust_region_low": low, "trust_region_high": high}

    def metrics(self):
        return ("trust_region_masked_fraction", "trust_region_capped_fraction")

    def factor(self, step: Step):
        x = step.x
        fn = lookup(TRUST_REGIONS, self.mode, "trust_region")
        low, high = step.values["trust_region_low"], step.values["trust_region_high"]
        keep = fn(x.log_prob, step.ratio_base, x.advantage, x.mask, low, high)
        # verl's pg_clipfrac_lower: kept tokens whose ratio the weight's cap 1 + eps_high cuts
        cap = step.log_clip_bounds[1].exp()
        log_ratio = x.log_prob.detach() - step.ratio_base
        capped = dppo_truncation_fraction(log_ratio, keep, x.mask, cap)
        metrics = {"trust_region_masked_fraction": masked_fraction(keep, x)}
        return None, keep, {**metrics, "trust_region_capped_fraction": capped.to(x.log_prob.dtype)}


@dataclass(frozen=True)
class TopEntropy(Factor):
    """``loss_objective`` only on the real tokens whose entropy is in the top ``quantile`` of
    the batch (:func:`~torchrl_grpo.loss_terms.high_entropy_token_mask`; TRL's
    ``top_entropy_quantile``, ``0.2`` in Wang et al., 2025); the adaptive entropy coefficient
    then measures those tokens (TRL's). The entropy is computed even without the entropy
    bonus. Schedulable as ``loss.top_entropy_quantile``.

    Examples:
        >>> from torchrl_grpo.loss.variants import TopEntropy
        >>> TopEntropy(0.2).entropy
        True
    """

    quantile: float
    slot: ClassVar[str] = "top_entropy"
    entropy: ClassVar[bool] = True
    ranges: ClassVar[dict] = {"top_entropy_quantile": ("in [0, 1]", 0.0)}

    def buffers(self):
        return {"top_entropy_quantile": self.quantile}

    def factor(self, step: Step):
        kept = high_entropy_token_mask(
            step.x.entropy, step.loss_mask, step.values["top_entropy_quantile"]
        )
        step.measured = kept
        return None, kept, {}
