"""Group-relative advantage estimators: pure functions on tensors.

Nothing here knows about TensorDicts, queues or keys. Samples (trajectory returns, or the reward
elements of every step) arrive as a flat tensor ``x`` of shape ``(S,)`` together with an integer
``group_index`` of shape ``(S,)`` naming the group of each sample, or, when the samples come in
contiguous runs that each belong to one group (a trajectory's reward elements), with the runs'
``lengths`` and one group per run (:class:`Segments`). Every reduction is a segment reduction, so
a whole batch of groups is one pass.

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
    "Segments",
    "group_mean",
    "group_relative_advantage",
    "group_std",
    "trajectory_returns",
]


def _num_segments(index: Tensor, num: int | None) -> int:
    if num is not None:
        return int(num)
    return int(index.max()) + 1 if index.numel() else 0


class Segments:
    r"""Which segment (trajectory or group) each sample belongs to, and the reductions over them.

    Two descriptions of the same mapping:

    * one index per sample: ``index`` of shape ``(S,)``, values in ``[0, num)``;
    * contiguous *runs* of samples (the reward elements of one trajectory, say): ``lengths`` of
      shape ``(R,)`` samples per run, and ``index`` of shape ``(R,)`` the segment of each run
      (``None``: run ``i`` is segment ``i``).

    Both give the same numbers. With runs, no per-sample index exists: per-sample work goes
    through segment reductions and ``repeat_interleave`` (or plain views when every run has the
    same length), which on a CPU is several times cheaper than a scatter or gather by index over
    every sample; group-level work is done once per run.

    Args:
        index: segment of each sample, or of each run when ``lengths`` is given; ``None`` with
            ``lengths`` means one segment per run.
        num: number of segments; defaults to ``index.max() + 1`` (or the number of runs).
        lengths: samples per run, shape ``(R,)``, or ``None``.
        width: with ``lengths``, the length every run has, or ``0`` if they differ, when the
            caller knows it (it is found from ``lengths`` otherwise).

    Examples:
        >>> import torch
        >>> x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
        >>> by_sample = Segments(torch.tensor([0, 0, 1, 1, 1]))
        >>> by_run = Segments(None, lengths=torch.tensor([2, 3]))
        >>> by_sample.sum(x), by_run.sum(x)
        (tensor([ 3., 12.]), tensor([ 3., 12.]))
        >>> by_run.expand(torch.tensor([10.0, 20.0]))
        tensor([10., 10., 20., 20., 20.])
    """

    def __init__(
        self,
        index: Tensor | None,
        num: int | None = None,
        lengths: Tensor | None = None,
        *,
        width: int | None = None,
    ):
        if lengths is None and index is None:
            raise ValueError("Segments needs an index, or run lengths.")
        self.lengths = lengths
        self.index = index
        self.width = 0  # runs of one common length > 0, viewed as (R, width); 0: not so
        if lengths is None:
            self.num = _num_segments(index, num)
        else:
            runs = lengths.numel()
            self.num = runs if index is None and num is None else _num_segments(index, num)
        # One segment (a lone group, say): plain reductions, no index or runs needed at all.
        self.single = self.num == 1
        if lengths is None or self.single:
            return
        # Every run of the same length: runs are the rows of a (R, L) view.
        if width is not None:
            self.width = width
        elif runs:
            shortest, longest = (int(v) for v in torch.aminmax(lengths))
            self.width = shortest if shortest == longest else 0

    @property
    def count(self) -> Tensor:
        """Samples per segment, ``(num,)`` int64."""
        if self.single:
            size = self.index.numel() if self.lengths is None else self.lengths.sum()
            return torch.as_tensor(size, dtype=torch.long).reshape(1)
        if self.lengths is None:
            return torch.bincount(self.index, minlength=self.num)
        if self.index is None:
            return self.lengths.clone()  # not the caller's tensor
        return torch.zeros(self.num, dtype=torch.long).index_add_(0, self.index, self.lengths)

    def _runs_to_segments(self, per_run: Tensor, init: Tensor, reduce: str = "sum") -> Tensor:
        if self.index is None:
            return per_run
        if reduce == "sum":
            return init.index_add_(0, self.index, per_run)
        return init.scatter_reduce(0, self.index, per_run, reduce=reduce, include_self=True)

    def view(self, x: Tensor) -> Tensor:
        """The samples as a ``(R, L)`` view when every run has length ``L``, else as they are.

        The methods below take either form, and :meth:`spread` values broadcast against it.
        """
        return x.view(-1, self.width) if self.width else x

    def spread(self, values: Tensor) -> Tensor:
        """Per-segment ``values`` made to broadcast against :meth:`view` of the samples."""
        if self.single:
            return values  # (1,)
        if self.width:
            return self._at_runs(values).unsqueeze(1)  # (R, 1)
        return self.expand(values)

    def _at_runs(self, values: Tensor) -> Tensor:
        """Per-segment values at each run, ``(R,)``."""
        return values if self.index is None else values.index_select(0, self.index)

    def _per_run(self, x: Tensor, reduce: str) -> Tensor:
        if self.width:
            rows = x.view(-1, self.width)  # (R, L)
            if reduce == "sum" and self.width < 16 and x.is_floating_point():  # faster as mat-vec
                return rows @ torch.ones(self.width, dtype=x.dtype, device=x.device)
            return rows.sum(1) if reduce == "sum" else rows.amax(1)
        x = x.reshape(-1)
        if x.numel() == 0:
            return x.new_zeros(self.lengths.shape)
        return torch.segment_reduce(x, reduce, lengths=self.lengths)

    def sum(self, x: Tensor) -> Tensor:
        """Per-segment sum of the samples ``x`` (``(S,)`` or its :meth:`view`), ``(num,)``."""
        if self.single:
            return x.sum().reshape(1)
        zeros = torch.zeros(self.num, dtype=x.dtype, device=x.device)
        if self.lengths is None:
            return zeros.index_add_(0, self.index, x)
        return self._runs_to_segments(self._per_run(x, "sum"), zeros)

    def amax(self, x: Tensor) -> Tensor:
        """Per-segment maximum, ``(num,)`` (``-inf`` for an empty segment)."""
        init = torch.full((self.num,), float("-inf"), dtype=x.dtype, device=x.device)
        if self.single:
            return x.amax().reshape(1) if x.numel() else init
        if self.lengths is None:
            return init.scatter_reduce(0, self.index, x, reduce="amax", include_self=True)
        return self._runs_to_segments(self._per_run(x, "max"), init, "amax")

    def last(self, x: Tensor) -> Tensor:
        """Each segment's last sample in the order of ``x``, ``(num,)``."""
        if self.single:
            return x.reshape(-1)[-1:]
        if self.lengths is None:
            position = torch.arange(x.numel(), device=x.device)
            last = torch.zeros(self.num, dtype=torch.long, device=x.device)
            last = last.scatter_reduce(0, self.index, position, reduce="amax", include_self=False)
            return x[last]
        x = x.reshape(-1)
        ends = torch.cumsum(self.lengths, 0) - 1  # (R,) last sample of each run
        if self.index is None:
            return x[ends]
        last = torch.zeros(self.num, dtype=torch.long, device=x.device)
        return x[last.scatter_reduce(0, self.index, ends, reduce="amax", include_self=False)]

    def member(self, x: Tensor) -> Tensor:
        """One sample of each segment, ``(num,)``: its maximum, or with runs the largest first
        sample of its runs (no pass over every sample)."""
        if self.single and x.numel():
            return x.reshape(-1)[:1]
        if self.lengths is None or self.single:
            return self.amax(x)
        if self.width:
            firsts = x.view(-1, self.width)[:, 0]  # (R,)
        else:
            firsts = x.reshape(-1)[torch.cumsum(self.lengths, 0) - self.lengths]  # (R,)
        init = torch.full((self.num,), float("-inf"), dtype=x.dtype, device=x.device)
        return self._runs_to_segments(firsts, init, "amax")

    def expand(self, values: Tensor) -> Tensor:
        """Per-segment ``values`` (``(num,)``) repeated for every sample, shape ``(S,)``."""
        if self.single:
            size = self.index.numel() if self.lengths is None else int(self.lengths.sum())
            return values.repeat(size)
        if self.lengths is None:
            return values.index_select(0, self.index)
        per_run = self._at_runs(values)  # (R,)
        if self.width:
            return per_run.unsqueeze(1).expand(-1, self.width).reshape(-1)
        return per_run.repeat_interleave(self.lengths)


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
    # Sum the deviations from a member of the group: exact for a constant group, where
    # sum(x) / n can round, and better conditioned whenever |mean| >> std.
    ref = seg.member(x)  # (G,)
    return ref + seg.sum(x - seg.spread(ref)) / count, count


def group_std(
    x: Tensor,
    group_index: Tensor,
    num_groups: int | None = None,
    *,
    mean: Tensor | None = None,
    lengths: Tensor | None = None,
) -> Tensor:
    r"""Per-group sample standard deviation with Bessel's correction.

    :math:`\sigma_g = \sqrt{\frac{1}{n_g - 1}\sum_{i\in g}(x_i - \mu_g)^2}`, computed in two passes
    (mean, then squared deviations) in float64. A group of one sample gets ``0``, not ``nan``.

    Args:
        x: samples, shape ``(S,)``.
        group_index: group of each sample, shape ``(S,)``.
        num_groups: number of groups; defaults to ``group_index.max() + 1``.
        mean: the per-group means if already computed, shape ``(num_groups,)``.
        lengths: samples per run, as in :func:`group_mean`.

    Returns:
        Standard deviations, shape ``(num_groups,)``, float64.

    Examples:
        >>> import torch
        >>> group_std(torch.tensor([1.0, 3.0, 10.0]), torch.tensor([0, 0, 1]))
        tensor([1.4142, 0.0000], dtype=torch.float64)
    """
    seg = Segments(group_index, num_groups, lengths)
    x = seg.view(x.double())
    mean, count = _mean(x, seg) if mean is None else (mean, seg.count)
    return _group_scale(x - seg.spread(mean), seg, mean, count)


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


def _group_scale(dev: Tensor, seg: Segments, mean: Tensor, count: Tensor) -> Tensor:
    m2 = seg.sum(dev.square())  # (G,)
    return (m2 / (count - 1).clamp_min(1)).sqrt()


def _batch_scale(dev: Tensor, seg: Segments, mean: Tensor, count: Tensor) -> Tensor:
    # Std of every sample: within-group squares plus between-group squares (Chan et al., 1979).
    total = int(count.sum())
    present = count > 0
    grand = (mean[present] * count[present]).sum() / max(total, 1)
    m2 = dev.square().sum() + (count[present] * (mean[present] - grand).square()).sum()
    return (m2 / max(total - 1, 1)).sqrt().expand(mean.shape)


def _no_scale(dev: Tensor, seg: Segments, mean: Tensor, count: Tensor) -> Tensor:
    return torch.ones_like(mean)


SCALES: dict[str, Callable[[Tensor, Segments, Tensor, Tensor], Tensor]] = {
    "group": _group_scale,
    "batch": _batch_scale,
    "none": _no_scale,
}
"""Scales by name, each ``scale(x - mean_g, segments, mean, count) -> (G,)``."""


def group_relative_advantage(
    x: Tensor,
    group_index: Tensor,
    num_groups: int | None = None,
    *,
    baseline: str = "mean",
    scale_rewards: str = "group",
    epsilon: float = 1e-6,
    lengths: Tensor | None = None,
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
        lengths: samples per run, shape ``(R,)``, when ``x`` is made of contiguous runs that each
            belong to one group; ``group_index`` then has shape ``(R,)``. Same result as the
            per-sample index ``group_index.repeat_interleave(lengths)``, computed faster (per-step
            GRPO: the runs are the trajectories, the samples their reward elements).

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
    seg = Segments(group_index, num_groups, lengths)
    x = seg.view(x.double())  # (S,), or (R, L) when all runs have length L
    mean, count = _mean(x, seg)  # (G,), (G,)
    dev = x - seg.spread(mean)
    scale = SCALES[scale_rewards](dev, seg, mean, count)  # (G,)
    factor = BASELINES[baseline](count) / scale.clamp_min(epsilon)  # (G,)
    return (dev * seg.spread(factor)).reshape(-1)
