"""Tests of :mod:`torchrl_grpo.advantages.group_relative`: GRPO's group-relative advantage (per
trajectory and per time step) and its registries, against hand-computed values and a slow
reference."""

import math

import pytest
import torch
from helpers.references import (
    reference_advantage,
    reference_time_step_advantage,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrl_grpo.advantages import (
    SCALES,
    Scale,
    group_relative_advantage,
    group_std,
    multi_reward_advantage,
)


class TestGroupRelativeAdvantage:
    @pytest.mark.parametrize("baseline", ["mean", "leave_one_out", "pass_at_k"])
    @pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
    @pytest.mark.parametrize("whiten", [False, True])
    def test_matches_reference(self, baseline, scale_rewards, whiten):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(40, generator=gen)
        g = torch.randint(0, 6, (40,), generator=gen)
        got = group_relative_advantage(
            x, g, baseline=baseline, scale_rewards=scale_rewards, whiten=whiten
        )
        want = reference_advantage(x, g, baseline, scale_rewards, whiten=whiten)
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

    @settings(max_examples=60, deadline=None)
    @given(
        values=st.lists(
            st.floats(-1e6, 1e6, allow_nan=False, allow_subnormal=False), min_size=1, max_size=6
        ),
        size=st.integers(1, 2000),
        seed=st.integers(0, 2**16),
    )
    def test_large_constant_groups_give_exact_zeros(self, values, size, seed):
        """A constant group gives exactly 0 in every form (index, runs), however large."""
        x = torch.tensor(values, dtype=torch.float64).repeat_interleave(size)  # group k: values[k]
        g = torch.arange(len(values)).repeat_interleave(size)
        perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(seed))
        for scale in ("group", "batch", "none"):
            assert (group_relative_advantage(x[perm], g[perm], scale_rewards=scale) == 0).all()
            runs = torch.full((len(values),), size)
            got = group_relative_advantage(
                x, torch.arange(len(values)), lengths=runs, scale_rewards=scale
            )
            assert (got == 0).all()

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


class TestByTimeStep:
    """``by_time_step=True``: the baseline over the group's samples at the same time step, the
    scale the pooled std of those deviations (rewards-to-go)."""

    @staticmethod
    def flat(groups):
        """Runs laid flat: ``(x, group of each run, lengths)``."""
        x = [v for trajs in groups for t in trajs for v in t]
        group = [g for g, trajs in enumerate(groups) for _ in trajs]
        lengths = [len(t) for trajs in groups for t in trajs]
        return torch.tensor(x, dtype=torch.float64), torch.tensor(group), torch.tensor(lengths)

    def test_by_hand(self):
        # one group: returns-to-go [3, 2, 1] and [5, 3, 2, 1]; at t = 0: 3 vs 5, t = 1: 2 vs 3,
        # t = 2: 1 vs 2, t = 3: 1 alone; deviations -1, -0.5, -0.5 | 1, 0.5, 0.5, 0;
        # pooled: (1 + 0.25 * 4 + 1) / (7 samples - 4 time steps) = 1
        x, g, lengths = self.flat([[[3.0, 2.0, 1.0], [5.0, 3.0, 2.0, 1.0]]])
        got = group_relative_advantage(x, g, lengths=lengths, by_time_step=True)
        want = [-1.0, -0.5, -0.5, 1.0, 0.5, 0.5, 0.0]
        assert got.tolist() == pytest.approx(want)
        assert group_std(x, g, lengths=lengths, by_time_step=True).tolist() == pytest.approx([1])

    def test_identical_trajectories_give_exact_zeros(self):
        """The issue's case: a group of identical episodes (CartPole, rewards 1 to the end) got
        advantages from -0.78 to +3.24 by time step with the baseline over all steps."""
        to_go = [1.0 + 0.99 * (1 - 0.99**k) / 0.01 for k in reversed(range(30))]
        x, g, lengths = self.flat([[to_go] * 4, [to_go[:10]] * 3])
        for scale in ("group", "batch", "none"):
            for baseline in ("mean", "leave_one_out", "pass_at_k"):
                got = group_relative_advantage(
                    x,
                    g,
                    lengths=lengths,
                    by_time_step=True,
                    baseline=baseline,
                    scale_rewards=scale,
                )
                assert (got == 0).all(), (baseline, scale)
        assert (group_std(x, g, lengths=lengths, by_time_step=True) == 0).all()
        before = group_relative_advantage(x, g, lengths=lengths)  # the baseline over all steps
        assert float(before.abs().max()) > 1.0

    def test_steps_keep_their_weights(self):
        """Early steps, whose returns-to-go differ little, get small advantages: one scale for
        the whole group, not one per time step."""
        long, short = [3.0, 2.0, 1.0], [2.9, 1.5, 0.2]
        x, g, lengths = self.flat([[long, short]])
        got = group_relative_advantage(x, g, lengths=lengths, by_time_step=True)
        assert got[0] == pytest.approx(-got[3]) and abs(float(got[0])) < abs(float(got[2]))

    @settings(max_examples=60, deadline=None)
    @given(
        groups=st.lists(
            st.lists(
                st.lists(st.floats(-100, 100, allow_nan=False), min_size=1, max_size=6),
                min_size=1,
                max_size=4,
            ),
            min_size=1,
            max_size=4,
        ),
        baseline=st.sampled_from(["mean", "leave_one_out", "pass_at_k"]),
        scale=st.sampled_from(["group", "batch", "none"]),
    )
    def test_equals_reference(self, groups, baseline, scale):
        x, g, lengths = self.flat(groups)
        got = group_relative_advantage(
            x, g, lengths=lengths, by_time_step=True, baseline=baseline, scale_rewards=scale
        )
        want = reference_time_step_advantage(groups, baseline=baseline, scale_rewards=scale)
        flat = [v for trajs in want for t in trajs for v in t]
        assert got.tolist() == pytest.approx(flat, rel=1e-6, abs=1e-6)

    def test_several_rewards_sum_each_rewards_advantage(self):
        x, g, lengths = self.flat([[[3.0, 2.0, 1.0], [5.0, 3.0]], [[1.0], [2.0, 4.0]]])
        y = torch.flip(x, [0]) * 0.5
        got = multi_reward_advantage(
            torch.stack([x, y], 1),
            g,
            lengths=lengths,
            by_time_step=True,
            whiten=False,
            weights=torch.tensor([1.0, 2.0]),
        )
        each = [group_relative_advantage(v, g, lengths=lengths, by_time_step=True) for v in (x, y)]
        torch.testing.assert_close(got, each[0] + 2 * each[1])

    def test_needs_runs(self):
        with pytest.raises(ValueError, match="by_time_step needs the samples as runs"):
            group_relative_advantage(
                torch.ones(3), torch.zeros(3, dtype=torch.long), by_time_step=True
            )


# --- the registries are the whole contract: a scale added to SCALES works wherever a scale is
# looked up, or is refused by name where it has no form


@pytest.fixture
def half_group():
    """A scale of its own: half the group's std, per group and pooled over time steps."""
    group, batch = SCALES["group"], SCALES["batch"]
    SCALES["half"] = Scale(
        lambda *args: 0.5 * group(*args), lambda m2, dof: 0.5 * group.pooled(m2, dof)
    )
    SCALES["plain"] = batch.per_group  # a bare function: no form pooled over time steps
    yield
    del SCALES["half"], SCALES["plain"]


def test_a_new_scale_is_used_everywhere(half_group):
    x = torch.tensor([1.0, 2.0, 4.0, 0.0, 3.0, 5.0, 1.0, 2.0])
    steps = {"group_index": torch.tensor([0, 0, 1, 1]), "lengths": torch.tensor([2, 2, 2, 2])}
    per_sample = {"group_index": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])}
    for kw in (per_sample, {**steps, "by_time_step": True}):  # runs of two steps, two a group
        std = group_relative_advantage(x, scale_rewards="group", **kw)
        half = group_relative_advantage(x, scale_rewards="half", **kw)
        torch.testing.assert_close(half, 2 * std)


def test_a_scale_without_a_pooled_form_is_refused_by_the_time_step_baseline(half_group):
    x, g = torch.arange(8.0), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    torch.testing.assert_close(
        group_relative_advantage(x, g, scale_rewards="plain"),
        group_relative_advantage(x, g, scale_rewards="batch"),
    )
    with pytest.raises(ValueError, match="'plain' has no form pooled over time steps"):
        group_relative_advantage(
            x,
            torch.tensor([0, 0, 1, 1]),
            scale_rewards="plain",
            lengths=torch.tensor([2, 2, 2, 2]),
            by_time_step=True,
        )


def test_mcadvantage_refuses_it_at_construction(half_group):
    from torchrl_grpo import MCAdvantage
    from torchrl_grpo.mcadvantage import GroupRelative, RewardToGo

    def by_time_step(scale):
        group = GroupRelative(scale_rewards=scale)
        return MCAdvantage(4, estimator=RewardToGo(1.0, baseline="time_step", group=group))

    with pytest.raises(ValueError, match="'plain', has no form pooled over time steps"):
        by_time_step("plain")
    by_time_step("half")
