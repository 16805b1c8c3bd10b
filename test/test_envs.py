"""Tests of torchrl_grpo/envs.py: SameStartGroups under envs, batched envs and collectors."""

from __future__ import annotations

import copy
import functools
import warnings
from collections import Counter

import gymnasium as gym
import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import (
    GymEnv,
    GymWrapper,
    ParallelEnv,
    PendulumEnv,
    SerialEnv,
    TransformedEnv,
    check_env_specs,
)

from torchrl_grpo import MCAdvantage, SameStartGroups


def reset_observation(seed: int) -> torch.Tensor:
    """Where gymnasium's ``CartPole-v1`` starts after ``reset(seed=seed)``: the reference."""
    return torch.as_tensor(gym.make("CartPole-v1").reset(seed=seed)[0])


def vector_env(num_envs: int, mode=gym.vector.AutoresetMode.DISABLED):
    vector = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1")] * num_envs, autoreset_mode=mode
    )
    return GymWrapper(vector, categorical_action_encoding=True)


def episode_starts(steps: TensorDict, key="reset_seed") -> list[tuple[int, int, torch.Tensor]]:
    """``(trajectory id, seed, first observation)`` of every trajectory in collector output."""
    steps = steps.reshape(-1)
    ids = steps["collector", "traj_ids"]
    order = torch.argsort(ids, stable=True)  # steps of one trajectory stay in time order
    ids, seeds, obs = ids[order], steps[key][order], steps["observation"][order]
    first = torch.ones_like(ids, dtype=torch.bool)
    first[1:] = ids[1:] != ids[:-1]
    return list(zip(ids[first].tolist(), seeds[first].tolist(), obs[first]))


def check_every_step_carries_its_seed(steps: TensorDict, key="reset_seed") -> None:
    steps = steps.reshape(-1)
    ids = steps["collector", "traj_ids"]
    for traj in ids.unique():
        mine = ids == traj
        seeds = torch.cat([steps[key][mine], steps["next", key][mine]])
        assert (seeds == seeds[0]).all(), f"trajectory {int(traj)} mixes seeds {seeds.unique()}"


def collect(env, frames_per_batch: int, total_frames: int) -> TensorDict:
    collector = Collector(env, None, frames_per_batch=frames_per_batch, total_frames=total_frames)
    steps = torch.cat([batch.reshape(-1) for batch in collector])
    collector.shutdown()
    return steps


def check_groups(starts, seeds, group_size: int) -> None:
    """The episodes start in queue order (each seed ``group_size`` times), from gym's reset state.

    ``starts`` come from one transform, in trajectory-id order, which is the order of the resets.
    Only the tail of the queue can be missing: the episodes reset after the last collected step.
    """
    played = [seed for _, seed, _ in sorted(starts, key=lambda s: s[0])]
    queue = [seed for seed in seeds[: len(played) // group_size + 1] for _ in range(group_size)]
    assert played == queue[: len(played)]
    for _, seed, obs in starts:
        torch.testing.assert_close(obs, reset_observation(seed))


class TestSameStartGroups:
    def test_single_env_rollout(self):
        seeds = [11, 5, 29, 3, 17, 8, 40, 2, 33, 21, 6, 14]  # any order, not a range
        env = TransformedEnv(GymEnv("CartPole-v1"), SameStartGroups(3, seeds=seeds))
        torch.manual_seed(0)
        steps = env.rollout(200, break_when_any_done=False)  # random actions, auto resets
        done = steps["next", "done"].squeeze(-1)
        starts = torch.cat([torch.tensor([0]), done.nonzero().squeeze(-1) + 1])
        starts = starts[starts < steps.shape[0]]
        played = steps["reset_seed"][starts].tolist()
        assert played == [s for s in seeds for _ in range(3)][: len(played)]
        assert len(played) >= 4  # several episodes, so the queue moved past a group
        for start, seed in zip(starts.tolist(), played):
            torch.testing.assert_close(steps["observation"][start], reset_observation(seed))
        episode = torch.cumsum(torch.nn.functional.pad(done[:-1], (1, 0)).long(), 0)
        for e in episode.unique():  # all steps of an episode, and their next, carry its seed
            mine = episode == e
            assert set(steps["reset_seed"][mine].tolist()) == {played[e]}
            assert set(steps["next", "reset_seed"][mine].tolist()) == {played[e]}
        assert env.transform.episodes_started == len(played)  # no reset after the last step

    def test_vector_env_partial_resets(self):
        # 5 sub-envs and groups of 2: groups straddle sub-envs and partial resets
        env = TransformedEnv(vector_env(5), SameStartGroups(2, seeds=range(100, 200)))
        steps = collect(env, frames_per_batch=100, total_frames=600)
        starts = episode_starts(steps)
        assert len(starts) > 20
        check_groups(starts, range(100, 200), 2)
        check_every_step_carries_its_seed(steps)
        assert env.transform.episodes_started >= len(starts)

    def test_serial_env(self):
        env = TransformedEnv(SerialEnv(3, lambda: GymEnv("CartPole-v1")), SameStartGroups(4))
        steps = collect(env, frames_per_batch=90, total_frames=360)
        check_groups(episode_starts(steps), range(100), 4)
        check_every_step_carries_its_seed(steps)

    def test_parallel_env(self):
        base = ParallelEnv(2, functools.partial(GymEnv, "CartPole-v1"))
        env = TransformedEnv(base, SameStartGroups(3, seeds=range(7, 1000, 7)))
        steps = collect(env, frames_per_batch=100, total_frames=300)  # shuts the workers down
        check_groups(episode_starts(steps), range(7, 1000, 7), 3)
        check_every_step_carries_its_seed(steps)

    def test_multi_worker_collector_plays_each_seed_group_size_times(self):
        # 2 workers x 3 sub-envs, disjoint seed streams through create_env_kwargs
        collector = MultiSyncCollector(
            [make_worker_env, make_worker_env],
            None,
            frames_per_batch=300,
            total_frames=1200,
            create_env_kwargs=[{"worker": 0}, {"worker": 1}],
        )
        steps = torch.cat([batch.reshape(-1) for batch in collector])
        collector.shutdown()
        starts = episode_starts(steps)
        by_worker = [[s for s in starts if s[1] % 2 == w] for w in range(2)]
        assert all(len(mine) > 10 for mine in by_worker)  # both workers played
        for worker, mine in enumerate(by_worker):  # each stream: exact groups, from gym's start
            check_groups(mine, range(worker, 400, 2), 2)
        counts = Counter(seed for _, seed, _ in starts)  # across workers: never more than G
        assert max(counts.values()) == 2 and sum(n < 2 for n in counts.values()) <= 2 * 3
        check_every_step_carries_its_seed(steps)

    def test_groups_reach_mcadvantage_from_a_collector(self):
        env = TransformedEnv(vector_env(8), SameStartGroups(4))
        collector = Collector(
            env, None, frames_per_batch=80, total_frames=-1, trajs_per_batch=16, traj_format="cat"
        )
        rb = ReplayBuffer(storage=LazyTensorStorage(20_000))
        advantage = MCAdvantage(4, prompt_key="reset_seed", trajectory_return="sum")
        rb.append_transform(advantage)
        batches = iter(collector)
        for _ in range(3):
            rb.extend(next(batches))
        collector.shutdown()
        stored = rb[:]
        done = stored["next", "done"].squeeze(-1)
        first = torch.cat([torch.tensor([True]), done[:-1]])
        seeds = stored["reset_seed"][first]
        assert seeds.numel() >= 4 and seeds.numel() % 4 == 0
        for seed, n in Counter(seeds.tolist()).items():  # whole groups of 4, one start each
            assert n == 4
            obs = stored["observation"][first][seeds == seed]
            torch.testing.assert_close(obs, reset_observation(seed).expand_as(obs))
        assert advantage.get_stats()["written_groups"] == seeds.numel() // 4

    def test_full_resets_of_a_self_resetting_vector_env_are_seeded(self):
        # SAME_STEP: what the CartPole demo evaluates with (rollout until all are done)
        env = vector_env(3, gym.vector.AutoresetMode.SAME_STEP)
        env.append_transform(SameStartGroups(1, seeds=[4, 8, 15, 16, 23, 42, 1, 2, 3]))
        for seeds in ([4, 8, 15], [16, 23, 42]):
            td = env.reset()
            assert td["reset_seed"].tolist() == seeds
            for obs, seed in zip(td["observation"], seeds):
                torch.testing.assert_close(obs, reset_observation(seed))
            env.step(env.rand_action(td))  # played: the next reset takes new seeds
        steps = env.rollout(500, break_when_any_done=False, break_when_all_done=True)
        assert steps["next", "done"][:, -1].all()  # every sub-env ended, none was reset

    def test_state_dict_resumes_the_queue(self):
        env = TransformedEnv(vector_env(3), SameStartGroups(2, seeds=range(50)))
        env.reset()
        state = env.transform.state_dict()
        fresh = SameStartGroups(2, seeds=range(50))
        fresh.load_state_dict(state)
        assert fresh.episodes_started == 3
        env2 = TransformedEnv(vector_env(3), fresh)
        assert env2.reset()["reset_seed"].tolist() == [1, 2, 2]

    def test_specs_and_custom_key(self):
        env = TransformedEnv(vector_env(2), SameStartGroups(2, out_key="seed"))
        check_env_specs(env)
        spec = env.observation_spec["seed"]
        assert spec.dtype == torch.long and spec.shape == (2,)
        assert "reset_seed" not in env.reset().keys()
        assert (
            repr(env.transform)
            == "SameStartGroups(group_size=2, seeds=range(0, 2147483648), out_key='seed')"
        )


class TestDevices:
    def test_env_on_device(self, device):
        """An env whose outputs live on ``device`` (partial resets included): the seeds are
        written there and the groups are the CPU env's. Three single envs in a ``SerialEnv``:
        torchrl 0.14.1's ``GymWrapper`` of a gymnasium vector env fails on a GPU's partial
        resets (it reads the ``reset_mask`` with ``.numpy()``, seen on an H200)."""
        env = TransformedEnv(
            SerialEnv(3, functools.partial(GymEnv, "CartPole-v1", device=device)),
            SameStartGroups(2, seeds=range(50, 90)),
        )
        steps = collect(env, frames_per_batch=60, total_frames=240)
        assert steps["reset_seed"].device.type == device.type
        check_groups(episode_starts(steps.cpu()), range(50, 90), 2)


class TestSameStartGroupsErrors:
    @pytest.mark.parametrize("bad", [0, -1, 2.7, True, "4", None])
    def test_group_size(self, bad):
        with pytest.raises(ValueError, match="group_size must be an integer") as error:
            SameStartGroups(bad)
        assert str(error.value).endswith(f"got {bad!r}.")

    @pytest.mark.parametrize(
        ("seeds", "match"),
        [
            ([], "must not be empty"),
            (range(0), "non-empty and non-negative"),
            (range(-3, 3), "non-empty and non-negative"),
            ([1, -2], r"seeds\[1\] must be a non-negative integer, got -2"),
            ([1, 2.5], r"seeds\[1\] must be an integer, got 2\.5"),
            ([3, 1, 3, 1, 2], r"distinct .* got \[1, 3\] more than once"),
            ("0123", "a range or a sequence of integers"),
            (7, "a range or a sequence of integers, got 7"),
        ],
    )
    def test_seeds(self, seeds, match):
        with pytest.raises(ValueError, match=match):
            SameStartGroups(2, seeds=seeds)

    def test_seeds_run_out_and_nothing_changes(self):
        transform = SameStartGroups(2, seeds=[9, 10])
        env = TransformedEnv(vector_env(3), transform)
        td = env.reset()  # 9, 9, 10
        env.step(env.rand_action(td))
        assert transform.episodes_started == 3
        with pytest.raises(
            ValueError,
            match=r"ran out of seeds: 3 more episode\(s\) after 3 started need seed number 2 "
            r".* has 2",
        ):
            env.reset()
        assert transform.episodes_started == 3

    def test_partial_reset_of_a_self_resetting_vector_env(self):
        env = vector_env(3, gym.vector.AutoresetMode.SAME_STEP)
        env.append_transform(SameStartGroups(2))
        with pytest.raises(
            ValueError, match=r"cannot seed a partial reset .*AutoresetMode\.DISABLED"
        ):  # already at the collector's first reset, before any training
            Collector(env, None, frames_per_batch=300, total_frames=300)
        assert env.reset()["reset_seed"].tolist() == [0, 0, 1]  # whole resets stay seeded

    def test_env_without_gym_seeds(self):
        env = TransformedEnv(PendulumEnv(), SameStartGroups(2))
        with pytest.raises(TypeError, match="reset takes a gymnasium seed .* got PendulumEnv"):
            env.reset()
        assert env.transform.episodes_started == 0  # the failed reset handed out no seed

    def test_step_without_the_seed(self):
        env = TransformedEnv(GymEnv("CartPole-v1"), SameStartGroups(2))
        td = env.reset().exclude("reset_seed")  # a tensordict that did not come from reset
        td["action"] = env.action_spec.rand()
        with pytest.raises(KeyError, match="no 'reset_seed': step the tensordict"):
            env.step(td)

    def test_not_a_replay_buffer_transform(self):
        with pytest.raises(RuntimeError, match="append it to an env"):
            SameStartGroups(2)(TensorDict(batch_size=[]))


def make_worker_env(worker: int, num_workers: int = 2):
    """The env of one collector worker: 3 sub-envs, seeds ``worker, worker + 2, ...``."""
    transform = SameStartGroups(2, seeds=range(worker, 400, num_workers))
    return TransformedEnv(vector_env(3), transform)


class TestSeedsOutsideTheCollector:
    """Resets outside the collector that feeds the buffer must not leave a group incomplete."""

    def test_a_reset_never_played_gives_its_seed_back(self):
        env = TransformedEnv(vector_env(3), SameStartGroups(2))
        first = env.reset()["reset_seed"].tolist()
        assert env.reset()["reset_seed"].tolist() == first == [0, 0, 1]
        assert env.transform.episodes_started == 3
        env.step(env.rand_action(env.reset()))
        assert env.reset()["reset_seed"].tolist() == [1, 2, 2]

    def test_a_lazily_built_policy_then_a_collector(self):
        """``policy(env.reset())`` before the collector: the first group still completes."""
        env = TransformedEnv(vector_env(4), SameStartGroups(4))
        env.reset()  # what building a lazy policy on env.reset() does
        collector = Collector(env, None, frames_per_batch=200, total_frames=-1)
        advantage = MCAdvantage(4, prompt_key="reset_seed", trajectory_return="sum")
        rb = ReplayBuffer(storage=LazyTensorStorage(10_000))
        rb.append_transform(advantage)
        for _, batch in zip(range(4), collector):
            rb.extend(batch)
        collector.shutdown()
        assert 0 not in advantage.queues  # seed 0's four episodes completed their group
        assert 0 in rb[:]["reset_seed"].tolist()

    def test_rewind_after_a_trial_rollout(self):
        env = TransformedEnv(vector_env(2), SameStartGroups(2))
        check_env_specs(env)  # plays seed 0 on both sub-envs
        assert env.transform.episodes_started == 2
        env.transform.rewind()
        assert env.transform.episodes_started == 0
        assert env.reset()["reset_seed"].tolist() == [0, 0]

    def test_a_self_resetting_vector_env_fails_at_the_collectors_first_reset(self):
        env = vector_env(2, gym.vector.AutoresetMode.SAME_STEP)
        env.append_transform(SameStartGroups(1))
        with pytest.raises(ValueError, match="a collector resets its sub-envs one by one"):
            Collector(env, None, frames_per_batch=10, total_frames=10)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fresh = vector_env(2, gym.vector.AutoresetMode.SAME_STEP)
            fresh.append_transform(SameStartGroups(1))
            fresh.reset()  # an evaluation's whole reset: no word


class TestResume:
    """A checkpoint between two collector batches, a fresh process's objects, ``resume()``: every
    group pending at the checkpoint completes, with exactly ``G`` episodes of its seed."""

    LAYOUTS = {
        "stream": dict(frames_per_batch=60),
        "episodes": dict(frames_per_batch=30, trajs_per_batch=6, traj_format="cat"),
    }

    def build(self, layout, state=None, checkpoint=None, resume=True):
        """Env, buffer and collector as a user builds them; the checkpoint loaded (and
        ``resume`` called) before the collector exists, since it resets the env."""
        env = TransformedEnv(vector_env(5), SameStartGroups(3, seeds=range(1000)))
        advantage = MCAdvantage(3, prompt_key="reset_seed", trajectory_return="sum")
        rb = ReplayBuffer(storage=LazyTensorStorage(50_000)).append_transform(advantage)
        replays = None
        if checkpoint is not None:
            rb.loads(checkpoint)
            env.transform.load_state_dict(state)
            if resume:
                replays = env.transform.resume(advantage)
            else:  # what the transform's error asks for, and no more
                advantage.forget_trajectory_ids()
        collector = Collector(env, None, total_frames=-1, **self.LAYOUTS[layout])
        return env, rb, advantage, collector, replays

    def episodes_stored(self, rb) -> Counter:
        stored = rb[:]
        done = stored["next", "done"].squeeze(-1)
        first = torch.cat([torch.tensor([True]), done[:-1]])
        return Counter(stored["reset_seed"][first].tolist())

    def run(self, tmp_path, layout, resume=True):
        torch.manual_seed(0)
        env, rb, advantage, collector, _ = self.build(layout)
        batches = iter(collector)
        for _ in range(3):
            rb.extend(next(batches))
        collector.shutdown()
        pending = {seed: len(held) for seed, held in advantage.queues.items()}
        running = env.transform.running_seeds
        rb.dumps(tmp_path / "buffer")
        state = env.transform.state_dict()
        env, rb, advantage, collector, replays = self.build(
            layout, state, tmp_path / "buffer", resume
        )
        batches = iter(collector)
        for _ in range(12):
            rb.extend(next(batches))
        collector.shutdown()
        return pending, running, replays, self.episodes_stored(rb)

    @pytest.mark.parametrize("layout", ["stream", "episodes"])
    def test_every_pending_group_completes(self, tmp_path, layout):
        pending, running, replays, stored = self.run(tmp_path, layout)
        assert pending and running  # groups waited, episodes were being played
        assert set(replays) <= set(pending) | set(running)
        assert set(pending) <= set(stored)  # every group pending at the checkpoint released
        assert all(n == 3 for n in stored.values())  # each with exactly G episodes

    def test_without_resume_pending_groups_wait_forever(self, tmp_path):
        """What resume() is for; the first reset without it names the remedy and the seeds
        whose groups can no longer complete."""
        with pytest.warns(RuntimeWarning, match=r"without SameStartGroups.resume") as caught:
            pending, running, _, stored = self.run(tmp_path, "stream", resume=False)
        assert not set(pending) <= set(stored)
        (message,) = [str(w.message) for w in caught if "resume(advantage)" in str(w.message)]
        assert f"seeds {sorted(set(running))}" in message

    def test_a_torn_buffer_is_refused_naming_the_seeds(self, tmp_path):
        """The buffer saved two batches after the env state (what a kill between two in-place
        writes leaves): its pending groups hold episodes the state never started; resume()
        names them and changes nothing."""
        torch.manual_seed(0)
        env, rb, advantage, collector, _ = self.build("stream")
        batches = iter(collector)
        rb.extend(next(batches))
        state = copy.deepcopy(env.transform.state_dict())  # the state of batch 1 ...
        for _ in range(3):
            rb.extend(next(batches))
        collector.shutdown()
        rb.dumps(tmp_path / "buffer")  # ... beside the buffer of batch 4
        fresh = TransformedEnv(vector_env(5), SameStartGroups(3, seeds=range(1000)))
        fresh.transform.load_state_dict(state)
        restored = MCAdvantage(3, prompt_key="reset_seed", trajectory_return="sum")
        ReplayBuffer(storage=LazyTensorStorage(50_000)).append_transform(restored).loads(
            tmp_path / "buffer"
        )
        started = fresh.transform.episodes_started
        never = sorted(s for s, held in restored.queues.items() if s > (started - 1) // 3)
        held = restored.get_stats()
        with pytest.raises(ValueError, match=rf"never started \(seed {never[0]}: ") as error:
            fresh.transform.resume(restored)
        assert "torn checkpoint" in str(error.value)
        assert all(f"seed {seed}:" in str(error.value) for seed in never)
        assert restored.get_stats() == held and fresh.transform.replays == []
        assert fresh.transform.running_seeds == state["_extra_state"]["running"]

    def test_replays_are_served_first_and_saved(self):
        env = TransformedEnv(vector_env(2), SameStartGroups(2, seeds=range(50)))
        env.transform.replay({7: 1, 3: 2})
        assert env.transform.replays == [7, 3, 3]
        fresh = SameStartGroups(2, seeds=range(50))
        fresh.load_state_dict(env.transform.state_dict())
        assert fresh.replays == [7, 3, 3] and fresh.episodes_started == 0
        env = TransformedEnv(vector_env(2), fresh)
        td = env.reset()
        assert td["reset_seed"].tolist() == [7, 3] and fresh.replays == [3]
        env.step(env.rand_action(td))
        td = env.reset()
        assert td["reset_seed"].tolist() == [3, 0] and fresh.episodes_started == 1

    def test_bad_replays_are_refused(self):
        transform = SameStartGroups(2, seeds=range(10))
        with pytest.raises(ValueError, match="seed 12"):
            transform.replay({12: 1})
        with pytest.raises(ValueError, match="non-negative count"):
            transform.replay({1: -1})
        assert transform.replays == []

    def test_an_older_state_dict_loads(self):
        transform = SameStartGroups(2)
        transform.load_state_dict({"_episodes_started": torch.tensor(5)})
        assert transform.episodes_started == 5 and transform.running_seeds == []

    def test_a_restored_state_in_a_live_env_then_a_step(self):
        """The checkpoint's running seeds are not this env's sub-envs: stepping after a load
        neither fails nor masks the wrong sub-envs, and the next reset takes over."""
        env = TransformedEnv(vector_env(4), SameStartGroups(2, seeds=range(50)))
        td = env.reset()
        saved = SameStartGroups(2, seeds=range(50))
        saved.load_state_dict(
            {
                "_episodes_started": torch.tensor(6),
                "_extra_state": {"running": [1, 2, 2], "replays": []},
            }
        )
        env.transform.load_state_dict(saved.state_dict())
        assert env.transform.running_seeds == [1, 2, 2]
        env.step(env.rand_action(td))  # no shape error
        with pytest.warns(RuntimeWarning, match=r"seeds \[1, 2\], running at the checkpoint"):
            env.reset()  # loaded without resume(): those groups can no longer complete
        assert len(env.transform.running_seeds) == 4  # the live sub-envs' seeds

    def test_resume_twice_counts_the_replays_still_queued(self):
        """Seed 3 (G=2) was replayed twice by a first resume; one replay runs, one is queued at
        the second checkpoint: only the running one is played again."""
        transform = SameStartGroups(2, seeds=range(50))
        transform.load_state_dict(
            {
                "_episodes_started": torch.tensor(10),
                "_extra_state": {"running": [3], "replays": [3]},
            }
        )
        assert transform.resume({}) == {3: 1}
        assert transform.replays == [3, 3]

    def test_a_group_released_short_is_not_started_again(self):
        """With min_group_size a group can leave the transform short: a running seed whose
        group is not pending may be gone, and is not replayed (a warning names it)."""
        advantage = MCAdvantage(
            4,
            prompt_key="reset_seed",
            trajectory_return="sum",
            min_group_size=2,
            max_pending_age=1,
        )
        rb = ReplayBuffer(storage=LazyTensorStorage(100)).append_transform(advantage)

        def episodes(seed, n):
            done = torch.ones(n, 1, dtype=torch.bool)
            return TensorDict(
                reset_seed=torch.full((n,), seed),
                observation=torch.zeros(n, 4),
                next=TensorDict(
                    reward=torch.ones(n, 1), done=done, terminated=done, batch_size=[n]
                ),
                batch_size=[n],
            )

        rb.extend(episodes(0, 3))  # three of seed 0's four ended; the fourth is running
        rb.extend(episodes(1, 1))  # seed 0's group is released short (3 >= min_group_size)
        assert advantage.get_stats()["short_groups"] == 1 and 0 not in advantage.queues
        transform = SameStartGroups(4, seeds=range(50))
        transform.load_state_dict(
            {"_episodes_started": torch.tensor(6), "_extra_state": {"running": [0, 1]}}
        )
        with pytest.warns(RuntimeWarning, match=r"running seeds \[0\]"):
            replays = transform.resume(advantage)
        assert replays == {1: 1}  # seed 1: two started, one held; seed 0 not again
