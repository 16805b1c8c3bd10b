"""Tests of torchrl_grpo/advantages.py against hand-computed values and a slow reference."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrl_grpo.advantages import (
    Segments,
    group_mean,
    group_relative_advantage,
    group_std,
    trajectory_returns,
)


def reference_advantage(x, groups, baseline="mean", scale_rewards="group", epsilon=1e-6):
    """One group at a time, in Python floats: the definition, written plainly."""
    x, groups = x.double().tolist(), groups.tolist()
    out = [0.0] * len(x)
    everything = torch.tensor(x, dtype=torch.float64)
    batch_std = float(everything.std()) if len(x) > 1 else 0.0
    for g in set(groups):
        idx = [i for i, gi in enumerate(groups) if gi == g]
        vals = [x[i] for i in idx]
        n = len(vals)
        mean = sum(vals) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
        scale = {"group": std, "batch": batch_std, "none": 1.0}[scale_rewards]
        for i in idx:
            if baseline == "mean":
                b = mean
            else:
                b = (sum(vals) - x[i]) / (n - 1) if n > 1 else x[i]
            out[i] = (x[i] - b) / max(scale, epsilon)
    return torch.tensor(out, dtype=torch.float64)


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


class TestGroupRelativeAdvantage:
    @pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
    @pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
    def test_matches_reference(self, baseline, scale_rewards):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(40, generator=gen)
        g = torch.randint(0, 6, (40,), generator=gen)
        got = group_relative_advantage(x, g, baseline=baseline, scale_rewards=scale_rewards)
        want = reference_advantage(x, g, baseline, scale_rewards)
        torch.testing.assert_close(got, want)

    def test_grpo_by_hand(self):
        # group 0: returns 0, 1, 1 -> mean 2/3, std sqrt(1/3)
        x = torch.tensor([0.0, 1.0, 1.0])
        adv = group_relative_advantage(x, torch.zeros(3, dtype=torch.long))
        s = math.sqrt(1 / 3)
        assert adv.tolist() == pytest.approx([-2 / 3 / s, 1 / 3 / s, 1 / 3 / s])

    def test_rloo_by_hand(self):
        x = torch.tensor([1.0, 2.0, 6.0])
        adv = group_relative_advantage(
            x, torch.zeros(3, dtype=torch.long), baseline="leave_one_out", scale_rewards="none"
        )
        assert adv.tolist() == pytest.approx([1 - 4, 2 - 3.5, 6 - 1.5])

    def test_dr_grpo_is_centred_only(self):
        x = torch.tensor([1.0, 2.0, 6.0, 10.0])
        g = torch.tensor([0, 0, 0, 1])
        adv = group_relative_advantage(x, g, scale_rewards="none")
        assert adv.tolist() == pytest.approx([-2.0, -1.0, 3.0, 0.0])

    def test_constant_group_gives_zeros_not_nan(self):
        adv = group_relative_advantage(torch.full((5,), 3.0), torch.zeros(5, dtype=torch.long))
        assert adv.tolist() == [0.0] * 5

    def test_group_of_one_gives_zero(self):
        for baseline in ("mean", "leave_one_out"):
            adv = group_relative_advantage(
                torch.tensor([4.0]), torch.tensor([0]), baseline=baseline
            )
            assert adv.tolist() == [0.0]

    def test_epsilon_floors_the_scale(self):
        x = torch.tensor([0.0, 1e-9])
        adv = group_relative_advantage(x, torch.zeros(2, dtype=torch.long), epsilon=1e-3)
        mean, std = 0.5e-9, math.sqrt(0.5e-18)
        assert std < 1e-3
        assert adv.tolist() == pytest.approx([-mean / 1e-3, mean / 1e-3])

    @pytest.mark.parametrize("scale", [1e-30, 1e30])
    def test_extreme_magnitudes_stay_finite(self, scale):
        x = torch.tensor([0.0, 1.0, 2.0, 3.0]) * scale
        adv = group_relative_advantage(x, torch.zeros(4, dtype=torch.long), epsilon=1e-300)
        assert torch.isfinite(adv).all()
        torch.testing.assert_close(adv, reference_advantage(x, torch.zeros(4), epsilon=1e-300))

    def test_bfloat16_input(self):
        x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
        adv = group_relative_advantage(x, torch.zeros(4, dtype=torch.long))
        torch.testing.assert_close(adv, reference_advantage(x.float(), torch.zeros(4)))

    def test_unknown_names(self):
        x, g = torch.ones(2), torch.zeros(2, dtype=torch.long)
        with pytest.raises(ValueError, match="baseline"):
            group_relative_advantage(x, g, baseline="median")
        with pytest.raises(ValueError, match="scale_rewards"):
            group_relative_advantage(x, g, scale_rewards="global")

    @settings(max_examples=60, deadline=None)
    @given(
        rewards=st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=40),
        num_groups=st.integers(1, 5),
        seed=st.integers(0, 2**16),
    )
    def test_groups_are_centred_and_unit_std(self, rewards, num_groups, seed):
        x = torch.tensor(rewards, dtype=torch.float64)
        g = torch.randint(
            0, num_groups, (len(rewards),), generator=torch.Generator().manual_seed(seed)
        )
        adv = group_relative_advantage(x, g)
        assert torch.isfinite(adv).all()
        for k in g.unique().tolist():
            a, v = adv[g == k], x[g == k]
            assert abs(float(a.mean())) < 1e-6
            if v.numel() > 1 and float(v.std()) > 1e-3:
                assert float(a.std()) == pytest.approx(1.0, rel=1e-6)
            if (v == v[0]).all():  # a constant group (or a group of one): exactly zero
                assert (a == 0).all()


class TestSegments:
    """Runs (contiguous samples of one group) give the numbers of the per-sample index."""

    @staticmethod
    def runs(lengths, num_groups, seed=0):
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.tensor(lengths)
        run_group = torch.randint(0, num_groups, (lengths.numel(),), generator=gen)
        x = torch.randn(int(lengths.sum()), generator=gen, dtype=torch.float64)
        return x, lengths, run_group, run_group.repeat_interleave(lengths)

    @pytest.mark.parametrize("lengths", [[3, 1, 4, 1, 5], [4, 4, 4, 4], [2], [1, 1, 1]])
    def test_reductions_match_the_index(self, lengths):
        x, lengths, run_group, index = self.runs(lengths, 3)
        by_run, by_sample = Segments(run_group, 3, lengths), Segments(index, 3)
        torch.testing.assert_close(by_run.sum(x), by_sample.sum(x))
        torch.testing.assert_close(by_run.amax(x), by_sample.amax(x))
        torch.testing.assert_close(by_run.last(x), by_sample.last(x))
        assert torch.equal(by_run.count, by_sample.count)
        values = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
        assert torch.equal(by_run.expand(values), by_sample.expand(values))

    @pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
    @pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
    @pytest.mark.parametrize("lengths", [[3, 1, 4, 1, 5, 9, 2, 6], [4] * 8])
    def test_advantage_matches_the_index(self, lengths, baseline, scale_rewards):
        x, lengths, run_group, index = self.runs(lengths, 3, seed=1)
        kw = dict(baseline=baseline, scale_rewards=scale_rewards)
        got = group_relative_advantage(x, run_group, 3, lengths=lengths, **kw)
        torch.testing.assert_close(got, group_relative_advantage(x, index, 3, **kw))
        torch.testing.assert_close(got, reference_advantage(x, index, **kw))
        mean, count = group_mean(x, run_group, 3, lengths=lengths)
        torch.testing.assert_close(mean, group_mean(x, index, 3)[0])
        std = group_std(x, run_group, 3, lengths=lengths)
        torch.testing.assert_close(std, group_std(x, index, 3))

    @pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
    @pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
    @pytest.mark.parametrize("lengths", [[3, 1, 4], [5, 5], [7]])
    def test_one_group(self, lengths, baseline, scale_rewards):
        """A lone group takes plain reductions; same numbers as the definition."""
        x, lengths, _, _ = self.runs(lengths, 1, seed=2)
        runs, index = (
            torch.zeros(lengths.numel(), dtype=torch.long),
            torch.zeros(len(x), dtype=torch.long),
        )
        kw = dict(baseline=baseline, scale_rewards=scale_rewards)
        want = reference_advantage(x, index, **kw)
        torch.testing.assert_close(group_relative_advantage(x, index, 1, **kw), want)
        torch.testing.assert_close(
            group_relative_advantage(x, runs, 1, lengths=lengths, **kw), want
        )
        for reduction in ("sum", "mean", "max", "last"):
            torch.testing.assert_close(
                trajectory_returns(x, None, reduction=reduction, lengths=lengths.sum().reshape(1)),
                trajectory_returns(x, index, reduction=reduction),
            )

    def test_constant_runs_give_exact_zeros(self):
        x = torch.full((10,), 0.1, dtype=torch.float64)
        lengths, run_group = torch.tensor([3, 3, 4]), torch.tensor([0, 0, 0])
        assert (group_relative_advantage(x, run_group, lengths=lengths) == 0).all()

    def test_trajectory_returns_by_lengths(self):
        x, lengths, _, _ = self.runs([3, 1, 4], 1)
        traj = torch.arange(3).repeat_interleave(lengths)
        for reduction in ("sum", "mean", "max", "last"):
            torch.testing.assert_close(
                trajectory_returns(x, None, reduction=reduction, lengths=lengths),
                trajectory_returns(x, traj, reduction=reduction),
            )

    def test_needs_an_index_or_lengths(self):
        with pytest.raises(ValueError, match="index"):
            Segments(None)
