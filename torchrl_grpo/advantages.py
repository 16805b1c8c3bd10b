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

And for the estimators beyond GRPO's mean and std:

* **Whitening** over a batch (REINFORCE++-baseline, GDPO's last step) follows the same rules: the
  batch std has Bessel's correction, a batch of one sample has std ``0``, and the std is floored at
  ``epsilon``; so a batch whose centred values are all equal whitens to exactly zero. verl and
  OpenRLHF add ``1e-8`` to the variance and TRL ``1e-4`` to the std instead: the results agree to
  about that constant over the std.
* **Pass@k** needs a runner-up: a group of one sample gets ``0`` (verl raises), and a tie for the
  best gives every member ``0``: the best minus the best of the others is then ``0`` for each of
  the tied samples, as in verl, where ``topk`` picks one of them and gives it ``r_max -
  r_second_max = 0``.
* **Several rewards** (GDPO) are normalized one at a time by the rules above; a reward that is
  constant within a group contributes ``0`` to that group, never ``nan``.
* **Step groups** (GiGPO) of one step have no peer: their step-level advantage is ``0``, as in
  verl-agent and ROLL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from torchrl_grpo._segments import Segments, dense_codes, discounted_suffix_sum

__all__ = [
    "BASELINES",
    "RETURN_REDUCTIONS",
    "SCALES",
    "Scale",
    "Segments",
    "anchor_step_groups",
    "batch_whiten",
    "discounted_returns",
    "gigpo_advantage",
    "group_mean",
    "group_relative_advantage",
    "group_std",
    "multi_reward_advantage",
    "pass_at_k_advantage",
    "reinforce_pp_baseline_advantage",
    "step_level_advantage",
    "trajectory_returns",
]


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


def group_std(
    x: Tensor,
    group_index: Tensor,
    num_groups: int | None = None,
    *,
    mean: Tensor | None = None,
    lengths: Tensor | None = None,
    by_time_step: bool = False,
) -> Tensor:
    r"""Per-group sample standard deviation with Bessel's correction.

    :math:`\sigma_g = \sqrt{\frac{1}{n_g - 1}\sum_{i\in g}(x_i - \mu_g)^2}`, computed in two passes
    (mean, then squared deviations) in float64. A group of one sample gets ``0``, not ``nan``.
    With ``by_time_step``, the pooled spread around each time step's mean instead (the scale of
    :func:`group_relative_advantage` with ``by_time_step=True``): ``0`` exactly when, at every
    time step, the group's samples are equal.

    Args:
        x: samples, shape ``(S,)``.
        group_index: group of each sample, shape ``(S,)``.
        num_groups: number of groups; defaults to ``group_index.max() + 1``.
        mean: the per-group means if already computed, shape ``(num_groups,)``.
        lengths: samples per run, as in :func:`group_mean`.
        by_time_step: the runs are trajectories in time order (``lengths`` required); see
            :func:`group_relative_advantage`. ``mean`` is then ignored.

    Returns:
        Standard deviations, shape ``(num_groups,)``, float64.

    Examples:
        >>> import torch
        >>> group_std(torch.tensor([1.0, 3.0, 10.0]), torch.tensor([0, 0, 1]))
        tensor([1.4142, 0.0000], dtype=torch.float64)
        >>> x = torch.tensor([3.0, 2.0, 1.0, 3.0, 2.0, 1.0])  # two equal runs of one group
        >>> group_std(x, torch.tensor([0, 0]), lengths=torch.tensor([3, 3]), by_time_step=True)
        tensor([0.], dtype=torch.float64)
    """
    seg = Segments(group_index, num_groups, lengths)
    if by_time_step:
        steps = _time_steps(seg)
        x = x.double().reshape(-1)
        mean, _ = _mean(x, steps.cells)
        return steps.scale("group", x - steps.cells.spread(mean), seg)
    x = seg.view(x.double())
    mean, count = _mean(x, seg) if mean is None else (mean, seg.count)
    return _group_scale(x - seg.spread(mean), seg, mean, count)


# --- baselines ----------------------------------------------------------------------------------
# A baseline gives x_i - b_i as centred_i * factor_g: the mean and leave-one-out baselines are
# affine in the group mean (centred = x - mu_g, the deviations already at hand), pass@k is an
# indicator of the group's best times the gap to the runner-up. The advantage is then one pass over
# the samples.


def _mean_baseline(x: Tensor, dev: Tensor, seg: Segments, count: Tensor) -> tuple[Tensor, Tensor]:
    return dev, torch.ones(count.shape, dtype=torch.float64, device=dev.device)


def _leave_one_out_baseline(
    x: Tensor, dev: Tensor, seg: Segments, count: Tensor
) -> tuple[Tensor, Tensor]:
    # x_i - (sum_g - x_i) / (n_g - 1) = n_g / (n_g - 1) * (x_i - mu_g); a group of one has no
    # "others", so its advantage is 0.
    n = count.double()
    return dev, torch.where(n > 1, n / (n - 1).clamp_min(1), 0.0)


def _pass_at_k_baseline(
    x: Tensor, dev: Tensor, seg: Segments, count: Tensor
) -> tuple[Tensor, Tensor]:
    # max_g - max_{j != i} x_j: the gap to the runner-up for the unique best, 0 for everyone else
    # (the others' maximum is the group's); 0 for a tie at the top and for a group of one.
    top = seg.amax(x)  # (G,)
    is_top = x == seg.spread(top)  # (S,) or its view
    ties = seg.sum(is_top.double())  # (G,) samples at the maximum
    runner_up = seg.amax(x.masked_fill(is_top, float("-inf")))  # (G,) -inf if all tie
    gap = torch.where((ties == 1) & (count > 1), top - runner_up, 0.0)  # (G,)
    return is_top.double(), gap


BASELINES: dict[str, Callable[[Tensor, Tensor, Segments, Tensor], tuple[Tensor, Tensor]]] = {
    "mean": _mean_baseline,
    "leave_one_out": _leave_one_out_baseline,
    "pass_at_k": _pass_at_k_baseline,
}
"""Baselines by name, each ``baseline(x, x - mean_g, segments, count) -> (centred, factor)`` with
``x_i - b_i = centred_i * factor_g``: ``centred`` has the samples' shape, ``factor`` is ``(G,)``."""


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


# the same, pooled over each group's time-step cells: from each group's squared deviations from
# its cells' means ``m2`` and its degrees of freedom ``dof`` (samples less cells), both (G,)


def _group_pooled(m2: Tensor, dof: Tensor) -> Tensor:
    return (m2 / dof.clamp_min(1)).sqrt()


def _batch_pooled(m2: Tensor, dof: Tensor) -> Tensor:
    return (m2.sum() / dof.sum().clamp_min(1)).sqrt().expand(m2.shape)


def _no_pooled(m2: Tensor, dof: Tensor) -> Tensor:
    return torch.ones_like(m2)


class Scale(NamedTuple):
    """A scale of :data:`SCALES`: what the centred samples are divided by (before the floor).

    ``per_group(x - mean_g, segments, mean, count) -> (G,)`` for samples compared with their
    group (calling the scale calls it); ``pooled(m2, dof) -> (G,)`` for samples compared with
    their group's samples at the same time step (``reward_to_go_baseline="time_step"``), from
    each group's sum of squared deviations from its cells' means and its degrees of freedom
    (samples less cells); ``None`` if the scale has no such form (then that baseline refuses it).

    Examples:
        >>> import torch
        >>> from torchrl_grpo.advantages import SCALES, Scale, group_relative_advantage
        >>> group = SCALES["group"]
        >>> SCALES["half"] = Scale(
        ...     lambda *a: 0.5 * group(*a), lambda m2, dof: 0.5 * group.pooled(m2, dof)
        ... )
        >>> x, g = torch.tensor([0.0, 2.0, 1.0, 5.0]), torch.tensor([0, 0, 1, 1])
        >>> group_relative_advantage(x, g, scale_rewards="half")
        tensor([-1.4142,  1.4142, -1.4142,  1.4142], dtype=torch.float64)
        >>> del SCALES["half"]
    """

    per_group: Callable[[Tensor, Segments, Tensor, Tensor], Tensor]
    pooled: Callable[[Tensor, Tensor], Tensor] | None = None

    def __call__(self, dev: Tensor, seg: Segments, mean: Tensor, count: Tensor) -> Tensor:
        return self.per_group(dev, seg, mean, count)


SCALES: dict[str, Scale] = {
    "group": Scale(_group_scale, _group_pooled),
    "batch": Scale(_batch_scale, _batch_pooled),
    "none": Scale(_no_scale, _no_pooled),
}
"""Scales by name (:class:`Scale`): ``scale(x - mean_g, segments, mean, count) -> (G,)``, and its
form pooled over time-step cells."""


def _check_names(baseline: str, scale_rewards: str, time_step_scale: str = "pooled") -> None:
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {sorted(BASELINES)}, got {baseline!r}.")
    if scale_rewards not in SCALES:
        raise ValueError(f"scale_rewards must be one of {sorted(SCALES)}, got {scale_rewards!r}.")
    if time_step_scale not in ("pooled", "cell"):
        raise ValueError(f"time_step_scale must be 'pooled' or 'cell', got {time_step_scale!r}.")


def _advantage(
    x: Tensor,
    seg: Segments,
    baseline: str,
    scale_rewards: str,
    epsilon: float,
    steps: _TimeSteps | None = None,
):
    """The advantage of samples ``x`` (float64, as ``seg.view(x)``), flat ``(S,)``; with
    ``steps``, the baseline taken at each time step of each group."""
    if steps is not None:
        x = x.reshape(-1)
        mean, count = _mean(x, steps.cells)  # (C,), (C,)
        dev = x - steps.cells.spread(mean)
        centred, factor = BASELINES[baseline](x, dev, steps.cells, count)  # (S,), (C,)
        if steps.cell_scale:  # each (group, time step) cell a group of its own (rLLM per_step)
            scale = SCALES[scale_rewards](dev, steps.cells, mean, count)  # (C,)
            return centred * steps.cells.spread(factor / scale.clamp_min(epsilon))
        scale = steps.scale(scale_rewards, dev, seg)  # (G,)
        return centred * steps.cells.spread(factor) / seg.expand(scale.clamp_min(epsilon))
    mean, count = _mean(x, seg)  # (G,), (G,)
    dev = x - seg.spread(mean)
    scale = SCALES[scale_rewards](dev, seg, mean, count)  # (G,)
    centred, factor = BASELINES[baseline](x, dev, seg, count)  # samples' shape, (G,)
    return (centred * seg.spread(factor / scale.clamp_min(epsilon))).reshape(-1)


class _TimeSteps(NamedTuple):
    """The (group, time step) cells of samples laid out as trajectories (runs) in time order."""

    cells: Segments  # the cell of each sample, (S,) -> (C,)
    per_group: Tensor  # (G,) cells of each group: its time steps that some trajectory reached
    cell_scale: bool = False  # scale each cell by its own spread (else the group's pooled one)

    def scale(self, scale_rewards: str, dev: Tensor, seg: Segments) -> Tensor:
        r"""``(G,)`` the scale ``scale_rewards`` of :data:`SCALES` pooled over each group's
        cells, from the deviations ``dev`` ``(S,)`` from their cells' means: for ``"group"``
        :math:`\sqrt{\sum (x - \mu_{g,t})^2 / (n_g - T_g)}` (the degrees of freedom of a
        one-way layout), for ``"batch"`` the same over every group, for ``"none"`` ``1``."""
        pooled = getattr(SCALES[scale_rewards], "pooled", None)
        if pooled is None:
            raise ValueError(
                f"scale_rewards={scale_rewards!r} has no form pooled over time steps (a Scale "
                "of SCALES with pooled=...): the time-step baseline cannot use it."
            )
        m2 = seg.sum(dev.square())  # (G,)
        return pooled(m2, seg.count - self.per_group)  # degrees of freedom: (G,)


def _time_steps(seg: Segments, scale: str = "pooled") -> _TimeSteps:
    """The cells of ``seg``'s samples: runs (trajectories) of one group, samples in time order;
    two samples share a cell when they have the same group and the same position in their run.
    ``scale``: ``"pooled"`` (each group's pooled spread) or ``"cell"`` (each cell's own)."""
    lengths = seg.lengths
    if lengths is None:
        raise ValueError("by_time_step needs the samples as runs: pass lengths.")
    if lengths.numel() == 0 or int(lengths.sum()) == 0:
        empty = torch.zeros(0, dtype=torch.long, device=lengths.device)
        return _TimeSteps(
            Segments(empty, 0), torch.zeros(seg.num, dtype=torch.long), scale == "cell"
        )
    runs = Segments(None, lengths=lengths)
    group = seg.expand(torch.arange(seg.num, device=lengths.device))  # (S,)
    start = runs.expand(torch.cumsum(lengths, 0) - lengths)  # (S,)
    position = torch.arange(group.numel(), device=lengths.device) - start  # (S,)
    cell, num_cells = dense_codes(group * int(lengths.max()) + position)
    cell_group = torch.zeros(num_cells, dtype=torch.long, device=group.device)
    cell_group.scatter_(0, cell, group)  # (C,)
    per_group = torch.bincount(cell_group, minlength=seg.num)
    return _TimeSteps(Segments(cell, num_cells), per_group, scale == "cell")


def group_relative_advantage(
    x: Tensor,
    group_index: Tensor,
    num_groups: int | None = None,
    *,
    baseline: str = "mean",
    scale_rewards: str = "group",
    whiten: bool = False,
    epsilon: float = 1e-6,
    lengths: Tensor | None = None,
    by_time_step: bool = False,
    time_step_scale: str = "pooled",
) -> Tensor:
    r"""Group-relative advantage :math:`A_i = (x_i - b_i) / \max(s_i, \epsilon)`.

    * GRPO (Shao et al., 2024, *DeepSeekMath*, arXiv:2402.03300): ``baseline="mean"``,
      ``scale_rewards="group"``: :math:`A_i = (x_i - \mu_g)/\max(\sigma_g, \epsilon)`.
    * Dr. GRPO (Liu et al., 2025, *Understanding R1-Zero-Like Training*, arXiv:2503.20783):
      ``scale_rewards="none"``: :math:`A_i = x_i - \mu_g`, no division by the group std.
    * Batch-level std (Trinity-RFT ``std_cal_level="batch"``): ``scale_rewards="batch"`` divides
      by the std of every sample passed in (the raw samples: between-group spread included),
      while the mean stays per group.
    * RLOO (Ahmadian et al., 2024, *Back to Basics*, arXiv:2402.14740): ``baseline=
      "leave_one_out"``: :math:`b_i = \frac{1}{n_g - 1}\sum_{j\in g, j\ne i} x_j`, which equals
      :math:`\frac{n_g}{n_g-1}(x_i - \mu_g)`; combine with ``scale_rewards="none"`` for plain RLOO.
    * Pass@k (Tang et al., 2025, arXiv:2503.19595; verl ``grpo_passk``): ``baseline=
      "pass_at_k"``: :math:`x_i - b_i = \max_{j\in g} x_j - \max_{j\in g, j\ne i} x_j`, see
      :func:`pass_at_k_advantage`.
    * REINFORCE++-baseline (Hu, 2025, arXiv:2501.03262): ``whiten=True`` (with
      ``scale_rewards="none"``), see :func:`reinforce_pp_baseline_advantage`.

    The three choices compose: the baseline centres, the scale divides, and ``whiten`` then
    re-centres and rescales the result over every sample passed in (:func:`batch_whiten`).

    ``by_time_step=True`` (per-step samples such as rewards-to-go, the runs being trajectories in
    time order) takes the baseline over the group's samples *at the same time step* (the same
    position in their runs): :math:`x_{i,t} - b_{g,t}`, a time-dependent baseline, so a group of
    identical trajectories gets exactly ``0`` and a step is compared only with the steps its
    peers took at that point of their episodes (a step that only one trajectory reached gets
    ``0``). The scale is then the pooled std of those deviations,
    :math:`s_g = \sqrt{\sum_{i,t}(x_{i,t} - \mu_{g,t})^2 / (n_g - T_g)}` over the group's
    :math:`n_g` samples and :math:`T_g` time steps (``"batch"``: pooled over every group), so
    the steps of a trajectory keep their relative weights (a per-step std would blow the tiny
    differences between the returns-to-go of early steps up to unit size).
    ``time_step_scale="cell"`` scales each (group, time step) cell by its own spread instead:
    every cell is then a GRPO group of its own, rLLM's ``stepwise_advantage.mode="per_step"``
    (the turns of an agent's dialogs compared turn index by turn index, rLLM 0.2; a turn that
    only one dialog reached gets ``0``).

    Args:
        x: samples, shape ``(S,)``: trajectory returns, or reward elements for per-step GRPO.
        group_index: group of each sample, shape ``(S,)``, values in ``[0, num_groups)``.
        num_groups: number of groups; defaults to ``group_index.max() + 1``.
        baseline: a key of :data:`BASELINES`.
        scale_rewards: a key of :data:`SCALES`.
        whiten: whiten the advantages over all ``S`` samples last (:func:`batch_whiten`).
        epsilon: floor of the scale (``clamp_min``, as torchrl), so constant groups give ``0``.
        lengths: samples per run, shape ``(R,)``, when ``x`` is made of contiguous runs that each
            belong to one group; ``group_index`` then has shape ``(R,)``. Same result as the
            per-sample index ``group_index.repeat_interleave(lengths)``, computed faster (per-step
            GRPO: the runs are the trajectories, the samples their reward elements).
        by_time_step: compare samples at the same position of their runs (needs ``lengths``).
        time_step_scale: with ``by_time_step``: ``"pooled"`` (the group's pooled std) or
            ``"cell"`` (each time step's own).

    Returns:
        Advantages, shape ``(S,)``, float64.

    Raises:
        ValueError: for an unknown ``baseline`` or ``scale_rewards``, mismatched shapes, or
            ``by_time_step`` without ``lengths``.

    Examples:
        >>> import torch
        >>> r = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 2.0])
        >>> g = torch.tensor([0, 0, 0, 1, 1, 1])
        >>> group_relative_advantage(r, g)
        tensor([-1.1547,  0.5774,  0.5774,  0.0000,  0.0000,  0.0000], dtype=torch.float64)
        >>> group_relative_advantage(r, g, scale_rewards="none", baseline="leave_one_out")
        tensor([-1.0000,  0.5000,  0.5000,  0.0000,  0.0000,  0.0000], dtype=torch.float64)
        >>> to_go = torch.tensor([3.0, 2.0, 1.0, 4.0, 3.0, 2.0, 1.0])  # episodes of 3 and 4 steps
        >>> group_relative_advantage(to_go, torch.tensor([0, 0]), lengths=torch.tensor([3, 4]),
        ...     by_time_step=True, scale_rewards="none")
        tensor([-0.5000, -0.5000, -0.5000,  0.5000,  0.5000,  0.5000,  0.0000],
               dtype=torch.float64)
    """
    _check_names(baseline, scale_rewards, time_step_scale)
    _check_samples("x", x)
    _check_index(x, group_index, lengths)
    seg = Segments(group_index, num_groups, lengths)
    steps = _time_steps(seg, time_step_scale) if by_time_step else None
    adv = _advantage(seg.view(x.double()), seg, baseline, scale_rewards, epsilon, steps)  # (S,)
    return batch_whiten(adv, epsilon=epsilon) if whiten else adv


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


def reinforce_pp_baseline_advantage(
    x: Tensor,
    group_index: Tensor,
    num_groups: int | None = None,
    *,
    weights: Tensor | None = None,
    epsilon: float = 1e-6,
    lengths: Tensor | None = None,
) -> Tensor:
    r"""REINFORCE++-baseline: subtract the group mean, then whiten over the whole batch.

    :math:`A_i = (c_i - m) / \max(s, \epsilon)` with :math:`c_i = x_i - \mu_g` and :math:`m, s`
    the mean and std of the centred values :math:`c` over every sample passed in (Hu, 2025,
    *REINFORCE++*, arXiv:2501.03262; OpenRLHF ``advantage_estimator="reinforce_baseline"``,
    verl ``reinforce_plus_plus_baseline``). The group mean removes the prompt's difficulty; the
    batch std, unlike GRPO's group std, does not inflate the advantages of groups whose answers
    barely differ.

    Unlike ``scale_rewards="batch"`` (the std of the raw samples, between-group spread included),
    the std here is that of the centred values. Equal to ``group_relative_advantage(x,
    group_index, scale_rewards="none", whiten=True)``.

    Args:
        x: samples, shape ``(S,)``: trajectory returns, or reward elements.
        group_index: group of each sample, shape ``(S,)`` (or per run with ``lengths``).
        num_groups: number of groups; defaults to ``group_index.max() + 1``.
        weights: how many times each sample counts in the whitening (verl and OpenRLHF: its
            tokens), shape ``(S,)``; ``None``: once.
        epsilon: floor of the batch std.
        lengths: samples per run, as in :func:`group_relative_advantage`.

    Returns:
        Advantages, shape ``(S,)``, float64.

    Examples:
        >>> import torch
        >>> x = torch.tensor([0.0, 2.0, 5.0, 5.0, 9.0, 11.0])
        >>> g = torch.tensor([0, 0, 1, 1, 2, 2])
        >>> reinforce_pp_baseline_advantage(x, g)  # centred: -1, 1, 0, 0, -1, 1
        tensor([-1.1180,  1.1180,  0.0000,  0.0000, -1.1180,  1.1180], dtype=torch.float64)
    """
    adv = group_relative_advantage(
        x, group_index, num_groups, scale_rewards="none", epsilon=epsilon, lengths=lengths
    )
    return batch_whiten(adv, weights=weights, epsilon=epsilon)


def pass_at_k_advantage(
    x: Tensor,
    group_index: Tensor,
    num_groups: int | None = None,
    *,
    scale_rewards: str = "group",
    epsilon: float = 1e-6,
    lengths: Tensor | None = None,
) -> Tensor:
    r"""GRPO pass@k: only the best sample of a group gets an advantage, the gap to the runner-up.

    :math:`A_i = \left(\max_{j\in g} x_j - \max_{j\in g,\, j\ne i} x_j\right) / \max(s_g,
    \epsilon)`: for the group's best sample the best minus the second best, for every other
    sample ``0``. It is the leave-one-out estimator of the gradient of the group's maximum, the
    pass@k objective for ``k`` the group size (Tang et al., 2025, *Optimizing Language Models for
    Inference Time Objectives using Reinforcement Learning*, arXiv:2503.19595; verl
    ``adv_estimator="grpo_passk"``, ``compute_grpo_passk_outcome_advantage``).

    Defaults are verl's: the gap is divided by the group std (``norm_adv_by_std_in_grpo=True``;
    ``scale_rewards="none"`` for ``False``). Ties: when several samples share the best value,
    every sample of the group gets ``0`` (verl gives ``r_max - r_second_max = 0`` to the one
    ``topk`` picks: the same numbers). A group of one sample gets ``0`` (verl raises).

    Args:
        x: samples, shape ``(S,)``: trajectory returns.
        group_index: group of each sample, shape ``(S,)`` (or per run with ``lengths``).
        num_groups: number of groups; defaults to ``group_index.max() + 1``.
        scale_rewards: a key of :data:`SCALES`: ``"group"`` (verl's default) or ``"none"``.
        epsilon: floor of the scale (verl adds ``1e-6`` to the std instead).
        lengths: samples per run, as in :func:`group_relative_advantage`.

    Returns:
        Advantages, shape ``(S,)``, float64; at most one non-zero entry per group.

    Examples:
        >>> import torch
        >>> x = torch.tensor([0.0, 3.0, 1.0, 2.0, 2.0, 0.0])
        >>> g = torch.tensor([0, 0, 0, 1, 1, 1])
        >>> pass_at_k_advantage(x, g, scale_rewards="none")  # best 3, runner-up 1; a tie at 2
        tensor([0., 2., 0., 0., 0., 0.], dtype=torch.float64)
    """
    return group_relative_advantage(
        x,
        group_index,
        num_groups,
        baseline="pass_at_k",
        scale_rewards=scale_rewards,
        epsilon=epsilon,
        lengths=lengths,
    )


def multi_reward_advantage(
    x: Tensor,
    group_index: Tensor,
    num_groups: int | None = None,
    *,
    weights: Tensor | None = None,
    baseline: str = "mean",
    scale_rewards: str = "group",
    whiten: bool = True,
    epsilon: float = 1e-6,
    lengths: Tensor | None = None,
    by_time_step: bool = False,
    time_step_scale: str = "pooled",
) -> Tensor:
    r"""GDPO: each reward normalized within its group, then summed with weights, then whitened.

    :math:`A_i = \mathrm{whiten}\big(\sum_k w_k \hat A^{(k)}_i\big)` with
    :math:`\hat A^{(k)}_i = (x_{ik} - \mu^{(k)}_g) / \max(\sigma^{(k)}_g, \epsilon)`, GRPO's
    advantage of reward ``k`` alone, and the whitening over every sample passed in
    (:func:`batch_whiten`). GDPO (Liu et al., 2026, *Group reward-Decoupled Normalization Policy
    Optimization*, arXiv:2601.05242; TRL ``multi_objective_aggregation="normalize_then_sum"``):
    normalizing the sum instead (GRPO's, TRL's ``"sum_then_normalize"``) lets distinct reward
    combinations collapse to the same advantage and a high-variance reward drown the others.
    TRL's defaults: weights ``1``, group std, the batch whitening always applied.

    ``baseline`` and ``scale_rewards`` set each reward's normalization, as in
    :func:`group_relative_advantage` (TRL: ``"mean"``, ``"group"``). With one reward of weight
    ``1`` and ``whiten=False`` this is :func:`group_relative_advantage`.

    Args:
        x: rewards, shape ``(S, K)``: ``K`` rewards of each sample.
        group_index: group of each sample, shape ``(S,)`` (or per run with ``lengths``).
        num_groups: number of groups; defaults to ``group_index.max() + 1``.
        weights: weight of each reward, shape ``(K,)``; ``None``: all ``1``.
        baseline: a key of :data:`BASELINES`, for each reward.
        scale_rewards: a key of :data:`SCALES`, for each reward.
        whiten: whiten the weighted sum over all ``S`` samples (GDPO's batch normalization).
        epsilon: floor of every std (TRL adds ``1e-4`` to it instead).
        lengths: samples per run, shape ``(R,)``, as in :func:`group_relative_advantage`.
        by_time_step: each reward's baseline at each time step, as in
            :func:`group_relative_advantage` (needs ``lengths``).
        time_step_scale: with ``by_time_step``, as in :func:`group_relative_advantage`.

    Returns:
        Advantages, shape ``(S,)``, float64.

    Raises:
        ValueError: if ``x`` is not ``(S, K)`` or ``weights`` not ``(K,)``.

    Examples:
        >>> import torch
        >>> x = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 3.0], [0.0, 3.0]])  # correct, format
        >>> g = torch.tensor([0, 0, 1, 1])
        >>> multi_reward_advantage(x, g, weights=torch.tensor([1.0, 0.5]), whiten=False)
        tensor([ 0.7071, -0.7071,  0.7071, -0.7071], dtype=torch.float64)
    """
    if x.ndim != 2:
        raise ValueError(f"x must be (S, K), one column per reward, got shape {tuple(x.shape)}.")
    num_rewards = x.shape[1]
    weights = torch.ones(num_rewards, device=x.device) if weights is None else weights
    if weights.shape != (num_rewards,):
        raise ValueError(
            f"weights must have one entry per reward, shape ({num_rewards},), got "
            f"{tuple(weights.shape)}."
        )
    _check_names(baseline, scale_rewards, time_step_scale)
    _check_index(x[:, 0], group_index, lengths)
    seg = Segments(group_index, num_groups, lengths)
    steps = _time_steps(seg, time_step_scale) if by_time_step else None
    w = weights.double().tolist()
    x = x.double()
    adv = sum(  # a loop over the K rewards, each a pass over the samples
        w[k]
        * _advantage(seg.view(x[:, k].contiguous()), seg, baseline, scale_rewards, epsilon, steps)
        for k in range(num_rewards)
    )
    if not torch.is_tensor(adv):  # K = 0
        adv = x.new_zeros(x.shape[0])
    return batch_whiten(adv, epsilon=epsilon) if whiten else adv


# --- step-level groups for multi-step tasks (GiGPO) ---------------------------------------------


def discounted_returns(
    rewards: Tensor, lengths: Tensor, gamma: float, *, width: int | None = None
) -> Tensor:
    r"""The discounted return from each step to the end of its trajectory.

    :math:`G_t = \sum_{k=t}^{T_i} \gamma^{k-t} r_k` for every step :math:`t` of trajectory
    :math:`i` (GiGPO, Feng et al., 2025, arXiv:2505.10978, Eq. 5), computed for every trajectory at
    once in ``ceil(log2(longest))`` vectorized passes, with no Python loop over steps or
    trajectories.

    Args:
        rewards: per-step rewards, shape ``(N,)``, trajectory after trajectory, in time order.
        lengths: steps per trajectory, shape ``(n,)``, summing to ``N``.
        gamma: the discount, in ``[0, 1]``.
        width: the length every trajectory has, if they all have one (``0``: they differ); found
            from ``lengths`` when ``None``.

    Returns:
        The returns, shape ``(N,)``, float64.

    Raises:
        ValueError: for mismatched shapes or a ``gamma`` outside ``[0, 1]``.

    Examples:
        >>> import torch
        >>> discounted_returns(torch.tensor([0.0, 0.0, 1.0, 2.0]), torch.tensor([3, 1]), 0.5)
        tensor([0.2500, 0.5000, 1.0000, 2.0000], dtype=torch.float64)
    """
    _check_samples("rewards", rewards)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be (n,), got shape {tuple(lengths.shape)}.")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}.")
    if int(lengths.sum()) != rewards.numel():
        raise ValueError(
            f"lengths sum to {int(lengths.sum())} steps, but rewards has {rewards.numel()}."
        )
    if width is None and lengths.numel():
        shortest, longest = (int(v) for v in torch.aminmax(lengths))
        width = shortest if shortest == longest else 0
    return discounted_suffix_sum(rewards.double(), lengths, float(gamma), width=width or 0)


def anchor_step_groups(
    group_index: Tensor, anchor: Tensor, num_groups: int | None = None
) -> tuple[Tensor, int]:
    r"""GiGPO's step groups: the steps of one group whose anchor states are equal.

    Two steps share a step group when they belong to the same (episode-level) group and their
    anchor states are equal in every entry (GiGPO, Feng et al., 2025, arXiv:2505.10978, Eq. 6:
    :math:`G^S(\tilde s) = \{(a_t^{(i)}, G_t^{(i)}) \mid s_t^{(i)} = \tilde s\}`), whichever
    trajectory and time step they come from. Equality is exact (``-0.0`` equals ``0.0``; a ``nan``
    equals only the same ``nan``); pass a hash or an id to compare anything else (text
    observations: a code per distinct string).

    Cost: integer states whose entries span a compact range (a state index, a cell of a grid)
    are numbered with the group in mixed radix and coded through a table of that range, with no
    sort; anything else (float vectors, 64-bit hashes) is hashed with the group to one integer
    per step and coded with one sort, and the result is checked against the states themselves (a
    hash collision falls back to an exact row-wise comparison: the grouping is exact either
    way).

    Args:
        group_index: group of each step, shape ``(N,)``, integer, values in ``[0, G)``.
        anchor: anchor state of each step, shape ``(N,)`` or ``(N, ...)``: the observation the
            step acted on, or a hash of it.
        num_groups: ``G``; defaults to ``group_index.max() + 1``.

    Returns:
        ``(step_group, num_step_groups)``: a dense code per step, shape ``(N,)`` int64, equal
        iff group and anchor are, and the number of codes.

    Raises:
        ValueError: if ``anchor`` has not one entry per step.

    Examples:
        >>> import torch
        >>> group = torch.tensor([0, 0, 0, 1, 1])
        >>> obs = torch.tensor([[0, 1], [2, 2], [0, 1], [0, 1], [0, 1]])
        >>> anchor_step_groups(group, obs)
        (tensor([0, 1, 0, 2, 2]), 3)
    """
    _check_samples("group_index", group_index)
    if anchor.shape[:1] != group_index.shape:
        raise ValueError(
            f"anchor must have one entry per step, {group_index.numel()}, got shape "
            f"{tuple(anchor.shape)}."
        )
    n = group_index.numel()
    if n == 0:
        return group_index.long(), 0
    group = group_index.long()
    rows = anchor.reshape(n, -1)  # (N, d)
    if not (rows.is_floating_point() or rows.is_complex()):  # ids, or cells of a grid
        low, high = (v.tolist() for v in torch.aminmax(rows.long(), dim=0))  # each entry's range
        widths = [top - bottom + 1 for bottom, top in zip(low, high)]  # Python ints: no overflow
        span = int(group.max()) + 1 if num_groups is None else int(num_groups)
        for width in widths:
            span *= width
        if span <= 4 * n + 1024:  # (group, state) numbered in mixed radix: a small table
            key = group
            for column, lowest, width in zip(rows.long().unbind(1), low, widths):
                key = column.add(key, alpha=width)  # key * width + column
                if lowest:
                    key = key.sub_(lowest)
            return dense_codes(key, span=span)
    bits = _state_bits(rows)  # (N, d) int64, equal iff the states are
    key = group
    for column in bits.unbind(1):  # a few columns: one pass each
        key = key * 1099511628211 + column  # wraps around: a hash, checked below
    codes, num = dense_codes(key)
    first = torch.full((num,), n, dtype=torch.long, device=codes.device).scatter_reduce(
        0, codes, torch.arange(n, device=codes.device), reduce="amin"
    )[codes]  # (N,) the first step of each step's code
    if bool((group[first] == group).all()) and bool((bits[first] == bits).all()):
        return codes, num
    exact = torch.unique(torch.cat([group[:, None], bits], 1), dim=0, return_inverse=True)[1]
    return exact, int(exact.max()) + 1


def _state_bits(rows: Tensor) -> Tensor:
    """``(N, d)`` states as int64 bit patterns, equal iff the values are (``-0.0`` as ``0.0``)."""
    if rows.is_complex():
        rows = torch.view_as_real(rows).reshape(rows.shape[0], -1)
    if not rows.is_floating_point():
        return rows.long()
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[rows.element_size()]
    return (rows + 0.0).view(as_int).long()  # + 0.0 turns -0.0 into 0.0


def step_level_advantage(
    rewards: Tensor,
    lengths: Tensor,
    step_group: Tensor,
    num_step_groups: int | None = None,
    *,
    gamma: float = 0.95,
    baseline: str = "mean",
    scale_rewards: str = "group",
    epsilon: float = 1e-6,
    width: int | None = None,
) -> Tensor:
    r"""GiGPO's step-level advantage: each step's discounted return against its step group.

    :math:`A^S_t = (G_t - \mu_{\tilde s}) / \max(\sigma_{\tilde s}, \epsilon)` where :math:`G_t` is
    the discounted return from step :math:`t` (:func:`discounted_returns`) and :math:`\mu, \sigma`
    are taken over the steps of its step group :math:`\tilde s` (:func:`anchor_step_groups`) (Feng
    et al., 2025, *Group-in-Group Policy Optimization for LLM Agent Training*, arXiv:2505.10978,
    Eq. 7; ROLL and verl-agent: :math:`\gamma = 0.95`). A step group of one step gets ``0``.
    ``scale_rewards="group"`` is verl-agent's ``mode="mean_std_norm"``, ``"none"`` its
    ``"mean_norm"``.

    Args:
        rewards: per-step rewards, shape ``(N,)``, trajectory after trajectory, in time order.
        lengths: steps per trajectory, shape ``(n,)``.
        step_group: step group of each step, shape ``(N,)``.
        num_step_groups: number of step groups; defaults to ``step_group.max() + 1``.
        gamma: the discount of the returns.
        baseline: a key of :data:`BASELINES`.
        scale_rewards: a key of :data:`SCALES`.
        epsilon: floor of the scale.
        width: the length of every trajectory if they all have one (``0``: they differ); found
            from ``lengths`` when ``None``.

    Returns:
        Step-level advantages, shape ``(N,)``, float64.

    Examples:
        >>> import torch
        >>> r = torch.tensor([0.0, 1.0, 0.0, 0.0])  # two trajectories of two steps
        >>> same_start = torch.tensor([0, 1, 0, 2])  # their first steps share a state
        >>> step_level_advantage(
        ...     r, torch.tensor([2, 2]), same_start, gamma=0.5, scale_rewards="none")
        tensor([ 0.2500,  0.0000, -0.2500,  0.0000], dtype=torch.float64)
    """
    returns = discounted_returns(rewards, lengths, gamma, width=width)  # (N,)
    return group_relative_advantage(
        returns,
        step_group,
        num_step_groups,
        baseline=baseline,
        scale_rewards=scale_rewards,
        epsilon=epsilon,
    )


def gigpo_advantage(
    returns: Tensor,
    group_index: Tensor,
    step_rewards: Tensor,
    lengths: Tensor,
    anchor: Tensor,
    *,
    gamma: float = 0.95,
    episode_weight: float = 1.0,
    step_weight: float = 1.0,
    baseline: str = "mean",
    scale_rewards: str = "group",
    epsilon: float = 1e-6,
) -> Tensor:
    r"""GiGPO: the episode-level group advantage plus the step-level one, weighted, per step.

    :math:`A_t = w_E\, A^E(\tau_i) + w_S\, A^S_t` for step :math:`t` of trajectory :math:`i`, where
    :math:`A^E` is GRPO's advantage of the trajectory's return within its group
    (:func:`group_relative_advantage`) and :math:`A^S` the step-level advantage of its discounted
    return within its step group (:func:`step_level_advantage`) (Feng et al., 2025,
    *Group-in-Group Policy Optimization for LLM Agent Training*, arXiv:2505.10978, Eq. 8).
    Defaults: ROLL's ``episode_reward_weight=1.0``, ``step_reward_weight=1.0``,
    ``step_reward_gamma=0.95`` (verl-agent: ``step_advantage_w=1.0``, ``gamma=0.95``). With
    ``step_weight=0`` and ``episode_weight=1`` this is GRPO's advantage, given to every step.

    Args:
        returns: each trajectory's return, shape ``(n,)``.
        group_index: group of each trajectory, shape ``(n,)``.
        step_rewards: per-step rewards, shape ``(N,)``, trajectory after trajectory, in order.
        lengths: steps per trajectory, shape ``(n,)``, summing to ``N``.
        anchor: anchor state of each step, shape ``(N,)`` or ``(N, ...)``, compared by value.
        gamma: the discount of the step-level returns.
        episode_weight: :math:`w_E`.
        step_weight: :math:`w_S`.
        baseline: a key of :data:`BASELINES`, for both levels.
        scale_rewards: a key of :data:`SCALES`, for both levels.
        epsilon: floor of the scales.

    Returns:
        Per-step advantages, shape ``(N,)``, float64.

    Raises:
        ValueError: for mismatched shapes.

    Examples:
        >>> import torch
        >>> r = torch.tensor([0.0, 1.0, 0.0, 0.0])  # trajectory 0 succeeds, trajectory 1 fails
        >>> obs = torch.tensor([7, 8, 7, 9])  # both start from state 7
        >>> gigpo_advantage(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), r,
        ...                 torch.tensor([2, 2]), obs, gamma=0.5, scale_rewards="none")
        tensor([ 0.7500,  0.5000, -0.7500, -0.5000], dtype=torch.float64)
    """
    _check_samples("returns", returns)
    _check_index(returns, group_index, None)
    if lengths.shape != returns.shape:
        raise ValueError(
            f"lengths must have one entry per trajectory, {tuple(returns.shape)}, got "
            f"{tuple(lengths.shape)}."
        )
    kw = dict(baseline=baseline, scale_rewards=scale_rewards, epsilon=epsilon)
    episode = group_relative_advantage(returns, group_index, **kw)  # (n,)
    step_group, num = anchor_step_groups(group_index.repeat_interleave(lengths), anchor)
    step = step_level_advantage(step_rewards, lengths, step_group, num, gamma=gamma, **kw)  # (N,)
    return episode_weight * episode.repeat_interleave(lengths) + step_weight * step
