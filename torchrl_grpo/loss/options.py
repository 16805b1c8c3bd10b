"""The settings of a :class:`~torchrl_grpo.GRPOLoss`, checked once into a frozen record.

:func:`loss_options` takes the loss's keywords as given, rejects what cannot work together
(before any module is built, so that a bad call leaves nothing half-made), resolves the names of
the variants into the callables of the registries of :mod:`torchrl_grpo.loss_terms`, and returns
a :class:`LossOptions` that ``GRPOLoss.__init__`` wires into the module. A variant's factory
(``_make_objective``, ``_make_inference_correction``, ``_make_aggregation``) binds the
settings that variant takes and rejects those it does not.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, SimpleNamespace
from typing import Any

import torch
from torchrl.modules.llm import LLMWrapperBase

from torchrl_grpo.loss.inputs import MASKING_STRATEGIES
from torchrl_grpo.loss_terms import (
    AGGREGATIONS,
    INFERENCE_CORRECTIONS,
    KL_ESTIMATORS,
    OBJECTIVES,
    RATIO_LEVELS,
    TRUST_REGIONS,
    Objective,
    RatioLevel,
)

#: SAPO's temperatures (tau_pos, tau_neg) when none are given: the paper's and TRL's.
SAPO_TEMPERATURES = (1.0, 1.05)
#: VESPO's kernels when none are given, ``(for A >= 0, for A < 0)``: TRL's ``vespo_k_pos``,
#: ``vespo_k_neg`` and ``vespo_lambda_pos``, ``vespo_lambda_neg``.
VESPO_K = (2.0, 3.0)
VESPO_LAMBDA = (3.0, 2.0)
#: DPPO's bounds ``(delta_low, delta_high)`` when none are given: verl's DPPO recipe
#: (``examples/dppo_trainer``: 0.15 for the total variation, 0.05 for the binary KL).
TRUST_REGION_BOUNDS = {"dppo_tv": (0.15, 0.15), "dppo_kl": (0.05, 0.05)}
#: The adaptive entropy coefficient's ``(min, max)`` and step when not given: TRL's
#: ``entropy_coef_min``, ``entropy_coef_max`` and ``entropy_coef_delta``.
ENTROPY_COEFF_BOUNDS = (0.0, 1.0)
ENTROPY_COEFF_STEP = 0.005
#: The inference band when ``inference_correction`` is set without bounds: TRL's
#: ``vllm_importance_sampling_clip_min`` / ``_clip_max`` defaults.
INFERENCE_CORRECTION_BOUNDS = (None, 3.0)
#: torchrl's ``GRPOLoss(aggregation=...)`` names, as this loss's aggregations.
TORCHRL_AGGREGATIONS = {"prompt_mean": "seq_mean_token_mean"}
#: The coefficients a GRPOLoss keeps as schedulable buffers (``loss.tis_cap = 1.5``), on top of
#: ClipPPOLoss's ``clip_epsilon`` and ``entropy_coeff``; ``None`` when the variant is off.
COEFFICIENTS = (
    "clip_ratio_c",
    "delta",
    "trust_region_low",
    "trust_region_high",
    "kl_to_ref_coeff",
    "kl_to_inference_coeff",
    "kl_mask_threshold",
    "tis_cap",
    "inference_correction_low",
    "inference_correction_high",
    "off_policy_mask_threshold",
    "behaviour_weight_cap",
    "top_entropy_quantile",
    "inference_veto_threshold",
)

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
    "policy's log-probs from the batch: use decoupled=True and set_keys(proximal_log_prob=...)",
    "max_importance_ratio": "ClipPPOLoss's cap on pi_theta / pi_behav has no equivalent here. "
    "To cap the importance weight against the inference engine, min(pi_old / pi_inference, cap), "
    "use tis_cap=...; with decoupled=True, behaviour_weight_cap caps pi_prox / pi_behav",
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
        objective (Objective): the per-token surrogate, SAPO's temperatures or VESPO's
            kernels bound.
        ratio_level (RatioLevel): ``(log_ratio, mask) -> log_ratio``.
        aggregate (callable): ``(loss, mask) -> scalar``, Dr. GRPO's ``max_length`` bound.
        kl_to_ref_estimator (callable), kl_to_inference_estimator (callable):
            ``(log_prob, other_log_prob) -> per-token estimate``.
        inference_correction (callable or None): ``(log_weight, mask, low, high) ->
            (weight, keep)``; ``None`` when off or given as ``tis_cap``.
        decoupled (bool), mask_truncated_completions (bool), kl_to_ref_unbiased (bool): as
            the keywords.
        trust_region (callable or None): DPPO's ``(log_prob, old_log_prob, advantage, mask,
            low, high) -> keep``; ``None`` when off.
        adaptive_entropy (tuple or None): ``(target, min, max, step)`` of the adaptive entropy
            coefficient; ``None`` when the coefficient is fixed.
        coefficients (Mapping[str, float or None]): the schedulable buffers of
            :data:`COEFFICIENTS`, in that order; ``None`` when the variant is off.
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
    ratio_level: RatioLevel
    aggregate: Callable[..., torch.Tensor]
    kl_to_ref_estimator: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    kl_to_inference_estimator: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    inference_correction: Callable | None
    decoupled: bool
    mask_truncated_completions: bool
    kl_to_ref_unbiased: bool
    trust_region: Callable | None
    adaptive_entropy: tuple[float, float, float, float] | None
    coefficients: Mapping[str, float | None]


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
        >>> loss_options(None, {**defaults, "clip_ratio_c": 0.5}, {})
        Traceback (most recent call last):
        ...
        ValueError: clip_ratio_c must be greater than 1, got 0.5.
    """
    actor_network = _actor(actor_network, positional, replaced)
    k = SimpleNamespace(**keywords)
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
    objective = _make_objective(k)
    _check_dual_clip(objective, k.clip_ratio_c, k.delta)
    trust_region, inference_correction, bounds = _masks_and_weights(k)
    clip_epsilon, no_lower_bound = _clip_band(k.clip_epsilon)
    coefficients = {name: bounds.get(name, getattr(k, name, None)) for name in COEFFICIENTS}
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
        ratio_level=_lookup(RATIO_LEVELS, k.ratio_level, "ratio_level"),
        aggregate=_make_aggregation(aggregation, k.max_length),
        kl_to_ref_estimator=_lookup(KL_ESTIMATORS, k.kl_to_ref_estimator, "KL estimator"),
        kl_to_inference_estimator=_lookup(
            KL_ESTIMATORS, k.kl_to_inference_estimator, "KL estimator"
        ),
        inference_correction=inference_correction,
        decoupled=bool(k.decoupled),
        mask_truncated_completions=bool(k.mask_truncated_completions),
        kl_to_ref_unbiased=_check_unbiased_kl(k.kl_to_ref_unbiased, k.kl_to_ref_coeff),
        trust_region=trust_region,
        adaptive_entropy=_adaptive_entropy(k),
        coefficients=MappingProxyType(coefficients),
    )


def _masks_and_weights(k: SimpleNamespace):
    """``(trust_region, inference_correction, bounds)``: the variants that weigh or drop
    tokens, checked; ``bounds`` are the buffers of their bands, by name."""
    for name in (
        "tis_cap",
        "kl_mask_threshold",
        "off_policy_mask_threshold",
        "inference_veto_threshold",
        "kl_to_ref_coeff",
        "kl_to_inference_coeff",
    ):
        _check_range(name, getattr(k, name))
    trust_region, (tr_low, tr_high) = _make_trust_region(k.trust_region, k.trust_region_bounds)
    inference_correction, (low, high) = _make_inference_correction(
        k.inference_correction, k.inference_correction_bounds, k.tis_cap
    )
    _check_decoupled(k.decoupled, k.behaviour_weight_cap)
    _check_quantile(k.top_entropy_quantile)
    bounds = {
        "inference_correction_low": low,
        "inference_correction_high": high,
        "trust_region_low": tr_low,
        "trust_region_high": tr_high,
    }
    return trust_region, inference_correction, bounds


def _lookup(registry: Mapping[str, Callable], value: str | Callable, name: str) -> Callable:
    """``value`` if it is a callable, else its entry in ``registry``."""
    if callable(value):
        return value
    try:
        return registry[value]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown {name} {value!r}: pass one of {sorted(registry)} or a callable."
        ) from None


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


def _make_objective(k: SimpleNamespace) -> Objective:
    """The objective, SAPO's temperatures or VESPO's kernels bound (the defaults where not
    given); each variant's settings are rejected with another objective."""
    fn = _lookup(OBJECTIVES, k.objective, "objective")
    sapo = (k.sapo_temperature_pos, k.sapo_temperature_neg)
    vespo = (k.vespo_k, k.vespo_lambda)
    for name, settings, its_fn in (
        ("sapo", sapo, OBJECTIVES["sapo"]),
        ("vespo", vespo, OBJECTIVES["vespo"]),
    ):
        if fn is not its_fn and any(x is not None for x in settings):
            names = "sapo_temperature_pos / _neg" if name == "sapo" else "vespo_k / vespo_lambda"
            raise ValueError(f"{names} apply to objective={name!r}, not {k.objective!r}.")
    if fn is OBJECTIVES["sapo"]:
        taus = [default if tau is None else tau for tau, default in zip(sapo, SAPO_TEMPERATURES)]
        if min(taus) <= 0:
            raise ValueError(f"SAPO temperatures must be positive, got {tuple(taus)}.")
        return functools.partial(fn, temperature_pos=taus[0], temperature_neg=taus[1])
    if fn is OBJECTIVES["vespo"]:
        return _vespo(fn, k)
    return fn


def _vespo(fn: Objective, k: SimpleNamespace) -> Objective:
    """VESPO's objective with its kernels bound; its weight is the product of the token ratios."""
    if not (callable(k.ratio_level) or k.ratio_level == "sequence_sum"):
        raise ValueError(
            "objective='vespo' weighs each sequence by the product of its token ratios: use "
            f"ratio_level='sequence_sum' (VESPOLoss sets it), not {k.ratio_level!r}."
        )
    ks, lambdas = (
        VESPO_K if k.vespo_k is None else tuple(k.vespo_k),
        VESPO_LAMBDA if k.vespo_lambda is None else tuple(k.vespo_lambda),
    )
    if len(ks) != 2 or len(lambdas) != 2 or min(*ks, *lambdas) < 0:
        raise ValueError(
            "vespo_k and vespo_lambda are pairs (for A >= 0, for A < 0) of non-negative "
            f"numbers, got {ks} and {lambdas}."
        )
    return functools.partial(
        fn, k_pos=ks[0], lambda_pos=lambdas[0], k_neg=ks[1], lambda_neg=lambdas[1]
    )


def _check_dual_clip(objective: Objective, clip_ratio_c: float | None, delta: float | None):
    """The dual clip and the two-sided clip bound the PPO surrogate, one of them at a time."""
    if clip_ratio_c is not None and delta is not None:
        raise ValueError(
            "clip_ratio_c and delta both bound the loss of negative-advantage tokens (delta "
            "> 1 + eps_high is the dual clip with c = delta): pass one."
        )
    fn = getattr(objective, "func", objective)
    names = {OBJECTIVES["cispo"]: "CISPO", OBJECTIVES["sapo"]: "SAPO", OBJECTIVES["vespo"]: "VESPO"}
    if clip_ratio_c is not None:
        if fn in names:
            raise ValueError(
                f"clip_ratio_c (dual clip) applies to the PPO surrogate, not {names[fn]}."
            )
        _check_range("clip_ratio_c", clip_ratio_c)
    if delta is not None:
        if fn is not OBJECTIVES["clip"]:
            raise ValueError(
                "delta (two-sided clip) caps the ratio of PPO's surrogate: objective='clip' only."
            )
        _check_range("delta", delta)


def _make_trust_region(trust_region, bounds):
    """``(fn, (low, high))``: DPPO's mask and its bounds (the recipe's where not given)."""
    if trust_region is None:
        if bounds is not None:
            raise ValueError("trust_region_bounds needs a trust_region.")
        return None, (None, None)
    fn = _lookup(TRUST_REGIONS, trust_region, "trust_region")
    if bounds is None:
        if callable(trust_region):
            raise ValueError("a callable trust_region needs trust_region_bounds=(low, high).")
        bounds = TRUST_REGION_BOUNDS[trust_region]
    low, high = bounds if isinstance(bounds, (tuple, list)) else (bounds, bounds)
    for name, value in (("trust_region_low", low), ("trust_region_high", high)):
        _check_range(name, value)
    return fn, (float(low), float(high))


def _check_unbiased_kl(unbiased: bool, kl_to_ref_coeff: float | None) -> bool:
    if unbiased and kl_to_ref_coeff is None:
        raise ValueError("kl_to_ref_unbiased weighs the KL to the reference: set kl_to_ref_coeff.")
    return bool(unbiased)


def _adaptive_entropy(k: SimpleNamespace) -> tuple[float, float, float, float] | None:
    """``(target, min, max, step)`` of the adaptive entropy coefficient, or ``None`` (fixed)."""
    if k.entropy_target is None:
        if k.entropy_coeff_bounds is not None or k.entropy_coeff_step is not None:
            raise ValueError("entropy_coeff_bounds / entropy_coeff_step need an entropy_target.")
        return None
    if not k.entropy_bonus:
        raise ValueError("entropy_target adapts the entropy bonus: it needs entropy_bonus=True.")
    low, high = ENTROPY_COEFF_BOUNDS if k.entropy_coeff_bounds is None else k.entropy_coeff_bounds
    step = ENTROPY_COEFF_STEP if k.entropy_coeff_step is None else k.entropy_coeff_step
    if not (k.entropy_target >= 0 and 0 <= low <= high and step > 0):
        raise ValueError(
            "the adaptive entropy coefficient needs entropy_target >= 0, "
            f"0 <= min <= max and step > 0, got {k.entropy_target}, ({low}, {high}), {step}."
        )
    return float(k.entropy_target), float(low), float(high), float(step)


def _check_range(name: str, value: float | None) -> None:
    """``value`` is ``None`` (off), or in the range ``_RANGES`` gives ``name`` (never ``nan``)."""
    if value is None:
        return
    what, bound = _RANGES[name]
    if not (value >= bound if what == "non-negative" else value > bound):
        what = f"greater than {bound:g}" if what == "greater than" else what
        raise ValueError(f"{name} must be {what}, got {value}.")


def _check_quantile(value: float | None) -> None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {value}.")


def _make_inference_correction(correction, bounds, tis_cap):
    """``(fn, (low, high))``: the correction and its band (``None`` fn for none)."""
    if tis_cap is not None:
        if correction is not None or bounds is not None:
            raise ValueError(
                "tis_cap is inference_correction='token_truncate' with bounds "
                "(None, tis_cap): pass one or the other."
            )
        return None, (None, None)  # read from the tis_cap buffer
    if correction is None:
        if bounds is not None:
            raise ValueError("inference_correction_bounds needs an inference_correction.")
        return None, (None, None)
    fn = _lookup(INFERENCE_CORRECTIONS, correction, "inference_correction")
    low, high = INFERENCE_CORRECTION_BOUNDS if bounds is None else bounds
    if (low is not None and not low >= 0) or (high is not None and not high > 0):
        raise ValueError(
            f"inference_correction_bounds must be a low >= 0 and a high > 0, got {bounds}."
        )
    if low is not None and high is not None and low >= high:
        raise ValueError(f"inference_correction_bounds must have low < high, got {bounds}.")
    return fn, (low, high)


def _check_decoupled(decoupled: bool, behaviour_weight_cap: float | None) -> None:
    if behaviour_weight_cap is None:
        return
    if not decoupled:
        raise ValueError("behaviour_weight_cap applies to decoupled=True only.")
    _check_range("behaviour_weight_cap", behaviour_weight_cap)


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


def check_scheduled(name: str, value: float) -> None:
    """A scheduler's new value of a buffer (``loss.name = value``), checked against the range
    the same setting is checked against at construction.

    Only the value's own range: a bound checked against another buffer (``inference_correction``
    ``low < high``) is not, nor is a tensor assigned or written in place.

    Raises:
        ValueError: the value is out of its range.
    """
    if name in CLIP_EPSILON_BUFFERS:
        check_clip_bound(name, value)
    elif name in _RANGES:
        _check_range(name, value)
    elif name == "top_entropy_quantile":
        _check_quantile(value)


#: The range of each schedulable coefficient, checked at construction and when scheduled:
#: ``(what, bound)``, ``what`` one of ``"positive"``, ``"non-negative"``, ``"greater than"``.
_RANGES = {
    "kl_to_ref_coeff": ("non-negative", 0.0),
    "kl_to_inference_coeff": ("non-negative", 0.0),
    "tis_cap": ("positive", 0.0),
    "kl_mask_threshold": ("positive", 0.0),
    "off_policy_mask_threshold": ("positive", 0.0),
    "inference_correction_low": ("non-negative", 0.0),
    "inference_correction_high": ("positive", 0.0),
    "clip_ratio_c": ("greater than", 1.0),
    "delta": ("greater than", 1.0),
    "trust_region_low": ("positive", 0.0),
    "trust_region_high": ("positive", 0.0),
    "inference_veto_threshold": ("positive", 0.0),
    "behaviour_weight_cap": ("greater than", 1.0),
}


def _make_aggregation(aggregation, max_length: int | None):
    """The aggregation; Dr. GRPO's with ``max_length`` bound, which the others reject."""
    fn = _lookup(AGGREGATIONS, aggregation, "aggregation")
    wants_length = "max_length" in inspect.signature(fn).parameters
    if wants_length and max_length is None:
        raise ValueError(f"aggregation {aggregation!r} needs max_length (Dr. GRPO's L_max).")
    if not wants_length and max_length is not None:
        raise ValueError(
            f"max_length={max_length} is only used by a length-normalised "
            f"aggregation, not by {aggregation!r}."
        )
    return functools.partial(fn, max_length=max_length) if wants_length else fn
