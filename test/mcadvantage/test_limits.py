"""Tests of torchrl_grpo/mcadvantage/limits.py: the memory limits on what is held back."""

import warnings

import pytest
import torch
from helpers import (
    random_stream,
    trajectory,
)
from helpers.states import store
from torchrl.data import LazyTensorStorage, ReplayBuffer

from torchrl_grpo import MCAdvantage
from torchrl_grpo.mcadvantage.limits import evict_groups
from torchrl_grpo.mcadvantage.options import Limits
from torchrl_grpo.mcadvantage.records import Pending


class TestMemoryLimits:
    def test_drop_oldest_groups_past_max_pending_groups(self):
        t = MCAdvantage(3, prompt_key="seed", limits=Limits(max_groups=2))
        t.inv(trajectory(0, [1.0]))
        t.inv(trajectory(1, [1.0]))
        with pytest.warns(RuntimeWarning, match="max_groups=2,"):
            t.inv(torch.cat([trajectory(2, [1.0]), trajectory(1, [2.0])]))
        assert sorted(t.queues) == [1, 2]  # group 0 started first and was evicted
        stats = t.get_stats()
        assert stats["evicted_groups"] == 1 and stats["evicted_trajectories"] == 1
        out = t.inv(trajectory(1, [3.0]))  # group 1 still completes normally
        assert out["seed"].tolist() == [1, 1, 1]

    def test_max_pending_age_in_insertions(self):
        t = MCAdvantage(2, prompt_key="seed", limits=Limits(max_age=2))
        t.inv(trajectory(0, [1.0]))  # insertion 0
        t.inv(trajectory(1, [1.0]))  # insertion 1
        with pytest.warns(RuntimeWarning):
            t.inv(trajectory(2, [1.0]))  # insertion 2: group 0 is 2 insertions old
        assert sorted(t.queues) == [1, 2]
        assert t.get_stats()["evicted_groups"] == 1

    def test_raise_rejects_the_insertion_and_changes_nothing(self):
        t = MCAdvantage(3, prompt_key="seed", limits=Limits(max_groups=1, on_overflow="raise"))
        t.inv(trajectory(0, [1.0]))
        before = t.get_stats()
        with pytest.raises(RuntimeError, match="rejected"):
            t.inv(trajectory(1, [1.0]))
        assert t.get_stats() == before and list(t.queues) == [0]

    @pytest.mark.filterwarnings("ignore:MCAdvantage. 20 insertions and no group:RuntimeWarning")
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
        for limits, message in [
            (Limits(max_groups=0), "^Limits' max_groups must be at least 1"),
            (Limits(max_age=0), "^Limits' max_age must be at least 1"),
            (Limits(on_overflow="drop"), "^Limits' on_overflow must be"),
        ]:
            with pytest.raises(ValueError, match=message):
                MCAdvantage(2, limits=limits)

    def test_invalid_flat_limit_names_both(self):
        message = r"^Limits' max_groups \(given as max_pending_groups=\) must be at least 1"
        with pytest.raises(ValueError, match=message):
            MCAdvantage(2, max_pending_groups=0)


class TestEvictGroups:
    def test_oldest_groups_go_first(self):
        state = store([5, 6, 5, 7], arrival=[0, 1, 2, 3])
        limits = Limits(max_groups=2, max_age=None, on_overflow="drop_oldest")
        pending, groups, trajectories = evict_groups(limits, state, 4)
        assert (groups, trajectories) == (1, 2)
        assert pending.ids.values.flatten().tolist() == [6, 7]

    def test_age_in_insertions(self):
        # 4 insertions so far (0 to 3): group 5 waited 3, group 6 waited 1, group 7 none
        state = store([5, 6, 7], arrival=[0, 2, 3])
        limits = Limits(max_groups=None, max_age=2, on_overflow="drop_oldest")
        pending, groups, _ = evict_groups(limits, state, 4)
        assert pending.ids.values.flatten().tolist() == [6, 7] and groups == 1

    def test_raise_names_the_limits(self):
        state = store([5, 6], arrival=[0, 1])
        with pytest.raises(RuntimeError, match=r"Limits\(max_groups=1, max_age=None\)"):
            evict_groups(Limits(max_groups=1, max_age=None, on_overflow="raise"), state, 2)

    def test_within_limits_or_empty(self):
        state = store([5, 6], arrival=[0, 1])
        limits = Limits(max_groups=2, max_age=5, on_overflow="raise")
        assert evict_groups(limits, state, 2)[0] is state
        assert evict_groups(limits, Pending(), 2)[1] == 0


class TestWarning:
    def test_points_at_the_caller(self):
        """The eviction warning names the line that inserted, not a line of this package."""
        t = MCAdvantage(3, prompt_key="seed", limits=Limits(max_groups=1))
        t.inv(trajectory(0, [1.0]))
        with pytest.warns(RuntimeWarning, match="max_groups=1,") as caught:
            t.inv(trajectory(1, [1.0]))
        assert caught[0].filename == __file__

    def test_through_a_replay_buffer(self):
        rb = ReplayBuffer(storage=LazyTensorStorage(10))
        rb.append_transform(MCAdvantage(3, prompt_key="seed", limits=Limits(max_groups=1)))
        rb.extend(trajectory(0, [1.0]))
        with pytest.warns(RuntimeWarning, match="oldest were dropped"):
            rb.extend(trajectory(1, [1.0]))
        assert rb.transform[0].evicted_groups == 1


class TestStuck:
    def test_no_group_completes_in_20_insertions(self):
        t = MCAdvantage(8, prompt_key="seed")
        with pytest.warns(RuntimeWarning, match="20 insertions and no group has completed") as seen:
            for seed in range(0, 40, 2):  # every id gets one trajectory of the 8 a group needs
                t.inv(torch.cat([trajectory(seed, [1.0]), trajectory(seed + 1, [1.0])]))
        message = str(seen[0].message)
        assert "40 groups hold 40 trajectories, at most 1 in one" in message
        assert "grpo_size=8" in message and seen[0].filename == __file__

    def test_said_once_and_not_when_groups_complete(self):
        t = MCAdvantage(2, prompt_key="seed")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for seed in range(40):
                t.inv(trajectory(seed // 2, [1.0]))  # a group every second insertion
        stuck = MCAdvantage(4, prompt_key="seed")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for seed in range(40):
                stuck.inv(trajectory(seed, [1.0]))
        assert len([w for w in seen if "no group has completed" in str(w.message)]) == 1


class TestMinGroupSize:
    """``min_group_size``: a group still short ``max_pending_age`` insertions after it started
    is released with what it holds (runs that failed or timed out never come), GRPO over its
    members; shorter than ``min_group_size``, it is given up as before."""

    def test_a_short_group_is_released_past_the_age(self):
        t = MCAdvantage(
            4,
            prompt_key="seed",
            trajectory_return="sum",
            limits=Limits(max_age=2, min_group_size=2),
        )
        assert t.inv(torch.cat([trajectory(7, [1.0]), trajectory(7, [3.0, 2.0])])) is None
        assert t.inv(trajectory(8, [1.0])) is None  # age 1: still waiting
        out = t.inv(trajectory(9, [0.0]))  # age 2: group 7 goes, short, its own two returns
        assert out["seed"].tolist() == [7, 7, 7]
        # returns 1 and 5: +-1/sqrt(2) each, on every step of its trajectory
        assert out["advantage"].reshape(-1).tolist() == pytest.approx(
            [-0.7071, 0.7071, 0.7071], abs=1e-4
        )
        stats = t.get_stats()
        assert stats["short_groups"] == 1 and stats["evicted_groups"] == 0
        assert stats["group_return_mean"] == pytest.approx(3.0)
        assert stats["group_return_std"] == pytest.approx(2.0**1.5, abs=1e-9)  # std of {1, 5}

    def test_shorter_than_the_minimum_is_given_up(self):
        t = MCAdvantage(
            4,
            prompt_key="seed",
            trajectory_return="sum",
            limits=Limits(max_age=1, min_group_size=2),
        )
        t.inv(trajectory(7, [1.0]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert t.inv(trajectory(8, [1.0])) is None
        assert t.get_stats()["evicted_groups"] == 1 and t.get_stats()["short_groups"] == 0

    def test_a_group_of_one_gets_zero(self):
        t = MCAdvantage(
            3,
            prompt_key="seed",
            trajectory_return="sum",
            limits=Limits(max_age=1, min_group_size=1),
        )
        t.inv(trajectory(7, [4.0]))
        out = t.inv(trajectory(8, [1.0]))
        assert out["seed"].tolist() == [7] and out["advantage"].reshape(-1).tolist() == [0.0]

    @pytest.mark.parametrize(
        ("kw", "words"),
        [
            ({"limits": Limits(min_group_size=0, max_age=2)}, "between 1 and grpo_size=4, got 0"),
            ({"limits": Limits(min_group_size=5, max_age=2)}, "between 1 and grpo_size=4, got 5"),
            ({"limits": Limits(min_group_size=2)}, "set Limits' max_age too"),
            (
                {
                    "limits": Limits(min_group_size=2, max_age=2),
                    "candidate_group_size": 6,
                    "trajectory_return": "sum",
                },
                "cannot be combined with candidate_group_size",
            ),
        ],
    )
    def test_validation(self, kw, words):
        with pytest.raises(ValueError, match=words):
            MCAdvantage(4, **kw)


class TestOverRepeatedGroups:
    def test_more_trajectories_of_an_id_than_grpo_size_in_one_insertion_warn(self):
        t = MCAdvantage(2, prompt_key="seed")
        four = torch.cat([trajectory(0, [float(r)]) for r in range(4)])
        with pytest.warns(RuntimeWarning, match=r"4 trajectories of one group id.*grpo_size=4"):
            out = t.inv(torch.cat([four, trajectory(1, [1.0]), trajectory(1, [2.0])]))
        assert out.numel() == 6  # two groups of seed 0 and one of seed 1, as before

    def test_exactly_grpo_size_or_candidate_selection_say_nothing(self):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            t = MCAdvantage(2, prompt_key="seed")
            t.inv(torch.cat([trajectory(0, [1.0]), trajectory(0, [2.0])]))
            s = MCAdvantage(2, prompt_key="seed", candidate_group_size=4, trajectory_return="sum")
            s.inv(torch.cat([trajectory(0, [float(r)]) for r in range(4)]))

    def test_string_prompts(self):
        t = MCAdvantage(2)
        prompts = torch.cat([trajectory("a", [float(r)], key="query") for r in range(3)])
        with pytest.warns(RuntimeWarning, match=r"3 trajectories of one group id"):
            t.inv(prompts)
