"""Tests of :mod:`torchrl_grpo.loss_terms.aggregations` against hand-computed values (the running
example of ``test/helpers/running_example.py``)."""

from __future__ import annotations

import pytest
import torch
from helpers.running_example import MASK, close, ppo_losses
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrl_grpo.loss_terms import (
    AGGREGATIONS,
    aggregate_seq_mean_token_mean,
    aggregate_seq_mean_token_sum,
    aggregate_seq_mean_token_sum_norm,
    aggregate_token_mean,
    aggregate_token_sum,
)


class TestAggregations:
    # per-token losses of the running example: rows sum to -3.3 (3 tokens) and 4.8 (2 tokens)
    def test_token_mean(self):
        close(aggregate_token_mean(ppo_losses(), MASK), (-3.3 + 4.8) / 5)

    def test_seq_mean_token_mean(self):
        close(aggregate_seq_mean_token_mean(ppo_losses(), MASK), (-3.3 / 3 + 4.8 / 2) / 2)

    def test_seq_mean_token_sum(self):
        close(aggregate_seq_mean_token_sum(ppo_losses(), MASK), (-3.3 + 4.8) / 2)

    def test_seq_mean_token_sum_norm(self):
        close(aggregate_seq_mean_token_sum_norm(ppo_losses(), MASK, max_length=5), 0.75 / 5)
        with pytest.raises(ValueError, match="max_length"):
            aggregate_seq_mean_token_sum_norm(ppo_losses(), MASK, max_length=0)

    def test_registry(self):
        assert set(AGGREGATIONS) == {
            "token_mean",
            "seq_mean_token_mean",
            "seq_mean_token_sum",
            "seq_mean_token_sum_norm",
            "token_sum",
        }

    @pytest.mark.parametrize("name", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
    def test_empty_sequences_and_nan_pads_are_ignored(self, name):
        fn = AGGREGATIONS[name]
        loss = ppo_losses()
        padded = torch.cat([loss, torch.full((1, 3), float("nan"))])  # an all-padding row
        padded = torch.cat([padded, torch.full((3, 2), float("inf"))], 1)  # two pad columns
        mask = torch.cat([MASK, torch.zeros(1, 3, dtype=torch.bool)])
        mask = torch.cat([mask, torch.zeros(3, 2, dtype=torch.bool)], 1)
        close(fn(padded, mask), fn(loss, MASK))

    @settings(max_examples=25, deadline=None)
    @given(perm_seed=st.integers(0, 1000))
    def test_invariant_to_sequence_order(self, perm_seed):
        g = torch.Generator().manual_seed(perm_seed)
        loss = torch.randn(6, 5, generator=g)
        mask = torch.rand(6, 5, generator=g) > 0.4
        mask[0, 0] = True
        perm = torch.randperm(6, generator=g)
        for fn in (
            aggregate_token_mean,
            aggregate_seq_mean_token_mean,
            aggregate_seq_mean_token_sum,
        ):
            close(fn(loss[perm], mask[perm]), fn(loss, mask), atol=1e-5)


class TestTokenSum:
    def test_hand_value(self):
        close(aggregate_token_sum(ppo_losses(), MASK), -3.3 + 4.8)
