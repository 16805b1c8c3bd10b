"""What every variant of a :class:`~torchrl_grpo.GRPOLoss` is: one object in one place.

A variant declares the batch entries it reads (:attr:`Variant.reads`), the checks of its
settings (at construction), the values a scheduler may change (:meth:`Variant.buffers`, with
their :attr:`Variant.ranges`: registered on the loss that holds it as buffers, so that
``loss.tis_cap = 1.5`` and ``state_dict`` work as for ClipPPOLoss's ``clip_epsilon``), the
metrics it reports, and its math (calling the pure functions of :mod:`torchrl_grpo.loss_terms`).
The loss composes the ones it holds; nothing in ``loss/grpo.py`` knows any one of them.

One base class a stage, each declaring its hooks, in the order of one call:

* :class:`Objective`: the per-token surrogate (exactly one), :meth:`Objective.loss`;
* :class:`Exclusion`: tokens left out of the loss terms *and* of the aggregation's denominator
  (the KL trust region, truncated completions, the veto, verl's rejection),
  :meth:`Exclusion.exclude`;
* :class:`Factor`: a weight and/or tokens zeroed in ``loss_objective`` only, kept in the
  denominator as the papers write them (decoupled PPO, the inference correction, OPSM, DPPO,
  high-entropy tokens), :meth:`Factor.factor`;
* :class:`Penalty`: a term of its own (the KL penalties, :meth:`Penalty.terms`) or a change of
  the entropy bonus's coefficient (the adaptive entropy, :meth:`Penalty.coefficient`).

Every hook takes the call's :class:`Step`: the lined-up batch (``step.x``, with the entries the
variant reads), the values of the loss's schedulable buffers at call time (``step.values``)
and the state the variants keep on the loss (``step.modules``).

A variant of one's own is one subclass of a stage, passed where it is used: a frozen dataclass
of its settings, its ``slot``, and its hook. Its ``reads`` are batch keys of its choosing; its
``ranges`` become buffers of the losses that hold it, and of no other:

    >>> from dataclasses import dataclass
    >>> from typing import ClassVar
    >>> from torchrl_grpo.loss.variants import Exclusion, masked_fraction
    >>> @dataclass(frozen=True)
    ... class Confident(Exclusion):
    ...     # tokens whose stored confidence is below a bound leave the loss
    ...     bound: float
    ...     slot: ClassVar[str] = "confident"
    ...     reads: ClassVar[tuple] = ("confidence",)  # a new batch entry, read as it is
    ...     ranges: ClassVar[dict] = {"confidence_bound": ("in [0, 1]", 0.0)}
    ...
    ...     def buffers(self):
    ...         return {"confidence_bound": self.bound}
    ...
    ...     def metrics(self):
    ...         return ("unconfident_fraction",)
    ...
    ...     def exclude(self, step):
    ...         keep = step.x.entries["confidence"] >= step.values["confidence_bound"]
    ...         return keep, {"unconfident_fraction": masked_fraction(keep, step.x)}
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tensordict.nn import TensorDictModule
    >>> from torchrl.modules import ProbabilisticActor
    >>> from torchrl_grpo import GRPOLoss
    >>> net = TensorDictModule(torch.nn.Linear(3, 5), ["hidden"], ["logits"])
    >>> policy = ProbabilisticActor(net, in_keys=["logits"], out_keys=["tokens"],
    ...     distribution_class=torch.distributions.Categorical, return_log_prob=True)
    >>> batch = policy(TensorDict(hidden=torch.randn(2, 4, 3), batch_size=[2])).detach()
    >>> batch["advantage"] = torch.tensor([1.0, -1.0])
    >>> batch["confidence"] = torch.tensor([[0.9, 0.9, 0.2, 0.9], [0.9, 0.9, 0.9, 0.9]])
    >>> loss = GRPOLoss(policy, corrections=[Confident(0.5)])
    >>> loss.set_keys(sample_log_prob="tokens_log_prob")
    >>> loss(batch).unconfident_fraction  # one token of eight
    tensor(0.1250)
    >>> loss.confidence_bound = 0.95  # schedulable, checked against its range
    >>> loss(batch).unconfident_fraction
    tensor(1.)
    >>> "confidence_bound" in dict(GRPOLoss(policy).named_buffers())  # only where it is held
    False
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import torch

from torchrl_grpo.loss.inputs import Inputs
from torchrl_grpo.loss_terms import masked_mean

__all__ = [
    "Exclusion",
    "Factor",
    "Objective",
    "Penalty",
    "Step",
    "Variant",
    "check_range",
    "lookup",
    "masked_fraction",
]

#: A range of a schedulable value: ``(what, bound)``, ``what`` one of ``"positive"``,
#: ``"non-negative"``, ``"greater than"`` (``bound``) or ``"in [0, 1]"``.
Range = tuple[str, float]


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


def check_range(name: str, value: float | None, ranges: Mapping[str, Range]) -> None:
    """``value`` is ``None`` (off), or in the range ``ranges`` gives ``name`` (never ``nan``).

    Args:
        name (str): the schedulable value's buffer name.
        value (float or None): its value.
        ranges (Mapping[str, Range]): the ranges by name: those of a variant
            (:attr:`Variant.ranges`), of a loss (its variants'), or of the package's own
            variants (:func:`~torchrl_grpo.loss.variants.builtin_ranges`).

    Raises:
        ValueError: the value is out of its range (named, with the value).

    Examples:
        >>> from torchrl_grpo.loss.variants import TIS
        >>> from torchrl_grpo.loss.variants.base import check_range
        >>> check_range("tis_cap", 2.0, TIS.ranges)
        >>> check_range("my_bound", 0.0, {"my_bound": ("positive", 0.0)})
        Traceback (most recent call last):
        ...
        ValueError: my_bound must be positive, got 0.0.
    """
    if value is None:
        return
    what, bound = ranges[name]
    if what == "in [0, 1]":
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}.")
        return
    if not (value >= bound if what == "non-negative" else value > bound):
        what = f"greater than {bound:g}" if what == "greater than" else what
        raise ValueError(f"{name} must be {what}, got {value}.")


@dataclass
class Step:
    """What one call's variants share: the lined-up batch, the loss's state at call time, and
    what earlier stages decided. Every hook of a variant takes it.

    Attributes:
        x (Inputs): the batch as ``(B, T)`` tensors with one mask of real tokens; the entries
            the variants read beyond the built-in ones are ``x.entries[name]``.
        ratio_base (torch.Tensor): the log-probs the ratio and its clip are taken against (the
            proximal policy's with decoupled PPO, else the sampler's).
        loss_mask (torch.Tensor): the tokens the loss terms cover, once the
            :class:`Exclusion` variants ran.
        measured (torch.Tensor): the tokens whose entropy the adaptive coefficient measures
            (the real ones, or those high-entropy selection keeps).
        log_clip_bounds (tuple of torch.Tensor): ``(log(1 - eps_low), log(1 + eps_high))``,
            the clip band of this call.
        values (Mapping[str, torch.Tensor or None]): the schedulable values of the loss's
            variants at call time (its buffers, ``loss.tis_cap``...), by name.
        modules (Mapping[str, torch.nn.Module]): the state its variants keep on the loss
            (:meth:`Variant.modules`), by attribute name.
    """

    x: Inputs
    ratio_base: torch.Tensor
    loss_mask: torch.Tensor | None = None
    measured: torch.Tensor | None = None
    log_clip_bounds: tuple[torch.Tensor, torch.Tensor] | None = None
    values: Mapping[str, torch.Tensor | None] = field(default_factory=dict)
    modules: Mapping[str, torch.nn.Module] = field(default_factory=dict)


def masked_fraction(keep: torch.Tensor, x: Inputs) -> torch.Tensor:
    """The share of the real tokens of ``x`` that ``keep`` leaves out (in the log-probs' dtype)."""
    return masked_mean((~keep).to(x.log_prob.dtype), x.mask)


class Variant:
    """A variant of the loss: the base of the four stages (:class:`Objective`,
    :class:`Exclusion`, :class:`Factor`, :class:`Penalty`), whose hooks the loss calls.
    Subclasses are frozen dataclasses of their settings; the defaults below declare nothing.

    Attributes:
        slot (str): what the variant is one of (``"trust_region"``...): a loss holds one
            variant a slot; a preset's variant is replaced by the caller's of the same slot.
        reads (tuple of str): the batch entries it reads. A name of the loss's keys
            (``"inference_log_prob"``, ``"proximal_log_prob"``, ``"truncated"``,
            ``"ref_log_prob"``: ``set_keys`` renames them) is read as the loss reads it, into
            ``step.x.<name>``; any other name is a batch key of the variant's own, read per
            token (or per sequence, spread over its tokens) into ``step.x.entries[name]``,
            ``(B, T)`` with zeros on padding.
        fallback (bool): ``sample_log_prob`` stands in for an absent ``inference_log_prob``
            (torchrl's behaviour for the KL to inference; TRL's for OPSM).
        entropy (bool): it needs the policy's entropy even without the entropy bonus.
        ranges (dict): the range of each of its schedulable values (:data:`Range`), by buffer
            name: checked when built, and when a scheduler sets the value on a loss that
            holds it.

    Examples:
        >>> from torchrl_grpo.loss.variants import TIS, Factor
        >>> tis = TIS(2.0)
        >>> isinstance(tis, Factor), tis.slot, tis.reads, tis.buffers()
        (True, 'inference_correction', ('inference_log_prob',), {'tis_cap': 2.0})
    """

    slot: ClassVar[str]
    reads: ClassVar[tuple[str, ...]] = ()
    fallback: ClassVar[bool] = False
    entropy: ClassVar[bool] = False
    ranges: ClassVar[Mapping[str, Range]] = MappingProxyType({})

    def __post_init__(self) -> None:
        # a dataclass subclass runs this after its __init__: its values checked when built
        self._check_ranges()

    def buffers(self) -> dict[str, float | None]:
        """The schedulable values, by buffer name (``step.values[name]`` at call time)."""
        return {}

    def metrics(self) -> tuple[str, ...]:
        """The output entries it adds."""
        return ()

    def modules(self, device=None) -> dict[str, torch.nn.Module]:
        """State the loss holds as submodules, by attribute name (saved with its state;
        ``step.modules[name]`` at call time)."""
        return {}

    def check(self, held: tuple[Variant, ...], settings: Any) -> None:
        """Checks against the other variants the loss holds and its settings
        (``settings.ratio_level``, ``settings.entropy_bonus``); raise ``ValueError``."""

    def _check_ranges(self) -> None:
        for name, value in self.buffers().items():
            check_range(name, value, self.ranges)


class Objective(Variant):
    """The per-token surrogate: :meth:`loss` of the call's ratio, the clip band read from the
    step (``step.log_clip_bounds``).

    Attributes:
        title (str): its name in messages; lower-cased, a built-in one's name in
            :data:`~torchrl_grpo.loss_terms.OBJECTIVES` (``objective="cispo"`` is ``CISPO()``).
        dual_clip (bool): the dual clip (``clip_ratio_c``) may bound it (PPO's surrogate, a
            callable); CISPO, SAPO and VESPO have no unbounded negative term to bound.
        ratio_levels (tuple of str or None): the ratio levels it needs (VESPO: the product of
            the token ratios); ``None``: any.

    Examples:
        >>> from torchrl_grpo.loss.variants import VESPO, Clip
        >>> Clip().dual_clip, VESPO().dual_clip, VESPO.title
        (True, False, 'VESPO')
    """

    slot: ClassVar[str] = "objective"
    title: ClassVar[str] = ""
    dual_clip: ClassVar[bool] = False
    ratio_levels: ClassVar[tuple[str, ...] | None] = None

    def loss(self, step: Step, log_ratio: torch.Tensor) -> torch.Tensor:
        """The per-token loss ``(B, T)`` of ``log_ratio`` ``(B, T)`` (at the loss's ratio
        level), the advantage and log-probs in ``step.x``."""
        raise NotImplementedError(f"{type(self).__name__} defines no loss(step, log_ratio).")

    def report(self, step: Step) -> dict[str, torch.Tensor]:
        """Its own diagnostics (the entries of :meth:`metrics`), detached. None by default."""
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


class Exclusion(Variant):
    """Tokens left out of the loss terms and of the aggregation's denominator
    (``corrections=[...]``)."""

    def exclude(self, step: Step) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(keep, metrics)``: the tokens ``(B, T)`` kept, and the entries of :meth:`metrics`."""
        raise NotImplementedError(f"{type(self).__name__} defines no exclude(step).")


class Factor(Variant):
    """A weight on each token's objective, or tokens zeroed in it, kept in the aggregation's
    denominator (``corrections=[...]``)."""

    def factor(
        self, step: Step
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]:
        """``(weight, keep, metrics)``: the weight ``(B, T)`` (``None``: 1), the tokens kept
        (``None``: all), and the entries of :meth:`metrics`."""
        raise NotImplementedError(f"{type(self).__name__} defines no factor(step).")


class Penalty(Variant):
    """A term of its own, or a change of the entropy bonus's coefficient
    (``penalties=[...]``): by default neither."""

    def terms(self, step: Step, reduce: Callable) -> dict[str, torch.Tensor]:
        """Its output entries: ``loss_*`` terms (``reduce`` aggregates a ``(B, T)`` tensor over
        the loss's tokens) and metrics. None by default."""
        return {}

    def coefficient(self, step: Step, coeff: torch.Tensor) -> torch.Tensor:
        """The entropy bonus's coefficient this call applies, given the loss's ``coeff``
        (reported as ``entropy_coeff`` when a penalty changes it). ``coeff`` by default."""
        return coeff
