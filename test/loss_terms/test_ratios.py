"""Tests of :mod:`torchrl_grpo.loss_terms.ratios` against hand-computed values (the running
example of ``test/helpers/running_example.py``)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.running_example import MASK, RATIO, close

from torchrl_grpo.loss_terms import (
    INFERENCE_CORRECTIONS,
    decoupled_behaviour_weight,
    mask_importance_weight,
    sequence_log_ratio,
    truncate_importance_weight,
    truncated_is_weight,
)


class TestSequenceLogRatio:
    def test_hand_values(self):
        s = sequence_log_ratio(RATIO.log(), MASK).exp()
        # geometric means over real tokens: (1 * 1.1 * 1.5)^(1/3), (0.5 * 4)^(1/2)
        close(s[0], [1.65 ** (1 / 3)] * 3)
        close(s[1], [math.sqrt(2.0)] * 3)

    def test_gradient_is_spread_over_the_real_tokens(self):
        log_ratio = RATIO.log().requires_grad_()
        sequence_log_ratio(log_ratio, MASK)[:, 0].sum().backward()
        close(log_ratio.grad, [[1 / 3, 1 / 3, 1 / 3], [0.5, 0.5, 0.0]])

    def test_empty_sequence_has_ratio_one(self):
        mask = torch.tensor([[True, False], [False, False]])
        close(
            sequence_log_ratio(torch.tensor([[0.3, 5.0], [2.0, 2.0]]), mask), [[0.3, 0.3], [0, 0]]
        )


class TestTruncatedISWeight:
    def test_hand_values(self):
        w = truncated_is_weight(
            torch.tensor([0.6, 0.3, 0.1]).log(), torch.tensor([0.2, 0.3, 0.5]).log(), 2.0
        )
        close(w, [2.0, 1.0, 0.2])

    def test_detached(self):
        old = torch.zeros(2, requires_grad=True)
        assert not truncated_is_weight(old, torch.zeros(2), 2.0).requires_grad


class TestInferenceCorrections:
    # log pi_old - log pi_inference: row 0 ratios 2, 1, 0.25 | row 1 ratios 0.5, 8, (pad: 100)
    LOG_W = torch.tensor([[2.0, 1.0, 0.25], [0.5, 8.0, 100.0]]).log()

    def test_registry(self):
        assert set(INFERENCE_CORRECTIONS) == {
            "token_truncate",
            "token_mask",
            "sequence_truncate",
            "sequence_mask",
        }

    def test_token_truncate(self):
        weight, keep = INFERENCE_CORRECTIONS["token_truncate"](self.LOG_W, MASK, 0.5, 3.0)
        close(weight[0], [2.0, 1.0, 0.5])
        close(weight[1, :2], [0.5, 3.0])
        assert torch.equal(keep, MASK)

    def test_token_truncate_is_tis(self):
        old = torch.tensor([0.6, 0.3, 0.1]).log()
        inference = torch.tensor([0.2, 0.3, 0.5]).log()
        weight, _ = truncate_importance_weight(
            (old - inference)[None], torch.ones(1, 3, dtype=torch.bool), None, 2.0
        )
        torch.testing.assert_close(
            weight[0], truncated_is_weight(old, inference, 2.0), rtol=0, atol=0
        )

    def test_token_mask_icepop_band(self):
        weight, keep = INFERENCE_CORRECTIONS["token_mask"](self.LOG_W, MASK, 0.5, 5.0)
        # 0.25 < 0.5 and 8 > 5 leave; 0.5 (at the bound) stays; the pad is not kept
        assert keep.tolist() == [[True, True, False], [True, False, False]]
        close(weight, [[2.0, 1.0, 0.0], [0.5, 0.0, 0.0]])

    def test_sequence_levels(self):
        # products over the real tokens: row 0: 2 * 1 * 0.25 = 0.5; row 1: 0.5 * 8 = 4
        weight, keep = INFERENCE_CORRECTIONS["sequence_truncate"](self.LOG_W, MASK, None, 3.0)
        close(weight, [[0.5] * 3, [3.0] * 3])
        assert torch.equal(keep, MASK)
        weight, keep = INFERENCE_CORRECTIONS["sequence_mask"](self.LOG_W, MASK, None, 3.0)
        close(weight, [[0.5] * 3, [0.0] * 3])
        assert keep.tolist() == [[True, True, True], [False, False, False]]
        _, keep = mask_importance_weight(self.LOG_W, MASK, 0.6, None, level="sequence")
        assert keep.tolist() == [[False, False, False], [True, True, False]]

    def test_equal_log_probs_give_weight_one(self):
        for name, fn in INFERENCE_CORRECTIONS.items():
            weight, keep = fn(torch.zeros(2, 3), MASK, 0.5, 3.0)
            assert torch.equal(keep, MASK), name
            close(weight[MASK], [1.0] * 5)

    def test_weights_are_detached_and_shapes_checked(self):
        log_w = self.LOG_W.clone().requires_grad_()
        for fn in INFERENCE_CORRECTIONS.values():
            assert not fn(log_w, MASK, None, 3.0)[0].requires_grad
        with pytest.raises(ValueError, match=r"mask has shape \(2, 2\)"):
            truncate_importance_weight(self.LOG_W, MASK[:, :2], None, 3.0)
        with pytest.raises(ValueError, match="level must be one of"):
            mask_importance_weight(self.LOG_W, MASK, None, 3.0, level="group")


class TestDecoupledBehaviourWeight:
    def test_hand_values(self):
        prox = torch.tensor([[0.3, 0.6, 0.9]]).log()
        behav = torch.tensor([[0.6, 0.3, 0.1]]).log()
        weight, keep = decoupled_behaviour_weight(prox, behav)
        close(weight, [[0.5, 2.0, 9.0]], atol=1e-5)
        assert keep.all()
        weight, keep = decoupled_behaviour_weight(prox, behav, cap=3.0)  # 9 > 3 leaves
        close(weight, [[0.5, 2.0, 0.0]], atol=1e-5)
        assert keep.tolist() == [[True, True, False]]

    def test_proximal_equal_to_behaviour_is_weight_one(self):
        lp = torch.randn(2, 3)
        weight, keep = decoupled_behaviour_weight(lp, lp.clone(), cap=1.5)
        assert (weight == 1).all() and keep.all()

    def test_detached(self):
        prox = torch.zeros(2, requires_grad=True)
        assert not decoupled_behaviour_weight(prox, torch.zeros(2))[0].requires_grad
