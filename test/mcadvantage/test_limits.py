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
        for kw, message in [
            (dict(max_pending_groups=0), "max_pending_groups must be at least 1"),
            (dict(max_pending_age=0), "max_pending_age must be at least 1"),
            (dict(on_overflow="drop"), "on_overflow must be"),
        ]:
            with pytest.raises(ValueError, match=message):
                MCAdvantage(2, **kw)


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
        with pytest.raises(RuntimeError, match="max_pending_groups=1 / max_pending_age=None"):
            evict_groups(Limits(max_groups=1, max_age=None, on_overflow="raise"), state, 2)

    def test_within_limits_or_empty(self):
        state = store([5, 6], arrival=[0, 1])
        limits = Limits(max_groups=2, max_age=5, on_overflow="raise")
        assert evict_groups(limits, state, 2)[0] is state
        assert evict_groups(limits, Pending(), 2)[1] == 0


class TestWarning:
    def test_points_at_the_caller(self):
        """The eviction warning names the line that inserted, not a line of this package."""
        t = MCAdvantage(3, prompt_key="seed", max_pending_groups=1)
        t.inv(trajectory(0, [1.0]))
        with pytest.warns(RuntimeWarning, match="max_pending_groups=1") as caught:
            t.inv(trajectory(1, [1.0]))
        assert caught[0].filename == __file__

    def test_through_a_replay_buffer(self):
        rb = ReplayBuffer(storage=LazyTensorStorage(10))
        rb.append_transform(MCAdvantage(3, prompt_key="seed", max_pending_groups=1))
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
