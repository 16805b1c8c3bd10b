"""Tests of torchrl_grpo/mcadvantage/transform.py: ``MCAdvantage`` as torchrl sees it - parity
with torchrl's, its estimators, a replay buffer around it, bad input, numerics, devices."""

import random
import re

import pytest
import torch
from helpers import (
    assert_same_releases,
    bad_inputs,
    collector_stream,
    next_uid,
    random_chunks,
    random_stream,
    released,
    streaming,
    trajectory,
)
from tensordict import NonTensorData, TensorDict, lazy_stack
from torchrl.data import LazyStackStorage, LazyTensorStorage, ReplayBuffer
from torchrl.objectives.llm import MCAdvantage as TorchRLMCAdvantage

from torchrl_grpo import MCAdvantage, MCAdvantageSelector, group_relative_advantage
from torchrl_grpo.mcadvantage import GroupRelative, StepGroups


class TestParityWithTorchRL:
    @pytest.mark.parametrize("mode", [None, "sum", "max", "mean"])
    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_random_interleaved_groups(self, mode, seed):
        chunks = random_chunks(random_stream(12, 4, seed), seed)
        kw = dict(grpo_size=4, prompt_key="seed", trajectory_return=mode)
        ours = assert_same_releases(chunks, kw)
        assert ours.queued_trajectories == 0

    def test_more_trajectories_than_the_group_size(self):
        # 10 of one group: two full rounds of 4 are released, 2 stay pending
        chunks = random_chunks(random_stream(1, 10, 3), 3)
        ours = assert_same_releases(chunks, dict(grpo_size=4, prompt_key="seed"))
        assert ours.queued_trajectories == 2

    def test_single_trajectories_and_string_prompts(self):
        trajs = random_stream(6, 3, 4, strings=True, key="query")
        ours = assert_same_releases(trajs, dict(grpo_size=3, trajectory_return="sum"))
        assert ours.get_stats()["written_groups"] == 6

    def test_dynamic_sampling(self):
        chunks = random_chunks(random_stream(30, 4, 5, binary=True), 5)
        kw = dict(grpo_size=4, prompt_key="seed", trajectory_return="sum")
        ours = assert_same_releases(chunks, {**kw, "keep_return_bounds": (0.1, 0.9)})
        stats = ours.get_stats()
        assert stats["dropped_groups"] > 0 and stats["written_groups"] > 0

    @pytest.mark.parametrize("strategy", ["first", "uniform", "balanced"])
    def test_oversampled_candidates(self, strategy):
        chunks = random_chunks(random_stream(20, 7, 6, binary=True), 6)
        kw = dict(
            grpo_size=4,
            prompt_key="seed",
            trajectory_return="sum",
            keep_return_bounds=(0.1, 0.9),
            candidate_group_size=7,
            candidate_selection_min_size=5,
            candidate_selector=MCAdvantageSelector(strategy),
        )
        ours = assert_same_releases(chunks, kw)
        assert ours.get_stats()["unselected_trajectories"] > 0

    def test_batch_of_rows(self):
        # [B, T] input: each row holds two trajectories of 3 steps and ends with done.
        trajs = random_stream(4, 4, 7, max_len=1)
        rows = []
        for i in range(0, len(trajs), 2):
            a, b = (trajectory(int(t["seed"][0]), torch.randn(3)) for t in trajs[i : i + 2])
            rows.append(torch.cat([a, b]))
        assert_same_releases(
            [torch.stack(rows[:3]), torch.stack(rows[3:])], dict(grpo_size=4, prompt_key="seed")
        )

    def test_nested_group_key_and_multi_value_ids(self):
        trajs = []
        for g in range(3):
            for _ in range(2):
                t = trajectory(g, torch.randn(2), key=("task", "id"), width=2)
                trajs.append(t)
        random.Random(0).shuffle(trajs)
        ours = assert_same_releases(trajs, dict(grpo_size=2, prompt_key=("task", "id")))
        assert ours.get_stats()["written_groups"] == 3

    def test_ragged_lazy_stacked_token_rewards(self):
        # LLM data: each step is a turn whose per-token rewards have their own length.
        rng = random.Random(8)
        trajs = []
        for g in range(4):
            for _ in range(3):
                turns = rng.randint(1, 3)
                steps = [
                    TensorDict(
                        query=NonTensorData(f"prompt {g}"),
                        uid=torch.tensor(next_uid()),
                        tokens=torch.arange(n := rng.randint(1, 6)),
                        next=TensorDict(
                            reward=torch.randn(n, 1), done=torch.tensor([t == turns - 1])
                        ),
                    )
                    for t in range(turns)
                ]
                trajs.append(lazy_stack(steps))
        rng.shuffle(trajs)
        assert_same_releases(trajs, dict(grpo_size=3))
        # several ragged trajectories in one call
        assert_same_releases(
            [lazy_stack([s for t in trajs for s in t.unbind(0)])], dict(grpo_size=3)
        )


class TestEstimators:
    def release(self, t, trajs):
        out = t.inv(torch.cat(trajs))
        return out["advantage"], out

    def test_last_step_reward_is_broadcast(self):
        trajs = [trajectory(0, [5.0, 0.0, 1.0]), trajectory(0, [9.0, 3.0]), trajectory(0, [2.0])]
        t = MCAdvantage(3, prompt_key="seed", trajectory_return="last")
        adv, _ = self.release(t, trajs)
        want = group_relative_advantage(torch.tensor([1.0, 3.0, 2.0]), torch.zeros(3).long())
        want = want.tolist()
        assert adv.squeeze(-1).tolist() == pytest.approx(
            [want[0]] * 3 + [want[1]] * 2 + [want[2]], abs=1e-6
        )

    def test_dr_grpo_rloo_and_step_norm(self):
        trajs = [trajectory(0, [1.0, 1.0]), trajectory(0, [0.0]), trajectory(0, [0.0, 0.0, 4.0])]
        returns = torch.tensor([2.0, 0.0, 4.0])
        for kw, want in [
            (dict(scale_rewards="none"), returns - 2.0),
            (dict(scale_rewards="none", baseline="leave_one_out"), 1.5 * (returns - 2.0)),
        ]:
            t = MCAdvantage(
                3, prompt_key="seed", trajectory_return="sum", estimator=GroupRelative(**kw)
            )
            adv, _ = self.release(t, trajs)
            assert adv.squeeze(-1).tolist() == pytest.approx(
                want.repeat_interleave(torch.tensor([2, 1, 3])).tolist()
            )
        dr_grpo = GroupRelative(scale_rewards="none", step_norm=True)
        t = MCAdvantage(3, prompt_key="seed", trajectory_return="sum", estimator=dr_grpo)
        adv, _ = self.release(t, trajs)
        assert adv.squeeze(-1).tolist() == pytest.approx([0.0, 0.0, -2.0, 2 / 3, 2 / 3, 2 / 3])

    def test_step_norm_per_step(self):
        """Per-step samples: each element's advantage is divided by its trajectory's steps."""
        trajs = [trajectory(0, [1.0, 1.0]), trajectory(0, [0.0]), trajectory(0, [0.0, 0.0, 4.0])]
        t = MCAdvantage(
            3, prompt_key="seed", estimator=GroupRelative(scale_rewards="none", step_norm=True)
        )
        adv, _ = self.release(t, trajs)  # mean of the six rewards is 1
        assert adv.squeeze(-1).tolist() == pytest.approx([0.0, 0.0, -1.0, -1 / 3, -1 / 3, 1.0])

    def test_batch_scale_uses_every_released_return(self):
        trajs = [trajectory(g, [r]) for g, r in [(0, 0.0), (0, 2.0), (1, 10.0), (1, 30.0)]]
        t = MCAdvantage(
            2,
            prompt_key="seed",
            trajectory_return="sum",
            estimator=GroupRelative(scale_rewards="batch"),
        )
        adv, _ = self.release(t, trajs)
        std = torch.tensor([0.0, 2.0, 10.0, 30.0]).std().item()
        assert adv.squeeze(-1).tolist() == pytest.approx([-1 / std, 1 / std, -10 / std, 10 / std])

    def test_std_threshold_drops_flat_groups(self):
        trajs = [
            trajectory(0, [1.0]),
            trajectory(0, [1.0]),
            trajectory(1, [0.0]),
            trajectory(1, [1.0]),
        ]
        t = MCAdvantage(
            2,
            prompt_key="seed",
            trajectory_return="sum",
            estimator=GroupRelative(std_threshold=0.0),
        )
        _, out = self.release(t, trajs)
        assert out["seed"].tolist() == [1, 1]
        stats = t.get_stats()
        assert stats["dropped_groups"] == 1 and stats["written_groups"] == 1

    def test_per_step_mode_normalizes_every_reward_element(self):
        trajs = [trajectory(0, [[1.0, 2.0], [3.0, 4.0]]), trajectory(0, [[5.0, 6.0]])]
        adv, _ = self.release(MCAdvantage(2, prompt_key="seed"), trajs)
        x = torch.arange(1.0, 7.0)
        assert adv.shape == (3, 2)
        torch.testing.assert_close(adv.reshape(-1), (x - x.mean()) / x.std())

    def test_constant_rewards_and_a_group_of_one(self):
        adv, _ = self.release(MCAdvantage(3, prompt_key="seed"), [trajectory(0, [2.0, 2.0])] * 3)
        assert adv.abs().max() == 0
        # torchrl gives nan for a one-element group; here the advantage is 0.
        adv, _ = self.release(MCAdvantage(1, prompt_key="seed"), [trajectory(0, [2.0])])
        assert adv.tolist() == [[0.0]]

    def test_validation_mirrors_torchrl(self):
        bad = [  # (arguments, what both messages say)
            (dict(trajectory_return="median"), "trajectory_return must be one of"),
            (dict(trajectory_return="sum", grpo_size=1), "trajectory_return requires grpo_size"),
            (dict(candidate_group_size=2), "candidate_group_size must be greater than or equal"),
            (dict(candidate_group_size=6), "candidate_group_size > grpo_size requires"),
            (dict(candidate_selection_min_size=3), "candidate_selection_min_size must be greater"),
            (
                dict(trajectory_return="sum", candidate_selection_min_size=6),
                "candidate_selection_min_size must be less than or equal",
            ),
            (
                dict(keep_return_bounds=(0.1, 0.9)),
                re.escape("keep_return_bounds (dynamic sampling)"),
            ),
            (
                dict(trajectory_return="sum", keep_return_bounds=(0.9, 0.1)),
                "keep_return_bounds must be an increasing",
            ),
        ]
        for kw, message in bad:
            kw = {"grpo_size": 4, **kw}
            with pytest.raises(ValueError, match=message):
                TorchRLMCAdvantage(**kw)
            with pytest.raises(ValueError, match=message):
                MCAdvantage(**kw)
        for kw, message in [
            (dict(scale_rewards="std"), "^GroupRelative's scale_rewards must be one of"),
            (dict(baseline="median"), "^GroupRelative's baseline must be one of"),
            (dict(std_threshold=-1.0), "^GroupRelative's std_threshold must be non-negative"),
            (dict(epsilon=0.0), "^GroupRelative's epsilon must be positive"),
        ]:
            with pytest.raises(ValueError, match=message):
                MCAdvantage(4, estimator=GroupRelative(**kw))
        with pytest.raises(ValueError, match=r"\(given as epsilon=\) must be positive"):
            MCAdvantage(4, epsilon=0.0)  # the deprecated flat keyword, named as well


class TestBadInput:
    @pytest.mark.parametrize("case", bad_inputs(), ids=lambda c: c[0])
    def test_raises_clearly_and_changes_nothing(self, case):
        _, batch, error, words = case
        trajs = random_stream(5, 4, 9)
        first, rest = torch.cat(trajs[:9]), torch.cat(trajs[9:])
        clean = MCAdvantage(4, prompt_key="seed", trajectory_return="sum")
        clean.inv(first)
        t = MCAdvantage(4, prompt_key="seed", trajectory_return="sum")
        t.inv(first)
        before = t.get_stats()
        with pytest.raises(error, match=re.escape(words[0])) as info:
            t.inv(batch)
        for word in words:
            assert word in str(info.value)
        assert t.get_stats() == before
        got, want = released(t.inv(rest)), released(clean.inv(rest))
        assert got.keys() == want.keys() and len(got) > 0
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert t.get_stats() == clean.get_stats()


class TestReplayBuffer:
    def test_extend_holds_back_incomplete_groups(self):
        rb = ReplayBuffer(storage=LazyTensorStorage(1000), batch_size=8)
        t = MCAdvantage(3, prompt_key="seed", trajectory_return="sum")
        rb.append_transform(t)
        trajs = [trajectory(g, torch.randn(4)) for g in (0, 1, 0, 1, 0)]
        rb.extend(torch.cat(trajs))
        assert len(rb) == 12  # group 0 released, group 1 (2 of 3) pending
        assert t.queued_groups == 1 and t.queued_trajectories == 2
        assert list(t.queues) == [1] and len(t.queues[1]) == 2
        rb.extend(trajectory(1, torch.randn(4)))
        assert len(rb) == 24 and t.queued_trajectories == 0
        sample = rb.sample()
        assert sample["advantage"].shape == (8, 1)
        assert set(rb[:]["seed"].tolist()) == {0, 1}

    def test_single_steps_without_a_batch_dimension(self):
        t = MCAdvantage(2, prompt_key="seed")
        assert t.inv(trajectory(5, [1.0])[0]) is None
        out = t.inv(trajectory(5, [3.0])[0])
        assert out["advantage"].squeeze(-1).tolist() == pytest.approx([-0.7071, 0.7071], abs=1e-4)

    def test_ragged_data_into_a_lazy_stack_storage(self):
        rb = ReplayBuffer(storage=LazyStackStorage(100))
        rb.append_transform(MCAdvantage(2))
        steps = [
            TensorDict(
                query=NonTensorData("p"),
                tokens=torch.arange(n),
                next=TensorDict(reward=torch.full((n, 1), float(n)), done=torch.tensor([True])),
            )
            for n in (2, 5)
        ]
        rb.extend(lazy_stack(steps[:1]))
        rb.extend(lazy_stack(steps[1:]))
        assert len(rb) == 2
        advs = [rb[i]["advantage"] for i in range(2)]
        assert [a.shape for a in advs] == [(2, 1), (5, 1)]
        values = torch.cat([torch.full((2,), 2.0), torch.full((5,), 5.0)])
        want = (values - values.mean()) / values.std()
        torch.testing.assert_close(torch.cat(advs).reshape(-1), want)

    def test_stats_reset_and_clear(self):
        t = MCAdvantage(2, prompt_key="seed", trajectory_return="sum")
        t.inv(torch.cat([trajectory(0, [1.0]), trajectory(1, [0.0]), trajectory(0, [0.0])]))
        stats = t.get_stats()
        assert stats["completed_trajectories"] == 3 and stats["written_groups"] == 1
        assert stats["trajectory_return_sum"] == 1.0 and stats["successful_trajectories"] == 1
        assert stats["queued_groups"] == 1 and stats["max_queued_trajectories_per_group"] == 1
        t.reset_stats()
        assert t.completed_trajectories == 0 and t.queued_trajectories == 1
        t.clear_queues()
        assert t.queued_trajectories == 0 and t.queues == {}

    def test_share_memory_keeps_working_in_process(self):
        t = MCAdvantage(2, prompt_key="seed")
        t.inv(trajectory(0, [1.0]))
        assert not t.is_shared
        t.share_memory_()
        assert t.is_shared and t.queued_trajectories == 1
        out = t.inv(trajectory(0, [3.0]))
        assert out["advantage"].squeeze(-1).tolist() == pytest.approx([-0.7071, 0.7071], abs=1e-4)
        assert t.get_stats()["written_groups"] == 1

    def test_output_does_not_alias_the_input(self):
        batch = torch.cat([trajectory(0, [1.0]), trajectory(0, [2.0])])
        rb = ReplayBuffer(storage=LazyTensorStorage(10))
        rb.append_transform(MCAdvantage(2, prompt_key="seed"))
        rb.extend(batch)
        assert "advantage" not in batch.keys()


class TestNumerics:
    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_half_precision_rewards(self, dtype):
        trajs = [trajectory(0, [60000.0] * 4), trajectory(0, [-60000.0] * 4)]
        for t in trajs:
            t["next", "reward"] = t["next", "reward"].to(dtype)
        out = MCAdvantage(2, prompt_key="seed", trajectory_return="sum").inv(torch.cat(trajs))
        adv = out["advantage"]
        assert adv.dtype == dtype and torch.isfinite(adv).all()  # sums of 2.4e5 overflow fp16
        assert adv[:4].float().reshape(-1).tolist() == pytest.approx([0.7071] * 4, abs=1e-2)

    @pytest.mark.parametrize("scale", [1e-20, 1e18])
    def test_extreme_rewards(self, scale):
        trajs = [trajectory(0, [r * scale]) for r in (1.0, 2.0, 3.0)]
        for mode in (None, "sum"):
            tiny = GroupRelative(epsilon=1e-30)
            out = MCAdvantage(3, prompt_key="seed", trajectory_return=mode, estimator=tiny).inv(
                torch.cat([t.clone() for t in trajs])
            )
            assert out["advantage"].squeeze(-1).tolist() == pytest.approx(
                [-1.0, 0.0, 1.0], abs=1e-5
            )


class TestDevices:
    """Data on any device: stored and released there, the same advantages as on the CPU."""

    @pytest.mark.parametrize(
        "kwargs",
        [
            {},
            {"trajectory_return": "sum"},
            {"trajectory_return": "sum", "estimator": GroupRelative(whiten=True)},
            {"estimator": GroupRelative(scale_rewards="batch", std_threshold=0.0)},
            {"estimator": StepGroups(anchor_key="state", step_weight=0.5)},
            {
                "estimator": GroupRelative(
                    reward_weights={("next", "reward"): 1.0, ("next", "format"): 0.5}
                )
            },
        ],
        ids=["per_step", "sum", "whiten", "batch_std", "gigpo", "gdpo"],
    )
    def test_buffer_on_device(self, device, kwargs):
        """A buffer whose storage is on ``device``, fed ``device`` data (the case that failed on
        CUDA in ``_group_codes``): every stored tensor is there, advantages equal the CPU's."""
        trajs = [
            trajectory(
                g % 3,
                torch.randn(n),
                state=torch.arange(n) % 2,
                next_format=torch.rand(n, 1),
            )
            for g, n in enumerate([3, 2, 4, 1, 3, 2, 2, 4, 1])
        ]
        chunks = [torch.cat(trajs[:4]), torch.cat(trajs[4:7]), torch.cat(trajs[7:])]

        def run(dev):
            rb = ReplayBuffer(storage=LazyTensorStorage(100, device=dev))
            rb.append_transform(MCAdvantage(grpo_size=3, prompt_key="seed", **kwargs))
            for chunk in chunks:
                rb.extend(chunk.to(dev))
            return rb[:]

        want, got = run("cpu"), run(device)
        assert got["advantage"].device.type == device.type
        assert got["uid"].tolist() == want["uid"].tolist()
        torch.testing.assert_close(got["advantage"].cpu(), want["advantage"])

    def test_streaming_on_device(self, device):
        """Trajectories that cross insertions, from ``device`` batches: held there, joined there."""
        batches, _ = collector_stream(3, 4, 3, seed=5, max_len=6, steps_per_batch=4)
        want = streaming(trajectory_return="sum")
        got = streaming(trajectory_return="sum")
        for batch in batches:
            a, b = want.inv(batch), got.inv(batch.to(device))
            assert (a is None) == (b is None)
            if b is not None:
                assert b["advantage"].device.type == device.type
                assert b["uid"].tolist() == a["uid"].tolist()
                torch.testing.assert_close(b["advantage"].cpu(), a["advantage"])
        assert got.held_trajectories == 0

    def test_string_prompts_on_device(self, device):
        trajs = [trajectory(p, torch.randn(2)) for p in ["a", "b", "a", "b"]]
        t = MCAdvantage(grpo_size=2, prompt_key="seed")
        out = t.inv(torch.cat(trajs).to(device))
        assert out["advantage"].device.type == device.type
        assert out.shape == (8,)
