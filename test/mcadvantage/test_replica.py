"""Tests of torchrl_grpo/mcadvantage/replica.py: where the state lives, under one lock."""

import pytest
from helpers import (
    trajectory,
)

from torchrl_grpo import MCAdvantage
from torchrl_grpo.mcadvantage.options import make_options
from torchrl_grpo.mcadvantage.replica import OPERATIONS, Replica


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


class TestReplica:
    def test_insert_commits_attempt_does_not(self):
        replica = Replica(make_options(2, "seed"))
        assert replica.insert(trajectory(0, [1.0])) is None
        outcome = replica.attempt(trajectory(0, [2.0]))
        assert outcome.out is not None and replica.stats()["queued_trajectories"] == 1
        replica.commit(outcome)
        assert (
            replica.stats()["queued_trajectories"] == 0 and replica.counter("written_groups") == 1
        )

    def test_counters_and_the_pending_groups(self):
        replica = Replica(make_options(3, "seed"))
        for seed in (4, 5, 4):
            replica.insert(trajectory(seed, [1.0]))
        assert replica.group_ids() == [4, 5, 4]
        assert [len(t) for t in replica.trajectories(4)] == [1, 1]
        replica.set_counter("written_groups", 7)
        assert replica.counter("written_groups") == 7
        assert replica.pop_group(6, "none") == "none" and len(replica.pop_group(5)) == 1
        with pytest.raises(KeyError, match="5"):
            replica.drop_group(5)
        replica.reset_stats()
        assert replica.counter("written_groups") == 0 and replica.group_ids() == [4, 4]
        replica.clear()
        assert replica.group_ids() == [] and replica.state.insertions == 0

    def test_checkpoints_and_settings(self):
        replica = Replica(make_options(2, "seed"))
        replica.insert(trajectory(0, [1.0]))
        other = Replica(make_options(2, "seed"))
        other.load_plain(replica.to_plain())
        assert other.group_ids() == [0]
        with pytest.raises(RuntimeError, match="grpo_size=2, this transform has grpo_size=3"):
            Replica(make_options(3, "seed")).load_plain(replica.to_plain())
        other.set_options(make_options(2, "seed", max_pending_groups=1))
        assert other.options.limits.max_groups == 1
        assert OPERATIONS <= set(dir(Replica))  # what the owner may be asked, a replica does
