"""Tests of torchrl_grpo/loss/variants/penalties.py: the KL penalties and the adaptive entropy
as objects, their state in the loss's state_dict, their checks."""

from __future__ import annotations

import pytest
import torch
from helpers.loss import every_entry_batch, token_policy

from torchrl_grpo.loss import GRPOLoss
from torchrl_grpo.loss.variants import EntropyTarget, KLToInference, KLToReference
from torchrl_grpo.loss_terms import kl_k2, masked_mean


def test_the_kl_to_the_reference_by_hand():
    batch = every_entry_batch()
    loss = GRPOLoss(token_policy(), penalties=[KLToReference(0.5, estimator="k2")])
    loss.set_keys(sample_log_prob="tokens_log_prob")
    out = loss(batch)
    lp = token_policy().get_dist(batch).log_prob(batch["tokens"]).detach()
    mask = batch["mask"]
    kl = kl_k2(torch.where(mask, lp, 0.0), torch.where(mask, batch["ref_log_prob"], 0.0))
    torch.testing.assert_close(out.kl_to_ref, masked_mean(kl, mask))
    torch.testing.assert_close(out.loss_kl_to_ref.detach(), 0.5 * masked_mean(kl, mask))
    assert "ref_log_prob" in loss.in_keys and "inference_log_prob" not in loss.in_keys
    loss.kl_to_ref_coeff = 0.0  # schedulable
    assert loss(batch).loss_kl_to_ref.item() == 0.0


def test_the_kl_to_inference_falls_back_on_the_sampler():
    batch = every_entry_batch().exclude("inference_log_prob")
    loss = GRPOLoss(token_policy(), penalties=[KLToInference(0.1)])
    loss.set_keys(sample_log_prob="tokens_log_prob")
    assert "inference_log_prob" not in loss.in_keys
    assert loss(batch).kl_to_inference.item() > 0


def test_the_entropy_target_state_is_saved():
    batch = every_entry_batch()
    loss = GRPOLoss(token_policy(), entropy_coeff=0.1, penalties=[EntropyTarget(5.0)])
    loss.set_keys(sample_log_prob="tokens_log_prob")
    loss(batch).total_loss().backward()
    coeff = loss.update_entropy_coeff()
    assert coeff == pytest.approx(0.105)  # the entropy is below 5 nats: up by one step
    state = loss.state_dict()
    assert "adaptive_entropy.window" in state and "adaptive_entropy.last_entropy" in state
    again = GRPOLoss(token_policy(), entropy_coeff=0.1, penalties=[EntropyTarget(5.0)])
    again.load_state_dict(state)
    assert again.entropy_coeff.item() == pytest.approx(0.105)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"penalties": [KLToReference(0.1)], "corrections": [KLToInference(0.1)]}, "stage"),
        ({"penalties": [EntropyTarget(0.5)], "entropy_bonus": False}, "entropy_bonus=True"),
    ],
)
def test_bad_compositions(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        GRPOLoss(token_policy(), **kwargs)


def test_settings_are_checked_when_built():
    with pytest.raises(ValueError, match="Unknown KL estimator"):
        KLToReference(0.1, estimator="k4")
    with pytest.raises(ValueError, match="kl_to_ref_coeff must be non-negative"):
        KLToReference(-0.1)
    with pytest.raises(ValueError, match="step > 0"):
        EntropyTarget(0.5, step=0.0)
