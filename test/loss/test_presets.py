"""Tests of torchrl_grpo/loss/presets.py: the papers' defaults, under the caller's keywords."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from helpers.loss import (
    P,
    known_batch,
    known_policy,
    outputs_and_grads,
    response_values,
    token_batch,
    token_policy,
)

from torchrl_grpo.loss import (
    CISPOLoss,
    DAPOLoss,
    DrGRPOLoss,
    GRPOLoss,
    GSPOLoss,
    SAPOLoss,
)
from torchrl_grpo.loss.variants import SAPO

PRESETS = [DAPOLoss, DrGRPOLoss, GSPOLoss, CISPOLoss, SAPOLoss]


class TestDAPOLoss:
    def test_defaults(self):
        dapo = DAPOLoss(token_policy())
        assert (dapo.clip_epsilon_low.item(), dapo.clip_epsilon_high.item()) == pytest.approx(
            (0.2, 0.28)
        )

    def test_is_grpo_with_the_paper_defaults(self):
        policy, batch = token_policy(), token_batch()
        grpo = GRPOLoss(
            policy, clip_epsilon=(0.2, 0.28), aggregation="token_mean", entropy_coeff=0.0
        )
        expected, expected_grads = outputs_and_grads(grpo, batch)
        out, grads = outputs_and_grads(DAPOLoss(policy), batch)
        for key, value in expected.items():
            torch.testing.assert_close(out.get(key), value, rtol=0, atol=0, msg=key)
        for a, b in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)

    def test_the_caller_keywords_win(self):
        loss = DAPOLoss(token_policy(), clip_epsilon=0.1, entropy_coeff=0.5)
        assert loss.clip_epsilon.item() == pytest.approx(0.1)
        assert loss.entropy_coeff.item() == pytest.approx(0.5)
        assert DAPOLoss(token_policy()).clip_epsilon_high.item() == pytest.approx(0.28)


class TestDrGRPOLoss:
    def test_max_length_is_required(self):
        policy = token_policy()
        with pytest.raises(
            TypeError, match="missing 1 required keyword-only argument: 'max_length'"
        ):
            DrGRPOLoss(policy)
        assert DrGRPOLoss(policy, max_length=8).entropy_coeff.item() == 0.0
        assert (
            inspect.signature(DrGRPOLoss).parameters["max_length"].default
            is inspect.Parameter.empty
        )


class TestGSPOLoss:
    def test_defaults(self):
        gspo = GSPOLoss(token_policy())
        assert (gspo.clip_epsilon_low.item(), gspo.clip_epsilon_high.item()) == pytest.approx(
            (3e-4, 4e-4)
        )

    def test_gspo_clip_fraction_counts_tokens(self):
        out = GSPOLoss(known_policy())(known_batch())
        assert out.clip_fraction_high.item() == 1.0 and out.clip_fraction_low.item() == 0.0


class TestCISPOLoss:
    def test_defaults(self):
        cispo = CISPOLoss(token_policy())
        low, high = cispo.clip_bounds
        assert low.item() == -math.inf and high.exp().item() == pytest.approx(4.0)

    def test_cispo_gradient_reaches_clipped_tokens(self):
        # with a 1.2 cap, r = 1.5 and r = 4 are clipped; each token's d loss / d log p is
        # -clip(r) A / N, nonzero for every real token and zero on the pad
        batch = known_batch()
        batch["logits"].requires_grad_()
        loss = CISPOLoss(known_policy(), clip_epsilon=(1.0, 0.2))
        loss(batch).loss_objective.backward()
        p = torch.tensor(P)
        # d log p / d logit_0 = 1 - p for token 0 (logit_1 gets -(1 - p))
        weights = torch.tensor([[1.0, 1.1, 1.2], [-0.5, -1.2, 0.0]])
        expected = -weights * (1 - p) / 5
        torch.testing.assert_close(batch["logits"].grad[..., 0], expected)


class TestSAPOLoss:
    def test_sapo_preset(self):
        loss = SAPOLoss(token_policy())
        assert loss.objective == SAPO(temperature_pos=1.0, temperature_neg=1.05)
        assert loss.entropy_coeff.item() == 0.0
        custom = SAPOLoss(token_policy(), sapo_temperature_neg=2.0)
        assert custom.objective.temperature_neg == 2.0

    def test_sapo_from_the_scorer_log_probs(self, tiny_llm, make_llm_batch, make_llm_scorer):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        scorer = make_llm_scorer(model, tokenizer)
        out = SAPOLoss(scorer)(batch.copy())
        means = []  # per response: token mean of -(4 / tau) sigmoid(tau (r - 1)) A
        for (lp, old), adv in zip(
            response_values(batch, scorer, ("log_probs", "full")), batch["advantage"].flatten()
        ):
            tau = 1.0 if adv > 0 else 1.05
            means.append((-(4 / tau) * torch.sigmoid(tau * ((lp - old).exp() - 1)) * adv).mean())
        torch.testing.assert_close(
            out.loss_objective, torch.stack(means).mean().detach(), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("preset", PRESETS, ids=lambda cls: cls.__name__)
def test_signature_is_grpo_loss_with_the_preset_defaults(preset):
    grpo = inspect.signature(GRPOLoss).parameters
    ours = inspect.signature(preset).parameters
    assert list(ours) == list(grpo)
    for name, parameter in ours.items():
        if name in preset.required:
            continue
        assert parameter.default == preset.defaults.get(name, grpo[name].default), name


def test_an_instance_is_called_as_a_grpo_loss():
    # the presets' constructor signature is the class's only, not the instances' call's
    called = inspect.signature(DAPOLoss(token_policy()))
    assert called == inspect.signature(GRPOLoss(token_policy()))
    assert "clip_epsilon" not in called.parameters
