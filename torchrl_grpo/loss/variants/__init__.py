"""The variants of :class:`~torchrl_grpo.GRPOLoss`, one object each.

``GRPOLoss(actor, objective=..., corrections=[...], penalties=[...], aggregation=...)`` composes
them: its in-keys, what it reads and its out-keys are the union over what it holds. A variant is
one class here; adding one is a subclass of :class:`~torchrl_grpo.loss.variants.base.Variant`
(its ``slot``, ``stage``, ``reads``, ``ranges``, ``buffers()``, ``metrics()`` and its math) and
one line where it is used: ``corrections=[MyVariant(...)]``.

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

from torchrl_grpo.loss.variants.base import Objective, Step, Variant
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

__all__ = [
    "CISPO",
    "SAPO",
    "TIS",
    "VESPO",
    "Clip",
    "CustomObjective",
    "Decoupled",
    "EntropyTarget",
    "InferenceCorrection",
    "InferenceVeto",
    "KLMask",
    "KLToInference",
    "KLToReference",
    "Objective",
    "OffPolicyMask",
    "Rejection",
    "Step",
    "TopEntropy",
    "TruncatedCompletions",
    "TrustRegion",
    "Variant",
]
