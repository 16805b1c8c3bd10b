"""Tests of torchrl_grpo/mcadvantage/ids.py: group ids, prompts or tensors."""

import pytest
import torch
from helpers.states import ids_of

from torchrl_grpo.mcadvantage.ids import PromptIds, TensorIds, ids_from_plain


class TestCodes:
    @pytest.mark.parametrize(
        "ids",
        [
            [3, 1, 3, 2, 1],  # compact integers: no sort
            [10**12, -5, 10**12, 7],  # far apart: sorted
            [0.5, -1.5, 0.5],  # floats
            [[1, 2], [2, 1], [1, 2]],  # several values per id
            ["b", "a", "b"],  # prompts
        ],
    )
    def test_equal_codes_iff_equal_ids(self, ids):
        pending, incoming = ids[:2], ids[2:]
        codes, order = ids_of(incoming).codes(ids_of(pending))
        assert sorted(set(codes.tolist())) == list(range(len({str(i) for i in ids})))
        for a in range(len(ids)):
            for b in range(len(ids)):
                assert (codes[a] == codes[b]) == (ids[a] == ids[b])
        if order is not None:  # by code, arrival order within a code
            assert codes[order].tolist() == sorted(codes.tolist())
            for c in set(codes.tolist()):
                positions = [int(j) for j in order if codes[j] == c]
                assert positions == sorted(positions)

    def test_nothing_pending(self):
        codes, _ = ids_of([4, 4, 9]).codes()
        assert codes.tolist() == [0, 0, 1]


class TestTensorIds:
    def test_rows_compared_by_value(self):
        ids = TensorIds(torch.tensor([[1, 2], [3, 4], [1, 2]]))
        assert ids.width == 2 and len(ids) == 3 and ids.kind == "tensors"
        assert ids.same_as(TensorIds(torch.tensor([[1, 2]]))).tolist() == [True, False, True]
        assert sorted(ids.counts()) == [1, 2]
        assert ids.python() == [(1, 2), (3, 4), (1, 2)]
        assert TensorIds(torch.tensor([[7], [8]])).python() == [7, 8]

    def test_select_and_cat_keep_the_pending_dtype(self):
        held = TensorIds(torch.tensor([[1], [2], [3]]))
        assert held.select(torch.tensor([0, 2])).values.tolist() == [[1], [3]]
        joined = held.cat(TensorIds(torch.tensor([[4]], dtype=torch.int32)))
        assert joined.values.dtype == torch.int64 and joined.values.flatten().tolist() == [
            1,
            2,
            3,
            4,
        ]

    @pytest.mark.parametrize("values", [[5, -3, 5, 2**40, 5, -3], [0.5, -0.0, 0.5, 1e30, 0.5, 0.0]])
    def test_counts_of_single_values(self, values):
        ids = TensorIds(torch.tensor(values).reshape(-1, 1))
        expected = torch.unique(ids.values, dim=0, return_counts=True)[1].tolist()
        assert sorted(ids.counts()) == sorted(expected) == [1, 2, 3]

    def test_nothing_pending_counts_nothing(self):
        assert TensorIds(torch.zeros(0, 1, dtype=torch.long)).counts() == []


class TestPromptIds:
    def test_strings(self):
        ids = PromptIds(["a", "b", "a"])
        assert len(ids) == 3 and ids.kind == "strings"
        assert ids.same_as(PromptIds(["a"])).tolist() == [True, False, True]
        assert ids.counts() == [2, 1] and ids.python() == ["a", "b", "a"]
        assert ids.select(torch.tensor([1])).values == ["b"]
        assert ids.cat(PromptIds(["c"])).values == ["a", "b", "a", "c"]

    def test_codes_are_in_first_arrival_order(self):
        codes, order = PromptIds(["y", "x"]).codes(PromptIds(["x"]))
        assert codes.tolist() == [0, 1, 0] and codes.dtype == torch.long and order is None


class TestCheckpointForm:
    @pytest.mark.parametrize(
        "ids",
        [TensorIds(torch.tensor([[5], [6]])), PromptIds(["p", "q"])],
        ids=["tensors", "strings"],
    )
    def test_round_trip(self, ids):
        back = ids_from_plain(ids.to_plain())
        assert type(back) is type(ids) and back.python() == ids.python()

    def test_nothing_held(self):
        assert ids_from_plain(None) is None
