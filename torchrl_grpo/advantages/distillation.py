"""On-policy distillation: a teacher's log-probs on the student's own tokens as a per-token
advantage, alone or added to the group's.

The student samples, a teacher scores the sampled tokens, and the per-token reverse KL between
them becomes the advantage of a policy-gradient step (Agarwal et al., 2024, arXiv:2306.13649;
Thinking Machines' "On-Policy Distillation", 2025; Qwen3, 2025; MOPD, arXiv:2601.02780):

.. math::

    A_t = \\alpha\\, A^{group} - \\beta\\, D_t, \\qquad
    D_t = \\sum_{k \\ge t} \\gamma^{p_k - p_t}\\, \\big(\\log \\pi_{old}(y_k)
          - \\log \\pi_T(y_k)\\big)

over the response tokens ``y_t`` of a trajectory, ``p_t`` their positions. ``alpha = 0`` is pure
distillation (no reward), ``alpha = 1, beta > 0`` GRPO with a teacher, ``gamma = 0`` (the
default of Tinker's ``kl_discount_factor``) the token's own reverse KL, ``gamma = 1`` the whole
future's (the gradient of the sequence's reverse KL).

The advantage is not torchrl's ``DistillationLoss`` (``kl_direction="reverse"``), a loss on the
k3 estimate ``pi_T / pi - 1 - log(pi_T / pi)``: that loss is :class:`~torchrl_grpo.GRPOLoss`'s
``KLToReference`` with the teacher as the reference (unclamped k3; ``seq_mean_token_mean`` for
its ``normalize_by_seq_length=True``), the same value and gradient. On the student's samples at
ratio 1 the advantage form's gradient per token is ``beta (log pi - log pi_T) grad log pi`` (the
score function of the reverse KL; with ``gamma = 1`` of the sequence's), torchrl's is
``(1 - pi_T / pi) grad log pi`` (the k3 path derivative, the forward KL's gradient in
expectation): equal to first order in ``log pi - log pi_T``, apart beyond it.

Four functions, on flat tensors of real tokens (padding never enters): :func:`token_reverse_kl`,
:func:`future_reverse_kl`, :func:`distillation_advantage` and :func:`distillation_metrics`.
The transform that reads them from torchrl's LLM rows is
:mod:`torchrl_grpo.mcadvantage.distillation`.

Degenerate cases, decided here:

* A token the teacher finds likelier than the student has a negative reverse KL and a positive
  advantage: the estimate is Schulman's k1, unbiased on the student's own samples, not clamped.
* A trajectory's future sum stops at its end; a sequence or trajectory without a real token
  sums to ``0``; the metrics of no token are ``0``, and a spread of fewer than two samples is
  ``0`` (Bessel's correction otherwise, as the rest of the package).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torchrl_grpo._segments import Segments
from torchrl_grpo.advantages.returns import _check_samples
from torchrl_grpo.advantages.step_groups import discounted_returns

__all__ = [
    "distillation_advantage",
    "group_mean_baseline",
    "distillation_metrics",
    "future_reverse_kl",
    "token_reverse_kl",
]


def token_reverse_kl(log_prob: Tensor, teacher_log_prob: Tensor) -> Tensor:
    """The per-token reverse KL of the student to the teacher on the student's own tokens.

    .. math:: d_t = \\log \\pi_{old}(y_t) - \\log \\pi_T(y_t)

    Schulman's k1 estimate of :math:`KL(\\pi_{old} \\| \\pi_T)` (unbiased when ``y_t`` is sampled
    from :math:`\\pi_{old}`); Tinker's ``reverse_kl``, minus Trinity-RFT's and NeMo-RL's
    advantage. Computed in float64.

    Args:
        log_prob: the sampling policy's log-probs of the tokens, any shape.
        teacher_log_prob: the teacher's log-probs of the same tokens, same shape.

    Returns:
        ``d``, same shape, float64.

    Raises:
        ValueError: the shapes differ.

    Examples:
        >>> import torch
        >>> token_reverse_kl(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]))
        tensor([ 0.5000, -1.0000], dtype=torch.float64)
    """
    if log_prob.shape != teacher_log_prob.shape:
        raise ValueError(
            f"log_prob and teacher_log_prob must have one shape, got {tuple(log_prob.shape)} "
            f"and {tuple(teacher_log_prob.shape)}."
        )
    return log_prob.double() - teacher_log_prob.double()


def future_reverse_kl(
    kl: Tensor, lengths: Tensor, gamma: float, *, positions: Tensor | None = None
) -> Tensor:
    """Each token's reverse KL with the discounted reverse KL of the tokens after it.

    .. math:: D_t = \\sum_{k \\ge t} \\gamma^{p_k - p_t}\\, d_k

    within its trajectory (Tinker's ``kl_discount_factor``, the discounted future sum of the
    per-token penalty). ``p`` are the tokens' positions: consecutive by default; a dialog's
    response tokens give their positions in the dialog, so that the environment's tokens between
    two turns count in the discount as in Tinker's concatenated sequence (they carry no KL).

    Args:
        kl: ``d``, shape ``(S,)``, trajectory after trajectory, in order.
        lengths: tokens per trajectory, shape ``(n,)``, summing to ``S``.
        gamma: the discount, in ``[0, 1]``; ``0`` returns ``d`` itself.
        positions: ``p``, shape ``(S,)``, integers increasing within each trajectory; ``None``:
            ``0, 1, 2, ...`` in each.

    Returns:
        ``D``, shape ``(S,)``, float64.

    Raises:
        ValueError: mismatched shapes, ``gamma`` outside ``[0, 1]``, or positions that do not
            increase within a trajectory (the first such trajectory named).

    Examples:
        >>> import torch
        >>> kl, lengths = torch.tensor([1.0, 1.0, 2.0]), torch.tensor([2, 1])
        >>> future_reverse_kl(kl, lengths, 0.5)
        tensor([1.5000, 1.0000, 2.0000], dtype=torch.float64)
        >>> future_reverse_kl(kl, lengths, 0.5, positions=torch.tensor([0, 2, 5]))  # a gap of 1
        tensor([1.2500, 1.0000, 2.0000], dtype=torch.float64)
    """
    _check_samples("kl", kl)
    if positions is None or gamma == 0.0:
        return discounted_returns(kl, lengths, gamma)
    if positions.shape != kl.shape:
        raise ValueError(
            f"positions must have the shape of kl, {tuple(kl.shape)}, got {tuple(positions.shape)}."
        )
    if kl.numel() == 0:
        return kl.double().clone()
    trajectory = torch.arange(lengths.numel()).repeat_interleave(lengths, output_size=kl.numel())
    inside = trajectory[1:] == trajectory[:-1]  # (S - 1,) consecutive tokens of one trajectory
    backwards = inside & (torch.diff(positions) <= 0)
    starts = torch.cumsum(lengths, 0) - lengths  # (n,)
    first = positions[starts.clamp_max(kl.numel() - 1)]  # (n,) (an empty run's: unused)
    last = positions[(starts + lengths - 1).clamp_min(0)]
    spans = torch.where(lengths > 0, last - first + 1, 0)  # (n,) positions each covers
    bad, total = torch.stack([backwards.any().long(), spans.sum()]).tolist()
    if bad:
        where = int(trajectory[1:][backwards][0])
        raise ValueError(
            f"positions must increase within each trajectory; trajectory {where}'s do not."
        )
    offsets = torch.cumsum(spans, 0) - spans
    slot = (offsets - first)[trajectory] + positions  # (S,) each token in a zero-filled table
    table = kl.double().new_zeros(total)
    table[slot] = kl.double()
    return discounted_returns(table, spans, gamma)[slot]


def group_mean_baseline(reverse_kl: Tensor, group: Tensor, num_groups: int) -> Tensor:
    """Each token's baseline: the mean of ``D`` over the response tokens of its group.

    .. math:: b_t = \\frac{1}{|g(t)|} \\sum_{k \\in g(t)} D_k

    Subtracted from ``D_t`` (``Distillation(baseline=True)``), it centres the teacher's term in
    every group, as GRPO centres the rewards: the policy gradient's expectation is unchanged up
    to the token's own share of the mean (``1 / |g|``, as GRPO's group mean), its variance much
    smaller. Without it every advantage of a student far from its teacher is negative (the reverse
    KL is at least 0 on average), and each step pushes down every sampled token, moving their
    mass to tokens nobody sampled, which the teacher may like less: on the digit-sum example one
    epoch over a batch raised the exact reverse KL on that batch's own tokens (1.81 to 1.96) where
    the centred advantage lowered it (1.81 to 1.78, 1.63 after three).

    Args:
        reverse_kl: ``D``, shape ``(S,)``.
        group: each token's group, shape ``(S,)``, integers in ``[0, num_groups)``.
        num_groups: the number of groups.

    Returns:
        ``b``, shape ``(S,)``, float64 (a group without a token has no mean to read).

    Examples:
        >>> import torch
        >>> group_mean_baseline(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 1]), 2)
        tensor([2., 2., 5.], dtype=torch.float64)
    """
    if group.shape != reverse_kl.shape:
        raise ValueError(
            f"group must have the shape of reverse_kl, {tuple(reverse_kl.shape)}, got "
            f"{tuple(group.shape)}."
        )
    d = reverse_kl.double()
    sums = d.new_zeros(num_groups).index_add_(0, group, d)  # (G,)
    counts = d.new_zeros(num_groups).index_add_(0, group, torch.ones_like(d))
    return (sums / counts.clamp_min(1.0))[group]


def distillation_advantage(
    reverse_kl: Tensor,
    *,
    beta: float,
    alpha: float = 0.0,
    group_advantage: Tensor | None = None,
    baseline: Tensor | None = None,
) -> Tensor:
    """The distillation advantage of every token: ``A_t = alpha * A_group - beta * (D_t - b_t)``.

    ``D_t`` is :func:`token_reverse_kl` or :func:`future_reverse_kl`, ``A_group`` the
    group-relative advantage of the token's trajectory (or turn) spread on its tokens. ``alpha =
    0``: pure on-policy distillation (Trinity-RFT's ``on_policy_distill`` with ``kl_coef = beta``,
    NeMo-RL's ``opd`` with ``beta = 1``); ``alpha = 1``: Tinker's ``incorporate_kl_penalty``
    (``kl_penalty_coef = beta``) added to the group's advantage.

    Args:
        reverse_kl: ``D``, shape ``(S,)``.
        beta: the teacher's weight, finite and at least ``0``.
        alpha: the group advantage's weight, finite and at least ``0``. Defaults to ``0``.
        group_advantage: ``A_group``, shape ``(S,)``; needed when ``alpha`` is not ``0``.
        baseline: ``b``, shape ``(S,)`` (:func:`group_mean_baseline`); ``None``: ``0``, the
            peers' form.

    Returns:
        ``A``, shape ``(S,)``, float64.

    Raises:
        ValueError: ``beta`` or ``alpha`` negative or not finite, or ``group_advantage``
            missing or of another shape.

    Examples:
        >>> import torch
        >>> kl = torch.tensor([0.5, -1.0])
        >>> distillation_advantage(kl, beta=2.0)
        tensor([-1.,  2.], dtype=torch.float64)
        >>> distillation_advantage(kl, beta=2.0, alpha=1.0, group_advantage=torch.ones(2))
        tensor([0., 3.], dtype=torch.float64)
        >>> distillation_advantage(kl, beta=2.0, baseline=torch.full((2,), -0.25))  # centred
        tensor([-1.5000,  1.5000], dtype=torch.float64)
    """
    check_weights(alpha, beta)
    d = reverse_kl.double()
    if baseline is not None:
        if baseline.shape != reverse_kl.shape:
            raise ValueError(
                f"baseline must have the shape of reverse_kl, {tuple(reverse_kl.shape)}, got "
                f"{tuple(baseline.shape)}."
            )
        d = d - baseline.double()
    adv = -float(beta) * d
    if alpha == 0.0:
        return adv
    if group_advantage is None or group_advantage.shape != reverse_kl.shape:
        shape = None if group_advantage is None else tuple(group_advantage.shape)
        raise ValueError(
            f"alpha={alpha} needs group_advantage of the shape of reverse_kl, "
            f"{tuple(reverse_kl.shape)}; got {shape}."
        )
    return adv + float(alpha) * group_advantage.double()


def check_weights(alpha: float, beta: float) -> None:
    """Raise unless ``beta`` and ``alpha`` are finite and at least ``0``.

    Examples:
        >>> check_weights(1.0, -0.5)
        Traceback (most recent call last):
        ...
        ValueError: beta must be finite and at least 0, got -0.5.
    """
    if not (_finite(beta) and beta >= 0.0):
        raise ValueError(f"beta must be finite and at least 0, got {beta!r}.")
    if not (_finite(alpha) and alpha >= 0.0):
        raise ValueError(f"alpha must be finite and at least 0, got {alpha!r}.")


def _finite(value) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def distillation_metrics(
    log_prob: Tensor,
    teacher_log_prob: Tensor,
    lengths: Tensor,
    *,
    trajectory_lengths: Tensor | None = None,
) -> dict[str, Tensor]:
    """How far the student is from the teacher, on the real tokens of some sequences.

    * ``kl_token_mean``, ``kl_token_std``: the per-token reverse KL ``d_t``
      (:func:`token_reverse_kl`) over every token (Tinker's ``teacher_kl``, NeMo-RL's
      ``teacher_student_logprob_gap_mean`` negated);
    * ``kl_sequence_mean``, ``kl_sequence_std``: each sequence's sum of ``d_t`` (a turn's
      response; Trinity-RFT's ``kl/mean`` and ``kl/std``);
    * ``kl_trajectory_mean``, ``kl_trajectory_std``: each trajectory's sum (its turns' sums;
      Trinity-RFT's multi-turn ``kl/trajectory_mean``), with ``trajectory_lengths``;
    * ``teacher_more_likely``: the share of tokens the teacher gives a higher log-prob.

    Every spread is a Bessel-corrected std (Trinity-RFT's trajectory std divides by ``n``).

    Args:
        log_prob: the student's log-probs of the real tokens, shape ``(S,)``, sequence after
            sequence.
        teacher_log_prob: the teacher's, same shape.
        lengths: tokens per sequence, shape ``(m,)``, summing to ``S``.
        trajectory_lengths: sequences per trajectory, shape ``(n,)``, summing to ``m``; ``None``:
            no trajectory statistics.

    Returns:
        ``{name: 0-d float64 tensor}``, nothing read on the host.

    Examples:
        >>> import torch
        >>> m = distillation_metrics(torch.tensor([-1.0, -1.0, -3.0]), torch.tensor(
        ...     [-2.0, -1.0, -1.0]), torch.tensor([2, 1]), trajectory_lengths=torch.tensor([2]))
        >>> {k: round(float(v), 4) for k, v in m.items()}  # doctest: +NORMALIZE_WHITESPACE
        {'kl_token_mean': -0.3333, 'kl_token_std': 1.5275, 'kl_sequence_mean': -0.5,
         'kl_sequence_std': 2.1213, 'teacher_more_likely': 0.3333, 'kl_trajectory_mean': -1.0,
         'kl_trajectory_std': 0.0}
    """
    d = token_reverse_kl(log_prob, teacher_log_prob)  # (S,)
    per_sequence = Segments(None, lengths=lengths).sum(d) if lengths.numel() else d[:0]
    metrics = {
        "kl_token_mean": _mean(d),
        "kl_token_std": _std(d),
        "kl_sequence_mean": _mean(per_sequence),
        "kl_sequence_std": _std(per_sequence),
        "teacher_more_likely": _mean((teacher_log_prob > log_prob).double()),
    }
    if trajectory_lengths is not None:
        per_trajectory = Segments(None, lengths=trajectory_lengths).sum(per_sequence)
        metrics["kl_trajectory_mean"] = _mean(per_trajectory)
        metrics["kl_trajectory_std"] = _std(per_trajectory)
    return metrics


def _mean(x: Tensor) -> Tensor:
    """The mean of ``x`` (``0`` for no sample)."""
    return x.sum() / max(x.numel(), 1)


def _std(x: Tensor) -> Tensor:
    """The Bessel-corrected std of ``x`` (``0`` for fewer than two samples)."""
    return x.std() if x.numel() > 1 else x.new_zeros(())
