"""Tests of torchrl_grpo/mcadvantage/pending.py: the store of pending trajectories."""

import torch
from helpers import (
    trajectory,
)
from helpers.states import hold, read, uids

from torchrl_grpo.mcadvantage import pending as pending_
from torchrl_grpo.mcadvantage.records import NO_VERSION, Pending, Returns


def returns_of(batch, start=0.0):
    n = batch.num_trajectories
    value = torch.arange(n, dtype=torch.float64) + start
    return Returns(value, None)


class TestHoldAndGather:
    def test_an_insertion_is_held_as_it_came(self):
        batch = read(trajectory(1, [1.0, 2.0]), trajectory(2, [3.0]))
        state = hold(Pending(), batch)
        assert state.chunks.steps == (batch.steps,)
        assert state.chunks.steps[0].data is batch.steps.data  # no copy
        unknown = NO_VERSION  # no policy version in these steps
        assert state.spans.tolist() == [[0, 0, 2, 0, unknown], [0, 2, 1, 0, unknown]]
        assert state.ids.values.tolist() == [[1], [2]]
        assert state.returns.value.tolist() == [10.0 * 0, 1.0]

    def test_gather_in_arrival_order_across_chunks(self):
        a, b = trajectory(1, [1.0, 2.0]), trajectory(2, [3.0])
        c, d = trajectory(1, [4.0]), trajectory(3, [5.0, 6.0])
        state = hold(hold(Pending(), read(a, b)), read(c))
        incoming = read(d, state=state)
        out = pending_.gather(state, incoming, torch.tensor([0, 2, 3]))
        assert uids(out) == a["uid"].tolist() + c["uid"].tolist() + d["uid"].tolist()
        assert pending_.gather(Pending(), incoming, torch.tensor([0])) is incoming.steps

    def test_few_and_many_trajectories_gather_alike(self):
        trajs = [trajectory(g % 5, [float(g)] * (g % 3 + 1)) for g in range(60)]
        state = Pending()
        for i in range(0, 60, 3):
            state = hold(state, read(*trajs[i : i + 3]))
        few = torch.tensor([1, 7, 30])  # one slice per trajectory
        many = torch.arange(0, 60, 1)  # one take per chunk
        assert uids(pending_.gather(state, None, few)) == [
            u for j in few.tolist() for u in trajs[j]["uid"].tolist()
        ]
        assert uids(pending_.gather(state, None, many)) == torch.cat(trajs)["uid"].tolist()

    def test_ragged_fallback_when_step_shapes_differ_between_insertions(self):
        """Two insertions whose steps differ in shape (a reward of 1, then of 2 elements per
        step) cannot be concatenated: the steps come out ragged, as copies of the steps."""
        narrow = trajectory(1, [1.0, 2.0])
        wide = trajectory(1, [[3.0, 4.0]])
        state = hold(Pending(), read(narrow))
        out = pending_.gather(state, read(wide), torch.tensor([0, 1]))
        assert out.ragged and uids(out) == narrow["uid"].tolist() + wide["uid"].tolist()
        assert [tuple(step["next", "reward"].shape) for step in out.data] == [(1,), (1,), (2,)]
        out.data[0]["next", "reward"] += 1  # copies: the held chunk is untouched
        assert narrow["next", "reward"][0].item() == 1.0
        stacked = pending_.trajectory(state, read(wide), 1)
        assert stacked.batch_size == (1,) and stacked[0]["next", "reward"].tolist() == [3.0, 4.0]


class TestRemainingAndDrop:
    def test_release_everything(self):
        batch = read(trajectory(1, [1.0]), trajectory(1, [2.0]))
        consumed = torch.ones(2, dtype=torch.bool)
        new = pending_.remaining(Pending(), batch, consumed, returns_of(batch), 4)
        assert new.num_pending == 0 and new.chunks.steps == ()

    def test_partly_consumed_insertion(self):
        a, b, c = trajectory(1, [1.0]), trajectory(2, [2.0, 3.0]), trajectory(1, [4.0])
        state = hold(Pending(), read(a))
        batch = read(b, c, state=state)
        consumed = torch.tensor([True, False, True])  # a and c form a round
        new = pending_.remaining(state, batch, consumed, returns_of(batch, 5.0), 1)
        assert uids(pending_.gather(new, None, torch.arange(new.num_pending))) == b["uid"].tolist()
        assert new.ids.values.tolist() == [[2]] and new.returns.value.tolist() == [5.0]
        assert new.chunks.steps[0] is None and new.chunks.sizes[0] == 0  # a's chunk was let go

    def test_dropped_chunks_are_released_and_slots_renumbered(self):
        state = Pending()
        for g in range(100):  # one chunk per trajectory
            state = hold(state, read(trajectory(g, [float(g)])))
        keep = torch.zeros(100, dtype=torch.bool)
        keep[[3, 50, 99]] = True
        new = pending_.drop(state, keep)
        assert len(new.chunks.steps) == 3 and None not in new.chunks.steps  # renumbered
        assert new.spans[:, 0].tolist() == [0, 1, 2]
        assert new.ids.values.flatten().tolist() == [3, 50, 99]
        assert uids(pending_.gather(new, None, torch.arange(3))) == [
            int(state.chunks.steps[c].data["uid"]) for c in (3, 50, 99)
        ]
        keep = torch.ones(100, dtype=torch.bool)
        keep[7] = False
        few = pending_.drop(state, keep)
        assert few.chunks.steps[7] is None and len(few.chunks.steps) == 100  # not renumbered

    def test_compaction_once_released_steps_outnumber_the_held_ones(self):
        big = torch.cat([trajectory(g, [1.0] * 3) for g in range(600)])  # 1800 steps
        state = hold(Pending(), read(big))
        batch = read(trajectory(10**6, [1.0]), state=state)
        consumed = torch.ones(601, dtype=torch.bool)
        consumed[[5, 600]] = False  # one held trajectory of the big chunk, and the newcomer
        new = pending_.remaining(state, batch, consumed, returns_of(batch), 1)
        assert new.chunks.sizes == (4,) and len(new.chunks.steps) == 1  # rebuilt from the live
        assert uids(new.chunks.steps[0]) == big["uid"][15:18].tolist() + uids(batch.steps)
