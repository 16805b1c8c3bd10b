"""Tests of torchrl_grpo/loss/variants/objectives.py: each objective's properties are attributes
(the dual clip applies, the ratio level it needs), names resolve through OBJECTIVES, and VESPO
reports TRL's phi."""

from __future__ import annotations

import pytest
import torch
from helpers.loss import every_entry_batch, token_policy

from torchrl_grpo.loss import GRPOLoss, VESPOLoss
from torchrl_grpo.loss.variants import CISPO, SAPO, VESPO, Clip, CustomObjective
from torchrl_grpo.loss.variants.objectives import objective_from_name
from torchrl_grpo.loss_terms import OBJECTIVES, cispo_loss, vespo_phi_sequence_mean


def test_properties_are_attributes():
    assert Clip().dual_clip and CustomObjective(cispo_loss).dual_clip
    assert not (CISPO().dual_clip or SAPO().dual_clip or VESPO().dual_clip)
    assert VESPO().ratio_levels == ("sequence_sum",) and Clip().ratio_levels is None


def test_names_resolve_through_the_registry():
    assert objective_from_name("clip") == Clip() and objective_from_name("sapo") == SAPO()
    OBJECTIVES["mine"] = cispo_loss  # a name registered by a user: a custom objective
    try:
        assert objective_from_name("mine") == CustomObjective(cispo_loss)
    finally:
        del OBJECTIVES["mine"]
    with pytest.raises(ValueError, match="Unknown objective 'ppo2'"):
        objective_from_name("ppo2")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Clip(clip_ratio_c=3.0, delta=4.0), "pass one"),
        (lambda: Clip(delta=1.0), "delta must be greater than 1"),
        (lambda: SAPO(temperature_neg=0.0), "temperatures must be positive"),
        (lambda: VESPO(k=(1.0, -1.0)), "non-negative"),
    ],
)
def test_settings_are_checked_when_built(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_vespo_needs_the_product_of_the_ratios():
    with pytest.raises(ValueError, match="ratio_level='sequence_sum'"):
        GRPOLoss(token_policy(), objective=VESPO())
    GRPOLoss(token_policy(), objective=VESPO(), ratio_level="sequence_sum")


def test_a_custom_objective_takes_the_dual_clip():
    batch = every_entry_batch()
    losses = [
        GRPOLoss(token_policy(), objective=objective, entropy_coeff=0.0)
        for objective in (CustomObjective(OBJECTIVES["clip"], clip_ratio_c=1.5), Clip(1.5))
    ]
    for loss in losses:
        loss.set_keys(sample_log_prob="tokens_log_prob")
    torch.testing.assert_close(losses[0](batch).loss_objective, losses[1](batch).loss_objective)
    assert losses[0].clip_ratio_c.item() == 1.5


def test_vespo_reports_trls_phi():
    batch = every_entry_batch()
    loss = VESPOLoss(token_policy())
    loss.set_keys(sample_log_prob="tokens_log_prob")
    out = loss(batch)
    assert "vespo_phi_seq_mean" in loss.out_keys
    dist = token_policy().get_dist(batch)
    log_ratio = dist.log_prob(batch["tokens"]).detach() - batch["tokens_log_prob"]
    log_ratio = torch.where(batch["mask"], log_ratio, 0.0)
    expected = vespo_phi_sequence_mean(log_ratio, batch["advantage"][:, None], batch["mask"])
    torch.testing.assert_close(out.vespo_phi_seq_mean, expected)
    assert 0 < float(expected) and not torch.isclose(expected, torch.tensor(1.0))


def test_the_names_are_a_view_of_the_classes():
    from torchrl_grpo.loss.variants.objectives import OBJECTIVE_CLASSES

    for cls in OBJECTIVE_CLASSES:  # each built-in class computes the function of its name
        name = cls.title.lower()
        assert name in OBJECTIVES and objective_from_name(name) == cls()
    assert {cls.title.lower() for cls in OBJECTIVE_CLASSES} == set(OBJECTIVES)
