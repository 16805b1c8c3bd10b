"""Tests of torchrl_grpo/loss/variants/base.py: a variant declares what it reads, checks,
schedules and reports; a new one is one class of its stage, and the loss composes it with
nothing else (no global registry: its buffers are on the losses that hold it only)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from helpers.loss import every_entry_batch, token_policy

from torchrl_grpo.loss import GRPOLoss
from torchrl_grpo.loss.variants import (
    TIS,
    Exclusion,
    Factor,
    Objective,
    Penalty,
    Step,
    builtin_ranges,
)
from torchrl_grpo.loss.variants.base import check_range, masked_fraction
from torchrl_grpo.loss_terms import masked_mean


@dataclass(frozen=True)
class SmallAdvantageFilter(Exclusion):
    """Sequences whose |A| is below a bound leave the loss (a variant of the test's own)."""

    bound: float
    slot: ClassVar[str] = "small_advantage"
    ranges: ClassVar[dict] = {"small_advantage_bound": ("non-negative", 0.0)}

    def buffers(self):
        return {"small_advantage_bound": self.bound}

    def metrics(self):
        return ("small_advantage_fraction",)

    def exclude(self, step: Step):
        keep = step.x.advantage.abs() >= step.values["small_advantage_bound"]
        return keep, {"small_advantage_fraction": masked_fraction(keep, step.x)}


@dataclass(frozen=True)
class StoredWeight(Factor):
    """Each token's objective times a weight stored in the batch under a key of its own."""

    slot: ClassVar[str] = "stored_weight"
    reads: ClassVar[tuple[str, ...]] = ("my_weight",)

    def factor(self, step: Step):
        return step.x.entries["my_weight"], None, {}


@dataclass(frozen=True)
class LengthPenalty(Penalty):
    """A term of its own: ``coeff`` times the mean stored length, read per sequence."""

    coeff: float
    slot: ClassVar[str] = "length"
    reads: ClassVar[tuple[str, ...]] = ("length",)
    ranges: ClassVar[dict] = {"length_coeff": ("non-negative", 0.0)}

    def buffers(self):
        return {"length_coeff": self.coeff}

    def metrics(self):
        return ("loss_length",)

    def terms(self, step: Step, reduce):
        return {"loss_length": step.values["length_coeff"] * reduce(step.x.entries["length"])}


def test_check_range():
    ranges = builtin_ranges()  # the package's own variants'
    check_range("tis_cap", None, ranges)  # off
    with pytest.raises(ValueError, match="tis_cap must be positive, got nan"):
        check_range("tis_cap", math.nan, ranges)
    with pytest.raises(ValueError, match=r"top_entropy_quantile must be in \[0, 1\]"):
        check_range("top_entropy_quantile", 1.5, ranges)
    with pytest.raises(ValueError, match="small_advantage_bound must be non-negative"):
        check_range("small_advantage_bound", -1.0, SmallAdvantageFilter.ranges)


def test_a_new_variant_is_one_class():
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


def test_a_variants_ranges_are_the_losses_that_hold_it():
    # the class is defined (above): a loss without it has no buffer, no range, no attribute
    assert "small_advantage_bound" not in builtin_ranges()
    loss = GRPOLoss(token_policy())
    assert "small_advantage_bound" not in loss._buffers
    assert "small_advantage_bound" not in dict(loss.named_buffers())
    assert not hasattr(loss, "small_advantage_bound")
    held = GRPOLoss(token_policy(), corrections=[SmallAdvantageFilter(0.5)])
    assert held.small_advantage_bound.item() == 0.5
    assert "small_advantage_bound" in held.state_dict()


def test_a_variant_reads_a_new_entry_with_no_edit_elsewhere():
    batch = every_entry_batch()
    weight = torch.rand(batch["mask"].shape) + 0.5  # (B, T), a key no built-in reads
    batch["my_weight"] = weight
    loss = GRPOLoss(token_policy(), entropy_coeff=0.0, corrections=[StoredWeight()])
    loss.set_keys(sample_log_prob="tokens_log_prob")
    assert "my_weight" in loss.in_keys
    out = loss(batch)
    plain = GRPOLoss(token_policy(), entropy_coeff=0.0, reduction="none")
    plain.set_keys(sample_log_prob="tokens_log_prob")
    per_token = plain(batch).loss_objective
    mask = batch["mask"]
    expected = (per_token * weight)[mask].sum() / mask.sum()
    torch.testing.assert_close(out.loss_objective, expected)
    with pytest.raises(KeyError, match=r"'my_weight' \(read by StoredWeight\)"):
        loss(batch.exclude("my_weight"))


def test_a_penalty_reads_a_per_sequence_entry():
    batch = every_entry_batch()
    length = torch.arange(1.0, batch.shape[0] + 1)  # (B,): one value a sequence
    batch["length"] = length
    loss = GRPOLoss(token_policy(), penalties=[LengthPenalty(0.5)])
    loss.set_keys(sample_log_prob="tokens_log_prob")
    out = loss(batch)
    mask = batch["mask"]
    spread = torch.where(mask, length[:, None], 0.0)
    torch.testing.assert_close(out.loss_length, 0.5 * masked_mean(spread, mask))
    loss.length_coeff = 0.0
    assert loss(batch).loss_length.item() == 0.0


@dataclass(frozen=True)
class ScaledReinforce(Objective):
    """A surrogate of the test's own: REINFORCE on the ratio, scaled per token by a stored entry."""

    title: ClassVar[str] = "scaled"
    reads: ClassVar[tuple[str, ...]] = ("scale",)

    def loss(self, step: Step, log_ratio):
        return -step.x.entries["scale"] * log_ratio.exp() * step.x.advantage


def test_an_objective_of_ones_own_reads_its_entry():
    batch = every_entry_batch()
    batch["scale"] = torch.rand(batch["mask"].shape)
    loss = GRPOLoss(token_policy(), entropy_coeff=0.0, objective=ScaledReinforce())
    loss.set_keys(sample_log_prob="tokens_log_prob")
    assert "scale" in loss.in_keys
    out = loss(batch)
    log_prob = token_policy().get_dist(batch).log_prob(batch["tokens"])
    ratio = (log_prob - batch["tokens_log_prob"]).exp()
    mask = batch["mask"]
    per_token = -batch["scale"] * ratio * batch["advantage"][:, None]
    torch.testing.assert_close(out.loss_objective, per_token[mask].sum() / mask.sum())


def test_the_hooks_have_defaults():
    step = Step(x=None, ratio_base=None)
    coeff = torch.tensor(0.1)

    @dataclass(frozen=True)
    class Nothing(Penalty):
        slot: ClassVar[str] = "nothing"

    assert Nothing().terms(step, None) == {} and Nothing().coefficient(step, coeff) is coeff
    for stage, hook in ((Exclusion, "exclude"), (Factor, "factor")):
        with pytest.raises(NotImplementedError, match=f"defines no {hook}"):
            getattr(stage(), hook)(step)
    with pytest.raises(NotImplementedError, match="defines no loss"):
        Objective().loss(step, None)
    assert Objective().report(step) == {}


def test_a_variant_left_off_stays_off():
    loss = GRPOLoss(token_policy(), corrections=[TIS(2.0)])
    loss.tis_cap = 1.5
    with pytest.raises(ValueError, match="off_policy_mask_threshold was off.*OffPolicyMask"):
        loss.off_policy_mask_threshold = 0.1


def test_the_loss_holds_one_variant_a_slot():
    with pytest.raises(ValueError, match="one variant of a kind"):
        GRPOLoss(token_policy(), corrections=[TIS(2.0), TIS(3.0)])
    with pytest.raises(TypeError, match="corrections= takes variants"):
        GRPOLoss(token_policy(), corrections=[0.1])
    with pytest.raises(TypeError, match="stage .* is Exclusion or Factor"):
        GRPOLoss(token_policy(), corrections=[LengthPenalty(0.1)])
