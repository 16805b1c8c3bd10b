"""Tests of torchrl_grpo/mcadvantage/insert.py: whole insertions - order and chunking do not
matter, every trajectory is accounted for, a rejected insertion changes nothing."""

import random
import warnings

import pytest
import torch
from helpers import (
    bad_inputs,
    collector_stream,
    random_chunks,
    random_stream,
    released,
    stream_outputs,
    trajectory,
)

from torchrl_grpo import MCAdvantage
from torchrl_grpo.mcadvantage import GroupRelative, Limits
from torchrl_grpo.mcadvantage.insert import commit, insert
from torchrl_grpo.mcadvantage.options import make_options
from torchrl_grpo.mcadvantage.replica import fresh_state


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
        kw = dict(grpo_size=size, prompt_key=key, trajectory_return=mode)
        kw.update(estimator=GroupRelative(scale_rewards=scale))
        one_by_one = stream_outputs(MCAdvantage(**kw), trajs)
        shuffled = trajs[:]
        random.Random(seed + 1).shuffle(shuffled)
        chunked = stream_outputs(MCAdvantage(**kw), random_chunks(shuffled, seed))
        assert one_by_one.keys() == chunked.keys()
        assert len(one_by_one) == sum(t.numel() for t in trajs)
        if scale == "group":
            for uid, adv in one_by_one.items():
                torch.testing.assert_close(chunked[uid], adv, atol=1e-6, rtol=1e-6)
            return
        per_group = stream_outputs(MCAdvantage(**{**kw, "estimator": GroupRelative()}), trajs)
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
            limits=Limits(max_groups=limit),
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


class TestRewardsOnArrival:
    """With trajectory ids, the steps of an unfinished trajectory are held; their rewards are
    checked when they arrive, so that a NaN is refused by the insertion that brings it."""

    def stream(self):
        batches, _ = collector_stream(4, 4, 2, seed=3, max_len=6, steps_per_batch=3)
        return batches

    def test_a_nan_on_an_unfinished_step_is_refused_as_it_arrives(self):
        batches = self.stream()
        options = make_options(2, "seed", traj_key=("collector", "traj_ids"))
        state = insert(options, fresh_state(), batches[0]).state
        bad = batches[1].clone()
        rows, width = bad.batch_size
        last = bad["next", "done"].reshape(rows, width)[:, -1]  # (rows,) each row's last step
        row = int((~last).nonzero()[0])  # its trajectory goes on past this batch: held
        at = row * width + width - 1
        bad["next", "reward"].view(-1)[at] = float("nan")
        with pytest.raises(ValueError, match=rf"non-finite reward value\(s\) .* step {at} "):
            insert(options, state, bad)
        clean = insert(options, state, batches[1])  # the state is as it was: the good one goes
        assert clean.state.insertions == 2

    def test_the_rewards_of_every_input_layout_are_checked(self):
        options = make_options(2, "seed", traj_key=("collector", "traj_ids"))
        flat = self.stream()[0].reshape(-1).clone()
        flat["next", "reward"][-1] = float("inf")
        with pytest.raises(ValueError, match="non-finite reward"):
            insert(options, fresh_state(), flat)


class TestInsert:
    def test_a_function_of_the_state(self):
        """``insert`` builds the next state and changes none it was given; ``commit`` marks the
        ended trajectory ids."""
        options = make_options(2, "seed", trajectory_return="sum")
        state = fresh_state()
        first = insert(options, state, trajectory(0, [1.0]))
        assert first.out is None and state.pending.num_pending == 0
        assert first.state.pending.num_pending == 1 and first.state.insertions == 1
        second = insert(options, first.state, trajectory(0, [3.0]))
        assert second.out["advantage"].flatten().tolist() == pytest.approx(
            [-0.7071, 0.7071], abs=1e-4
        )
        assert first.state.pending.num_pending == 1  # unchanged
        assert second.state.insertions == 2 and second.state.stats["written_groups"] == 1

    def test_the_clock_counts_insertions_that_release_nothing(self):
        options = make_options(2, "seed")
        state = fresh_state()
        for step in range(3):
            state = insert(options, state, trajectory(step, [1.0])).state
        empty = trajectory(0, [1.0])[:0]
        assert insert(options, state, empty).state.insertions == 4

    def test_commit_marks_the_ended_ids(self):
        options = make_options(2, "seed")
        batch = collector_stream(1, 1, 2, seed=0, max_len=2, steps_per_batch=2)[0][0]
        outcome = insert(options, fresh_state(), batch)
        ((ids, status),) = outcome.marks
        state = commit(outcome.state, outcome.marks)
        assert (state.tails.registry.status(ids) == status).all()
