"""GRPOLoss: torchrl's ClipPPOLoss without a critic, over real tokens, with GRPO's variants.

The module only fetches tensors, lines their shapes up and calls the math of
:mod:`torchrl_grpo.loss_terms`. Everything that varies between the published variants is one
keyword: the clip band (``clip_epsilon``), the dual clip (``clip_ratio_c``), the surrogate
(``objective``), the level of the importance ratio (``ratio_level``), the aggregation, the KL
estimators and the truncated importance sampling cap (``tis_cap``). :class:`DAPOLoss`,
:class:`DrGRPOLoss`, :class:`GSPOLoss` and :class:`CISPOLoss` are the same class with the papers'
defaults.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tensordict import TensorClass, TensorDictBase
from tensordict.nn import ProbabilisticTensorDictSequential
from tensordict.utils import NestedKey
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.utils import _maybe_add_or_extend_key

from torchrl_grpo.loss_terms import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    cispo_loss,
    clip_fractions,
    dual_clip_loss,
    effective_sample_size,
    masked_mean,
    ppo_clip_loss,
    sequence_log_ratio,
    truncated_is_weight,
)

__all__ = [
    "CISPOLoss",
    "DAPOLoss",
    "DrGRPOLoss",
    "GRPOLoss",
    "GRPOLossOutput",
    "GSPOLoss",
]

#: ``objective(log_ratio, advantage, log_prob, log_clip_low, log_clip_high) -> per-token loss``
Objective = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]
#: ``ratio_level(log_ratio, mask) -> log_ratio``, all ``(B, T)``
RatioLevel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _clip_objective(log_ratio, advantage, log_prob, log_clip_low, log_clip_high):
    # the PPO surrogate does not use log_prob; the uniform signature lets objectives be swapped
    return ppo_clip_loss(log_ratio, advantage, log_clip_low, log_clip_high)


def _token_log_ratio(log_ratio, mask):
    return log_ratio


OBJECTIVES: dict[str, Objective] = {"clip": _clip_objective, "cispo": cispo_loss}
RATIO_LEVELS: dict[str, RatioLevel] = {"token": _token_log_ratio, "sequence": sequence_log_ratio}


def _lookup(registry: dict, value, name: str):
    if callable(value):
        return value
    try:
        return registry[value]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown {name} {value!r}: pass one of {sorted(registry)} or a callable."
        ) from None


class GRPOLossOutput(TensorClass["nocast"]):
    # tensordict's TensorClass replaces the class docstring: it is set again below.

    loss_objective: torch.Tensor
    clip_fraction: torch.Tensor
    clip_fraction_low: torch.Tensor
    clip_fraction_high: torch.Tensor
    kl_approx: torch.Tensor
    ESS: torch.Tensor
    entropy: torch.Tensor | None = None
    loss_entropy: torch.Tensor | None = None
    kl_to_ref: torch.Tensor | None = None
    loss_kl_to_ref: torch.Tensor | None = None
    kl_to_inference: torch.Tensor | None = None
    loss_kl_to_inference: torch.Tensor | None = None


GRPOLossOutput.__doc__ = """What :class:`GRPOLoss` returns: the terms to sum (``loss_*``) and the metrics to log.

    Every ``loss_*`` field is a differentiable scalar (or, with ``reduction="none"``, a per-token
    tensor of the policy's log-prob shape holding zeros on padding); the others are detached
    scalars computed over real tokens only. Optional terms are ``None`` when not configured.

    Attributes:
        loss_objective: the aggregated surrogate loss.
        clip_fraction: share of real tokens whose ratio is outside the clip band.
        clip_fraction_low: share below ``1 - eps_low``.
        clip_fraction_high: share above ``1 + eps_high``.
        kl_approx: ``mean(log pi_old - log pi_theta)``, as :class:`~torchrl.objectives.ClipPPOLoss`.
        ESS: normalised effective sample size of the importance weights, in ``(0, 1]``.
        entropy: mean per-token entropy of the policy (``None`` without ``entropy_bonus``).
        loss_entropy: ``-entropy_coeff`` times the aggregated entropy.
        kl_to_ref: mean KL estimate to the reference policy (``None`` without ``kl_to_ref_coeff``).
        loss_kl_to_ref: ``kl_to_ref_coeff`` times the aggregated estimate.
        kl_to_inference: mean KL estimate to the sampling policy.
        loss_kl_to_inference: ``kl_to_inference_coeff`` times the aggregated estimate.

    Examples:
        >>> import torch
        >>> out = GRPOLossOutput(
        ...     loss_objective=torch.tensor(0.5), clip_fraction=torch.tensor(0.0),
        ...     clip_fraction_low=torch.tensor(0.0), clip_fraction_high=torch.tensor(0.0),
        ...     kl_approx=torch.tensor(0.0), ESS=torch.tensor(1.0), batch_size=[])
        >>> out.loss_objective, out.kl_to_ref
        (tensor(0.5000), None)
        >>> sum(v for k, v in out.items() if k.startswith("loss_"))
        tensor(0.5000)
    """


class GRPOLoss(ClipPPOLoss):
    """GRPO loss: :class:`~torchrl.objectives.ClipPPOLoss` with no critic, over real tokens.

    With the defaults, the loss is ClipPPOLoss's clipped surrogate (Schulman et al., 2017) on a
    precomputed advantage -- the group-relative advantage of GRPO (Shao et al., 2024) -- averaged
    over the real tokens of the batch:

    .. math::

        L = \\frac{1}{\\sum_i |o_i|} \\sum_i \\sum_{t} -\\min\\big(r_{i,t} A_{i,t},\\
            \\operatorname{clip}(r_{i,t}, 1-\\varepsilon_{low}, 1+\\varepsilon_{high}) A_{i,t}\\big)
            \\;-\\; c_H\\, \\bar{H} \\;+\\; \\beta_{ref}\\, \\overline{KL}_{ref}
            \\;+\\; \\beta_{inf}\\, \\overline{KL}_{inf}

    where ``r = pi_theta / pi_old``. The per-token pieces are the pure functions of
    :mod:`torchrl_grpo.loss_terms`; each term of the output is returned separately
    (:class:`GRPOLossOutput`), to be summed by the caller.

    **Inputs.** The policy is any torchrl probabilistic actor
    (:class:`~torchrl.modules.ProbabilisticActor`, a
    :class:`~tensordict.nn.ProbabilisticTensorDictSequential`...). Its log-prob of the stored
    action, read from the batch exactly as :class:`~torchrl.objectives.ClipPPOLoss` does, sets
    the shape every other entry is checked against:

    * classic control: batch ``[N]``, log-prob ``[N]``, advantage ``[N]`` or ``[N, 1]``; each
      step is a sequence of one token.
    * tokens: log-prob ``[B, T]`` (``B`` padded responses of ``T`` tokens); advantage per token
      (``[B, T]`` or ``[B, T, 1]``) or per sequence (``[B]`` or ``[B, 1]``, broadcast over the
      tokens); an optional boolean mask ``[B, T]`` that is ``True`` on real tokens.
      Leading batch dimensions beyond two are flattened into ``B``; the last one is ``T``.

    Keys (``set_keys``): ``advantage``, ``action``, ``sample_log_prob`` (the log-probs of the
    policy the ratio is taken against, as in ClipPPOLoss; resolved from the actor), ``mask``
    (``"mask"``; absent means every entry is real), ``ref_log_prob`` (``"ref_log_prob"``, read
    only with ``kl_to_ref_coeff``) and ``inference_log_prob`` (``"inference_log_prob"``: the
    sampler's log-probs, read by ``tis_cap`` and by the KL to inference; when absent that KL is
    taken against ``sample_log_prob``, torchrl's behaviour). torchrl's ``loss_mask_key`` entries
    (``("collector", "mask")``...) are honoured too, and-ed with ``mask``.

    **Padding** never enters the loss, the metrics or the gradient: padded entries of every input
    are replaced by zeros with ``torch.where`` before any arithmetic (so ``nan`` pads are fine),
    and every mean divides by the number of real tokens or non-empty sequences.

    **Degenerate cases.** A batch with no real token raises ``ValueError`` (there is nothing to
    average, and a silent zero loss would hide a broken pipeline). A sequence with no real token
    inside a batch is ignored: it is not counted by the per-sequence aggregations. A
    sequence-level ratio of an empty sequence is 1.

    Args:
        actor_network (ProbabilisticTensorDictSequential): the policy.

    Keyword Args:
        clip_epsilon (float or tuple of float): ``eps`` or ``(eps_low, eps_high)``; the ratio is
            clipped to ``[1 - eps_low, 1 + eps_high]`` (DAPO's clip-higher uses ``(0.2, 0.28)``).
            ``eps_low = 1.0`` means no lower bound (CISPO). Schedulable buffers, as in
            ClipPPOLoss: ``clip_epsilon``, or ``clip_epsilon_low`` / ``clip_epsilon_high``.
            Defaults to ``0.2``.
        entropy_bonus (bool): compute the entropy and its loss term. Defaults to ``True``.
        samples_mc_entropy (int): Monte-Carlo samples for distributions without an analytic
            entropy. Defaults to ``1``.
        entropy_coeff (float): ``c_H``, a schedulable buffer. Defaults to ``0.01`` (ClipPPOLoss).
        objective (str or callable): ``"clip"`` (PPO's clipped surrogate,
            :func:`~torchrl_grpo.loss_terms.ppo_clip_loss`), ``"cispo"``
            (:func:`~torchrl_grpo.loss_terms.cispo_loss`), or a callable
            ``(log_ratio, advantage, log_prob, log_clip_low, log_clip_high) -> per-token loss``.
            Defaults to ``"clip"``.
        ratio_level (str or callable): ``"token"`` or ``"sequence"`` (GSPO's length-normalised
            sequence ratio, :func:`~torchrl_grpo.loss_terms.sequence_log_ratio`), or a callable
            ``(log_ratio, mask) -> log_ratio``. Defaults to ``"token"``.
        aggregation (str or callable): how per-token losses become a scalar: a key of
            :data:`~torchrl_grpo.loss_terms.AGGREGATIONS` (``"token_mean"``,
            ``"seq_mean_token_mean"``, ``"seq_mean_token_sum"``, ``"seq_mean_token_sum_norm"``)
            or a callable ``(loss, mask) -> scalar``. Applies to every ``loss_*`` term.
            Defaults to ``"token_mean"``.
        max_length (int, optional): the constant ``L_max`` of ``"seq_mean_token_sum_norm"``
            (Dr. GRPO), required by it and rejected by the others.
        clip_ratio_c (float, optional): dual clip ``c > 1`` for negative advantages
            (:func:`~torchrl_grpo.loss_terms.dual_clip_loss`; ``3.0`` in the paper). Only with
            ``objective="clip"`` or a custom objective. Schedulable buffer.
        kl_to_ref_coeff (float, optional): ``beta_ref``; enables ``kl_to_ref`` /
            ``loss_kl_to_ref`` (reads ``ref_log_prob``). Schedulable buffer.
        kl_to_ref_estimator (str or callable): ``"k1"``, ``"k2"``, ``"k3"`` (clamped, verl's
            ``low_var_kl``) or ``(log_prob, ref_log_prob) -> per-token estimate``.
            Defaults to ``"k3"``.
        kl_to_inference_coeff (float, optional): ``beta_inf``; enables ``kl_to_inference`` /
            ``loss_kl_to_inference``. Schedulable buffer.
        kl_to_inference_estimator (str or callable): as ``kl_to_ref_estimator``.
            Defaults to ``"k3"``.
        tis_cap (float, optional): truncated importance sampling: multiply each token's loss by
            ``min(pi_old / pi_inference, tis_cap)``, without gradient
            (:func:`~torchrl_grpo.loss_terms.truncated_is_weight`; Yao et al., 2025, use 2).
            Reads ``inference_log_prob``. Schedulable buffer.
        reduction (str, optional): ``"mean"`` (apply ``aggregation``) or ``"none"`` (per-token
            ``loss_*`` terms, zeros on padding). ``"sum"`` is not supported: choose an
            aggregation. Defaults to ``"mean"``.
        functional (bool): as in ClipPPOLoss. Defaults to ``True``.
        device (torch.device, optional): device of the buffers.

    Raises:
        ValueError: for an unknown variant name, an invalid coefficient, ``reduction="sum"``,
            or a ``max_length`` that does not match the aggregation.
        TypeError: for a critic-related ClipPPOLoss argument (GRPO has no critic).

    Examples:
        A CartPole-style actor (4 observations, 2 actions), as for ClipPPOLoss:

        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor
        >>> _ = torch.manual_seed(0)
        >>> net = TensorDictModule(torch.nn.Linear(4, 2), ["observation"], ["logits"])
        >>> actor = ProbabilisticActor(net, in_keys=["logits"],
        ...     distribution_class=torch.distributions.Categorical, return_log_prob=True)
        >>> batch = actor(TensorDict({"observation": torch.randn(8, 4)}, [8])).detach()
        >>> batch["advantage"] = torch.randn(8, 1)
        >>> loss = GRPOLoss(actor, clip_epsilon=0.2, entropy_coeff=0.01)
        >>> out = loss(batch)
        >>> total = out.loss_objective + out.loss_entropy
        >>> total.backward()
        >>> out.ESS, out.clip_fraction  # fresh samples: every ratio is 1
        (tensor(1.), tensor(0.))
        >>> loss.clip_epsilon = 0.1  # schedulable, as in torchrl

        Tokens: ``[B, T]`` responses with padding and a per-sequence advantage:

        >>> net = TensorDictModule(torch.nn.Linear(3, 5), ["hidden"], ["logits"])
        >>> policy = ProbabilisticActor(net, in_keys=["logits"], out_keys=["tokens"],
        ...     distribution_class=torch.distributions.Categorical)
        >>> batch = TensorDict({
        ...     "hidden": torch.randn(2, 4, 3),
        ...     "tokens": torch.randint(5, (2, 4)),
        ...     "old_log_prob": torch.full((2, 4), -1.6),
        ...     "advantage": torch.tensor([1.0, -1.0]),
        ...     "mask": torch.tensor([[True, True, True, False], [True, True, False, False]]),
        ... }, [2])
        >>> loss = DAPOLoss(policy)
        >>> loss.set_keys(sample_log_prob="old_log_prob")
        >>> out = loss(batch)
        >>> out.clip_fraction_low + out.clip_fraction_high == out.clip_fraction
        tensor(True)
    """

    @dataclass
    class _AcceptedKeys(ClipPPOLoss._AcceptedKeys):
        """Tensordict keys of :class:`GRPOLoss`, changed with ``set_keys(name=key)``.

        On top of ClipPPOLoss's keys (``advantage``, ``action``, ``sample_log_prob``...):

        Attributes:
            mask (NestedKey): boolean mask of real tokens, shaped like the log-prob. Optional:
                absent means every entry is real. Defaults to ``"mask"``.
            ref_log_prob (NestedKey): reference-policy log-probs of the sampled tokens, read
                when ``kl_to_ref_coeff`` is set. Defaults to ``"ref_log_prob"``.
            inference_log_prob (NestedKey): sampler (inference engine) log-probs, read by
                ``tis_cap`` and the KL to inference. Defaults to ``"inference_log_prob"``.
        """

        mask: NestedKey = "mask"
        ref_log_prob: NestedKey = "ref_log_prob"
        inference_log_prob: NestedKey = "inference_log_prob"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    _schedulable_buffers = frozenset(
        {"clip_ratio_c", "kl_to_ref_coeff", "kl_to_inference_coeff", "tis_cap"}
    )

    def __init__(
        self,
        actor_network: ProbabilisticTensorDictSequential | None = None,
        *,
        clip_epsilon: float | tuple[float, float] = 0.2,
        entropy_bonus: bool = True,
        samples_mc_entropy: int = 1,
        entropy_coeff: float | None = None,
        objective: str | Objective = "clip",
        ratio_level: str | RatioLevel = "token",
        aggregation: str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = "token_mean",
        max_length: int | None = None,
        clip_ratio_c: float | None = None,
        kl_to_ref_coeff: float | None = None,
        kl_to_ref_estimator: str | Callable = "k3",
        kl_to_inference_coeff: float | None = None,
        kl_to_inference_estimator: str | Callable = "k3",
        tis_cap: float | None = None,
        reduction: str | None = None,
        functional: bool = True,
        device: torch.device | None = None,
    ):
        if reduction not in (None, "mean", "none"):
            raise ValueError(
                f"GRPOLoss supports reduction='mean' (apply `aggregation`) or 'none', got "
                f"{reduction!r}; for a sum over tokens use aggregation='seq_mean_token_sum' "
                "or a callable."
            )
        if isinstance(entropy_coeff, dict):
            raise TypeError("GRPOLoss takes a scalar entropy_coeff (single-head policies only).")
        objective_fn = _lookup(OBJECTIVES, objective, "objective")
        if clip_ratio_c is not None:
            if objective_fn is cispo_loss:
                raise ValueError(
                    "clip_ratio_c (dual clip) applies to the PPO surrogate, not CISPO."
                )
            if clip_ratio_c <= 1.0:
                raise ValueError(f"clip_ratio_c must be greater than 1, got {clip_ratio_c}.")
        if tis_cap is not None and tis_cap <= 0:
            raise ValueError(f"tis_cap must be positive, got {tis_cap}.")
        for name, coeff in (
            ("kl_to_ref_coeff", kl_to_ref_coeff),
            ("kl_to_inference_coeff", kl_to_inference_coeff),
        ):
            if coeff is not None and coeff < 0:
                raise ValueError(f"{name} must be non-negative, got {coeff}.")
        # torchrl forbids eps_low >= 1 (log(0)); here eps_low = 1 means "no lower bound" (CISPO)
        no_lower_bound = isinstance(clip_epsilon, (tuple, list)) and float(clip_epsilon[0]) == 1.0
        if no_lower_bound:
            clip_epsilon = (0.0, clip_epsilon[1])

        super().__init__(
            actor_network,
            None,
            clip_epsilon=clip_epsilon,
            entropy_bonus=entropy_bonus,
            samples_mc_entropy=samples_mc_entropy,
            entropy_coeff=entropy_coeff,
            reduction=reduction,
            functional=functional,
            device=device,
        )
        if no_lower_bound:
            self.clip_epsilon_low.fill_(1.0)
        device = self._clip_bounds[1].device
        self._objective = objective_fn
        self._ratio_level = _lookup(RATIO_LEVELS, ratio_level, "ratio_level")
        self._aggregate = self._make_aggregation(aggregation, max_length)
        self._kl_to_ref_estimator = _lookup(KL_ESTIMATORS, kl_to_ref_estimator, "KL estimator")
        self._kl_to_inference_estimator = _lookup(
            KL_ESTIMATORS, kl_to_inference_estimator, "KL estimator"
        )
        self.register_coeff_buffer("clip_ratio_c", clip_ratio_c, device=device)
        self.register_coeff_buffer("kl_to_ref_coeff", kl_to_ref_coeff, device=device)
        self.register_coeff_buffer("kl_to_inference_coeff", kl_to_inference_coeff, device=device)
        self.register_coeff_buffer("tis_cap", tis_cap, device=device)
        self._in_keys = None
        self._out_keys = None

    @staticmethod
    def _make_aggregation(aggregation, max_length):
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

    # --- keys -----------------------------------------------------------------------------

    def _set_in_keys(self):
        keys = []
        _maybe_add_or_extend_key(keys, self.actor_network.in_keys)
        tk = self.tensor_keys
        for key in (tk.action, tk.sample_log_prob, tk.advantage, tk.mask):
            _maybe_add_or_extend_key(keys, key)
        if getattr(self, "kl_to_ref_coeff", None) is not None:
            _maybe_add_or_extend_key(keys, tk.ref_log_prob)
        if getattr(self, "tis_cap", None) is not None:
            _maybe_add_or_extend_key(keys, tk.inference_log_prob)
        self._in_keys = list(dict.fromkeys(keys))

    @property
    def out_keys(self):
        if self._out_keys is None:
            keys = [
                "loss_objective",
                "clip_fraction",
                "clip_fraction_low",
                "clip_fraction_high",
                "kl_approx",
                "ESS",
            ]
            if self.entropy_bonus:
                keys += ["entropy", "loss_entropy"]
            if self.kl_to_ref_coeff is not None:
                keys += ["kl_to_ref", "loss_kl_to_ref"]
            if self.kl_to_inference_coeff is not None:
                keys += ["kl_to_inference", "loss_kl_to_inference"]
            self._out_keys = keys
        return self._out_keys

    @out_keys.setter
    def out_keys(self, values):
        self._out_keys = values

    def make_value_estimator(self, value_type=None, **hyperparams):
        """GRPO has no critic: the advantage comes with the batch (e.g. from ``MCAdvantage``).

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no critic and no value estimator: write the advantage "
            f"into the batch under {self.tensor_keys.advantage!r} before calling the loss."
        )

    # --- plumbing ----------------------------------------------------------------------------

    def _get_input(self, tensordict: TensorDictBase, key: NestedKey, why: str) -> torch.Tensor:
        value = tensordict.get(key, None)
        if value is None:
            raise KeyError(
                f"{type(self).__name__} needs {key!r} ({why}) in the input batch; "
                f"found keys {sorted(map(str, tensordict.keys(True, True)))}."
            )
        if value.requires_grad:
            raise RuntimeError(
                f"The stored {key!r} requires grad: it must be data, not part of "
                "the graph. Store it detached."
            )
        return value

    def _token_mask(self, tensordict: TensorDictBase, log_prob: torch.Tensor) -> torch.Tensor:
        shape = log_prob.shape
        mask = None
        for key in dict.fromkeys((self.tensor_keys.mask, *self._loss_mask_keys())):
            entry = tensordict.get(key, None)
            if entry is not None:
                entry = _match_shape(entry, shape, key).bool()
                mask = entry if mask is None else mask & entry
        if mask is None:
            return torch.ones(shape, dtype=torch.bool, device=log_prob.device)
        return mask

    def forward(self, tensordict: TensorDictBase) -> GRPOLossOutput:
        """Compute the loss terms and metrics of a batch.

        Args:
            tensordict (TensorDictBase): the batch; see the class docstring for the entries.

        Returns:
            GRPOLossOutput: the ``loss_*`` terms to sum and the metrics.

        Raises:
            KeyError: a required entry is missing (the key is named).
            RuntimeError: a stored log-prob or advantage requires grad.
            ValueError: an entry's shape does not match the policy's log-prob, or the batch
                has no real token.
            NotImplementedError: for multi-head (composite) action distributions.
        """
        tensordict = tensordict.clone(False)  # the actor writes into it; leave the input as is
        tk = self.tensor_keys
        if not isinstance(tk.sample_log_prob, NestedKey) or not isinstance(tk.action, NestedKey):
            raise NotImplementedError(f"{type(self).__name__} supports single-head policies only.")
        advantage = self._get_input(tensordict, tk.advantage, "the advantage")
        old_log_prob = self._get_input(tensordict, tk.sample_log_prob, "the sampling log-probs")
        ref_log_prob = inference_log_prob = None
        if self.kl_to_ref_coeff is not None:
            ref_log_prob = self._get_input(tensordict, tk.ref_log_prob, "for kl_to_ref_coeff")
        if self.tis_cap is not None:
            inference_log_prob = self._get_input(tensordict, tk.inference_log_prob, "for tis_cap")
        elif self.kl_to_inference_coeff is not None:
            # torchrl's convention: without the sampler's own log-probs, the KL to inference
            # is taken against the log-probs the ratio uses
            key = tk.inference_log_prob
            if tensordict.get(key, None) is None:
                key = tk.sample_log_prob
            inference_log_prob = self._get_input(tensordict, key, "for kl_to_inference_coeff")

        log_prob, dist, is_composite = self._get_cur_log_prob(tensordict)
        if is_composite or not isinstance(log_prob, torch.Tensor):
            raise NotImplementedError(f"{type(self).__name__} supports single-head policies only.")
        shape = log_prob.shape
        if not shape:
            raise ValueError("The policy's log-prob is a scalar; expected a batch [N] or [B, T].")
        mask = _as_sequences(self._token_mask(tensordict, log_prob))  # (B, T)
        if not mask.any():
            raise ValueError(
                f"The batch has no real token: the mask {tk.mask!r} is all False "
                f"(shape {tuple(shape)}). There is nothing to average."
            )

        def tokens(x):  # (B, T), zeros on padding so nan/inf pads cannot leak
            return torch.where(mask, _as_sequences(x), 0.0)

        lp = tokens(log_prob)
        old = tokens(_match_shape(old_log_prob, shape, tk.sample_log_prob))
        adv = tokens(_match_advantage(advantage, shape, tk.advantage))

        def reduce(per_token):
            if self.reduction == "none":
                return torch.where(mask, per_token, 0.0).reshape(shape)
            return self._aggregate(per_token, mask)

        log_clip_low, log_clip_high = self._clip_bounds
        log_ratio = self._ratio_level(lp - old, mask)  # (B, T)
        per_token = self._objective(log_ratio, adv, lp, log_clip_low, log_clip_high)
        if self.clip_ratio_c is not None:
            per_token = dual_clip_loss(per_token, adv, self.clip_ratio_c)
        if self.tis_cap is not None:
            inf = tokens(_match_shape(inference_log_prob, shape, tk.inference_log_prob))
            per_token = per_token * truncated_is_weight(old, inf, self.tis_cap)
        clip_fraction, clip_low, clip_high = clip_fractions(
            log_ratio, mask, log_clip_low, log_clip_high
        )
        out = {
            "loss_objective": reduce(per_token),
            "clip_fraction": clip_fraction,
            "clip_fraction_low": clip_low,
            "clip_fraction_high": clip_high,
            "kl_approx": masked_mean(old - lp, mask).detach(),
            "ESS": effective_sample_size(log_ratio, mask),
        }
        if self.entropy_bonus:
            entropy = self._get_entropy(dist, adv_shape=shape).squeeze(-1)
            entropy = tokens(_match_shape(entropy, shape, "entropy"))
            out["entropy"] = masked_mean(entropy, mask).detach()
            out["loss_entropy"] = -self.entropy_coeff * reduce(entropy)
        if self.kl_to_ref_coeff is not None:
            ref = tokens(_match_shape(ref_log_prob, shape, tk.ref_log_prob))
            kl = self._kl_to_ref_estimator(lp, ref)
            out["kl_to_ref"] = masked_mean(kl, mask).detach()
            out["loss_kl_to_ref"] = self.kl_to_ref_coeff * reduce(kl)
        if self.kl_to_inference_coeff is not None:
            inf = tokens(_match_shape(inference_log_prob, shape, tk.inference_log_prob))
            kl = self._kl_to_inference_estimator(lp, inf)
            out["kl_to_inference"] = masked_mean(kl, mask).detach()
            out["loss_kl_to_inference"] = self.kl_to_inference_coeff * reduce(kl)
        self._clear_weakrefs(tensordict, "actor_network_params", "target_actor_network_params")
        return GRPOLossOutput(**out, batch_size=[])


def _as_sequences(x: torch.Tensor) -> torch.Tensor:
    # [N] -> [N, 1] (one-token sequences); [..., T] -> [prod(...), T]
    return x.reshape(-1, 1) if x.ndim == 1 else x.reshape(-1, x.shape[-1])


def _match_shape(x: torch.Tensor, shape: torch.Size, key) -> torch.Tensor:
    # an entry must have the log-prob's shape, optionally with a trailing singleton dimension
    if x.shape == shape:
        return x
    if x.shape == shape + (1,):
        return x.squeeze(-1)
    raise ValueError(
        f"{key!r} has shape {tuple(x.shape)}, but the policy's log-prob has shape "
        f"{tuple(shape)}: expected {tuple(shape)} or {tuple(shape + (1,))}."
    )


def _match_advantage(adv: torch.Tensor, shape: torch.Size, key) -> torch.Tensor:
    # per token ([B, T] or [B, T, 1]) or, for token batches, per sequence ([B] or [B, 1])
    if adv.shape in (shape, shape + (1,)):
        return _match_shape(adv, shape, key)
    if len(shape) >= 2 and adv.shape in (shape[:-1], shape[:-1] + (1,)):
        return adv.reshape(shape[:-1] + (1,)).expand(shape)
    expected = [shape, shape + (1,)]
    if len(shape) >= 2:
        expected += [shape[:-1], shape[:-1] + (1,)]
    raise ValueError(
        f"{key!r} has shape {tuple(adv.shape)}, but the policy's log-prob has shape "
        f"{tuple(shape)}: expected one of {[tuple(s) for s in expected]}."
    )


class DAPOLoss(GRPOLoss):
    """GRPOLoss with DAPO's defaults: clip-higher and a global token mean, no KL.

    DAPO (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    arXiv:2503.14476) decouples the clip band, ``[1 - 0.2, 1 + 0.28]`` (Eq. 10), so that
    low-probability tokens can grow, averages the loss over all tokens of the batch (its token-level
    policy-gradient loss, ``"token_mean"``) and drops the KL penalty. Its dynamic sampling and overlong shaping act on
    the data, not on the loss.

    .. math:: L = \\frac{1}{\\sum_i |o_i|} \\sum_{i,t} -\\min\\big(r_{i,t} A_i,\\
        \\operatorname{clip}(r_{i,t}, 0.8, 1.28) A_i\\big)

    Args:
        actor_network (ProbabilisticTensorDictSequential): the policy.

    Keyword Args:
        clip_epsilon: defaults to ``(0.2, 0.28)``.
        aggregation: defaults to ``"token_mean"``.
        entropy_coeff: defaults to ``0.0`` (the entropy is still reported).
        **kwargs: any other :class:`GRPOLoss` keyword.

    Examples:
        >>> import torch
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor
        >>> net = TensorDictModule(torch.nn.Linear(3, 5), ["hidden"], ["logits"])
        >>> policy = ProbabilisticActor(net, in_keys=["logits"], out_keys=["tokens"],
        ...     distribution_class=torch.distributions.Categorical)
        >>> loss = DAPOLoss(policy)
        >>> loss.clip_epsilon_low, loss.clip_epsilon_high
        (tensor(0.2000), tensor(0.2800))
    """

    def __init__(
        self,
        actor_network=None,
        *,
        clip_epsilon=(0.2, 0.28),
        aggregation="token_mean",
        entropy_coeff=0.0,
        **kwargs,
    ):
        super().__init__(
            actor_network,
            clip_epsilon=clip_epsilon,
            aggregation=aggregation,
            entropy_coeff=entropy_coeff,
            **kwargs,
        )


class DrGRPOLoss(GRPOLoss):
    """GRPOLoss with Dr. GRPO's defaults: token sums divided by a constant length, no KL.

    Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
    arXiv:2503.20783) removes GRPO's two biases: the division by the response length ``|o_i|``
    in the loss -- replaced here by the constant generation budget ``max_length`` -- and the
    division by the reward standard deviation in the advantage (an advantage-side setting).

    .. math:: L = \\frac{1}{G} \\sum_{i=1}^{G} \\frac{1}{L_{\\max}} \\sum_{t=1}^{|o_i|}
        -\\min\\big(r_{i,t} A_i,\\ \\operatorname{clip}(r_{i,t}, 0.8, 1.2) A_i\\big)

    Args:
        actor_network (ProbabilisticTensorDictSequential): the policy.

    Keyword Args:
        max_length (int): ``L_max``, the maximum number of generated tokens. Required.
        clip_epsilon: defaults to ``0.2``.
        aggregation: defaults to ``"seq_mean_token_sum_norm"``.
        entropy_coeff: defaults to ``0.0``.
        **kwargs: any other :class:`GRPOLoss` keyword.

    Examples:
        >>> import torch
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor
        >>> net = TensorDictModule(torch.nn.Linear(3, 5), ["hidden"], ["logits"])
        >>> policy = ProbabilisticActor(net, in_keys=["logits"], out_keys=["tokens"],
        ...     distribution_class=torch.distributions.Categorical)
        >>> loss = DrGRPOLoss(policy, max_length=1024)
    """

    def __init__(
        self,
        actor_network=None,
        *,
        max_length: int,
        clip_epsilon=0.2,
        aggregation="seq_mean_token_sum_norm",
        entropy_coeff=0.0,
        **kwargs,
    ):
        super().__init__(
            actor_network,
            clip_epsilon=clip_epsilon,
            aggregation=aggregation,
            max_length=max_length,
            entropy_coeff=entropy_coeff,
            **kwargs,
        )


class GSPOLoss(GRPOLoss):
    """GRPOLoss with GSPO's defaults: a sequence-level ratio and a very narrow clip band.

    GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization", arXiv:2507.18071) clips the
    length-normalised sequence ratio ``s_i`` instead of each token's, with the band
    ``[1 - 3e-4, 1 + 4e-4]`` (Sec. 5.1), averages over sequences and uses no KL penalty.

    .. math:: L = \\frac{1}{G} \\sum_{i=1}^{G} -\\min\\big(s_i A_i,\\
        \\operatorname{clip}(s_i, 1 - 3\\cdot 10^{-4}, 1 + 4\\cdot 10^{-4}) A_i\\big), \\quad
        s_i = \\exp\\Big(\\frac{1}{|o_i|} \\sum_t \\log r_{i,t}\\Big)

    Args:
        actor_network (ProbabilisticTensorDictSequential): the policy.

    Keyword Args:
        clip_epsilon: defaults to ``(3e-4, 4e-4)``.
        ratio_level: defaults to ``"sequence"``.
        aggregation: defaults to ``"seq_mean_token_mean"``.
        entropy_coeff: defaults to ``0.0``.
        **kwargs: any other :class:`GRPOLoss` keyword.

    Examples:
        >>> import torch
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor
        >>> net = TensorDictModule(torch.nn.Linear(3, 5), ["hidden"], ["logits"])
        >>> policy = ProbabilisticActor(net, in_keys=["logits"], out_keys=["tokens"],
        ...     distribution_class=torch.distributions.Categorical)
        >>> loss = GSPOLoss(policy)
    """

    def __init__(
        self,
        actor_network=None,
        *,
        clip_epsilon=(3e-4, 4e-4),
        ratio_level="sequence",
        aggregation="seq_mean_token_mean",
        entropy_coeff=0.0,
        **kwargs,
    ):
        super().__init__(
            actor_network,
            clip_epsilon=clip_epsilon,
            ratio_level=ratio_level,
            aggregation=aggregation,
            entropy_coeff=entropy_coeff,
            **kwargs,
        )


class CISPOLoss(GRPOLoss):
    """GRPOLoss with CISPO's objective: a clipped, stop-gradient importance weight.

    CISPO (MiniMax, 2025, "MiniMax-M1", arXiv:2506.13585) keeps every token's gradient
    and only bounds its importance weight:

    .. math:: L = -\\frac{1}{\\sum_i |o_i|} \\sum_{i,t}
        \\operatorname{sg}\\big[\\operatorname{clip}(r_{i,t}, 1-\\varepsilon_{low},
        1+\\varepsilon_{high})\\big] A_i \\log \\pi_\\theta(o_{i,t})

    MiniMax-M1 imposes no lower bound (``eps_low = 1``) and tunes only the upper one, without
    publishing its value; the default cap of the weight at ``4`` (``eps_high = 3``) follows
    ScaleRL (Khatri et al., 2025, arXiv:2510.13786), which found CISPO insensitive to it in
    ``{4, 5, 8}``. Unlike torchrl 0.14.1's ``CISPOLoss``, the weight carries no gradient, so
    tokens outside the band still learn.

    Args:
        actor_network (ProbabilisticTensorDictSequential): the policy.

    Keyword Args:
        clip_epsilon: defaults to ``(1.0, 3.0)``: the weight is clipped to ``[0, 4]``.
        objective: defaults to ``"cispo"``.
        aggregation: defaults to ``"token_mean"``.
        entropy_coeff: defaults to ``0.0``.
        **kwargs: any other :class:`GRPOLoss` keyword.

    Examples:
        >>> import torch
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor
        >>> net = TensorDictModule(torch.nn.Linear(3, 5), ["hidden"], ["logits"])
        >>> policy = ProbabilisticActor(net, in_keys=["logits"], out_keys=["tokens"],
        ...     distribution_class=torch.distributions.Categorical)
        >>> loss = CISPOLoss(policy)
        >>> loss._clip_bounds[0]  # no lower bound
        tensor(-inf)
    """

    def __init__(
        self,
        actor_network=None,
        *,
        clip_epsilon=(1.0, 3.0),
        objective="cispo",
        aggregation="token_mean",
        entropy_coeff=0.0,
        **kwargs,
    ):
        super().__init__(
            actor_network,
            clip_epsilon=clip_epsilon,
            objective=objective,
            aggregation=aggregation,
            entropy_coeff=entropy_coeff,
            **kwargs,
        )
