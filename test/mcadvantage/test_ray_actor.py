"""Tests of torchrl_grpo/mcadvantage/ray_actor.py: RayMCAdvantage against the local transform,
writers in Ray tasks, releases refused by the writer, insertions overtaken by another writer,
errors and warnings raised in the writer, named actors, checkpoints."""

import pickle

import pytest
import torch
from helpers import bad_inputs, random_chunks, random_stream, released, trajectory
from torchrl.data import LazyTensorStorage, ReplayBuffer

from torchrl_grpo import MCAdvantage, RayMCAdvantage
from torchrl_grpo.mcadvantage import GroupRelative, Limits
from torchrl_grpo.mcadvantage.ray_actor import RayOwner

ray = pytest.importorskip("ray", reason="the `dist` extra (ray) is not installed")

KWARGS = dict(grpo_size=3, prompt_key="seed", trajectory_return="sum")


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def make():
    made = []

    def make(*args, **kwargs):
        made.append(RayMCAdvantage(*args, **kwargs))
        return made[-1]

    yield make
    for t in made:
        t.close()


def test_same_releases_and_statistics_as_local(make):
    trajs = random_stream(6, 3, seed=4)
    normed = GroupRelative(step_norm=True)
    ours, local = make(**KWARGS, estimator=normed), MCAdvantage(**KWARGS, estimator=normed)
    assert ours.is_shared and isinstance(ours._replica, RayOwner)
    for chunk in random_chunks(trajs, seed=4):
        got, want = released(ours.inv(chunk)), released(local.inv(chunk))
        assert got.keys() == want.keys()
        for uid, adv in want.items():
            assert torch.equal(got[uid], adv), uid
    assert ours.get_stats() == local.get_stats() and ours.written_groups == 6
    assert ours.share_memory_() is ours


def test_writers_in_ray_tasks_complete_one_set_of_groups(make):
    """Each group's trajectories dealt to two Ray tasks and the driver, each with a pickled copy
    of the transform: every group is released once, with its whole group's advantages."""
    t = make(**KWARGS)
    trajs = random_stream(4, 3, seed=7)

    @ray.remote(num_cpus=1)
    def write(transform, trajs):
        return [transform.inv(traj) for traj in trajs]

    outs = ray.get([write.remote(t, trajs[k::3]) for k in (1, 2)])
    outs = [out for batch in outs for out in batch] + [t.inv(traj) for traj in trajs[::3]]
    got = {}
    for out in outs:
        got.update(released(out))
    local = MCAdvantage(**KWARGS)
    want = released(local.inv(torch.cat(trajs)))
    assert got.keys() == want.keys()
    for uid, adv in want.items():
        torch.testing.assert_close(got[uid], adv, atol=1e-6, rtol=0)
    assert t.written_groups == 4 and t.queued_trajectories == 0


def test_a_release_the_storage_cannot_hold_is_refused_and_kept_pending(make):
    rb = ReplayBuffer(storage=LazyTensorStorage(4), batch_size=2)
    rb.append_transform(t := make(2, prompt_key="seed", limits=Limits(on_overflow="raise")))
    rb.extend(trajectory(0, [1.0, 2.0, 3.0]))
    before = t.get_stats()
    with pytest.raises(ValueError, match="storage"):
        rb.extend(trajectory(0, [0.0, 1.0]))  # releases 5 steps into a storage of 4
    assert t.get_stats() == before and t.queued_trajectories == 1 and len(rb) == 0


def test_an_insertion_overtaken_by_another_writer_is_attempted_again(make):
    """Another writer commits between this writer's attempt and its commit: the commit is
    refused and the insertion attempted again on the new state; both are kept."""
    t = make(2, prompt_key="seed", trajectory_return="sum")
    other = pickle.loads(pickle.dumps(t))  # a copy, as a Ray worker has
    t.inv(trajectory(0, [1.0]))
    checks = []

    def overtake(out):
        checks.append(len(out))
        if len(checks) == 1:
            assert other.inv(trajectory(1, [4.0])) is None  # commits first

    out = t._replica.insert(trajectory(0, [3.0]), check=overtake)
    assert checks == [2, 2] and out["advantage"].reshape(-1).tolist() == pytest.approx(
        [-0.7071, 0.7071], abs=1e-4
    )
    assert t.written_groups == 1 and list(t.queues) == [1]


def test_errors_are_raised_as_they_are_and_change_nothing(make):
    """Each bad input raises the local transform's error (not Ray's wrapped task error)."""
    t = make(2, prompt_key="seed")  # one actor for every case: each starts a process
    t.inv(trajectory(1, [1.0]))
    before = t.get_stats()
    for _, batch, error, words in bad_inputs():
        with pytest.raises(error, match=words[0]) as caught:
            t.inv(batch)
        assert type(caught.value) is error
        assert t.get_stats() == before


def test_warnings_are_issued_in_the_writer(make):
    t = make(2, prompt_key="seed", limits=Limits(max_groups=1))
    t.inv(trajectory(0, [1.0]))
    with pytest.warns(RuntimeWarning, match="evict") as record:
        t.inv(trajectory(1, [1.0]))
    assert t.evicted_groups == 1
    assert record[0].filename == __file__  # on the user's line, as the local transform's


def test_a_named_actor_is_shared_and_left_running_by_who_found_it(make):
    first = make(2, prompt_key="seed", actor_name="grpo-groups")
    first.inv(trajectory(0, [1.0]))
    second = make(2, prompt_key="seed", actor_name="grpo-groups")
    assert second.queued_trajectories == 1
    second.close()  # found, not created: the actor goes on
    assert first.inv(trajectory(0, [2.0])) is not None


def test_checkpoint_loads_into_a_local_transform(make):
    trajs = random_stream(3, 3, seed=2)
    t = make(**KWARGS)
    t.inv(torch.cat(trajs[:5]))
    local = MCAdvantage(**KWARGS)
    local.load_state_dict(t.state_dict())
    assert local.get_stats() == t.get_stats()
    rest = torch.cat(trajs[5:])
    got, want = released(local.inv(rest)), released(t.inv(rest))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    t.clear_queues()
    assert t.queued_trajectories == 0
