"""GRPOLoss: torchrl's ClipPPOLoss without a critic, over real tokens, with GRPO's variants.

The module reads the batch, lines every tensor up as ``(B, T)`` sequences with one mask of real
tokens, and calls the math of :mod:`torchrl_grpo.loss_terms`. Two kinds of policy are read:

* a torchrl probabilistic actor (``ProbabilisticActor``...), as ClipPPOLoss reads it: classic
  control (one action per step) or a token head over padded ``[B, T]`` responses;
* a torchrl LLM wrapper (``TransformersWrapper``, ``vLLMWrapper``: an ``LLMWrapperBase``), as
  :class:`torchrl.objectives.llm.GRPOLoss` reads it: ragged lazy stacks of
  ``("tokens", "full")`` with torchrl's masking strategies.

Everything that varies between the published variants is one keyword: the clip band
(``clip_epsilon``), the dual clip (``clip_ratio_c``), the surrogate (``objective``: PPO's clip,
CISPO, SAPO), the level of the importance ratio (``ratio_level``), the aggregation, the KL
estimators, the KL trust region (``kl_mask_threshold``), the correction against the inference
engine (``inference_correction``, or ``tis_cap``), off-policy sequence masking
(``off_policy_mask_threshold``), decoupled PPO (``decoupled``), high-entropy token selection
(``top_entropy_quantile``) and the masking of truncated completions
(``mask_truncated_completions``). :class:`DAPOLoss`, :class:`DrGRPOLoss`, :class:`GSPOLoss`,
:class:`CISPOLoss` and :class:`SAPOLoss` are the same class with the papers' defaults.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from tensordict import TensorClass, TensorDictBase, unravel_key
from tensordict.nn import CompositeDistribution, ProbabilisticTensorDictSequential
from tensordict.utils import NestedKey
from torchrl.modules.llm import LLMWrapperBase
from torchrl.objectives import AUTO_LOSS_MASK_KEYS, ClipPPOLoss

from torchrl_grpo import _compat
from torchrl_grpo.llm.lean_wrapper import HiddenLLMMaskedCategorical
from torchrl_grpo.loss_terms import (
    AGGREGATIONS,
    INFERENCE_CORRECTIONS,
    KL_ESTIMATORS,
    cispo_loss,
    clip_fractions,
    decoupled_behaviour_weight,
    dual_clip_loss,
    effective_sample_size,
    high_entropy_token_mask,
    kl_trust_region_mask,
    masked_mean,
    off_policy_sequence_mask,
    ppo_clip_loss,
    sapo_loss,
    sequence_log_ratio,
)
from torchrl_grpo.token_dist import token_log_prob_entropy

__all__ = [
    "CISPOLoss",
    "DAPOLoss",
    "DrGRPOLoss",
    "GRPOLoss",
    "GRPOLossOutput",
    "GSPOLoss",
    "SAPOLoss",
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


def _sapo_objective(
    log_ratio, advantage, log_prob, log_clip_low, log_clip_high, *, temperature_pos, temperature_neg
):
    # SAPO's soft gate replaces the clip: the clip band is not used (it still sets the metrics)
    return sapo_loss(log_ratio, advantage, temperature_pos, temperature_neg)


def _token_log_ratio(log_ratio, mask):
    return log_ratio


OBJECTIVES: dict[str, Objective] = {
    "clip": _clip_objective,
    "cispo": cispo_loss,
    "sapo": _sapo_objective,
}
#: SAPO's temperatures (tau_pos, tau_neg) when none are given: the paper's and TRL's.
SAPO_TEMPERATURES = (1.0, 1.05)
#: The inference band when ``inference_correction`` is set without bounds: TRL's
#: ``vllm_importance_sampling_clip_min`` / ``_clip_max`` defaults.
INFERENCE_CORRECTION_BOUNDS = (None, 3.0)
RATIO_LEVELS: dict[str, RatioLevel] = {"token": _token_log_ratio, "sequence": sequence_log_ratio}
#: torchrl's ``GRPOLoss(aggregation=...)`` names, as this loss's aggregations.
TORCHRL_AGGREGATIONS = {"prompt_mean": "seq_mean_token_mean"}
MASKING_STRATEGIES = tuple(_compat.LLM_MASKED_DIST_METHODS)
#: What each masking strategy reads, for error messages.
MASK_SOURCES = {
    "sft": "('tokens', 'prompt') (or ('masks', 'all_assistant_mask')) and the attention mask",
    "rlhf": "('masks', 'all_assistant_mask') (history input builds it)",
    "generic": "('masks', 'all_attention_mask') or the wrapper's attention mask",
}

#: ClipPPOLoss / torchrl GRPOLoss keywords that have no meaning here, and what replaces them.
_REPLACED_KEYWORDS = {
    **dict.fromkeys(
        (
            "critic_network",
            "critic_coeff",
            "loss_critic_type",
            "clip_value",
            "value_key",
            "value_target_key",
            "separate_losses",
            "log_explained_variance",
        ),
        "GRPO has no critic: the advantage comes with the batch (torchrl_grpo.MCAdvantage)",
    ),
    **dict.fromkeys(
        ("gamma", "lmbda"),
        "GRPO has no value estimator: returns and advantages are written by "
        "torchrl_grpo.MCAdvantage (trajectory_return=...)",
    ),
    "normalize_advantage": "advantages are normalised per group by torchrl_grpo.MCAdvantage "
    "(scale_rewards=...)",
    "advantage_key": "use loss.set_keys(advantage=...)",
    "entropy_coef": "use entropy_coeff",
}


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
    inference_masked_fraction: torch.Tensor | None = None
    off_policy_masked_fraction: torch.Tensor | None = None
    behaviour_masked_fraction: torch.Tensor | None = None
    truncated_fraction: torch.Tensor | None = None

    def __getitem__(self, index):
        # out["loss_objective"], as a ClipPPOLoss TensorDict output is read
        if isinstance(index, str) or (
            isinstance(index, tuple) and index and all(isinstance(i, str) for i in index)
        ):
            value = self.get(index, None)
            if value is None:
                raise KeyError(f"{index!r} is not set in this {type(self).__name__}.")
            return value
        return super().__getitem__(index)

    def total_loss(self) -> torch.Tensor:
        """The sum of the ``loss_*`` terms: what torchrl's trainers minimise."""
        return sum(value for key, value in self.items() if key.startswith("loss_"))

    def mean(self, *args, reduce: bool | None = None, **kwargs):
        # torchrl's GRPO recipe backpropagates ``loss.mean(reduce=True)``; on a TensorDict that
        # is the mean of every field, metrics included, which divides the gradient by the number
        # of fields. Here it is the total loss, whatever metrics are reported.
        if reduce and not args and not kwargs:
            return self.total_loss()
        return super().mean(*args, reduce=reduce, **kwargs)


GRPOLossOutput.__doc__ = """What :class:`GRPOLoss` returns: the terms to sum (``loss_*``) and the metrics to log.

    Every ``loss_*`` field is a differentiable scalar (or, with ``reduction="none"``, a per-token
    tensor of the policy's log-prob shape holding zeros on padding); the others are detached
    scalars computed over real tokens only. Optional terms are ``None`` when not configured.

    It is read like ClipPPOLoss's TensorDict output and like torchrl's ``GRPOLossOutput``:
    ``out.loss_objective``, ``out["loss_objective"]``, ``out.items()`` (torchrl's ``Trainer``,
    ``GRPOTrainer`` and PPO trainer sum the ``loss*`` entries). :meth:`total_loss` is that sum.
    ``out.mean(reduce=True)``, which torchrl's GRPO recipe backpropagates, is :meth:`total_loss`
    too: the mean over fields would divide the gradient by the number of fields, metrics
    included, so adding a metric would rescale training.

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
        inference_masked_fraction: share of real tokens the correction against the inference
            engine leaves out (weight 0: outside the band in the ``*_mask`` modes; 0 in the
            truncating ones). With ``inference_correction`` or ``tis_cap``.
        off_policy_masked_fraction: share of real tokens dropped by off-policy sequence masking
            (with ``off_policy_mask_threshold``).
        behaviour_masked_fraction: share of real tokens whose decoupled-PPO behaviour weight
            exceeds ``behaviour_weight_cap`` (with ``decoupled=True``; 0 without a cap).
        truncated_fraction: share of the sequences flagged truncated, which leave the loss
            (with ``mask_truncated_completions``).

    Examples:
        >>> import torch
        >>> out = GRPOLossOutput(
        ...     loss_objective=torch.tensor(0.5), clip_fraction=torch.tensor(0.0),
        ...     clip_fraction_low=torch.tensor(0.0), clip_fraction_high=torch.tensor(0.0),
        ...     kl_approx=torch.tensor(0.0), ESS=torch.tensor(1.0),
        ...     loss_entropy=torch.tensor(-0.25), entropy=torch.tensor(2.5), batch_size=[])
        >>> out["loss_objective"], out.kl_to_ref
        (tensor(0.5000), None)
        >>> out.total_loss()  # loss_objective + loss_entropy
        tensor(0.2500)
        >>> out.mean(reduce=True)  # the same, not the mean of the seven fields
        tensor(0.2500)
    """


class _Inputs(NamedTuple):
    """One batch read and lined up: every tensor ``(B, T)``, finite zeros where ``mask`` is False."""

    log_prob: torch.Tensor  # current policy, differentiable
    old_log_prob: torch.Tensor  # sample_log_prob: the ratio's anchor, or the behaviour policy
    advantage: torch.Tensor
    mask: torch.Tensor  # bool, True on real tokens
    entropy: torch.Tensor | None  # differentiable; with entropy_bonus or top_entropy_quantile
    ref_log_prob: torch.Tensor | None  # with kl_to_ref_coeff
    inference_log_prob: torch.Tensor | None  # inference correction, KL to inference, OPSM
    proximal_log_prob: torch.Tensor | None  # with decoupled: the ratio's anchor
    truncated: torch.Tensor | None  # bool, True on the tokens of truncated completions
    shape: torch.Size  # the policy log-prob's own shape (reduction="none" returns it)


class _Stored(NamedTuple):
    """The entries of the batch that are data, as stored (read before the policy runs)."""

    advantage: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor | None
    inference: torch.Tensor | None
    proximal: torch.Tensor | None


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

    **Inputs: a torchrl actor.** The policy is any torchrl probabilistic actor
    (:class:`~torchrl.modules.ProbabilisticActor`, a
    :class:`~tensordict.nn.ProbabilisticTensorDictSequential`...). Its log-prob of the stored
    action, read from the batch as :class:`~torchrl.objectives.ClipPPOLoss` does, sets the shape
    every other entry is checked against:

    * classic control: batch ``[N]``, log-prob ``[N]``, advantage ``[N]`` or ``[N, 1]``; each
      step is a sequence of one token.
    * tokens: log-prob ``[B, T]`` (``B`` padded responses of ``T`` tokens); advantage per token
      (``[B, T]`` or ``[B, T, 1]``) or per sequence (``[B]``, ``[B, 1]`` or ``[B, 1, 1]``,
      broadcast over the tokens); an optional boolean mask ``[B, T]`` that is ``True`` on real
      tokens. Leading batch dimensions beyond two are flattened into ``B``; the last one is ``T``.

    Keys (``set_keys``): ``advantage``, ``action``, ``sample_log_prob`` (the log-probs of the
    policy the ratio is taken against, as in ClipPPOLoss; resolved from the actor), ``mask``
    (``"mask"``; absent means every entry is real), ``ref_log_prob`` (``"ref_log_prob"``, read
    only with ``kl_to_ref_coeff``; ``ref_log_probs``, torchrl's name, is accepted by
    ``set_keys``), ``inference_log_prob`` (``"inference_log_prob"``: the sampler's
    log-probs, read by ``inference_correction`` / ``tis_cap``, by the KL to inference and by
    ``off_policy_mask_threshold``; when absent the last two take ``sample_log_prob`` instead,
    torchrl's behaviour), ``proximal_log_prob`` (``"proximal_log_prob"``, read only with
    ``decoupled=True``) and ``truncated`` (``"truncated"``: a per-sequence boolean, read only
    with ``mask_truncated_completions``). torchrl's ``loss_mask_key`` entries
    (``("collector", "mask")``...) are honoured too, and-ed with ``mask``.

    **Inputs: a torchrl LLM wrapper.** With an
    :class:`~torchrl.modules.llm.LLMWrapperBase` (``TransformersWrapper(generate=False)``,
    ``vLLMWrapper``...) the batch is torchrl's LLM layout, as for
    :class:`torchrl.objectives.llm.GRPOLoss`: the keys default to ``action=("tokens", "full")``,
    ``sample_log_prob=("log_probs", "full")`` and ``ref_log_prob=("next", "ref_log_probs",
    "full")``; ragged lazy stacks are read through tensordict's padded getters (left padding,
    torchrl's convention). The wrapper scores ``("tokens", "full")``, and ``masking_strategy``
    picks the real tokens from its masks: ``"sft"`` the response (attention mask without the
    ``("tokens", "prompt")`` tokens), ``"rlhf"`` the assistant tokens (``("masks",
    "all_assistant_mask")``), ``"generic"`` every attended token. A token whose stored
    ``sample_log_prob`` is not finite (torchrl's NaN placeholders, e.g. the prompt slice of a
    ``vLLMWrapper``'s ``LogProbs.full``) is not real either. Log-probs and entropy are computed
    from the wrapper's logits by :func:`~torchrl_grpo.token_log_prob_entropy`, which keeps no
    ``[B, T, V]`` temporary for the backward pass. Every variant and metric works the same on
    both kinds of policy. See ``docs/migration.rst`` for the numbers that equal torchrl's and
    the ones that differ by design.

    **Padding** never enters the loss, the metrics or the gradient: padded entries of every input
    are replaced by zeros with ``torch.where`` before any arithmetic (so ``nan`` pads are fine),
    and every mean divides by the number of real tokens or non-empty sequences.

    **Leaving a token out, two ways.** Tokens *excluded* from the loss are not counted by the
    aggregation: those outside the KL trust region (``kl_mask_threshold``, as torchrl) and
    those of truncated completions (``mask_truncated_completions``, as TRL and DAPO, where they
    leave the batch). Tokens *zeroed* keep their place in the aggregation's denominator, as the
    papers write them (a factor ``M_{i,t}`` or ``w_t`` inside the sum): off-policy sequence
    masking, the masking modes of ``inference_correction``, the behaviour-weight cap of
    decoupled PPO and high-entropy token selection. Metrics (ESS, clip fractions, KL means,
    entropy) describe every real token either way. Only ``loss_objective`` is zeroed or
    weighted; ``loss_entropy`` and the KL terms cover every token left in the loss.

    **Degenerate cases.** A batch with no real token raises ``ValueError`` (there is nothing to
    average, and a silent zero loss would hide a broken pipeline). A sequence with no real token
    inside a batch is ignored: it is not counted by the per-sequence aggregations. A
    sequence-level ratio of an empty sequence is 1.

    Args:
        actor_network (ProbabilisticTensorDictSequential or LLMWrapperBase): the policy.

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
            (:func:`~torchrl_grpo.loss_terms.cispo_loss`), ``"sapo"`` (SAPO's soft gate,
            :func:`~torchrl_grpo.loss_terms.sapo_loss`), or a callable
            ``(log_ratio, advantage, log_prob, log_clip_low, log_clip_high) -> per-token loss``.
            Defaults to ``"clip"``.
        sapo_temperature_pos (float, optional): SAPO's ``tau_pos`` (tokens with ``A > 0``),
            only with ``objective="sapo"``. Defaults to ``1.0`` there (TRL's and the paper's).
        sapo_temperature_neg (float, optional): SAPO's ``tau_neg`` (``A <= 0``). Defaults to
            ``1.05`` with ``objective="sapo"``.
        ratio_level (str or callable): ``"token"`` or ``"sequence"`` (GSPO's length-normalised
            sequence ratio, :func:`~torchrl_grpo.loss_terms.sequence_log_ratio`), or a callable
            ``(log_ratio, mask) -> log_ratio``. Defaults to ``"token"``.
        aggregation (str or callable): how per-token losses become a scalar: a key of
            :data:`~torchrl_grpo.loss_terms.AGGREGATIONS` (``"token_mean"``,
            ``"seq_mean_token_mean"``, ``"seq_mean_token_sum"``, ``"seq_mean_token_sum_norm"``)
            or a callable ``(loss, mask) -> scalar``. Applies to every ``loss_*`` term.
            torchrl's names are accepted: ``"prompt_mean"`` is ``"seq_mean_token_mean"``
            (empty sequences are left out of the mean, where torchrl counts them as zero) and
            ``"none"`` is ``reduction="none"``. Defaults to ``"token_mean"``.
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
        inference_correction (str or callable, optional): correct the trainer/inference
            mismatch with the importance weight ``rho = pi_old / pi_inference`` (TRL's
            ``vllm_importance_sampling_mode``), a key of
            :data:`~torchrl_grpo.loss_terms.INFERENCE_CORRECTIONS`: ``"token_truncate"``
            (TIS), ``"sequence_truncate"``, ``"token_mask"`` (IcePop with the band
            ``(0.5, 5.0)``), ``"sequence_mask"`` (TRL's default mode); or a callable
            ``(log_weight, mask, low, high) -> (weight, keep)``. The per-token objective is
            multiplied by the weight (0 where masked). Reads ``inference_log_prob``. The share
            of tokens masked is ``inference_masked_fraction``. Defaults to ``None`` (off).
        inference_correction_bounds (tuple, optional): ``(low, high)``, either ``None`` for no
            bound; the band outside which ``rho`` is truncated or masked. Defaults to
            ``(None, 3.0)`` (TRL's ``vllm_importance_sampling_clip_min`` / ``_clip_max``).
            Schedulable buffers ``inference_correction_low`` / ``inference_correction_high``.
        tis_cap (float, optional): truncated importance sampling: multiply each token's loss by
            ``min(pi_old / pi_inference, tis_cap)``, without gradient
            (:func:`~torchrl_grpo.loss_terms.truncated_is_weight`; Yao et al., 2025, use 2):
            the same as ``inference_correction="token_truncate"`` with bounds
            ``(None, tis_cap)``, kept as a shorthand. Reads ``inference_log_prob``. Schedulable
            buffer.
        off_policy_mask_threshold (float, optional): DeepSeek-V3.2's off-policy sequence
            masking: a sequence with a negative advantage whose mean
            ``log pi_inference - log pi_theta`` over its real tokens exceeds this ``delta`` is
            zeroed in ``loss_objective``
            (:func:`~torchrl_grpo.loss_terms.off_policy_sequence_mask`; TRL's
            ``off_policy_mask_threshold``, slime's ``--opsm-delta``). Reads
            ``inference_log_prob`` (or ``sample_log_prob`` when absent). Schedulable buffer.
        decoupled (bool): decoupled PPO (AReaL): the ratio and its clip are taken against
            ``proximal_log_prob`` (the policy before this update), and each token's objective
            is weighted by ``pi_prox / pi_behav``, ``sample_log_prob`` being the behaviour
            policy that sampled it (:func:`~torchrl_grpo.loss_terms.decoupled_behaviour_weight`).
            Defaults to ``False``.
        behaviour_weight_cap (float, optional): with ``decoupled``, tokens whose behaviour
            weight exceeds it are zeroed (AReaL's ``behav_imp_weight_cap``, ``> 1``).
            Schedulable buffer.
        top_entropy_quantile (float, optional): ``rho``: ``loss_objective`` only on the real
            tokens whose entropy is in the top ``rho`` quantile of the batch
            (:func:`~torchrl_grpo.loss_terms.high_entropy_token_mask`; TRL's
            ``top_entropy_quantile``, ``0.2`` in Wang et al., 2025). The entropy is computed
            even with ``entropy_bonus=False``. ``1.0`` keeps every token. Schedulable buffer.
        mask_truncated_completions (bool): sequences flagged truncated leave the loss (TRL's
            ``mask_truncated_completions``, DAPO's overlong filtering). The flag is the
            ``truncated`` entry (per sequence, e.g. ``[B]``, ``[B, 1]``, or per token); with
            an LLM wrapper and no such entry, a completion is truncated when its last token is
            neither the tokenizer's EOS nor its pad token (TRL's rule). Defaults to ``False``.
        kl_mask_threshold (float, optional): torchrl's KL-Mask: tokens whose
            ``0.5 * (log pi_theta - log pi_old)**2`` exceeds it are left out of the ``loss_*``
            terms (:func:`~torchrl_grpo.loss_terms.kl_trust_region_mask`); the metrics still
            describe every real token. If no token is left, the loss terms are zero (the batch
            sends no gradient). Schedulable buffer.
        masking_strategy (str, optional): for LLM wrappers only: ``"sft"`` (default, as
            torchrl), ``"rlhf"`` or ``"generic"`` (see above). Rejected for other actors,
            whose real tokens come from the ``mask`` key.
        ref_log_prob_padding_side (str): side on which ragged reference log-probs are padded,
            as torchrl. Defaults to ``"left"``.
        ref_log_prob_padding_value (float): their padding value. Defaults to ``0.0``.
        reduction (str, optional): ``"mean"`` (apply ``aggregation``) or ``"none"`` (per-token
            ``loss_*`` terms, zeros on padding). ``"sum"`` is not supported: choose an
            aggregation. Defaults to ``"mean"``.
        functional (bool, optional): as in ClipPPOLoss. Defaults to ``True`` for torchrl
            actors and ``False`` for LLM wrappers (as torchrl's LLM losses).
        device (torch.device, optional): device of the buffers.

    Raises:
        ValueError: for an unknown variant name, an invalid coefficient, ``reduction="sum"``,
            a ``max_length`` that does not match the aggregation, a ``masking_strategy``
            for an actor that is not an LLM wrapper, or a variant's setting given without the
            variant (SAPO temperatures without SAPO, a behaviour cap without ``decoupled``,
            bounds without ``inference_correction``, ``tis_cap`` with ``inference_correction``).
        TypeError: for a ClipPPOLoss or torchrl ``GRPOLoss`` argument that has no meaning
            without a critic (``critic_network``, ``clip_value``, ``gamma``...); the message
            names what replaces it.

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
                ``inference_correction`` / ``tis_cap``, the KL to inference and off-policy
                sequence masking. Defaults to ``"inference_log_prob"``.
            proximal_log_prob (NestedKey): log-probs of the proximal policy of decoupled PPO,
                read only with ``decoupled=True``. Defaults to ``"proximal_log_prob"``.
            truncated (NestedKey): per-sequence boolean, ``True`` for a truncated completion,
                read only with ``mask_truncated_completions``. Defaults to ``"truncated"``.
        """

        mask: NestedKey = "mask"
        ref_log_prob: NestedKey = "ref_log_prob"
        inference_log_prob: NestedKey = "inference_log_prob"
        proximal_log_prob: NestedKey = "proximal_log_prob"
        truncated: NestedKey = "truncated"

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys
    _schedulable_buffers = frozenset(
        {
            "clip_ratio_c",
            "kl_to_ref_coeff",
            "kl_to_inference_coeff",
            "kl_mask_threshold",
            "tis_cap",
            "inference_correction_low",
            "inference_correction_high",
            "off_policy_mask_threshold",
            "behaviour_weight_cap",
            "top_entropy_quantile",
        }
    )

    def __init__(
        self,
        actor_network: ProbabilisticTensorDictSequential | LLMWrapperBase | None = None,
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
        kl_mask_threshold: float | None = None,
        tis_cap: float | None = None,
        sapo_temperature_pos: float | None = None,
        sapo_temperature_neg: float | None = None,
        inference_correction: str | Callable | None = None,
        inference_correction_bounds: tuple[float | None, float | None] | None = None,
        off_policy_mask_threshold: float | None = None,
        decoupled: bool = False,
        behaviour_weight_cap: float | None = None,
        top_entropy_quantile: float | None = None,
        mask_truncated_completions: bool = False,
        masking_strategy: str | None = None,
        ref_log_prob_padding_side: str = "left",
        ref_log_prob_padding_value: float = 0.0,
        reduction: str | None = None,
        functional: bool | None = None,
        device: torch.device | None = None,
        **replaced,
    ):
        for name in replaced:
            if name in _REPLACED_KEYWORDS:
                raise TypeError(f"GRPOLoss takes no {name!r}: {_REPLACED_KEYWORDS[name]}.")
        if replaced:
            raise TypeError(f"GRPOLoss got unexpected keyword arguments {sorted(replaced)}.")
        is_llm = isinstance(actor_network, LLMWrapperBase)
        if masking_strategy is not None and not is_llm:
            raise ValueError(
                f"masking_strategy={masking_strategy!r} applies to torchrl LLM wrappers "
                f"(LLMWrapperBase); this actor is a {type(actor_network).__name__}: mark real "
                "tokens with the 'mask' key instead."
            )
        if masking_strategy is None:
            masking_strategy = "sft"  # torchrl's default
        if masking_strategy not in MASKING_STRATEGIES:
            raise ValueError(
                f"masking_strategy must be one of {list(MASKING_STRATEGIES)}, "
                f"got {masking_strategy!r}."
            )
        if ref_log_prob_padding_side not in ("left", "right"):
            raise ValueError(
                f"ref_log_prob_padding_side must be 'left' or 'right', got "
                f"{ref_log_prob_padding_side!r}."
            )
        if aggregation == "none":  # torchrl's per-token output
            aggregation, reduction = "token_mean", reduction or "none"
        aggregation = TORCHRL_AGGREGATIONS.get(aggregation, aggregation)
        if reduction not in (None, "mean", "none"):
            raise ValueError(
                f"GRPOLoss supports reduction='mean' (apply `aggregation`) or 'none', got "
                f"{reduction!r}; for a sum over tokens use aggregation='seq_mean_token_sum' "
                "or a callable."
            )
        if isinstance(entropy_coeff, dict):
            raise TypeError("GRPOLoss takes a scalar entropy_coeff (single-head policies only).")
        objective_fn = self._make_objective(objective, sapo_temperature_pos, sapo_temperature_neg)
        if clip_ratio_c is not None:
            is_sapo = getattr(objective_fn, "func", None) is _sapo_objective
            if objective_fn is cispo_loss or is_sapo:
                raise ValueError(
                    "clip_ratio_c (dual clip) applies to the PPO surrogate, not "
                    f"{'SAPO' if is_sapo else 'CISPO'}."
                )
            if clip_ratio_c <= 1.0:
                raise ValueError(f"clip_ratio_c must be greater than 1, got {clip_ratio_c}.")
        for name, value in (
            ("tis_cap", tis_cap),
            ("kl_mask_threshold", kl_mask_threshold),
            ("off_policy_mask_threshold", off_policy_mask_threshold),
        ):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}.")
        inference_fn, inference_bounds = self._make_inference_correction(
            inference_correction, inference_correction_bounds, tis_cap
        )
        if behaviour_weight_cap is not None:
            if not decoupled:
                raise ValueError("behaviour_weight_cap applies to decoupled=True only.")
            if behaviour_weight_cap <= 1.0:
                raise ValueError(
                    f"behaviour_weight_cap must be greater than 1, got {behaviour_weight_cap}."
                )
        if top_entropy_quantile is not None and not 0.0 <= top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}.")
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
            # an LLM wrapper runs as it is (torchrl's LLM losses are not functional)
            functional=not is_llm if functional is None else functional,
            device=device,
        )
        if no_lower_bound:
            self.clip_epsilon_low.fill_(1.0)
        device = self.entropy_coeff.device
        self.is_llm = is_llm
        self.masking_strategy = masking_strategy
        self.ref_log_prob_padding_side = ref_log_prob_padding_side
        self.ref_log_prob_padding_value = float(ref_log_prob_padding_value)
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
        self.register_coeff_buffer("kl_mask_threshold", kl_mask_threshold, device=device)
        self.register_coeff_buffer("tis_cap", tis_cap, device=device)
        self._inference_correction = inference_fn
        self.register_coeff_buffer("inference_correction_low", inference_bounds[0], device=device)
        self.register_coeff_buffer("inference_correction_high", inference_bounds[1], device=device)
        self.register_coeff_buffer(
            "off_policy_mask_threshold", off_policy_mask_threshold, device=device
        )
        self.decoupled = bool(decoupled)
        self.register_coeff_buffer("behaviour_weight_cap", behaviour_weight_cap, device=device)
        self.register_coeff_buffer("top_entropy_quantile", top_entropy_quantile, device=device)
        self.mask_truncated_completions = bool(mask_truncated_completions)
        if is_llm:  # torchrl's LLM layout (torchrl.objectives.llm.GRPOLoss's keys)
            self.set_keys(**LLM_KEYS)
        self._in_keys = None
        self._out_keys = None

    @staticmethod
    def _make_objective(objective, temperature_pos, temperature_neg):
        fn = _lookup(OBJECTIVES, objective, "objective")
        if fn is not _sapo_objective:
            if temperature_pos is not None or temperature_neg is not None:
                raise ValueError(
                    f"sapo_temperature_pos / sapo_temperature_neg apply to objective='sapo', "
                    f"not {objective!r}."
                )
            return fn
        taus = [
            default if tau is None else tau
            for tau, default in zip((temperature_pos, temperature_neg), SAPO_TEMPERATURES)
        ]
        if min(taus) <= 0:
            raise ValueError(f"SAPO temperatures must be positive, got {tuple(taus)}.")
        return functools.partial(fn, temperature_pos=taus[0], temperature_neg=taus[1])

    @staticmethod
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
        if (low is not None and low < 0) or (high is not None and high <= 0):
            raise ValueError(
                f"inference_correction_bounds must be a low >= 0 and a high > 0, got {bounds}."
            )
        if low is not None and high is not None and low >= high:
            raise ValueError(f"inference_correction_bounds must have low < high, got {bounds}.")
        return fn, (low, high)

    @property
    def inference_correction(self) -> Callable | None:
        """The correction against the inference engine (``tis_cap``: token truncation)."""
        if self.tis_cap is not None:
            return INFERENCE_CORRECTIONS["token_truncate"]
        return self._inference_correction

    @property
    def inference_correction_bounds(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(low, high)`` of the inference band, read from the schedulable buffers."""
        if self.tis_cap is not None:
            return None, self.tis_cap
        return self.inference_correction_low, self.inference_correction_high

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

    @property
    def clip_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log(1 - eps_low), log(1 + eps_high))``, read from the schedulable buffers."""
        buffers = dict(self.named_buffers(recurse=False))
        low = buffers.get("clip_epsilon_low", buffers.get("clip_epsilon"))
        high = buffers.get("clip_epsilon_high", buffers.get("clip_epsilon"))
        return (-low).log1p(), high.log1p()

    # --- keys -----------------------------------------------------------------------------

    def set_keys(self, **kwargs) -> GRPOLoss:
        """Change tensordict keys, as ClipPPOLoss's ``set_keys``.

        ``ref_log_probs`` (torchrl's ``GRPOLoss`` name) is accepted for ``ref_log_prob``.
        """
        if "ref_log_probs" in kwargs:
            kwargs["ref_log_prob"] = kwargs.pop("ref_log_probs")
        return super().set_keys(**kwargs)

    def _set_in_keys(self):
        tk = self.tensor_keys
        keys = [*self.actor_network.in_keys, tk.action, tk.sample_log_prob, tk.advantage, tk.mask]
        if getattr(self, "kl_to_ref_coeff", None) is not None:
            keys.append(tk.ref_log_prob)
        if getattr(self, "tis_cap", None) is not None or getattr(self, "_inference_correction", None) is not None:  # fmt: skip
            keys.append(tk.inference_log_prob)
        if getattr(self, "decoupled", False):
            keys.append(tk.proximal_log_prob)
        if getattr(self, "mask_truncated_completions", False):
            keys.append(tk.truncated)
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
            if self.inference_correction is not None:
                keys.append("inference_masked_fraction")
            if self.off_policy_mask_threshold is not None:
                keys.append("off_policy_masked_fraction")
            if self.decoupled:
                keys.append("behaviour_masked_fraction")
            if self.mask_truncated_completions:
                keys.append("truncated_fraction")
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

    # --- read: the batch as (B, T) sequences and one mask of real tokens ----------------------

    def forward(self, tensordict: TensorDictBase) -> GRPOLossOutput:
        """Compute the loss terms and metrics of a batch.

        Args:
            tensordict (TensorDictBase): the batch; see the class docstring for the entries.

        Returns:
            GRPOLossOutput: the ``loss_*`` terms to sum and the metrics.

        Raises:
            KeyError: a required entry is missing (the key is named).
            RuntimeError: a stored log-prob or advantage requires grad.
            ValueError: an entry's shape does not match the policy's log-prob, a reference or
                inference log-prob is not finite on a real token, or the batch has no real
                token.
            NotImplementedError: for multi-head (composite) action distributions.
        """
        tensordict = tensordict.copy()  # the policy writes into it; leave the input as is
        inputs = self._read_llm(tensordict) if self.is_llm else self._read_actor(tensordict)
        out = self._terms(inputs)
        if torch.compiler.is_compiling():
            tensordict.clear_refs_for_compile_()
        return GRPOLossOutput(**out, batch_size=[])

    def _policy_params(self):
        """The context in which the policy runs with the loss's parameters."""
        if self.functional:
            return self.actor_network_params.to_module(
                self.actor_network, preserve_module_state=False
            )
        return contextlib.nullcontext()

    def _read_actor(self, tensordict: TensorDictBase) -> _Inputs:
        """A torchrl probabilistic actor: its distribution's log-prob of the stored action."""
        tk = self.tensor_keys
        if not isinstance(tk.sample_log_prob, NestedKey) or not isinstance(tk.action, NestedKey):
            raise NotImplementedError(f"{type(self).__name__} supports single-head policies only.")
        stored = self._stored(tensordict)
        with self._policy_params():
            dist = self.actor_network.get_dist(tensordict)
        if isinstance(dist, CompositeDistribution):
            raise NotImplementedError(f"{type(self).__name__} supports single-head policies only.")
        log_prob = dist.log_prob(self._get_input(tensordict, tk.action, "the sampled action"))
        if not log_prob.shape:
            raise ValueError("The policy's log-prob is a scalar; expected a batch [N] or [B, T].")
        entropy = self._entropy(dist) if self._needs_entropy else None
        mask = self._token_mask(tensordict, log_prob.shape, log_prob.device)
        truncated = self._truncated(tensordict, log_prob.shape)
        return self._line_up(log_prob, mask, entropy, stored, truncated)

    def _read_llm(self, tensordict: TensorDictBase) -> _Inputs:
        """A torchrl LLM wrapper: masked token distribution over ``("tokens", "full")``.

        As :class:`torchrl.objectives.llm.GRPOLoss`: the wrapper builds the left-padded logits
        and the mask of the masking strategy; tokens whose stored log-prob is not finite
        (torchrl's NaN placeholders) are not real. Log-probs and entropy come from the logits
        through :func:`~torchrl_grpo.token_log_prob_entropy`, which keeps no ``[B, T, V]``
        temporary for the backward pass.
        """
        tk = self.tensor_keys
        stored = self._stored(tensordict)
        with self._policy_params():
            try:
                dist = _compat.llm_masked_dist(
                    self.actor_network, tensordict, self.masking_strategy
                )
            except (KeyError, ValueError, AttributeError) as err:
                needs = MASK_SOURCES[self.masking_strategy]
                raise ValueError(
                    f"masking_strategy={self.masking_strategy!r} needs {needs} in the batch; "
                    f"the wrapper failed with: {err}"
                ) from err
        mask = dist.mask.bool()  # (B, T)
        # the wrapper may compute elsewhere than the batch lives (TransformersWrapper(device=)):
        # the loss follows the policy's mask
        device = mask.device
        stored = _Stored(*(None if value is None else value.to(device) for value in stored))
        tokens = self._get_input(tensordict, tk.action, "the sampled tokens", padding=-100)
        tokens = tokens.to(device)
        if tokens.shape != mask.shape:
            raise ValueError(
                f"{tk.action!r} has shape {tuple(tokens.shape)} once padded, but the policy's "
                f"logits under masking_strategy={self.masking_strategy!r} cover "
                f"{tuple(mask.shape)}: the tokens and the wrapper's input disagree."
            )
        old_log_prob = _match_shape(stored.old, mask.shape, tk.sample_log_prob)
        mask = mask & torch.isfinite(old_log_prob)
        mask = mask & self._token_mask(tensordict, mask.shape, mask.device)
        truncated = self._truncated(tensordict, mask.shape, last_tokens=tokens[:, -1])
        truncated = None if truncated is None else truncated.to(device)
        log_prob, entropy = _token_log_prob_entropy(dist, tokens.masked_fill(~mask, -100))
        entropy = entropy if self._needs_entropy else None
        return self._line_up(log_prob, mask, entropy, stored._replace(old=old_log_prob), truncated)

    def _get_input(
        self, tensordict: TensorDictBase, key: NestedKey, why: str, padding: float = 0.0
    ) -> torch.Tensor:
        """An entry that must be data: present, without gradient; padded left if ragged."""
        if self.is_llm:
            side = "left"
            if key == self.tensor_keys.ref_log_prob:
                side, padding = self.ref_log_prob_padding_side, self.ref_log_prob_padding_value
            value = tensordict.get(
                key, None, as_padded_tensor=True, padding_side=side, padding_value=padding
            )
        else:
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

    @property
    def _needs_entropy(self) -> bool:
        return bool(self.entropy_bonus) or self.top_entropy_quantile is not None

    def _stored(self, tensordict: TensorDictBase) -> _Stored:
        """The data entries of the batch, as stored, read before the policy runs."""
        tk = self.tensor_keys
        advantage = self._get_input(tensordict, tk.advantage, "the advantage")
        old = self._get_input(tensordict, tk.sample_log_prob, "the sampling log-probs")
        ref = inference = proximal = None
        if self.kl_to_ref_coeff is not None:
            ref = self._get_input(tensordict, tk.ref_log_prob, "for kl_to_ref_coeff")
        if self.inference_correction is not None:
            why = "for tis_cap" if self.tis_cap is not None else "for inference_correction"
            inference = self._get_input(tensordict, tk.inference_log_prob, why)
        elif self.kl_to_inference_coeff is not None or self.off_policy_mask_threshold is not None:
            # torchrl's convention: without the sampler's own log-probs, the KL to inference
            # (and OPSM's drift, as TRL) is taken against sample_log_prob
            key = tk.inference_log_prob
            if not _has(tensordict, key):
                key = tk.sample_log_prob
            why = "for kl_to_inference_coeff" if self.kl_to_inference_coeff is not None else "for off_policy_mask_threshold"  # fmt: skip
            inference = self._get_input(tensordict, key, why)
        if self.decoupled:
            proximal = self._get_input(tensordict, tk.proximal_log_prob, "for decoupled=True")
        return _Stored(advantage=advantage, old=old, ref=ref, inference=inference, proximal=proximal)  # fmt: skip

    def _truncated(self, tensordict, shape: torch.Size, last_tokens=None) -> torch.Tensor | None:
        """Per-token flags of truncated completions, with ``mask_truncated_completions``.

        The ``truncated`` entry when present; for an LLM wrapper without it, TRL's rule on the
        last token of each (left-padded) sequence: neither EOS nor the pad token.
        """
        if not self.mask_truncated_completions:
            return None
        key = self.tensor_keys.truncated
        if _has(tensordict, key) or last_tokens is None:
            entry = self._get_input(tensordict, key, "for mask_truncated_completions", padding=False)  # fmt: skip
            return _per_token(entry, shape, key).bool()
        tokenizer = getattr(self.actor_network, "tokenizer", None)
        ends = [getattr(tokenizer, name, None) for name in ("eos_token_id", "pad_token_id")]
        ends = [end for end in ends if end is not None]
        if not ends:
            raise KeyError(
                f"mask_truncated_completions needs {key!r} in the batch: the wrapper has no "
                "tokenizer with an EOS or pad token to tell truncated completions apart."
            )
        finished = torch.isin(last_tokens, torch.tensor(ends, device=last_tokens.device))
        return (~finished).unsqueeze(-1).expand(shape)

    def _token_mask(self, tensordict: TensorDictBase, shape: torch.Size, device) -> torch.Tensor:
        """``mask`` and-ed with torchrl's loss-mask entries (``loss_mask_key``); all True if none."""
        loss_mask = self.loss_mask_key
        extra = () if loss_mask is None else AUTO_LOSS_MASK_KEYS if loss_mask == "auto" else (loss_mask,)  # fmt: skip
        mask = torch.ones(shape, dtype=torch.bool, device=device)
        for key in dict.fromkeys((self.tensor_keys.mask, *extra)):
            if tensordict.get(key, None) is not None:
                entry = self._get_input(tensordict, key, "a mask", padding=False)
                mask = mask & _per_token(entry, shape, key).bool().to(device)
        return mask

    def _entropy(self, dist: torch.distributions.Distribution) -> torch.Tensor:
        """Analytic entropy; a Monte-Carlo estimate where there is none (or it is not finite)."""
        try:
            entropy = dist.entropy()
            if bool(torch.isfinite(entropy).all()):
                return entropy
        except NotImplementedError:
            pass
        sample_shape = (self.samples_mc_entropy,)
        sample = dist.rsample(sample_shape) if dist.has_rsample else dist.sample(sample_shape)
        return -dist.log_prob(sample).mean(0)

    def _line_up(self, log_prob, mask, entropy, stored: _Stored, truncated) -> _Inputs:
        """Every entry as ``(B, T)``, checked against the log-prob's shape, zeros on padding."""
        tk = self.tensor_keys
        shape = log_prob.shape
        mask = _as_sequences(mask)  # (B, T)
        if not mask.any():
            raise ValueError(
                f"The batch has no real token: the mask {tk.mask!r} is all False "
                f"(shape {tuple(shape)}). There is nothing to average."
            )

        def tokens(x, key):  # (B, T), zeros on padding so nan/inf pads cannot leak
            return None if x is None else torch.where(mask, _as_sequences(_match_shape(x, shape, key)), 0.0)  # fmt: skip

        for name, key, value in (
            ("reference", tk.ref_log_prob, stored.ref),
            ("inference", tk.inference_log_prob, stored.inference),
            ("proximal", tk.proximal_log_prob, stored.proximal),
        ):
            if value is not None and not bool(torch.isfinite(tokens(value, key)).all()):
                raise ValueError(
                    f"The {name} log-probs under {key!r} are not finite on some real tokens: "
                    "every token in the loss needs a finite log-prob."
                )
        return _Inputs(
            log_prob=tokens(log_prob, "log_prob"),
            old_log_prob=tokens(stored.old, tk.sample_log_prob),
            advantage=torch.where(
                mask, _as_sequences(_per_token(stored.advantage, shape, tk.advantage)), 0.0
            ),  # fmt: skip
            mask=mask,
            entropy=tokens(entropy, "entropy"),
            ref_log_prob=tokens(stored.ref, tk.ref_log_prob),
            inference_log_prob=tokens(stored.inference, tk.inference_log_prob),
            proximal_log_prob=tokens(stored.proximal, tk.proximal_log_prob),
            truncated=None if truncated is None else _as_sequences(truncated),
            shape=shape,
        )

    # --- terms: the math of loss_terms on the lined-up batch ------------------------------------

    def _terms(self, x: _Inputs) -> dict:
        mask, lp = x.mask, x.log_prob
        # the policy the ratio and its clip are taken against: the proximal one (decoupled PPO)
        # or the one that sampled the data
        anchor = x.old_log_prob if x.proximal_log_prob is None else x.proximal_log_prob
        # tokens excluded from the loss terms (not counted by the aggregation): those outside
        # the KL trust region and those of truncated completions; the metrics describe every
        # real token
        loss_mask = mask
        if self.kl_mask_threshold is not None:
            loss_mask = mask & kl_trust_region_mask(lp - anchor, self.kl_mask_threshold)
        if x.truncated is not None:
            loss_mask = loss_mask & ~x.truncated

        def reduce(per_token):  # (B, T) -> a scalar, or the per-token tensor
            if self.reduction == "none":
                return torch.where(loss_mask, per_token, 0.0).reshape(x.shape)
            if not loss_mask.any():  # every token excluded: no gradient
                return (per_token * 0.0).sum()
            return self._aggregate(per_token, loss_mask)

        log_clip_low, log_clip_high = self.clip_bounds
        log_ratio = self._ratio_level(lp - anchor, mask)  # (B, T)
        per_token = self._objective(log_ratio, x.advantage, lp, log_clip_low, log_clip_high)
        if self.clip_ratio_c is not None:
            per_token = dual_clip_loss(per_token, x.advantage, self.clip_ratio_c)
        # tokens weighted or zeroed in the objective (they stay in the aggregation's denominator)
        weight, keep, fractions = self._objective_factors(x, loss_mask)
        if weight is not None:
            per_token = per_token * weight
        if keep is not None:
            per_token = torch.where(keep, per_token, 0.0)
        clip_fraction, clip_low, clip_high = clip_fractions(
            log_ratio, mask, log_clip_low, log_clip_high
        )
        out = {
            "loss_objective": reduce(per_token),
            "clip_fraction": clip_fraction,
            "clip_fraction_low": clip_low,
            "clip_fraction_high": clip_high,
            "kl_approx": masked_mean(anchor - lp, mask).detach(),
            "ESS": effective_sample_size(log_ratio, mask),
            **fractions,
        }
        if x.truncated is not None:
            nonempty = mask.any(-1)  # (B,)
            out["truncated_fraction"] = ((x.truncated & mask).any(-1).sum() / nonempty.sum()).to(lp.dtype)  # fmt: skip
        if self.entropy_bonus:
            out["entropy"] = masked_mean(x.entropy, mask).detach()
            out["loss_entropy"] = -self.entropy_coeff * reduce(x.entropy)
        for name, coeff, other, estimator in (
            ("kl_to_ref", self.kl_to_ref_coeff, x.ref_log_prob, self._kl_to_ref_estimator),
            (
                "kl_to_inference",
                self.kl_to_inference_coeff,
                x.inference_log_prob,
                self._kl_to_inference_estimator,
            ),
        ):
            if coeff is not None:
                kl = estimator(lp, other)  # (B, T)
                out[name] = masked_mean(kl, mask).detach()
                out["loss_" + name] = coeff * reduce(kl)
        return out

    def _objective_factors(self, x: _Inputs, loss_mask: torch.Tensor):
        """What multiplies each token's objective: ``(weight, keep, masked fractions)``.

        Each enabled variant gives a detached weight and/or the tokens it keeps (one function
        of :mod:`torchrl_grpo.loss_terms` each); ``weight`` and ``keep`` are ``None`` when no
        variant is on, so the default loss runs no extra operation.
        """
        factors = []  # (weight or None, keep, name of its masked fraction or None)
        if x.proximal_log_prob is not None:
            w, k = decoupled_behaviour_weight(
                x.proximal_log_prob, x.old_log_prob, self.behaviour_weight_cap
            )
            factors.append((w, k, "behaviour_masked_fraction"))
        if self.inference_correction is not None:
            low, high = self.inference_correction_bounds
            log_weight = x.old_log_prob - x.inference_log_prob  # (B, T)
            w, k = self.inference_correction(log_weight, x.mask, low, high)
            factors.append((w, k, "inference_masked_fraction"))
        if self.off_policy_mask_threshold is not None:
            k = off_policy_sequence_mask(
                x.log_prob, x.inference_log_prob, x.advantage, x.mask, self.off_policy_mask_threshold
            )  # fmt: skip
            factors.append((None, k, "off_policy_masked_fraction"))
        if self.top_entropy_quantile is not None:
            k = high_entropy_token_mask(x.entropy, loss_mask, self.top_entropy_quantile)
            factors.append((None, k, None))
        weight = keep = None
        fractions = {}
        for w, k, name in factors:
            if name is not None:
                fractions[name] = masked_mean((~k).to(x.log_prob.dtype), x.mask)
            if w is not None:
                weight = w if weight is None else weight * w
            keep = k if keep is None else keep & k
        return weight, keep, fractions


#: torchrl's keys for LLM-wrapper batches (those of ``torchrl.objectives.llm.GRPOLoss``).
LLM_KEYS = {
    "action": ("tokens", "full"),
    "sample_log_prob": ("log_probs", "full"),
    "ref_log_prob": ("next", "ref_log_probs", "full"),
}


def _token_log_prob_entropy(dist, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``(B, T)`` of an LLM wrapper's masked distribution, in one pass.

    From its logits through :func:`~torchrl_grpo.token_log_prob_entropy`, or, for a
    distribution that holds no logits (:class:`~torchrl_grpo.LeanTransformersWrapper`'s), its
    own ``log_prob_entropy``. Tokens below zero are padding.
    """
    if isinstance(dist, HiddenLLMMaskedCategorical):
        return dist.log_prob_entropy(tokens)
    return token_log_prob_entropy(dist.logits, tokens)


def _has(tensordict: TensorDictBase, key: NestedKey) -> bool:
    # a membership test that never stacks a ragged entry (``get`` would)
    return unravel_key(key) in tensordict.keys(include_nested=True)


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


def _per_token(adv: torch.Tensor, shape: torch.Size, key) -> torch.Tensor:
    # per token ([B, T] or [B, T, 1]) or, for token batches, per sequence: [B] followed by
    # singleton dimensions ([B], [B, 1], torchrl's LLM layout [B, 1, 1])
    if adv.shape in (shape, shape + (1,)):
        return _match_shape(adv, shape, key)
    per_sequence = shape[:-1]
    if len(shape) >= 2 and adv.shape[: len(per_sequence)] == per_sequence:
        if adv.numel() == per_sequence.numel():
            return adv.reshape(per_sequence + (1,)).expand(shape)
    expected = [shape, shape + (1,)]
    if len(shape) >= 2:
        expected += [per_sequence, per_sequence + (1,), per_sequence + (1, 1)]
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
        >>> loss.clip_bounds[0]  # no lower bound
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


class SAPOLoss(GRPOLoss):
    """GRPOLoss with SAPO's objective: a soft, temperature-controlled gate instead of the clip.

    SAPO (Gao et al., 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347) replaces the
    hard clip of the ratio by a sigmoid gate whose temperature depends on the advantage's sign
    (:func:`~torchrl_grpo.loss_terms.sapo_loss`), and keeps GRPO's sequence-level averaging:

    .. math:: L = -\\frac{1}{G} \\sum_{i=1}^{G} \\frac{1}{|o_i|} \\sum_{t=1}^{|o_i|}
        \\frac{4}{\\tau_{i,t}}\\, \\sigma\\big(\\tau_{i,t} (r_{i,t} - 1)\\big) A_{i,t}, \\qquad
        \\tau_{i,t} = \\tau_{pos} \\text{ if } A_{i,t} > 0 \\text{ else } \\tau_{neg}

    with ``tau_pos = 1.0`` and ``tau_neg = 1.05`` (the paper's and TRL's defaults). Tokens far
    off-policy get a smoothly vanishing gradient rather than none past a bound; on-policy the
    gradient is GRPO's. ``clip_epsilon`` only sets the reported clip fractions.

    Args:
        actor_network (ProbabilisticTensorDictSequential or LLMWrapperBase): the policy.

    Keyword Args:
        sapo_temperature_pos: ``tau_pos``, defaults to ``1.0``.
        sapo_temperature_neg: ``tau_neg``, defaults to ``1.05``.
        aggregation: defaults to ``"seq_mean_token_mean"``.
        entropy_coeff: defaults to ``0.0``.
        **kwargs: any other :class:`GRPOLoss` keyword.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor
        >>> net = TensorDictModule(torch.nn.Linear(3, 5), ["hidden"], ["logits"])
        >>> policy = ProbabilisticActor(net, in_keys=["logits"], out_keys=["tokens"],
        ...     distribution_class=torch.distributions.Categorical, return_log_prob=True)
        >>> batch = policy(TensorDict(hidden=torch.randn(2, 4, 3), batch_size=[2])).detach()
        >>> batch["advantage"] = torch.tensor([1.0, -1.0])
        >>> out = SAPOLoss(policy)(batch)  # on-policy: -(4 / tau) * sigmoid(0) * A per sequence
        >>> round(out.loss_objective.item(), 4)  # (-2 / 1.0 + 2 / 1.05) / 2
        -0.0476
    """

    def __init__(
        self,
        actor_network=None,
        *,
        sapo_temperature_pos=SAPO_TEMPERATURES[0],
        sapo_temperature_neg=SAPO_TEMPERATURES[1],
        objective="sapo",
        aggregation="seq_mean_token_mean",
        entropy_coeff=0.0,
        **kwargs,
    ):
        super().__init__(
            actor_network,
            objective=objective,
            sapo_temperature_pos=sapo_temperature_pos,
            sapo_temperature_neg=sapo_temperature_neg,
            aggregation=aggregation,
            entropy_coeff=entropy_coeff,
            **kwargs,
        )
