"""Tests of torchrl_grpo/storages.py: a replay buffer whose groups are all still pending can be
saved and restored (and the transform's state with it, on any device), its storage empty or a
list of rows torchrl cannot save."""

import functools
import io

import pytest
import torch
from helpers import halves, released, trajectory
from helpers.buffers import make_buffer
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer

from torchrl_grpo import MCAdvantage
from torchrl_grpo.storages import (  # and torchrl_grpo.checkpoint
    EmptyStorageCheckpointer,
    allow_empty_dumps,
)


def stored(rb):
    """uid -> advantage of everything in storage."""
    return released(rb[:]) if len(rb) else {}


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


def llm_rows(prompts, seed=0):
    """LLM rows as torchrl's LLM collectors store them: ragged tokens, text, a prompt key."""
    from torchrl.modules.llm.policies.common import Text, Tokens

    g = torch.Generator().manual_seed(seed)
    rows = []
    for prompt in prompts:
        n = int(torch.randint(3, 9, (), generator=g))
        rows.append(
            TensorDict(
                tokens=Tokens(full=torch.randint(50, (n,), generator=g), prompt=torch.arange(2)),
                text=Text(prompt=prompt, full=prompt + " answer"),
                query=prompt,
                next=TensorDict(
                    reward=torch.rand(1, 1, generator=g),
                    done=torch.ones(1, 1, dtype=torch.bool),
                    terminated=torch.ones(1, 1, dtype=torch.bool),
                ),
            ).unsqueeze(0)  # one step each
        )
    return rows


class TestListStorages:
    """torchrl 0.14.1 cannot save a ListStorage / LazyStackStorage; through MCAdvantage's buffer
    (or allow_empty_dumps) it can, the transform's pending text groups included."""

    def make(self):
        from torchrl.data import LazyStackStorage

        transform = MCAdvantage(2, prompt_key="query", trajectory_return="sum")
        return ReplayBuffer(storage=LazyStackStorage(100)).append_transform(transform), transform

    def test_plain_torchrl_refuses(self, tmp_path):
        from torchrl.data import LazyStackStorage

        rb = ReplayBuffer(storage=LazyStackStorage(10))
        with pytest.raises(NotImplementedError):
            rb.dumps(tmp_path)

    def test_restart_with_stored_and_pending_groups(self, tmp_path):
        from tensordict import lazy_stack, set_list_to_stack

        with set_list_to_stack(True):
            rows = llm_rows(["a", "b", "a", "c", "b", "c"])
            reference, _ = self.make()
            for row in rows:
                reference.extend(row)
            rb, transform = self.make()
            for row in rows[:4]:  # "a" complete (stored); "b" and "c" pending
                rb.extend(row)
            assert len(rb) == 2 and transform.queued_trajectories == 2
            rb.dumps(tmp_path / "checkpoint")
            restored, restored_transform = self.make()
            restored.loads(tmp_path / "checkpoint")
            assert len(restored) == 2 and restored_transform.queued_trajectories == 2
            for row in rows[4:]:
                restored.extend(row)
            assert len(restored) == len(reference) == 6
            got, want = restored[:], reference[:]
            assert got["query"] == want["query"]
            assert torch.equal(got["advantage"].flatten(), want["advantage"].flatten())
            for a, b in zip(got.unbind(0), want.unbind(0)):
                assert torch.equal(a["tokens", "full"], b["tokens", "full"])
                assert a["text", "full"] == b["text", "full"]
            assert lazy_stack(list(got.unbind(0))).batch_size == got.batch_size

    def test_loading_into_a_filled_storage_is_refused(self, tmp_path):
        from tensordict import set_list_to_stack

        with set_list_to_stack(True):
            rb, _ = self.make()
            for row in llm_rows(["a", "a"]):
                rb.extend(row)
            rb.dumps(tmp_path / "checkpoint")
            with pytest.raises(RuntimeError, match="loads into an empty storage"):
                rb.loads(tmp_path / "checkpoint")

    def test_a_plain_list_storage_of_objects(self, tmp_path):
        from torchrl.data import ListStorage

        rb = allow_empty_dumps(ReplayBuffer(storage=ListStorage(10)))
        rb.extend([{"a": 1}, "text", 3.5])
        rb.dumps(tmp_path / "checkpoint")
        restored = allow_empty_dumps(ReplayBuffer(storage=ListStorage(10)))
        restored.loads(tmp_path / "checkpoint")
        assert [restored[i] for i in range(3)] == [{"a": 1}, "text", 3.5]


def test_an_emptied_tensor_storage_is_saved_as_empty(tmp_path):
    """Filled, then emptied (rb.empty() after training): saved as the empty record, without
    torchrl's warning about its unset cursor, and loaded as empty."""
    import warnings

    rb, _ = make_buffer()
    first, second = halves()
    rb.extend(first.clone())
    rb.extend(second.clone())
    assert len(rb) > 0
    rb.empty()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        rb.dumps(tmp_path / "checkpoint")
    restored, _ = make_buffer()
    restored.loads(tmp_path / "checkpoint")
    assert len(restored) == 0
