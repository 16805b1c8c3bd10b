"""The settings of a :class:`~torchrl_grpo.GRPOLoss`, checked once into a frozen record.

:func:`loss_options` takes the loss's keywords as given, rejects what cannot work together
(before any module is built, so that a bad call leaves nothing half-made), composes the variants
(:mod:`torchrl_grpo.loss.variants`: the objective, the corrections and the penalties, the flat
keywords of earlier versions mapped onto them), resolves the ratio level and the aggregation
from the registries of :mod:`torchrl_grpo.loss_terms`, and returns a :class:`LossOptions` that
``GRPOLoss.__init__`` wires into the module.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType, SimpleNamespace
from typing import Any

import torch
from torchrl.modules.llm import LLMWrapperBase

from torchrl_grpo.loss.inputs import MASKING_STRATEGIES
from torchrl_grpo.loss.variants import (
    Exclusion,
    Factor,
    Objective,
    Penalty,
    Range,
    Variant,
    builtin_ranges,
)
from torchrl_grpo.loss.variants.base import check_range, lookup
from torchrl_grpo.loss.variants.corrections import (
    INFERENCE_CORRECTION_BOUNDS,
    TRUST_REGION_BOUNDS,
)
from torchrl_grpo.loss.variants.flat import FLAT_KEYWORDS, TORCHRL_KEYWORDS, from_keywords
from torchrl_grpo.loss.variants.objectives import SAPO_TEMPERATURES, objective_from_name
from torchrl_grpo.loss.variants.penalties import ENTROPY_COEFF_BOUNDS, ENTROPY_COEFF_STEP
from torchrl_grpo.loss_terms import AGGREGATIONS, RATIO_LEVELS, VESPO_K, VESPO_LAMBDA

__all__ = [
    "CLIP_EPSILON_BUFFERS",
    "COEFFICIENTS",
    "ENTROPY_COEFF_BOUNDS",
    "ENTROPY_COEFF_STEP",
    "INFERENCE_CORRECTION_BOUNDS",
    "SAPO_TEMPERATURES",
    "TORCHRL_AGGREGATIONS",
    "TRUST_REGION_BOUNDS",
    "UNUSED_KEYS",
    "VESPO_K",
    "VESPO_LAMBDA",
    "LossOptions",
    "check_clip_bound",
    "check_scheduled",
    "loss_options",
]

#: torchrl's ``GRPOLoss(aggregation=...)`` names, as this loss's aggregations.
TORCHRL_AGGREGATIONS = {"prompt_mean": "seq_mean_token_mean"}
#: The values every GRPOLoss keeps as schedulable buffers (``loss.tis_cap = 1.5``), on top of
#: ClipPPOLoss's ``clip_epsilon`` and ``entropy_coeff``: those of the package's own variants
#: (:data:`~torchrl_grpo.loss.variants.BUILTIN_VARIANTS`), ``None`` when the loss holds no
#: variant with it. A variant of the user's adds its own to the losses that hold it only.
COEFFICIENTS = tuple(builtin_ranges())

_NO_CRITIC = "GRPO has no critic: the advantage comes with the batch (torchrl_grpo.MCAdvantage)"
_NO_ESTIMATOR = (
    "GRPO has no value estimator: returns and advantages are written by "
    "torchrl_grpo.MCAdvantage (trajectory_return=...)"
)
_GROUP_NORMALISED = (
    "advantages are normalised per group by torchrl_grpo.MCAdvantage (scale_rewards=...)"
)
#: ClipPPOLoss / torchrl GRPOLoss keywords (torchrl 0.14.1) that have no meaning here, and what
#: replaces them. ``actor`` is not here: it is taken as ClipPPOLoss takes it (``actor_network``).
_REPLACED_KEYWORDS = {
    **dict.fromkeys(
        (
            "critic_network",
            "critic",
            "critic_coeff",
            "critic_coef",
            "loss_critic_type",
            "clip_value",
            "value_key",
            "value_target_key",
            "separate_losses",
            "log_explained_variance",
        ),
        _NO_CRITIC,
    ),
    **dict.fromkeys(("gamma", "lmbda"), _NO_ESTIMATOR),
    **dict.fromkeys(("normalize_advantage", "normalize_advantage_exclude_dims"), _GROUP_NORMALISED),
    "advantage_norm": "there is no value target to scale advantages by: " + _GROUP_NORMALISED,
    "delay_actor": "PPO-EWMA's proximal policy is not built in; decoupled PPO reads the proximal "
    "policy's log-probs from the batch: use corrections=[Decoupled()] and "
    "set_keys(proximal_log_prob=...)",
    "max_importance_ratio": "ClipPPOLoss's cap on pi_theta / pi_behav has no equivalent here. "
    "To cap the importance weight against the inference engine, min(pi_old / pi_inference, cap), "
    "use corrections=[TIS(cap)]; Decoupled(behaviour_weight_cap=...) caps pi_prox / pi_behav",
    "advantage_key": "use loss.set_keys(advantage=...)",
    "entropy_coef": "use entropy_coeff",
}
#: Keywords torchrl's GRPOLoss takes and ignores when ``None``: accepted when ``None``.
_TORCHRL_NO_OPS = ("gamma", "clip_value")
#: ClipPPOLoss's tensordict keys that no part of GRPOLoss reads, and why: ``set_keys`` rejects
#: them rather than accept a key that changes nothing.
UNUSED_KEYS = {
    **dict.fromkeys(("value", "value_target"), _NO_CRITIC),
    **dict.fromkeys(
        ("reward", "done", "terminated"),
        "GRPO has no value estimator: the loss reads the advantage only; rewards and episode "
        "ends are read by torchrl_grpo.MCAdvantage (its rewards_key and done_key)",
    ),
}
#: The buffers of the clip band: ``clip_epsilon`` (a float), or the two of a tuple.
CLIP_EPSILON_BUFFERS = ("clip_epsilon", "clip_epsilon_low", "clip_epsilon_high")


@dataclass(frozen=True)
class LossOptions:
    """The validated settings of a GRPOLoss: what ``__init__`` wires into the module.

    Attributes:
        actor_network: the policy (given as ``actor_network`` or ``actor``).
        is_llm (bool): the policy is a torchrl LLM wrapper (``LLMWrapperBase``).
        masking_strategy (str): ``"sft"``, ``"rlhf"`` or ``"generic"`` (read for LLM wrappers).
        ref_log_prob_padding_side (str): ``"left"`` or ``"right"``.
        ref_log_prob_padding_value (float): the padding of ragged reference log-probs.
        clip_epsilon (float or tuple): as ClipPPOLoss takes it: an ``eps_low`` of 1 (no lower
            bound) is given as 0, and ``no_lower_bound`` says to set it back after.
        no_lower_bound (bool): ``eps_low = 1``, CISPO's weight without a lower bound.
        entropy_bonus (bool), samples_mc_entropy (int), entropy_coeff (float or None),
            reduction (str or None), functional (bool), device: ClipPPOLoss's settings.
        objective (Objective): the per-token surrogate (a variant).
        ratio_level (RatioLevel): ``(log_ratio, mask) -> log_ratio``.
        aggregate (callable): ``(loss, mask) -> scalar``, Dr. GRPO's ``max_length`` bound.
        variants (tuple of Variant): the corrections, then the penalties, one a slot.
        coefficients (Mapping[str, float or None]): the schedulable buffers: those of
            :data:`COEFFICIENTS` (``None`` where no variant held has it), and those of the
            variants held.
        ranges (Mapping[str, Range]): the range of each of ``coefficients``.
    """

    actor_network: Any
    is_llm: bool
    masking_strategy: str
    ref_log_prob_padding_side: str
    ref_log_prob_padding_value: float
    clip_epsilon: float | tuple[float, float]
    no_lower_bound: bool
    entropy_bonus: bool
    samples_mc_entropy: int
    entropy_coeff: float | None
    reduction: str | None
    functional: bool
    device: torch.device | None
    objective: Objective
    ratio_level: Callable
    aggregate: Callable[..., torch.Tensor]
    variants: tuple[Variant, ...]
    coefficients: Mapping[str, float | None]
    ranges: Mapping[str, Range]


def loss_options(
    actor_network: Any,
    keywords: Mapping[str, Any],
    replaced: Mapping[str, Any],
    positional: tuple = (),
) -> LossOptions:
    """Check a GRPOLoss's keywords and resolve its variants, before any module is built.

    Args:
        actor_network: the policy (an ``LLMWrapperBase`` switches to torchrl's LLM layout).
        keywords (Mapping[str, Any]): every keyword-only argument of ``GRPOLoss.__init__``,
            with its value (given or default).
        replaced (Mapping[str, Any]): the other keywords given: ClipPPOLoss's ``actor`` (the
            policy's other name), ClipPPOLoss or torchrl ``GRPOLoss`` arguments without meaning
            here, or unknown ones.
        positional (tuple): the positional arguments after the actor (a critic, as given to
            ``ClipPPOLoss(actor, critic)``): rejected.

    Returns:
        LossOptions: the record ``GRPOLoss.__init__`` consumes.

    Raises:
        TypeError: for a positional argument after the actor, a keyword of ``replaced`` (the
            message names what replaces it), ``actor`` with ``actor_network``, or a per-head
            ``entropy_coeff``.
        ValueError: for an unknown variant name, an invalid coefficient, or a variant's
            setting given without the variant (see :class:`~torchrl_grpo.GRPOLoss`).

    Examples:
        >>> import inspect
        >>> from torchrl_grpo.loss import GRPOLoss
        >>> defaults = {
        ...     name: p.default
        ...     for name, p in inspect.signature(GRPOLoss).parameters.items()
        ...     if p.kind is p.KEYWORD_ONLY
        ... }
        >>> options = loss_options(None, {**defaults, "clip_epsilon": (1.0, 3.0)}, {})
        >>> options.clip_epsilon, options.no_lower_bound  # ClipPPOLoss gets eps_low = 0
        ((0.0, 3.0), True)
        >>> options.functional, options.coefficients["tis_cap"]
        (True, None)
        >>> from torchrl_grpo.loss.variants import Clip
        >>> loss_options(None, {**defaults, "objective": Clip(clip_ratio_c=3.0)}, {}).objective
        Clip(clip_ratio_c=3.0, delta=None)
        >>> loss_options(None, {**defaults, "objective": "ppo2"}, {})
        Traceback (most recent call last):
        ...
        ValueError: Unknown objective 'ppo2': pass one of ['cispo', 'clip', 'sapo', 'vespo'], a
        variant of torchrl_grpo.loss.variants (Clip(), CISPO()...) or a callable.
    """
    given = {**keywords, **replaced}
    flat = {
        name: value
        for name, value in given.items()
        if name in FLAT_KEYWORDS and not (name in TORCHRL_KEYWORDS and value is None)
    }
    others = {name: value for name, value in replaced.items() if name not in FLAT_KEYWORDS}
    actor_network = _actor(actor_network, positional, others)
    k = SimpleNamespace(**{**keywords, **others})
    is_llm = isinstance(actor_network, LLMWrapperBase)
    masking_strategy = _masking_strategy(k.masking_strategy, actor_network, is_llm)
    _check_padding_side(k.ref_log_prob_padding_side)
    aggregation, reduction = _aggregation_and_reduction(k.aggregation, k.reduction)
    if isinstance(k.entropy_coeff, Mapping):
        raise TypeError(
            "GRPOLoss takes a scalar entropy_coeff: a multi-head policy's entropies are summed "
            "over its heads, as ClipPPOLoss does with a scalar; per-head coefficients are not "
            "supported."
        )
    ratio_level = lookup(RATIO_LEVELS, k.ratio_level, "ratio_level")
    objective, variants = _compose(k, flat)
    clip_epsilon, no_lower_bound = _clip_band(k.clip_epsilon)
    # the package's own variants' (None unless held), and those of the variants held
    ranges = dict(builtin_ranges())
    coefficients = dict.fromkeys(ranges)
    for variant in (objective, *variants):
        ranges.update(variant.ranges)
        coefficients.update(variant.buffers())
    return LossOptions(
        actor_network=actor_network,
        is_llm=is_llm,
        masking_strategy=masking_strategy,
        ref_log_prob_padding_side=k.ref_log_prob_padding_side,
        ref_log_prob_padding_value=float(k.ref_log_prob_padding_value),
        clip_epsilon=clip_epsilon,
        no_lower_bound=no_lower_bound,
        entropy_bonus=k.entropy_bonus,
        samples_mc_entropy=k.samples_mc_entropy,
        entropy_coeff=k.entropy_coeff,
        reduction=reduction,
        # an LLM wrapper runs as it is (torchrl's LLM losses are not functional)
        functional=not is_llm if k.functional is None else k.functional,
        device=k.device,
        objective=objective,
        ratio_level=ratio_level,
        aggregate=_make_aggregation(aggregation, k.max_length),
        variants=variants,
        coefficients=MappingProxyType(coefficients),
        ranges=MappingProxyType(ranges),
    )


def _compose(k: SimpleNamespace, flat: Mapping[str, Any]) -> tuple[Objective, tuple]:
    """The objective and the variants: those given, then the flat keywords' (see
    :func:`~torchrl_grpo.loss.variants.flat.from_keywords`), checked together."""
    objective = objective_from_name(k.objective)
    variants = (
        *_staged(k.corrections, "corrections", (Exclusion, Factor)),
        *_staged(k.penalties, "penalties", (Penalty,)),
    )
    slots = [variant.slot for variant in variants]
    for slot in set(slots):
        if slots.count(slot) > 1:
            twice = [variant for variant in variants if variant.slot == slot]
            raise ValueError(f"The loss holds one variant of a kind; got {twice}.")
    objective, variants = from_keywords(flat, objective, variants)
    settings = SimpleNamespace(ratio_level=k.ratio_level, entropy_bonus=k.entropy_bonus)
    for variant in (objective, *variants):
        variant.check(variants, settings)
    return objective, variants


def _staged(given: Sequence[Variant] | None, name: str, stages: tuple[type, ...]) -> tuple:
    """The variants of ``corrections=`` or ``penalties=``, each of a stage that list holds."""
    given = () if given is None else tuple(given)
    for variant in given:
        if not isinstance(variant, stages):
            raise TypeError(
                f"{name}= takes variants of torchrl_grpo.loss.variants whose stage (base "
                f"class) is {' or '.join(stage.__name__ for stage in stages)}; got {variant!r}."
            )
    return given


def _actor(actor_network: Any, positional: tuple, replaced: Mapping[str, Any]) -> Any:
    """The policy: ``actor_network``, or ``actor=`` as ClipPPOLoss takes it; anything else given
    (a critic, positionally or not, or an unknown keyword) is rejected with what replaces it."""
    if positional:
        raise TypeError(
            f"GRPOLoss takes one positional argument, the policy, and got {len(positional)} "
            f"more (a critic, as ClipPPOLoss(actor, critic) takes?): {_NO_CRITIC}."
        )
    # torchrl's GRPOLoss takes gamma=None and clip_value=None (its defaults) as no-ops: so here
    others = {k: v for k, v in replaced.items() if not (k in _TORCHRL_NO_OPS and v is None)}
    actor = others.pop("actor", None)
    for name in others:
        if name in _REPLACED_KEYWORDS:
            raise TypeError(f"GRPOLoss takes no {name!r}: {_REPLACED_KEYWORDS[name]}.")
    if others:
        raise TypeError(f"GRPOLoss got unexpected keyword arguments {sorted(others)}.")
    if actor is not None and actor_network is not None:
        raise TypeError("GRPOLoss got both actor_network and actor (its alias): pass one.")
    return actor_network if actor is None else actor


def _masking_strategy(masking_strategy: str | None, actor_network: Any, is_llm: bool) -> str:
    if masking_strategy is not None and not is_llm:
        raise ValueError(
            f"masking_strategy={masking_strategy!r} applies to torchrl LLM wrappers "
            f"(LLMWrapperBase); this actor is a {type(actor_network).__name__}: mark real "
            "tokens with the 'mask' key instead."
        )
    if masking_strategy is None:
        return "sft"  # torchrl's default
    if masking_strategy not in MASKING_STRATEGIES:
        raise ValueError(
            f"masking_strategy must be one of {list(MASKING_STRATEGIES)}, got {masking_strategy!r}."
        )
    return masking_strategy


def _check_padding_side(side: str) -> None:
    if side not in ("left", "right"):
        raise ValueError(f"ref_log_prob_padding_side must be 'left' or 'right', got {side!r}.")


def _aggregation_and_reduction(aggregation, reduction: str | None):
    """torchrl's aggregation names translated (``None`` is its default); ``reduction`` checked."""
    if aggregation is None:  # torchrl's GRPOLoss: ``aggregation or "token_mean"``
        aggregation = "token_mean"
    if aggregation == "none":  # torchrl's per-token output
        aggregation, reduction = "token_mean", reduction or "none"
    aggregation = TORCHRL_AGGREGATIONS.get(aggregation, aggregation)
    if reduction not in (None, "mean", "none"):
        raise ValueError(
            f"GRPOLoss supports reduction='mean' (apply `aggregation`) or 'none', got "
            f"{reduction!r}; for a sum over tokens use aggregation='seq_mean_token_sum' "
            "or a callable."
        )
    return aggregation, reduction


def _clip_band(clip_epsilon):
    """``(clip_epsilon as ClipPPOLoss takes it, no_lower_bound)``; both forms checked alike.

    torchrl checks a tuple but not a float (``-0.1`` would invert the band, ``1.5`` give a
    ``nan`` bound): here a float is checked as each bound of a tuple (:func:`check_clip_bound`).
    ``eps_low = 1`` means "no lower bound" (CISPO); torchrl forbids it in a tuple (``log(0)``),
    so ClipPPOLoss gets 0 and the buffer is set back to 1 once registered. A float 1 is kept as
    it is: its lower bound, ``log(1 - 1) = -inf``, clamps nothing either.
    """
    if not isinstance(clip_epsilon, (tuple, list)):
        check_clip_bound("clip_epsilon", clip_epsilon)
        return clip_epsilon, False
    if len(clip_epsilon) != 2:
        raise ValueError(f"clip_epsilon tuple must have length 2, got {clip_epsilon}.")
    check_clip_bound("clip_epsilon_low", clip_epsilon[0])
    check_clip_bound("clip_epsilon_high", clip_epsilon[1])
    if float(clip_epsilon[0]) == 1.0:
        return (0.0, clip_epsilon[1]), True
    return clip_epsilon, False


def check_clip_bound(name: str, value: Any) -> None:
    """One value of the clip band, at construction or scheduled (``loss.clip_epsilon = x``).

    ``clip_epsilon`` (a float) and ``clip_epsilon_low`` must be in ``[0, 1]`` (``1 - eps`` is the
    lower bound of the ratio; 1 means none), ``clip_epsilon_high`` non-negative; ``nan`` is
    neither.

    Raises:
        TypeError: the value is not a number.
        ValueError: the value is out of its range (named, with the value).
    """
    try:
        eps = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}.") from None
    if name == "clip_epsilon_high":
        if not eps >= 0.0:
            raise ValueError(
                f"{name} must be non-negative (1 + eps is the upper bound), got {eps}."
            )
        return
    if not 0.0 <= eps <= 1.0:
        raise ValueError(
            f"{name} must be in [0, 1] (1 - eps is the lower bound of the ratio; 1 means no lower "
            f"bound), got {eps}."
        )


def check_scheduled(name: str, value: float, ranges: Mapping[str, Range] | None = None) -> None:
    """A scheduler's new value of a buffer (``loss.name = value``), checked against the range
    the same setting is checked against at construction.

    Only the value's own range: a bound checked against another buffer (``InferenceCorrection``'s
    ``low < high``) is not, nor is a tensor assigned or written in place.

    Args:
        name (str): the buffer.
        value (float): its new value.
        ranges (Mapping[str, Range], optional): the loss's ranges (``LossOptions.ranges``).
            Defaults to those of the package's own variants.

    Raises:
        ValueError: the value is out of its range.
    """
    if name in CLIP_EPSILON_BUFFERS:
        check_clip_bound(name, value)
        return
    ranges = builtin_ranges() if ranges is None else ranges
    if name in ranges:
        check_range(name, value, ranges)


def _make_aggregation(aggregation, max_length: int | None):
    """The aggregation; Dr. GRPO's with ``max_length`` bound, which the others reject."""
    fn = lookup(AGGREGATIONS, aggregation, "aggregation")
    wants_length = "max_length" in inspect.signature(fn).parameters
    if wants_length and max_length is None:
        raise ValueError(f"aggregation {aggregation!r} needs max_length (Dr. GRPO's L_max).")
    if not wants_length and max_length is not None:
        raise ValueError(
            f"max_length={max_length} is only used by a length-normalised "
            f"aggregation, not by {aggregation!r}."
        )
    return functools.partial(fn, max_length=max_length) if wants_length else fn
