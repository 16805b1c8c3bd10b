"""Tests of torchrl_grpo/advantages.py against hand-computed values and a slow reference."""

import math

import pytest
import torch
from helpers import reference_discounted_returns
from helpers.references import (
    reference_advantage,
    reference_time_step_advantage,
    reference_whiten,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrl_grpo.advantages import (
    anchor_step_groups,
    batch_whiten,
    discounted_returns,
    gigpo_advantage,
    group_mean,
    group_relative_advantage,
    group_std,
    multi_reward_advantage,
    pass_at_k_advantage,
    reinforce_pp_baseline_advantage,
    step_level_advantage,
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


def reference_passk_verl(x, groups, norm_by_std=True, epsilon=1e-6):
    """verl's ``compute_grpo_passk_outcome_advantage``: ``topk(rewards, 2)`` per group, the std
    floored at ``epsilon`` (this package's rule) where verl adds it."""
    x = x.double()
    out = torch.zeros_like(x)
    for g in groups.unique().tolist():
        idx = (groups == g).nonzero().squeeze(1)
        rewards = x[idx]
        if rewards.numel() < 2:
            continue  # verl raises; this package gives 0
        top, top_idx = torch.topk(rewards, 2)
        adv = top[0] - top[1]
        if norm_by_std:
            adv = adv / max(float(rewards.std()), epsilon)
        out[idx[top_idx[0]]] = adv
    return out


def reference_gdpo_trl(x, groups, weights, epsilon=1e-6):
    """TRL's ``normalize_then_sum``: per reward, per group ``(r - mean) / std``; weighted sum;
    ``(s - s.mean()) / s.std()``; each std floored at ``epsilon`` where TRL adds ``1e-4``."""
    x = x.double()
    per_reward = torch.zeros_like(x)
    for g in groups.unique().tolist():
        rows = groups == g
        block = x[rows]  # (n_g, K)
        std = block.std(0) if block.shape[0] > 1 else torch.zeros(block.shape[1])
        per_reward[rows] = (block - block.mean(0)) / std.clamp_min(epsilon)
    s = (per_reward * weights.double()).sum(1)
    return (s - s.mean()) / max(float(s.std()) if s.numel() > 1 else 0.0, epsilon)


def reference_gigpo(returns, groups, step_rewards, lengths, anchors, gamma, w_e, w_s, scale):
    """verl-agent's GiGPO: ``episode_norm_reward`` + ``build_step_group`` + ``step_norm_reward``
    with dictionaries, one step at a time; ``scale`` is "group" (mean_std_norm) or "none"."""
    episode = reference_advantage(returns, groups, scale_rewards=scale)  # (n,)
    step_returns = reference_discounted_returns(step_rewards.tolist(), lengths.tolist(), gamma)
    step_group = groups.repeat_interleave(lengths).tolist()
    clusters: dict = {}
    for t, (g, a) in enumerate(zip(step_group, anchors.reshape(len(step_group), -1).tolist())):
        clusters.setdefault((g, tuple(a)), []).append(t)
    step = [0.0] * len(step_group)
    for members in clusters.values():
        vals = [float(step_returns[t]) for t in members]
        n = len(vals)
        mean = sum(vals) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
        for t in members:
            step[t] = (float(step_returns[t]) - mean) / (max(std, 1e-6) if scale == "group" else 1)
    return w_e * episode.repeat_interleave(lengths) + w_s * torch.tensor(step, dtype=torch.float64)


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


class TestBatchWhiten:
    def test_by_hand(self):
        # mean 2, std sqrt(((-2)^2 + 0 + 2^2 + 0) / 3) = sqrt(8/3)
        out = batch_whiten(torch.tensor([0.0, 2.0, 4.0, 2.0]))
        s = math.sqrt(8 / 3)
        assert out.tolist() == pytest.approx([-2 / s, 0.0, 2 / s, 0.0])

    def test_weights_are_repetitions(self):
        x, w = torch.tensor([1.0, -2.0, 5.0]), torch.tensor([2.0, 1.0, 3.0])
        repeated = batch_whiten(x.repeat_interleave(w.long()))
        torch.testing.assert_close(batch_whiten(x, weights=w), repeated.unique_consecutive())
        torch.testing.assert_close(batch_whiten(x, weights=w), reference_whiten(x.tolist(), w))

    def test_matches_verl_masked_whiten_over_tokens(self):
        """verl whitens every token of the batch: a response's value counts once per token."""
        gen = torch.Generator().manual_seed(0)
        values = torch.randn(6, generator=gen, dtype=torch.float64)  # one value per response
        mask = torch.arange(5) < torch.tensor([5, 2, 3, 1, 4, 5]).unsqueeze(1)  # (6, 5) tokens
        tokens = values.unsqueeze(1).expand(6, 5)
        mean = tokens[mask].mean()
        var = ((tokens - mean).square() * mask).sum() / mask.sum() * mask.sum() / (mask.sum() - 1)
        verl = ((tokens - mean) * torch.rsqrt(var + 1e-8))[:, 0]  # verl_F.masked_whiten
        ours = batch_whiten(values, weights=mask.sum(1))
        torch.testing.assert_close(ours, verl, rtol=1e-6, atol=1e-7)

    def test_degenerate_batches(self):
        assert batch_whiten(torch.tensor([3.0])).tolist() == [0.0]  # one sample: no spread
        assert batch_whiten(torch.full((4,), 0.1)).tolist() == [0.0] * 4  # constant: exactly 0
        assert batch_whiten(torch.zeros(0)).numel() == 0
        x = torch.tensor([0.0, 1e-9])
        assert batch_whiten(x, epsilon=1e-3).tolist() == pytest.approx([-0.5e-6, 0.5e-6])

    def test_shapes_are_checked(self):
        with pytest.raises(ValueError, match="one-dimensional"):
            batch_whiten(torch.zeros(2, 3))
        with pytest.raises(ValueError, match="weights must have the shape"):
            batch_whiten(torch.zeros(3), weights=torch.ones(2))

    @settings(max_examples=60, deadline=None)
    @given(values=st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=2, max_size=30))
    def test_mean_zero_std_one(self, values):
        x = torch.tensor(values, dtype=torch.float64)
        out = batch_whiten(x)
        assert abs(float(out.mean())) < 1e-9
        if float(x.std()) > 1e-3:
            assert float(out.std()) == pytest.approx(1.0, rel=1e-9)


class TestReinforcePPBaseline:
    def test_by_hand(self):
        # groups {0, 2} and {10, 12}: centred -1, 1, -1, 1; their std sqrt(4/3)
        x, g = torch.tensor([0.0, 2.0, 10.0, 12.0]), torch.tensor([0, 0, 1, 1])
        adv = reinforce_pp_baseline_advantage(x, g)
        s = math.sqrt(4 / 3)
        assert adv.tolist() == pytest.approx([-1 / s, 1 / s, -1 / s, 1 / s])
        # scale_rewards="batch" divides by the std of the raw returns instead: sqrt(104 / 3)
        batch = group_relative_advantage(x, g, scale_rewards="batch")
        assert batch.tolist() == pytest.approx([v / math.sqrt(104 / 3) for v in (-1, 1, -1, 1)])

    def test_unequal_groups_by_hand(self):
        # groups {1, 3, 8} (mean 4) and {6, 6}: centred -3, -1, 4, 0, 0; mean 0; std sqrt(26/4)
        x, g = torch.tensor([1.0, 3.0, 8.0, 6.0, 6.0]), torch.tensor([0, 0, 0, 1, 1])
        s = math.sqrt(26 / 4)
        assert reinforce_pp_baseline_advantage(x, g).tolist() == pytest.approx(
            [-3 / s, -1 / s, 4 / s, 0.0, 0.0]
        )

    def test_is_centring_then_whitening(self):
        gen = torch.Generator().manual_seed(1)
        x, g = torch.randn(30, generator=gen), torch.randint(0, 5, (30,), generator=gen)
        got = reinforce_pp_baseline_advantage(x, g)
        torch.testing.assert_close(
            got, group_relative_advantage(x, g, scale_rewards="none", whiten=True)
        )
        torch.testing.assert_close(
            got, reference_advantage(x, g, scale_rewards="none", whiten=True)
        )

    def test_token_weights_match_verl(self):
        """With each response's token count as its weight: verl's ``reinforce_plus_plus_baseline``
        (group mean subtracted, then ``masked_whiten`` over every token)."""
        gen = torch.Generator().manual_seed(2)
        scores = torch.randn(8, generator=gen, dtype=torch.float64)
        g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
        tokens = torch.tensor([3, 1, 4, 1, 5, 2, 6, 5])
        mask = torch.arange(6) < tokens.unsqueeze(1)  # (8, 6)
        centred = scores - torch.stack([scores[g == k].mean() for k in (0, 1)])[g]
        per_token = centred.unsqueeze(1).expand(8, 6)
        mean = per_token[mask].mean()
        var = ((per_token - mean).square() * mask).sum() / (mask.sum() - 1)
        verl = ((per_token - mean) * torch.rsqrt(var + 1e-8))[:, 0]
        ours = reinforce_pp_baseline_advantage(scores, g, weights=tokens)
        torch.testing.assert_close(ours, verl, rtol=1e-6, atol=1e-7)

    def test_whiten_false_is_plain_grpo(self):
        gen = torch.Generator().manual_seed(3)
        x, g = torch.randn(20, generator=gen), torch.randint(0, 4, (20,), generator=gen)
        torch.testing.assert_close(
            group_relative_advantage(x, g, whiten=False), reference_advantage(x, g)
        )

    @settings(max_examples=60, deadline=None)
    @given(
        rewards=st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=2, max_size=40),
        num_groups=st.integers(1, 5),
        seed=st.integers(0, 2**16),
    )
    def test_groups_centred_batch_unit_std_order_invariant(self, rewards, num_groups, seed):
        gen = torch.Generator().manual_seed(seed)
        x = torch.tensor(rewards, dtype=torch.float64)
        g = torch.randint(0, num_groups, (len(rewards),), generator=gen)
        adv = reinforce_pp_baseline_advantage(x, g)
        for k in g.unique().tolist():  # equal weights: the batch mean of centred values is 0
            assert abs(float(adv[g == k].mean())) < 1e-6
        centred = (
            x
            - torch.stack([x[g == k].mean() for k in range(num_groups) if (g == k).any()])[
                torch.unique(g, return_inverse=True)[1]
            ]
        )
        if float(centred.std()) > 1e-3:
            assert float(adv.std()) == pytest.approx(1.0, rel=1e-6)
        perm = torch.randperm(len(rewards), generator=gen)
        torch.testing.assert_close(reinforce_pp_baseline_advantage(x[perm], g[perm]), adv[perm])


class TestPassAtK:
    def test_by_hand(self):
        x = torch.tensor([0.0, 3.0, 1.0])
        g = torch.zeros(3, dtype=torch.long)
        assert pass_at_k_advantage(x, g, scale_rewards="none").tolist() == [0.0, 2.0, 0.0]
        std = math.sqrt(7 / 3)  # of 0, 3, 1
        assert pass_at_k_advantage(x, g).tolist() == pytest.approx([0.0, 2 / std, 0.0])

    def test_ties_and_tiny_groups_give_zero(self):
        x = torch.tensor([2.0, 2.0, 1.0, 5.0, 4.0, 4.0, 4.0])
        g = torch.tensor([0, 0, 0, 1, 2, 2, 2])  # a tie at the top; a group of one; a constant
        assert pass_at_k_advantage(x, g).tolist() == [0.0] * 7

    def test_negative_rewards(self):
        x, g = torch.tensor([-5.0, -1.0, -3.0, -1.5]), torch.zeros(4, dtype=torch.long)
        assert pass_at_k_advantage(x, g, scale_rewards="none").tolist() == [0.0, 0.5, 0.0, 0.0]

    def test_pairs_are_the_positive_part_of_rloo(self):
        """With two samples a group's runner-up is the other sample: pass@k = max(RLOO, 0)."""
        gen = torch.Generator().manual_seed(4)
        x, g = torch.randn(20, generator=gen), torch.arange(10).repeat_interleave(2)
        rloo = group_relative_advantage(x, g, baseline="leave_one_out", scale_rewards="none")
        torch.testing.assert_close(
            pass_at_k_advantage(x, g, scale_rewards="none"), rloo.clamp_min(0)
        )

    @settings(max_examples=80, deadline=None)
    @given(
        rewards=st.lists(st.integers(0, 3), min_size=2, max_size=30),  # small ints: many ties
        num_groups=st.integers(1, 4),
        scale=st.sampled_from(["group", "none"]),
        seed=st.integers(0, 2**16),
    )
    def test_matches_verl_and_is_order_invariant(self, rewards, num_groups, scale, seed):
        gen = torch.Generator().manual_seed(seed)
        x = torch.tensor(rewards, dtype=torch.float64)
        g = torch.randint(0, num_groups, (len(rewards),), generator=gen)
        adv = pass_at_k_advantage(x, g, scale_rewards=scale)
        torch.testing.assert_close(adv, reference_passk_verl(x, g, norm_by_std=scale == "group"))
        for k in g.unique().tolist():  # at most one non-zero, never negative
            assert int((adv[g == k] != 0).sum()) <= 1 and (adv[g == k] >= 0).all()
        perm = torch.randperm(len(rewards), generator=gen)
        torch.testing.assert_close(
            pass_at_k_advantage(x[perm], g[perm], scale_rewards=scale), adv[perm]
        )


class TestMultiReward:
    def test_by_hand(self):
        # group 0: correctness (1, 0, 0), format (1, 1, 0); group 1: correctness constant
        x = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 2.0], [1.0, 0.0]])
        g = torch.tensor([0, 0, 0, 1, 1])
        w = torch.tensor([2.0, 1.0])
        s = math.sqrt(1 / 3)  # the std of (1, 0, 0) and of (1, 1, 0); group 1's format: sqrt(2)
        per_sample = [
            2 * (2 / 3) / s + (1 / 3) / s,
            2 * (-1 / 3) / s + (1 / 3) / s,
            2 * (-1 / 3) / s + (-2 / 3) / s,
            0.0 + 1 / math.sqrt(2),  # constant correctness contributes 0
            0.0 - 1 / math.sqrt(2),
        ]
        got = multi_reward_advantage(x, g, weights=w, whiten=False)
        assert got.tolist() == pytest.approx(per_sample)
        torch.testing.assert_close(
            multi_reward_advantage(x, g, weights=w), reference_whiten(per_sample, [1] * 5)
        )

    def test_matches_trl(self):
        gen = torch.Generator().manual_seed(5)
        x = torch.randint(0, 3, (24, 3), generator=gen).double()
        g = torch.arange(6).repeat_interleave(4)
        w = torch.tensor([1.0, 0.3, 0.1])
        torch.testing.assert_close(
            multi_reward_advantage(x, g, weights=w), reference_gdpo_trl(x, g, w)
        )

    def test_one_reward_is_grpo(self):
        gen = torch.Generator().manual_seed(6)
        x, g = torch.randn(20, generator=gen), torch.randint(0, 4, (20,), generator=gen)
        for whiten in (False, True):
            torch.testing.assert_close(
                multi_reward_advantage(x.unsqueeze(1), g, whiten=whiten),
                group_relative_advantage(x, g, whiten=whiten),
            )

    def test_runs_match_the_index(self):
        gen = torch.Generator().manual_seed(7)
        lengths = torch.tensor([3, 1, 4, 2, 2])
        run_group = torch.tensor([0, 1, 0, 1, 2])
        x = torch.randn(int(lengths.sum()), 2, generator=gen, dtype=torch.float64)
        by_run = multi_reward_advantage(
            x, run_group, 3, lengths=lengths, weights=torch.tensor([1.0, 2.0])
        )
        by_index = multi_reward_advantage(
            x, run_group.repeat_interleave(lengths), 3, weights=torch.tensor([1.0, 2.0])
        )
        torch.testing.assert_close(by_run, by_index)

    def test_shapes_are_checked(self):
        g = torch.zeros(3, dtype=torch.long)
        with pytest.raises(ValueError, match=r"x must be \(S, K\)"):
            multi_reward_advantage(torch.zeros(3), g)
        with pytest.raises(ValueError, match="one entry per reward"):
            multi_reward_advantage(torch.zeros(3, 2), g, weights=torch.ones(3))
        with pytest.raises(ValueError, match="one entry per sample"):
            multi_reward_advantage(torch.zeros(3, 2), torch.zeros(2, dtype=torch.long))

    @settings(max_examples=60, deadline=None)
    @given(
        seed=st.integers(0, 2**16),
        scale=st.floats(0.01, 100.0),
        shift=st.floats(-100.0, 100.0),
    )
    def test_each_reward_scale_free_and_groups_centred(self, seed, scale, shift):
        """Decoupled normalization: an affine change of one reward changes nothing (GRPO on the
        sum would); without the whitening every group is centred."""
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(16, 2, generator=gen, dtype=torch.float64)
        g = torch.arange(4).repeat_interleave(4)
        moved = x.clone()
        moved[:, 1] = moved[:, 1] * scale + shift
        adv = multi_reward_advantage(x, g, whiten=False)
        torch.testing.assert_close(multi_reward_advantage(moved, g, whiten=False), adv)
        for k in range(4):
            assert abs(float(adv[g == k].mean())) < 1e-9


class TestDiscountedReturns:
    def test_by_hand(self):
        r = torch.tensor([1.0, 2.0, 4.0, 10.0, 0.0])
        out = discounted_returns(r, torch.tensor([3, 2]), 0.5)
        assert out.tolist() == [1 + 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4, 4.0, 10.0, 0.0]
        assert discounted_returns(r, torch.tensor([3, 2]), 1.0).tolist() == [7, 6, 4, 10, 0]
        assert discounted_returns(r, torch.tensor([3, 2]), 0.0).tolist() == r.tolist()

    def test_long_trajectory_stays_finite(self):
        r = torch.ones(5000, dtype=torch.float64)
        out = discounted_returns(r, torch.tensor([5000]), 0.99)
        want = (1 - 0.99 ** torch.arange(5000, 0, -1, dtype=torch.float64)) / 0.01
        torch.testing.assert_close(out, want)

    @settings(max_examples=60, deadline=None)
    @given(
        lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12),
        gamma=st.floats(0.0, 1.0),
        seed=st.integers(0, 2**16),
    )
    def test_matches_a_loop(self, lengths, gamma, seed):
        gen = torch.Generator().manual_seed(seed)
        r = torch.randn(sum(lengths), generator=gen, dtype=torch.float64)
        got = discounted_returns(r, torch.tensor(lengths), gamma)
        torch.testing.assert_close(got, reference_discounted_returns(r.tolist(), lengths, gamma))

    def test_bad_input(self):
        with pytest.raises(ValueError, match="gamma"):
            discounted_returns(torch.ones(2), torch.tensor([2]), 1.5)
        with pytest.raises(ValueError, match="lengths sum to 3"):
            discounted_returns(torch.ones(2), torch.tensor([3]), 0.9)
        with pytest.raises(ValueError, match="one-dimensional"):
            discounted_returns(torch.ones(2, 1), torch.tensor([2]), 0.9)


class TestAnchorStepGroups:
    def test_by_hand(self):
        group = torch.tensor([0, 0, 0, 1, 1, 1])
        obs = torch.tensor([[0.5, 1.0], [0.5, 2.0], [0.5, 1.0], [0.5, 1.0], [9.0, 9.0], [0.5, 1.0]])
        codes, num = anchor_step_groups(group, obs)
        assert num == 4
        assert codes[0] == codes[2] and codes[3] == codes[5]  # equal states, same group
        assert len({int(codes[0]), int(codes[1]), int(codes[3]), int(codes[4])}) == 4

    def test_hash_ids_of_any_size(self):
        hashes = torch.tensor([2**62, -(2**62), 2**62, 7])
        codes, num = anchor_step_groups(torch.zeros(4, dtype=torch.long), hashes)
        assert num == 3 and codes[0] == codes[2] and codes[1] != codes[3]

    def test_shapes_are_checked(self):
        with pytest.raises(ValueError, match="one entry per step"):
            anchor_step_groups(torch.zeros(3, dtype=torch.long), torch.zeros(2, 4))

    def test_a_hash_collision_is_caught(self):
        p = 1099511628211  # the multiplier of the hash: rows (0, p) and (1, 0) both hash to p
        codes, num = anchor_step_groups(
            torch.zeros(3, dtype=torch.long), torch.tensor([[0, p], [1, 0], [0, p]])
        )
        assert num == 2 and codes[0] == codes[2] != codes[1]

    def test_signed_zero_is_zero(self):
        codes, num = anchor_step_groups(torch.zeros(2, dtype=torch.long), torch.tensor([0.0, -0.0]))
        assert num == 1

    @settings(max_examples=60, deadline=None)
    @given(
        kind=st.sampled_from(["small ids", "hashes", "float vectors", "int vectors"]),
        steps=st.integers(1, 60),
        seed=st.integers(0, 2**16),
    )
    def test_equal_iff_group_and_state_are(self, kind, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        group = torch.randint(0, 3, (steps,), generator=gen)
        choice = torch.randint(0, 4, (steps,), generator=gen)  # 4 distinct states, repeated
        states = {
            "small ids": torch.tensor([3, -1, 7, 0]),
            "hashes": torch.tensor([2**62, -(2**61), 12345, -7]),
            "float vectors": torch.randn(4, 3, generator=gen),
            "int vectors": torch.randint(-5, 5, (4, 2), generator=gen),
        }[kind]
        anchor = states[choice]
        codes, num = anchor_step_groups(group, anchor)
        pairs = list(zip(group.tolist(), map(tuple, anchor.reshape(steps, -1).tolist())))
        assert num == len(set(pairs))
        for i in range(steps):
            for j in range(steps):
                assert (codes[i] == codes[j]) == (pairs[i] == pairs[j])


class TestGiGPO:
    @staticmethod
    def episodes(seed, num_groups=3, size=4, states=3):
        """Random multi-step episodes whose states repeat across the trajectories of a group."""
        gen = torch.Generator().manual_seed(seed)
        n = num_groups * size
        lengths = torch.randint(1, 6, (n,), generator=gen)
        groups = torch.arange(num_groups).repeat_interleave(size)
        steps = int(lengths.sum())
        rewards = torch.randint(0, 2, (steps,), generator=gen).double()
        anchors = torch.randint(0, states, (steps, 2), generator=gen)
        returns = trajectory_returns(rewards, None, reduction="sum", lengths=lengths)
        return returns, groups, rewards, lengths, anchors

    def test_by_hand(self):
        # Two trajectories from state 7: the first reaches 8 and succeeds, the second reaches 9
        # and fails. Episode: returns 1, 0 -> +-0.5. Steps from 7: discounted returns 0.5, 0.
        r = torch.tensor([0.0, 1.0, 0.0, 0.0])
        obs = torch.tensor([7, 8, 7, 9])
        adv = gigpo_advantage(
            torch.tensor([1.0, 0.0]),
            torch.tensor([0, 0]),
            r,
            torch.tensor([2, 2]),
            obs,
            gamma=0.5,
            step_weight=2.0,
            scale_rewards="none",
        )
        assert adv.tolist() == [0.5 + 2 * 0.25, 0.5, -0.5 - 2 * 0.25, -0.5]

    @pytest.mark.parametrize("scale", ["group", "none"])
    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_matches_verl_agent(self, scale, seed):
        returns, groups, rewards, lengths, anchors = self.episodes(seed)
        got = gigpo_advantage(
            returns,
            groups,
            rewards,
            lengths,
            anchors,
            gamma=0.9,
            step_weight=0.7,
            episode_weight=1.3,
            scale_rewards=scale,
        )
        want = reference_gigpo(returns, groups, rewards, lengths, anchors, 0.9, 1.3, 0.7, scale)
        torch.testing.assert_close(got, want)

    def test_step_weight_zero_is_grpo(self):
        returns, groups, rewards, lengths, anchors = self.episodes(3)
        got = gigpo_advantage(returns, groups, rewards, lengths, anchors, step_weight=0.0)
        grpo = group_relative_advantage(returns, groups).repeat_interleave(lengths)
        torch.testing.assert_close(got, grpo)

    def test_step_groups_are_centred_and_lone_steps_zero(self):
        returns, groups, rewards, lengths, anchors = self.episodes(4)
        step_group, num = anchor_step_groups(groups.repeat_interleave(lengths), anchors)
        adv = step_level_advantage(rewards, lengths, step_group, num, gamma=0.95)
        sizes = torch.bincount(step_group, minlength=num)
        for k in range(num):
            assert abs(float(adv[step_group == k].mean())) < 1e-9
            if sizes[k] == 1:
                assert float(adv[step_group == k]) == 0.0

    def test_order_of_trajectories_does_not_matter(self):
        returns, groups, rewards, lengths, anchors = self.episodes(5)
        adv = gigpo_advantage(returns, groups, rewards, lengths, anchors)
        perm = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0))
        starts = torch.cumsum(lengths, 0) - lengths
        step_perm = torch.cat(
            [torch.arange(int(s), int(s + n)) for s, n in zip(starts[perm], lengths[perm])]
        )
        moved = gigpo_advantage(
            returns[perm], groups[perm], rewards[step_perm], lengths[perm], anchors[step_perm]
        )
        torch.testing.assert_close(moved, adv[step_perm])

    def test_shapes_are_checked(self):
        with pytest.raises(ValueError, match="lengths must have one entry per trajectory"):
            gigpo_advantage(
                torch.ones(2),
                torch.zeros(2, dtype=torch.long),
                torch.ones(3),
                torch.tensor([3]),
                torch.zeros(3),
            )


class TestDevices:
    """The public estimators on ``device`` inputs: outputs there, equal to the CPU's."""

    def test_every_estimator(self, device):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(12, generator=gen)
        groups = torch.arange(4).repeat_interleave(3)
        lengths = torch.tensor([2, 1, 3, 2, 2, 1, 1, 3, 2, 1, 2, 2])
        steps = int(lengths.sum())
        step_rewards = torch.rand(steps, generator=gen)
        anchors = torch.randint(0, 3, (steps,), generator=gen)
        two = torch.randn(12, 2, generator=gen)
        calls = {
            "grpo": lambda d: group_relative_advantage(x.to(d), groups.to(d)),
            "whiten": lambda d: group_relative_advantage(x.to(d), groups.to(d), whiten=True),
            "pass_at_k": lambda d: pass_at_k_advantage(x.to(d), groups.to(d)),
            "rloo": lambda d: group_relative_advantage(
                x.to(d), groups.to(d), baseline="leave_one_out"
            ),
            "gdpo": lambda d: multi_reward_advantage(two.to(d), groups.to(d)),
            "returns": lambda d: trajectory_returns(
                step_rewards.to(d), None, reduction="sum", lengths=lengths.to(d)
            ),
            "discounted": lambda d: discounted_returns(step_rewards.to(d), lengths.to(d), 0.9),
            "gigpo": lambda d: gigpo_advantage(
                x.to(d), groups.to(d), step_rewards.to(d), lengths.to(d), anchors.to(d), gamma=0.9
            ),
        }
        for name, call in calls.items():
            want, got = call("cpu"), call(device)
            assert got.device.type == device.type, name
            torch.testing.assert_close(got.cpu(), want, msg=name)
