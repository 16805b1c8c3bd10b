"""Which complete groups are written: dynamic sampling and the std threshold.

``keep_return_bounds`` is decided as torchrl 0.14.1 decides it, in two tests on the returns as
torchrl computes them (in the reward's dtype, see
:func:`~torchrl_grpo.mcadvantage.returns.torchrl_returns`):

1. *selection*: ``MCAdvantageSelector`` takes the group if the mean of its returns as Python
   floats, summed left to right, lies strictly inside the bounds;
2. *keeping*: the selected group is then dropped unless ``float(returns.mean())``, the mean in the
   reward's dtype, lies strictly inside them too.

torchrl counts a group in ``selected_trajectories`` after the first test. ``std_threshold`` (not
in torchrl) is part of selection: a group whose float64 std of the advantage's samples is at or
below it is neither selected nor written (with ``RewardToGo``'s gamma, the std around each time
step's mean, so a group of identical episodes has std 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchrl_grpo.advantages import group_std
from torchrl_grpo.mcadvantage.options import GroupFilter

__all__ = ["filter_groups", "keeps_selected", "selects"]


def filter_groups(
    group_filter: GroupFilter,
    x: Tensor,
    group_index: Tensor,
    num_groups: int,
    *,
    runs: Tensor | None = None,
    torchrl_returns: Tensor | None = None,
    by_time_step: bool = False,
    width: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Per group, whether it is selected, and whether it is written.

    Args:
        group_filter: the filters.
        x: the advantage's samples, ``(S,)``; with ``runs``, contiguous runs of one group.
        group_index: the group of each sample (of each run with ``runs``).
        num_groups: ``G``.
        runs: samples per run, or ``None``.
        torchrl_returns: ``(G, size)`` the returns of each group as torchrl computes them, in
            the order torchrl sees them; needed with ``keep_return_bounds``.
        by_time_step: the samples are rewards-to-go, their std taken around each time step's
            mean (:func:`~torchrl_grpo.advantages.group_std`), as the advantage compares them.
        width: with ``runs``, the samples of every run when all have as many (``0``: they
            differ), if known.

    Returns:
        ``(selected, kept)``, each ``(G,)`` bool; ``kept`` implies ``selected``.

    Examples:
        >>> import torch
        >>> returns = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
        >>> filter_groups(GroupFilter((0.1, 0.9), None), returns.reshape(-1).double(),
        ...     torch.tensor([0, 0, 1, 1]), 2, torchrl_returns=returns)
        (tensor([ True, False]), tensor([ True, False]))
    """
    selected = torch.ones(num_groups, dtype=torch.bool)
    kept = selected
    if group_filter.std_threshold is not None:
        std = group_std(
            x, group_index, num_groups, lengths=runs, by_time_step=by_time_step, width=width
        )
        selected = std > group_filter.std_threshold
        kept = selected
    if group_filter.keep_return_bounds is not None:
        python_mean, dtype_mean = _means(torchrl_returns)
        selected = selected & _inside(python_mean, group_filter.keep_return_bounds)
        kept = selected & _inside(dtype_mean, group_filter.keep_return_bounds)
    return selected, kept


def selects(group_filter: GroupFilter, returns: Tensor, torchrl_returns: Tensor) -> bool:
    """Whether one group passes selection; ``(size,)`` float64 and torchrl returns."""
    if group_filter.std_threshold is not None:
        zeros = torch.zeros(returns.shape[0], dtype=torch.long)
        if not bool(group_std(returns, zeros, 1) > group_filter.std_threshold):
            return False
    if group_filter.keep_return_bounds is None:
        return True
    low, high = group_filter.keep_return_bounds
    values = torchrl_returns.tolist()
    return low < sum(values) / len(values) < high


def keeps_selected(group_filter: GroupFilter, torchrl_returns: Tensor) -> bool:
    """Whether a selected group is written: its mean in the reward's dtype in the bounds."""
    if group_filter.keep_return_bounds is None:
        return True
    return bool(_inside(_means(torchrl_returns[None])[1], group_filter.keep_return_bounds))


def _means(returns: Tensor) -> tuple[Tensor, Tensor]:
    """The two means torchrl compares with the bounds, for ``(G, size)`` returns, as float64.

    ``sum(values) / size`` over Python floats, left to right, is a float64 running sum
    (``cumsum``); ``float(returns.mean())`` in the reward's dtype is a row mean (a row of a
    ``(G, size)`` tensor rounds as the row alone does).
    """
    python_mean = torch.cumsum(returns.double(), 1)[:, -1] / returns.shape[1]
    dtype_mean = (returns if returns.is_floating_point() else returns.double()).mean(1)
    return python_mean, dtype_mean.double()


def _inside(mean: Tensor, bounds: tuple[float, float]) -> Tensor:
    low, high = bounds  # compared as Python floats compare: in float64
    return (low < mean) & (mean < high)
