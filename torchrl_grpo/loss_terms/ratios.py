"""Importance ratios: their level (token, GSPO's sequence, VESPO's product) and the weights that
correct the trainer/inference mismatch (truncation and masking, :data:`INFERENCE_CORRECTIONS`)
and the behaviour weight of decoupled PPO."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from torchrl_grpo.loss_terms._shapes import check_same_shape
from torchrl_grpo.loss_terms.objectives import MAX_LOG_RATIO


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
    check_same_shape(log_weight=log_weight, mask=mask)
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
    check_same_shape(log_weight=log_weight, mask=mask)
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
    check_same_shape(proximal_log_prob=proximal_log_prob, behaviour_log_prob=behaviour_log_prob)
    weight = (proximal_log_prob - behaviour_log_prob).detach().exp()
    keep = torch.ones_like(weight, dtype=torch.bool) if cap is None else weight <= cap
    return torch.where(keep, weight, 0.0), keep
