"""What every variant of a :class:`~torchrl_grpo.GRPOLoss` is: one object in one place.

A variant declares the batch entries it reads, the checks of its settings (at construction),
the values a scheduler may change (registered on the loss as buffers under these names, so that
``loss.tis_cap = 1.5`` and ``state_dict`` work as for ClipPPOLoss's ``clip_epsilon``), the
metrics it reports, and its math (calling the pure functions of :mod:`torchrl_grpo.loss_terms`).
The loss composes the ones it holds; nothing in ``loss/grpo.py`` knows any one of them.

Four stages, in the order of one call:

* ``"objective"``: the per-token surrogate (exactly one, :class:`Objective`);
* ``"exclude"``: tokens left out of the loss terms *and* of the aggregation's denominator (the KL
  trust region, truncated completions, the veto, verl's rejection);
* ``"factor"``: a weight and/or tokens zeroed in ``loss_objective`` only, kept in the denominator
  as the papers write them (decoupled PPO, the inference correction, OPSM, DPPO, high-entropy
  tokens);
* ``"penalty"``: a term of its own (the KL penalties) or a change of the entropy bonus's
  coefficient (the adaptive entropy).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from torchrl_grpo.loss.inputs import Inputs
from torchrl_grpo.loss_terms import masked_mean

__all__ = ["RANGES", "Objective", "Step", "Variant", "check_range", "lookup", "masked_fraction"]

#: The range of each schedulable value, by buffer name: ``(what, bound)``, ``what`` one of
#: ``"positive"``, ``"non-negative"``, ``"greater than"``, ``"in [0, 1]"`` (filled from each
#: class's ``ranges`` as the classes are defined). The loss registers every name here as a buffer
#: (``None`` when no variant it holds has it), so that a variant left off at construction cannot
#: be scheduled on later.
RANGES: dict[str, tuple[str, float]] = {}


def lookup(registry: Mapping[str, Callable], value: str | Callable, name: str) -> Callable:
    """``value`` if it is a callable, else its entry in ``registry`` (one of the registries of
    :mod:`torchrl_grpo.loss_terms`).

    Raises:
        ValueError: a name the registry does not hold (named, with the registry's names).

    Examples:
        >>> from torchrl_grpo.loss.variants.base import lookup
        >>> from torchrl_grpo.loss_terms import KL_ESTIMATORS, kl_k2
        >>> lookup(KL_ESTIMATORS, "k2", "KL estimator") is kl_k2
        True
    """
    if callable(value):
        return value
    try:
        return registry[value]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown {name} {value!r}: pass one of {sorted(registry)} or a callable."
        ) from None


def check_range(name: str, value: float | None) -> None:
    """``value`` is ``None`` (off), or in the range ``RANGES`` gives ``name`` (never ``nan``).

    Raises:
        ValueError: the value is out of its range (named, with the value).

    Examples:
        >>> from torchrl_grpo.loss.variants.base import check_range
        >>> check_range("tis_cap", 2.0)
        >>> check_range("tis_cap", 0.0)
        Traceback (most recent call last):
        ...
        ValueError: tis_cap must be positive, got 0.0.
    """
    if value is None:
        return
    what, bound = RANGES[name]
    if what == "in [0, 1]":
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}.")
        return
    if not (value >= bound if what == "non-negative" else value > bound):
        what = f"greater than {bound:g}" if what == "greater than" else what
        raise ValueError(f"{name} must be {what}, got {value}.")


@dataclass
class Step:
    """What one call's variants share: the lined-up batch and what earlier stages decided.

    Attributes:
        x (Inputs): the batch as ``(B, T)`` tensors with one mask of real tokens.
        ratio_base (torch.Tensor): the log-probs the ratio and its clip are taken against (the
            proximal policy's with decoupled PPO, else the sampler's).
        loss_mask (torch.Tensor): the tokens the loss terms cover, once the ``"exclude"``
            variants ran.
        measured (torch.Tensor): the tokens whose entropy the adaptive coefficient measures
            (the real ones, or those high-entropy selection keeps).
        log_clip_bounds (tuple of torch.Tensor): ``(log(1 - eps_low), log(1 + eps_high))``,
            the clip band of this call.
    """

    x: Inputs
    ratio_base: torch.Tensor
    loss_mask: torch.Tensor | None = None
    measured: torch.Tensor | None = None
    log_clip_bounds: tuple[torch.Tensor, torch.Tensor] | None = None


def masked_fraction(keep: torch.Tensor, x: Inputs) -> torch.Tensor:
    """The share of the real tokens of ``x`` that ``keep`` leaves out (in the log-probs' dtype)."""
    return masked_mean((~keep).to(x.log_prob.dtype), x.mask)


class Variant:
    """A variant of the loss. Subclasses are frozen dataclasses of their settings.

    Attributes:
        slot (str): what the variant is one of (``"trust_region"``...): a loss holds one
            variant a slot; a preset's variant is replaced by the caller's of the same slot.
        stage (str): ``"objective"``, ``"exclude"``, ``"factor"`` or ``"penalty"``.
        reads (tuple of str): the entries it reads, by the loss's key names
            (``"inference_log_prob"``, ``"proximal_log_prob"``, ``"truncated"``,
            ``"ref_log_prob"``).
        fallback (bool): ``sample_log_prob`` stands in for an absent ``inference_log_prob``
            (torchrl's behaviour for the KL to inference; TRL's for OPSM).
        entropy (bool): it needs the policy's entropy even without the entropy bonus.
        ranges (dict): the range of each of its schedulable values, by buffer name.
        label (str): its name in messages (the keyword of the flat form).

    Examples:
        >>> from torchrl_grpo.loss.variants import TIS
        >>> tis = TIS(2.0)
        >>> tis.slot, tis.stage, tis.reads, tis.buffers()
        ('inference_correction', 'factor', ('inference_log_prob',), {'tis_cap': 2.0})
    """

    slot: ClassVar[str]
    stage: ClassVar[str]
    reads: ClassVar[tuple[str, ...]] = ()
    fallback: ClassVar[bool] = False
    entropy: ClassVar[bool] = False
    ranges: ClassVar[dict[str, tuple[str, float]]] = {}
    label: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        RANGES.update(cls.__dict__.get("ranges", {}))

    def __post_init__(self) -> None:
        # a dataclass subclass runs this after its __init__: its values checked when built
        self._check_ranges()

    def buffers(self) -> dict[str, float | None]:
        """The schedulable values, by buffer name (``loss.<name>`` at call time)."""
        return {}

    def metrics(self) -> tuple[str, ...]:
        """The output entries it adds."""
        return ()

    def modules(self, device=None) -> dict[str, torch.nn.Module]:
        """State the loss holds as submodules, by attribute name (saved with its state)."""
        return {}

    def check(self, held: tuple[Variant, ...], settings: Any) -> None:
        """Checks against the other variants the loss holds and its settings
        (``settings.ratio_level``, ``settings.entropy_bonus``); raise ``ValueError``."""

    def _check_ranges(self) -> None:
        for name, value in self.buffers().items():
            check_range(name, value)


class Objective(Variant):
    """The per-token surrogate: ``(log_ratio, advantage, log_prob, log_clip_low,
    log_clip_high) -> per-token loss``, the clip bounds read from the loss's buffers.

    Attributes:
        dual_clip (bool): the dual clip (``clip_ratio_c``) may bound it (PPO's surrogate, a
            callable); CISPO, SAPO and VESPO have no unbounded negative term to bound.
        ratio_levels (tuple of str or None): the ratio levels it needs (VESPO: the product of
            the token ratios); ``None``: any.
        title (str): its name in messages.

    Examples:
        >>> from torchrl_grpo.loss.variants import VESPO, Clip
        >>> Clip().dual_clip, VESPO().dual_clip
        (True, False)
    """

    slot: ClassVar[str] = "objective"
    stage: ClassVar[str] = "objective"
    dual_clip: ClassVar[bool] = False
    ratio_levels: ClassVar[tuple[str, ...] | None] = None
    title: ClassVar[str] = ""

    def loss(self, values, log_ratio, advantage, log_prob, log_clip_low, log_clip_high):
        """The per-token loss; ``values``: the loss module (its buffers at call time)."""
        raise NotImplementedError

    def report(self, values, step: Step) -> dict[str, torch.Tensor]:
        """Its own diagnostics (the entries of :meth:`metrics`), detached."""
        return {}

    def check(self, held: tuple[Variant, ...], settings: Any) -> None:
        ratio_level = settings.ratio_level
        if self.ratio_levels is None or callable(ratio_level):
            return
        if ratio_level not in self.ratio_levels:
            raise ValueError(
                f"objective={self.title.lower()!r} weighs each sequence by the product of its "
                f"token ratios: use ratio_level={self.ratio_levels[0]!r} (VESPOLoss sets it), "
                f"not {ratio_level!r}."
            )
