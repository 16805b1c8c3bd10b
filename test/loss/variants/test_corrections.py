"""Tests of torchrl_grpo/loss/variants/corrections.py: verl's rejection as a variant (its tokens
leave the denominator), DPPO's capped fraction, the perplexities reported with the mismatch
statistics, and the checks each correction makes when built."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.loss import every_entry_batch, token_policy

from torchrl_grpo.loss import DPPOLoss, GRPOLoss
from torchrl_grpo.loss.variants import (
    TIS,
    InferenceCorrection,
    InferenceVeto,
    Rejection,
    TrustRegion,
)
from torchrl_grpo.loss_terms import (
    dppo_truncation_fraction,
    dppo_tv_mask,
    perplexity_metrics,
    rejection_mask,
)


def per_token_and_batch(**kwargs):
    batch = every_entry_batch(drift=1.0)
    plain = GRPOLoss(token_policy(), entropy_coeff=0.0, reduction="none")
    plain.set_keys(sample_log_prob="tokens_log_prob")
    return plain(batch).loss_objective, batch


@pytest.mark.parametrize(
    "modes, thresholds",
    [("token_k1", "0.5_2.0"), ("seq_mean_k3", 0.3), ("token_k2,seq_max_k2", 1.0)],
)
def test_rejected_tokens_leave_the_loss_and_its_denominator(modes, thresholds):
    per_token, batch = per_token_and_batch()
    loss = GRPOLoss(token_policy(), entropy_coeff=0.0, corrections=[Rejection(modes, thresholds)])
    loss.set_keys(sample_log_prob="tokens_log_prob")
    out = loss(batch)
    log_weight = batch["tokens_log_prob"] - batch["inference_log_prob"]
    keep = rejection_mask(log_weight, batch["mask"], modes, thresholds) & batch["mask"]
    assert 0 < keep.sum() < batch["mask"].sum()  # some rejected, some kept
    torch.testing.assert_close(out.loss_objective, per_token[keep].sum() / keep.sum())
    torch.testing.assert_close(
        out.inference_rejected_fraction, 1 - keep.sum() / batch["mask"].sum()
    )
    assert "inference_log_prob" in loss.in_keys


def test_rejection_modes_are_checked_when_built():
    with pytest.raises(ValueError):
        Rejection("token_k4", 2.0)
    with pytest.raises(ValueError):
        Rejection("token_k3", "0.5_2.0")  # a band is for k1 modes only


def test_dppo_reports_verls_capped_fraction():
    batch = every_entry_batch(drift=1.0)
    loss = DPPOLoss(token_policy(), clip_epsilon=(1.0, 0.5))  # the weight capped at 1.5
    loss.set_keys(sample_log_prob="tokens_log_prob")
    out = loss(batch)
    dist = token_policy().get_dist(batch)
    lp = dist.log_prob(batch["tokens"]).detach()
    old, adv, mask = batch["tokens_log_prob"], batch["advantage"][:, None], batch["mask"]
    keep = dppo_tv_mask(torch.where(mask, lp, 0), torch.where(mask, old, 0), adv, mask, 0.15, 0.15)
    log_ratio = torch.where(mask, lp - old, 0.0)
    expected = dppo_truncation_fraction(log_ratio, keep, mask, 1.5)
    torch.testing.assert_close(out.trust_region_capped_fraction, expected)
    assert 0 < float(expected) < 1


def test_perplexities_come_with_the_mismatch_statistics():
    batch = every_entry_batch()
    loss = GRPOLoss(token_policy(), corrections=[TIS(2.0)])
    loss.set_keys(sample_log_prob="tokens_log_prob")
    out = loss(batch)
    mask = batch["mask"]
    old = torch.where(mask, batch["tokens_log_prob"], 0.0)
    inference = torch.where(mask, batch["inference_log_prob"], 0.0)
    expected = perplexity_metrics(old, inference, mask)
    for name in ("rollout_ppl", "training_ppl", "log_ppl_diff", "ppl_ratio"):
        torch.testing.assert_close(out[f"inference_{name}"], expected[name])
    assert "inference_ppl_ratio" in loss.out_keys
    assert "inference_ppl_ratio" not in GRPOLoss(token_policy()).out_keys


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: InferenceCorrection("token_clip"), "Unknown inference_correction"),
        (lambda: InferenceCorrection("token_mask", (2.0, 1.0)), "low < high"),
        (lambda: InferenceCorrection("token_mask", (None, 0.0)), "high > 0"),
        (lambda: TrustRegion(lambda *args: args[-3]), "needs trust_region_bounds"),
        (lambda: TrustRegion("dppo_tv", 0.0), "trust_region_low must be positive"),
        (lambda: InferenceVeto(math.nan), "inference_veto_threshold must be positive"),
        (lambda: TIS(0.0), "tis_cap must be positive"),
    ],
)
def test_settings_are_checked_when_built(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_the_band_defaults_to_trls():
    assert InferenceCorrection("token_mask").bounds == (None, 3.0)
    assert TrustRegion("dppo_kl").bounds == (0.05, 0.05)
