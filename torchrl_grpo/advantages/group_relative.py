"""GRPO's group-relative advantage and its registries: the baselines (:data:`BASELINES`: the
group mean, RLOO's leave-one-out, pass@k's runner-up) and the scales (:data:`SCALES`: the
group's std, the batch's, none), per trajectory or per time step."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from torchrl_grpo._segments import Segments, dense_codes
from torchrl_grpo.advantages.returns import _check_index, _check_samples, _mean, batch_whiten

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


def _group_scale(dev: Tensor, seg: Segments, mean: Tensor, count: Tensor) -> Tensor:
    m2 = seg.sum(dev.square())  # (G,)
    return (m2 / (count - 1).clamp_min(1)).sqrt()


def _batch_scale(dev: Tensor, seg: Segments, mean: Tensor, count: Tensor) -> Tensor:
    # Std of every sample: within-group squares plus between-group squares (Chan et al., 1979).
    present = count > 0
    total, groups = torch.stack([count.sum(), present.sum()]).tolist()  # read at once
    index = torch.nonzero_static(present, size=groups).view(-1)  # the groups with samples
    mean, count = mean.index_select(0, index), count.index_select(0, index)
    grand = (mean * count).sum() / max(total, 1)
    m2 = dev.square().sum() + (count * (mean - grand).square()).sum()
    return (m2 / max(total - 1, 1)).sqrt().expand(present.shape)


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
    total = seg.total if seg.total is not None else int(lengths.sum())
    if lengths.numel() == 0 or total == 0:
        empty = torch.zeros(0, dtype=torch.long, device=lengths.device)
        return _TimeSteps(
            Segments(empty, 0), torch.zeros(seg.num, dtype=torch.long), scale == "cell"
        )
    runs = Segments(None, lengths=lengths, width=seg.known_width, total=total)
    group = seg.expand(torch.arange(seg.num, device=lengths.device))  # (S,)
    start = runs.expand(torch.cumsum(lengths, 0) - lengths)  # (S,)
    position = torch.arange(group.numel(), device=lengths.device) - start  # (S,)
    longest = seg.known_width or int(lengths.max())  # (the runs' length, when all have one)
    cell, num_cells = dense_codes(group * longest + position, span=seg.num * longest)
    cell_group = torch.zeros(num_cells, dtype=torch.long, device=group.device)
    cell_group.scatter_(0, cell, group)  # (C,)
    per_group = torch.zeros(seg.num, dtype=torch.long, device=group.device)
    per_group.index_add_(0, cell_group, torch.ones_like(cell_group))  # (G,) cells of each
    return _TimeSteps(Segments(cell, num_cells), per_group, scale == "cell")


def group_std(
    x: Tensor,
    group_index: Tensor,
    num_groups: int | None = None,
    *,
    mean: Tensor | None = None,
    lengths: Tensor | None = None,
    by_time_step: bool = False,
    width: int | None = None,
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
        width: with ``lengths``, as in :func:`group_relative_advantage`.

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
    seg = Segments(group_index, num_groups, lengths, width=width, total=x.shape[0])
    if by_time_step:
        steps = _time_steps(seg)
        x = x.double().reshape(-1)
        mean, _ = _mean(x, steps.cells)
        return steps.scale("group", x - steps.cells.spread(mean), seg)
    x = seg.view(x.double())
    mean, count = _mean(x, seg) if mean is None else (mean, seg.count)
    return _group_scale(x - seg.spread(mean), seg, mean, count)


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
    width: int | None = None,
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
        width: with ``lengths``, the length every run has (``0``: they differ) when the caller
            knows it; found from ``lengths`` (one read on the host) when ``None``.

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
    seg = Segments(group_index, num_groups, lengths, width=width, total=x.shape[0])
    steps = _time_steps(seg, time_step_scale) if by_time_step else None
    adv = _advantage(seg.view(x.double()), seg, baseline, scale_rewards, epsilon, steps)  # (S,)
    return batch_whiten(adv, epsilon=epsilon) if whiten else adv
