"""Tests of torchrl_grpo/loss/variants/base.py: a variant declares what it reads, checks,
schedules and reports; a new one is one class, and the loss composes it with nothing else."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from helpers.loss import every_entry_batch, token_policy

from torchrl_grpo.loss import GRPOLoss
from torchrl_grpo.loss.variants import TIS, Step, Variant
from torchrl_grpo.loss.variants.base import RANGES, check_range, masked_fraction


@dataclass(frozen=True)
class SmallAdvantageFilter(Variant):
    """Sequences whose |A| is below a bound leave the loss (a variant of the test's own)."""

    bound: float
    slot: ClassVar[str] = "small_advantage"
    stage: ClassVar[str] = "exclude"
    ranges: ClassVar[dict] = {"small_advantage_bound": ("non-negative", 0.0)}

    def buffers(self):
        return {"small_advantage_bound": self.bound}

    def metrics(self):
        return ("small_advantage_fraction",)

    def exclude(self, values, step: Step):
        keep = step.x.advantage.abs() >= values.small_advantage_bound
        return keep, {"small_advantage_fraction": masked_fraction(keep, step.x)}


def test_check_range():
    check_range("tis_cap", None)  # off
    with pytest.raises(ValueError, match="tis_cap must be positive, got nan"):
        check_range("tis_cap", math.nan)
    with pytest.raises(ValueError, match=r"top_entropy_quantile must be in \[0, 1\]"):
        check_range("top_entropy_quantile", 1.5)


def test_a_new_variant_is_one_class():
    assert RANGES["small_advantage_bound"] == ("non-negative", 0.0)  # registered by the class
    batch = every_entry_batch()
    loss = GRPOLoss(token_policy(), entropy_coeff=0.0, corrections=[SmallAdvantageFilter(0.5)])
    loss.set_keys(sample_log_prob="tokens_log_prob")
    out = loss(batch)
    assert "small_advantage_fraction" in loss.out_keys
    # by hand: the token mean of the plain per-token loss over the rows with |A| >= 0.5
    plain = GRPOLoss(token_policy(), entropy_coeff=0.0, reduction="none")
    plain.set_keys(sample_log_prob="tokens_log_prob")
    per_token = plain(batch).loss_objective
    keep = batch["mask"] & (batch["advantage"].abs() >= 0.5)[:, None]
    assert 0 < keep.sum() < batch["mask"].sum()
    expected = per_token[keep].sum() / keep.sum()
    torch.testing.assert_close(out.loss_objective, expected)
    dropped = 1 - keep.sum() / batch["mask"].sum()
    torch.testing.assert_close(out.small_advantage_fraction, dropped)
    loss.small_advantage_bound = 10.0  # schedulable: every sequence leaves the loss
    assert loss(batch).loss_objective.item() == 0.0
    with pytest.raises(ValueError, match="small_advantage_bound must be non-negative"):
        loss.small_advantage_bound = -1.0


def test_a_variant_left_off_stays_off():
    loss = GRPOLoss(token_policy(), corrections=[TIS(2.0)])
    loss.tis_cap = 1.5
    with pytest.raises(ValueError, match="off_policy_mask_threshold was off"):
        loss.off_policy_mask_threshold = 0.1


def test_the_loss_holds_one_variant_a_slot():
    with pytest.raises(ValueError, match="one variant of a kind"):
        GRPOLoss(token_policy(), corrections=[TIS(2.0), TIS(3.0)])
    with pytest.raises(TypeError, match="corrections= takes variants"):
        GRPOLoss(token_policy(), corrections=[0.1])
