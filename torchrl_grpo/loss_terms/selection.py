"""Token and sequence selection: off-policy sequence masking, DPPO's trust regions, the veto of
mismatched sequences, the adaptive entropy coefficient and high-entropy tokens."""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchrl_grpo.loss_terms._shapes import check_same_rank, check_same_shape
from torchrl_grpo.loss_terms.aggregations import masked_mean
from torchrl_grpo.loss_terms.objectives import MAX_LOG_RATIO


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
    check_same_shape(log_prob=log_prob, sampler_log_prob=sampler_log_prob, mask=mask)
    check_same_rank("advantage", advantage, "log_prob", log_prob)
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
    check_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, mask=mask)
    check_same_rank("advantage", advantage, "log_prob", log_prob)
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
    check_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, mask=mask)
    check_same_rank("advantage", advantage, "log_prob", log_prob)
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
    check_same_shape(log_weight=log_weight, mask=mask)
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
    check_same_shape(log_weight=log_weight, mask=mask)
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
    check_same_shape(x=x, mask=mask)
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
    check_same_shape(entropy=entropy, mask=mask)
    with torch.no_grad():
        if not mask.any():
            return mask.clone()
        rho = top_quantile.double() if torch.is_tensor(top_quantile) else float(top_quantile)
        # rho read to 1e-6: a level 1 - rho that names a token exactly (up to its rounding in
        # float32 or float64) puts the threshold on that token, not just above it
        threshold = masked_quantile(entropy, mask, 1.0 - rho, whole_within=1e-6)
        return mask & (entropy >= threshold)
