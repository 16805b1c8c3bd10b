"""The flat keywords of earlier versions (``GRPOLoss(tis_cap=2.0, decoupled=True)``), mapped onto
the variant objects.

Each slot's keywords rebuild that slot's variant from the keywords given and, for the settings
not given, the variant already held (a preset's); a main keyword given as ``None`` or ``False``
removes it. torchrl's own keywords (``kl_to_ref_coeff``, ``kl_to_inference_coeff``,
``kl_mask_threshold``) are not deprecated; the others raise a :class:`DeprecationWarning` that
names the new form.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from torchrl_grpo.loss.variants.base import Objective, Variant, lookup
from torchrl_grpo.loss.variants.corrections import (
    TIS,
    Decoupled,
    InferenceCorrection,
    InferenceVeto,
    KLMask,
    OffPolicyMask,
    TopEntropy,
    TruncatedCompletions,
    TrustRegion,
)
from torchrl_grpo.loss.variants.objectives import SAPO, VESPO, Clip
from torchrl_grpo.loss.variants.penalties import EntropyTarget, KLToInference, KLToReference
from torchrl_grpo.loss_terms import KL_ESTIMATORS

__all__ = ["FLAT_KEYWORDS", "TORCHRL_KEYWORDS", "from_keywords"]

#: torchrl's GRPOLoss keywords that build a variant: kept, not deprecated.
TORCHRL_KEYWORDS = ("kl_to_ref_coeff", "kl_to_inference_coeff", "kl_mask_threshold")
#: Every flat keyword, its default (what "not given" was) and the new form a warning names.
FLAT_KEYWORDS: dict[str, tuple[Any, str]] = {
    "clip_ratio_c": (None, "objective=Clip(clip_ratio_c=...)"),
    "delta": (None, "objective=Clip(delta=...)"),
    "sapo_temperature_pos": (None, "objective=SAPO(temperature_pos=...)"),
    "sapo_temperature_neg": (None, "objective=SAPO(temperature_neg=...)"),
    "vespo_k": (None, "objective=VESPO(k=...)"),
    "vespo_lambda": (None, "objective=VESPO(lambda_=...)"),
    "kl_to_ref_coeff": (None, "penalties=[KLToReference(coeff)]"),
    "kl_to_ref_estimator": ("k3", "penalties=[KLToReference(coeff, estimator=...)]"),
    "kl_to_ref_unbiased": (False, "penalties=[KLToReference(coeff, unbiased=True)]"),
    "kl_to_inference_coeff": (None, "penalties=[KLToInference(coeff)]"),
    "kl_to_inference_estimator": ("k3", "penalties=[KLToInference(coeff, estimator=...)]"),
    "entropy_target": (None, "penalties=[EntropyTarget(target)]"),
    "entropy_coeff_bounds": (None, "penalties=[EntropyTarget(target, bounds=...)]"),
    "entropy_coeff_step": (None, "penalties=[EntropyTarget(target, step=...)]"),
    "kl_mask_threshold": (None, "corrections=[KLMask(threshold)]"),
    "mask_truncated_completions": (False, "corrections=[TruncatedCompletions()]"),
    "inference_veto_threshold": (None, "corrections=[InferenceVeto(threshold)]"),
    "decoupled": (False, "corrections=[Decoupled()]"),
    "behaviour_weight_cap": (None, "corrections=[Decoupled(behaviour_weight_cap=...)]"),
    "tis_cap": (None, "corrections=[TIS(cap)]"),
    "inference_correction": (None, "corrections=[InferenceCorrection(mode)]"),
    "inference_correction_bounds": (None, "corrections=[InferenceCorrection(mode, bounds)]"),
    "off_policy_mask_threshold": (None, "corrections=[OffPolicyMask(threshold)]"),
    "trust_region": (None, "corrections=[TrustRegion(mode)]"),
    "trust_region_bounds": (None, "corrections=[TrustRegion(mode, bounds)]"),
    "top_entropy_quantile": (None, "corrections=[TopEntropy(quantile)]"),
}


def _warn(given: Mapping[str, Any]) -> None:
    deprecated = [name for name in given if name not in TORCHRL_KEYWORDS]
    if deprecated:
        forms = "; ".join(f"{name}= -> {FLAT_KEYWORDS[name][1]}" for name in deprecated)
        warnings.warn(
            f"GRPOLoss's flat variant keywords are deprecated (they keep working): {forms} "
            "(classes of torchrl_grpo.loss.variants).",
            DeprecationWarning,
            stacklevel=4,
        )


def _objective(given: Mapping[str, Any], objective: Objective) -> Objective:
    """SAPO's temperatures, VESPO's kernels, the dual and two-sided clips onto the objective."""
    name = objective.title.lower()
    for cls, pair, names in (
        (SAPO, ("sapo_temperature_pos", "sapo_temperature_neg"), "sapo_temperature_pos / _neg"),
        (VESPO, ("vespo_k", "vespo_lambda"), "vespo_k / vespo_lambda"),
    ):
        values = [given.get(key) for key in pair]
        if any(value is not None for value in values):
            if not isinstance(objective, cls):
                raise ValueError(f"{names} apply to objective={cls.title.lower()!r}, not {name!r}.")
            fields = [f.name for f in dataclasses.fields(cls)]
            changes = {f: v for f, v in zip(fields, values) if v is not None}
            objective = dataclasses.replace(objective, **changes)
    c, delta = given.get("clip_ratio_c"), given.get("delta")
    if c is not None and not objective.dual_clip:
        raise ValueError(
            f"clip_ratio_c (dual clip) applies to the PPO surrogate, not {objective.title}."
        )
    if delta is not None and not isinstance(objective, Clip):
        raise ValueError(
            "delta (two-sided clip) caps the ratio of PPO's surrogate: objective='clip' only."
        )
    fields = {f.name for f in dataclasses.fields(objective)}
    changes = {k: given[k] for k in ("clip_ratio_c", "delta") if k in given and k in fields}
    return dataclasses.replace(objective, **changes) if changes else objective


def _kl(given, held, prefix: str, cls: type) -> Variant | None:
    """``<prefix>_coeff`` / ``_estimator`` (/ ``kl_to_ref_unbiased``) onto a KL penalty."""
    estimator = given.get(f"{prefix}_estimator", "k3")
    lookup(KL_ESTIMATORS, estimator, "KL estimator")
    coeff = given.get(f"{prefix}_coeff", getattr(held, "coeff", None))
    if given.get("kl_to_ref_unbiased") and prefix == "kl_to_ref" and coeff is None:
        raise ValueError("kl_to_ref_unbiased weighs the KL to the reference: set kl_to_ref_coeff.")
    if coeff is None:
        return None
    changes = {"coeff": coeff}
    if f"{prefix}_estimator" in given:
        changes["estimator"] = estimator
    if prefix == "kl_to_ref" and "kl_to_ref_unbiased" in given:
        changes["unbiased"] = bool(given["kl_to_ref_unbiased"])
    return cls(**changes) if held is None else dataclasses.replace(held, **changes)


def _entropy_target(given, held) -> EntropyTarget | None:
    target = given.get("entropy_target", getattr(held, "target", None))
    if target is None:
        if given.get("entropy_coeff_bounds") is not None or given.get("entropy_coeff_step"):
            raise ValueError("entropy_coeff_bounds / entropy_coeff_step need an entropy_target.")
        return None
    held = held or EntropyTarget(target)
    bounds = given.get("entropy_coeff_bounds") or held.bounds
    step = given.get("entropy_coeff_step") or held.step
    return EntropyTarget(target, tuple(bounds), step)


def _inference(given, held) -> Variant | None:
    tis = given.get("tis_cap")
    mode, bounds = given.get("inference_correction"), given.get("inference_correction_bounds")
    if tis is not None:
        if mode is not None or bounds is not None:
            raise ValueError(
                "tis_cap is inference_correction='token_truncate' with bounds "
                "(None, tis_cap): pass one or the other."
            )
        return TIS(tis)
    if "inference_correction" not in given and isinstance(held, InferenceCorrection):
        mode = held.mode
    if mode is None:
        if bounds is not None:
            raise ValueError("inference_correction_bounds needs an inference_correction.")
        return None
    return InferenceCorrection(mode, bounds)


def _trust_region(given, held) -> TrustRegion | None:
    mode, bounds = given.get("trust_region"), given.get("trust_region_bounds")
    if "trust_region" not in given and held is not None:
        mode = held.mode
    if mode is None:
        if bounds is not None:
            raise ValueError("trust_region_bounds needs a trust_region.")
        return None
    return TrustRegion(mode, bounds)


def _decoupled(given, held) -> Decoupled | None:
    on = given.get("decoupled", held is not None)
    cap = given.get("behaviour_weight_cap", getattr(held, "behaviour_weight_cap", None))
    if cap is not None and not on:
        raise ValueError("behaviour_weight_cap applies to decoupled=True only.")
    return Decoupled(cap) if on else None


def _single(cls: type, keyword: str) -> Callable:
    """A slot of one keyword: its value builds the variant (``None`` / ``False``: none)."""

    def build(given, held):
        value = given[keyword]
        if value is None or value is False:
            return None
        return cls() if value is True else cls(value)

    return build


#: The slots the flat keywords build, their keywords, and the builder ``(given, held) ->
#: variant or None``.
_SLOTS: tuple[tuple[str, tuple[str, ...], Callable], ...] = (
    ("kl_mask", ("kl_mask_threshold",), _single(KLMask, "kl_mask_threshold")),
    (
        "truncated",
        ("mask_truncated_completions",),
        _single(TruncatedCompletions, "mask_truncated_completions"),
    ),
    ("veto", ("inference_veto_threshold",), _single(InferenceVeto, "inference_veto_threshold")),
    ("decoupled", ("decoupled", "behaviour_weight_cap"), _decoupled),
    (
        "inference_correction",
        ("tis_cap", "inference_correction", "inference_correction_bounds"),
        _inference,
    ),
    (
        "off_policy_mask",
        ("off_policy_mask_threshold",),
        _single(OffPolicyMask, "off_policy_mask_threshold"),
    ),
    ("trust_region", ("trust_region", "trust_region_bounds"), _trust_region),
    ("top_entropy", ("top_entropy_quantile",), _single(TopEntropy, "top_entropy_quantile")),
    (
        "kl_to_ref",
        ("kl_to_ref_coeff", "kl_to_ref_estimator", "kl_to_ref_unbiased"),
        lambda given, held: _kl(given, held, "kl_to_ref", KLToReference),
    ),
    (
        "kl_to_inference",
        ("kl_to_inference_coeff", "kl_to_inference_estimator"),
        lambda given, held: _kl(given, held, "kl_to_inference", KLToInference),
    ),
    (
        "entropy_target",
        ("entropy_target", "entropy_coeff_bounds", "entropy_coeff_step"),
        _entropy_target,
    ),
)


def from_keywords(
    given: Mapping[str, Any], objective: Objective, variants: tuple[Variant, ...]
) -> tuple[Objective, tuple[Variant, ...]]:
    """The objective and the variants once the flat keywords ``given`` are applied.

    Args:
        given (Mapping[str, Any]): the flat keywords passed (keys of :data:`FLAT_KEYWORDS`).
        objective (Objective): the objective held so far (given, or a preset's).
        variants (tuple of Variant): the corrections and penalties held so far.

    Returns:
        ``(objective, variants)``: a slot's variant replaced where its keywords are given.

    Examples:
        >>> from torchrl_grpo.loss.variants import Clip, TIS
        >>> from_keywords({"tis_cap": 2.0, "clip_ratio_c": 3.0}, Clip(), ())
        (Clip(clip_ratio_c=3.0, delta=None), (TIS(cap=2.0),))
    """
    objective = _objective(given, objective)
    held = {variant.slot: variant for variant in variants}
    for slot, keywords, build in _SLOTS:
        mine = {k: given[k] for k in keywords if k in given}
        if mine:
            held[slot] = build(mine, held.get(slot))
    _warn(given)
    return objective, tuple(v for v in held.values() if v is not None)


class FlatAttributes:
    """The attributes of earlier versions' flat settings, read from the variants a loss holds
    (``loss.decoupled``...); the objects themselves are ``loss.objective`` and
    ``loss.variants``."""

    variants: tuple[Variant, ...]

    def _held(self, cls: type) -> Variant | None:
        return next((v for v in self.variants if isinstance(v, cls)), None)

    @property
    def decoupled(self) -> bool:
        """A :class:`~torchrl_grpo.loss.variants.Decoupled` is held."""
        return self._held(Decoupled) is not None

    @property
    def mask_truncated_completions(self) -> bool:
        """A :class:`~torchrl_grpo.loss.variants.TruncatedCompletions` is held."""
        return self._held(TruncatedCompletions) is not None

    @property
    def kl_to_ref_unbiased(self) -> bool:
        """The KL to the reference held is the unbiased one."""
        return bool(getattr(self._held(KLToReference), "unbiased", False))

    @property
    def inference_correction_bounds(self) -> tuple:
        """``(low, high)`` of the inference band, read from the schedulable buffers (``(None,
        tis_cap)`` for :class:`~torchrl_grpo.loss.variants.TIS`)."""
        if self._held(TIS) is not None:
            return None, self.tis_cap
        return self.inference_correction_low, self.inference_correction_high
