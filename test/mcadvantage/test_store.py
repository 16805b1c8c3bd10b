"""Tests of torchrl_grpo/mcadvantage/store.py: the chunked store of held steps."""

import torch
from tensordict import TensorDict

from torchrl_grpo.mcadvantage.steps import DenseSteps
from torchrl_grpo.mcadvantage.store import LENIENT, Chunks, ranges


def chunk(values):
    values = torch.tensor(values)
    return DenseSteps(TensorDict(value=values, batch_size=[len(values)]))


def spans(*rows):
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)


def values(steps):
    return steps.data["value"].tolist()


class TestRanges:
    def test_concatenated_aranges(self):
        assert ranges(torch.tensor([5, 0, 9]), torch.tensor([2, 3, 0])).tolist() == [5, 6, 0, 1, 2]


class TestChunks:
    def store(self):
        return Chunks().add(chunk([0, 1, 2, 3])).add(chunk([10, 11])).add(chunk([20, 21, 22]))

    def test_add_counts_the_steps(self):
        store = self.store()
        assert store.sizes == (4, 2, 3) and store.held == 9 and len(store.steps) == 3

    def test_gather_in_any_order(self):
        store = self.store()
        assert values(store.gather(spans([2, 1, 2], [0, 0, 1]))) == [21, 22, 0]  # few: views
        assert store.gather(spans([1, 0, 2])).data is store.steps[1].data  # a whole chunk
        many = spans(*[[c, 0, 1] for c in (2, 0, 1, 0)] * 10)  # many: one take per chunk
        assert values(store.gather(many)) == [20, 0, 10, 0] * 10

    def test_parts_in_chunk_order(self):
        store = self.store()
        rows = spans(*[[0, i, 1] for i in range(4)] * 9, [1, 0, 2])
        parts = store.parts(rows)
        assert [values(p) for p in parts] == [[0, 1, 2, 3] * 9, [10, 11]]

    def test_take_whole_or_per_chunk(self):
        store = self.store()
        got = store.take(torch.tensor([2, 0, 2, 1]), torch.tensor([2, 3, 0, 1]))
        assert values(got) == [22, 3, 20, 11]
        big = Chunks().add(chunk(list(range(20000)))).add(chunk([7]))
        got = big.take(torch.tensor([1, 0]), torch.tensor([0, 19999]))  # per chunk, reordered
        assert values(got) == [7, 19999]

    def test_tidy_releases_and_renumbers(self):
        store = Chunks()
        for c in range(100):
            store = store.add(chunk([c]))
        held = spans([3, 0, 1], [99, 0, 1])
        dropped = torch.tensor([c for c in range(100) if c not in (3, 99)])
        tidy, renumbered = store.tidy(held, dropped)
        assert len(tidy.steps) == 2 and renumbered[:, 0].tolist() == [0, 1]
        assert values(tidy.gather(renumbered)) == [3, 99]
        few, same = store.tidy(spans(*[[c, 0, 1] for c in range(100) if c != 7]), torch.tensor([7]))
        assert few.steps[7] is None and few.sizes[7] == 0 and len(few.steps) == 100
        assert torch.equal(same, spans(*[[c, 0, 1] for c in range(100) if c != 7]))

    def test_tidy_rebuilds_once_released_steps_outnumber_the_live(self):
        store = Chunks().add(chunk(list(range(3000)))).add(chunk([7]))
        live = spans([0, 10, 2], [1, 0, 1])
        rebuilt, moved = store.tidy(live)
        assert rebuilt.sizes == (3,) and moved.tolist() == [[0, 0, 2], [0, 2, 1]]
        assert values(rebuilt.steps[0]) == [10, 11, 7]
        lenient, same = store.tidy(live, rebuild_above=LENIENT)  # 3001 < 4 * 3 + 16384
        assert lenient is store and same is live

    def test_nothing_held(self):
        empty, rows = self.store().tidy(spans())
        assert empty == Chunks() and rows.shape == (0, 3)
