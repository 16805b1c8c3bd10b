"""Tests of torchrl_grpo/mcadvantage/tails.py: trajectories that cross insertions."""

import warnings

import pytest
import torch
from helpers import (
    collector_stream,
    released,
    same_output,
    streaming,
)
from helpers.restart import buffer_and_collector, collect, first_run
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, lazy_stack

from torchrl_grpo import MCAdvantage
from torchrl_grpo.mcadvantage import (
    GroupRelative,
    Limits,
    RewardToGo,
    StepGroups,
    TrajectoryIds,
)
from torchrl_grpo.mcadvantage.options import TrajectoryKeys
from torchrl_grpo.mcadvantage.records import LAST_COUNT, STARTED_AT, TAIL_ID, Tails
from torchrl_grpo.mcadvantage.registry import ENDED, GIVEN_UP, IdRegistry
from torchrl_grpo.mcadvantage.tails import drop, held_steps, join, streamed, tail_index

KEYS = TrajectoryKeys(traj=("collector", "traj_ids"), done=("next", "done"), count="step_count")


def steps(ids, done, counts=None, values=None):
    """Flat steps of the given trajectory ids, done flags and step counts; ``value`` tells
    the steps apart."""
    n = len(ids)
    td = TensorDict(
        collector=TensorDict(traj_ids=torch.tensor(ids), batch_size=[n]),
        next=TensorDict(done=torch.tensor(done).unsqueeze(-1), batch_size=[n]),
        value=torch.tensor(values if values is not None else list(range(n))),
        batch_size=[n],
    )
    if counts is not None:
        td["step_count"] = torch.tensor(counts).unsqueeze(-1)
    return td


def turns(flat):
    """Flat steps as a lazy stack whose steps carry token sequences of different lengths
    (``uid % 3 + 1`` tokens): ragged steps, as an agent's turns."""
    return lazy_stack(
        [step.set("tokens", torch.arange(int(step["uid"]) % 3 + 1)) for step in flat.unbind(0)]
    )


class TestJoin:
    def test_pieces_wait_for_their_end(self):
        first = join(Tails(), steps([0, 1, 0], [False, False, False], [0, 0, 1]), KEYS, 0)
        assert first.complete is None and first.ended.tolist() == []
        tails = first.tails
        assert tails.num_tails == 2 and tails.meta[:, TAIL_ID].tolist() == [0, 1]
        assert tails.meta[:, STARTED_AT].tolist() == [0, 0]
        assert tails.meta[:, LAST_COUNT].tolist() == [1, 0]
        second = join(tails, steps([1, 0], [True, True], [1, 2], [10, 11]), KEYS, 1)
        assert second.ended.tolist() == [1, 0]  # in the order of their last step
        assert second.complete["value"].tolist() == [1, 10, 0, 2, 11]
        assert second.tails.num_tails == 0 and second.tails.chunks.steps == ()

    def test_rows_are_flattened_row_by_row(self):
        rows = torch.stack(
            [
                steps([0, 0], [False, True], [0, 1], [0, 1]),
                steps([1, 2], [True, False], [0, 0], [2, 3]),
            ]
        )
        joined = join(Tails(), rows, KEYS, 0)
        assert joined.complete["value"].tolist() == [0, 1, 2] and joined.ended.tolist() == [0, 1]
        assert joined.tails.meta[:, TAIL_ID].tolist() == [2]

    def test_a_done_step_inside_an_id(self):
        with pytest.raises(ValueError, match="trajectory id 1 .* done step before its last"):
            join(Tails(), steps([1, 1], [True, False], [0, 1]), KEYS, 0)

    def test_an_ended_id_must_not_come_back(self):
        registry = IdRegistry()
        registry.mark(torch.tensor([3]), ENDED)
        with pytest.raises(ValueError, match="trajectory id 3 .* must not be reused"):
            join(Tails(registry=registry), steps([3], [True], [4]), KEYS, 0)  # not a new start

    def test_given_up_ids_are_left_out_and_counted(self):
        registry = IdRegistry()
        registry.mark(torch.tensor([2]), GIVEN_UP)
        joined = join(
            Tails(registry=registry), steps([2, 2, 4], [False, True, True], [5, 6, 0]), KEYS, 0
        )
        assert joined.dropped_steps == 2 and joined.ended.tolist() == [4]

    def test_negative_ids_are_not_data(self):
        joined = join(Tails(), steps([-1, 5, -1], [False, True, False], [0, 0, 0]), KEYS, 0)
        assert joined.complete["value"].tolist() == [1]


class TestHeld:
    def held(self):
        return join(Tails(), steps([0, 1, 0, 2], [False] * 4, [0, 0, 1, 0]), KEYS, 3).tails

    def test_tail_index(self):
        tails = self.held()
        held, slot = tail_index(tails, torch.tensor([2, 7, 0]))
        assert held.tolist() == [True, False, True] and tails.meta[
            slot[held], TAIL_ID
        ].tolist() == [2, 0]
        assert tail_index(Tails(), torch.tensor([1]))[0].tolist() == [False]

    def test_held_steps_tail_after_tail(self):
        data, lengths = held_steps(self.held())
        assert data["value"].tolist() == [0, 2, 1, 3] and lengths.tolist() == [2, 1, 1]
        data, lengths = held_steps(Tails())
        assert data is None and lengths.tolist() == []

    def test_drop(self):
        tails, gone = drop(self.held(), torch.tensor([True, False, True]))
        assert gone.tolist() == [1] and tails.meta[:, TAIL_ID].tolist() == [0, 2]
        assert held_steps(tails)[0]["value"].tolist() == [0, 2, 3]


class TestStreamed:
    def test_read_by_id_only_with_ids(self):
        td = steps([0], [True], [0])
        assert streamed(Tails(), td, KEYS) is td
        assert streamed(Tails(), td.exclude(("collector", "traj_ids")), KEYS) is None
        assert streamed(Tails(), td, KEYS._replace(traj=None)) is None

    def test_ragged_steps_are_read_by_id(self):
        """Ragged steps (an agent's turns: token sequences of different lengths) are read by
        id as a lazy stack, held tails or not; ``[B, T]`` ragged rows are flattened row by
        row."""
        a = TensorDict(collector=TensorDict(traj_ids=torch.tensor(0)), tokens=torch.arange(2))
        b = TensorDict(collector=TensorDict(traj_ids=torch.tensor(1)), tokens=torch.arange(3))
        ragged = lazy_stack([a, b])
        assert streamed(Tails(), ragged, KEYS) is ragged
        held = join(Tails(), steps([5], [False], [0]), KEYS, 0).tails
        assert streamed(held, ragged, KEYS) is ragged
        rows = lazy_stack([lazy_stack([a, b]), lazy_stack([b, a])])
        flat = streamed(Tails(), rows, KEYS)
        assert [len(t) for t in flat.get("tokens", as_list=True)] == [2, 3, 3, 2]


class TestStreaming:
    @pytest.mark.parametrize("layout", ["rows", "flat"])
    @pytest.mark.parametrize("trajectory_return", [None, "sum", "last"])
    def test_equals_inserting_whole_trajectories(self, layout, trajectory_return):
        """Each insertion releases exactly what inserting, whole, the trajectories that end in
        it would release; at the end every step was stored once and nothing is held."""
        batches, completed = collector_stream(4, 6, 3, seed=0)
        ours = streaming(trajectory_return=trajectory_return)
        ref = streaming(trajectory_return=trajectory_return, traj_key=None)
        stored = []
        for batch, whole in zip(batches, completed):
            got = ours.inv(batch if layout == "rows" else batch.reshape(-1))
            same_output(got, ref.inv(torch.cat(whole)) if whole else None)
            stored += [] if got is None else got["uid"].tolist()
        every_step = torch.cat([b.reshape(-1) for b in batches])["uid"].tolist()
        assert sorted(stored) == sorted(every_step)
        assert ours.held_trajectories == ours.queued_trajectories == 0
        assert ours.get_stats() | {"held_steps": 0, "held_trajectories": 0} == ref.get_stats() | {
            "held_steps": 0,
            "held_trajectories": 0,
        }

    @pytest.mark.parametrize("trajectory_return", [None, "last"])
    def test_ragged_turns_equal_whole_trajectories(self, trajectory_return):
        """Ragged steps crossing insertions (the turns of dialogs cut by a collector's
        batches): each insertion releases what inserting the whole trajectories releases, the
        tokens of every step intact."""
        batches, completed = collector_stream(4, 6, 3, seed=5, max_len=4, steps_per_batch=3)
        ours = streaming(trajectory_return=trajectory_return)
        ref = streaming(trajectory_return=trajectory_return, traj_key=None)
        stored = []
        for batch, whole in zip(batches, completed):
            got = ours.inv(turns(batch.reshape(-1)))
            want = None if not whole else ref.inv(turns(torch.cat(whole)))
            if want is None:
                assert got is None
                continue
            assert got["uid"].tolist() == want["uid"].tolist()
            torch.testing.assert_close(got["advantage"], want["advantage"])
            for step, tokens in zip(got["uid"].tolist(), got.get("tokens", as_list=True)):
                assert tokens.tolist() == list(range(step % 3 + 1))
            stored += got["uid"].tolist()
        every_step = torch.cat([b.reshape(-1) for b in batches])["uid"].tolist()
        assert sorted(stored) == sorted(every_step)
        assert ours.held_trajectories == ours.queued_trajectories == 0

    @pytest.mark.parametrize(
        "estimator",
        [
            {"estimator": GroupRelative(whiten=True), "trajectory_return": "sum"},
            {"estimator": GroupRelative(baseline="pass_at_k"), "trajectory_return": "sum"},
            {"estimator": StepGroups(step_weight=0.5, anchor_key="step_count")},
            {"estimator": GroupRelative(scale_rewards="batch")},
            {"estimator": RewardToGo(0.9)},
        ],
        ids=["whiten", "pass_at_k", "gigpo", "batch_std", "reward_to_go"],
    )
    def test_estimators_see_whole_trajectories(self, estimator):
        """The estimators beyond torchrl get, from the joined stream, exactly what whole
        trajectories give them (GiGPO's anchors included, read on every step of the join)."""
        batches, completed = collector_stream(4, 6, 3, seed=3, max_len=9, steps_per_batch=4)
        ours, ref = streaming(**estimator), streaming(**estimator, traj_key=None)
        for batch, whole in zip(batches, completed):
            same_output(ours.inv(batch), ref.inv(torch.cat(whole)) if whole else None)
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
        ours = streaming(trajectory_return="sum")
        ref = streaming(trajectory_return="sum", traj_key=None)
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
        t = streaming()
        t.inv(batches[0])
        stats = t.get_stats()
        assert stats["held_trajectories"] == t.held_trajectories == 3  # every env mid-episode?
        assert stats["held_steps"] > 0

    def test_checkpoint_with_held_tails(self, tmp_path):
        batches, completed = collector_stream(4, 6, 3, seed=2)
        t = streaming(trajectory_return="sum")
        for batch in batches[:3]:
            t.inv(batch)
        assert t.held_trajectories > 0
        torch.save(t.state_dict(), tmp_path / "t.pt")
        restored = streaming(trajectory_return="sum")
        restored.load_state_dict(torch.load(tmp_path / "t.pt", weights_only=True))
        assert restored.get_stats() == t.get_stats()
        for batch in batches[3:]:
            same_output(restored.inv(batch.clone()), t.inv(batch.clone()))
        assert restored.held_trajectories == 0
        # the ended ids travel too: a trajectory that ended cannot be continued
        assert (batches[-1]["step_count"][:, 0] > 0).any()  # rows that continue a trajectory
        with pytest.raises(ValueError, match="ended in an earlier insertion"):
            restored.inv(batches[-1])

    def test_missing_earlier_part_raises_and_changes_nothing(self):
        batches, _ = collector_stream(3, 4, 3, seed=3, max_len=9, steps_per_batch=4)
        t = streaming()
        with pytest.raises(ValueError, match="its earlier part is missing"):
            t.inv(batches[1])  # continuations whose first steps never arrived
        assert t.held_trajectories == 0 and t.get_stats()["completed_trajectories"] == 0
        t.inv(batches[0])  # the stream can still start from its beginning
        t.inv(batches[1])

    def test_reused_id_raises_and_changes_nothing(self):
        batches, _ = collector_stream(3, 4, 3, seed=4, max_len=3, steps_per_batch=6)
        t = streaming()
        t.inv(batches[0])
        t.inv(batches[1])
        before = t.get_stats()
        assert (batches[1]["step_count"][:, 0] > 0).any()  # rows that continue a trajectory
        with pytest.raises(ValueError, match=r"trajectory id \d+ .* ended in an earlier insertion"):
            t.inv(batches[1])  # again: their trajectories ended, they cannot be continued
        assert t.get_stats() == before
        again, _ = collector_stream(3, 4, 3, seed=6, max_len=3, steps_per_batch=6)
        t.inv(again[0])  # and new trajectories go through

    def test_done_inside_an_id_raises(self):
        batches, _ = collector_stream(1, 2, 3, seed=5, max_len=3, steps_per_batch=30)
        bad = batches[0].reshape(-1).clone()
        bad["collector", "traj_ids"] = torch.zeros_like(bad["collector", "traj_ids"])
        bad["step_count"] = torch.arange(bad.shape[0]).unsqueeze(-1)
        with pytest.raises(ValueError, match="has a done step before its last step"):
            streaming().inv(bad)

    def test_step_gap_raises(self):
        batches, _ = collector_stream(1, 2, 3, seed=6, max_len=6, steps_per_batch=30)
        flat = batches[0].reshape(-1)
        done = flat["next", "done"].squeeze(-1)
        middle = (~done[:-1] & ~done[1:]).nonzero()  # a step with a step of its trajectory after
        keep = torch.ones(flat.shape[0], dtype=torch.bool)
        keep[int(middle[0]) + 1] = False  # that step is lost
        with pytest.raises(ValueError, match="steps are missing"):
            streaming().inv(flat[keep])

    def test_without_step_count_continuations_are_trusted(self):
        batches, completed = collector_stream(3, 4, 3, seed=7)
        ours = streaming(traj_key=TrajectoryIds(step_count_key=None))
        ref = streaming(traj_key=None)
        for batch, whole in zip(batches, completed):
            same_output(
                ours.inv(batch.exclude("step_count")), ref.inv(torch.cat(whole)) if whole else None
            )

    def test_traj_key_none_keeps_torchrl_behaviour(self):
        batches, _ = collector_stream(2, 2, 3, seed=8, max_len=9, steps_per_batch=3)
        with pytest.raises(RuntimeError, match="expected complete trajectories"):
            streaming(traj_key=None).inv(batches[0])

    def test_age_limit_gives_up_held_trajectories(self):
        batches, _ = collector_stream(2, 2, 3, seed=9, max_len=20, steps_per_batch=2)
        t = streaming(limits=Limits(max_age=1))
        with pytest.warns(RuntimeWarning, match="unfinished trajectories"):
            for batch in batches:
                t.inv(batch)  # later steps of the given-up ids are left out, no error
        stats = t.get_stats()
        assert stats["evicted_trajectories"] > 0 and stats["evicted_steps"] > 0
        assert t.held_trajectories <= 2

    def test_age_limit_raise_changes_nothing(self):
        batches, _ = collector_stream(2, 2, 3, seed=9, max_len=20, steps_per_batch=2)
        t = streaming(limits=Limits(max_age=1, on_overflow="raise"))
        t.inv(batches[0])
        held = t.held_trajectories
        with pytest.raises(RuntimeError, match="max_age=1.*nothing changed"):
            for batch in batches[1:]:
                t.inv(batch)
        assert t.held_trajectories >= held

    def test_clear_queues_gives_up_held_trajectories(self):
        batches, _ = collector_stream(2, 2, 3, seed=10, max_len=20, steps_per_batch=3)
        t = streaming()
        t.inv(batches[0])
        assert t.held_trajectories > 0
        t.clear_queues()
        assert t.held_trajectories == 0
        t.inv(batches[1])  # their continuations are left out, not taken for new trajectories
        assert t.get_stats()["evicted_steps"] > 0

    def test_uncollected_frames_are_not_data(self):
        batches, completed = collector_stream(2, 2, 3, seed=11)
        ours, ref = streaming(), streaming(traj_key=None)
        for batch, whole in zip(batches, completed):
            padded = torch.cat([batch, batch[:, :1].clone()], 1)  # one extra frame per row...
            padded["collector", "traj_ids"][:, -1] = -1  # ...that the collector did not fill
            same_output(ours.inv(padded), ref.inv(torch.cat(whole)) if whole else None)

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
# each step's discounted reward-to-go as its sample (RewardToGo(gamma))
# --------------------------------------------------------------------------------------------


class TestRestarts:
    """A collector started again numbers its trajectories from 0 again."""

    def test_a_trajectory_that_starts_at_step_0_is_new(self):
        keys = KEYS._replace(group="value")  # the group id: the value of a tail's first step
        first = join(Tails(), steps([0, 1], [True, False], [0, 0], [0, 1]), keys, 0)
        first.tails.registry.mark(first.ended, ENDED)  # as a commit does
        again = steps([0, 1], [False, True], [0, 0], [5, 6])  # ids from 0 again
        with pytest.warns(RuntimeWarning, match=r"ids \[1\] .* start again at step 0") as caught:
            joined = join(first.tails, again, keys, 1)
        # the remedy and the group that lost its member are named, and counted
        (message,) = [str(w.message) for w in caught]
        assert "the groups [1] they belong to can no longer complete" in message
        assert "SameStartGroups.resume(transform)" in message and joined.stranded == 1
        assert joined.complete["value"].tolist() == [6]  # the new trajectory 1, not the held
        assert (joined.dropped_steps, joined.dropped_tails) == (1, 1)  # old 1's held step
        assert joined.tails.meta[:, TAIL_ID].tolist() == [0]  # the new trajectory 0, held
        assert joined.restarted.tolist() == [0]  # ended before: running again once committed

    def test_without_a_step_counter_an_ended_id_is_an_error(self):
        no_count = KEYS._replace(count=None)
        first = join(Tails(), steps([0], [True]), no_count, 0)
        first.tails.registry.mark(first.ended, ENDED)
        with pytest.raises(ValueError, match="forget_trajectory_ids"):
            join(first.tails, steps([0], [True]), no_count, 1)

    def test_forget_trajectory_ids(self):
        t = MCAdvantage(2, prompt_key="seed", traj_key=TrajectoryIds(step_count_key=None))
        one = steps([0, 1], [True, False])
        one["seed"] = torch.zeros(2, dtype=torch.long)
        one["next", "reward"] = torch.ones(2, 1)
        t.inv(one)
        with pytest.raises(ValueError, match="ended in an earlier insertion"):
            t.inv(one.clone())
        t.forget_trajectory_ids()
        assert t.held_trajectories == 0 and t.evicted_trajectories == 1
        assert t.inv(one.clone()) is not None  # trajectory 0 again: completes seed 0's group

    @pytest.mark.parametrize("counter", [True, False], ids=["step counter", "no counter"])
    def test_a_collector_restarted_in_a_new_process(self, counter, tmp_path, spawn):
        """The first run saves the transform and ends; a new collector goes on from its state."""
        path = str(tmp_path / "transform.pt")
        process = spawn(first_run, path, counter)
        process.join(120)
        assert process.exitcode == 0
        rb, collector = buffer_and_collector(counter, seed=1)
        transform = rb.transform[0]
        transform.load_state_dict(torch.load(path, weights_only=True))
        before = transform.get_stats()
        assert before["written_groups"] > 0 and before["completed_trajectories"] > 0
        if not counter:
            with pytest.raises(ValueError, match="forget_trajectory_ids"):
                collect(rb, collector, 1)
            transform.forget_trajectory_ids()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)  # a held tail given up, if any
            collect(rb, collector, 4)
        collector.shutdown()
        after = transform.get_stats()
        restarted = [str(w.message) for w in caught if "start again at step 0" in str(w.message)]
        # each restart's warning names the groups it strands, and the report counts them
        assert bool(restarted) == (after["stranded_groups"] > 0)
        assert all("SameStartGroups.resume" in m for m in restarted)
        assert after["completed_trajectories"] > before["completed_trajectories"]
        assert after["written_groups"] > before["written_groups"] and len(rb) > 0
