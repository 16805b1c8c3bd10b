"""Surrogate objectives, each a per-token loss (the negated objective): PPO's clip, the dual and
two-sided clips, CISPO, SAPO and VESPO, and their registry (:data:`OBJECTIVES`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from torchrl_grpo.loss_terms._shapes import check_same_rank

#: The cap of the unclipped log-ratio in :func:`ppo_clip_loss` (verl's): ``e^20``, about 4.9e8.
MAX_LOG_RATIO = 20.0
#: SAPO's temperatures ``(tau_pos, tau_neg)`` when none are given: the paper's and TRL's.
SAPO_TEMPERATURES = (1.0, 1.05)
#: VESPO's kernels when none are given, ``(for A >= 0, for A < 0)``: TRL's ``vespo_k_pos``,
#: ``vespo_k_neg`` and ``vespo_lambda_pos``, ``vespo_lambda_neg``.
VESPO_K = (2.0, 3.0)
VESPO_LAMBDA = (3.0, 2.0)


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
    temperature_pos: float | torch.Tensor = SAPO_TEMPERATURES[0],
    temperature_neg: float | torch.Tensor = SAPO_TEMPERATURES[1],
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
    check_same_rank("advantage", advantage, "log_ratio", log_ratio)
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
    k_pos: float = VESPO_K[0],
    lambda_pos: float = VESPO_LAMBDA[0],
    k_neg: float = VESPO_K[1],
    lambda_neg: float = VESPO_LAMBDA[1],
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
#: all ``(B, T)`` but the two clip bounds (scalars): an entry of :data:`OBJECTIVES`. (The
#: variant a loss holds is :class:`torchrl_grpo.loss.variants.Objective`.)
ObjectiveFn = Callable[
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
OBJECTIVES: dict[str, ObjectiveFn] = {
    "clip": _clip_objective,
    "cispo": cispo_loss,
    "sapo": _sapo_objective,
    "vespo": _vespo_objective,
}
