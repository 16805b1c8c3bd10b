"""Tests of :mod:`torchrl_grpo.advantages.estimators`: batch whitening, REINFORCE++-baseline,
pass@k and GDPO, against hand-computed values and a slow reference."""

import math

import pytest
import torch
from helpers.references import (
    reference_advantage,
    reference_whiten,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrl_grpo.advantages import (
    batch_whiten,
    group_relative_advantage,
    multi_reward_advantage,
    pass_at_k_advantage,
    reinforce_pp_baseline_advantage,
)


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
