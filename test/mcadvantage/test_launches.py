"""The host synchronisations and operators of one insertion (issue 39), counted at torch's
dispatcher with :func:`torchrl_grpo.launches.count_launches`: on a GPU, each synchronisation is
a wait for the device. The transform reads twice per insertion on its main paths (what the input
holds, then what completes), a trajectory-id join once more; none of it grows with the groups."""

import pytest
import torch
from helpers import collector_stream
from tensordict import NonTensorData, NonTensorStack, TensorDict, lazy_stack
from torchrl.data import LazyTensorStorage, ReplayBuffer

from torchrl_grpo import MCAdvantage
from torchrl_grpo.launches import count_launches


def groups_of(groups, steps=4, size=8, seed=0, strings=False):
    """``groups`` groups of ``size`` trajectories of ``steps`` steps each, shuffled."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * size
    ids = torch.arange(groups).repeat_interleave(size)[torch.randperm(n, generator=gen)]
    ids = (ids + 1000 * seed).repeat_interleave(steps)
    done = torch.zeros(n, steps, 1, dtype=torch.bool)
    done[:, -1] = True
    td = TensorDict(
        observation=torch.randn(n * steps, 3, generator=gen),
        seed=ids,
        next=TensorDict(
            reward=torch.randn(n * steps, 1, generator=gen),
            done=done.reshape(-1, 1),
            batch_size=[n * steps],
        ),
        batch_size=[n * steps],
    )
    if strings:
        td["seed"] = NonTensorStack(*[f"prompt {int(i)}" for i in ids], batch_size=[n * steps])
    return td


def ragged_rows(groups, size=8, seed=0):
    """A lazy stack of one-step trajectories (an LLM's rows): ``size`` completions of each of
    ``groups`` prompts, token sequences of different lengths."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for prompt in range(groups):
        for _ in range(size):
            length = int(torch.randint(3, 9, (1,), generator=gen))
            rows.append(
                TensorDict(
                    query=NonTensorData(f"prompt {prompt} {seed}"),
                    tokens=torch.randint(0, 50, (length,), generator=gen),
                    next=TensorDict(
                        reward=torch.randn(1, 1, generator=gen), done=torch.tensor([True])
                    ),
                )
            )
    return lazy_stack(rows)


def launches_of(transform, first, second):
    """The launches of inserting ``second`` once ``first`` was (the first call's work done)."""
    transform.inv(first)
    with count_launches() as launches:
        transform.inv(second)
    return launches


class TestInsertionLaunches:
    @pytest.mark.parametrize("trajectory_return", [None, "sum"])
    def test_tensor_ids_read_twice(self, trajectory_return):
        transform = MCAdvantage(8, prompt_key="seed", trajectory_return=trajectory_return)
        launches = launches_of(transform, groups_of(8), groups_of(8, seed=1))
        assert launches.syncs == 2, launches.by_sync

    def test_an_extend_adds_two_to_the_storage_write(self):
        def extend(transform):
            rb = ReplayBuffer(storage=LazyTensorStorage(4096))
            if transform is not None:
                rb.append_transform(transform)
            rb.extend(groups_of(8))
            with count_launches() as launches:
                rb.extend(groups_of(8, seed=1))
            return launches

        plain, ours = extend(None), extend(MCAdvantage(8, prompt_key="seed"))
        assert ours.syncs == plain.syncs + 2, ours.by_sync

    def test_pending_groups_complete_with_two_reads(self):
        data = groups_of(8)
        half = data.shape[0] // 2
        launches = launches_of(MCAdvantage(8, prompt_key="seed"), data[:half], data[half:])
        assert launches.syncs == 2, launches.by_sync

    def test_prompt_ids(self):
        first, second = groups_of(8, strings=True), groups_of(8, seed=1, strings=True)
        launches = launches_of(MCAdvantage(8, prompt_key="seed"), first, second)
        assert launches.syncs == 2, launches.by_sync

    def test_ragged_rows(self):
        transform = MCAdvantage(8, prompt_key="query")
        launches = launches_of(transform, ragged_rows(4), ragged_rows(4, seed=1))
        assert launches.syncs == 2, launches.by_sync

    def test_ragged_rows_operators_do_not_grow_with_the_rows(self):
        """Ragged rows (a lazy stack of one TensorDict per completion): the rewards read and
        the advantages written back with a fixed number of operators, 8 groups as 64."""
        counts = {}
        for groups in (8, 64):
            transform = MCAdvantage(8, prompt_key="query")
            launches = launches_of(transform, ragged_rows(groups), ragged_rows(groups, seed=1))
            counts[groups] = (launches.syncs, launches.ops)
        assert counts[8] == counts[64] and counts[8][0] == 2

    def test_streamed_trajectories_joined_across_batches(self):
        batches, _ = collector_stream(8, 16, 4, seed=0, steps_per_batch=8)
        transform = MCAdvantage(4, prompt_key="seed", traj_key=("collector", "traj_ids"))
        for batch in batches[:2]:
            transform.inv(batch)
        for batch in batches[2:5]:
            with count_launches() as launches:
                transform.inv(batch)
            assert launches.syncs <= 3, launches.by_sync  # the join's read, then as above

    def test_counts_do_not_grow_with_the_groups(self):
        counts = {}
        for groups in (1, 8, 64):
            transform = MCAdvantage(8, prompt_key="seed")
            first, second = groups_of(groups, steps=96), groups_of(groups, steps=96, seed=1)
            launches = launches_of(transform, first, second)
            counts[groups] = (launches.syncs, launches.ops)
        assert counts[1][0] == counts[8][0] == counts[64][0] == 2
        assert counts[1][1] <= counts[8][1] == counts[64][1]  # one group: fewer (no index)
