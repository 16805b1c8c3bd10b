"""The variants of :class:`~torchrl_grpo.GRPOLoss`, one object each.

``GRPOLoss(actor, objective=..., corrections=[...], penalties=[...], aggregation=...)`` composes
them: its in-keys, what it reads, its buffers and its out-keys are the union over what it
holds. A variant is one class here; adding one is a subclass of the base of its stage
(:class:`Objective`, :class:`Exclusion`, :class:`Factor` or :class:`Penalty`, in
:mod:`~torchrl_grpo.loss.variants.base`: its ``slot``, ``reads``, ``ranges``, ``buffers()``,
``metrics()`` and its hook) and one line where it is used: ``corrections=[MyVariant(...)]``.

* objectives (:mod:`~torchrl_grpo.loss.variants.objectives`): :class:`Clip` (PPO's, with the
  dual or two-sided clip), :class:`CISPO`, :class:`SAPO`, :class:`VESPO`,
  :class:`CustomObjective`;
* corrections (:mod:`~torchrl_grpo.loss.variants.corrections`): :class:`KLMask`,
  :class:`TruncatedCompletions`, :class:`InferenceVeto`, :class:`Rejection` (tokens
  excluded), :class:`Decoupled`, :class:`InferenceCorrection`, :class:`TIS`,
  :class:`OffPolicyMask`, :class:`TrustRegion`, :class:`TopEntropy` (tokens zeroed or
  weighted);
* penalties (:mod:`~torchrl_grpo.loss.variants.penalties`): :class:`KLToReference`,
  :class:`KLToInference`, :class:`EntropyTarget`.
"""

from collections.abc import Mapping
from types import MappingProxyType

from torchrl_grpo.loss.variants.base import (
    Exclusion,
    Factor,
    Objective,
    Penalty,
    Range,
    Step,
    Variant,
    masked_fraction,
)
from torchrl_grpo.loss.variants.corrections import (
    TIS,
    Decoupled,
    InferenceCorrection,
    InferenceVeto,
    KLMask,
    OffPolicyMask,
    Rejection,
    TopEntropy,
    TruncatedCompletions,
    TrustRegion,
)
from torchrl_grpo.loss.variants.objectives import CISPO, SAPO, VESPO, Clip, CustomObjective
from torchrl_grpo.loss.variants.penalties import EntropyTarget, KLToInference, KLToReference

#: The package's own variant classes. Their schedulable values are buffers of every loss
#: (``None`` where it holds none of them), so that one left off at construction cannot be
#: scheduled on later; a user's variant class adds buffers only to the losses that hold it.
BUILTIN_VARIANTS: tuple[type[Variant], ...] = (
    Clip,
    CustomObjective,
    CISPO,
    SAPO,
    VESPO,
    KLMask,
    TruncatedCompletions,
    InferenceVeto,
    Rejection,
    Decoupled,
    InferenceCorrection,
    TIS,
    OffPolicyMask,
    TrustRegion,
    TopEntropy,
    KLToReference,
    KLToInference,
    EntropyTarget,
)


def builtin_ranges() -> Mapping[str, Range]:
    """The ranges of the schedulable values of :data:`BUILTIN_VARIANTS`, by buffer name.

    Examples:
        >>> from torchrl_grpo.loss.variants import builtin_ranges
        >>> builtin_ranges()["tis_cap"]
        ('positive', 0.0)
    """
    return MappingProxyType({k: v for cls in BUILTIN_VARIANTS for k, v in cls.ranges.items()})


__all__ = [
    "BUILTIN_VARIANTS",
    "CISPO",
    "SAPO",
    "TIS",
    "VESPO",
    "Clip",
    "CustomObjective",
    "Decoupled",
    "EntropyTarget",
    "Exclusion",
    "Factor",
    "InferenceCorrection",
    "InferenceVeto",
    "KLMask",
    "KLToInference",
    "KLToReference",
    "Objective",
    "OffPolicyMask",
    "Penalty",
    "Range",
    "Rejection",
    "Step",
    "TopEntropy",
    "TruncatedCompletions",
    "TrustRegion",
    "Variant",
    "builtin_ranges",
    "masked_fraction",
]
