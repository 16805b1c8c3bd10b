"""GRPOLoss: torchrl's ClipPPOLoss without a critic, over real tokens, with GRPO's variants.

The loss reads the batch, lines every tensor up as ``(B, T)`` sequences with one mask of real
tokens, and calls the math of :mod:`torchrl_grpo.loss_terms`. Two kinds of policy are read:

* a torchrl probabilistic actor (``ProbabilisticActor``...), as ClipPPOLoss reads it: classic
  control (one action per step, from one head or several), or a token head over padded
  ``[B, T]`` responses;
* a torchrl LLM wrapper (``TransformersWrapper``, ``vLLMWrapper``: an ``LLMWrapperBase``), as
  :class:`torchrl.objectives.llm.GRPOLoss` reads it: ragged lazy stacks of
  ``("tokens", "full")`` with torchrl's masking strategies.

Everything that varies between the published variants is one object of
:mod:`torchrl_grpo.loss.variants`, composed by the loss: the surrogate (``objective=``: PPO's
clip with the dual or two-sided clip, CISPO, SAPO, VESPO), the tokens left out, zeroed or
weighted (``corrections=[...]``: the KL trust region, truncated completions, the veto, verl's
rejection modes, decoupled PPO, the inference corrections, OPSM, DPPO's trust region,
high-entropy tokens) and the penalties (``penalties=[...]``: the KL to the reference or to the
sampler, the adaptive entropy coefficient); the clip band, the ratio level and the aggregation
are keywords, as in torchrl. The flat keywords of earlier versions still work (mapped onto the
objects, with a deprecation note).
:class:`DAPOLoss`, :class:`DrGRPOLoss`, :class:`GSPOLoss`, :class:`CISPOLoss`,
:class:`SAPOLoss`, :class:`DPPOLoss`, :class:`VESPOLoss` and :class:`LUSPOLoss` are the same
class with the papers' defaults;
:class:`DAPO` is torchrl's name (GRPOLoss's defaults, a ``DAPOLossOutput``). Every name of the
GRPO family that ``torchrl.objectives.llm`` exports is here (:class:`LLMLossOutput` and the
outputs of each loss, ``k3_kl_token_estimate``; ``MCAdvantage`` and ``RayMCAdvantage`` in
:mod:`torchrl_grpo`).

The package, one concern a module: ``grpo.py`` (the module: keys, wiring, ``forward``),
``options.py`` (the keywords checked into one record), ``variants/`` (each variant one object),
``inputs.py`` (a batch read into aligned tensors), ``output.py`` (:class:`GRPOLossOutput`) and
``presets.py`` (the papers' defaults).
"""

from torchrl_grpo.loss.distill import TopKDistillationLoss, TopKDistillationLossOutput
from torchrl_grpo.loss.grpo import GRPOLoss
from torchrl_grpo.loss.inputs import LLM_KEYS as LLM_KEYS
from torchrl_grpo.loss.inputs import MASK_SOURCES as MASK_SOURCES
from torchrl_grpo.loss.inputs import MASKING_STRATEGIES as MASKING_STRATEGIES
from torchrl_grpo.loss.options import INFERENCE_CORRECTION_BOUNDS as INFERENCE_CORRECTION_BOUNDS
from torchrl_grpo.loss.options import SAPO_TEMPERATURES as SAPO_TEMPERATURES
from torchrl_grpo.loss.options import TORCHRL_AGGREGATIONS as TORCHRL_AGGREGATIONS
from torchrl_grpo.loss.output import (
    CISPOLossOutput,
    DAPOLossOutput,
    GRPOLossOutput,
    LLMLossOutput,
)
from torchrl_grpo.loss.presets import (
    DAPO,
    CISPOLoss,
    DAPOLoss,
    DPPOLoss,
    DrGRPOLoss,
    GSPOLoss,
    LUSPOLoss,
    SAPOLoss,
    VESPOLoss,
)
from torchrl_grpo.loss_terms import AGGREGATIONS as AGGREGATIONS
from torchrl_grpo.loss_terms import INFERENCE_CORRECTIONS as INFERENCE_CORRECTIONS
from torchrl_grpo.loss_terms import KL_ESTIMATORS as KL_ESTIMATORS
from torchrl_grpo.loss_terms import OBJECTIVES as OBJECTIVES
from torchrl_grpo.loss_terms import RATIO_LEVELS as RATIO_LEVELS
from torchrl_grpo.loss_terms import TRUST_REGIONS as TRUST_REGIONS
from torchrl_grpo.loss_terms import ObjectiveFn as ObjectiveFn
from torchrl_grpo.loss_terms import RatioLevel as RatioLevel
from torchrl_grpo.loss_terms import cispo_loss as cispo_loss
from torchrl_grpo.loss_terms import clip_fractions as clip_fractions
from torchrl_grpo.loss_terms import decoupled_behaviour_weight as decoupled_behaviour_weight
from torchrl_grpo.loss_terms import dual_clip_loss as dual_clip_loss
from torchrl_grpo.loss_terms import effective_sample_size as effective_sample_size
from torchrl_grpo.loss_terms import high_entropy_token_mask as high_entropy_token_mask
from torchrl_grpo.loss_terms import k3_kl_token_estimate as k3_kl_token_estimate
from torchrl_grpo.loss_terms import kl_trust_region_mask as kl_trust_region_mask
from torchrl_grpo.loss_terms import masked_mean as masked_mean
from torchrl_grpo.loss_terms import off_policy_sequence_mask as off_policy_sequence_mask
from torchrl_grpo.loss_terms import ppo_clip_loss as ppo_clip_loss
from torchrl_grpo.loss_terms import sapo_loss as sapo_loss
from torchrl_grpo.loss_terms import sequence_log_ratio as sequence_log_ratio
from torchrl_grpo.token_dist import token_log_prob_entropy as token_log_prob_entropy


def __getattr__(name: str):
    # the deprecated name of the callable alias (see torchrl_grpo.loss_terms.ObjectiveFn)
    if name == "Objective":
        import torchrl_grpo.loss_terms

        return torchrl_grpo.loss_terms.Objective
    # the lean wrapper's distribution, from its own package: the loss reads any distribution
    # with ``log_prob_entropy`` without importing it
    if name == "HiddenLLMMaskedCategorical":
        import warnings

        from torchrl_grpo.llm import HiddenLLMMaskedCategorical

        warnings.warn(
            "torchrl_grpo.loss.HiddenLLMMaskedCategorical is deprecated: import it from "
            "torchrl_grpo.llm.",
            DeprecationWarning,
            stacklevel=2,
        )
        return HiddenLLMMaskedCategorical
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CISPOLoss",
    "CISPOLossOutput",
    "DAPO",
    "DAPOLoss",
    "DAPOLossOutput",
    "DPPOLoss",
    "DrGRPOLoss",
    "GRPOLoss",
    "GRPOLossOutput",
    "GSPOLoss",
    "LLMLossOutput",
    "LUSPOLoss",
    "SAPOLoss",
    "TopKDistillationLoss",
    "TopKDistillationLossOutput",
    "VESPOLoss",
]
