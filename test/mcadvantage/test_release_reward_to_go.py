"""Tests of torchrl_grpo/mcadvantage/release.py, continued: advantages of rewards-to-go
(``estimator=RewardToGo(gamma)``), against a constant baseline per group and per time step
(``RewardToGo(gamma, baseline=...)``)."""

import statistics

import pytest
import torch
from helpers import (
    GDPO_KEYS,
    agent_episodes,
    collector_stream,
    flat_items,
    random_chunks,
    random_stream,
    released,
    same_output,
    streaming,
    trajectory,
)
from helpers.references import reference_whiten, reward_to_go_reference
from tensordict import NonTensorData, TensorDict, lazy_stack
from torchrl.objectives.llm import MCAdvantage as TorchRLMCAdvantage
from torchrl.objectives.value.functional import reward2go

from torchrl_grpo import MCAdvantage, group_relative_advantage
from torchrl_grpo.mcadvantage import GroupRelative, RewardToGo


def _with_reward2go(steps, gamma, key=("next", "reward"), out=("next", "reward_to_go")):
    """``steps`` (flat, whole trajectories) with torchrl's ``reward2go`` of ``key`` under ``out``:
    the reference the transform must reproduce."""
    reward = steps.get(key)
    done = steps["next", "done"].expand_as(reward)  # one flag per element, as reward2go wants
    return steps.clone().set(out, reward2go(reward, done, gamma, time_dim=-2))


class TestRewardToGo:
    def test_by_hand(self):
        # group 0: rewards [1, 2, 4] and [10, 0]; with gamma 0.5 the samples are the
        # rewards-to-go [1 + 1 + 1, 2 + 2, 4] and [10, 0]
        trajs = [trajectory(0, [1.0, 2.0, 4.0]), trajectory(0, [10.0, 0.0])]
        t = MCAdvantage(2, prompt_key="seed", estimator=RewardToGo(0.5))
        out = t.inv(torch.cat(trajs))
        samples = [3.0, 4.0, 4.0, 10.0, 0.0]
        mean, std = statistics.mean(samples), statistics.stdev(samples)  # Bessel's correction
        want = [(x - mean) / std for x in samples]
        assert out["advantage"].squeeze(-1).tolist() == pytest.approx(want, rel=1e-6)
        assert out["advantage"].dtype == torch.float32 and out["advantage"].shape == (5, 1)

    # gamma = 0: torchrl's reward2go fails (an empty geometric series); test_neutral_discounts
    # checks it against the plain rewards instead
    @pytest.mark.parametrize("gamma", [0.5, 0.99, 1.0])
    @pytest.mark.parametrize(
        "estimator",
        [{}, {"scale_rewards": "none", "baseline": "leave_one_out"}, {"step_norm": True}],
        ids=["grpo", "rloo", "step_norm"],
    )
    def test_equals_reward2go_then_torchrl(self, gamma, estimator):
        """Whole trajectories: the same advantages as torchrl's ``reward2go`` written on the
        batch, then torchrl's ``MCAdvantage`` (our plain one for the keywords beyond torchrl)."""
        chunks = random_chunks(random_stream(6, 3, seed=1, max_len=12), seed=2)
        group = GroupRelative(**estimator)
        ours = MCAdvantage(3, prompt_key="seed", estimator=RewardToGo(gamma, group=group))
        to_go = dict(prompt_key="seed", rewards_key=("next", "reward_to_go"))
        if estimator:  # our plain one, for the settings beyond torchrl
            ref = MCAdvantage(3, **to_go, estimator=group)
        else:
            ref = TorchRLMCAdvantage(3, **to_go)
        written = 0
        for chunk in chunks:
            got, want = released(ours.inv(chunk)), released(ref.inv(_with_reward2go(chunk, gamma)))
            assert got.keys() == want.keys()
            for uid, adv in want.items():
                torch.testing.assert_close(got[uid], adv, atol=1e-5, rtol=1e-5)
            written += len(got)
        assert written > 0 and ours.get_stats()["written_groups"] == 6

    @pytest.mark.parametrize("layout", ["rows", "flat"])
    def test_streaming_batches_equal_whole_trajectories(self, layout):
        """``[N, T]`` batches cut anywhere: the reward-to-go is computed on the joined
        trajectories, equal to ``reward2go`` on each whole trajectory."""
        batches, completed = collector_stream(4, 6, 3, seed=12, max_len=11, steps_per_batch=4)
        ours = streaming(estimator=RewardToGo(0.9))
        ref = streaming(traj_key=None, rewards_key=("next", "reward_to_go"))
        crossed = False
        for batch, whole in zip(batches, completed):
            got = ours.inv(batch if layout == "rows" else batch.reshape(-1))
            crossed = crossed or ours.held_trajectories > 0
            want = None
            if whole:
                want = ref.inv(torch.cat([_with_reward2go(w, 0.9) for w in whole]))
            if want is None:
                assert got is None
                continue
            assert got["uid"].tolist() == want["uid"].tolist()
            torch.testing.assert_close(got["advantage"], want["advantage"], atol=1e-5, rtol=1e-5)
        assert crossed and ours.held_trajectories == ours.queued_trajectories == 0

    def test_neutral_discounts(self):
        """gamma 0: the rewards themselves; single-step trajectories: any gamma; gamma 1: the
        undiscounted sum to the end."""
        chunks = random_chunks(random_stream(5, 3, seed=3, max_len=6), seed=4)
        plain = MCAdvantage(3, prompt_key="seed")
        zero = MCAdvantage(3, prompt_key="seed", estimator=RewardToGo(0.0))
        for chunk in chunks:
            got, want = released(zero.inv(chunk.clone())), released(plain.inv(chunk.clone()))
            assert got.keys() == want.keys()
            assert all(torch.equal(got[uid], want[uid]) for uid in want)
        single = random_stream(4, 3, seed=5, max_len=1)
        want = MCAdvantage(3, prompt_key="seed").inv(torch.cat(single))["advantage"]
        got = MCAdvantage(3, prompt_key="seed", estimator=RewardToGo(0.7)).inv(torch.cat(single))
        assert torch.equal(got["advantage"], want)
        trajs = [trajectory(0, [1.0, 2.0, 3.0]), trajectory(0, [5.0])]
        got = MCAdvantage(2, prompt_key="seed", estimator=RewardToGo(1.0)).inv(torch.cat(trajs))
        want = MCAdvantage(2, prompt_key="seed").inv(
            torch.cat([trajectory(0, [6.0, 5.0, 3.0]), trajectory(0, [5.0])])
        )
        torch.testing.assert_close(got["advantage"], want["advantage"])

    def test_several_elements_per_step(self):
        """A reward of two elements per step: each element discounted along the steps, as
        ``reward2go`` does with a trailing dimension."""
        gen = torch.Generator().manual_seed(6)
        trajs = [trajectory(g, torch.randn(n, 2, generator=gen)) for g in (0, 1) for n in (3, 1, 4)]
        steps = torch.cat(trajs)
        got = MCAdvantage(3, prompt_key="seed", estimator=RewardToGo(0.8)).inv(steps.clone())
        want = MCAdvantage(3, prompt_key="seed", rewards_key=("next", "reward_to_go")).inv(
            _with_reward2go(steps, 0.8)
        )
        assert got["advantage"].shape == (steps.shape[0], 2)
        torch.testing.assert_close(got["advantage"], want["advantage"], atol=1e-5, rtol=1e-5)

    def test_several_rewards(self):
        """GDPO: each reward's reward-to-go normalized within the group, then weighted."""
        trajs, _ = agent_episodes(seed=11)
        steps = torch.cat(trajs)
        gdpo = GroupRelative(reward_weights=GDPO_KEYS)
        got = MCAdvantage(3, prompt_key="seed", estimator=RewardToGo(0.6, group=gdpo))
        discounted = _with_reward2go(
            _with_reward2go(steps, 0.6, out=("next", "reward_rtg")),
            0.6,
            key=("next", "format"),
            out=("next", "format_rtg"),
        )
        ref = MCAdvantage(
            3,
            prompt_key="seed",
            estimator=GroupRelative(
                reward_weights={("next", "reward_rtg"): 1.0, ("next", "format_rtg"): 0.5}
            ),
        )
        torch.testing.assert_close(
            got.inv(steps)["advantage"], ref.inv(discounted)["advantage"], atol=1e-5, rtol=1e-5
        )

    def test_checkpoint_state_is_unaffected(self, tmp_path):
        """The reward-to-go is computed at release: what is pending or held (and saved) is the
        raw steps, the same with or without it, and a state saved by either restores in either."""
        batches, _ = collector_stream(4, 6, 3, seed=13, max_len=9, steps_per_batch=4)
        with_it, without = streaming(estimator=RewardToGo(0.9)), streaming()
        for batch in batches[:3]:
            with_it.inv(batch.clone())
            without.inv(batch.clone())
        assert with_it.held_trajectories > 0 and with_it.queued_trajectories > 0
        saved, plain = with_it.state_dict(), without.state_dict()
        torch.save(plain, tmp_path / "plain.pt")
        saved, plain = dict(flat_items(saved)), dict(flat_items(plain))
        assert (
            saved.keys() == plain.keys()
            and ("_extra_state", "pending", "steps", "next", "reward") in saved
        )
        for path, value in saved.items():  # tensors and plain Python values
            assert type(value) is type(plain[path]), path
            same = (
                torch.equal(value, plain[path]) if torch.is_tensor(value) else value == plain[path]
            )
            assert same, path
        restored = streaming(estimator=RewardToGo(0.9))
        restored.load_state_dict(torch.load(tmp_path / "plain.pt", weights_only=True))
        for batch in batches[3:]:
            same_output(restored.inv(batch.clone()), with_it.inv(batch.clone()))

    def test_validation(self):
        for kw, error, words in [
            (
                dict(estimator=RewardToGo(1.5)),
                ValueError,
                r"^RewardToGo's gamma must be in \[0, 1\]",
            ),
            (dict(estimator=RewardToGo(-0.1)), ValueError, r"must be in \[0, 1\], got -0.1"),
            (dict(estimator=RewardToGo(float("nan"))), ValueError, r"in \[0, 1\], got nan"),
            (dict(estimator=RewardToGo(True)), TypeError, "real number .*True .*bool"),
            (dict(estimator=RewardToGo("0.9")), TypeError, "real number .*'0.9' .*str"),
            (
                dict(estimator=RewardToGo(0.9), trajectory_return="sum"),
                ValueError,
                "requires trajectory_return=None, got trajectory_return='sum'",
            ),
            (  # the deprecated flat keywords: named as well
                dict(reward_to_go_gamma=1.5),
                ValueError,
                r"^RewardToGo's gamma \(given as reward_to_go_gamma=\) must be in \[0, 1\]",
            ),
            (
                dict(reward_to_go_gamma=0.9, anchor_key="obs"),
                ValueError,
                "cannot be combined with StepGroups' anchor_key .*StepGroups' gamma",
            ),
        ]:
            with pytest.raises(error, match=words):
                MCAdvantage(4, **kw)
        assert MCAdvantage(4, estimator=RewardToGo(1)).estimator.gamma == 1.0  # an int is fine
        assert not isinstance(MCAdvantage(4).estimator, RewardToGo)

    def test_ragged_steps_raise_and_change_nothing(self):
        t = MCAdvantage(2, estimator=RewardToGo(0.9))
        steps = [
            TensorDict(
                query=NonTensorData("prompt"),
                next=TensorDict(reward=torch.ones(n, 1), done=torch.tensor([done])),
            )
            for n, done in ((2, False), (3, True))
        ]
        before = t.get_stats()
        with pytest.raises(ValueError, match="RewardToGo's gamma .* rewards of different sizes"):
            t.inv(lazy_stack(steps))
        assert t.get_stats() == before and t.queued_trajectories == 0


class TestRewardToGoByTimeStep:
    """``RewardToGo(gamma, baseline="time_step")``: each reward-to-go compared with the group's at
    the same time step."""

    def test_by_hand(self):
        # group 0: rewards [1, 2, 4] and [10, 0]; with gamma 0.5 the samples are the
        # rewards-to-go [1 + 1 + 1, 2 + 2, 4] and [10, 0]; at t = 0: 3 vs 10, t = 1: 4 vs 0,
        # t = 2: 4 alone; deviations -3.5, 2, 0 | 3.5, -2; pooled std over 5 - 3 = 2 degrees
        trajs = [trajectory(0, [1.0, 2.0, 4.0]), trajectory(0, [10.0, 0.0])]
        t = MCAdvantage(2, prompt_key="seed", estimator=RewardToGo(0.5, baseline="time_step"))
        out = t.inv(torch.cat(trajs))
        std = ((3.5**2 * 2 + 2.0**2 * 2) / 2) ** 0.5
        want = [-3.5 / std, 2.0 / std, 0.0, 3.5 / std, -2.0 / std]
        assert out["advantage"].squeeze(-1).tolist() == pytest.approx(want, rel=1e-6)
        assert out["advantage"].dtype == torch.float32 and out["advantage"].shape == (5, 1)

    def test_samples_are_torchrl_reward2go(self):
        """The samples are what torchrl's ``reward2go`` writes on whole trajectories: its values
        through the time-step baseline give the transform's advantages."""
        trajs = [trajectory(g, torch.randn(n).tolist()) for g in (0, 1) for n in (5, 2, 7)]
        steps = torch.cat(trajs)
        got = MCAdvantage(
            3, prompt_key="seed", estimator=RewardToGo(0.9, baseline="time_step")
        ).inv(steps.clone())
        to_go = _with_reward2go(steps, 0.9)["next", "reward_to_go"].reshape(-1)
        want = group_relative_advantage(
            to_go,
            torch.tensor([0, 0, 0, 1, 1, 1]),
            lengths=torch.tensor([5, 2, 7] * 2),
            by_time_step=True,
        )
        torch.testing.assert_close(
            got["advantage"].reshape(-1).double(), want, atol=1e-6, rtol=1e-6
        )

    @pytest.mark.parametrize("gamma", [0.5, 0.99, 1.0])
    @pytest.mark.parametrize(
        "estimator",
        [{}, {"scale_rewards": "none", "baseline": "leave_one_out"}, {"step_norm": True}],
        ids=["grpo", "rloo", "step_norm"],
    )
    def test_equals_reference(self, gamma, estimator):
        """Whole trajectories in random chunks: the advantages of a plain Python reference
        (discounted sums step by step, then each time step's baseline), released when torchrl's
        ``MCAdvantage`` releases the group."""
        trajs = random_stream(6, 3, seed=1, max_len=12)
        chunks = random_chunks(trajs, seed=2)
        ours = MCAdvantage(
            3,
            prompt_key="seed",
            estimator=RewardToGo(gamma, baseline="time_step", group=GroupRelative(**estimator)),
        )
        timing = TorchRLMCAdvantage(3, prompt_key="seed")
        want = reward_to_go_reference(trajs, gamma, 3, **estimator)
        for chunk in chunks:
            got = released(ours.inv(chunk))
            assert got.keys() == released(timing.inv(chunk)).keys()
            for uid, adv in got.items():
                torch.testing.assert_close(adv, want[uid], atol=1e-5, rtol=1e-5)
        assert ours.get_stats()["written_groups"] == 6

    @pytest.mark.parametrize("layout", ["rows", "flat"])
    def test_streaming_batches_equal_whole_trajectories(self, layout):
        """``[N, T]`` batches cut anywhere: the reward-to-go is computed on the joined
        trajectories, the same numbers as on each whole trajectory."""
        batches, completed = collector_stream(4, 6, 3, seed=12, max_len=11, steps_per_batch=4)
        ours = streaming(estimator=RewardToGo(0.9, baseline="time_step"))
        timing = streaming(traj_key=None)
        want = reward_to_go_reference([w for whole in completed for w in whole], 0.9, 3)
        crossed = False
        for batch, whole in zip(batches, completed):
            got = ours.inv(batch if layout == "rows" else batch.reshape(-1))
            crossed = crossed or ours.held_trajectories > 0
            expected = timing.inv(torch.cat(whole)) if whole else None
            if expected is None:
                assert got is None
                continue
            assert got["uid"].tolist() == expected["uid"].tolist()
            for uid, adv in released(got).items():
                torch.testing.assert_close(adv, want[uid], atol=1e-5, rtol=1e-5)
        assert crossed and ours.held_trajectories == ours.queued_trajectories == 0

    def test_several_elements_per_step(self):
        """A reward of two elements per step: each element discounted along the steps, as
        ``reward2go`` does with a trailing dimension, and compared element by element."""
        gen = torch.Generator().manual_seed(6)
        trajs = [trajectory(g, torch.randn(n, 2, generator=gen)) for g in (0, 1) for n in (3, 1, 4)]
        got = MCAdvantage(
            3, prompt_key="seed", estimator=RewardToGo(0.8, baseline="time_step")
        ).inv(torch.cat(trajs))
        assert got["advantage"].shape == (sum(t.shape[0] for t in trajs), 2)
        want = reward_to_go_reference(trajs, 0.8, 3)
        for uid, adv in released(got).items():
            torch.testing.assert_close(adv, want[uid], atol=1e-5, rtol=1e-5)

    def test_several_rewards(self):
        """GDPO: each reward's reward-to-go compared at its time step within the group, then
        weighted, then whitened over the insertion."""
        trajs, _ = agent_episodes(seed=11)
        got = MCAdvantage(
            3,
            prompt_key="seed",
            estimator=RewardToGo(
                0.6, baseline="time_step", group=GroupRelative(reward_weights=GDPO_KEYS)
            ),
        )
        out = released(got.inv(torch.cat(trajs)))
        total = {uid: 0.0 for uid in out}
        for key, weight in GDPO_KEYS.items():
            as_reward = [t.clone().set(("next", "reward"), t.get(key)) for t in trajs]
            for uid, adv in reward_to_go_reference(as_reward, 0.6, 3).items():
                total[uid] = total[uid] + weight * adv.double()
        uids = list(out)
        want = reference_whiten([float(total[u]) for u in uids], [1.0] * len(uids))
        torch.testing.assert_close(
            torch.stack([out[u] for u in uids]).reshape(-1).double(), want, atol=1e-5, rtol=1e-5
        )

    @pytest.mark.parametrize("mode", ["group", "time_step"])
    def test_identical_episodes_give_zeros_and_are_filtered(self, mode):
        """The issue's case: four identical CartPole episodes (reward 1 to the end) got -0.78
        to +3.24 by time step; now 0 in either mode, and ``std_threshold=0`` drops them, as
        ``trajectory_return="sum"`` does."""
        episodes = [trajectory(7, [1.0] * 40) for _ in range(4)]
        other = [trajectory(8, [1.0] * n) for n in (40, 30, 35, 20)]
        out = MCAdvantage(4, prompt_key="seed", estimator=RewardToGo(0.99, baseline=mode)).inv(
            torch.cat(episodes + other)
        )
        same = out["seed"] == 7
        assert (out["advantage"][same] == 0).all() and (out["advantage"][~same] != 0).any()
        group = GroupRelative(std_threshold=0.0)
        filtered = MCAdvantage(
            4, prompt_key="seed", estimator=RewardToGo(0.99, baseline=mode, group=group)
        )
        out = filtered.inv(torch.cat(episodes + other))
        assert (out["seed"] == 8).all() and filtered.get_stats()["dropped_groups"] == 1

    def test_identical_in_every_reward(self):
        """With several rewards, a group is zeroed only if every reward is the same at every
        time step: equal weighted sums are not enough."""
        a = trajectory(3, [1.0, 0.0], next_format=torch.tensor([[0.0], [1.0]]))
        b = trajectory(3, [0.0, 1.0], next_format=torch.tensor([[1.0], [0.0]]))
        weights = {("next", "reward"): 1.0, ("next", "format"): 1.0}
        rtg = RewardToGo(1.0, group=GroupRelative(reward_weights=weights))
        t = MCAdvantage(2, prompt_key="seed", estimator=rtg)
        out = t.inv(torch.cat([a, b]))
        assert (out["advantage"] != 0).any()
        same = MCAdvantage(2, prompt_key="seed", estimator=rtg)
        assert (same.inv(torch.cat([a, a.clone()]))["advantage"] == 0).all()

    def test_validation(self):
        with pytest.raises(
            ValueError, match=r"must be one of \['group', 'time_step', 'step_group'\], got 'step'"
        ):
            MCAdvantage(4, estimator=RewardToGo(0.9, baseline="step"))
        with pytest.raises(ValueError, match="needs RewardToGo's gamma"):
            MCAdvantage(4, reward_to_go_baseline="time_step")  # the deprecated flat keyword
        t = MCAdvantage(4, estimator=RewardToGo(0.9, baseline="time_step"))
        assert t.estimator.baseline == "time_step"
        assert MCAdvantage(4, estimator=RewardToGo(0.5)).estimator.baseline == "group"
