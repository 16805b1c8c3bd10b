"""Tests of :mod:`torchrl_grpo.loss_terms.diagnostics` against hand-computed values (the running
example of ``test/helpers/running_example.py``)."""

from __future__ import annotations

import math

import torch
from helpers.running_example import HIGH, LOW, MASK, RATIO, close

from torchrl_grpo.loss_terms import (
    clip_fractions,
    effective_sample_size,
    masked_mean,
)


class TestDiagnostics:
    def test_masked_mean_ignores_nan_padding(self):
        close(masked_mean(torch.tensor([[1.0, float("nan")]]), torch.tensor([[True, False]])), 1.0)

    def test_effective_sample_size(self):
        # weights 1, 1.1, 1.5, 0.5, 4.0 over the real tokens: (sum w)^2 / sum w^2 / N
        expected = 8.1**2 / (1 + 1.21 + 2.25 + 0.25 + 16) / 5
        close(effective_sample_size(RATIO.log(), MASK), expected)

    def test_effective_sample_size_on_policy_is_one(self):
        assert effective_sample_size(torch.zeros(2, 3), MASK).item() == 1.0  # exactly, N = 5

    def test_effective_sample_size_large_log_weights(self):
        # weights e^100 and e^101: the ratio only depends on their quotient e
        expected = (1 + math.e) ** 2 / (2 * (1 + math.e**2))
        close(
            effective_sample_size(
                torch.tensor([[100.0, 101.0]]), torch.ones(1, 2, dtype=torch.bool)
            ),
            expected,
        )

    def test_clip_fractions(self):
        total, low, high = clip_fractions(RATIO.log(), MASK, LOW, HIGH)
        # real ratios 1.0, 1.1, 1.5, 0.5, 4.0: 0.5 below, 1.5 and 4.0 above
        close(low, 0.2)
        close(high, 0.4)
        close(total, 0.6)
