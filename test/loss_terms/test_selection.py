"""Tests of :mod:`torchrl_grpo.loss_terms.selection` against hand-computed values (the running
example of ``test/helpers/running_example.py``)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.running_example import ADV, MASK, close
from hypothesis import example, given, settings
from hypothesis import strategies as st

from torchrl_grpo.loss_terms import (
    dppo_kl_mask,
    dppo_tv_mask,
    high_entropy_token_mask,
    inference_mismatch,
    masked_quantile,
    off_policy_sequence_mask,
    sequence_veto_mask,
)


class TestOffPolicySequenceMask:
    # per-token drift log pi_old - log pi_theta: row 0: 1, 1 | row 1: 2, 0, (pad) | row 2: 3, 1
    LOGP = torch.tensor([[-2.0, -2.0, 0.0], [-3.0, -1.0, 5.0], [-4.0, -2.0, 0.0]])
    OLD = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, float("nan")], [-1.0, -1.0, 0.0]])
    MASK3 = torch.tensor([[True, True, False], [True, True, False], [True, True, False]])

    def test_hand_values(self):
        # sequence KLs (mean over real tokens): 1, 1, 2; only A < 0 and KL > 1.5 leaves: row 2
        adv = torch.tensor([[-1.0], [1.0], [-0.5]])
        keep = off_policy_sequence_mask(self.LOGP, self.OLD, adv, self.MASK3, 1.5)
        assert keep.tolist() == [[True, True, False], [True, True, False], [False, False, False]]
        # a threshold below 1 drops row 0 too; row 1 (A > 0) always stays
        keep = off_policy_sequence_mask(self.LOGP, self.OLD, adv, self.MASK3, 0.5)
        assert keep[:, 0].tolist() == [False, True, False]

    def test_zero_advantage_stays_and_infinite_threshold_keeps_all(self):
        adv = torch.tensor([[0.0], [-1.0], [-1.0]])
        keep = off_policy_sequence_mask(self.LOGP, self.OLD, adv, self.MASK3, 0.5)
        assert keep[:, 0].tolist() == [True, False, False]
        keep = off_policy_sequence_mask(self.LOGP, self.OLD, adv, self.MASK3, math.inf)
        assert torch.equal(keep, self.MASK3)

    def test_per_token_advantage_sign(self):
        adv = torch.tensor([[1.0, -1.0, 0.0], [1.0, 1.0, 0.0], [-1.0, 1.0, 0.0]])
        keep = off_policy_sequence_mask(self.LOGP, self.OLD, adv, self.MASK3, 1.5)
        assert keep.tolist() == [[True, True, False], [True, True, False], [False, True, False]]

    def test_checks_shapes(self):
        with pytest.raises(ValueError, match=r"advantage has shape \(3,\)"):
            off_policy_sequence_mask(self.LOGP, self.OLD, torch.ones(3), self.MASK3, 1.0)


class TestHighEntropyTokenMask:
    # real entropies 0.1, 2.0, 0.5 | 1.0, 0.2 (9.0 is padding)
    H = torch.tensor([[0.1, 2.0, 0.5], [1.0, 0.2, 9.0]])

    def test_hand_values(self):
        # 1 - rho = 0.6: sorted 0.1 0.2 0.5 1.0 2.0, position 2.4 -> 0.5 + 0.4 * 0.5 = 0.7
        assert high_entropy_token_mask(self.H, MASK, 0.4).tolist() == [
            [False, True, False],
            [True, False, False],
        ]
        # rho = 0.2: position 3.2 -> 1.0 + 0.2 * 1.0 = 1.2: only 2.0
        assert high_entropy_token_mask(self.H, MASK, 0.2).sum() == 1

    def test_extremes_and_ties(self):
        assert torch.equal(high_entropy_token_mask(self.H, MASK, 1.0), MASK)  # every real token
        top = high_entropy_token_mask(self.H, MASK, 0.0)  # the maximum (not the 9.0 pad)
        assert top.tolist() == [[False, True, False], [False, False, False]]
        ties = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
        assert torch.equal(high_entropy_token_mask(ties, MASK, 0.2), MASK)  # all at the threshold

    def test_empty_mask_selects_nothing(self):
        empty = torch.zeros(2, 3, dtype=torch.bool)
        assert not high_entropy_token_mask(self.H, empty, 0.5).any()

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    @pytest.mark.parametrize("as_tensor", [False, True])
    @pytest.mark.parametrize("rho", [0.1, 0.2, 0.25, 0.3, 0.5, 0.7, 0.9])
    def test_threshold_exactly_on_a_token_keeps_it(self, rho, as_tensor, dtype):
        """``(1 - rho) (N - 1)`` a whole number: the threshold is that token's entropy and it
        is kept (TRL's torch.quantile keeps it). 1 - 0.2 in float32 is 0.800000011920929,
        which put the threshold just above the token and dropped it."""
        g = torch.Generator().manual_seed(int(rho * 100))
        for n in (11, 21, 41, 51, 101, 1001):
            entropy = torch.rand(1, n, generator=g, dtype=torch.float64).to(dtype)
            mask = torch.ones(1, n, dtype=torch.bool)
            position = round((1 - rho) * (n - 1))
            if abs((1 - rho) * (n - 1) - position) > 1e-9:
                continue
            level = torch.tensor(rho) if as_tensor else rho  # a scheduled rho is float32
            kept = high_entropy_token_mask(entropy, mask, level)
            threshold = entropy.sort().values[0, position]  # the reference, written out
            assert torch.equal(kept, entropy >= threshold), (n, position)
            assert int(kept.sum()) == n - position

    @settings(max_examples=25, deadline=None)
    @given(seed=st.integers(0, 1000), q=st.floats(0.0, 1.0))
    @example(seed=0, q=1.192092896e-07)  # a position within 1e-6 of 0: interpolated all the same
    def test_masked_quantile_matches_torch_quantile(self, seed, q):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(5, 7, generator=g, dtype=torch.float64)
        mask = torch.rand(5, 7, generator=g) > 0.3
        mask[0, 0] = True
        close(masked_quantile(x, mask, q), torch.quantile(x[mask], q), atol=1e-12)


class TestDPPOMasks:
    # p_old 0.5 everywhere but row 1's second token (0.1); p 0.5, 0.55, 0.75 | 0.25, 0.4
    P_NOW = torch.tensor([[0.5, 0.55, 0.75], [0.25, 0.4, 0.9]])
    P_OLD = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.1, 0.5]])

    def test_tv_hand_values(self):
        # moves +0, +.05, +.25 (A > 0: > .1 masked) | -.25, +.3 (A < 0: < -.1 masked)
        keep = dppo_tv_mask(self.P_NOW.log(), self.P_OLD.log(), ADV, MASK, 0.1, 0.1)
        assert keep.tolist() == [[True, True, False], [False, True, False]]

    def test_kl_hand_values(self):
        d = lambda p, q: q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))  # noqa: E731
        # 0.75 vs 0.5: D = 0.144 (A > 0, rising: masked above 0.1); 0.25 vs 0.5: D = 0.144
        # (A < 0, falling: masked); 0.4 vs 0.1: rising against A < 0: kept whatever D
        assert d(0.75, 0.5) > 0.1 and d(0.55, 0.5) < 0.1
        keep = dppo_kl_mask(self.P_NOW.log(), self.P_OLD.log(), ADV, MASK, 0.1, 0.1)
        assert keep.tolist() == [[True, True, False], [False, True, False]]
        keep = dppo_kl_mask(self.P_NOW.log(), self.P_OLD.log(), ADV, MASK, 0.2, 0.2)
        assert keep.tolist() == [[True, True, True], [True, True, False]]

    def test_zero_advantage_takes_the_negative_branch(self):
        # verl: only A > 0 reads the positive bound; A = 0 is bounded below
        keep = dppo_tv_mask(self.P_NOW.log(), self.P_OLD.log(), torch.zeros(2, 1), MASK, 0.1, 0.1)
        assert keep.tolist() == [[True, True, True], [False, True, False]]


class TestMismatch:
    # rho = pi_old / pi_inference: 2, 1, 1 | 1, 0.5 (the running example's real tokens)
    RHO = torch.tensor([[2.0, 1.0, 1.0], [1.0, 0.5, 7.0]])

    def test_hand_values(self):
        stats = inference_mismatch(self.RHO.log(), MASK)
        close(stats["chi2_token"], (4 + 1 + 1 + 1 + 0.25) / 5 - 1)
        close(stats["chi2_sequence"], (4 + 0.25) / 2 - 1)
        k3 = [2 - 1 - math.log(2), 0.5 - 1 - math.log(0.5)]
        close(stats["seq_max_k3_mean"], sum(k3) / 2)
        close(stats["seq_max_k3_max"], max(k3))

    def test_agreement_is_zero(self):
        stats = inference_mismatch(torch.zeros(2, 3), MASK)
        for value in stats.values():
            close(value, 0.0)

    def test_veto(self):
        keep = sequence_veto_mask(self.RHO.log(), MASK, 0.25)  # k3: 0.307 | 0.193
        assert keep.tolist() == [[False, False, False], [True, True, False]]
        empty = torch.zeros(1, 3, dtype=torch.bool)
        assert not sequence_veto_mask(torch.zeros(1, 3), empty, 0.1).any()
