"""The variants that add a term or steer the entropy bonus: ``penalties=[...]``.

:class:`KLToReference` and :class:`KLToInference` add ``loss_kl_to_ref`` /
``loss_kl_to_inference`` and their metrics; :class:`EntropyTarget` makes the entropy bonus's
coefficient adaptive (Skywork-OR1, TRL's ``use_adaptive_entropy``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from torchrl_grpo.loss.entropy import AdaptiveEntropy
from torchrl_grpo.loss.variants.base import Penalty, Step, lookup
from torchrl_grpo.loss_terms import KL_ESTIMATORS, importance_weighted_kl, masked_mean

__all__ = [
    "ENTROPY_COEFF_BOUNDS",
    "ENTROPY_COEFF_STEP",
    "EntropyTarget",
    "KLToInference",
    "KLToReference",
]

#: The adaptive entropy coefficient's ``(min, max)`` and step when not given: TRL's
#: ``entropy_coef_min``, ``entropy_coef_max`` and ``entropy_coef_delta``.
ENTROPY_COEFF_BOUNDS = (0.0, 1.0)
ENTROPY_COEFF_STEP = 0.005


class _KL(Penalty):
    """A KL penalty ``coeff * KL(pi_theta || other)``, per token by ``estimator``; its
    ``slot`` (``"kl_to_ref"``...) names its output's entries and its coefficient's buffer."""

    def __post_init__(self):
        lookup(KL_ESTIMATORS, self.estimator, "KL estimator")
        self._check_ranges()

    def buffers(self):
        return {f"{self.slot}_coeff": self.coeff}

    def metrics(self):
        return (self.slot, f"loss_{self.slot}")

    def _other(self, x):
        raise NotImplementedError

    def _estimate(self, step: Step) -> torch.Tensor:
        x = step.x
        return lookup(KL_ESTIMATORS, self.estimator, "KL estimator")(x.log_prob, self._other(x))

    def terms(self, step: Step, reduce: Callable) -> dict[str, torch.Tensor]:
        kl = self._estimate(step)  # (B, T)
        coeff = step.values[f"{self.slot}_coeff"]
        return {
            self.slot: masked_mean(kl, step.x.mask).detach(),
            f"loss_{self.slot}": coeff * reduce(kl),
        }


@dataclass(frozen=True)
class KLToReference(_KL):
    """The KL to a reference policy, ``beta_ref * KL`` (reads ``ref_log_prob``): torchrl's
    ``kl_to_ref_coeff``, schedulable as ``loss.kl_to_ref_coeff``.

    Args:
        coeff (float): ``beta_ref >= 0``.
        estimator (str or callable): ``"k1"``, ``"k2"``, ``"k3"`` (clamped, verl's
            ``low_var_kl``) or ``(log_prob, ref_log_prob) -> per-token estimate``. Defaults to
            ``"k3"``.
        unbiased (bool): DeepSeek-V3.2's unbiased KL (TRL's ``use_bias_correction_kl``): each
            token's estimate times its ``pi_theta / pi_old``, the ratio keeping its gradient
            (:func:`~torchrl_grpo.loss_terms.importance_weighted_kl`). Defaults to ``False``.

    Examples:
        >>> from torchrl_grpo.loss.variants import KLToReference
        >>> KLToReference(0.04, unbiased=True).metrics()
        ('kl_to_ref', 'loss_kl_to_ref')
    """

    coeff: float
    estimator: str | Callable = "k3"
    unbiased: bool = False
    slot: ClassVar[str] = "kl_to_ref"
    reads: ClassVar[tuple[str, ...]] = ("ref_log_prob",)
    ranges: ClassVar[dict] = {"kl_to_ref_coeff": ("non-negative", 0.0)}

    def _other(self, x):
        return x.ref_log_prob

    def _estimate(self, step: Step) -> torch.Tensor:
        kl = super()._estimate(step)
        if self.unbiased:  # r_t k_t, r against the sampler
            kl = importance_weighted_kl(kl, step.x.log_prob - step.x.old_log_prob)
        return kl


@dataclass(frozen=True)
class KLToInference(_KL):
    """The KL to the inference engine's policy, ``beta_inf * KL`` (reads
    ``inference_log_prob``, or ``sample_log_prob`` when absent, as torchrl): torchrl's
    ``kl_to_inference_coeff``, schedulable as ``loss.kl_to_inference_coeff``.

    Args:
        coeff (float): ``beta_inf >= 0``.
        estimator (str or callable): as :class:`KLToReference`'s. Defaults to ``"k3"``.

    Examples:
        >>> from torchrl_grpo.loss.variants import KLToInference
        >>> KLToInference(0.01).fallback
        True
    """

    coeff: float
    estimator: str | Callable = "k3"
    slot: ClassVar[str] = "kl_to_inference"
    reads: ClassVar[tuple[str, ...]] = ("inference_log_prob",)
    fallback: ClassVar[bool] = True
    ranges: ClassVar[dict] = {"kl_to_inference_coeff": ("non-negative", 0.0)}

    def _other(self, x):
        return x.inference_log_prob


@dataclass(frozen=True)
class EntropyTarget(Penalty):
    """Skywork-OR1's adaptive entropy coefficient (TRL's ``use_adaptive_entropy`` /
    ``entropy_target``): the loss's ``entropy_coeff`` becomes the coefficient's starting
    value, moved once per optimizer step by ``loss.update_entropy_coeff()`` toward keeping the
    entropy at ``target``, and applied only while the entropy last measured is at or below it.
    Its state is ``loss.adaptive_entropy``
    (:class:`~torchrl_grpo.loss.entropy.AdaptiveEntropy`), saved with the loss. Needs the
    entropy bonus; reports the applied ``entropy_coeff``.

    Args:
        target (float): the target entropy (nats per token), ``>= 0``.
        bounds (tuple of float): ``(min, max)`` of the coefficient. Defaults to ``(0.0, 1.0)``.
        step (float): its step per update, ``> 0``. Defaults to ``0.005``.

    Examples:
        >>> from torchrl_grpo.loss.variants import EntropyTarget
        >>> EntropyTarget(0.5)
        EntropyTarget(target=0.5, bounds=(0.0, 1.0), step=0.005)
    """

    target: float
    bounds: tuple[float, float] = ENTROPY_COEFF_BOUNDS
    step: float = ENTROPY_COEFF_STEP
    slot: ClassVar[str] = "entropy_target"

    def __post_init__(self):
        low, high = self.bounds
        if not (self.target >= 0 and 0 <= low <= high and self.step > 0):
            raise ValueError(
                "EntropyTarget (the adaptive entropy coefficient) needs target >= 0, "
                f"0 <= min <= max and step > 0, got {self.target}, ({low}, {high}), "
                f"{self.step}."
            )

    def metrics(self):
        return ("entropy_coeff",)

    def modules(self, device=None) -> dict[str, AdaptiveEntropy]:
        """The controller's state, which the loss holds as ``adaptive_entropy``."""
        low, high = self.bounds
        args = (float(self.target), float(low), float(high), float(self.step))
        return {"adaptive_entropy": AdaptiveEntropy(*args, device=device)}

    def check(self, held, settings) -> None:
        if not settings.entropy_bonus:
            raise ValueError("EntropyTarget adapts the entropy bonus: it needs entropy_bonus=True.")

    def coefficient(self, step: Step, coeff: torch.Tensor) -> torch.Tensor:
        """The coefficient this call applies; records the measured tokens' entropy."""
        measured = step.x.mask if step.measured is None else step.measured
        return step.modules["adaptive_entropy"].applied(coeff, step.x.entropy, measured)
