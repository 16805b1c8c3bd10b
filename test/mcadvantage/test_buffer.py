"""Tests of torchrl_grpo/mcadvantage/buffer.py: releases a buffer could not store as steps."""

import warnings

import pytest
import torch
from helpers import trajectory
from torchrl.data import LazyTensorStorage, ReplayBuffer

from torchrl_grpo import MCAdvantage
from torchrl_grpo.mcadvantage import Limits


def buffer(size, **kwargs):
    rb = ReplayBuffer(storage=LazyTensorStorage(size))
    rb.append_transform(MCAdvantage(2, prompt_key="seed", **kwargs))
    return rb


class TestAdd:
    def test_a_release_through_add_is_refused_and_nothing_changes(self):
        rb = buffer(10)
        rb.add(trajectory(0, [1.0])[0])  # held back: nothing to store
        before = rb.transform[0].get_stats()
        with pytest.raises(ValueError, match=r"releases 2 steps, but add\(\) stores one element"):
            rb.add(trajectory(0, [2.0])[0])
        assert rb.transform[0].get_stats() == before and len(rb) == 0
        rb.extend(trajectory(0, [2.0]))  # the same step by extend completes the group
        assert len(rb) == 2 and rb[:]["advantage"].flatten().tolist() == pytest.approx(
            [-0.7071, 0.7071], abs=1e-4
        )

    def test_a_group_of_one_step_through_add(self):
        rb = ReplayBuffer(storage=LazyTensorStorage(10))
        rb.append_transform(MCAdvantage(1, prompt_key="seed"))
        rb.add(trajectory(0, [1.0])[0])
        assert len(rb) == 1


class TestCapacity:
    def test_a_release_larger_than_the_storage_overwrites_as_torchrl_said_once(self):
        rb = buffer(3)
        rb.extend(trajectory(0, [1.0, 1.0]))
        with pytest.warns(RuntimeWarning, match=r"releases 4 steps, more .*max_size=3.*last 3"):
            rb.extend(trajectory(0, [1.0, 2.0]))
        released = MCAdvantage(2, prompt_key="seed")  # the same release, outside a buffer
        released.inv(trajectory(0, [1.0, 1.0]))
        out = released.inv(trajectory(0, [1.0, 2.0]))["advantage"].flatten()
        assert len(rb) == 3 and rb.transform[0].written_groups == 1
        # torchrl's ring buffer wrote the 4 steps at slots 0, 1, 2, 0: the last 3 are kept
        assert rb[:]["advantage"].flatten().tolist() == out[[3, 1, 2]].tolist()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rb.extend(torch.cat([trajectory(1, [1.0, 1.0]), trajectory(1, [2.0, 2.0])]))

    def test_a_release_larger_than_the_storage_is_refused_on_request(self):
        rb = buffer(3, limits=Limits(on_overflow="raise"))
        rb.extend(trajectory(0, [1.0, 1.0]))
        with pytest.raises(ValueError, match=r"releases 4 steps, more than .*max_size=3.*raise"):
            rb.extend(trajectory(0, [1.0, 2.0]))
        assert len(rb) == 0 and rb.transform[0].queued_trajectories == 1

    def test_overwriting_stored_steps_is_said_once(self):
        rb = buffer(5)

        def group(seed):
            return torch.cat([trajectory(seed, [1.0, 1.0]), trajectory(seed, [1.0])])

        rb.extend(group(0))
        with pytest.warns(RuntimeWarning, match="holding 3 of max_size=5: the oldest 1") as seen:
            rb.extend(group(1))
        assert seen[0].filename == __file__
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rb.extend(group(2))  # once per transform
        assert len(rb) == 5

    def test_inv_outside_a_buffer_is_not_checked(self):
        t = MCAdvantage(2, prompt_key="seed")
        t.inv(trajectory(0, [1.0] * 500))
        assert t.inv(trajectory(0, [1.0] * 500)).numel() == 1000


class TestShared:
    def test_a_refused_release_leaves_the_owner_as_it_was(self):
        rb = ReplayBuffer(storage=LazyTensorStorage(3), shared=True)
        rb.append_transform(MCAdvantage(2, prompt_key="seed", limits=Limits(on_overflow="raise")))
        rb.extend(trajectory(0, [1.0, 1.0]))
        with pytest.raises(ValueError, match="more than the storage holds"):
            rb.extend(trajectory(0, [1.0, 2.0]))
        transform = rb.transform[0]
        assert transform.is_shared and transform.queued_trajectories == 1
        assert transform.written_groups == 0
