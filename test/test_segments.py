"""Tests of torchrl_grpo/_segments.py: the scan behind the discounted returns.

``Segments``' reductions are checked against the per-sample index in ``test_advantages.py``,
where they serve the public estimators.
"""

import pytest
import torch
from helpers import reference_discounted_returns
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrl_grpo._segments import discounted_suffix_sum


class TestDiscountedSuffixSum:
    def test_by_hand(self):
        x = torch.tensor([1.0, 2.0, 4.0, 8.0, 3.0], dtype=torch.float64)
        out = discounted_suffix_sum(x, torch.tensor([3, 1, 1]), 0.5)
        assert out.tolist() == [1 + 1 + 1, 2 + 2, 4.0, 8.0, 3.0]

    @pytest.mark.parametrize("lengths", [[3, 1, 4, 1, 5], [1], [6], [2, 7, 1, 16, 17]])
    @pytest.mark.parametrize("gamma", [0.0, 0.5, 0.95, 1.0])
    def test_matches_a_loop(self, lengths, gamma):
        x = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(0)).double()
        out = discounted_suffix_sum(x, torch.tensor(lengths), gamma)
        torch.testing.assert_close(out, reference_discounted_returns(x.tolist(), lengths, gamma))

    @pytest.mark.parametrize(
        "lengths, gamma",
        [
            ([8] * 5, 0.9),  # one width: the scaled cumsum over rows
            ([60] * 3, 0.01),  # one width, gamma^59 < 1e-100: the scan
            ([3, 5, 4, 6], 0.9),  # ragged, padded rows: the scaled cumsum
            ([1] * 20 + [100], 0.9),  # ragged, padding would be 17x the samples: the scan
            ([3, 60, 5], 0.01),  # ragged, gamma^59 < 1e-100: the scan
        ],
    )
    def test_each_form(self, lengths, gamma):
        x = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(1)).double()
        want = reference_discounted_returns(x.tolist(), lengths, gamma)
        width = lengths[0] if len(set(lengths)) == 1 else 0
        got = discounted_suffix_sum(x, torch.tensor(lengths), gamma, width=width)
        torch.testing.assert_close(got, want)

    def test_large_rewards_stay_finite(self):
        x = torch.tensor([1e200, -1e200, 1e200], dtype=torch.float64)
        got = discounted_suffix_sum(x, torch.tensor([3]), 0.5, width=3)
        torch.testing.assert_close(got, reference_discounted_returns(x.tolist(), [3], 0.5))

    @settings(max_examples=40, deadline=None)
    @given(
        width=st.integers(1, 33),
        runs=st.integers(1, 6),
        gamma=st.floats(0.0, 1.0),
        seed=st.integers(0, 2**16),
    )
    def test_rows_of_one_width_take_the_same_numbers(self, width, runs, gamma, seed):
        x = torch.randn(width * runs, generator=torch.Generator().manual_seed(seed)).double()
        lengths = torch.full((runs,), width)
        rows = discounted_suffix_sum(x, lengths, gamma, width=width)
        flat = discounted_suffix_sum(x, lengths, gamma)
        torch.testing.assert_close(rows, flat)
        torch.testing.assert_close(
            rows, reference_discounted_returns(x.tolist(), [width] * runs, gamma)
        )

    def test_empty(self):
        assert (
            discounted_suffix_sum(torch.zeros(0), torch.zeros(0, dtype=torch.long), 0.9).numel()
            == 0
        )
