"""Tests of checkpoints: MCAdvantage.state_dict and torchrl_grpo/checkpoint.py."""

import functools
import io
from pathlib import Path

import pytest
import torch
from helpers import checkpoints, released, trajectory
from tensordict import NonTensorData, TensorDict, lazy_stack
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer

from torchrl_grpo import MCAdvantage
from torchrl_grpo.checkpoint import EmptyStorageCheckpointer, allow_empty_dumps

DATA = Path(__file__).parent / "data"


def halves(num_groups=4, size=4, seed=0):
    """Trajectories of ``num_groups`` groups: the first halves, then the second halves."""
    gen = torch.Generator().manual_seed(seed)
    trajs = [
        [
            trajectory(g, torch.randn(int(torch.randint(1, 4, (1,), generator=gen)), generator=gen))
            for _ in range(size)
        ]
        for g in range(num_groups)
    ]
    first = [t for group in trajs for t in group[: size // 2]]
    second = [t for group in trajs for t in group[size // 2 :]]
    return torch.cat(first), torch.cat(second)


def make_buffer(storage=LazyTensorStorage, through_constructor=False, **kw):
    """A buffer built as a user builds one: no call other than torchrl's."""
    transform = MCAdvantage(4, prompt_key="seed", trajectory_return="sum", **kw)
    if through_constructor:
        return ReplayBuffer(storage=storage(1000), transform=transform), transform
    return ReplayBuffer(storage=storage(1000)).append_transform(transform), transform


def stored(rb):
    """uid -> advantage of everything in storage."""
    return released(rb[:]) if len(rb) else {}


class TestStateDict:
    def test_round_trip_through_weights_only_torch_load(self):
        first, second = halves()
        t = MCAdvantage(4, prompt_key="seed", trajectory_return="sum")
        t.inv(first)
        buffer = io.BytesIO()
        torch.save(t.state_dict(), buffer)
        buffer.seek(0)
        u = MCAdvantage(4, prompt_key="seed", trajectory_return="sum")
        u.load_state_dict(torch.load(buffer, weights_only=True))
        assert u.get_stats() == t.get_stats() and u.queued_trajectories == 8
        a, b = released(t.inv(second.clone())), released(u.inv(second.clone()))
        assert a.keys() == b.keys() and len(a) == second.numel() + first.numel()
        assert all(torch.equal(a[k], b[k]) for k in a)

    def test_string_prompts_and_ragged_steps(self):
        def step(prompt, n, done):
            return TensorDict(
                query=NonTensorData(prompt),
                uid=torch.tensor(n * 10 + int(done)),
                tokens=torch.arange(n),
                next=TensorDict(reward=torch.full((n, 1), float(n)), done=torch.tensor([done])),
            )

        t = MCAdvantage(2)
        t.inv(lazy_stack([step("p", 2, False), step("p", 3, True)]))
        u = MCAdvantage(2)
        u.load_state_dict(t.state_dict())
        assert list(u.queues) == ["p"]
        last = lazy_stack([step("p", 4, True)])
        a, b = released(t.inv(last)), released(u.inv(last))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def test_the_checkpoint_is_torchs_extra_state(self):
        t = MCAdvantage(2, prompt_key="seed")
        t.inv(trajectory(0, [1.0]))
        assert list(t.state_dict()) == ["_extra_state"]
        state = t.state_dict()["_extra_state"]
        assert state["grpo_size"] == 2 and state["pending"]["lengths"].tolist() == [1]

    def test_checkpoints_of_the_earlier_layout_load(self):
        """torchrl_grpo 0.1.0 saved ``pending`` and ``grpo_size`` entries of its own."""
        first, second = halves()
        t = MCAdvantage(4, prompt_key="seed", trajectory_return="sum")
        t.inv(first)
        earlier = {"pending": t.get_extra_state()["pending"], "grpo_size": 4}
        u = MCAdvantage(4, prompt_key="seed", trajectory_return="sum")
        u.load_state_dict(earlier)
        assert u.get_stats() == t.get_stats() and u.queued_trajectories == 8
        a, b = released(t.inv(second.clone())), released(u.inv(second.clone()))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def test_group_size_mismatch_is_an_error(self):
        t = MCAdvantage(4, prompt_key="seed")
        t.inv(trajectory(0, [1.0]))
        with pytest.raises(RuntimeError, match="grpo_size=4"):
            MCAdvantage(3, prompt_key="seed").load_state_dict(t.state_dict())


class TestReplayBufferDumps:
    @pytest.mark.parametrize("complete_first", [False, True])
    @pytest.mark.parametrize("through_constructor", [False, True])
    @pytest.mark.parametrize("storage", [LazyTensorStorage, LazyMemmapStorage])
    def test_restart_between_halves_changes_nothing(
        self, tmp_path, complete_first, through_constructor, storage
    ):
        """``rb.dumps`` / ``rb.loads`` between two halves of every group, with no call beyond
        torchrl's: at step 0 (nothing stored yet, every group pending) or later."""
        first, second = halves()
        if complete_first:  # one group complete before the restart: the storage holds data
            first = torch.cat([first, halves(1, 4, seed=1)[0], halves(1, 4, seed=1)[1]])
        reference, _ = make_buffer()
        reference.extend(first.clone())
        reference.extend(second.clone())

        rb, transform = make_buffer(storage, through_constructor)
        rb.extend(first.clone())
        assert (len(rb) == 0) != complete_first and transform.queued_trajectories == 8
        rb.dumps(tmp_path / "checkpoint")
        restored, restored_transform = make_buffer(storage, through_constructor)
        restored.loads(tmp_path / "checkpoint")
        assert restored_transform.get_stats() == transform.get_stats() and len(restored) == len(rb)
        restored.extend(second.clone())
        want, got = stored(reference), stored(restored)
        assert got.keys() == want.keys() and len(got) == first.numel() + second.numel()
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert restored_transform.get_stats() == reference.transform[0].get_stats()

    def test_appending_is_enough_for_a_dump_before_any_insertion(self, tmp_path):
        rb, _ = make_buffer()
        rb.dumps(tmp_path)
        restored, transform = make_buffer(through_constructor=True)  # storage not wrapped
        assert not isinstance(restored.storage.checkpointer, EmptyStorageCheckpointer)
        restored.loads(tmp_path)  # torchrl's own checkpointer reads the empty record
        assert len(restored) == 0 and transform.queued_trajectories == 0

    def test_plain_torchrl_storage_refuses_an_empty_dump(self, tmp_path):
        """What the transform spares its buffer: torchrl alone cannot save an empty storage."""
        rb = ReplayBuffer(storage=LazyTensorStorage(10))  # no MCAdvantage in it
        with pytest.raises(RuntimeError, match="non-initialized"):
            rb.dumps(tmp_path)
        allow_empty_dumps(rb).dumps(tmp_path)  # the explicit way, for such a buffer

    def test_the_first_insertion_finds_the_buffer(self, tmp_path):
        """A transform put in a buffer torchrl's way without ``append_transform`` (here a
        ``Compose`` built first) finds its buffer when data first goes through it."""
        from torchrl.envs.transforms import Compose

        transform = MCAdvantage(2, prompt_key="seed")
        rb = ReplayBuffer(storage=LazyTensorStorage(10), transform=Compose(transform))
        assert not isinstance(rb.storage.checkpointer, EmptyStorageCheckpointer)
        rb.extend(trajectory(0, [1.0]))
        assert isinstance(rb.storage.checkpointer, EmptyStorageCheckpointer)
        rb.dumps(tmp_path)

    def test_loading_an_empty_dump_empties_a_filled_storage(self, tmp_path):
        storage = LazyTensorStorage(10)
        storage.checkpointer = EmptyStorageCheckpointer(storage.checkpointer)
        storage.dumps(tmp_path)
        other = LazyTensorStorage(10)
        other.checkpointer = EmptyStorageCheckpointer(other.checkpointer)
        other.set(range(2), TensorDict(x=torch.ones(2), batch_size=[2]))
        assert len(other) == 2
        other.loads(tmp_path)
        assert len(other) == 0

    def test_allow_empty_dumps_wraps_once(self):
        rb = allow_empty_dumps(allow_empty_dumps(ReplayBuffer(storage=LazyTensorStorage(10))))
        assert isinstance(rb.storage.checkpointer, EmptyStorageCheckpointer)
        assert not isinstance(rb.storage.checkpointer.inner, EmptyStorageCheckpointer)


class TestDevices:
    """Pending steps on a device: a checkpoint restores them there, or onto the CPU."""

    @pytest.mark.parametrize("map_location", [None, "cpu"])
    def test_restore_then_continue(self, device, map_location):
        first, second = halves()
        reference, _ = make_buffer()
        reference.extend(first)
        reference.extend(second)

        on_device = functools.partial(LazyTensorStorage, device=device)
        rb, transform = make_buffer(on_device)
        rb.extend(first.to(device))  # every group half full: all pending, on `device`
        assert len(rb) == 0
        saved = io.BytesIO()
        torch.save(transform.state_dict(), saved)
        saved.seek(0)
        state = torch.load(saved, map_location=map_location, weights_only=True)

        restored_rb, restored = make_buffer(on_device)
        restored.load_state_dict(state)
        restored_rb.extend(second.to(device))
        got = restored_rb[:]
        assert got["advantage"].device.type == device.type
        want = stored(reference)
        assert sorted(released(got)) == sorted(want)
        for uid, adv in released(got).items():
            torch.testing.assert_close(adv.cpu(), want[uid])


class TestCheckpointsOfEarlierVersions:
    """``state_dict()`` files written by torchrl_grpo 0.1.0 (``test/data``, see
    ``helpers.checkpoints``) load, and the restored transform goes on as the one that saved them
    would have: same queues, statistics, releases and advantages."""

    @pytest.mark.parametrize("name", sorted(checkpoints.CASES))
    def test_load_and_go_on(self, name):
        kwargs, before = checkpoints.CASES[name]
        whole = MCAdvantage(**kwargs)
        for insertion in checkpoints.stream(name)[:before]:
            whole.inv(insertion)
        restored = MCAdvantage(**kwargs)
        saved = torch.load(checkpoints.path(DATA, name), weights_only=True)
        restored.load_state_dict(saved)
        assert restored.get_stats() == whole.get_stats()
        assert list(restored.queues) == list(whole.queues)
        for group in whole.queues:
            for a, b in zip(restored.queues[group], whole.queues[group], strict=True):
                assert a["uid"].tolist() == b["uid"].tolist()
        rest = zip(checkpoints.stream(name)[before:], checkpoints.stream(name)[before:])
        released_steps = 0
        for mine, theirs in rest:
            a, b = released(restored.inv(mine)), released(whole.inv(theirs))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            released_steps += len(a)
        assert released_steps > 0 and restored.get_stats() == whole.get_stats()
