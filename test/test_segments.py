"""Tests of torchrl_grpo/_segments.py: segment reductions (runs give the numbers of the
per-sample index), the scan behind the discounted returns, and the dense codes of keys."""

import pytest
import torch
from helpers import reference_discounted_returns
from helpers.references import reference_advantage
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrl_grpo._segments import (
    Segments,
    dense_codes,
    dense_codes_and_order,
    discounted_suffix_sum,
)
from torchrl_grpo.advantages import (
    group_mean,
    group_relative_advantage,
    group_std,
    trajectory_returns,
)


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


class TestSegments:
    """Runs (contiguous samples of one group) give the numbers of the per-sample index."""

    @staticmethod
    def runs(lengths, num_groups, seed=0):
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.tensor(lengths)
        run_group = torch.randint(0, num_groups, (lengths.numel(),), generator=gen)
        x = torch.randn(int(lengths.sum()), generator=gen, dtype=torch.float64)
        return x, lengths, run_group, run_group.repeat_interleave(lengths)

    @pytest.mark.parametrize("lengths", [[3, 1, 4, 1, 5], [4, 4, 4, 4], [2], [1, 1, 1]])
    def test_reductions_match_the_index(self, lengths):
        x, lengths, run_group, index = self.runs(lengths, 3)
        by_run, by_sample = Segments(run_group, 3, lengths), Segments(index, 3)
        torch.testing.assert_close(by_run.sum(x), by_sample.sum(x))
        torch.testing.assert_close(by_run.amax(x), by_sample.amax(x))
        torch.testing.assert_close(by_run.last(x), by_sample.last(x))
        assert torch.equal(by_run.count, by_sample.count)
        values = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
        assert torch.equal(by_run.expand(values), by_sample.expand(values))

    @pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
    @pytest.mark.parametrize("baseline", ["mean", "leave_one_out", "pass_at_k"])
    @pytest.mark.parametrize("lengths", [[3, 1, 4, 1, 5, 9, 2, 6], [4] * 8])
    @pytest.mark.parametrize("whiten", [False, True])
    def test_advantage_matches_the_index(self, lengths, baseline, scale_rewards, whiten):
        x, lengths, run_group, index = self.runs(lengths, 3, seed=1)
        kw = dict(baseline=baseline, scale_rewards=scale_rewards, whiten=whiten)
        got = group_relative_advantage(x, run_group, 3, lengths=lengths, **kw)
        torch.testing.assert_close(got, group_relative_advantage(x, index, 3, **kw))
        torch.testing.assert_close(got, reference_advantage(x, index, **kw))
        mean, count = group_mean(x, run_group, 3, lengths=lengths)
        torch.testing.assert_close(mean, group_mean(x, index, 3)[0])
        std = group_std(x, run_group, 3, lengths=lengths)
        torch.testing.assert_close(std, group_std(x, index, 3))

    @pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
    @pytest.mark.parametrize("baseline", ["mean", "leave_one_out", "pass_at_k"])
    @pytest.mark.parametrize("lengths", [[3, 1, 4], [5, 5], [7]])
    def test_one_group(self, lengths, baseline, scale_rewards):
        """A lone group takes plain reductions; same numbers as the definition."""
        x, lengths, _, _ = self.runs(lengths, 1, seed=2)
        runs, index = (
            torch.zeros(lengths.numel(), dtype=torch.long),
            torch.zeros(len(x), dtype=torch.long),
        )
        kw = dict(baseline=baseline, scale_rewards=scale_rewards)
        want = reference_advantage(x, index, **kw)
        torch.testing.assert_close(group_relative_advantage(x, index, 1, **kw), want)
        torch.testing.assert_close(
            group_relative_advantage(x, runs, 1, lengths=lengths, **kw), want
        )
        for reduction in ("sum", "mean", "max", "last"):
            torch.testing.assert_close(
                trajectory_returns(x, None, reduction=reduction, lengths=lengths.sum().reshape(1)),
                trajectory_returns(x, index, reduction=reduction),
            )

    def test_constant_runs_give_exact_zeros(self):
        x = torch.full((10,), 0.1, dtype=torch.float64)
        lengths, run_group = torch.tensor([3, 3, 4]), torch.tensor([0, 0, 0])
        assert (group_relative_advantage(x, run_group, lengths=lengths) == 0).all()

    def test_trajectory_returns_by_lengths(self):
        x, lengths, _, _ = self.runs([3, 1, 4], 1)
        traj = torch.arange(3).repeat_interleave(lengths)
        for reduction in ("sum", "mean", "max", "last"):
            torch.testing.assert_close(
                trajectory_returns(x, None, reduction=reduction, lengths=lengths),
                trajectory_returns(x, traj, reduction=reduction),
            )

    def test_needs_an_index_or_lengths(self):
        with pytest.raises(ValueError, match="index"):
            Segments(None)


# --------------------------------------------------------------------------------------------
# slow references for the estimators beyond GRPO, one group (or trajectory) at a time
# --------------------------------------------------------------------------------------------


class TestDenseCodes:
    @pytest.mark.parametrize(
        "keys",
        [[7, 3, 7, 10], [10**12, -5, 10**12], [0.5, -1.0, 0.5], [True, False, True]],
        ids=["compact", "far apart", "floats", "bools"],
    )
    def test_codes_in_increasing_key_order(self, keys):
        keys = torch.tensor(keys)
        codes, num, order = dense_codes_and_order(keys)
        ranks = {k: r for r, k in enumerate(sorted(set(keys.tolist())))}
        assert codes.tolist() == [ranks[k] for k in keys.tolist()] and num == len(ranks)
        same, count = dense_codes(keys)
        assert torch.equal(same, codes) and count == num
        if order is not None:  # by code, input order within a code
            assert order.tolist() == sorted(range(len(keys)), key=lambda i: (codes[i], i))

    def test_nothing(self):
        assert dense_codes(torch.zeros(0, dtype=torch.long))[1] == 0
