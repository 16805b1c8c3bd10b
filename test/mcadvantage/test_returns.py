"""Tests of torchrl_grpo/mcadvantage/returns.py: returns in float64 and as torchrl computes them."""

import pytest
import torch
from helpers import (
    trajectory,
)
from helpers.states import KEYS

from torchrl_grpo.mcadvantage.read import read_insertion
from torchrl_grpo.mcadvantage.records import Pending, Returns
from torchrl_grpo.mcadvantage.returns import concat, insertion_returns, take, torchrl_returns


class TestTorchRLReturns:
    @pytest.mark.parametrize("mode", ["sum", "mean", "max", "last"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_each_rounds_as_torchrl_reduces_one_trajectory(self, mode, dtype):
        gen = torch.Generator().manual_seed(0)
        for lengths in ([3] * 5, [1, 7, 3, 7, 2, 1, 30]):
            rewards = [torch.randn(n, 1, generator=gen).to(dtype) / 7 for n in lengths]
            got = torchrl_returns(torch.cat(rewards).reshape(-1), torch.tensor(lengths), mode)
            reduce = {
                "sum": lambda r: r.sum(),
                "mean": lambda r: r.mean(),
                "max": lambda r: r.max(),
                "last": lambda r: r.reshape(-1)[-1],
            }[mode]
            want = torch.stack([reduce(r) for r in rewards])
            assert got.dtype == dtype and torch.equal(got, want)

    def test_float64_returns_for_the_advantage(self):
        batch = read_insertion(
            torch.cat([trajectory(0, [0.1] * 3), trajectory(0, [2.0])]), KEYS, Pending()
        )
        got = insertion_returns(batch, "sum", exact=False).value
        assert got.dtype == torch.float64
        assert got.tolist() == [3 * float(torch.tensor(0.1)), 2.0]
        assert insertion_returns(batch, None, exact=False).value.tolist() == [0.0, 0.0]
        exact = insertion_returns(batch, "sum", exact=True).torchrl
        assert exact.dtype == torch.float32 and torch.allclose(exact.double(), got)


class TestConcatAndTake:
    def test_pending_then_incoming(self):
        pending = Returns(torch.tensor([1.0], dtype=torch.float64), torch.tensor([1.0]))
        incoming = Returns(torch.tensor([2.0, 3.0], dtype=torch.float64), torch.tensor([2.0, 3.0]))
        both = concat(pending, incoming)
        assert both.value.tolist() == [1.0, 2.0, 3.0] and both.torchrl.tolist() == [1.0, 2.0, 3.0]
        assert concat(Returns(torch.zeros(0, dtype=torch.float64), None), incoming) is incoming
        picked = take(both, torch.tensor([2, 0]))
        assert picked.value.tolist() == [3.0, 1.0] and picked.torchrl.tolist() == [3.0, 1.0]

    def test_without_torchrl_returns(self):
        value = Returns(torch.tensor([1.0, 2.0], dtype=torch.float64), None)
        assert (
            concat(value, value).torchrl is None and take(value, torch.tensor([1])).torchrl is None
        )
