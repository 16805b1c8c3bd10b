"""Policy versions and staleness: the lags reported, the stale trajectories dropped, by hand and
against a slow reference; with checkpoints, streaming and shared mode."""

import random

import pytest
import torch
from helpers.trajectories import released, trajectory
from tensordict import lazy_stack

from torchrl_grpo import MCAdvantage
from torchrl_grpo.mcadvantage import GroupRelative, RewardToGo, Staleness
from torchrl_grpo.mcadvantage.records import NO_VERSION, VERSION


def versioned(group, rewards, version):
    """A trajectory whose steps carry ``policy_version`` (as torchrl's PolicyVersion writes)."""
    return trajectory(group, rewards, policy_version=torch.full((len(rewards),), version))


def insert(transform, *trajectories):
    return transform._inv_call(torch.cat(trajectories))


class TestLags:
    def test_hand_values(self):
        t = MCAdvantage(grpo_size=2, prompt_key="seed", trajectory_return="sum")
        insert(t, versioned(1, [1.0], 3))
        assert "policy_lag_max" not in t.get_stats()  # nothing completed yet
        out = insert(t, versioned(1, [0.0, 2.0], 5), versioned(2, [1.0], 5))
        assert out is not None and len(out) == 3
        stats = t.get_stats()  # the newest version read is 5: lags 2 and 0
        assert (stats["policy_lag_min"], stats["policy_lag_max"]) == (0.0, 2.0)
        assert stats["policy_lag_mean"] == 1.0 and stats["policy_version_spread"] == 2.0
        assert stats["stale_trajectories"] == 0  # no bound: nothing dropped

    def test_consumer_version_is_the_reference(self):
        t = MCAdvantage(grpo_size=2, prompt_key="seed", staleness=Staleness(consumer_version=10))
        insert(t, versioned(1, [1.0], 7), versioned(1, [2.0], 8))
        assert (t.get_stats()["policy_lag_min"], t.get_stats()["policy_lag_max"]) == (2.0, 3.0)

    def test_without_versions_nothing_changes(self):
        t = MCAdvantage(grpo_size=2, prompt_key="seed")
        out = insert(t, trajectory(1, [1.0]), trajectory(1, [2.0]))
        assert len(out) == 2 and "policy_lag_max" not in t.get_stats()
        assert (t._replica.state.pending.spans[:, VERSION] == NO_VERSION).all()


class TestMaxPolicyLag:
    def test_pending_and_incoming_stale_ones_go(self):
        t = MCAdvantage(grpo_size=2, prompt_key="seed", staleness=Staleness(max_lag=1))
        assert insert(t, versioned(1, [1.0], 0)) is None  # pending, version 0
        # version 2 arrives: the pending one lags 2 > 1 and goes; the new one waits
        assert insert(t, versioned(1, [2.0], 2)) is None
        assert t.stale_trajectories == 1 and t.queued_trajectories == 1
        # a late version-0 trajectory is stale on arrival; a version-1 one is recent enough
        out = insert(t, versioned(1, [5.0], 0), versioned(1, [3.0], 1))
        assert t.stale_trajectories == 2
        assert sorted(out["next", "reward"].flatten().tolist()) == [2.0, 3.0]

    def test_consumer_version_drops_what_the_trainer_outran(self):
        t = MCAdvantage(grpo_size=2, prompt_key="seed", staleness=Staleness(max_lag=2))
        insert(t, versioned(1, [1.0], 5))
        t.consumer_version = 8  # the trainer moved on: the pending version 5 lags 3
        assert insert(t, versioned(1, [2.0], 7)) is None
        assert t.stale_trajectories == 1 and t.queued_trajectories == 1

    def test_lag_zero_keeps_only_the_newest(self):
        t = MCAdvantage(grpo_size=2, prompt_key="seed", staleness=Staleness(max_lag=0))
        out = insert(t, versioned(1, [1.0], 4), versioned(1, [2.0], 3), versioned(1, [3.0], 4))
        assert t.stale_trajectories == 1
        assert sorted(out["next", "reward"].flatten().tolist()) == [1.0, 3.0]

    def test_errors(self):
        t = MCAdvantage(grpo_size=2, prompt_key="seed", staleness=Staleness(max_lag=1))
        with pytest.raises(KeyError, match="policy_version"):
            insert(t, trajectory(1, [1.0]))
        strings = trajectory(1, [1.0], policy_version=["a"])
        with pytest.raises(TypeError, match="integer policy versions"):
            insert(t, strings)
        assert t.get_stats()["completed_trajectories"] == 0  # the rejected calls changed nothing
        with pytest.raises(ValueError, match="^Staleness' max_lag must be at least 0"):
            MCAdvantage(grpo_size=2, staleness=Staleness(max_lag=-1))
        with pytest.raises(ValueError, match="needs policy_version_key"):
            MCAdvantage(grpo_size=2, staleness=Staleness(max_lag=1), policy_version_key=None)
        with pytest.raises(TypeError, match="integer"):
            MCAdvantage(grpo_size=2, staleness=Staleness(max_lag=1.5))


def reference_stream(insertions, grpo_size, max_lag):
    """The rule, slowly: per insertion, the newest version is updated, every pending and incoming
    trajectory lagging by more than ``max_lag`` goes, then trajectories queue by group and each
    group releases its first ``grpo_size`` in arrival order (as many rounds as it holds)."""
    queues, newest, stale, out = {}, None, 0, []
    for trajectories in insertions:
        newest = max([newest or 0] + [v for _, v, _ in trajectories]) if trajectories else newest
        for group in queues:
            kept = [(uid, v) for uid, v in queues[group] if newest - v <= max_lag]
            stale += len(queues[group]) - len(kept)
            queues[group] = kept
        released_now = []
        for group, version, uid in trajectories:
            if newest - version > max_lag:
                stale += 1
                continue
            queues.setdefault(group, []).append((uid, version))
        for queue in queues.values():
            while len(queue) >= grpo_size:
                released_now += [uid for uid, _ in queue[:grpo_size]]
                del queue[:grpo_size]
        out.append(sorted(released_now))
    return out, stale


@pytest.mark.parametrize("seed", range(4))
def test_matches_a_slow_reference(seed):
    rng = random.Random(seed)
    t = MCAdvantage(
        grpo_size=3, prompt_key="seed", trajectory_return="sum", staleness=Staleness(max_lag=2)
    )
    version, insertions, got = 0, [], []
    for _ in range(25):
        version += rng.random() < 0.4
        trajectories = []
        for _ in range(rng.randint(1, 4)):
            v = max(0, version - rng.choice([0, 0, 1, 2, 3, 4]))
            td = versioned(rng.randrange(3), [rng.random()], v)
            trajectories.append((int(td["seed"][0]), v, int(td["uid"][0]), td))
        insertions.append([(g, v, uid) for g, v, uid, _ in trajectories])
        out = insert(t, *[td for *_, td in trajectories])
        got.append(sorted(released(out)))
    want, stale = reference_stream(insertions, 3, 2)
    assert got == want
    assert t.stale_trajectories == stale > 0
    total = sum(len(trajectories) for trajectories in insertions)  # one step each
    assert total == sum(map(len, got)) + t.queued_trajectories + t.stale_trajectories


class TestKeptEverywhere:
    def test_checkpoint_keeps_versions_and_the_newest(self):
        t = MCAdvantage(grpo_size=2, prompt_key="seed", staleness=Staleness(max_lag=1))
        insert(t, versioned(1, [1.0], 3), versioned(2, [1.0], 4))
        back = MCAdvantage(grpo_size=2, prompt_key="seed", staleness=Staleness(max_lag=1))
        back.load_state_dict(t.state_dict())
        assert back._replica.state.newest_version == 4
        assert back._replica.state.pending.spans[:, VERSION].tolist() == [3, 4]
        insert(back, versioned(2, [1.0], 5))  # newest 5: the version-3 one lags 2
        assert back.stale_trajectories == 1

    def test_streaming_reads_the_first_step(self):
        """A trajectory cut across insertions (traj_key) has the version of its first step."""
        t = MCAdvantage(grpo_size=2, prompt_key="seed", staleness=Staleness(max_lag=1))
        first = versioned(1, [0.0, 0.0, 1.0], 1)
        first["policy_version"][2] = 3  # updated mid-trajectory: its first step counts
        first["collector", "traj_ids"] = torch.full((3,), 100)
        first["next", "done"][:] = torch.tensor([[False], [False], [True]])
        assert insert(t, first[:2]) is None and t.held_trajectories == 1
        other = versioned(1, [2.0], 3)
        other["collector", "traj_ids"] = torch.full((1,), 101)
        assert insert(t, torch.cat([first[2:], other])) is None  # 3 - 1 > 1: stale
        assert t.stale_trajectories == 1 and t.queued_trajectories == 1

    def test_ragged_steps(self):
        t = MCAdvantage(grpo_size=2, prompt_key="seed", staleness=Staleness(max_lag=0))
        steps = [versioned(1, [1.0], v)[0] for v in (2, 1, 2)]
        steps[0]["tokens"], steps[1]["tokens"], steps[2]["tokens"] = (
            torch.zeros(3),
            torch.zeros(5),
            torch.zeros(2),
        )
        out = t._inv_call(lazy_stack(steps))
        assert t.stale_trajectories == 1 and len(out) == 2

    def test_every_estimator_still_works(self):
        for kwargs in (
            dict(trajectory_return=None),
            dict(trajectory_return="sum", estimator=GroupRelative(baseline="leave_one_out")),
            dict(trajectory_return="sum", keep_return_bounds=(-1.0, 10.0)),
            dict(estimator=RewardToGo(0.9)),
        ):
            t = MCAdvantage(
                grpo_size=2, prompt_key="seed", staleness=Staleness(max_lag=1), **kwargs
            )
            out = insert(
                t, versioned(1, [1.0, 2.0], 0), versioned(1, [0.5], 2), versioned(1, [3.0], 2)
            )
            assert t.stale_trajectories == 1 and len(out) == 2, kwargs
            assert torch.isfinite(out["advantage"]).all()


def test_shared_mode_sees_the_consumer_version():
    t = MCAdvantage(grpo_size=2, prompt_key="seed", staleness=Staleness(max_lag=1)).share_memory_()
    try:
        insert(t, versioned(1, [1.0], 5))
        t.consumer_version = 7
        assert insert(t, versioned(1, [2.0], 7)) is None
        assert t.stale_trajectories == 1
    finally:
        del t
