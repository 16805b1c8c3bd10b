"""Tests of the shape checks the loss terms share (a per-sequence tensor never broadcasts)."""

from __future__ import annotations

import pytest
import torch

from torchrl_grpo.loss_terms import off_policy_sequence_mask
from torchrl_grpo.loss_terms._shapes import check_same_rank, check_same_shape


def test_a_per_sequence_tensor_against_tokens_raises():
    with pytest.raises(ValueError, match=r"same number of dimensions.*\(B, 1\)"):
        check_same_rank("advantage", torch.zeros(4), "log_ratio", torch.zeros(4, 3))
    with pytest.raises(ValueError, match="does not broadcast"):
        check_same_rank("advantage", torch.zeros(2, 1), "log_ratio", torch.zeros(4, 3))
    check_same_rank("advantage", torch.zeros(4, 1), "log_ratio", torch.zeros(4, 3))


def test_shapes_must_be_equal():
    with pytest.raises(ValueError, match="log_prob has shape .* but mask has shape"):
        check_same_shape(mask=torch.zeros(2, 3), log_prob=torch.zeros(2, 4))
    check_same_shape(mask=torch.zeros(2, 3), log_prob=torch.zeros(2, 3))


def test_a_term_rejects_a_flat_advantage():
    # a (B,) advantage against (B, T) log-probs would silently broadcast into (B, B)
    lp, mask = torch.zeros(4, 3), torch.ones(4, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="advantage has shape"):
        off_policy_sequence_mask(lp, lp, torch.zeros(4), mask, 0.5)
