"""Tests of :mod:`torchrl_grpo.advantages.step_groups`: GiGPO's step groups, against hand-computed
values and a slow reference."""

import math

import pytest
import torch
from helpers import reference_discounted_returns
from helpers.references import (
    reference_advantage,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrl_grpo.advantages import (
    anchor_step_groups,
    discounted_returns,
    gigpo_advantage,
    group_relative_advantage,
    step_level_advantage,
    trajectory_returns,
)


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
