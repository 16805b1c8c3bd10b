"""Loss terms of GRPO and its published variants, as pure functions on tensors.

Everything here takes plain tensors shaped ``(B, T)`` -- ``B`` sequences of ``T`` (padded)
tokens -- and, where padding matters, a boolean ``mask`` of the same shape that is ``True`` on
real tokens. No TensorDict, no keys, no modules: :class:`torchrl_grpo.GRPOLoss` fetches the
tensors and calls these functions.

Conventions:

* ``log_ratio`` is ``log pi_theta(a) - log pi_old(a)``; every ratio is handled in log space and
  clamped there, as :class:`torchrl.objectives.ClipPPOLoss` does, so that the two agree to the
  last bit.
* Surrogates return a per-token *loss* (the negated objective), to be reduced by one of the
  aggregations below.
* The functions never read padded entries in a way that can leak: callers are expected to have
  replaced padded values by finite numbers (``GRPOLoss`` writes zeros there), and every mean
  divides by the number of real tokens or non-empty sequences only.

References:

* PPO: Schulman et al., 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347.
* GRPO: Shao et al., 2024, "DeepSeekMath", arXiv:2402.03300.
* DAPO: Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
  arXiv:2503.14476.
* Dr. GRPO: Liu et al., 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
  arXiv:2503.20783.
* GSPO: Zheng et al., 2025, "Group Sequence Policy Optimization", arXiv:2507.18071.
* CISPO: MiniMax, 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
  Attention", arXiv:2506.13585.
* Dual clip: Ye et al., 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
  Learning", arXiv:1912.09729.
* KL estimators: Schulman, 2020, "Approximating KL Divergence",
  http://joschu.net/blog/kl-approx.html.
* Truncated importance sampling: Yao et al., 2025, "Your Efficient RL Framework Secretly Brings
  You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl.
* SAPO: Gao et al., 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347.
* IcePop: Ling Team, 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
  Thinking Model" (Ring-1T), arXiv:2510.18855.
* Off-policy sequence masking: DeepSeek-AI, 2025, "DeepSeek-V3.2", arXiv:2512.02556, Eq. 9.
* Decoupled PPO: Fu et al., 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning
  System for Language Reasoning", arXiv:2505.24298; Hilton et al., 2022, "Batch size-invariance
  for policy optimization", arXiv:2110.00641.
* High-entropy tokens: Wang et al., 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens
  Drive Effective Reinforcement Learning for LLM Reasoning", arXiv:2506.01939.
* DPPO: "Rethinking the Trust Region in LLM RL", 2026, arXiv:2602.04879 (verl's ``dppo_tv`` /
  ``dppo_kl``).
* Two-sided clip: Prime Intellect, 2025, "INTELLECT-2: A Reasoning Model Trained Through
  Globally Decentralized Reinforcement Learning", arXiv:2505.07291 (TRL's ``delta``).
* VESPO: 2026, arXiv:2602.10693 (TRL's ``loss_type="vespo"``).
* Adaptive entropy: He et al., 2025, "Skywork Open Reasoner 1 Technical Report",
  arXiv:2505.22312 (TRL's ``use_adaptive_entropy``).
* Mismatch diagnostics and the sequence veto: verl's ``rollout_corr_helper`` (0.9.0).

Shapes are checked at the top of the functions that combine per-token and per-sequence tensors
(rlax's habit): a ``(B,)`` advantage against a ``(B, T)`` ratio raises a ``ValueError`` instead
of broadcasting into a ``(B, B)`` loss.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

__all__ = [
    "AGGREGATIONS",
    "AGGREGATION_SUMS",
    "INFERENCE_CORRECTIONS",
    "KL_ESTIMATORS",
    "MAX_LOG_RATIO",
    "OBJECTIVES",
    "RATIO_LEVELS",
    "TRUST_REGIONS",
    "adaptive_entropy_coeff",
    "aggregate_token_sum",
    "aggregate_seq_mean_token_mean",
    "aggregate_seq_mean_token_sum",
    "aggregate_seq_mean_token_sum_norm",
    "aggregate_token_mean",
    "aggregation_sum",
    "register_aggregation",
    "cispo_loss",
    "clip_fractions",
    "decoupled_behaviour_weight",
    "dppo_kl_mask",
    "dppo_tv_mask",
    "dual_clip_loss",
    "effective_sample_size",
    "high_entropy_token_mask",
    "importance_weighted_kl",
    "inference_mismatch",
    "k3_kl_token_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_trust_region_mask",
    "mask_importance_weight",
    "masked_mean",
    "masked_quantile",
    "off_policy_sequence_mask",
    "ppo_clip_loss",
    "sapo_loss",
    "sequence_log_ratio",
    "sequence_sum_log_ratio",
    "sequence_veto_mask",
    "truncate_importance_weight",
    "truncated_is_weight",
    "two_sided_clip_loss",
    "vespo_loss",
]


def _check_same_rank(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    # rlax's habit: a per-sequence (B,) tensor against per-token (B, T) ones would broadcast into
    # (B, B) silently; require the same rank and broadcastable shapes instead
    if x.ndim != ref.ndim:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} and {ref_name} has shape {tuple(ref.shape)}: "
            f"they must have the same number of dimensions (a per-sequence value is (B, 1) "
            f"against (B, T) tokens)."
        )
    try:
        torch.broadcast_shapes(x.shape, ref.shape)
    except RuntimeError:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}, which does not broadcast to {ref_name}'s "
            f"{tuple(ref.shape)}."
        ) from None


def _check_same_shape(**tensors: torch.Tensor) -> None:
    # every named tensor must have exactly the shape of the first one
    (first, ref), *others = tensors.items()
    for name, x in others:
        if x.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but {first} has shape {tuple(ref.shape)}: "
                "they must be equal."
            )


# ---------------------------------------------------------------------------------------------
# Masked reductions and aggregations
# ---------------------------------------------------------------------------------------------


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is ``True``.

    .. math:: \\bar{x} = \\frac{\\sum_{b,t} m_{b,t}\\, x_{b,t}}{\\sum_{b,t} m_{b,t}}

    Masked-out entries are selected away (``torch.where``), never multiplied by zero, so a ``nan``
    or ``inf`` sitting in padding cannot leak into the result or its gradient.

    Args:
        x (torch.Tensor): values, any shape.
        mask (torch.Tensor): boolean, same shape as ``x``; ``True`` on real entries.

    Returns:
        torch.Tensor: a scalar. ``nan`` if ``mask`` has no ``True`` entry (the mean of nothing);
        :class:`~torchrl_grpo.GRPOLoss` rejects such a batch before it gets here.

    Examples:
        >>> import torch
        >>> x = torch.tensor([[1.0, 2.0], [3.0, float("nan")]])
        >>> mask = torch.tensor([[True, True], [True, False]])
        >>> masked_mean(x, mask)
        tensor(2.)
    """
    return torch.where(mask, x, 0.0).sum() / mask.sum()


def aggregate_token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Global token mean: every real token of the batch weighs the same (DAPO, CISPO).

    .. math:: L = \\frac{1}{\\sum_i |o_i|} \\sum_i \\sum_{t=1}^{|o_i|} \\ell_{i,t}

    Long sequences get more weight than short ones. This is DAPO's "token-level policy gradient
    loss" (Yu et al., 2025) and the normalisation of CISPO (MiniMax, 2025).

    Args:
        loss (torch.Tensor): per-token loss ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.

    Returns:
        torch.Tensor: a scalar.

    Examples:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[True, True, True], [True, False, False]])
        >>> aggregate_token_mean(loss, mask)  # (1 + 2 + 3 + 4) / 4
        tensor(2.5000)
    """
    return masked_mean(loss, mask)


def _sequence_sums(loss: torch.Tensor, mask: torch.Tensor):
    # per-sequence token sums and lengths, and which sequences hold any real token
    seq_sum = torch.where(mask, loss, 0.0).sum(-1)  # (B,)
    seq_len = mask.sum(-1)  # (B,)
    return seq_sum, seq_len, seq_len > 0


def aggregate_seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token mean within each sequence, then mean over sequences (GRPO, GSPO).

    .. math:: L = \\frac{1}{G} \\sum_{i=1}^{G} \\frac{1}{|o_i|} \\sum_{t=1}^{|o_i|} \\ell_{i,t}

    Every sequence weighs the same whatever its length: the original GRPO objective (Shao et al.,
    2024) and GSPO's sequence average (Zheng et al., 2025). Sequences with no real
    token are not sequences: they are left out of ``G``.

    Args:
        loss (torch.Tensor): per-token loss ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.

    Returns:
        torch.Tensor: a scalar.

    Examples:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[True, True, True], [True, False, False]])
        >>> aggregate_seq_mean_token_mean(loss, mask)  # (2 + 4) / 2
        tensor(3.)
    """
    seq_sum, seq_len, nonempty = _sequence_sums(loss, mask)
    seq_mean = seq_sum / seq_len.clamp_min(1)
    return torch.where(nonempty, seq_mean, 0.0).sum() / nonempty.sum()


def aggregate_seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token sum within each sequence, then mean over sequences.

    .. math:: L = \\frac{1}{G} \\sum_{i=1}^{G} \\sum_{t=1}^{|o_i|} \\ell_{i,t}

    The sequence-level REINFORCE estimate: a sequence's loss is the sum of its token losses
    (as in Dr. GRPO, Liu et al., 2025, before its constant normalisation). Sequences with no
    real token are left out of ``G``.

    Args:
        loss (torch.Tensor): per-token loss ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.

    Returns:
        torch.Tensor: a scalar.

    Examples:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[True, True, True], [True, False, False]])
        >>> aggregate_seq_mean_token_sum(loss, mask)  # (6 + 4) / 2
        tensor(5.)
    """
    seq_sum, _, nonempty = _sequence_sums(loss, mask)
    return seq_sum.sum() / nonempty.sum()


def aggregate_seq_mean_token_sum_norm(
    loss: torch.Tensor, mask: torch.Tensor, *, max_length: int
) -> torch.Tensor:
    """Dr. GRPO: token sum per sequence divided by a constant length, then mean over sequences.

    .. math:: L = \\frac{1}{G} \\sum_{i=1}^{G} \\frac{1}{L_{\\max}} \\sum_{t=1}^{|o_i|} \\ell_{i,t}

    Liu et al. (2025) show that dividing by the response length ``|o_i|`` biases GRPO
    towards long wrong answers; Dr. GRPO divides by a constant instead -- the generation budget
    ``L_max`` -- so every token's gradient has the same scale. ``L_max`` must be the same for
    every batch (the maximum number of new tokens), not the padded width of this batch.

    Args:
        loss (torch.Tensor): per-token loss ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.
        max_length (int): the constant ``L_max``, strictly positive.

    Returns:
        torch.Tensor: a scalar.

    Raises:
        ValueError: if ``max_length`` is not strictly positive.

    Examples:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[True, True, True], [True, False, False]])
        >>> aggregate_seq_mean_token_sum_norm(loss, mask, max_length=5)  # (6 + 4) / 2 / 5
        tensor(1.)
    """
    if max_length <= 0:
        raise ValueError(f"max_length must be strictly positive, got {max_length}.")
    return aggregate_seq_mean_token_sum(loss, mask) / max_length


def aggregate_token_sum(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""Sum over every real token of the batch, divided by nothing (verl's ``"token-sum"``).

    .. math:: L = \sum_i \sum_{t=1}^{|o_i|} \ell_{i,t}

    verl's ``loss_agg_mode="token-sum"`` (August 2026): no count, no constant, so the loss of a
    batch is the sum of the losses of its parts. Micro-batches add up as they are; with
    ``DistributedDataParallel`` (which averages the ranks' gradients) multiply the gradients
    by the world size, as verl multiplies the loss by ``dp_size``
    (``GRPOLoss.normalize_gradients(params, 1, ranks=world_size)``). The gradient's scale grows
    with the batch: pick the learning rate for the number of tokens of a step.

    Args:
        loss (torch.Tensor): per-token loss ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.

    Returns:
        torch.Tensor: a scalar.

    Examples:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 9.0]])
        >>> mask = torch.tensor([[True, True, True], [True, False, False]])
        >>> aggregate_token_sum(loss, mask)  # 1 + 2 + 3 + 4
        tensor(10.)
    """
    return torch.where(mask, loss, 0.0).sum()


def _token_mean_sum(loss: torch.Tensor, mask: torch.Tensor):
    return torch.where(mask, loss, 0.0).sum(), mask.sum()


def _seq_mean_token_mean_sum(loss: torch.Tensor, mask: torch.Tensor):
    seq_sum, seq_len, nonempty = _sequence_sums(loss, mask)
    return torch.where(nonempty, seq_sum / seq_len.clamp_min(1), 0.0).sum(), nonempty.sum()


def _seq_mean_token_sum_sum(loss: torch.Tensor, mask: torch.Tensor):
    seq_sum, _, nonempty = _sequence_sums(loss, mask)
    return seq_sum.sum(), nonempty.sum()


def _seq_mean_token_sum_norm_sum(loss: torch.Tensor, mask: torch.Tensor, *, max_length: int):
    seq_sum, _, nonempty = _sequence_sums(loss, mask)
    return seq_sum.sum() / max_length, nonempty.sum()


def _token_sum_sum(loss: torch.Tensor, mask: torch.Tensor):
    raise ValueError(
        "aggregation 'token_sum' is a sum already: the losses of micro-batches add up with "
        "no count to divide by. Call the loss outside summed(); with "
        "DistributedDataParallel, multiply the gradients by the world size: "
        "GRPOLoss.normalize_gradients(params, 1, ranks=world_size)."
    )


#: Aggregations by name, for ``GRPOLoss(aggregation=...)``. Each maps a per-token loss and its
#: mask, both ``(B, T)``, to a scalar; ``"seq_mean_token_sum_norm"`` also needs ``max_length``.
#: Add one with :func:`register_aggregation`, which records its sum and count beside it.
AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {}
#: Each aggregation of :data:`AGGREGATIONS` -> its ``(sum, count)`` function
#: (:func:`aggregation_sum`): the loss is ``sum / count``.
AGGREGATION_SUMS: dict[Callable[..., torch.Tensor], Callable[..., tuple]] = {}


def register_aggregation(
    name: str, aggregate: Callable[..., torch.Tensor], sum_and_count: Callable[..., tuple]
) -> None:
    """Add an aggregation under ``name``: its value ``aggregate(loss, mask)`` and its
    ``sum_and_count(loss, mask) -> (S, N)`` with ``aggregate == S / N`` (extra keywords, such as
    Dr. GRPO's ``max_length``, reach both). ``GRPOLoss(aggregation=name)`` then takes it, and
    :meth:`~torchrl_grpo.GRPOLoss.summed` adds its sums over micro-batches exactly.

    Raises:
        ValueError: ``name`` is taken.

    Examples:
        >>> import torch
        >>> from torchrl_grpo.loss_terms import AGGREGATIONS, aggregation_sum, register_aggregation
        >>> def longest_mean(loss, mask):  # each row's token mean over the longest row's length
        ...     return sum_longest(loss, mask)[0] / sum_longest(loss, mask)[1]
        >>> def sum_longest(loss, mask):
        ...     return (torch.where(mask, loss, 0.0).sum(-1) / mask.sum(-1).max()).sum(), (
        ...         mask.any(-1).sum())
        >>> register_aggregation("seq_mean_token_sum_longest", longest_mean, sum_longest)
        >>> loss, mask = torch.ones(2, 3), torch.tensor([[True, True, True], [True, False, False]])
        >>> AGGREGATIONS["seq_mean_token_sum_longest"](loss, mask)  # (3/3 + 1/3) / 2
        tensor(0.6667)
        >>> aggregation_sum(longest_mean, loss, mask)
        (tensor(1.3333), tensor(2))
        >>> del AGGREGATIONS["seq_mean_token_sum_longest"], AGGREGATION_SUMS[longest_mean]
    """
    if name in AGGREGATIONS:
        raise ValueError(f"aggregation {name!r} is registered already.")
    AGGREGATIONS[name] = aggregate
    AGGREGATION_SUMS[aggregate] = sum_and_count


register_aggregation("token_mean", aggregate_token_mean, _token_mean_sum)
register_aggregation("seq_mean_token_mean", aggregate_seq_mean_token_mean, _seq_mean_token_mean_sum)
register_aggregation("seq_mean_token_sum", aggregate_seq_mean_token_sum, _seq_mean_token_sum_sum)
register_aggregation(
    "seq_mean_token_sum_norm", aggregate_seq_mean_token_sum_norm, _seq_mean_token_sum_norm_sum
)
register_aggregation("token_sum", aggregate_token_sum, _token_sum_sum)


def aggregation_sum(
    aggregate: Callable[..., torch.Tensor], loss: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """An aggregation as a sum and a count: ``aggregate(loss, mask) == sum / count``.

    .. math:: L = \\frac{S}{N}, \\qquad S = \\sum_i s_i, \\qquad N = \\text{tokens or
        sequences}

    where, for the built-in ones, ``s_i`` is sequence ``i``'s share: its token sum
    (``"token_mean"``, ``"seq_mean_token_sum"``), its token mean (``"seq_mean_token_mean"``)
    or its token sum over ``L_max`` (``"seq_mean_token_sum_norm"``), and ``N`` counts the real
    tokens (``"token_mean"``) or the sequences holding one (the others). Both are sums over the
    batch, so the sums of ``K`` micro-batches (and of ``R`` ranks) add up to the whole batch's:
    divided by the whole batch's count, their gradients are the whole batch's. Averaging each
    micro-batch's own mean instead weighs a token by the size of its micro-batch (TRL issues
    3021 and 5619). :meth:`torchrl_grpo.GRPOLoss.summed` uses this. The sum and count of an
    aggregation are those :func:`register_aggregation` recorded beside it.

    Args:
        aggregate (callable): an aggregation of :data:`AGGREGATIONS` (Dr. GRPO's with its
            ``max_length`` bound by ``functools.partial``, as ``GRPOLoss`` binds it).
        loss (torch.Tensor): per-token loss ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: the sum ``S`` (a scalar, differentiable) and the
        count ``N`` (an int64 scalar).

    Raises:
        ValueError: ``aggregate`` was registered without its sum (a plain callable's sum is
            unknown), or is :func:`aggregate_token_sum`: a sum already, its parts add up with
            no count.

    Examples:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[True, True, True], [True, False, False]])
        >>> aggregation_sum(aggregate_token_mean, loss, mask)  # 10 / 4 = 2.5
        (tensor(10.), tensor(4))
        >>> aggregation_sum(aggregate_seq_mean_token_mean, loss, mask)  # (2 + 4) / 2 = 3
        (tensor(6.), tensor(2))
    """
    fn, keywords = aggregate, {}
    if isinstance(aggregate, functools.partial):
        fn, keywords = aggregate.func, aggregate.keywords
    sum_and_count = AGGREGATION_SUMS.get(fn)
    if sum_and_count is None:
        raise ValueError(
            f"aggregation {getattr(fn, '__name__', fn)!r} has no registered sum and count, so "
            "it cannot be summed over micro-batches exactly: add it with "
            "torchrl_grpo.loss_terms.register_aggregation(name, aggregate, sum_and_count)."
        )
    return sum_and_count(loss, mask, **keywords)


# ---------------------------------------------------------------------------------------------
# Importance ratios
# ---------------------------------------------------------------------------------------------


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio, broadcast back over the tokens.

    .. math::

        \\log s_i(\\theta) = \\frac{1}{|o_i|} \\sum_{t=1}^{|o_i|}
            \\log \\frac{\\pi_\\theta(o_{i,t} \\mid q, o_{i,<t})}
                {\\pi_{old}(o_{i,t} \\mid q, o_{i,<t})}

    (Zheng et al., 2025). The gradient flows to every token of the sequence through the
    mean. A sequence with no real token gets ``log s = 0`` (ratio 1); it is masked out anyway.

    Args:
        log_ratio (torch.Tensor): per-token log-ratio ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.

    Returns:
        torch.Tensor: ``(B, T)``, each row constant and equal to its sequence's ``log s_i``.

    Examples:
        >>> import torch
        >>> log_ratio = torch.tensor([[0.1, 0.3, 9.0], [0.4, 0.0, 0.0]])
        >>> mask = torch.tensor([[True, True, False], [True, False, False]])
        >>> sequence_log_ratio(log_ratio, mask)
        tensor([[0.2000, 0.2000, 0.2000],
                [0.4000, 0.4000, 0.4000]])
    """
    seq_len = mask.sum(-1, keepdim=True).clamp_min(1)  # (B, 1)
    seq_log_ratio = torch.where(mask, log_ratio, 0.0).sum(-1, keepdim=True) / seq_len  # (B, 1)
    return seq_log_ratio.expand_as(log_ratio)


def sequence_sum_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""The log of the product of a sequence's token ratios, broadcast back over its tokens.

    .. math:: \log W_i = \operatorname{clip}\Big(\sum_{t=1}^{|o_i|}
        \operatorname{clip}(\log r_{i,t}, -20, 20),\ -20,\ 20\Big)

    The sequence importance weight of VESPO (:func:`vespo_loss`): the plain product of the
    token ratios, where GSPO takes their geometric mean (:func:`sequence_log_ratio`). Each
    token's log-ratio and the sum are clamped to ``[-20, 20]`` (``MAX_LOG_RATIO``; TRL clamps
    the tokens there), so that ``W`` and the ratio metrics stay finite over long sequences.
    A sequence with no real token gets ``log W = 0``.

    Args:
        log_ratio (torch.Tensor): per-token log-ratio ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.

    Returns:
        torch.Tensor: ``(B, T)``, each row constant and equal to its sequence's ``log W_i``.

    Examples:
        >>> import torch
        >>> log_ratio = torch.tensor([[0.1, 0.3, 9.0], [15.0, 15.0, 0.0]])
        >>> mask = torch.tensor([[True, True, False], [True, True, False]])
        >>> sequence_sum_log_ratio(log_ratio, mask)
        tensor([[ 0.4000,  0.4000,  0.4000],
                [20.0000, 20.0000, 20.0000]])
    """
    clamped = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    total = torch.where(mask, clamped, 0.0).sum(-1, keepdim=True)  # (B, 1)
    return total.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).expand_as(log_ratio)


def _token_level(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # one value per token: the per-token log-ratio (or log-weight) as it is
    return log_ratio


#: ``ratio_level(log_ratio, mask) -> log_ratio``, all ``(B, T)``.
RatioLevel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: Levels of the importance ratio by name, for ``GRPOLoss(ratio_level=...)``: one ratio per
#: token (PPO, GRPO), GSPO's length-normalised one per sequence, or the product of a sequence's
#: token ratios (VESPO's).
RATIO_LEVELS: dict[str, RatioLevel] = {
    "token": _token_level,
    "sequence": sequence_log_ratio,
    "sequence_sum": sequence_sum_log_ratio,
}


def truncated_is_weight(
    log_prob: torch.Tensor, inference_log_prob: torch.Tensor, cap: float | torch.Tensor
) -> torch.Tensor:
    """Truncated importance weight correcting a trainer/inference mismatch (TIS).

    .. math:: w_t = \\operatorname{sg}\\Big[\\min\\Big(
        \\frac{\\pi_{old}(a_t)}{\\pi_{inference}(a_t)},\\ C\\Big)\\Big]

    The inference engine (e.g. vLLM) that sampled the tokens computes slightly different
    probabilities than the trainer, so the samples are off-policy even for a "fresh" batch. Yao
    et al. (2025) reweight each token's loss by the trainer-to-sampler ratio, truncated at ``C``
    (they use ``C = 2``) to bound the variance. The weight carries no gradient. The token level
    of :func:`truncate_importance_weight` with no lower bound, on any shape (``tis_cap``'s).

    Args:
        log_prob (torch.Tensor): trainer log-probs of the sampled tokens (the proximal, "old"
            policy), any shape.
        inference_log_prob (torch.Tensor): sampler log-probs, same shape.
        cap (float or torch.Tensor): the truncation ``C`` (> 0).

    Returns:
        torch.Tensor: the weights, same shape, detached.

    Examples:
        >>> import torch
        >>> old = torch.tensor([0.6, 0.3, 0.1]).log()
        >>> inference = torch.tensor([0.2, 0.3, 0.5]).log()
        >>> truncated_is_weight(old, inference, 2.0)  # ratios 3, 1, 0.2
        tensor([2.0000, 1.0000, 0.2000])
    """
    real = torch.ones_like(log_prob, dtype=torch.bool)
    return truncate_importance_weight(log_prob - inference_log_prob, real, None, cap)[0]


def _sequence_level(log_weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # log of the product of the token weights of each sequence, broadcast over its tokens
    return torch.where(mask, log_weight, 0.0).sum(-1, keepdim=True).expand_as(log_weight)


#: Levels of an importance weight: one per token, or one per sequence (the product of its tokens').
_IS_LEVELS = {"token": _token_level, "sequence": _sequence_level}


def _is_level(level: str):
    try:
        return _IS_LEVELS[level]
    except KeyError:
        raise ValueError(f"level must be one of {sorted(_IS_LEVELS)}, got {level!r}.") from None


def truncate_importance_weight(
    log_weight: torch.Tensor,
    mask: torch.Tensor,
    low: float | torch.Tensor | None,
    high: float | torch.Tensor | None,
    *,
    level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weight against the inference engine, truncated to ``[low, high]`` (TIS).

    .. math:: w_t = \\operatorname{sg}\\big[\\operatorname{clip}(\\rho_t, C_{min}, C_{max})\\big],
        \\qquad \\rho_t = \\frac{\\pi_{old}(a_t)}{\\pi_{inference}(a_t)}
        \\ \\text{(token)} \\quad\\text{or}\\quad
        \\rho_i = \\prod_{t \\in o_i} \\frac{\\pi_{old}(a_t)}{\\pi_{inference}(a_t)}
        \\ \\text{(sequence)}

    Truncated importance sampling (Yao et al., 2025) at the token level, and its sequence-level
    form, TRL's ``vllm_importance_sampling_mode="token_truncate"`` / ``"sequence_truncate"``
    (the sequence ratio is the product of the token ratios over the real tokens). Every token
    stays in the loss; the weight carries no gradient.

    Args:
        log_weight (torch.Tensor): ``log pi_old - log pi_inference`` per token, ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.
        low (float or torch.Tensor, optional): ``C_min``; ``None`` for no lower bound.
        high (float or torch.Tensor, optional): ``C_max``; ``None`` for no upper bound.
        level (str): ``"token"`` or ``"sequence"``. Defaults to ``"token"``.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``(weight, keep)``, both ``(B, T)``: the detached
        weights, and ``mask`` (truncation keeps every real token).

    Examples:
        >>> import torch
        >>> mask = torch.tensor([[True, True, False]])
        >>> log_w = torch.tensor([[3.0, 1.0, 9.0]]).log()
        >>> truncate_importance_weight(log_w, mask, None, 2.0)[0]  # min(rho_t, 2)
        tensor([[2., 1., 2.]])
        >>> truncate_importance_weight(log_w, mask, 0.5, 2.0, level="sequence")[0]  # 3 * 1
        tensor([[2., 2., 2.]])
    """
    _check_same_shape(log_weight=log_weight, mask=mask)
    ratio = _is_level(level)(log_weight.detach(), mask).exp()  # (B, T)
    return ratio.clamp(low, high), mask


def mask_importance_weight(
    log_weight: torch.Tensor,
    mask: torch.Tensor,
    low: float | torch.Tensor | None,
    high: float | torch.Tensor | None,
    *,
    level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weight against the inference engine, zero outside ``[low, high]`` (MIS, IcePop).

    .. math:: w_t = \\operatorname{sg}\\big[\\rho_t\\, \\mathbb{1}[C_{min} \\le \\rho_t \\le
        C_{max}]\\big]

    with ``rho`` per token or per sequence as in :func:`truncate_importance_weight`. Instead of
    truncating a ratio that left the band, the token (or the whole sequence) leaves the
    policy-gradient term: its weight is 0. Token level with the band ``[0.5, 5]`` is IcePop
    (Ling Team, 2025, the Ring-1T report); TRL's ``vllm_importance_sampling_mode="token_mask"``
    / ``"sequence_mask"`` (TRL's default, with ``C_min`` unset and ``C_max = 3``). The weight
    carries no gradient.

    Args:
        log_weight (torch.Tensor): ``log pi_old - log pi_inference`` per token, ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.
        low (float or torch.Tensor, optional): ``C_min``; ``None`` for no lower bound.
        high (float or torch.Tensor, optional): ``C_max``; ``None`` for no upper bound.
        level (str): ``"token"`` or ``"sequence"``. Defaults to ``"token"``.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``(weight, keep)``, both ``(B, T)``: the detached
        weights (0 outside the band and on padding) and the boolean real tokens left in.

    Examples:
        >>> import torch
        >>> mask = torch.tensor([[True, True, True], [True, True, False]])
        >>> log_w = torch.tensor([[0.4, 1.0, 2.0], [1.5, 3.0, 1.0]]).log()
        >>> weight, keep = mask_importance_weight(log_w, mask, 0.5, 5.0)  # IcePop's band
        >>> weight
        tensor([[0.0000, 1.0000, 2.0000],
                [1.5000, 3.0000, 0.0000]])
        >>> mask_importance_weight(log_w, mask, None, 3.0, level="sequence")[1]  # 0.8 | 4.5
        tensor([[ True,  True,  True],
                [False, False, False]])
    """
    _check_same_shape(log_weight=log_weight, mask=mask)
    ratio = _is_level(level)(log_weight.detach(), mask).exp()  # (B, T)
    keep = mask
    if low is not None:
        keep = keep & (ratio >= low)
    if high is not None:
        keep = keep & (ratio <= high)
    return torch.where(keep, ratio, 0.0), keep


#: Corrections of the trainer/inference mismatch by name, for
#: ``GRPOLoss(inference_correction=...)``: TRL's ``vllm_importance_sampling_mode`` values. Each
#: maps ``(log_weight, mask, low, high)``, ``log_weight = log pi_old - log pi_inference`` per token,
#: to ``(weight, keep)``, all ``(B, T)``.
INFERENCE_CORRECTIONS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "token_truncate": truncate_importance_weight,
    "token_mask": mask_importance_weight,
    "sequence_truncate": functools.partial(truncate_importance_weight, level="sequence"),
    "sequence_mask": functools.partial(mask_importance_weight, level="sequence"),
}


def decoupled_behaviour_weight(
    proximal_log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    cap: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Behaviour importance weight of decoupled PPO, zero above a cap.

    .. math:: J(\\theta) = \\mathbb{E}_{a \\sim \\pi_{behav}}\\Big[
        \\frac{\\pi_{prox}(a)}{\\pi_{behav}(a)} \\min\\big(r A,\\
        \\operatorname{clip}(r, 1-\\varepsilon, 1+\\varepsilon) A\\big)\\Big], \\qquad
        r = \\frac{\\pi_\\theta(a)}{\\pi_{prox}(a)}

    Decoupled PPO (Hilton et al., 2022; AReaL, Fu et al., 2025) separates the policy
    that *sampled* the data (behaviour: possibly several versions old, in asynchronous RL) from
    the policy the trust region is centred on (proximal: the current weights before this
    update, recomputed by the trainer). The clip acts on ``r = pi_theta / pi_prox``; this
    function gives the off-policy correction ``w = pi_prox / pi_behav`` that multiplies each
    token's loss. AReaL drops the tokens whose weight exceeds ``behav_imp_weight_cap`` (weight
    0, still counted by the aggregation); ``cap=None`` keeps every token. The weight carries no
    gradient.

    Args:
        proximal_log_prob (torch.Tensor): ``log pi_prox`` of the sampled tokens, any shape.
        behaviour_log_prob (torch.Tensor): ``log pi_behav`` (the sampler's), same shape.
        cap (float or torch.Tensor, optional): AReaL's ``behav_imp_weight_cap`` (``> 1``).

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``(weight, keep)``, same shape: the detached weights
        (0 above the cap) and the boolean tokens left in.

    Examples:
        >>> import torch
        >>> prox = torch.tensor([0.3, 0.6, 0.9]).log()
        >>> behav = torch.tensor([0.6, 0.3, 0.1]).log()
        >>> decoupled_behaviour_weight(prox, behav, cap=5.0)  # 0.5, 2, 9 > 5
        (tensor([0.5000, 2.0000, 0.0000]), tensor([ True,  True, False]))
    """
    _check_same_shape(proximal_log_prob=proximal_log_prob, behaviour_log_prob=behaviour_log_prob)
    weight = (proximal_log_prob - behaviour_log_prob).detach().exp()
    keep = torch.ones_like(weight, dtype=torch.bool) if cap is None else weight <= cap
    return torch.where(keep, weight, 0.0), keep


# ---------------------------------------------------------------------------------------------
# Surrogate objectives (per-token losses)
# ---------------------------------------------------------------------------------------------


#: The cap of the unclipped log-ratio in :func:`ppo_clip_loss` (verl's): ``e^20``, about 4.9e8.
MAX_LOG_RATIO = 20.0


def ppo_clip_loss(
    log_ratio: torch.Tensor,
    advantage: torch.Tensor,
    log_clip_low: float | torch.Tensor,
    log_clip_high: float | torch.Tensor,
) -> torch.Tensor:
    """Clipped surrogate loss of PPO / GRPO, with asymmetric bounds (DAPO clip-higher).

    .. math::

        \\ell_t = -\\min\\big(r_t A_t,\\ \\operatorname{clip}(r_t, 1-\\varepsilon_{low},
            1+\\varepsilon_{high})\\, A_t\\big), \\qquad r_t = e^{\\log r_t}

    PPO (Schulman et al., 2017, Eq. 7) with one ``epsilon``; DAPO's clip-higher (Yu et al., 2025,
    Eq. 10) decouples the bounds (``0.2``, ``0.28``). The ratio is clamped in log space, between
    ``log(1 - eps_low)`` and ``log(1 + eps_high)``, exactly as
    :class:`torchrl.objectives.ClipPPOLoss` does. The unclipped ratio is capped at ``e^20``
    (``MAX_LOG_RATIO``, verl's bound): past ``e^88`` it overflows float32, and ClipPPOLoss then
    returns a ``nan`` loss where ``A = 0`` and ``nan`` gradients for every token; here such a
    token's loss is finite and its gradient 0 (with ``A < 0`` its loss is ``|A| e^20``; the
    dual clip, :func:`dual_clip_loss`, bounds it). With a sequence-level ``log_ratio`` (see
    :func:`sequence_log_ratio`) this is GSPO's objective.

    Args:
        log_ratio (torch.Tensor): ``log r`` per token, ``(B, T)``.
        advantage (torch.Tensor): ``A``, broadcastable to ``log_ratio``.
        log_clip_low (float or torch.Tensor): ``log(1 - eps_low)`` (``-inf`` for no lower bound).
        log_clip_high (float or torch.Tensor): ``log(1 + eps_high)``.

    Returns:
        torch.Tensor: the per-token loss, same shape as ``log_ratio``.

    Examples:
        >>> import math, torch
        >>> ratio = torch.tensor([0.5, 1.1, 1.5, 1.5])
        >>> adv = torch.tensor([-1.0, 1.0, 1.0, -1.0])
        >>> ppo_clip_loss(ratio.log(), adv, math.log(0.8), math.log(1.2))
        tensor([ 0.8000, -1.1000, -1.2000,  1.5000])
    """
    # e^89 overflows float32: an inf ratio made the loss nan where A = 0 and every gradient
    # nan (0 * inf in exp's backward) even where the clip won; capped at e^20, as verl does
    ratio = log_ratio.clamp(max=MAX_LOG_RATIO).exp()
    clipped_ratio = log_ratio.clamp(log_clip_low, log_clip_high).exp()
    return -torch.minimum(ratio * advantage, clipped_ratio * advantage)


def dual_clip_loss(
    loss: torch.Tensor, advantage: torch.Tensor, clip_ratio_c: float | torch.Tensor
) -> torch.Tensor:
    """Dual clip: bound the loss of negative-advantage tokens whose ratio has exploded.

    .. math:: \\ell^{dual}_t = \\begin{cases} \\min(\\ell_t,\\ -c\\,A_t) & A_t < 0 \\\\
        \\ell_t & A_t \\ge 0 \\end{cases}

    With ``A < 0`` the PPO loss ``-min(rA, clip(r)A) = |A| max(r, clip(r))`` grows without bound
    as ``r`` grows; dual-clip PPO (Ye et al., 2020) caps it at ``c |A|`` (``c = 3`` in the
    paper and in verl), which also zeroes the gradient of those tokens.

    Args:
        loss (torch.Tensor): per-token loss from :func:`ppo_clip_loss`, ``(B, T)``.
        advantage (torch.Tensor): ``A``, broadcastable to ``loss``.
        clip_ratio_c (float or torch.Tensor): ``c``, greater than 1.

    Returns:
        torch.Tensor: the per-token loss, same shape as ``loss``.

    Examples:
        >>> import math, torch
        >>> ratio = torch.tensor([5.0, 5.0, 2.0])
        >>> adv = torch.tensor([-1.0, 1.0, -1.0])
        >>> loss = ppo_clip_loss(ratio.log(), adv, math.log(0.8), math.log(1.2))
        >>> dual_clip_loss(loss, adv, 3.0)
        tensor([ 3.0000, -1.2000,  2.0000])
    """
    capped = torch.minimum(loss, -clip_ratio_c * advantage)
    return torch.where(advantage < 0, capped, loss)


def cispo_loss(
    log_ratio: torch.Tensor,
    advantage: torch.Tensor,
    log_prob: torch.Tensor,
    log_clip_low: float | torch.Tensor,
    log_clip_high: float | torch.Tensor,
) -> torch.Tensor:
    """CISPO: clip the importance weight, not the update, and stop its gradient.

    .. math:: \\ell_t = -\\operatorname{sg}\\big[\\operatorname{clip}(r_t, 1-\\varepsilon_{low},
        1+\\varepsilon_{high})\\big]\\, A_t\\, \\log \\pi_\\theta(o_t)

    (MiniMax, 2025.) The gradient is ``-clip(r) A grad log pi`` for *every* token: a token
    outside the clip band keeps a bounded gradient instead of none, which is the point of CISPO.
    (torchrl 0.14.1's ``CISPOLoss`` returns ``-clip(r) A`` without the stop-gradient, so tokens
    outside the band get a zero gradient -- PPO's behaviour, not CISPO's.) Inside the band the
    gradient equals PPO's, ``r A grad log pi``. The *value* of this loss is not a PPO loss
    value; only its gradient is meaningful.

    Args:
        log_ratio (torch.Tensor): ``log r`` per token, ``(B, T)``.
        advantage (torch.Tensor): ``A``, broadcastable to ``log_ratio``.
        log_prob (torch.Tensor): ``log pi_theta`` of the sampled tokens, ``(B, T)``, with grad.
        log_clip_low (float or torch.Tensor): ``log(1 - eps_low)``; ``-inf`` for no lower bound,
            as MiniMax-M1 runs it.
        log_clip_high (float or torch.Tensor): ``log(1 + eps_high)``.

    Returns:
        torch.Tensor: the per-token loss, same shape as ``log_ratio``.

    Examples:
        >>> import math, torch
        >>> log_prob = torch.tensor([-1.0, -2.0], requires_grad=True)
        >>> old = torch.tensor([-1.0, -3.0])  # second token: ratio e = 2.72, clipped to 1.2
        >>> loss = cispo_loss(log_prob - old, torch.ones(2), log_prob, -math.inf, math.log(1.2))
        >>> loss.sum().backward()
        >>> log_prob.grad  # -clip(r) * A: the clipped token still gets a gradient
        tensor([-1.0000, -1.2000])
    """
    weight = log_ratio.detach().clamp(log_clip_low, log_clip_high).exp()
    return -weight * advantage * log_prob


def sapo_loss(
    log_ratio: torch.Tensor,
    advantage: torch.Tensor,
    temperature_pos: float | torch.Tensor = 1.0,
    temperature_neg: float | torch.Tensor = 1.05,
) -> torch.Tensor:
    """SAPO: a soft, temperature-controlled gate on the ratio in place of PPO's hard clip.

    .. math:: \\ell_t = -\\frac{4}{\\tau_t}\\, \\sigma\\big(\\tau_t (r_t - 1)\\big)\\, A_t,
        \\qquad \\tau_t = \\begin{cases} \\tau_{pos} & A_t > 0 \\\\ \\tau_{neg} & A_t \\le 0
        \\end{cases}

    Soft Adaptive Policy Optimization (Gao et al., 2025, arXiv:2511.20347). The gradient with
    respect to ``r`` is ``-4 sigma(1 - sigma) A``: exactly PPO's ``-A`` on-policy (``r = 1``),
    and smoothly decaying as ``r`` leaves 1, instead of dropping to 0 at the clip bound. A larger
    temperature narrows the gate; ``tau_neg > tau_pos`` damps negative-advantage tokens faster,
    which the paper finds stabilises training. Defaults ``tau_pos = 1.0``, ``tau_neg = 1.05``
    (the paper's and TRL's ``sapo_temperature_pos`` / ``sapo_temperature_neg``). The value at
    ``r = 1`` is ``-2A / tau``, not PPO's ``-A``: only the gradient is comparable.

    Args:
        log_ratio (torch.Tensor): ``log r`` per token, ``(B, T)``.
        advantage (torch.Tensor): ``A``, same rank as ``log_ratio`` and broadcastable to it
            (``(B, 1)`` or ``(B, T)``).
        temperature_pos (float or torch.Tensor): ``tau_pos > 0``. Defaults to ``1.0``.
        temperature_neg (float or torch.Tensor): ``tau_neg > 0``. Defaults to ``1.05``.

    Returns:
        torch.Tensor: the per-token loss, same shape as ``log_ratio``.

    Raises:
        ValueError: if ``advantage`` does not have the rank of ``log_ratio``.

    Examples:
        >>> import torch
        >>> log_ratio = torch.zeros(1, 2, requires_grad=True)  # on-policy: r = 1
        >>> loss = sapo_loss(log_ratio, torch.tensor([[1.0, -1.0]]), 1.0, 2.0)
        >>> loss  # -(4 / tau) * 0.5 * A
        tensor([[-2.,  1.]], grad_fn=<MulBackward0>)
        >>> loss.sum().backward()
        >>> log_ratio.grad  # PPO's -A
        tensor([[-1.,  1.]])
    """
    _check_same_rank("advantage", advantage, "log_ratio", log_ratio)
    tau = torch.where(advantage > 0, temperature_pos, temperature_neg)  # broadcast like A
    gate = torch.sigmoid(tau * log_ratio.exp().sub(1.0)) * (4.0 / tau)  # (B, T)
    return -gate * advantage


def two_sided_clip_loss(
    log_ratio: torch.Tensor,
    advantage: torch.Tensor,
    log_clip_low: float | torch.Tensor,
    log_clip_high: float | torch.Tensor,
    delta: float | torch.Tensor,
) -> torch.Tensor:
    r"""PPO's clipped surrogate with the unclipped ratio also capped at ``delta`` (two-sided clip).

    .. math:: \ell_t = -\min\big(\min(r_t, \delta)\, A_t,\
        \operatorname{clip}(r_t, 1-\varepsilon_{low}, 1+\varepsilon_{high})\, A_t\big)

    INTELLECT-2 (Prime Intellect, 2025, arXiv:2505.07291): with ``A < 0`` PPO's loss
    ``|A| max(r, clip(r))`` grows without bound with ``r``; capping ``r`` at ``delta`` bounds it
    at ``delta |A|`` and zeroes the gradient of those tokens. TRL's ``delta`` (``4`` in its
    INTELLECT-2 recipe), which recommends ``delta > 1 + eps_high``: then positive advantages
    are untouched and this equals the dual clip with ``c = delta`` (:func:`dual_clip_loss`).
    Below ``1 + eps_high``, ``delta`` is also the upper bound of positive advantages' ratios.

    Args:
        log_ratio (torch.Tensor): ``log r`` per token, ``(B, T)``.
        advantage (torch.Tensor): ``A``, broadcastable to ``log_ratio``.
        log_clip_low (float or torch.Tensor): ``log(1 - eps_low)``.
        log_clip_high (float or torch.Tensor): ``log(1 + eps_high)``.
        delta (float or torch.Tensor): the cap ``delta > 1``.

    Returns:
        torch.Tensor: the per-token loss, same shape as ``log_ratio``.

    Examples:
        >>> import math, torch
        >>> ratio = torch.tensor([6.0, 6.0, 2.0])
        >>> adv = torch.tensor([-1.0, 1.0, -1.0])
        >>> two_sided_clip_loss(ratio.log(), adv, math.log(0.8), math.log(1.2), 4.0)
        tensor([ 4.0000, -1.2000,  2.0000])
    """
    ratio = log_ratio.clamp(max=MAX_LOG_RATIO).exp().clamp(max=delta)
    clipped_ratio = log_ratio.clamp(log_clip_low, log_clip_high).exp()
    return -torch.minimum(ratio * advantage, clipped_ratio * advantage)


def vespo_loss(
    log_weight: torch.Tensor,
    advantage: torch.Tensor,
    log_prob: torch.Tensor,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> torch.Tensor:
    r"""VESPO: the sequence weight smoothed by a Gamma-shaped kernel, its gradient stopped.

    .. math:: \ell_{i,t} = -\operatorname{sg}\big[\phi(W_i)\big]\, A_i\,
        \log \pi_\theta(o_{i,t}), \qquad \phi(W) = W^{k}\, e^{\lambda (1 - W)}

    (arXiv:2602.10693; TRL's ``loss_type="vespo"``.) ``W_i`` is the product of the sequence's
    token ratios (:func:`sequence_sum_log_ratio`), its log clamped to ``[log 1e-8, 20]``;
    ``phi(1) = 1``, so on-policy the gradient is REINFORCE's, and ``phi`` decays smoothly as
    ``W`` leaves 1, fast when it grows (``e^{-lambda W}``) and as ``W^k`` when it shrinks, where
    PPO's clip cuts the gradient at a hard bound. ``(k, lambda)`` is ``(k_pos, lambda_pos)``
    for ``A >= 0`` and ``(k_neg, lambda_neg)`` for ``A < 0``; TRL's defaults ``(2, 3)`` and
    ``(3, 2)``. ``lambda`` is floored at ``1e-4`` and a non-finite ``phi`` is 0, as TRL does.
    The kernel follows the sign of each token's advantage: with a per-sequence advantage (TRL's
    case) one kernel per sequence.
    Like CISPO's, the value of this loss is not a PPO loss value; only its gradient is.

    Args:
        log_weight (torch.Tensor): ``log W`` per token, ``(B, T)`` (each row constant).
        advantage (torch.Tensor): ``A``, broadcastable to ``log_weight``.
        log_prob (torch.Tensor): ``log pi_theta`` of the sampled tokens, ``(B, T)``, with grad.
        k_pos, lambda_pos (float): the kernel for ``A >= 0``. Default to ``2.0``, ``3.0``.
        k_neg, lambda_neg (float): the kernel for ``A < 0``. Default to ``3.0``, ``2.0``.

    Returns:
        torch.Tensor: the per-token loss, same shape as ``log_weight``.

    Examples:
        >>> import math, torch
        >>> log_prob = torch.tensor([[-1.0], [-1.0], [-1.0]], requires_grad=True)
        >>> log_w = torch.tensor([[0.0], [math.log(2.0)], [math.log(2.0)]])  # W = 1, 2, 2
        >>> loss = vespo_loss(log_w, torch.tensor([[1.0], [1.0], [-1.0]]), log_prob)
        >>> loss.sum().backward()
        >>> log_prob.grad  # -phi(W) A: phi(1) = 1, 4 e^-3 = 0.199 (A > 0), -8 e^-2 = -1.083
        tensor([[-1.0000],
                [-0.1991],
                [ 1.0827]])
    """
    with torch.no_grad():
        log_w = log_weight.clamp(math.log(1e-8), MAX_LOG_RATIO)
        positive = advantage >= 0
        k = torch.where(positive, log_w.new_tensor(k_pos), log_w.new_tensor(k_neg))
        lam = torch.where(positive, log_w.new_tensor(lambda_pos), log_w.new_tensor(lambda_neg))
        lam = lam.clamp(min=1e-4)
        log_phi = lam + k * log_w - lam * log_w.exp()
        phi = log_phi.exp().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return -phi * advantage * log_prob


def _clip_objective(log_ratio, advantage, log_prob, log_clip_low, log_clip_high):
    # the PPO surrogate does not use log_prob; the uniform signature lets objectives be swapped
    return ppo_clip_loss(log_ratio, advantage, log_clip_low, log_clip_high)


def _sapo_objective(
    log_ratio, advantage, log_prob, log_clip_low, log_clip_high, *, temperature_pos, temperature_neg
):
    # SAPO's soft gate replaces the clip: the clip band is not used (it still sets the metrics)
    return sapo_loss(log_ratio, advantage, temperature_pos, temperature_neg)


#: ``objective(log_ratio, advantage, log_prob, log_clip_low, log_clip_high) -> per-token loss``,
#: all ``(B, T)`` but the two clip bounds (scalars).
Objective = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


def _vespo_objective(
    log_ratio,
    advantage,
    log_prob,
    log_clip_low,
    log_clip_high,
    *,
    k_pos,
    lambda_pos,
    k_neg,
    lambda_neg,
):
    # VESPO's kernel replaces the clip; log_ratio is the sequence's log W (ratio_level
    # "sequence_sum")
    return vespo_loss(log_ratio, advantage, log_prob, k_pos, lambda_pos, k_neg, lambda_neg)


#: Surrogate objectives by name, for ``GRPOLoss(objective=...)``: PPO's clip
#: (:func:`ppo_clip_loss`), :func:`cispo_loss`, SAPO's gate (:func:`sapo_loss`, whose
#: temperatures ``GRPOLoss`` binds as ``temperature_pos`` / ``temperature_neg`` keywords) and
#: VESPO's kernel (:func:`vespo_loss`, its ``k`` and ``lambda`` bound the same way).
OBJECTIVES: dict[str, Objective] = {
    "clip": _clip_objective,
    "cispo": cispo_loss,
    "sapo": _sapo_objective,
    "vespo": _vespo_objective,
}


# ---------------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------------


def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k1 estimator of ``KL(pi_theta || pi_ref)`` on tokens sampled from ``pi_theta``.

    .. math:: k_1 = \\log \\frac{\\pi_\\theta(a)}{\\pi_{ref}(a)}

    Unbiased but high-variance and can be negative (Schulman, 2020).

    Args:
        log_prob (torch.Tensor): ``log pi_theta`` of the sampled tokens, any shape.
        ref_log_prob (torch.Tensor): ``log pi_ref`` of the same tokens, same shape.

    Returns:
        torch.Tensor: per-token estimates, same shape.

    Examples:
        >>> import torch
        >>> kl_k1(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]))
        tensor([ 0.5000, -1.0000])
    """
    return log_prob - ref_log_prob


def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k2 estimator of ``KL(pi_theta || pi_ref)``: half the squared log-ratio.

    .. math:: k_2 = \\tfrac{1}{2} \\Big(\\log \\frac{\\pi_\\theta(a)}{\\pi_{ref}(a)}\\Big)^2

    Biased, low variance, never negative (Schulman, 2020). Its gradient is the gradient of the
    true KL's second-order expansion.

    Args:
        log_prob (torch.Tensor): ``log pi_theta`` of the sampled tokens, any shape.
        ref_log_prob (torch.Tensor): ``log pi_ref`` of the same tokens, same shape.

    Returns:
        torch.Tensor: per-token estimates, same shape.

    Examples:
        >>> import torch
        >>> kl_k2(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]))
        tensor([0.1250, 0.5000])
    """
    return 0.5 * (log_prob - ref_log_prob).square()


def kl_k3(
    log_prob: torch.Tensor, ref_log_prob: torch.Tensor, clamp: float | None = 10.0
) -> torch.Tensor:
    """k3 estimator of ``KL(pi_theta || pi_ref)``, clamped as verl's ``low_var_kl``.

    .. math:: k_3 = \\frac{\\pi_{ref}(a)}{\\pi_\\theta(a)} - 1
        - \\log \\frac{\\pi_{ref}(a)}{\\pi_\\theta(a)}

    Unbiased, low variance and never negative (Schulman, 2020); GRPO's KL penalty (Shao et al.,
    2024). Because ``exp`` explodes for tokens the policy has made much likelier than the
    reference, the log-ratio is clamped to ``[-20, 20]`` and the estimate to ``[-clamp, clamp]``
    (verl's ``low_var_kl``, ``clamp = 10``); pass ``clamp=None`` for the raw estimator.

    Args:
        log_prob (torch.Tensor): ``log pi_theta`` of the sampled tokens, any shape.
        ref_log_prob (torch.Tensor): ``log pi_ref`` of the same tokens, same shape.
        clamp (float, optional): bound on the estimate; ``None`` disables both clamps.
            Defaults to ``10.0``.

    Returns:
        torch.Tensor: per-token estimates, same shape.

    Examples:
        >>> import torch
        >>> kl_k3(torch.tensor([-1.0, -2.0, -30.0]), torch.tensor([-1.0, -1.0, -1.0]))
        tensor([ 0.0000,  0.7183, 10.0000])
    """
    log_ref_ratio = ref_log_prob - log_prob
    if clamp is not None:
        log_ref_ratio = log_ref_ratio.clamp(-20.0, 20.0)
    kl = log_ref_ratio.expm1() - log_ref_ratio
    if clamp is not None:
        kl = kl.clamp(-clamp, clamp)
    return kl


def k3_kl_token_estimate(target_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    r"""torchrl's ``k3_kl_token_estimate``: :func:`kl_k3` without clamps, arguments swapped.

    .. math:: k_3 = e^{d} - 1 - d, \qquad d = \log p_{target}(a) - \log p(a)

    The per-token k3 estimate of ``KL(p || p_target)`` on tokens sampled from ``p`` (torchrl's
    distillation and SFT losses use it), under torchrl's name and argument order, so that
    ``from torchrl.objectives.llm import k3_kl_token_estimate`` reads the same from here.

    Args:
        target_log_prob (torch.Tensor): ``log p_target`` of the tokens.
        log_prob (torch.Tensor): ``log p`` of the same tokens (their sampling distribution).

    Returns:
        torch.Tensor: per-token estimates, never negative, same shape.

    Examples:
        >>> import torch
        >>> k3_kl_token_estimate(torch.tensor([-1.0, -1.0]), torch.tensor([-1.0, -2.0]))
        tensor([0.0000, 0.7183])
    """
    return kl_k3(log_prob, target_log_prob, clamp=None)


def importance_weighted_kl(kl: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
    r"""The per-token KL estimate weighted by the importance ratio: the unbiased KL.

    .. math:: \widehat{KL}_t = \frac{\pi_\theta(o_t)}{\pi_{old}(o_t)}\, k_t

    DeepSeek-V3.2 (DeepSeek-AI, 2025, arXiv:2512.02556, Eq. 8): the tokens were sampled by
    ``pi_old``, not ``pi_theta``, so the estimate ``k_t`` of ``KL(pi_theta || pi_ref)`` (k3 in
    the paper) is weighted by ``r_t``; the ratio keeps its gradient, which makes the KL term's
    gradient the reverse KL's even off-policy, and changes it on-policy too (``r = 1`` in
    value, not in gradient). TRL's ``use_bias_correction_kl`` (on by default in TRL 1.16),
    slime's ``--use-unbiased-kl``. The log-ratio is capped at ``MAX_LOG_RATIO`` before ``exp``.

    Args:
        kl (torch.Tensor): the per-token estimate ``k_t`` (e.g. :func:`kl_k3`), ``(B, T)``.
        log_ratio (torch.Tensor): ``log pi_theta - log pi_old``, ``(B, T)``, with grad.

    Returns:
        torch.Tensor: ``r_t k_t``, same shape.

    Examples:
        >>> import math, torch
        >>> log_prob = torch.tensor([-1.0, -1.0], requires_grad=True)
        >>> kl = kl_k3(log_prob, torch.tensor([-1.0, -2.0]))  # 0 and e^-1 - 1 + 1 = 0.368
        >>> importance_weighted_kl(kl, log_prob - torch.tensor([-1.0, -1.0 - math.log(2.0)]))
        tensor([0.0000, 0.7358], grad_fn=<MulBackward0>)
    """
    return log_ratio.clamp(max=MAX_LOG_RATIO).exp() * kl


#: KL estimators by name, for ``GRPOLoss(kl_to_ref_estimator=..., kl_to_inference_estimator=...)``.
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


def kl_trust_region_mask(log_ratio: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """Tokens inside a per-token KL trust region (torchrl's ``kl_mask_threshold``).

    .. math:: m_t = \\big[\\tfrac{1}{2} (\\log \\pi_\\theta(a_t) - \\log \\pi_{old}(a_t))^2
        \\le \\delta\\big]

    ``0.5 * log_ratio**2`` is the second-order estimate of the per-token KL between the two
    policies (Schulman's ``k2``); a token whose estimate exceeds ``delta`` has drifted too far
    from the policy that sampled it and is left out of the loss. torchrl's
    :class:`~torchrl.objectives.llm.GRPOLoss` calls this the KL-Mask.

    Args:
        log_ratio (torch.Tensor): ``log pi_theta - log pi_old`` per token, any shape.
        threshold (float or torch.Tensor): ``delta > 0``.

    Returns:
        torch.Tensor: boolean, same shape, ``True`` where the token stays in the loss.

    Examples:
        >>> import torch
        >>> kl_trust_region_mask(torch.tensor([0.0, 0.3, -0.5, 1.0]), 0.1)  # 0, .045, .125, .5
        tensor([ True,  True, False, False])
    """
    with torch.no_grad():
        return 0.5 * log_ratio.square() <= threshold


# ---------------------------------------------------------------------------------------------
# Token and sequence selection
# ---------------------------------------------------------------------------------------------


def off_policy_sequence_mask(
    log_prob: torch.Tensor,
    sampler_log_prob: torch.Tensor,
    advantage: torch.Tensor,
    mask: torch.Tensor,
    threshold: float | torch.Tensor,
) -> torch.Tensor:
    """Off-policy sequence masking (OPSM): drop negative sequences that drifted from the sampler.

    .. math:: M_{i,t} = 0 \\ \\text{if}\\ A_{i,t} < 0 \\ \\text{and}\\
        \\frac{1}{|o_i|} \\sum_{t=1}^{|o_i|} \\log
        \\frac{\\pi_{old}(o_{i,t})}{\\pi_\\theta(o_{i,t})} > \\delta, \\quad 1 \\
        \\text{otherwise}

    DeepSeek-V3.2 (DeepSeek-AI, 2025, Eq. 9): a sequence whose tokens the current policy now
    finds much less likely than the policy that sampled it (``pi_old``: the inference engine)
    and that carries a negative advantage teaches little and destabilises training; it leaves
    the policy-gradient term. The sequence KL is the mean over the real tokens of
    ``log pi_old - log pi_theta`` (the ``k1`` estimate of ``KL(pi_old || pi_theta)``), computed
    without gradient, as TRL's ``off_policy_mask_threshold`` and slime's ``--use-opsm``. With a
    per-token advantage the sign is read per token. ``delta`` is not published with the paper;
    TRL suggests ``0.5`` (no default) and slime defaults to ``1e-4``.

    Args:
        log_prob (torch.Tensor): ``log pi_theta`` per token, ``(B, T)``.
        sampler_log_prob (torch.Tensor): ``log pi_old`` of the sampler, ``(B, T)``.
        advantage (torch.Tensor): ``A``, ``(B, 1)`` or ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.
        threshold (float or torch.Tensor): ``delta``.

    Returns:
        torch.Tensor: boolean ``(B, T)``, ``True`` on the real tokens that stay.

    Examples:
        >>> import torch
        >>> mask = torch.tensor([[True, True], [True, False], [True, True]])
        >>> log_prob = torch.tensor([[-2.0, -2.0], [-3.0, 0.0], [-3.0, -3.0]])
        >>> old = torch.tensor([[-1.0, -1.0], [-1.0, 0.0], [-1.0, -1.0]])  # KL 1, 2, 2
        >>> adv = torch.tensor([[-1.0], [-1.0], [1.0]])
        >>> off_policy_sequence_mask(log_prob, old, adv, mask, 1.5)
        tensor([[ True,  True],
                [False, False],
                [ True,  True]])
    """
    _check_same_shape(log_prob=log_prob, sampler_log_prob=sampler_log_prob, mask=mask)
    _check_same_rank("advantage", advantage, "log_prob", log_prob)
    with torch.no_grad():
        drift = torch.where(mask, sampler_log_prob - log_prob, 0.0)  # (B, T)
        seq_kl = drift.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)  # (B, 1)
        return mask & ((advantage >= 0) | (seq_kl <= threshold))


def dppo_tv_mask(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantage: torch.Tensor,
    mask: torch.Tensor,
    low: float | torch.Tensor,
    high: float | torch.Tensor,
) -> torch.Tensor:
    r"""DPPO's trust region on the token's probability, total-variation form.

    .. math:: M_t = 0 \ \text{if}\ \begin{cases} \pi_\theta(o_t) - \pi_{old}(o_t) >
        \delta_{high} & A_t > 0 \\ \pi_\theta(o_t) - \pi_{old}(o_t) < -\delta_{low} &
        A_t \le 0 \end{cases}, \quad 1 \ \text{otherwise}

    DPPO ("Rethinking the Trust Region in LLM RL", arXiv:2602.04879) bounds how far each
    sampled token's *probability* moves, where PPO bounds its ratio: a ratio of 2 on a token
    of probability 1e-4 moves the policy by 1e-4, on a token of probability 0.4 by 0.4. A
    token leaves the policy-gradient term once it has moved past the bound in the direction
    its advantage pushes it (up for ``A > 0``, down otherwise). verl's ``dppo_tv`` (its
    ``clip_ratio_low`` / ``clip_ratio_high``; ``0.15`` in its DPPO recipe). No gradient.

    Args:
        log_prob (torch.Tensor): ``log pi_theta`` per token, ``(B, T)``.
        old_log_prob (torch.Tensor): ``log pi_old`` (the policy the trust region is around).
        advantage (torch.Tensor): ``A``, ``(B, 1)`` or ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.
        low (float or torch.Tensor): ``delta_low``, the drop allowed for ``A <= 0``.
        high (float or torch.Tensor): ``delta_high``, the rise allowed for ``A > 0``.

    Returns:
        torch.Tensor: boolean ``(B, T)``, ``True`` on the real tokens that stay.

    Examples:
        >>> import torch
        >>> old = torch.tensor([[0.5, 0.5, 0.5, 0.5]]).log()
        >>> new = torch.tensor([[0.7, 0.3, 0.3, 0.6]]).log()  # moves +0.2, -0.2, -0.2, +0.1
        >>> adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
        >>> dppo_tv_mask(new, old, adv, torch.ones(1, 4, dtype=torch.bool), 0.15, 0.15)
        tensor([[False,  True, False,  True]])
    """
    _check_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, mask=mask)
    _check_same_rank("advantage", advantage, "log_prob", log_prob)
    with torch.no_grad():
        moved = log_prob.exp() - old_log_prob.exp()  # (B, T)
        keep = torch.where(advantage > 0, moved <= high, moved >= -low)
        return mask & keep


def dppo_kl_mask(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantage: torch.Tensor,
    mask: torch.Tensor,
    low: float | torch.Tensor,
    high: float | torch.Tensor,
) -> torch.Tensor:
    r"""DPPO's trust region on the token's probability, binary-KL form.

    .. math:: D_t = p^{old}_t \log\frac{p^{old}_t}{p_t} + (1 - p^{old}_t)
        \log\frac{1 - p^{old}_t}{1 - p_t}, \qquad M_t = 0 \ \text{if}\ \begin{cases}
        D_t > \delta_{high},\ p_t > p^{old}_t & A_t > 0 \\ D_t > \delta_{low},\
        p_t < p^{old}_t & A_t \le 0 \end{cases}

    The form of :func:`dppo_tv_mask` that measures the move of each sampled token by the KL
    between the two Bernoulli distributions "this token / any other" (``p_t`` its probability
    under ``pi_theta``, ``p^old_t`` under ``pi_old``; ``1e-8`` added inside the second log, as
    verl's ``dppo_kl``, whose DPPO recipe uses ``0.05``). No gradient.

    Args:
        log_prob (torch.Tensor): ``log pi_theta`` per token, ``(B, T)``.
        old_log_prob (torch.Tensor): ``log pi_old``, ``(B, T)``.
        advantage (torch.Tensor): ``A``, ``(B, 1)`` or ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.
        low (float or torch.Tensor): ``delta_low`` (``A <= 0``, probability falling).
        high (float or torch.Tensor): ``delta_high`` (``A > 0``, probability rising).

    Returns:
        torch.Tensor: boolean ``(B, T)``, ``True`` on the real tokens that stay.

    Examples:
        >>> import torch
        >>> old = torch.tensor([[0.5, 0.5, 0.5]]).log()
        >>> new = torch.tensor([[0.8, 0.8, 0.55]]).log()  # D = 0.223, 0.223, 0.005
        >>> adv = torch.tensor([[1.0, -1.0, 1.0]])  # a rise against A < 0 stays
        >>> dppo_kl_mask(new, old, adv, torch.ones(1, 3, dtype=torch.bool), 0.05, 0.05)
        tensor([[False,  True,  True]])
    """
    _check_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, mask=mask)
    _check_same_rank("advantage", advantage, "log_prob", log_prob)
    with torch.no_grad():
        p, p_old = log_prob.exp(), old_log_prob.exp()
        binary_kl = p_old * (old_log_prob - log_prob) + (1 - p_old) * torch.log(
            (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)
        )
        keep = torch.where(
            advantage > 0, (binary_kl <= high) | (p <= p_old), (binary_kl <= low) | (p >= p_old)
        )
        return mask & keep


#: DPPO's trust regions by name, for ``GRPOLoss(trust_region=...)``: verl's ``dppo_tv`` and
#: ``dppo_kl``. Each maps ``(log_prob, old_log_prob, advantage, mask, low, high)`` to the
#: boolean ``(B, T)`` tokens kept.
TRUST_REGIONS: dict[str, Callable[..., torch.Tensor]] = {
    "dppo_tv": dppo_tv_mask,
    "dppo_kl": dppo_kl_mask,
}


def _sequence_max_k3(log_weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # each sequence's largest per-token k3 = e^d - 1 - d, d = log pi_old - log pi_inference;
    # 0 for a sequence with no real token
    d = log_weight.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    k3 = torch.where(mask, d.exp() - 1.0 - d, 0.0)  # (B, T), >= 0
    return k3.amax(-1)  # (B,)


def sequence_veto_mask(
    log_weight: torch.Tensor, mask: torch.Tensor, threshold: float | torch.Tensor
) -> torch.Tensor:
    r"""The veto: a sequence whose worst token's mismatch exceeds a bound leaves the loss.

    .. math:: M_i = \Big[\max_{t \in o_i} \big(\rho_t - 1 - \log \rho_t\big) \le \tau\Big],
        \qquad \rho_t = \frac{\pi_{old}(o_t)}{\pi_{inference}(o_t)}

    verl's rejection option ``seq_max_k3`` (``rollout_corr_helper``, 0.9.0; the successor of
    its ``rollout_token_veto_threshold``): one token on which the trainer and the inference
    engine disagree badly (a sampling bug, a numerical blow-up) makes the whole sequence
    untrustworthy, so it is dropped, however well its other tokens agree. ``k3`` is the
    per-token estimate of the KL between the two (:func:`kl_k3`, unclamped); the log-weight is
    clamped to ``[-20, 20]`` first. No gradient.

    Args:
        log_weight (torch.Tensor): ``log pi_old - log pi_inference`` per token, ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.
        threshold (float or torch.Tensor): ``tau > 0``.

    Returns:
        torch.Tensor: boolean ``(B, T)``, ``True`` on the real tokens of the sequences kept.

    Examples:
        >>> import math, torch
        >>> log_w = torch.tensor([[0.0, math.log(3.0)], [0.1, -0.1]])  # k3 of rho = 3: 0.901
        >>> sequence_veto_mask(log_w, torch.ones(2, 2, dtype=torch.bool), 0.5)
        tensor([[False, False],
                [ True,  True]])
    """
    _check_same_shape(log_weight=log_weight, mask=mask)
    with torch.no_grad():
        return mask & (_sequence_max_k3(log_weight, mask) <= threshold).unsqueeze(-1)


def inference_mismatch(log_weight: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    r"""How far the trainer's probabilities are from the inference engine's: four statistics.

    .. math:: \chi^2_{token} = \overline{\rho_t^2} - 1, \qquad
        \chi^2_{seq} = \overline{\textstyle\prod_t \rho_t^2} - 1, \qquad
        \rho_t = \frac{\pi_{old}(o_t)}{\pi_{inference}(o_t)}

    verl's ``rollout_corr/chi2_token`` and ``chi2_seq`` (``rollout_corr_helper``): the
    chi-square divergence of the importance weights, 0 when the two engines agree; it is the
    relative variance an importance-weighted estimate pays (``ESS = 1 / (1 + chi^2)``). The
    token one is a mean over the real tokens, the sequence one over the sequences holding a real
    token, with each sequence's log-weight sum clamped to ``[-20, 20]`` as verl's. Then each
    sequence's worst token: the mean and the maximum over the sequences of
    ``max_t (rho_t - 1 - log rho_t)`` (verl's ``seq_max_k3`` statistic, the one
    :func:`sequence_veto_mask` bounds). No gradient.

    Args:
        log_weight (torch.Tensor): ``log pi_old - log pi_inference`` per token, ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens (at least one).

    Returns:
        dict[str, torch.Tensor]: scalars ``chi2_token``, ``chi2_sequence``,
        ``seq_max_k3_mean`` and ``seq_max_k3_max``.

    Examples:
        >>> import math, torch
        >>> log_w = torch.tensor([[0.0, math.log(2.0)], [0.0, 0.0]])
        >>> stats = inference_mismatch(log_w, torch.ones(2, 2, dtype=torch.bool))
        >>> stats["chi2_token"], stats["chi2_sequence"]  # (1+4+1+1)/4 - 1, (4+1)/2 - 1
        (tensor(0.7500), tensor(1.5000))
        >>> stats["seq_max_k3_max"]  # 2 - 1 - log 2
        tensor(0.3069)
    """
    _check_same_shape(log_weight=log_weight, mask=mask)
    with torch.no_grad():
        # float32 at least (e^40 overflows float16); masks, not indexing (no host sync)
        log_weight = log_weight.to(torch.promote_types(log_weight.dtype, torch.float32))
        d = log_weight.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        nonempty = mask.any(-1)  # (B,)
        seq_sum = torch.where(mask, log_weight, 0.0).sum(-1).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        seq_max = _sequence_max_k3(log_weight, mask)  # (B,), 0 for an empty sequence
        return {
            "chi2_token": masked_mean((2 * d).exp(), mask) - 1.0,
            "chi2_sequence": masked_mean((2 * seq_sum).exp(), nonempty) - 1.0,
            "seq_max_k3_mean": masked_mean(seq_max, nonempty),
            "seq_max_k3_max": seq_max.max(),  # every value >= 0: empty rows do not win
        }


def adaptive_entropy_coeff(
    coeff: float, entropy: float, target: float, low: float, high: float, step: float
) -> float:
    r"""One update of the adaptive entropy coefficient (Skywork-OR1).

    .. math:: \alpha \leftarrow \operatorname{clip}\big(\alpha + \Delta\, (\mathbb{1}[H \le
        H^*] - \mathbb{1}[H > H^*]),\ \alpha_{min},\ \alpha_{max}\big)

    Skywork-OR1 (He et al., 2025, arXiv:2505.22312): the entropy bonus follows the measured
    entropy toward a target instead of a fixed coefficient. Once per optimizer step, the
    coefficient goes up by ``step`` when the entropy ``H`` of the step's tokens is at or below
    the target ``H*`` and down by ``step`` above it, within ``[low, high]``; the bonus is
    applied only while the last measured entropy is at or below the target (TRL's
    ``use_adaptive_entropy``, ``entropy_target``, ``entropy_coef_min`` / ``_max`` /
    ``_delta``; :meth:`torchrl_grpo.GRPOLoss.update_entropy_coeff` runs it).

    Args:
        coeff (float): ``alpha``, the coefficient now.
        entropy (float): ``H``, the token-weighted mean entropy of the step.
        target (float): ``H*``.
        low (float): ``alpha_min``.
        high (float): ``alpha_max``.
        step (float): ``Delta > 0``.

    Returns:
        float: the new coefficient.

    Examples:
        >>> adaptive_entropy_coeff(0.01, entropy=0.1, target=0.2, low=0.0, high=1.0, step=0.005)
        0.015
        >>> adaptive_entropy_coeff(0.002, entropy=0.3, target=0.2, low=0.0, high=1.0, step=0.005)
        0.0
    """
    moved = coeff + step if entropy <= target else coeff - step
    return min(max(moved, low), high)


def masked_quantile(
    x: torch.Tensor, mask: torch.Tensor, q: float | torch.Tensor, *, whole_within: float = 0.0
) -> torch.Tensor:
    """The ``q``-quantile of ``x`` over the entries where ``mask`` is ``True``.

    Linear interpolation between the two nearest order statistics, as ``torch.quantile``
    (whose input is limited to ``2**24`` elements; this one sorts, so it has no such limit):
    with the ``N`` selected values sorted, the quantile sits at position ``q (N - 1)``, computed
    in float64. With ``whole_within=w``, a position within ``w (N - 1)`` of a whole number is
    taken as that number, so that a level like ``1 - 0.2`` (``0.800000011920929`` in float32,
    ``0.8000000000000000444`` in float64) gives the order statistic it names exactly.

    Args:
        x (torch.Tensor): values, any shape.
        mask (torch.Tensor): boolean, same shape as ``x``, with at least one ``True``.
        q (float or torch.Tensor): in ``[0, 1]``.
        whole_within (float, optional): the tolerance on ``q`` under which the position is
            rounded to a whole number. Defaults to ``0.0`` (as ``torch.quantile``).

    Returns:
        torch.Tensor: a scalar.

    Examples:
        >>> import torch
        >>> x = torch.tensor([[4.0, 1.0, 9.0], [2.0, 3.0, 0.0]])
        >>> mask = torch.tensor([[True, True, False], [True, True, False]])
        >>> masked_quantile(x, mask, 0.5)  # 1 2 3 4: halfway between 2 and 3
        tensor(2.5000)
    """
    _check_same_shape(x=x, mask=mask)
    values = x[mask].sort().values  # (N,)
    last = values.numel() - 1
    level = q.double() if torch.is_tensor(q) else torch.tensor(q, dtype=torch.float64)
    position = level.to(values.device) * last
    if whole_within > 0:
        nearest = position.round()
        near = (position - nearest).abs() <= whole_within * max(last, 1)
        position = torch.where(near, nearest, position)
    below = position.floor().long()
    above = position.ceil().long()
    fraction = (position - below).to(values.dtype)
    return values[below] + (values[above] - values[below]) * fraction


def high_entropy_token_mask(
    entropy: torch.Tensor, mask: torch.Tensor, top_quantile: float | torch.Tensor
) -> torch.Tensor:
    """The real tokens in the top ``rho`` quantile of the batch by entropy.

    .. math:: M_t = \\big[H_t \\ge \\tau_\\rho\\big], \\qquad
        \\tau_\\rho = \\operatorname{quantile}_{1-\\rho}\\{H_s : s \\text{ real}\\}

    Wang et al. (2025, "Beyond the 80/20 Rule") find that the policy gradient of the ~20% of
    tokens with the highest entropy ("forking tokens") carries the learning; restricting the
    policy-gradient term to them (``rho = 0.2``) matches or beats training on every token. As
    TRL's ``top_entropy_quantile``: the threshold is the ``1 - rho`` quantile (linear
    interpolation, :func:`masked_quantile`) of the entropies of *all* real tokens of the batch
    (not per sequence), and a token is kept when its entropy is at or above it, so ties at the
    threshold are all kept, and so is the token the threshold lands on (``(1 - rho) (N - 1)`` a
    whole number, to within ``1e-6 (N - 1)``: ``rho`` is read to six decimals). ``rho = 1``
    keeps every real token; ``rho = 0`` only those with the largest entropy. Computed without
    gradient. A mask with no real token selects nothing.

    Args:
        entropy (torch.Tensor): per-token entropy of the policy, ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on the tokens to rank.
        top_quantile (float or torch.Tensor): ``rho`` in ``[0, 1]``.

    Returns:
        torch.Tensor: boolean ``(B, T)``, ``True`` on the selected tokens.

    Examples:
        >>> import torch
        >>> entropy = torch.tensor([[0.1, 2.0, 0.5], [1.0, 0.2, 9.0]])
        >>> mask = torch.tensor([[True, True, True], [True, True, False]])
        >>> high_entropy_token_mask(entropy, mask, 0.4)  # 0.6-quantile of the 5 real values: 0.7
        tensor([[False,  True, False],
                [ True, False, False]])
    """
    _check_same_shape(entropy=entropy, mask=mask)
    with torch.no_grad():
        if not mask.any():
            return mask.clone()
        rho = top_quantile.double() if torch.is_tensor(top_quantile) else float(top_quantile)
        # rho read to 1e-6: a level 1 - rho that names a token exactly (up to its rounding in
        # float32 or float64) puts the threshold on that token, not just above it
        threshold = masked_quantile(entropy, mask, 1.0 - rho, whole_within=1e-6)
        return mask & (entropy >= threshold)


# ---------------------------------------------------------------------------------------------
# Diagnostics
# ---------------------------------------------------------------------------------------------


def effective_sample_size(log_weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Normalised effective sample size of the importance weights over the real tokens.

    .. math:: \\mathrm{ESS} = \\frac{1}{N} \\frac{\\left(\\sum_t w_t\\right)^2}{\\sum_t w_t^2},
        \\qquad w_t = e^{\\log w_t}

    Kish's effective sample size divided by the number ``N`` of real tokens: ``1`` when all
    weights are equal (on-policy), down to ``1/N`` when one weight dominates. The value of
    :class:`torchrl.objectives.ClipPPOLoss`'s ``ESS``; computed without gradient on weights
    rescaled by their maximum (``w_t / max w``, which cancels in the ratio), so that equal
    weights give exactly 1 and large log-weights cannot overflow.

    Args:
        log_weight (torch.Tensor): ``log w`` per token, ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.

    Returns:
        torch.Tensor: a scalar in ``(0, 1]``.

    Examples:
        >>> import torch
        >>> mask = torch.tensor([[True, True, False]])
        >>> effective_sample_size(torch.tensor([[0.3, 0.3, 5.0]]), mask)
        tensor(1.)
        >>> every = torch.ones(1, 3, dtype=torch.bool)
        >>> effective_sample_size(torch.tensor([[0.0, 2.0, 0.0]]).log(), every)
        tensor(0.3333)
    """
    with torch.no_grad():
        lw = log_weight[mask]  # (N,)
        w = (lw - lw.max()).exp()  # (N,), in (0, 1]
        return (w.sum().square() / (w.square().sum() * lw.numel())).clamp(max=1.0)


def clip_fractions(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    log_clip_low: float | torch.Tensor,
    log_clip_high: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Share of real tokens whose ratio lies outside the clip band, in total, below and above.

    .. math:: f_{low} = \\frac{1}{N}\\sum_t [r_t < 1-\\varepsilon_{low}], \\quad
        f_{high} = \\frac{1}{N}\\sum_t [r_t > 1+\\varepsilon_{high}], \\quad f = f_{low} + f_{high}

    ``f`` is :class:`torchrl.objectives.ClipPPOLoss`'s ``clip_fraction`` (a ratio the clamp
    changes), restricted to real tokens. It counts a token whether or not the ``min`` of the
    surrogate then picks the clipped term; the split shows which bound binds (DAPO's clip-higher
    is about ``f_high``).

    Args:
        log_ratio (torch.Tensor): ``log r`` per token, ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.
        log_clip_low (float or torch.Tensor): ``log(1 - eps_low)``.
        log_clip_high (float or torch.Tensor): ``log(1 + eps_high)``.

    Returns:
        tuple[torch.Tensor, torch.Tensor, torch.Tensor]: scalars ``(f, f_low, f_high)``.

    Examples:
        >>> import math, torch
        >>> ratio = torch.tensor([[0.5, 1.0, 1.5, 1.1]])
        >>> mask = torch.tensor([[True, True, True, False]])
        >>> clip_fractions(ratio.log(), mask, math.log(0.8), math.log(1.2))
        (tensor(0.6667), tensor(0.3333), tensor(0.3333))
    """
    with torch.no_grad():
        low = masked_mean((log_ratio < log_clip_low).to(log_ratio.dtype), mask)
        high = masked_mean((log_ratio > log_clip_high).to(log_ratio.dtype), mask)
        return low + high, low, high
