"""Trajectory returns and the per-group statistics (mean, Bessel-corrected std) every estimator
builds on, as segment reductions over a flat batch of groups."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from torchrl_grpo._segments import Segments


def _check_samples(name: str, x: Tensor) -> None:
    if x.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional (S,), got shape {tuple(x.shape)}.")


def _check_index(x: Tensor, group_index: Tensor, lengths: Tensor | None) -> None:
    """``group_index`` has one entry per sample, or per run with ``lengths``."""
    if lengths is None:
        if group_index.shape != x.shape:
            raise ValueError(
                f"group_index must have one entry per sample, shape {tuple(x.shape)}, got "
                f"{tuple(group_index.shape)}."
            )
    elif lengths.ndim != 1 or group_index.shape != lengths.shape:
        raise ValueError(
            f"with lengths, group_index needs one entry per run: lengths has shape "
            f"{tuple(lengths.shape)}, group_index {tuple(group_index.shape)}."
        )


def _return_sum(x: Tensor, seg: Segments) -> Tensor:
    return seg.sum(x)


def _return_mean(x: Tensor, seg: Segments) -> Tensor:
    return seg.sum(x) / seg.count.to(x.dtype)


def _return_max(x: Tensor, seg: Segments) -> Tensor:
    return seg.amax(x)


def _return_last(x: Tensor, seg: Segments) -> Tensor:
    return seg.last(x)


RETURN_REDUCTIONS: dict[str, Callable[[Tensor, Segments], Tensor]] = {
    "sum": _return_sum,
    "mean": _return_mean,
    "max": _return_max,
    "last": _return_last,
}
"""Return reductions by name, each ``reduction(x, segments) -> (num,)`` (a trajectory's return)."""


def trajectory_returns(
    rewards: Tensor,
    trajectory_index: Tensor | None,
    num_trajectories: int | None = None,
    reduction: str = "sum",
    *,
    lengths: Tensor | None = None,
) -> Tensor:
    r"""Reduce each trajectory's rewards to one scalar return.

    ``"sum"``: :math:`R_i = \sum_t r_{i,t}`; ``"mean"``: :math:`R_i = \frac1{T_i}\sum_t r_{i,t}`;
    ``"max"``: :math:`R_i = \max_t r_{i,t}`; ``"last"``: :math:`R_i = r_{i,T_i}`, the reward of the
    trajectory's final element, as in step-wise GRPO (Trinity-RFT ``step_wise_grpo``; rLLM's
    broadcast mode), where only the final step is scored and that score is given to every step.

    Args:
        rewards: reward elements, shape ``(E,)``, in time order within each trajectory.
        trajectory_index: trajectory of each element, shape ``(E,)``, values in
            ``[0, num_trajectories)``; or ``None`` with ``lengths``.
        num_trajectories: number of trajectories; defaults to ``trajectory_index.max() + 1``.
        reduction: a key of :data:`RETURN_REDUCTIONS`.
        lengths: elements per trajectory, shape ``(n,)``, when each trajectory's elements are
            contiguous in ``rewards`` (the faster description; see :class:`Segments`).

    Returns:
        The returns, shape ``(num_trajectories,)``, in float64.

    Raises:
        ValueError: for an unknown ``reduction``.

    Examples:
        >>> import torch
        >>> r = torch.tensor([0.0, 1.0, 2.0, 5.0])
        >>> traj = torch.tensor([0, 0, 0, 1])
        >>> trajectory_returns(r, traj, reduction="sum")
        tensor([3., 5.], dtype=torch.float64)
        >>> trajectory_returns(r, traj, reduction="last")
        tensor([2., 5.], dtype=torch.float64)
        >>> trajectory_returns(r, None, reduction="mean", lengths=torch.tensor([3, 1]))
        tensor([1., 5.], dtype=torch.float64)
    """
    if reduction not in RETURN_REDUCTIONS:
        raise ValueError(
            f"reduction must be one of {sorted(RETURN_REDUCTIONS)}, got {reduction!r}."
        )
    seg = Segments(trajectory_index, num_trajectories, lengths)
    return RETURN_REDUCTIONS[reduction](rewards.double(), seg)


def group_mean(
    x: Tensor,
    group_index: Tensor,
    num_groups: int | None = None,
    *,
    lengths: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Per-group mean :math:`\mu_g = \frac1{n_g}\sum_{i\in g} x_i` and size :math:`n_g`.

    Args:
        x: samples, shape ``(S,)``.
        group_index: group of each sample, shape ``(S,)``; with ``lengths``, group of each run.
        num_groups: number of groups; defaults to ``group_index.max() + 1``.
        lengths: samples per run, shape ``(R,)``, when ``x`` is made of contiguous runs that each
            belong to one group (the reward elements of one trajectory); see :class:`Segments`.

    Returns:
        ``(mean, count)``, each of shape ``(num_groups,)``; mean in float64 (``nan`` for an empty
        group), count in int64.

    Examples:
        >>> import torch
        >>> group_mean(torch.tensor([1.0, 3.0, 10.0]), torch.tensor([0, 0, 1]))
        (tensor([ 2., 10.], dtype=torch.float64), tensor([2, 1]))
    """
    seg = Segments(group_index, num_groups, lengths)
    return _mean(seg.view(x.double()), seg)


def _mean(x: Tensor, seg: Segments) -> tuple[Tensor, Tensor]:
    """Group means and sizes of samples ``x`` (given as ``seg.view(x)``)."""
    count = seg.count  # (G,)
    # Sum the deviations from a reference close to the mean: exact for a constant group, where
    # sum(x) / n can round, and better conditioned whenever |mean| >> std. With runs the
    # reference is a member (a run's first sample: no pass over the samples); with an index, the
    # rounded mean itself (a sum is cheaper than a maximum by index), which is corrected to the
    # same effect: for a constant group each x - ref is the same small multiple of the ulp, summed
    # and divided exactly, so that ref + correction is the constant (the corrected two-pass
    # algorithm; Chan, Golub and LeVeque, 1983).
    if seg.lengths is None and not seg.single:
        ref = seg.sum(x) / count  # (G,)
    else:
        ref = seg.member(x)  # (G,)
    return ref + seg.sum(x - seg.spread(ref)) / count, count


def batch_whiten(x: Tensor, *, weights: Tensor | None = None, epsilon: float = 1e-6) -> Tensor:
    r"""Whiten over the whole batch: :math:`(x_i - m) / \max(s, \epsilon)`.

    :math:`m` and :math:`s` are the mean and the sample standard deviation (Bessel's correction)
    of every sample, each counted ``weights[i]`` times: :math:`m = \sum_i w_i x_i / W` and
    :math:`s^2 = \sum_i w_i (x_i - m)^2 / (W - 1)` with :math:`W = \sum_i w_i` (frequency
    weights: the result equals whitening the samples repeated ``w_i`` times). Fewer than two
    samples' worth (:math:`W \le 1`) has no spread: :math:`s = 0`.

    This is the last step of REINFORCE++ (Hu, 2025, arXiv:2501.03262) and of GDPO (Liu et al.,
    2026, arXiv:2601.05242). verl (``masked_whiten``) and OpenRLHF whiten over every token of the
    batch, so that a response counts once per token: pass its token count as its weight to do
    the same.

    Args:
        x: samples, shape ``(S,)``.
        weights: how many times each sample counts, shape ``(S,)``, non-negative; ``None``: once.
        epsilon: floor of the std.

    Returns:
        The whitened samples, shape ``(S,)``, float64.

    Raises:
        ValueError: if ``x`` is not one-dimensional, or ``weights`` has another shape.

    Examples:
        >>> import torch
        >>> batch_whiten(torch.tensor([1.0, 2.0, 3.0]))
        tensor([-1.,  0.,  1.], dtype=torch.float64)
        >>> batch_whiten(torch.tensor([1.0, 3.0]), weights=torch.tensor([3.0, 1.0]))
        tensor([-0.5000,  1.5000], dtype=torch.float64)
    """
    _check_samples("x", x)
    x = x.double()
    if weights is None:
        total = float(x.numel())
        ref = x[:1]  # deviations from a member: exact for a constant batch (see _mean)
        mean = ref + (x - ref).mean() if x.numel() else x.new_zeros(1)
        dev = x - mean
        m2 = dev.square().sum()
    else:
        if weights.shape != x.shape:
            raise ValueError(
                f"weights must have the shape of x, {tuple(x.shape)}, got {tuple(weights.shape)}."
            )
        w = weights.double()
        total = float(w.sum())
        ref = x[:1]
        mean = ref + (w * (x - ref)).sum() / max(total, 1e-300)
        dev = x - mean
        m2 = (w * dev.square()).sum()
    std = (m2 / (total - 1)).sqrt() if total > 1 else m2.new_zeros(())
    return dev / std.clamp_min(epsilon)
