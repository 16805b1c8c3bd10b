"""Tests of torchrl_grpo/sampler.py: GroupSampler on torchrl's ReplayBuffer and storages."""

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from torchrl.data import LazyStackStorage, LazyTensorStorage, ListStorage, ReplayBuffer

from torchrl_grpo import GroupSampler
from torchrl_grpo.sampler import group_minibatches


def _buffer(sizes, batch_size, storage=LazyTensorStorage, key="group", **kwargs):
    """A buffer holding groups of the given sizes, each row's group at ``key``."""
    groups = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    rb = ReplayBuffer(
        storage=storage(len(groups)),
        sampler=GroupSampler(key, **kwargs),
        batch_size=batch_size,
    )
    rb.extend(TensorDict({key: groups, "row": torch.arange(len(groups))}, batch_size=[len(groups)]))
    return rb


class TestGroupSampler:
    def test_an_epoch_sees_every_row_once_in_whole_groups(self):
        rb = _buffer([4] * 6, batch_size=8)
        epoch = list(rb)
        assert [len(b) for b in epoch] == [8, 8, 8]
        assert sorted(torch.cat([b["row"] for b in epoch]).tolist()) == list(range(24))
        for batch in epoch:
            for g in batch["group"].unique():
                assert int((batch["group"] == g).sum()) == 4

    def test_epochs_are_shuffled_and_seeded_by_the_buffer(self):
        torch.manual_seed(0)
        orders = [
            tuple(b["group"][0].item() for b in _buffer([2] * 8, batch_size=2)) for _ in range(2)
        ]
        assert orders[0] != orders[1]
        rb = _buffer([2] * 8, batch_size=2, shuffle=False)
        assert [b["group"][0].item() for b in rb] == list(range(8))

    def test_groups_of_different_sizes_are_packed_whole(self):
        rb = _buffer([3, 1, 5, 2, 4], batch_size=6, shuffle=False)
        epoch = list(rb)
        assert [b["group"].tolist() for b in epoch] == [
            [0, 0, 0, 1],
            [2, 2, 2, 2, 2],
            [3, 3, 4, 4, 4, 4],
        ]

    def test_a_group_larger_than_a_minibatch_warns_and_spans_consecutive_ones(self):
        rb = _buffer([5, 2], batch_size=4, shuffle=False)
        with pytest.warns(UserWarning, match="a group of 5 rows is larger than batch_size=4"):
            epoch = list(rb)
        assert [b["group"].tolist() for b in epoch] == [[0, 0, 0, 0], [0, 1, 1]]

    def test_next_epoch_and_new_data_restart(self):
        rb = _buffer([2] * 4, batch_size=4, storage=lambda n: LazyTensorStorage(2 * n))
        assert len(list(rb)) == 2 and len(list(rb)) == 2  # a second epoch
        rb.sample()  # half an epoch, then new rows: the next epoch covers all of them
        rb.extend(TensorDict(group=torch.full((2,), 9), row=torch.tensor([8, 9]), batch_size=[2]))
        rows = torch.cat([b["row"] for b in rb]).tolist()
        assert sorted(rows) == list(range(10))

    def test_string_keys_in_a_lazy_stack_storage(self):
        rows = [TensorDict(query="ab"[i % 2], row=torch.tensor(i)) for i in range(6)]
        rb = ReplayBuffer(storage=LazyStackStorage(6), sampler=GroupSampler("query"), batch_size=3)
        rb.extend(lazy_stack(rows))
        epoch = list(rb)
        assert len(epoch) == 2
        for batch in epoch:
            assert len(set(batch.get("query").tolist())) == 1

    def test_state_dict_resumes_the_epoch(self, tmp_path):
        rb = _buffer([2] * 4, batch_size=2)
        first = rb.sample()
        sampler = rb._sampler
        state = sampler.state_dict()
        sampler.dumps(tmp_path)
        rest = [b["row"].tolist() for b in rb]
        restored = GroupSampler("group")
        restored.loads(tmp_path)
        assert restored.state_dict() == state
        again = [restored.sample(rb._storage, 2)[0].tolist() for _ in range(3)]
        assert again == rest and restored.ran_out
        assert sorted(first["row"].tolist() + sum(rest, [])) == list(range(8))

    def test_errors_name_the_problem(self):
        with pytest.raises(KeyError, match="no 'prompt'"):
            GroupSampler("prompt").sample(_buffer([2, 2], batch_size=2)._storage, 2)
        rb = ReplayBuffer(storage=ListStorage(4), sampler=GroupSampler("g"), batch_size=2)
        rb.extend([1, 2, 3, 4])
        with pytest.raises(TypeError, match="not tensor collections"):
            rb.sample()
        empty = ReplayBuffer(storage=LazyTensorStorage(4), sampler=GroupSampler("g"), batch_size=2)
        with pytest.raises(RuntimeError):
            empty.sample()


class TestGroupMinibatches:
    def test_whole_groups_in_first_seen_order(self):
        batches = group_minibatches(["a", "b", "a", "c", "b", "c", "a"], 4, shuffle=False)
        assert [b.tolist() for b in batches] == [[0, 2, 6], [1, 4, 3, 5]]

    def test_tensor_rows_as_keys_and_a_seeded_shuffle(self):
        prompts = [torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([1, 2]), torch.tensor([3])]
        one = group_minibatches(prompts, 2, generator=torch.Generator().manual_seed(1))
        two = group_minibatches(prompts, 2, generator=torch.Generator().manual_seed(1))
        assert [b.tolist() for b in one] == [b.tolist() for b in two]
        assert sorted(sorted(b.tolist()) for b in one) == [[0, 2], [1, 3]]

    @pytest.mark.parametrize("bad", [0, -1, 2.0, True])
    def test_bad_batch_size(self, bad):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            group_minibatches([0, 0], bad)

    def test_ragged_prompts_of_a_lazy_stack_storage_are_the_groups(self):
        prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
        rows = [
            TensorDict({("tokens", "prompt"): prompts[i % 2], "row": torch.tensor(i)})
            for i in range(6)
        ]
        rb = ReplayBuffer(
            storage=LazyStackStorage(6), sampler=GroupSampler(("tokens", "prompt")), batch_size=3
        )
        rb.extend(lazy_stack(rows))
        for batch in rb:
            assert (
                len({tuple(p.tolist()) for p in batch.get(("tokens", "prompt"), as_list=True)}) == 1
            )
