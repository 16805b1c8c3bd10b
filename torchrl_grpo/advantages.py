"""Group-relative advantage estimators: pure functions on tensors.

Nothing here knows about TensorDicts, queues or keys. Samples (trajectory returns, or the reward
elements of every step) arrive as a flat tensor ``x`` of shape ``(S,)`` together with an integer
``group_index`` of shape ``(S,)`` naming the group of each sample; every reduction is a segment
reduction over that index, so a whole batch of groups is one pass.

Degenerate cases, decided once for the whole package:

* Standard deviations use Bessel's correction (``n - 1``), as ``torch.std`` and torchrl do.
* A group with a single sample has no spread: its standard deviation is taken as ``0`` (torchrl
  computes ``nan`` there) and its advantage is therefore ``0``.
* The scale is floored at ``epsilon`` (default ``1e-6``, torchrl's ``clamp_min``), never added to
  it, so a constant-reward group gets exactly zero advantages and never ``nan``.
* Arithmetic is done in float64 whatever the reward dtype (float16 and bfloat16 included), so very
  large or very small rewards neither overflow nor underflow the variance; callers cast back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "BASELINES",
    "RETURN_REDUCTIONS",
    "SCALES",
    "group_mean",
    "group_relative_advantage",
    "group_std",
    "trajectory_returns",
]


def _num_segments(index: Tensor, num: int | None) -> int:
    if num is not None:
        return int(num)
    return int(index.max()) + 1 if index.numel() else 0


def _segment_sum(x: Tensor, index: Tensor, num: int) -> Tensor:
    return torch.zeros(num, dtype=x.dtype, device=x.device).index_add_(0, index, x)


def _return_sum(x: Tensor, index: Tensor, num: int) -> Tensor:
    return _segment_sum(x, index, num)


def _return_mean(x: Tensor, index: Tensor, num: int) -> Tensor:
    count = torch.bincount(index, minlength=num).to(x.dtype)
    return _segment_sum(x, index, num) / count


def _return_max(x: Tensor, index: Tensor, num: int) -> Tensor:
    init = torch.full((num,), float("-inf"), dtype=x.dtype, device=x.device)
    return init.scatter_reduce(0, index, x, reduce="amax", include_self=True)


def _return_last(x: Tensor, index: Tensor, num: int) -> Tensor:
    position = torch.arange(x.numel(), device=x.device)
    last = torch.zeros(num, dtype=torch.long, device=x.device)
    last = last.scatter_reduce(0, index, position, reduce="amax", include_self=False)
    return x[last]


RETURN_REDUCTIONS: dict[str, Callable[[Tensor, Tensor, int], Tensor]] = {
    "sum": _return_sum,
    "mean": _return_mean,
    "max": _return_max,
    "last": _return_last,
}
"""Return reductions by name, each ``reduction(x, index, num) -> (num,)`` (a trajectory's return)."""


def trajectory_returns(
    rewards: Tensor,
    trajectory_index: Tensor,
    num_trajectories: int | None = None,
    reduction: str = "sum",
) -> Tensor:
    r"""Reduce each trajectory's rewards to one scalar return.

    ``"sum"``: :math:`R_i = \sum_t r_{i,t}`; ``"mean"``: :math:`R_i = \frac1{T_i}\sum_t r_{i,t}`;
    ``"max"``: :math:`R_i = \max_t r_{i,t}`; ``"last"``: :math:`R_i = r_{i,T_i}`, the reward of the
    trajectory's final element, as in step-wise GRPO (Trinity-RFT ``step_wise_grpo``; rLLM's
    broadcast mode), where only the final step is scored and that score is given to every step.

    Args:
        rewards: reward elements, shape ``(E,)``, in time order within each trajectory.
        trajectory_index: trajectory of each element, shape ``(E,)``, values in
            ``[0, num_trajectories)``.
        num_trajectories: number of trajectories; defaults to ``trajectory_index.max() + 1``.
        reduction: a key of :data:`RETURN_REDUCTIONS`.

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
    """
    if reduction not in RETURN_REDUCTIONS:
        raise ValueError(
            f"reduction must be one of {sorted(RETURN_REDUCTIONS)}, got {reduction!r}."
        )
    num = _num_segments(trajectory_index, num_trajectories)
    return RETURN_REDUCTIONS[reduction](rewards.double(), trajectory_index, num)


def group_mean(
    x: Tensor, group_index: Tensor, num_groups: int | None = None
) -> tuple[Tensor, Tensor]:
    r"""Per-group mean :math:`\mu_g = \frac1{n_g}\sum_{i\in g} x_i` and size :math:`n_g`.

    Args:
        x: samples, shape ``(S,)``.
        group_index: group of each sample, shape ``(S,)``.
        num_groups: number of groups; defaults to ``group_index.max() + 1``.

    Returns:
        ``(mean, count)``, each of shape ``(num_groups,)``; mean in float64 (``nan`` for an empty
        group), count in int64.

    Examples:
        >>> import torch
        >>> group_mean(torch.tensor([1.0, 3.0, 10.0]), torch.tensor([0, 0, 1]))
        (tensor([ 2., 10.], dtype=torch.float64), tensor([2, 1]))
    """
    num = _num_segments(group_index, num_groups)
    count = torch.bincount(group_index, minlength=num)
    # Sum the deviations from a member of the group (its max): exact for a constant group, where
    # sum(x) / n can round, and better conditioned whenever |mean| >> std.
    x = x.double()
    ref = _return_max(x, group_index, num)  # (G,)
    return ref + _segment_sum(x - ref[group_index], group_index, num) / count, count


def group_std(
    x: Tensor,
    group_index: Tensor,
    num_groups: int | None = None,
    *,
    mean: Tensor | None = None,
) -> Tensor:
    r"""Per-group sample standard deviation with Bessel's correction.

    :math:`\sigma_g = \sqrt{\frac{1}{n_g - 1}\sum_{i\in g}(x_i - \mu_g)^2}`, computed in two passes
    (mean, then squared deviations) in float64. A group of one sample gets ``0``, not ``nan``.

    Args:
        x: samples, shape ``(S,)``.
        group_index: group of each sample, shape ``(S,)``.
        num_groups: number of groups; defaults to ``group_index.max() + 1``.
        mean: the per-group means if already computed, shape ``(num_groups,)``.

    Returns:
        Standard deviations, shape ``(num_groups,)``, float64.

    Examples:
        >>> import torch
        >>> group_std(torch.tensor([1.0, 3.0, 10.0]), torch.tensor([0, 0, 1]))
        tensor([1.4142, 0.0000], dtype=torch.float64)
    """
    num = _num_segments(group_index, num_groups)
    x = x.double()
    count = torch.bincount(group_index, minlength=num)
    if mean is None:
        mean, _ = group_mean(x, group_index, num)
    m2 = _segment_sum((x - mean[group_index]).square(), group_index, num)
    return (m2 / (count - 1).clamp_min(1)).sqrt()


# --- baselines ----------------------------------------------------------------------------------
# Both baselines are affine in the group mean, so x_i - b_i = factor_g * (x_i - mu_g): a baseline is
# the per-group factor, and the advantage costs one pass over the samples whatever the choice.


def _mean_baseline(count: Tensor) -> Tensor:
    return torch.ones(count.shape, dtype=torch.float64)


def _leave_one_out_baseline(count: Tensor) -> Tensor:
    # x_i - (sum_g - x_i) / (n_g - 1) = n_g / (n_g - 1) * (x_i - mu_g); a group of one has no
    # "others", so its advantage is 0.
    n = count.double()
    return torch.where(n > 1, n / (n - 1).clamp_min(1), 0.0)


BASELINES: dict[str, Callable[[Tensor], Tensor]] = {
    "mean": _mean_baseline,
    "leave_one_out": _leave_one_out_baseline,
}
"""Baselines by name, each ``baseline(count) -> (G,)``, the per-group factor on ``x - mean``."""


# --- scales: the per-group value the centred samples are divided by (before the floor) ----------


def _group_scale(dev: Tensor, group_index: Tensor, mean: Tensor, count: Tensor) -> Tensor:
    m2 = _segment_sum(dev.square(), group_index, mean.numel())
    return (m2 / (count - 1).clamp_min(1)).sqrt()


def _batch_scale(dev: Tensor, group_index: Tensor, mean: Tensor, count: Tensor) -> Tensor:
    # Std of every sample: within-group squares plus between-group squares (Chan et al., 1979).
    total = int(count.sum())
    present = count > 0
    grand = (mean[present] * count[present]).sum() / max(total, 1)
    m2 = dev.square().sum() + (count[present] * (mean[present] - grand).square()).sum()
    return (m2 / max(total - 1, 1)).sqrt().expand(mean.shape)


def _no_scale(dev: Tensor, group_index: Tensor, mean: Tensor, count: Tensor) -> Tensor:
    return torch.ones_like(mean)


SCALES: dict[str, Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]] = {
    "group": _group_scale,
    "batch": _batch_scale,
    "none": _no_scale,
}
"""Scales by name, each ``scale(x - mean_g, group_index, mean, count) -> (G,)``."""


def group_relative_advantage(
    x: Tensor,
    group_index: Tensor,
    num_groups: int | None = None,
    *,
    baseline: str = "mean",
    scale_rewards: str = "group",
    epsilon: float = 1e-6,
) -> Tensor:
    r"""Group-relative advantage :math:`A_i = (x_i - b_i) / \max(s_i, \epsilon)`.

    * GRPO (Shao et al., 2024, *DeepSeekMath*, arXiv:2402.03300): ``baseline="mean"``,
      ``scale_rewards="group"``: :math:`A_i = (x_i - \mu_g)/\max(\sigma_g, \epsilon)`.
    * Dr. GRPO (Liu et al., 2025, *Understanding R1-Zero-Like Training*, arXiv:2503.20783):
      ``scale_rewards="none"``: :math:`A_i = x_i - \mu_g`, no division by the group std.
    * Batch-level std (Trinity-RFT ``std_cal_level="batch"``; Hu, *REINFORCE++*,
      arXiv:2501.03262): ``scale_rewards="batch"`` divides by the std of every sample passed in,
      while the mean stays per group.
    * RLOO (Ahmadian et al., 2024, *Back to Basics*, arXiv:2402.14740): ``baseline=
      "leave_one_out"``: :math:`b_i = \frac{1}{n_g - 1}\sum_{j\in g, j\ne i} x_j`, which equals
      :math:`\frac{n_g}{n_g-1}(x_i - \mu_g)`; combine with ``scale_rewards="none"`` for plain RLOO.

    Args:
        x: samples, shape ``(S,)``: trajectory returns, or reward elements for per-step GRPO.
        group_index: group of each sample, shape ``(S,)``, values in ``[0, num_groups)``.
        num_groups: number of groups; defaults to ``group_index.max() + 1``.
        baseline: a key of :data:`BASELINES`.
        scale_rewards: a key of :data:`SCALES`.
        epsilon: floor of the scale (``clamp_min``, as torchrl), so constant groups give ``0``.

    Returns:
        Advantages, shape ``(S,)``, float64.

    Raises:
        ValueError: for an unknown ``baseline`` or ``scale_rewards``.

    Examples:
        >>> import torch
        >>> r = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 2.0])
        >>> g = torch.tensor([0, 0, 0, 1, 1, 1])
        >>> group_relative_advantage(r, g)
        tensor([-1.1547,  0.5774,  0.5774,  0.0000,  0.0000,  0.0000], dtype=torch.float64)
        >>> group_relative_advantage(r, g, scale_rewards="none", baseline="leave_one_out")
        tensor([-1.0000,  0.5000,  0.5000,  0.0000,  0.0000,  0.0000], dtype=torch.float64)
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {sorted(BASELINES)}, got {baseline!r}.")
    if scale_rewards not in SCALES:
        raise ValueError(f"scale_rewards must be one of {sorted(SCALES)}, got {scale_rewards!r}.")
    x = x.double()
    mean, count = group_mean(x, group_index, num_groups)  # (G,), (G,)
    dev = x - mean[group_index]  # (S,)
    scale = SCALES[scale_rewards](dev, group_index, mean, count)  # (G,)
    factor = BASELINES[baseline](count) / scale.clamp_min(epsilon)  # (G,)
    return dev * factor[group_index]
