"""The surrogate objectives as variants: PPO's clip (with the dual or two-sided clip), CISPO,
SAPO, VESPO, and any callable."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from torchrl_grpo.loss.variants.base import Objective, Step
from torchrl_grpo.loss_terms import (
    OBJECTIVES,
    SAPO_TEMPERATURES,
    VESPO_K,
    VESPO_LAMBDA,
    dual_clip_loss,
    two_sided_clip_loss,
    vespo_phi_sequence_mean,
)

__all__ = [
    "CISPO",
    "OBJECTIVE_CLASSES",
    "SAPO",
    "SAPO_TEMPERATURES",
    "VESPO",
    "VESPO_K",
    "VESPO_LAMBDA",
    "Clip",
    "CustomObjective",
    "objective_from_name",
]


def _call(fn: Callable, step: Step, log_ratio: torch.Tensor, **settings) -> torch.Tensor:
    """``fn``, of :data:`~torchrl_grpo.loss_terms.OBJECTIVES`' signature, on this call."""
    x, (low, high) = step.x, step.log_clip_bounds
    return fn(log_ratio, x.advantage, x.log_prob, low, high, **settings)


class _DualClipped(Objective):
    """An objective the dual clip may bound (``clip_ratio_c``, a schedulable buffer)."""

    dual_clip: ClassVar[bool] = True
    ranges: ClassVar[dict] = {"clip_ratio_c": ("greater than", 1.0)}

    def _dual(self, step: Step, per_token: torch.Tensor) -> torch.Tensor:
        c = step.values["clip_ratio_c"]
        return per_token if c is None else dual_clip_loss(per_token, step.x.advantage, c)


@dataclass(frozen=True)
class Clip(_DualClipped):
    """PPO's clipped surrogate (:func:`~torchrl_grpo.loss_terms.ppo_clip_loss`), the default.

    Args:
        clip_ratio_c (float, optional): the dual clip ``c > 1`` for negative advantages
            (:func:`~torchrl_grpo.loss_terms.dual_clip_loss`; ``3.0`` in the paper and verl).
            Schedulable: ``loss.clip_ratio_c``.
        delta (float, optional): the two-sided clip (INTELLECT-2, TRL's ``delta``): the
            unclipped ratio is capped at ``delta > 1``
            (:func:`~torchrl_grpo.loss_terms.two_sided_clip_loss`). Not with ``clip_ratio_c``.
            Schedulable: ``loss.delta``.

    Examples:
        >>> import torch
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor
        >>> from torchrl_grpo import GRPOLoss
        >>> from torchrl_grpo.loss.variants import Clip
        >>> net = TensorDictModule(torch.nn.Linear(3, 5), ["hidden"], ["logits"])
        >>> policy = ProbabilisticActor(net, in_keys=["logits"], out_keys=["tokens"],
        ...     distribution_class=torch.distributions.Categorical)
        >>> loss = GRPOLoss(policy, objective=Clip(clip_ratio_c=3.0))
        >>> loss.clip_ratio_c
        tensor(3.)
    """

    clip_ratio_c: float | None = None
    delta: float | None = None
    title: ClassVar[str] = "clip"
    ranges: ClassVar[dict] = {
        "clip_ratio_c": ("greater than", 1.0),
        "delta": ("greater than", 1.0),
    }

    def __post_init__(self):
        if self.clip_ratio_c is not None and self.delta is not None:
            raise ValueError(
                "clip_ratio_c and delta both bound the loss of negative-advantage tokens (delta "
                "> 1 + eps_high is the dual clip with c = delta): pass one."
            )
        self._check_ranges()

    def buffers(self):
        return {"clip_ratio_c": self.clip_ratio_c, "delta": self.delta}

    def loss(self, step: Step, log_ratio: torch.Tensor) -> torch.Tensor:
        delta = step.values["delta"]
        if delta is not None:  # the two-sided clip replaces PPO's surrogate
            low, high = step.log_clip_bounds
            return two_sided_clip_loss(log_ratio, step.x.advantage, low, high, delta)
        return self._dual(step, _call(OBJECTIVES["clip"], step, log_ratio))


@dataclass(frozen=True)
class CustomObjective(_DualClipped):
    """Any surrogate: a callable ``(log_ratio, advantage, log_prob, log_clip_low,
    log_clip_high) -> per-token loss`` (or a name registered in
    :data:`~torchrl_grpo.loss_terms.OBJECTIVES`), which the dual clip may bound.

    Args:
        fn (callable): the surrogate.
        clip_ratio_c (float, optional): as :class:`Clip`'s.

    Examples:
        >>> from torchrl_grpo.loss.variants import CustomObjective
        >>> from torchrl_grpo.loss_terms import cispo_loss
        >>> CustomObjective(cispo_loss).dual_clip
        True
    """

    fn: Callable
    clip_ratio_c: float | None = None
    title: ClassVar[str] = "custom"

    def buffers(self):
        return {"clip_ratio_c": self.clip_ratio_c}

    def loss(self, step: Step, log_ratio: torch.Tensor) -> torch.Tensor:
        return self._dual(step, _call(self.fn, step, log_ratio))


@dataclass(frozen=True)
class CISPO(Objective):
    """CISPO's clipped, stop-gradient importance weight
    (:func:`~torchrl_grpo.loss_terms.cispo_loss`; the clip band is ``clip_epsilon``'s).

    Examples:
        >>> from torchrl_grpo.loss.variants import CISPO
        >>> CISPO().dual_clip  # every token keeps its gradient: nothing to bound
        False
    """

    title: ClassVar[str] = "CISPO"

    def loss(self, step: Step, log_ratio: torch.Tensor) -> torch.Tensor:
        return _call(OBJECTIVES["cispo"], step, log_ratio)


@dataclass(frozen=True)
class SAPO(Objective):
    """SAPO's soft gate (:func:`~torchrl_grpo.loss_terms.sapo_loss`); the clip band only sets
    the reported clip fractions.

    Args:
        temperature_pos (float): ``tau_pos`` (tokens with ``A > 0``). Defaults to ``1.0``.
        temperature_neg (float): ``tau_neg`` (``A <= 0``). Defaults to ``1.05``.

    Examples:
        >>> from torchrl_grpo.loss.variants import SAPO
        >>> SAPO(temperature_neg=2.0)
        SAPO(temperature_pos=1.0, temperature_neg=2.0)
    """

    temperature_pos: float = SAPO_TEMPERATURES[0]
    temperature_neg: float = SAPO_TEMPERATURES[1]
    title: ClassVar[str] = "SAPO"

    def __post_init__(self):
        taus = (self.temperature_pos, self.temperature_neg)
        if min(taus) <= 0:
            raise ValueError(f"SAPO temperatures must be positive, got {taus}.")

    def loss(self, step: Step, log_ratio: torch.Tensor) -> torch.Tensor:
        taus = {"temperature_pos": self.temperature_pos, "temperature_neg": self.temperature_neg}
        return _call(OBJECTIVES["sapo"], step, log_ratio, **taus)


@dataclass(frozen=True)
class VESPO(Objective):
    """VESPO's kernel on the sequence weight (:func:`~torchrl_grpo.loss_terms.vespo_loss`),
    with ``ratio_level="sequence_sum"``. Reports ``vespo_phi_seq_mean``, TRL's
    ``vespo/phi_seq_mean`` (:func:`~torchrl_grpo.loss_terms.vespo_phi_sequence_mean`; the
    kernel picked by the sign of each sequence's summed advantage).

    Args:
        k (tuple of float): ``(k for A >= 0, k for A < 0)``. Defaults to ``(2.0, 3.0)`` (TRL's).
        lambda_ (tuple of float): ``lambda``, the same way. Defaults to ``(3.0, 2.0)``.

    Examples:
        >>> from torchrl_grpo.loss.variants import VESPO
        >>> VESPO().ratio_levels
        ('sequence_sum',)
    """

    k: tuple[float, float] = VESPO_K
    lambda_: tuple[float, float] = VESPO_LAMBDA
    title: ClassVar[str] = "VESPO"
    ratio_levels: ClassVar[tuple[str, ...]] = ("sequence_sum",)

    def __post_init__(self):
        ks, lambdas = tuple(self.k), tuple(self.lambda_)
        if len(ks) != 2 or len(lambdas) != 2 or min(*ks, *lambdas) < 0:
            raise ValueError(
                "vespo_k and vespo_lambda are pairs (for A >= 0, for A < 0) of non-negative "
                f"numbers, got {ks} and {lambdas}."
            )
        object.__setattr__(self, "k", ks)
        object.__setattr__(self, "lambda_", lambdas)

    def metrics(self):
        return ("vespo_phi_seq_mean",)

    def report(self, step: Step) -> dict[str, torch.Tensor]:
        x = step.x
        log_ratio = x.log_prob.detach() - step.ratio_base
        advantage = torch.where(x.mask, x.advantage, 0.0).sum(-1, keepdim=True)  # (B, 1)
        (k_pos, k_neg), (lambda_pos, lambda_neg) = self.k, self.lambda_
        phi = vespo_phi_sequence_mean(
            log_ratio, advantage, x.mask, k_pos, lambda_pos, k_neg, lambda_neg
        )
        return {"vespo_phi_seq_mean": phi.to(x.log_prob.dtype)}

    def loss(self, step: Step, log_ratio: torch.Tensor) -> torch.Tensor:
        (k_pos, k_neg), (lambda_pos, lambda_neg) = self.k, self.lambda_
        kernels = {
            "k_pos": k_pos,
            "lambda_pos": lambda_pos,
            "k_neg": k_neg,
            "lambda_neg": lambda_neg,
        }
        return _call(OBJECTIVES["vespo"], step, log_ratio, **kernels)


#: The built-in objective classes; by name (their ``title``, lower-cased: the keys of
#: :data:`~torchrl_grpo.loss_terms.OBJECTIVES` they compute), a view of the classes.
OBJECTIVE_CLASSES: tuple[type[Objective], ...] = (Clip, CISPO, SAPO, VESPO)


def objective_from_name(objective: str | Callable | Objective) -> Objective:
    """The objective variant of a name of :data:`~torchrl_grpo.loss_terms.OBJECTIVES` (a name
    registered there by a user becomes a :class:`CustomObjective`), a callable, or a variant.

    Raises:
        ValueError: for a name that is not registered.

    Examples:
        >>> objective_from_name("cispo")
        CISPO()
    """
    if isinstance(objective, Objective):
        return objective
    if callable(objective):
        return CustomObjective(objective)
    by_name = {cls.title.lower(): cls for cls in OBJECTIVE_CLASSES}
    if objective in by_name:
        return by_name[objective]()
    if isinstance(objective, str) and objective in OBJECTIVES:
        return CustomObjective(OBJECTIVES[objective])
    raise ValueError(
        f"Unknown objective {objective!r}: pass one of {sorted(OBJECTIVES)}, a variant of "
        "torchrl_grpo.loss.variants (Clip(), CISPO()...) or a callable."
    )
