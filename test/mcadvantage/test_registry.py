"""Tests of torchrl_grpo/mcadvantage/registry.py: which trajectory ids have ended."""

import torch

from torchrl_grpo.mcadvantage.registry import ENDED, GIVEN_UP, RUNNING, IdRegistry


class TestIdRegistry:
    def test_unknown_ids_are_running(self):
        registry = IdRegistry()
        assert registry.status(torch.tensor([0, 10**6])).tolist() == [RUNNING, RUNNING]

    def test_marks_grow_by_doubling_and_stay(self):
        registry = IdRegistry()
        registry.mark(torch.tensor([3]), ENDED)
        assert registry.marks.shape[0] == 4
        registry.mark(torch.tensor([5, 1]), GIVEN_UP)
        assert registry.marks.shape[0] == 8
        assert registry.status(torch.tensor([1, 3, 5, 7])).tolist() == [
            GIVEN_UP,
            ENDED,
            GIVEN_UP,
            RUNNING,
        ]
        registry.mark(torch.tensor([], dtype=torch.long), ENDED)  # nothing to mark
        assert registry.marks.shape[0] == 8
