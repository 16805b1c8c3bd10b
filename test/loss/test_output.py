"""Tests of torchrl_grpo/loss/output.py: GRPOLossOutput read as torchrl's trainers read a loss."""

from __future__ import annotations

import pytest
import torch
from helpers.loss import (
    cartpole_actor,
    cartpole_batch,
)

from torchrl_grpo.loss import (
    GRPOLoss,
)


class TestGRPOLossOutput:
    def test_string_indexing_and_items(self):
        actor = cartpole_actor()
        out = GRPOLoss(actor, kl_to_ref_coeff=None)(cartpole_batch(actor))
        assert out["loss_objective"] is out.loss_objective
        assert dict(out.items())["ESS"] is out.ESS
        with pytest.raises(KeyError, match="'loss_kl_to_ref' is not set"):
            out["loss_kl_to_ref"]

    def test_mean_reduce_is_the_total_loss(self):
        """torchrl's recipe backpropagates ``loss.mean(reduce=True)``: it must not depend on
        how many metrics the output carries."""
        actor = cartpole_actor()
        batch = cartpole_batch(actor)
        loss = GRPOLoss(actor, entropy_coeff=0.05)
        params = list(actor.parameters())
        out = loss(batch.clone())
        total = out.loss_objective + out.loss_entropy
        torch.testing.assert_close(out.mean(reduce=True), total)
        by_mean = torch.autograd.grad(out.mean(reduce=True), params, retain_graph=True)
        by_sum = torch.autograd.grad(total, params)
        for a, b in zip(by_mean, by_sum, strict=True):
            torch.testing.assert_close(a, b)
        # other reductions keep TensorDict's meaning
        assert out.mean().loss_objective == out.loss_objective

    def test_torchrl_trainer_steps_sum_the_loss_terms(self):
        """torchrl's GRPOTrainer steps with MixedPrecisionOptimizationStepper, which sums the
        ``loss*`` entries of the output: one SGD step moves the policy by the gradient of
        ``loss_objective + loss_entropy``."""
        from torchrl.trainers import MixedPrecisionOptimizationStepper

        actor = cartpole_actor()
        batch = cartpole_batch(actor)
        loss = GRPOLoss(actor, entropy_coeff=0.05)
        params = list(loss.parameters())
        out = loss(batch.clone())
        grads = torch.autograd.grad(out.loss_objective + out.loss_entropy, params)
        expected = [(p - 0.1 * g).detach() for p, g in zip(params, grads)]

        class Trainer:  # the one method the stepper calls
            def compute_loss(self, sub_batch):
                return loss(sub_batch)

        stepper = MixedPrecisionOptimizationStepper(
            optimizer=torch.optim.SGD(params, lr=0.1), clip_norm=None
        )
        metrics = stepper.step(Trainer(), batch.clone())
        assert set(metrics.keys()) >= {"loss_objective", "loss_entropy", "ESS", "clip_fraction"}
        for p, e in zip(params, expected, strict=True):
            torch.testing.assert_close(p.detach(), e)
