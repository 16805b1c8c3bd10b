"""Tests of torchrl_grpo/_pending.py: the store of pending trajectories."""

import io

import pytest
import torch
from helpers import trajectory
from tensordict import NonTensorData, TensorDict, lazy_stack

from torchrl_grpo import _pending
from torchrl_grpo._pending import Pending, Returns, evolve
from torchrl_grpo._reading import Keys, read_insertion

KEYS = Keys(group="seed", reward=("next", "reward"), done=("next", "done"), advantage="advantage")


def read(*trajs, state=None):
    return read_insertion(torch.cat(trajs), KEYS, state or Pending())


def returns_of(batch, start=0.0):
    n = batch.num_trajectories
    value = torch.arange(n, dtype=torch.float64) + start
    return Returns(value, None)


def hold(state, batch):
    """``state`` with the whole insertion ``batch`` queued (nothing released)."""
    return _pending.remaining(state, batch, None, returns_of(batch, 10.0 * state.num_pending))


def uids(data):
    if isinstance(data, list):
        return [int(step["uid"]) for step in data]
    return data["uid"].tolist()


class TestEvolve:
    def test_replaces_fields_and_keeps_the_old_state(self):
        state = Pending(stats={"a": 1})
        new = evolve(state, insertions=3, stats={"a": 2})
        assert (new.insertions, new.stats, state.insertions, state.stats) == (
            3,
            {"a": 2},
            0,
            {"a": 1},
        )

    def test_a_misspelled_field_is_an_error(self):
        with pytest.raises(TypeError, match="Pending has no field 'insertion'"):
            evolve(Pending(), insertion=3)


class TestHoldAndGather:
    def test_an_insertion_is_held_as_it_came(self):
        batch = read(trajectory(1, [1.0, 2.0]), trajectory(2, [3.0]))
        state = hold(Pending(), batch)
        assert state.chunks == [batch.data] and state.chunks[0] is batch.data  # no copy
        assert state.spans.tolist() == [[0, 0, 2, 0], [0, 2, 1, 0]]
        assert state.keys.tolist() == [[1], [2]] and state.returns.tolist() == [10.0 * 0, 1.0]

    def test_gather_in_arrival_order_across_chunks(self):
        a, b = trajectory(1, [1.0, 2.0]), trajectory(2, [3.0])
        c, d = trajectory(1, [4.0]), trajectory(3, [5.0, 6.0])
        state = hold(hold(Pending(), read(a, b)), read(c))
        incoming = read(d, state=state)
        out = _pending.gather(state, incoming, torch.tensor([0, 2, 3]))
        assert uids(out) == uids(a) + uids(c) + uids(d)
        assert _pending.gather(Pending(), incoming, torch.tensor([0])) is incoming.data

    def test_few_and_many_trajectories_gather_alike(self):
        trajs = [trajectory(g % 5, [float(g)] * (g % 3 + 1)) for g in range(60)]
        state = Pending()
        for i in range(0, 60, 3):
            state = hold(state, read(*trajs[i : i + 3]))
        few = torch.tensor([1, 7, 30])  # one slice per trajectory
        many = torch.arange(0, 60, 1)  # one take per chunk
        assert uids(_pending.gather(state, None, few)) == [
            u for j in few.tolist() for u in trajs[j]["uid"].tolist()
        ]
        assert uids(_pending.gather(state, None, many)) == torch.cat(trajs)["uid"].tolist()

    def test_ragged_fallback_when_step_shapes_differ_between_insertions(self):
        """Two insertions whose steps differ in shape (a reward of 1, then of 2 elements per
        step) cannot be concatenated: the steps come out as a list of step copies."""
        narrow = trajectory(1, [1.0, 2.0])
        wide = trajectory(1, [[3.0, 4.0]])
        state = hold(Pending(), read(narrow))
        out = _pending.gather(state, read(wide), torch.tensor([0, 1]))
        assert isinstance(out, list) and uids(out) == uids(narrow) + uids(wide)
        assert [tuple(step["next", "reward"].shape) for step in out] == [(1,), (1,), (2,)]
        out[0]["next", "reward"] += 1  # copies: the held chunk is untouched
        assert narrow["next", "reward"][0].item() == 1.0
        stacked = _pending.trajectory(state, read(wide), 1)
        assert stacked.batch_size == (1,) and stacked[0]["next", "reward"].tolist() == [3.0, 4.0]


class TestRemainingAndDrop:
    def test_release_everything(self):
        batch = read(trajectory(1, [1.0]), trajectory(1, [2.0]))
        new = _pending.remaining(
            Pending(insertions=4), batch, torch.ones(2, dtype=torch.bool), returns_of(batch)
        )
        assert new.num_pending == 0 and new.insertions == 4 and new.chunks == []

    def test_partly_consumed_insertion(self):
        a, b, c = trajectory(1, [1.0]), trajectory(2, [2.0, 3.0]), trajectory(1, [4.0])
        state = hold(Pending(), read(a))
        batch = read(b, c, state=state)
        consumed = torch.tensor([True, False, True])  # a and c form a round
        new = _pending.remaining(state, batch, consumed, returns_of(batch, 5.0))
        assert uids(_pending.gather(new, None, torch.arange(new.num_pending))) == uids(b)
        assert new.keys.tolist() == [[2]] and new.returns.tolist() == [5.0]
        assert new.chunks[0] is None and new.chunk_sizes[0] == 0  # a's chunk was let go

    def test_dropped_chunks_are_released_and_slots_renumbered(self):
        state = Pending()
        for g in range(100):  # one chunk per trajectory
            state = hold(state, read(trajectory(g, [float(g)])))
        keep = torch.zeros(100, dtype=torch.bool)
        keep[[3, 50, 99]] = True
        new = _pending.drop(state, keep)
        assert len(new.chunks) == 3 and None not in new.chunks  # mostly empty: renumbered
        assert new.chunk.tolist() == [0, 1, 2] and new.keys.flatten().tolist() == [3, 50, 99]
        assert uids(_pending.gather(new, None, torch.arange(3))) == [
            int(state.chunks[c]["uid"]) for c in (3, 50, 99)
        ]
        keep = torch.ones(100, dtype=torch.bool)
        keep[7] = False
        few = _pending.drop(state, keep)
        assert few.chunks[7] is None and len(few.chunks) == 100  # one slot: not renumbered

    def test_compaction_once_released_steps_outnumber_the_held_ones(self):
        big = torch.cat([trajectory(g, [1.0] * 3) for g in range(600)])  # 1800 steps
        state = hold(Pending(), read(big))
        batch = read(trajectory(10**6, [1.0]), state=state)
        consumed = torch.ones(601, dtype=torch.bool)
        consumed[[5, 600]] = False  # one held trajectory of the big chunk, and the newcomer
        new = _pending.remaining(state, batch, consumed, returns_of(batch))
        assert new.chunk_sizes == [4] and len(new.chunks) == 1  # rebuilt from the live steps
        assert uids(new.chunks[0]) == big["uid"][15:18].tolist() + uids(batch.data)


class TestCheckpointForm:
    def test_round_trip_through_weights_only_torch_load(self):
        a, b = trajectory(1, [1.0, 2.0]), trajectory(2, [3.0])
        state = hold(hold(Pending(stats={"written_groups": 2}, insertions=1), read(a)), read(b))
        state = evolve(state, torchrl_returns=state.returns.float())
        buffer = io.BytesIO()
        torch.save(_pending.to_plain(state), buffer)
        buffer.seek(0)
        back = _pending.from_plain(torch.load(buffer, weights_only=True))
        assert back.spans.tolist() == [[0, 0, 2, 1], [0, 2, 1, 1]]  # one chunk, arrivals kept
        assert torch.equal(back.keys, state.keys) and torch.equal(back.returns, state.returns)
        assert torch.equal(back.torchrl_returns, state.torchrl_returns)
        assert (back.stats, back.insertions) == (state.stats, state.insertions)
        assert uids(_pending.gather(back, None, torch.arange(2))) == uids(a) + uids(b)

    def test_ragged_steps_and_prompts(self):
        steps = [
            TensorDict(
                query=NonTensorData("p"),
                uid=torch.tensor(n),
                tokens=torch.arange(n),
                next=TensorDict(reward=torch.ones(n, 1), done=torch.tensor([True])),
            )
            for n in (2, 3)
        ]
        batch = read_insertion(lazy_stack(steps), KEYS._replace(group="query"), Pending())
        state = hold(Pending(), batch)
        back = _pending.from_plain(_pending.to_plain(state))
        assert back.ragged and back.keys == ["p", "p"]
        assert [s["tokens"].tolist() for s in _pending.gather(back, None, torch.arange(2))] == [
            [0, 1],
            [0, 1, 2],
        ]

    def test_a_checkpoint_without_torchrl_returns(self):
        """Checkpoints written before the reward-dtype returns were kept load; their float64
        returns stand in for them."""
        state = hold(Pending(), read(trajectory(1, [0.5])))
        plain = _pending.to_plain(state)
        del plain["torchrl_returns"]
        back = _pending.from_plain(plain)
        assert back.torchrl_returns is None
        incoming = Returns(torch.tensor([2.0], dtype=torch.float64), torch.tensor([2.0]))
        both = _pending.concat(_pending.returns_of(back), incoming)
        assert both.torchrl.tolist() == [0.0, 2.0] and both.torchrl.dtype == torch.float32
