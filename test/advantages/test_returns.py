"""Tests of :mod:`torchrl_grpo.advantages.returns`: trajectory returns and group statistics,
against hand-computed values and a slow reference."""

import math

import pytest
import torch

from torchrl_grpo.advantages import (
    group_mean,
    group_std,
    trajectory_returns,
)


class TestTrajectoryReturns:
    def test_reductions_by_hand(self):
        r = torch.tensor([1.0, -2.0, 4.0, 3.0, 0.5])
        traj = torch.tensor([0, 0, 0, 1, 1])
        assert trajectory_returns(r, traj, reduction="sum").tolist() == [3.0, 3.5]
        assert trajectory_returns(r, traj, reduction="mean").tolist() == [1.0, 1.75]
        assert trajectory_returns(r, traj, reduction="max").tolist() == [4.0, 3.0]
        assert trajectory_returns(r, traj, reduction="last").tolist() == [4.0, 0.5]

    def test_last_follows_element_order_not_value(self):
        r = torch.tensor([9.0, 1.0, 7.0, 2.0])
        traj = torch.tensor([0, 1, 0, 1])  # interleaved trajectories
        assert trajectory_returns(r, traj, 2, "last").tolist() == [7.0, 2.0]

    def test_unknown_reduction(self):
        with pytest.raises(ValueError, match="median"):
            trajectory_returns(torch.ones(2), torch.zeros(2, dtype=torch.long), reduction="median")

    def test_half_precision_accumulates_in_float64(self):
        r = torch.full((4096,), 60000.0, dtype=torch.float16)  # the sum overflows float16
        out = trajectory_returns(r, torch.zeros(4096, dtype=torch.long), 1, "sum")
        assert out.dtype == torch.float64 and out.item() == 60000.0 * 4096


class TestGroupMeanStd:
    def test_by_hand(self):
        x = torch.tensor([1.0, 3.0, 10.0, 2.0, 2.0])
        g = torch.tensor([0, 0, 1, 2, 2])
        mean, count = group_mean(x, g)
        assert mean.tolist() == [2.0, 10.0, 2.0] and count.tolist() == [2, 1, 2]
        std = group_std(x, g)
        assert std.tolist() == pytest.approx([math.sqrt(2.0), 0.0, 0.0])

    def test_bessel_matches_torch_std(self):
        x = torch.randn(7)
        assert group_std(x, torch.zeros(7, dtype=torch.long)).item() == pytest.approx(
            x.double().std().item()
        )
