"""KL estimators (Schulman's k1, k2, k3), the importance-weighted (unbiased) KL and torchrl's KL
trust region, with their registry (:data:`KL_ESTIMATORS`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchrl_grpo.loss_terms.objectives import MAX_LOG_RATIO


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


def top_k_reverse_kl(log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
    """The student's reverse KL to the teacher at each position over the teacher's ``K`` most
    likely tokens and the rest of the vocabulary as one more outcome (``K + 1`` outcomes):

    .. math:: \\sum_{i \\le K} p_i (\\log p_i - \\log q_i) + p_r (\\log p_r - \\log q_r),
        \\qquad p_r = 1 - \\sum_{i \\le K} p_i, \\quad q_r = 1 - \\sum_{i \\le K} q_i

    with ``p`` the student's probabilities and ``q`` the teacher's at those tokens. A lower
    bound of the full ``KL(p || q)`` (merging outcomes never raises a KL), equal to it when the
    ``K`` tokens are the vocabulary; without the rest outcome the student could lower the sum by
    moving its mass off the ``K`` tokens. Differentiable in ``log_probs``; each rest mass is
    floored at ``1e-12`` (a vocabulary the ``K`` tokens cover).

    Args:
        log_probs (torch.Tensor): the student's log-probs at the teacher's tokens ``[..., K]``.
        teacher_log_probs (torch.Tensor): the teacher's ``[..., K]``, the same tokens.

    Returns:
        torch.Tensor: ``[...]`` the KL at each position.

    Examples:
        >>> import torch
        >>> p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.7, 0.1, 0.2])
        >>> full = (p * (p.log() - q.log())).sum()
        >>> torch.allclose(top_k_reverse_kl(p.log(), q.log()), full)  # K = V: the full KL
        True
        >>> bool(top_k_reverse_kl(p[:1].log(), q[:1].log()) <= full)  # {0}, {1, 2} merged
        True
    """
    if log_probs.shape != teacher_log_probs.shape:
        raise ValueError(
            f"the student's log-probs {tuple(log_probs.shape)} and the teacher's "
            f"{tuple(teacher_log_probs.shape)} differ: expected the same [..., K] tokens."
        )
    p = log_probs.exp()
    kl = (p * (log_probs - teacher_log_probs)).sum(-1)
    rest = (1 - p.sum(-1)).clamp_min(1e-12)
    teacher_rest = (1 - teacher_log_probs.exp().sum(-1)).clamp_min(1e-12)
    return kl + rest * (rest.log() - teacher_rest.log())
