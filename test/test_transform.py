"""Tests of torchrl_grpo/transform.py: parity with torchrl, estimators, inputs, errors."""

import random
import re
import statistics
import warnings

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
    trajectory,
)
from tensordict import NonTensorData, NonTensorStack, TensorDict, lazy_stack
from torchrl.data import LazyStackStorage, LazyTensorStorage, ReplayBuffer
from torchrl.objectives.llm import MCAdvantage as TorchRLMCAdvantage
from torchrl.objectives.value.functional import reward2go

from torchrl_grpo import MCAdvantage, MCAdvantageSelector, group_relative_advantage
from torchrl_grpo.advantages import (
    gigpo_advantage,
    multi_reward_advantage,
    pass_at_k_advantage,
    reinforce_pp_baseline_advantage,
    step_level_advantage,
)


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
            t = MCAdvantage(3, prompt_key="seed", trajectory_return="sum", **kw)
            adv, _ = self.release(t, trajs)
            assert adv.squeeze(-1).tolist() == pytest.approx(
                want.repeat_interleave(torch.tensor([2, 1, 3])).tolist()
            )
        t = MCAdvantage(
            3, prompt_key="seed", trajectory_return="sum", scale_rewards="none", step_norm=True
        )
        adv, _ = self.release(t, trajs)
        assert adv.squeeze(-1).tolist() == pytest.approx([0.0, 0.0, -2.0, 2 / 3, 2 / 3, 2 / 3])

    def test_step_norm_per_step(self):
        """Per-step samples: each element's advantage is divided by its trajectory's steps."""
        trajs = [trajectory(0, [1.0, 1.0]), trajectory(0, [0.0]), trajectory(0, [0.0, 0.0, 4.0])]
        t = MCAdvantage(3, prompt_key="seed", scale_rewards="none", step_norm=True)
        adv, _ = self.release(t, trajs)  # mean of the six rewards is 1
        assert adv.squeeze(-1).tolist() == pytest.approx([0.0, 0.0, -1.0, -1 / 3, -1 / 3, 1.0])

    def test_batch_scale_uses_every_released_return(self):
        trajs = [trajectory(g, [r]) for g, r in [(0, 0.0), (0, 2.0), (1, 10.0), (1, 30.0)]]
        t = MCAdvantage(2, prompt_key="seed", trajectory_return="sum", scale_rewards="batch")
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
        t = MCAdvantage(2, prompt_key="seed", trajectory_return="sum", std_threshold=0.0)
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
            (dict(scale_rewards="std"), "scale_rewards must be one of"),
            (dict(baseline="median"), "baseline must be one of"),
            (dict(std_threshold=-1.0), "std_threshold must be non-negative"),
            (dict(epsilon=0.0), "epsilon must be positive"),
        ]:
            with pytest.raises(ValueError, match=message):
                MCAdvantage(4, **kw)


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


class TestMemoryLimits:
    def test_drop_oldest_groups_past_max_pending_groups(self):
        t = MCAdvantage(3, prompt_key="seed", max_pending_groups=2)
        t.inv(trajectory(0, [1.0]))
        t.inv(trajectory(1, [1.0]))
        with pytest.warns(RuntimeWarning, match="max_pending_groups=2"):
            t.inv(torch.cat([trajectory(2, [1.0]), trajectory(1, [2.0])]))
        assert sorted(t.queues) == [1, 2]  # group 0 started first and was evicted
        stats = t.get_stats()
        assert stats["evicted_groups"] == 1 and stats["evicted_trajectories"] == 1
        out = t.inv(trajectory(1, [3.0]))  # group 1 still completes normally
        assert out["seed"].tolist() == [1, 1, 1]

    def test_max_pending_age_in_insertions(self):
        t = MCAdvantage(2, prompt_key="seed", max_pending_age=2)
        t.inv(trajectory(0, [1.0]))  # insertion 0
        t.inv(trajectory(1, [1.0]))  # insertion 1
        with pytest.warns(RuntimeWarning):
            t.inv(trajectory(2, [1.0]))  # insertion 2: group 0 is 2 insertions old
        assert sorted(t.queues) == [1, 2]
        assert t.get_stats()["evicted_groups"] == 1

    def test_raise_rejects_the_insertion_and_changes_nothing(self):
        t = MCAdvantage(3, prompt_key="seed", max_pending_groups=1, on_overflow="raise")
        t.inv(trajectory(0, [1.0]))
        before = t.get_stats()
        with pytest.raises(RuntimeError, match="rejected"):
            t.inv(trajectory(1, [1.0]))
        assert t.get_stats() == before and list(t.queues) == [0]

    @pytest.mark.parametrize("per_call", [1, 3])
    def test_released_trajectories_are_not_held(self, per_call):
        """What a released group used is let go: the steps held stay bounded by those pending."""
        trajs = random_stream(200, 4, 0)  # 800 trajectories of 200 groups, interleaved
        t = MCAdvantage(4, prompt_key="seed")
        for i in range(0, len(trajs), per_call):
            t.inv(torch.cat(trajs[i : i + per_call]))
            pending = t._replica.state.pending
            held = [chunk for chunk in pending.chunks.steps if chunk is not None]
            live = int(pending.spans[:, 2].sum())  # the LENGTH column
            assert sum(len(chunk) for chunk in held) <= 2 * live + 1024 + 5 * per_call
            assert len(pending.chunks.steps) <= 2 * len(held) + 64 + per_call
        chunks = t._replica.state.pending.chunks.steps
        assert t.queued_trajectories == 0 and not [c for c in chunks if c is not None]

    def test_invalid_limits(self):
        for kw, message in [
            (dict(max_pending_groups=0), "max_pending_groups must be at least 1"),
            (dict(max_pending_age=0), "max_pending_age must be at least 1"),
            (dict(on_overflow="drop"), "on_overflow must be"),
        ]:
            with pytest.raises(ValueError, match=message):
                MCAdvantage(2, **kw)


def _write_from_process(rb, trajs):
    for t in trajs:
        rb.extend(t)


class TestManyWriters:
    def test_shared_replay_buffer_across_processes(self):
        import multiprocessing as mp

        transform = MCAdvantage(4, prompt_key="seed", trajectory_return="sum")
        rb = ReplayBuffer(storage=LazyTensorStorage(1000, shared_init=True), shared=True)
        rb.append_transform(transform)
        assert transform.is_shared
        trajs = [trajectory(g, [float(i), 1.0]) for g in range(5) for i in range(4)]
        trajs = trajs[:-1]  # the last group stays one short
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_write_from_process, args=(rb, trajs[w::2])) for w in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in procs] == [0, 0]
        # every group's trajectories came from both processes, and four groups completed
        assert len(rb) == 4 * 4 * 2 and transform.queued_trajectories == 3
        stats = transform.get_stats()
        assert stats["completed_trajectories"] == len(trajs) and stats["written_groups"] == 4
        assert sorted(set(rb[:]["seed"].tolist())) == [0, 1, 2, 3]

    def test_inside_a_ray_replay_buffer(self):
        ray = pytest.importorskip("ray", reason="the `dist` extra (ray) is not installed")
        from functools import partial

        from torchrl.data import RayReplayBuffer

        rb = RayReplayBuffer(
            storage=partial(LazyTensorStorage, 1000),
            transform_factory=partial(MCAdvantage, 4, prompt_key="seed", trajectory_return="sum"),
            ray_init_config={"num_cpus": 2, "include_dashboard": False, "log_to_driver": False},
            remote_config={"num_cpus": 0},
        )
        try:

            @ray.remote(num_cpus=1)
            def write(client, trajs):
                for t in trajs:
                    client.extend(t)
                return len(trajs)

            trajs = [trajectory(g, [float(i), 1.0]) for g in range(5) for i in range(4)][:-1]
            remote = ray.get(write.remote(rb.client(), trajs[1::2]))  # another process
            for t in trajs[::2]:
                rb.extend(t)
            assert remote == len(trajs[1::2])
            assert len(rb) == 4 * 4 * 2  # four groups completed across the two writers
            sample = rb.sample(8)
            assert sample["advantage"].shape == (8, 1)
        finally:
            rb.shutdown()
            ray.shutdown()


def _stream_outputs(t, chunks):
    out = {}
    for chunk in chunks:
        out.update(released(t.inv(chunk)))
    return out


class TestProperties:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=25, deadline=None)
    @given(
        num_groups=st.integers(1, 6),
        size=st.integers(2, 5),
        mode=st.sampled_from([None, "sum", "mean", "max", "last"]),
        strings=st.booleans(),
        scale=st.sampled_from(["group", "batch"]),
        seed=st.integers(0, 10**6),
    )
    def test_order_and_chunking_do_not_matter(self, num_groups, size, mode, strings, scale, seed):
        """The same steps are released whatever the order and the chunking; with a per-group
        scale, with the same advantages. With ``scale_rewards="batch"`` the scale is the std of
        whatever one call releases, so a chunk changes it: each group's advantages are then the
        same up to one positive factor, and one trajectory per call (one group per release) gives
        the per-group scale exactly."""
        key = "query" if strings else "seed"
        trajs = random_stream(num_groups, size, seed, strings=strings, key=key)
        kw = dict(grpo_size=size, prompt_key=key, trajectory_return=mode, scale_rewards=scale)
        one_by_one = _stream_outputs(MCAdvantage(**kw), trajs)
        shuffled = trajs[:]
        random.Random(seed + 1).shuffle(shuffled)
        chunked = _stream_outputs(MCAdvantage(**kw), random_chunks(shuffled, seed))
        assert one_by_one.keys() == chunked.keys()
        assert len(one_by_one) == sum(t.numel() for t in trajs)
        if scale == "group":
            for uid, adv in one_by_one.items():
                torch.testing.assert_close(chunked[uid], adv, atol=1e-6, rtol=1e-6)
            return
        per_group = _stream_outputs(MCAdvantage(**{**kw, "scale_rewards": "group"}), trajs)
        for uid, adv in one_by_one.items():
            torch.testing.assert_close(per_group[uid], adv, atol=1e-6, rtol=1e-6)
        groups: dict = {}
        for t in trajs:
            groups.setdefault(t[0][key] if strings else int(t[key][0]), []).extend(
                t["uid"].tolist()
            )
        for uids in groups.values():
            a = torch.cat([one_by_one[u].reshape(-1) for u in uids]).double()
            b = torch.cat([chunked[u].reshape(-1) for u in uids]).double()
            if a.abs().max() < 1e-6:  # a constant group: zero either way
                assert b.abs().max() < 1e-6
                continue
            factor = float(a @ b / (a @ a))
            assert factor > 0
            torch.testing.assert_close(b, factor * a, atol=1e-5, rtol=1e-4)

    @settings(max_examples=25, deadline=None)
    @given(
        size=st.integers(2, 5),
        mode=st.sampled_from(["sum", "mean", "last"]),
        constant=st.booleans(),
        seed=st.integers(0, 10**6),
    )
    def test_written_groups_are_normalized(self, size, mode, constant, seed):
        rng = random.Random(seed)
        value = rng.gauss(0, 1)
        trajs = [
            trajectory(
                0, [value if constant else rng.gauss(0, 3) for _ in range(rng.randint(1, 4))]
            )
            for _ in range(size)
        ]
        out = MCAdvantage(size, prompt_key="seed", trajectory_return=mode).inv(torch.cat(trajs))
        per_traj = torch.stack([out["advantage"][out["uid"] == t["uid"][0]][0, 0] for t in trajs])
        assert torch.isfinite(out["advantage"]).all()
        returns = torch.tensor(
            [
                float(
                    {
                        "sum": t["next", "reward"].sum(),
                        "mean": t["next", "reward"].mean(),
                        "last": t["next", "reward"][-1, 0],
                    }[mode]
                )
                for t in trajs
            ]
        )
        assert abs(float(per_traj.mean())) < 1e-5
        if (returns == returns[0]).all():
            assert (per_traj == 0).all()
        elif float(returns.std()) > 1e-3:
            assert float(per_traj.std()) == pytest.approx(1.0, rel=1e-4)

    @settings(max_examples=25, deadline=None)
    @given(seed=st.integers(0, 10**6), limit=st.integers(1, 4), bounds=st.booleans())
    def test_every_trajectory_is_accounted_for(self, seed, limit, bounds):
        trajs = random_stream(8, 3, seed, binary=True)
        t = MCAdvantage(
            3,
            prompt_key="seed",
            trajectory_return="sum",
            keep_return_bounds=(0.1, 0.9) if bounds else None,
            max_pending_groups=limit,
        )
        stored = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for chunk in random_chunks(trajs, seed):
                out = t.inv(chunk)
                stored += (
                    0
                    if out is None
                    else len(set(out["uid"].tolist()) & {int(tr["uid"][0]) for tr in trajs})
                )
        stats = t.get_stats()
        dropped_by_rule = 3 * (stats["dropped_groups"]) + stats["evicted_trajectories"]
        assert len(trajs) == stored + t.queued_trajectories + dropped_by_rule


class TestBadInputUnderLoad:
    def test_bad_calls_in_a_long_stream_change_nothing(self):
        rng = random.Random(11)
        trajs = random_stream(40, 4, 12)
        chunks = random_chunks(trajs, 13)
        bad = [case[1] for case in bad_inputs()]
        clean = MCAdvantage(4, prompt_key="seed", trajectory_return="sum")
        loaded = MCAdvantage(4, prompt_key="seed", trajectory_return="sum")
        failures = 0
        for chunk in chunks:
            for _ in range(rng.randint(0, 2)):
                with pytest.raises(
                    (RuntimeError, KeyError, ValueError, TypeError), match="^'?MCAdvantage: "
                ):
                    loaded.inv(rng.choice(bad))
                failures += 1
            got, want = released(loaded.inv(chunk)), released(clean.inv(chunk))
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want)
        assert failures > 10 and loaded.get_stats() == clean.get_stats()


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
            out = MCAdvantage(3, prompt_key="seed", trajectory_return=mode, epsilon=1e-30).inv(
                torch.cat([t.clone() for t in trajs])
            )
            assert out["advantage"].squeeze(-1).tolist() == pytest.approx(
                [-1.0, 0.0, 1.0], abs=1e-5
            )


class TestDynamicSamplingBounds:
    """``keep_return_bounds`` keeps and drops exactly the groups torchrl keeps and drops."""

    @staticmethod
    def group(rewards, steps):
        """Two trajectories of group 0: each return split evenly over ``steps`` steps."""
        return [trajectory(0, [r / steps] * steps) for r in rewards]

    @pytest.mark.parametrize(
        "rewards, steps, bounds, kept",
        [
            # float32 sums of 0.1 three times (0.3f) put the mean just above 0.1, as torchrl sees it
            ((0.3, -0.1), 3, (0.1, 2.5), True),
            ((0.3, -0.1), 3, (-1.0, 0.1), False),
            ((0.25, 0.75), 1, (0.5, 2.0), False),  # a mean on a bound: exclusive bounds
        ],
    )
    def test_float32_returns_on_a_bound(self, rewards, steps, bounds, kept):
        kw = dict(grpo_size=2, prompt_key="seed", trajectory_return="sum")
        ours = MCAdvantage(**kw, keep_return_bounds=bounds)
        ref = TorchRLMCAdvantage(**kw, keep_return_bounds=bounds)
        trajs = self.group(rewards, steps)
        outs = [(ours.inv(t.clone()), ref.inv(t.clone())) for t in trajs]
        assert (outs[-1][1] is not None) == kept  # torchrl's decision, as the case says
        assert (outs[-1][0] is not None) == kept
        assert ours.get_stats()["dropped_groups"] == ref.get_stats()["dropped_groups"]

    @pytest.mark.parametrize("mode", ["sum", "mean", "max"])
    def test_same_decisions_as_torchrl_on_a_grid(self, mode):
        values = [0.0, 0.1, 0.2, 0.3, 0.05, 0.15, 0.7, 1.1, -0.1]
        bounds_list = [(0.1, 2.5), (0.05, 2.5), (0.15, 2.5), (-1.0, 0.1), (-1.0, 0.2)]
        for steps in (1, 3):
            for bounds in bounds_list:
                chunks = []
                for g, (a, b) in enumerate((a, b) for a in values for b in values):
                    for r in (a, b):
                        chunks.append(trajectory(g, [r / steps] * steps))
                kw = dict(
                    grpo_size=2,
                    prompt_key="seed",
                    trajectory_return=mode,
                    keep_return_bounds=bounds,
                )
                assert_same_releases(chunks, kw)
                assert_same_releases([torch.cat(chunks)], kw)  # all groups in one call


class TestPendingGroupsView:
    """``queues`` is a live view: what torchrl users do with it changes the transform."""

    def filled(self, **kw):
        t = MCAdvantage(3, prompt_key="seed", trajectory_return="sum", **kw)
        t.inv(torch.cat([trajectory(g, [float(g), 1.0]) for g in (4, 2, 4, 7)]))
        return t

    def test_clear_drops_every_pending_trajectory(self):
        t = self.filled()
        stats = t.get_stats()
        t.queues.clear()
        assert t.queued_trajectories == 0 and t.queued_groups == 0 and len(t.queues) == 0
        stats.update(queued_groups=0, queued_trajectories=0, max_queued_trajectories_per_group=0)
        assert t.get_stats() == stats  # statistics are kept, as in torchrl
        assert t.inv(trajectory(4, [1.0])) is None  # group 4 starts over

    def test_same_view_as_torchrl_queues(self):
        chunks = random_chunks(random_stream(6, 5, 3), 3)
        ours, ref = MCAdvantage(4, prompt_key="seed"), TorchRLMCAdvantage(4, prompt_key="seed")
        for chunk in chunks:
            ours.inv(chunk)
            ref.inv(chunk)
        assert sorted(ours.queues) == sorted(ref.queues)
        for group in ref.queues:
            mine, theirs = ours.queues[group], list(ref.queues[group])
            assert len(mine) == len(theirs)
            for a, b in zip(mine, theirs):
                assert torch.equal(a["uid"], b["uid"])

    def test_delete_and_pop_one_group(self):
        t = self.filled()
        assert list(t.queues) == [4, 2, 7] and 4 in t.queues and 5 not in t.queues
        assert [len(t.queues[g]) for g in t.queues] == [2, 1, 1]
        del t.queues[2]
        assert list(t.queues) == [4, 7] and t.queued_trajectories == 3
        popped = t.queues.pop(7)
        assert len(popped) == 1 and int(popped[0]["seed"][0]) == 7
        assert t.queues.pop(7, None) is None and list(t.queues) == [4]
        out = t.inv(trajectory(4, [3.0]))  # group 4 completes as if nothing else was there
        want = MCAdvantage(3, prompt_key="seed", trajectory_return="sum")
        want.inv(torch.cat([trajectory(4, [4.0, 1.0]), trajectory(4, [4.0, 1.0])]))
        expected = want.inv(trajectory(4, [3.0]))
        torch.testing.assert_close(out["advantage"], expected["advantage"])

    def test_missing_groups_and_writes_raise(self):
        t = self.filled()
        with pytest.raises(KeyError, match="5"):
            t.queues[5]
        with pytest.raises(KeyError, match="5"):
            del t.queues[5]
        with pytest.raises(KeyError, match="5"):
            t.queues.pop(5)
        with pytest.raises(TypeError, match="filled by inserting trajectories"):
            t.queues[4] = []
        with pytest.raises(TypeError, match="filled by inserting trajectories"):
            t.queues.update({9: []})
        with pytest.raises(AttributeError, match="append"):
            t.queues[4].append(trajectory(4, [1.0]))  # a tuple: not a silent no-op
        assert t.queued_trajectories == 4

    def test_string_prompts_and_shared_state(self):
        t = MCAdvantage(2)
        t.inv(trajectory("a prompt", [1.0], key="query"))
        t.share_memory_()
        t.inv(trajectory("another", [1.0], key="query"))
        assert list(t.queues) == ["a prompt", "another"]
        del t.queues["a prompt"]
        assert list(t.queues) == ["another"] and t.queued_trajectories == 1
        assert repr(t.queues) == "PendingGroups({'another': 1})"


class TestIntegerArguments:
    @pytest.mark.parametrize(
        "kw, name",
        [
            (dict(grpo_size=2.7), "grpo_size"),
            (dict(grpo_size=2.0), "grpo_size"),
            (dict(grpo_size=True), "grpo_size"),
            (dict(grpo_size="4"), "grpo_size"),
            (dict(grpo_size=2, candidate_group_size=3.5), "candidate_group_size"),
            (dict(grpo_size=2, candidate_selection_min_size=False), "candidate_selection_min_size"),
            (dict(grpo_size=2, max_pending_groups=1.5), "max_pending_groups"),
            (dict(grpo_size=2, max_pending_age=True), "max_pending_age"),
        ],
    )
    def test_non_integers_are_rejected(self, kw, name):
        with pytest.raises(TypeError, match=f"{name} must be an integer, got"):
            MCAdvantage(**kw)

    def test_integer_types_are_converted(self):
        import numpy as np

        t = MCAdvantage(
            np.int64(4),
            trajectory_return="sum",
            candidate_group_size=torch.tensor(6),
            max_pending_groups=np.int32(3),
        )
        assert (t.grpo_size, t.candidate_group_size, t.max_pending_groups) == (4, 6, 3)
        assert all(type(v) is int for v in (t.grpo_size, t.candidate_group_size))


class _CountingLock:
    """A lock that counts how often it is taken (as the manager's RLock would be)."""

    def __init__(self):
        self.entered = 0

    def __enter__(self):
        self.entered += 1
        return self

    def __exit__(self, *exc):
        return False


class TestSharedStateReadsTakeTheLock:
    @pytest.mark.parametrize(
        "read",
        [
            lambda t: t.queued_groups,
            lambda t: t.queued_trajectories,
            lambda t: t.max_queued_trajectories_per_group,
            lambda t: t.completed_trajectories,
            lambda t: t.get_stats(),
            lambda t: list(t.queues),
            lambda t: len(t.queues),
            lambda t: t.queues[0],
            lambda t: 0 in t.queues,
        ],
    )
    def test_reads(self, read):
        t = MCAdvantage(2, prompt_key="seed")
        t.inv(trajectory(0, [1.0]))
        t._replica.lock = lock = _CountingLock()
        read(t)
        assert lock.entered >= 1

    def test_writes(self):
        t = MCAdvantage(2, prompt_key="seed")
        t.inv(trajectory(0, [1.0]))
        t._replica.lock = lock = _CountingLock()
        t.written_groups = 5
        del t.queues[0]
        assert lock.entered >= 2 and t.written_groups == 5 and t.queued_trajectories == 0


class TestSelectorInPerStepMode:
    def test_ignored_as_in_torchrl(self):
        """torchrl consults the selector only with a trajectory return."""

        class Never(MCAdvantageSelector):
            def select(self, candidates, *, group_size, keep_return_bounds=None):
                return None

        chunks = random_chunks(random_stream(5, 3, 4), 4)
        ours = assert_same_releases(
            chunks, dict(grpo_size=3, prompt_key="seed", candidate_selector=Never())
        )
        assert ours.get_stats()["written_groups"] == 5


GDPO_KEYS = {("next", "reward"): 1.0, ("next", "format"): 0.5}


def agent_episodes(num_groups=2, size=3, seed=0, strings=False):
    """Multi-step episodes whose states repeat within a group: (trajectories, the pieces)."""
    gen = torch.Generator().manual_seed(seed)
    trajs, returns, rewards, lengths, states, groups = [], [], [], [], [], []
    for g in range(num_groups):
        for _ in range(size):
            n = int(torch.randint(1, 5, (1,), generator=gen))
            r = torch.randint(0, 2, (n,), generator=gen).float()
            s = torch.randint(0, 3, (n,), generator=gen)
            obs = [f"room {int(v)}" for v in s] if strings else s
            fmt = torch.rand(n, generator=gen)
            trajs.append(trajectory(g, r.tolist(), obs=obs, next_format=fmt.reshape(n, 1)))
            returns.append(float(r.sum()))
            rewards.append(r)
            lengths.append(n)
            states.append(s)
            groups.append(g)
    pieces = (
        torch.tensor(returns),
        torch.tensor(groups),
        torch.cat(rewards),
        torch.tensor(lengths),
        torch.cat(states),
    )
    return trajs, pieces


class TestEstimatorsBeyondTorchRL:
    """The keywords of REINFORCE++-baseline, pass@k, GDPO and GiGPO, against the pure math."""

    def release(self, t, trajs):
        out = t.inv(torch.cat(trajs))
        return out["advantage"].squeeze(-1), out

    def test_whiten_is_reinforce_pp_baseline(self):
        trajs = [trajectory(g, r) for g, r in [(0, [0.0, 1.0]), (0, [3.0]), (1, [9.0]), (1, [5.0])]]
        t = MCAdvantage(
            2, prompt_key="seed", trajectory_return="sum", scale_rewards="none", whiten=True
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
        t = MCAdvantage(2, prompt_key="seed", whiten=True, scale_rewards="none")
        adv, _ = self.release(t, trajs)
        x = torch.tensor([1.0, 2.0, 6.0, 2.0, 4.0])
        want = reinforce_pp_baseline_advantage(x, torch.tensor([0, 0, 0, 1, 1]))
        torch.testing.assert_close(adv.double(), want, atol=1e-6, rtol=1e-6)

    def test_pass_at_k(self):
        trajs = [trajectory(0, r) for r in ([1.0, 1.0], [0.0], [3.0], [0.5])]
        t = MCAdvantage(4, prompt_key="seed", trajectory_return="sum", baseline="pass_at_k")
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
        t = MCAdvantage(3, prompt_key="seed", trajectory_return=mode, reward_weights=GDPO_KEYS)
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
            (2, {"reward_weights": {("next", "reward"): 1.0}, "whiten": False}),  # one reward
            (5, {"anchor_key": "obs", "step_reward_weight": 0.0}),  # GiGPO without its term
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
                MCAdvantage(3, prompt_key="seed", trajectory_return=mode, **neutral), trajs
            )
            torch.testing.assert_close(got, plain)

    def test_gdpo_statistics_and_filters_see_the_weighted_sum(self):
        trajs = [
            trajectory(0, [1.0], next_format=[[4.0]]),
            trajectory(0, [0.0], next_format=[[2.0]]),
        ]
        t = MCAdvantage(
            2, prompt_key="seed", trajectory_return="sum", reward_weights=GDPO_KEYS,
            keep_return_bounds=(1.0, 2.5),
        )  # fmt: skip
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
            3, prompt_key="seed", trajectory_return=mode, scale_rewards=scale, anchor_key="obs",
            episode_reward_weight=0.5, step_reward_weight=2.0, step_reward_gamma=0.9,
        )  # fmt: skip
        adv, _ = self.release(t, trajs)
        if mode == "sum":
            want = gigpo_advantage(
                returns, groups, rewards, lengths, states, gamma=0.9,
                episode_weight=0.5, step_weight=2.0, scale_rewards=scale,
            )  # fmt: skip
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
        t = MCAdvantage(3, prompt_key="seed", anchor_key="obs", step_reward_gamma=0.8)
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
            3, prompt_key="seed", trajectory_return="sum", reward_weights=GDPO_KEYS,
            anchor_key="obs", step_norm=True, step_reward_weight=0.5,
        )  # fmt: skip
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
        t = MCAdvantage(3, prompt_key="seed", trajectory_return="sum", anchor_key="obs")
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
        ragged = MCAdvantage(3, prompt_key="seed", trajectory_return="sum", anchor_key="obs")
        out = ragged.inv(lazy_stack(steps))
        per_step = torch.stack([step["advantage"][0] for step in out.unbind(0)])
        torch.testing.assert_close(per_step.double(), want, atol=1e-5, rtol=1e-5)

    def test_gigpo_by_hand(self):
        """Two runs from room 7: one reaches 8 and wins, one reaches 9 and loses."""
        trajs = [trajectory(0, [0.0, 1.0], obs=[7, 8]), trajectory(0, [0.0, 0.0], obs=[7, 9])]
        t = MCAdvantage(
            2, prompt_key="seed", trajectory_return="sum", scale_rewards="none", anchor_key="obs",
            step_reward_gamma=0.5,
        )  # fmt: skip
        adv, _ = self.release(t, trajs)
        # episode: +-0.5; step group {first steps}: returns 0.5, 0 -> +-0.25; lone steps: 0
        assert adv.tolist() == [0.75, 0.5, -0.75, -0.5]
        t = MCAdvantage(
            2, prompt_key="seed", trajectory_return="sum", scale_rewards="none", anchor_key="obs",
            step_reward_gamma=0.5, step_norm=True,
        )  # fmt: skip
        adv, _ = self.release(t, trajs)
        assert adv.tolist() == [0.375, 0.25, -0.375, -0.25]

    def test_gigpo_chunking_does_not_matter(self):
        trajs, _ = agent_episodes(num_groups=3, size=4, seed=6)
        kw = dict(grpo_size=4, prompt_key="seed", trajectory_return="sum", anchor_key="obs")
        one_by_one = _stream_outputs(MCAdvantage(**kw), trajs)
        shuffled = trajs[:]
        random.Random(0).shuffle(shuffled)
        chunked = _stream_outputs(MCAdvantage(**kw), random_chunks(shuffled, 0))
        assert one_by_one.keys() == chunked.keys()
        for uid, adv in one_by_one.items():
            torch.testing.assert_close(chunked[uid], adv, atol=1e-6, rtol=1e-6)

    def test_validation(self):
        for kw, words in [
            (dict(reward_weights={}), "non-empty"),
            (dict(reward_weights={("next", "reward"): float("nan")}), "finite"),
            (dict(reward_weights={("next", "a"): 1.0}, rewards_key=("next", "b")), "rewards_key"),
            (dict(step_reward_weight=0.5), "anchor_key"),
            (dict(step_reward_gamma=0.9), "anchor_key"),
            (dict(anchor_key="obs", step_reward_gamma=1.5), "step_reward_gamma"),
            (dict(anchor_key="obs", episode_reward_weight=float("inf")), "episode_reward_weight"),
        ]:
            with pytest.raises(ValueError, match=words):
                MCAdvantage(4, **kw)

    @pytest.mark.parametrize(
        "kw, break_it, error, words",
        [
            (dict(anchor_key="obs"), lambda td: td.exclude("obs"), KeyError, "anchor key .*obs"),
            (
                dict(anchor_key="obs"),
                lambda td: td.set("obs", NonTensorStack(*[{"a": 1}] * td.shape[0])),
                TypeError,
                "tensor or a string",
            ),
            (
                dict(reward_weights=GDPO_KEYS),
                lambda td: td.exclude(("next", "format")),
                KeyError,
                "format",
            ),
            (
                dict(reward_weights=GDPO_KEYS),
                lambda td: td.set(
                    ("next", "format"), td["next", "format"].clone().fill_(float("nan"))
                ),
                ValueError,
                "non-finite reward value\\(s\\) under \\('next', 'format'\\)",
            ),
            (
                dict(reward_weights=GDPO_KEYS),
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


def _streaming(**kwargs):
    return MCAdvantage(grpo_size=3, prompt_key="seed", **kwargs)


def _same_output(got, want):
    if want is None:
        assert got is None
        return
    assert got is not None and got["uid"].tolist() == want["uid"].tolist()
    torch.testing.assert_close(got["advantage"], want["advantage"], rtol=0, atol=0)


class TestStreaming:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @pytest.mark.parametrize("layout", ["rows", "flat"])
    @pytest.mark.parametrize("trajectory_return", [None, "sum", "last"])
    def test_equals_inserting_whole_trajectories(self, layout, trajectory_return):
        """Each insertion releases exactly what inserting, whole, the trajectories that end in
        it would release; at the end every step was stored once and nothing is held."""
        batches, completed = collector_stream(4, 6, 3, seed=0)
        ours = _streaming(trajectory_return=trajectory_return)
        ref = _streaming(trajectory_return=trajectory_return, traj_key=None)
        stored = []
        for batch, whole in zip(batches, completed):
            got = ours.inv(batch if layout == "rows" else batch.reshape(-1))
            _same_output(got, ref.inv(torch.cat(whole)) if whole else None)
            stored += [] if got is None else got["uid"].tolist()
        every_step = torch.cat([b.reshape(-1) for b in batches])["uid"].tolist()
        assert sorted(stored) == sorted(every_step)
        assert ours.held_trajectories == ours.queued_trajectories == 0
        assert ours.get_stats() | {"held_steps": 0, "held_trajectories": 0} == ref.get_stats() | {
            "held_steps": 0,
            "held_trajectories": 0,
        }

    @pytest.mark.parametrize(
        "estimator",
        [
            {"whiten": True, "trajectory_return": "sum"},
            {"baseline": "pass_at_k", "trajectory_return": "sum"},
            {"anchor_key": "step_count", "step_reward_weight": 0.5},
            {"scale_rewards": "batch"},
            {"reward_to_go_gamma": 0.9},
        ],
        ids=["whiten", "pass_at_k", "gigpo", "batch_std", "reward_to_go"],
    )
    def test_estimators_see_whole_trajectories(self, estimator):
        """The estimators beyond torchrl get, from the joined stream, exactly what whole
        trajectories give them (GiGPO's anchors included, read on every step of the join)."""
        batches, completed = collector_stream(4, 6, 3, seed=3, max_len=9, steps_per_batch=4)
        ours, ref = _streaming(**estimator), _streaming(**estimator, traj_key=None)
        for batch, whole in zip(batches, completed):
            _same_output(ours.inv(batch), ref.inv(torch.cat(whole)) if whole else None)
        assert ours.held_trajectories == ours.queued_trajectories == 0

    @given(
        envs=st.integers(1, 5),
        length=st.integers(1, 9),
        steps=st.integers(1, 8),
        seed=st.integers(0, 10**6),
    )
    @settings(max_examples=40, deadline=None)
    def test_any_chunking_property(self, envs, length, steps, seed):
        """Whatever the number of environments, trajectory lengths and batch size, the advantage
        of every step is the one of whole trajectories inserted one at a time."""
        batches, completed = collector_stream(
            envs, 4, 3, seed, max_len=length, steps_per_batch=steps
        )
        ours = _streaming(trajectory_return="sum")
        ref = _streaming(trajectory_return="sum", traj_key=None)
        got, want = {}, {}
        for batch, whole in zip(batches, completed):
            got |= released(ours.inv(batch))
            for trajectory_ in whole:
                want |= released(ref.inv(trajectory_))
        assert got.keys() == want.keys()
        for uid, adv in want.items():
            torch.testing.assert_close(got[uid], adv)
        assert ours.held_trajectories == 0

    def test_held_tails_are_counted(self):
        batches, _ = collector_stream(3, 2, 3, seed=1, max_len=9, steps_per_batch=4)
        t = _streaming()
        t.inv(batches[0])
        stats = t.get_stats()
        assert stats["held_trajectories"] == t.held_trajectories == 3  # every env mid-episode?
        assert stats["held_steps"] > 0

    def test_checkpoint_with_held_tails(self, tmp_path):
        batches, completed = collector_stream(4, 6, 3, seed=2)
        t = _streaming(trajectory_return="sum")
        for batch in batches[:3]:
            t.inv(batch)
        assert t.held_trajectories > 0
        torch.save(t.state_dict(), tmp_path / "t.pt")
        restored = _streaming(trajectory_return="sum")
        restored.load_state_dict(torch.load(tmp_path / "t.pt", weights_only=True))
        assert restored.get_stats() == t.get_stats()
        for batch in batches[3:]:
            _same_output(restored.inv(batch.clone()), t.inv(batch.clone()))
        assert restored.held_trajectories == 0
        # the ended ids travel too: an id that ended before the checkpoint cannot come back
        with pytest.raises(ValueError, match="ended in an earlier insertion"):
            restored.inv(batches[0])

    def test_missing_earlier_part_raises_and_changes_nothing(self):
        batches, _ = collector_stream(3, 4, 3, seed=3, max_len=9, steps_per_batch=4)
        t = _streaming()
        with pytest.raises(ValueError, match="its earlier part is missing"):
            t.inv(batches[1])  # continuations whose first steps never arrived
        assert t.held_trajectories == 0 and t.get_stats()["completed_trajectories"] == 0
        t.inv(batches[0])  # the stream can still start from its beginning
        t.inv(batches[1])

    def test_reused_id_raises_and_changes_nothing(self):
        batches, _ = collector_stream(3, 4, 3, seed=4, max_len=3, steps_per_batch=6)
        t = _streaming()
        t.inv(batches[0])
        before = t.get_stats()
        with pytest.raises(ValueError, match=r"trajectory id \d+ .* ended in an earlier insertion"):
            t.inv(batches[0])
        assert t.get_stats() == before
        t.inv(batches[1])  # and the next batch goes through

    def test_done_inside_an_id_raises(self):
        batches, _ = collector_stream(1, 2, 3, seed=5, max_len=3, steps_per_batch=30)
        bad = batches[0].reshape(-1).clone()
        bad["collector", "traj_ids"] = torch.zeros_like(bad["collector", "traj_ids"])
        bad["step_count"] = torch.arange(bad.shape[0]).unsqueeze(-1)
        with pytest.raises(ValueError, match="has a done step before its last step"):
            _streaming().inv(bad)

    def test_step_gap_raises(self):
        batches, _ = collector_stream(1, 2, 3, seed=6, max_len=6, steps_per_batch=30)
        flat = batches[0].reshape(-1)
        done = flat["next", "done"].squeeze(-1)
        middle = (~done[:-1] & ~done[1:]).nonzero()  # a step with a step of its trajectory after
        keep = torch.ones(flat.shape[0], dtype=torch.bool)
        keep[int(middle[0]) + 1] = False  # that step is lost
        with pytest.raises(ValueError, match="steps are missing"):
            _streaming().inv(flat[keep])

    def test_without_step_count_continuations_are_trusted(self):
        batches, completed = collector_stream(3, 4, 3, seed=7)
        ours = _streaming(step_count_key=None)
        ref = _streaming(traj_key=None)
        for batch, whole in zip(batches, completed):
            _same_output(ours.inv(batch.exclude("step_count")), ref.inv(torch.cat(whole)) if whole else None)  # fmt: skip

    def test_traj_key_none_keeps_torchrl_behaviour(self):
        batches, _ = collector_stream(2, 2, 3, seed=8, max_len=9, steps_per_batch=3)
        with pytest.raises(RuntimeError, match="expected complete trajectories"):
            _streaming(traj_key=None).inv(batches[0])

    def test_age_limit_gives_up_held_trajectories(self):
        batches, _ = collector_stream(2, 2, 3, seed=9, max_len=20, steps_per_batch=2)
        t = _streaming(max_pending_age=1)
        with pytest.warns(RuntimeWarning, match="unfinished trajectories"):
            for batch in batches:
                t.inv(batch)  # later steps of the given-up ids are left out, no error
        stats = t.get_stats()
        assert stats["evicted_trajectories"] > 0 and stats["evicted_steps"] > 0
        assert t.held_trajectories <= 2

    def test_age_limit_raise_changes_nothing(self):
        batches, _ = collector_stream(2, 2, 3, seed=9, max_len=20, steps_per_batch=2)
        t = _streaming(max_pending_age=1, on_overflow="raise")
        t.inv(batches[0])
        held = t.held_trajectories
        with pytest.raises(RuntimeError, match="max_pending_age=1.*nothing changed"):
            for batch in batches[1:]:
                t.inv(batch)
        assert t.held_trajectories >= held

    def test_clear_queues_gives_up_held_trajectories(self):
        batches, _ = collector_stream(2, 2, 3, seed=10, max_len=20, steps_per_batch=3)
        t = _streaming()
        t.inv(batches[0])
        assert t.held_trajectories > 0
        t.clear_queues()
        assert t.held_trajectories == 0
        t.inv(batches[1])  # their continuations are left out, not taken for new trajectories
        assert t.get_stats()["evicted_steps"] > 0

    def test_uncollected_frames_are_not_data(self):
        batches, completed = collector_stream(2, 2, 3, seed=11)
        ours, ref = _streaming(), _streaming(traj_key=None)
        for batch, whole in zip(batches, completed):
            padded = torch.cat([batch, batch[:, :1].clone()], 1)  # one extra frame per row...
            padded["collector", "traj_ids"][:, -1] = -1  # ...that the collector did not fill
            _same_output(ours.inv(padded), ref.inv(torch.cat(whole)) if whole else None)

    def test_with_a_torchrl_collector(self):
        """frames_per_batch batches of a real collector (same-start groups on CartPole)."""
        from torchrl.collectors import Collector
        from torchrl.envs import GymEnv, StepCounter, TransformedEnv

        from torchrl_grpo import SameStartGroups

        torch.manual_seed(0)  # the collector's random policy
        env = TransformedEnv(GymEnv("CartPole-v1"), SameStartGroups(group_size=2, seeds=range(100)))
        env.append_transform(StepCounter())
        collector = Collector(env, None, frames_per_batch=50, total_frames=400)
        t = MCAdvantage(grpo_size=2, prompt_key="reset_seed", trajectory_return="sum")
        stored = 0
        for batch in collector:
            out = t.inv(batch)
            stored += 0 if out is None else out.shape[0]
        collector.shutdown()
        # nothing lost: every collected step is stored, pending in a group, or held
        pending = sum(traj.shape[0] for group in t.queues.values() for traj in group)
        assert stored > 0 and t.held_trajectories > 0  # it did cross batches
        assert stored + pending + t.get_stats()["held_steps"] == 400


# --------------------------------------------------------------------------------------------
# each step's discounted reward-to-go as its sample (reward_to_go_gamma)
# --------------------------------------------------------------------------------------------


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
        t = MCAdvantage(2, prompt_key="seed", reward_to_go_gamma=0.5)
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
        ours = MCAdvantage(3, prompt_key="seed", reward_to_go_gamma=gamma, **estimator)
        reference = TorchRLMCAdvantage if not estimator else MCAdvantage
        ref = reference(3, prompt_key="seed", rewards_key=("next", "reward_to_go"), **estimator)
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
        ours = _streaming(reward_to_go_gamma=0.9)
        ref = _streaming(traj_key=None, rewards_key=("next", "reward_to_go"))
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
        zero = MCAdvantage(3, prompt_key="seed", reward_to_go_gamma=0.0)
        for chunk in chunks:
            got, want = released(zero.inv(chunk.clone())), released(plain.inv(chunk.clone()))
            assert got.keys() == want.keys()
            assert all(torch.equal(got[uid], want[uid]) for uid in want)
        single = random_stream(4, 3, seed=5, max_len=1)
        want = MCAdvantage(3, prompt_key="seed").inv(torch.cat(single))["advantage"]
        got = MCAdvantage(3, prompt_key="seed", reward_to_go_gamma=0.7).inv(torch.cat(single))
        assert torch.equal(got["advantage"], want)
        trajs = [trajectory(0, [1.0, 2.0, 3.0]), trajectory(0, [5.0])]
        got = MCAdvantage(2, prompt_key="seed", reward_to_go_gamma=1.0).inv(torch.cat(trajs))
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
        got = MCAdvantage(3, prompt_key="seed", reward_to_go_gamma=0.8).inv(steps.clone())
        want = MCAdvantage(3, prompt_key="seed", rewards_key=("next", "reward_to_go")).inv(
            _with_reward2go(steps, 0.8)
        )
        assert got["advantage"].shape == (steps.shape[0], 2)
        torch.testing.assert_close(got["advantage"], want["advantage"], atol=1e-5, rtol=1e-5)

    def test_several_rewards(self):
        """GDPO: each reward's reward-to-go normalized within the group, then weighted."""
        trajs, _ = agent_episodes(seed=11)
        steps = torch.cat(trajs)
        got = MCAdvantage(3, prompt_key="seed", reward_weights=GDPO_KEYS, reward_to_go_gamma=0.6)
        discounted = _with_reward2go(
            _with_reward2go(steps, 0.6, out=("next", "reward_rtg")),
            0.6,
            key=("next", "format"),
            out=("next", "format_rtg"),
        )
        ref = MCAdvantage(
            3, prompt_key="seed",
            reward_weights={("next", "reward_rtg"): 1.0, ("next", "format_rtg"): 0.5},
        )  # fmt: skip
        torch.testing.assert_close(
            got.inv(steps)["advantage"], ref.inv(discounted)["advantage"], atol=1e-5, rtol=1e-5
        )

    def test_checkpoint_state_is_unaffected(self, tmp_path):
        """The reward-to-go is computed at release: what is pending or held (and saved) is the
        raw steps, the same with or without it, and a state saved by either restores in either."""
        batches, _ = collector_stream(4, 6, 3, seed=13, max_len=9, steps_per_batch=4)
        with_it, without = _streaming(reward_to_go_gamma=0.9), _streaming()
        for batch in batches[:3]:
            with_it.inv(batch.clone())
            without.inv(batch.clone())
        assert with_it.held_trajectories > 0 and with_it.queued_trajectories > 0
        saved, plain = with_it.state_dict(), without.state_dict()
        torch.save(plain, tmp_path / "plain.pt")
        saved, plain = dict(_flat_items(saved)), dict(_flat_items(plain))
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
        restored = _streaming(reward_to_go_gamma=0.9)
        restored.load_state_dict(torch.load(tmp_path / "plain.pt", weights_only=True))
        for batch in batches[3:]:
            _same_output(restored.inv(batch.clone()), with_it.inv(batch.clone()))

    def test_validation(self):
        for kw, error, words in [
            (dict(reward_to_go_gamma=1.5), ValueError, r"reward_to_go_gamma must be in \[0, 1\]"),
            (dict(reward_to_go_gamma=-0.1), ValueError, r"must be in \[0, 1\], got -0.1"),
            (dict(reward_to_go_gamma=float("nan")), ValueError, r"must be in \[0, 1\], got nan"),
            (dict(reward_to_go_gamma=True), TypeError, "real number .*True .*bool"),
            (dict(reward_to_go_gamma="0.9"), TypeError, "real number .*'0.9' .*str"),
            (
                dict(reward_to_go_gamma=0.9, trajectory_return="sum"),
                ValueError,
                "requires trajectory_return=None, got trajectory_return='sum'",
            ),
            (
                dict(reward_to_go_gamma=0.9, anchor_key="obs"),
                ValueError,
                "cannot be combined with anchor_key.*step_reward_gamma",
            ),
        ]:
            with pytest.raises(error, match=words):
                MCAdvantage(4, **kw)
        assert MCAdvantage(4, reward_to_go_gamma=1).reward_to_go_gamma == 1.0  # an int is fine
        assert MCAdvantage(4).reward_to_go_gamma is None

    def test_ragged_steps_raise_and_change_nothing(self):
        t = MCAdvantage(2, reward_to_go_gamma=0.9)
        steps = [
            TensorDict(
                query=NonTensorData("prompt"),
                next=TensorDict(reward=torch.ones(n, 1), done=torch.tensor([done])),
            )
            for n, done in ((2, False), (3, True))
        ]
        before = t.get_stats()
        with pytest.raises(ValueError, match="reward_to_go_gamma .* ragged"):
            t.inv(lazy_stack(steps))
        assert t.get_stats() == before and t.queued_trajectories == 0


def _flat_items(state, prefix=()):
    """``(path, leaf)`` of a nested checkpoint (dicts, lists and tuples walked through)."""
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _flat_items(value, (*prefix, str(key)))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from _flat_items(value, (*prefix, str(i)))
    else:
        yield prefix, state


class TestDevices:
    """Data on any device: stored and released there, the same advantages as on the CPU."""

    @pytest.mark.parametrize(
        "kwargs",
        [
            {},
            {"trajectory_return": "sum"},
            {"trajectory_return": "sum", "whiten": True},
            {"scale_rewards": "batch", "std_threshold": 0.0},
            {"anchor_key": "state", "step_reward_weight": 0.5},
            {"reward_weights": {("next", "reward"): 1.0, ("next", "format"): 0.5}},
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
        want = _streaming(trajectory_return="sum")
        got = _streaming(trajectory_return="sum")
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
