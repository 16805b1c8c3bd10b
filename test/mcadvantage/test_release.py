"""Tests of torchrl_grpo/mcadvantage/release.py: the advantages written on released groups."""

import random

import pytest
import torch
from helpers import (
    GDPO_KEYS,
    agent_episodes,
    random_chunks,
    released,
    stream_outputs,
    trajectory,
)
from helpers.states import KEYS, options_of
from tensordict import NonTensorStack, TensorDict, lazy_stack

from torchrl_grpo import MCAdvantage, group_relative_advantage
from torchrl_grpo.advantages import (
    gigpo_advantage,
    multi_reward_advantage,
    pass_at_k_advantage,
    reinforce_pp_baseline_advantage,
    step_level_advantage,
)
from torchrl_grpo.mcadvantage.estimators import (
    GroupRelative,
    RewardToGo,
    StepGroups,
    released_anchors,
)
from torchrl_grpo.mcadvantage.groups import find_rounds
from torchrl_grpo.mcadvantage.options import GroupFilter
from torchrl_grpo.mcadvantage.read import read_insertion
from torchrl_grpo.mcadvantage.records import Pending
from torchrl_grpo.mcadvantage.release import release
from torchrl_grpo.mcadvantage.returns import insertion_returns
from torchrl_grpo.mcadvantage.steps import DenseSteps, RaggedSteps

GRPO = GroupRelative()
NO_FILTER = GroupFilter(None, None)


class TestRelease:
    def released(
        self, trajs, estimator=GRPO, group_filter=NO_FILTER, size=None, keys=KEYS, mode=None
    ):
        batch = read_insertion(torch.cat(trajs), keys, Pending())
        rounds = find_rounds(Pending(), batch, size or len(trajs))
        returns = insertion_returns(batch, mode, exact=mode is not None)
        options = options_of(
            estimator=estimator, group_filter=group_filter, keys=keys, trajectory_return=mode
        )
        out = release(Pending(), batch, rounds, returns, options)
        return out, batch, rounds

    def test_per_step_advantages(self):
        trajs = [
            trajectory(0, [1.0, 2.0]),
            trajectory(1, [5.0]),
            trajectory(0, [3.0]),
            trajectory(1, [1.0]),
        ]
        out, batch, _ = self.released(trajs, size=2)
        want = group_relative_advantage(batch.rewards, torch.tensor([0, 0, 1, 0, 1]), 2).float()
        assert out.out is batch.steps.data  # everything released: the insertion, as it came
        assert torch.equal(out.out["advantage"].reshape(-1), want)
        assert (out.written, out.selected) == (2, 2)

    def test_trajectory_advantages_on_every_step(self):
        trajs = [trajectory(0, [1.0, 2.0]), trajectory(0, [0.0]), trajectory(0, [4.0, 4.0, 4.0])]
        out, _, _ = self.released(trajs, mode="sum")
        per_trajectory = group_relative_advantage(
            torch.tensor([3.0, 0.0, 12.0]), torch.zeros(3, dtype=torch.long), 1
        ).float()
        want = per_trajectory.repeat_interleave(torch.tensor([2, 1, 3]))
        assert torch.equal(out.out["advantage"].reshape(-1), want)

    def test_a_filtered_group_is_not_written(self):
        trajs = [
            trajectory(0, [1.0]),
            trajectory(0, [1.0]),
            trajectory(1, [0.0]),
            trajectory(1, [1.0]),
        ]
        out, _, _ = self.released(
            trajs,
            mode="sum",
            group_filter=GroupFilter((0.1, 0.9), None),
            size=2,
        )
        assert out.out["seed"].tolist() == [1, 1] and (out.written, out.selected) == (1, 1)


class TestBeyondTorchRL:
    """The released groups' advantages with whitening, several rewards and step groups."""

    released = TestRelease.released

    def test_whitened_per_step_samples(self):
        trajs = [
            trajectory(0, [1.0, 2.0]),
            trajectory(0, [6.0]),
            trajectory(1, [0.0]),
            trajectory(1, [3.0]),
        ]
        estimator = GroupRelative(scale_rewards="none", whiten=True)
        out, batch, _ = self.released(trajs, estimator=estimator, size=2)
        want = reinforce_pp_baseline_advantage(batch.rewards, torch.tensor([0, 0, 0, 1, 1]))
        torch.testing.assert_close(
            out.out["advantage"].reshape(-1).double(), want, rtol=1e-6, atol=1e-6
        )

    def test_several_rewards(self):
        trajs = [
            trajectory(0, [1.0], next_format=[[0.0]]),
            trajectory(0, [0.0], next_format=[[2.0]]),
        ]
        trajs += [trajectory(0, [1.0], next_format=[[1.0]])]
        keys = KEYS._replace(reward_weights=((("next", "reward"), 1.0), (("next", "format"), 2.0)))
        out, _, _ = self.released(trajs, estimator=GroupRelative(whiten=True), keys=keys)
        x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
        want = multi_reward_advantage(
            x, torch.zeros(3, dtype=torch.long), weights=torch.tensor([1.0, 2.0])
        )
        torch.testing.assert_close(
            out.out["advantage"].reshape(-1).double(), want, rtol=1e-6, atol=1e-6
        )

    def test_step_groups(self):
        trajs = [
            trajectory(0, [0.0, 1.0], obs=["start", "won"]),
            trajectory(0, [0.0, 0.0], obs=["start", "lost"]),
        ]
        estimator = StepGroups(1.0, 2.0, 0.5, anchor_key="obs")
        keys = KEYS._replace(anchor="obs")
        out, _, _ = self.released(trajs, estimator=estimator, keys=keys, mode="sum")
        want = gigpo_advantage(
            torch.tensor([1.0, 0.0]),
            torch.zeros(2, dtype=torch.long),
            torch.tensor([0.0, 1.0, 0.0, 0.0]),
            torch.tensor([2, 2]),
            torch.tensor([0, 1, 0, 2]),
            gamma=0.5,
            step_weight=2.0,
        )
        torch.testing.assert_close(
            out.out["advantage"].reshape(-1).double(), want, rtol=1e-6, atol=1e-6
        )

    def test_reward_to_go_samples(self):
        """Each element's discounted sum to its trajectory's end is the sample: by hand, with
        the groups released in another order than they arrived."""
        trajs = [
            trajectory(0, [1.0, 2.0, 4.0]),
            trajectory(1, [5.0, 1.0]),
            trajectory(0, [8.0]),
            trajectory(1, [2.0]),
        ]
        out, _, _ = self.released(trajs, estimator=RewardToGo(0.5), size=2)
        samples = torch.tensor([1 + 1 + 1, 2 + 2, 4, 5 + 0.5, 1, 8, 2], dtype=torch.float64)
        want = group_relative_advantage(samples, torch.tensor([0, 0, 0, 1, 1, 0, 1]), 2).float()
        assert torch.equal(out.out["advantage"].reshape(-1), want)

    def test_reward_to_go_element_by_element(self):
        """Two reward elements per step: each discounted along the steps on its own."""
        out, _, _ = self.released(
            [trajectory(0, [[1.0, 3.0], [1.0, 1.0]]), trajectory(0, [[2.0, 0.0]])],
            estimator=RewardToGo(0.5),
        )
        samples = torch.tensor([1.5, 3.5, 1.0, 1.0, 2.0, 0.0], dtype=torch.float64)
        want = group_relative_advantage(samples, torch.zeros(6, dtype=torch.long), 1).float()
        assert torch.equal(out.out["advantage"].reshape(-1), want)
        assert out.out["advantage"].shape == (3, 2)

    def test_reward_to_go_by_time_step(self):
        """Each element's discounted sum to its trajectory's end is the sample, compared with
        the group's samples at the same time step: by hand, with the groups released in another
        order than they arrived."""
        trajs = [
            trajectory(0, [1.0, 2.0, 4.0]),
            trajectory(1, [5.0, 1.0]),
            trajectory(0, [8.0]),
            trajectory(1, [2.0]),
        ]
        out, _, _ = self.released(
            trajs,
            estimator=RewardToGo(0.5, "time_step"),
            size=2,
        )
        # group 0: to-go [3, 4, 4] and [8]; t = 0: 3 vs 8 (deviations -2.5, 2.5), t = 1 and 2
        # alone (0); pooled std sqrt(12.5 / (4 samples - 3 time steps)); group 1: [5.5, 1] and
        # [2]: t = 0 deviations 1.75, -1.75, pooled std sqrt(6.125 / (3 - 2))
        s0, s1 = 12.5**0.5, 6.125**0.5
        want = [-2.5 / s0, 0.0, 0.0, 1.75 / s1, 0.0, 2.5 / s0, -1.75 / s1]
        assert out.out["advantage"].reshape(-1).tolist() == pytest.approx(want, rel=1e-6)

    def test_reward_to_go_by_time_step_element_by_element(self):
        """Two reward elements per step: each discounted along the steps on its own, and each
        compared with the same element of the same time step."""
        out, _, _ = self.released(
            [trajectory(0, [[1.0, 3.0], [1.0, 1.0]]), trajectory(0, [[2.0, 0.0]])],
            estimator=RewardToGo(0.5, "time_step"),
        )
        # to-go [[1.5, 3.5], [1, 1]] and [[2, 0]]: step 0 element 0: 1.5 vs 2, element 1: 3.5
        # vs 0; step 1 alone; pooled: (0.0625 * 2 + 3.0625 * 2) / (6 - 4)
        scale = ((0.0625 * 2 + 3.0625 * 2) / 2) ** 0.5
        want = [-0.25 / scale, 1.75 / scale, 0.0, 0.0, 0.25 / scale, -1.75 / scale]
        assert out.out["advantage"].reshape(-1).tolist() == pytest.approx(want, rel=1e-6)
        assert out.out["advantage"].shape == (3, 2)


class TestReleasedAnchors:
    def test_tensors_as_they_are(self):
        td = trajectory(0, [1.0, 2.0], obs=[[1, 2], [3, 4]])
        assert torch.equal(released_anchors(DenseSteps(td), "obs"), torch.tensor([[1, 2], [3, 4]]))

    def test_strings_and_ragged_tensors_by_dictionary(self):
        codes = released_anchors(
            DenseSteps(trajectory(0, [1.0] * 4, obs=["a", "b", "a", "c"])), "obs"
        )
        assert codes.tolist() == [0, 1, 0, 2]
        steps = [
            TensorDict(obs=torch.tensor(v), batch_size=[])
            for v in ([1, 2], [1, 2, 3], [1, 2], [1.0, 2.0])
        ]
        assert released_anchors(RaggedSteps(steps), "obs").tolist() == [
            0,
            1,
            0,
            2,
        ]  # the dtype counts


class TestEstimatorsBeyondTorchRL:
    """The keywords of REINFORCE++-baseline, pass@k, GDPO and GiGPO, against the pure math."""

    def release(self, t, trajs):
        out = t.inv(torch.cat(trajs))
        return out["advantage"].squeeze(-1), out

    def test_whiten_is_reinforce_pp_baseline(self):
        trajs = [trajectory(g, r) for g, r in [(0, [0.0, 1.0]), (0, [3.0]), (1, [9.0]), (1, [5.0])]]
        t = MCAdvantage(
            2,
            prompt_key="seed",
            trajectory_return="sum",
            estimator=GroupRelative(scale_rewards="none", whiten=True),
        )
        adv, _ = self.release(t, trajs)
        want = reinforce_pp_baseline_advantage(
            torch.tensor([1.0, 3.0, 9.0, 5.0]), torch.tensor([0, 0, 1, 1])
        )  # centred -1, 1, 2, -2: std sqrt(10 / 3)
        assert want.tolist() == pytest.approx([v / (10 / 3) ** 0.5 for v in (-1, 1, 2, -2)])
        assert adv.tolist() == pytest.approx(
            want.repeat_interleave(torch.tensor([2, 1, 1, 1])).tolist()
        )

    def test_whiten_per_step_samples(self):
        """Per-step samples: every reward element is centred by its group, then all whitened."""
        trajs = [
            trajectory(0, [1.0, 2.0]),
            trajectory(0, [6.0]),
            trajectory(1, [2.0]),
            trajectory(1, [4.0]),
        ]
        t = MCAdvantage(
            2, prompt_key="seed", estimator=GroupRelative(whiten=True, scale_rewards="none")
        )
        adv, _ = self.release(t, trajs)
        x = torch.tensor([1.0, 2.0, 6.0, 2.0, 4.0])
        want = reinforce_pp_baseline_advantage(x, torch.tensor([0, 0, 0, 1, 1]))
        torch.testing.assert_close(adv.double(), want, atol=1e-6, rtol=1e-6)

    def test_pass_at_k(self):
        trajs = [trajectory(0, r) for r in ([1.0, 1.0], [0.0], [3.0], [0.5])]
        t = MCAdvantage(
            4,
            prompt_key="seed",
            trajectory_return="sum",
            estimator=GroupRelative(baseline="pass_at_k"),
        )
        adv, _ = self.release(t, trajs)
        returns = torch.tensor([2.0, 0.0, 3.0, 0.5])
        best = 1.0 / returns.std().item()  # 3 - 2, over the group std
        assert adv.tolist() == pytest.approx([0.0, 0.0, 0.0, best, 0.0])
        torch.testing.assert_close(
            adv[[0, 2, 3, 4]].double(),
            pass_at_k_advantage(returns, torch.zeros(4, dtype=torch.long)).float().double(),
        )

    @pytest.mark.parametrize("mode", [None, "sum", "max"])
    def test_gdpo_matches_the_math(self, mode):
        trajs, (returns, groups, rewards, lengths, _) = agent_episodes(seed=1)
        fmt = torch.cat([t["next", "format"].reshape(-1) for t in trajs])
        t = MCAdvantage(
            3,
            prompt_key="seed",
            trajectory_return=mode,
            estimator=GroupRelative(reward_weights=GDPO_KEYS),
        )
        adv, _ = self.release(t, trajs)
        weights = torch.tensor([1.0, 0.5])
        if mode is None:  # every reward element a sample, each trajectory a run of its group
            x = torch.stack([rewards, fmt], 1)
            want = multi_reward_advantage(x, groups, weights=weights, lengths=lengths)
        else:  # each reward's return, per trajectory
            traj = torch.arange(len(lengths)).repeat_interleave(lengths)
            if mode == "sum":
                reduce = lambda v: torch.zeros(len(lengths)).index_add_(0, traj, v)  # noqa: E731
            else:
                reduce = lambda v: torch.full((len(lengths),), -1e9).scatter_reduce(  # noqa: E731
                    0, traj, v, "amax"
                )
            x = torch.stack([reduce(rewards), reduce(fmt)], 1)
            want = multi_reward_advantage(x, groups, weights=weights).repeat_interleave(lengths)
        torch.testing.assert_close(adv.double(), want, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize(
        "seed, neutral",
        [
            (2, GroupRelative(reward_weights={("next", "reward"): 1.0}, whiten=False)),  # one
            (5, StepGroups(anchor_key="obs", step_weight=0.0)),  # GiGPO without its term
        ],
        ids=["gdpo_one_reward", "gigpo_no_step_weight"],
    )
    def test_neutral_settings_are_grpo(self, seed, neutral):
        trajs, _ = agent_episodes(seed=seed)
        for mode in (None, "sum"):
            plain, _ = self.release(
                MCAdvantage(3, prompt_key="seed", trajectory_return=mode), trajs
            )
            got, _ = self.release(
                MCAdvantage(3, prompt_key="seed", trajectory_return=mode, estimator=neutral),
                trajs,
            )
            torch.testing.assert_close(got, plain)

    def test_gdpo_statistics_and_filters_see_the_weighted_sum(self):
        trajs = [
            trajectory(0, [1.0], next_format=[[4.0]]),
            trajectory(0, [0.0], next_format=[[2.0]]),
        ]
        t = MCAdvantage(
            2,
            prompt_key="seed",
            trajectory_return="sum",
            estimator=GroupRelative(reward_weights=GDPO_KEYS),
            keep_return_bounds=(1.0, 2.5),
        )
        _, out = self.release(t, trajs)  # weighted returns 3 and 1: mean 2, inside the bounds
        assert out.shape == (2,)
        stats = t.get_stats()
        assert stats["trajectory_return_sum"] == pytest.approx(4.0)
        assert stats["trajectory_return_max"] == pytest.approx(3.0)

    @pytest.mark.parametrize("mode", [None, "sum"])
    @pytest.mark.parametrize("scale", ["group", "none"])
    def test_gigpo_matches_the_math(self, mode, scale):
        trajs, (returns, groups, rewards, lengths, states) = agent_episodes(seed=3)
        t = MCAdvantage(
            3,
            prompt_key="seed",
            trajectory_return=mode,
            estimator=StepGroups(
                episode_weight=0.5,
                step_weight=2.0,
                gamma=0.9,
                anchor_key="obs",
                group=GroupRelative(scale_rewards=scale),
            ),
        )
        adv, _ = self.release(t, trajs)
        if mode == "sum":
            want = gigpo_advantage(
                returns,
                groups,
                rewards,
                lengths,
                states,
                gamma=0.9,
                episode_weight=0.5,
                step_weight=2.0,
                scale_rewards=scale,
            )
        else:  # the episode level normalizes every reward element, as without anchors
            episode = group_relative_advantage(
                rewards, groups, scale_rewards=scale, lengths=lengths
            )
            step_groups = torch.unique(
                torch.stack([groups.repeat_interleave(lengths), states], 1),
                dim=0,
                return_inverse=True,
            )[1]
            step = step_level_advantage(
                rewards, lengths, step_groups, gamma=0.9, scale_rewards=scale
            )
            want = 0.5 * episode + 2.0 * step
        torch.testing.assert_close(adv.double(), want, atol=1e-5, rtol=1e-5)

    def test_gigpo_per_step_samples_of_two_elements(self):
        """Two reward elements per step: the step reward is their sum, the step-level advantage
        reaches both elements."""
        trajs, (_, groups, rewards, lengths, states) = agent_episodes(seed=8)
        two = [
            trajectory(
                int(t["seed"][0]), torch.stack([t["next", "reward"][:, 0]] * 2, 1) / 2, obs=t["obs"]
            )
            for t in trajs
        ]
        t = MCAdvantage(3, prompt_key="seed", estimator=StepGroups(gamma=0.8, anchor_key="obs"))
        adv, _ = self.release(t, two)
        elements = (rewards / 2).repeat_interleave(2)
        episode = group_relative_advantage(elements, groups, lengths=2 * lengths)
        step_groups = torch.unique(
            torch.stack([groups.repeat_interleave(lengths), states], 1), dim=0, return_inverse=True
        )[1]
        step = step_level_advantage(rewards, lengths, step_groups, gamma=0.8)
        torch.testing.assert_close(
            adv.reshape(-1).double(), episode + step.repeat_interleave(2), atol=1e-5, rtol=1e-5
        )

    def test_gdpo_and_gigpo_and_step_norm_compose(self):
        """Every stage at once: per-reward normalization, weighted sum, whitening, step groups,
        length normalization, each by the pure functions in turn."""
        trajs, (returns, groups, rewards, lengths, states) = agent_episodes(seed=9)
        fmt = torch.cat([t["next", "format"].reshape(-1) for t in trajs])
        t = MCAdvantage(
            3,
            prompt_key="seed",
            trajectory_return="sum",
            estimator=StepGroups(
                step_weight=0.5,
                anchor_key="obs",
                group=GroupRelative(reward_weights=GDPO_KEYS, step_norm=True),
            ),
        )
        adv, _ = self.release(t, trajs)
        traj = torch.arange(len(lengths)).repeat_interleave(lengths)
        per_key = torch.stack(
            [torch.zeros(len(lengths)).index_add_(0, traj, v) for v in (rewards, fmt)], 1
        )
        episode = multi_reward_advantage(per_key, groups, weights=torch.tensor([1.0, 0.5]))
        step_groups = torch.unique(
            torch.stack([groups.repeat_interleave(lengths), states], 1), dim=0, return_inverse=True
        )[1]
        step = step_level_advantage(rewards + 0.5 * fmt, lengths, step_groups, gamma=0.95)
        want = (episode.repeat_interleave(lengths) + 0.5 * step) / lengths.repeat_interleave(
            lengths
        )
        torch.testing.assert_close(adv.double(), want, atol=1e-5, rtol=1e-5)

    def test_gigpo_string_anchors_and_ragged_steps(self):
        trajs, (returns, groups, rewards, lengths, states) = agent_episodes(seed=4, strings=True)
        t = MCAdvantage(
            3, prompt_key="seed", trajectory_return="sum", estimator=StepGroups(anchor_key="obs")
        )
        adv, _ = self.release(t, trajs)
        want = gigpo_advantage(returns, groups, rewards, lengths, states)
        torch.testing.assert_close(adv.double(), want, atol=1e-5, rtol=1e-5)
        # the same steps as a lazy stack of ragged steps (token rewards of different lengths)
        steps = []
        for traj in trajs:
            for step in traj.unbind(0):
                step = step.clone()
                step["next", "reward"] = step["next", "reward"].expand(2) / 2  # two halves
                steps.append(step)
        steps[0]["next", "reward"] = steps[0]["next", "reward"].repeat(2) / 2  # four quarters
        ragged = MCAdvantage(
            3, prompt_key="seed", trajectory_return="sum", estimator=StepGroups(anchor_key="obs")
        )
        out = ragged.inv(lazy_stack(steps))
        per_step = torch.stack([step["advantage"][0] for step in out.unbind(0)])
        torch.testing.assert_close(per_step.double(), want, atol=1e-5, rtol=1e-5)

    def test_gigpo_by_hand(self):
        """Two runs from room 7: one reaches 8 and wins, one reaches 9 and loses."""
        trajs = [trajectory(0, [0.0, 1.0], obs=[7, 8]), trajectory(0, [0.0, 0.0], obs=[7, 9])]
        kw = dict(prompt_key="seed", trajectory_return="sum")
        steps = StepGroups(gamma=0.5, anchor_key="obs", group=GroupRelative(scale_rewards="none"))
        adv, _ = self.release(MCAdvantage(2, **kw, estimator=steps), trajs)
        # episode: +-0.5; step group {first steps}: returns 0.5, 0 -> +-0.25; lone steps: 0
        assert adv.tolist() == [0.75, 0.5, -0.75, -0.5]
        normed = GroupRelative(scale_rewards="none", step_norm=True)
        steps = StepGroups(gamma=0.5, anchor_key="obs", group=normed)
        adv, _ = self.release(MCAdvantage(2, **kw, estimator=steps), trajs)
        assert adv.tolist() == [0.375, 0.25, -0.375, -0.25]

    def test_gigpo_chunking_does_not_matter(self):
        trajs, _ = agent_episodes(num_groups=3, size=4, seed=6)
        kw = dict(grpo_size=4, prompt_key="seed", trajectory_return="sum")
        kw.update(estimator=StepGroups(anchor_key="obs"))
        one_by_one = stream_outputs(MCAdvantage(**kw), trajs)
        shuffled = trajs[:]
        random.Random(0).shuffle(shuffled)
        chunked = stream_outputs(MCAdvantage(**kw), random_chunks(shuffled, 0))
        assert one_by_one.keys() == chunked.keys()
        for uid, adv in one_by_one.items():
            torch.testing.assert_close(chunked[uid], adv, atol=1e-6, rtol=1e-6)

    def test_validation(self):
        for kw, words in [
            (dict(estimator=GroupRelative(reward_weights={})), "non-empty"),
            (
                dict(estimator=GroupRelative(reward_weights={("next", "reward"): float("nan")})),
                "^GroupRelative's reward_weights must be finite",
            ),
            (
                dict(
                    estimator=GroupRelative(reward_weights={("next", "a"): 1.0}),
                    rewards_key=("next", "b"),
                ),
                "rewards_key",
            ),
            (dict(estimator=StepGroups(gamma=0.9)), "StepGroups needs anchor_key"),
            (dict(estimator=StepGroups(gamma=1.5, anchor_key="obs")), "^StepGroups' gamma"),
            (
                dict(estimator=StepGroups(episode_weight=float("inf"), anchor_key="obs")),
                "^StepGroups' episode_weight must be finite",
            ),
            # the deprecated flat keywords (refused before their warning): named as well
            (dict(step_reward_weight=0.5), "need anchor_key"),
            (dict(anchor_key="obs", step_reward_gamma=1.5), r"\(given as step_reward_gamma=\)"),
        ]:
            with pytest.raises(ValueError, match=words):
                MCAdvantage(4, **kw)

    @pytest.mark.parametrize(
        "kw, break_it, error, words",
        [
            (
                dict(estimator=StepGroups(anchor_key="obs")),
                lambda td: td.exclude("obs"),
                KeyError,
                "anchor key .*obs",
            ),
            (
                dict(estimator=StepGroups(anchor_key="obs")),
                lambda td: td.set("obs", NonTensorStack(*[{"a": 1}] * td.shape[0])),
                TypeError,
                "tensor or a string",
            ),
            (
                dict(estimator=GroupRelative(reward_weights=GDPO_KEYS)),
                lambda td: td.exclude(("next", "format")),
                KeyError,
                "format",
            ),
            (
                dict(estimator=GroupRelative(reward_weights=GDPO_KEYS)),
                lambda td: td.set(
                    ("next", "format"), td["next", "format"].clone().fill_(float("nan"))
                ),
                ValueError,
                "non-finite reward value\\(s\\) under \\('next', 'format'\\)",
            ),
            (
                dict(estimator=GroupRelative(reward_weights=GDPO_KEYS)),
                lambda td: td.set(("next", "format"), td["next", "format"].expand(-1, 2).clone()),
                ValueError,
                "as many elements",
            ),
        ],
    )
    def test_bad_input_raises_and_changes_nothing(self, kw, break_it, error, words):
        trajs, _ = agent_episodes(seed=7)
        t = MCAdvantage(3, prompt_key="seed", trajectory_return="sum", **kw)
        clean = MCAdvantage(3, prompt_key="seed", trajectory_return="sum", **kw)
        for transform in (t, clean):
            assert transform.inv(torch.cat(trajs[:2])) is None
        before = t.get_stats()
        with pytest.raises(error, match=words):
            t.inv(break_it(trajs[2].clone()))
        assert t.get_stats() == before
        got, want = released(t.inv(torch.cat(trajs[2:]))), released(clean.inv(torch.cat(trajs[2:])))
        assert got.keys() == want.keys() and len(got) > 0
        assert all(torch.equal(got[k], want[k]) for k in want)


# --------------------------------------------------------------------------------------------
# trajectories that cross insertions (traj_key)
# --------------------------------------------------------------------------------------------
