"""The adaptive entropy coefficient (Skywork-OR1): the controller, its place in GRPOLoss, and
TRL's update loop written out."""

import math

import pytest
import torch
from helpers.loss import token_batch, token_policy

from torchrl_grpo import GRPOLoss
from torchrl_grpo.loss.entropy import AdaptiveEntropy
from torchrl_grpo.loss_terms import adaptive_entropy_coeff


def trl_adaptive_entropy(entropies, coef, target, coef_min, coef_max, delta):
    """TRL 1.16's rule (grpo_trainer.py), written out: the coefficient applied at each step
    (0 while the entropy last measured is above the target; it starts at inf), then the update
    from the step's token-weighted entropy."""
    applied, last = [], math.inf
    for entropy in entropies:
        applied.append(coef if last <= target else 0.0)
        if entropy <= target:
            coef = min(coef + delta, coef_max)
        else:
            coef = max(coef - delta, coef_min)
        last = entropy
    return applied, coef


class TestUpdateRule:
    def test_hand_values(self):
        assert adaptive_entropy_coeff(0.1, 0.3, 0.5, 0.0, 1.0, 0.05) == pytest.approx(0.15)
        assert adaptive_entropy_coeff(0.1, 0.5, 0.5, 0.0, 1.0, 0.05) == pytest.approx(0.15)
        assert adaptive_entropy_coeff(0.1, 0.6, 0.5, 0.0, 1.0, 0.05) == pytest.approx(0.05)
        assert adaptive_entropy_coeff(0.98, 0.1, 0.5, 0.0, 1.0, 0.05) == 1.0  # the maximum
        assert adaptive_entropy_coeff(0.02, 0.9, 0.5, 0.01, 1.0, 0.05) == 0.01  # the minimum


class TestController:
    def test_window_is_token_weighted_and_emptied(self):
        controller = AdaptiveEntropy(target=1.0, low=0.0, high=1.0, step=0.1)
        mask = torch.tensor([[True, True, False], [True, False, False]])
        controller.applied(torch.tensor(0.5), torch.tensor([[1.0, 2.0, 99.0], [3.0, 0, 0]]), mask)
        controller.applied(torch.tensor(0.5), torch.tensor([[0.0, 0.0, 0.0]]), mask[:1])
        torch.testing.assert_close(controller.window, torch.tensor([6.0, 5.0], dtype=torch.float64))
        assert controller.update(0.5) == pytest.approx(0.4)  # H = 6 / 5 > 1: down
        assert controller.last_entropy.item() == pytest.approx(1.2)
        assert controller.window.tolist() == [0.0, 0.0]

    def test_eval_mode_records_nothing(self):
        controller = AdaptiveEntropy(target=1.0, low=0.0, high=1.0, step=0.1).eval()
        controller.applied(torch.tensor(0.5), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool))
        with pytest.raises(RuntimeError, match="no token seen"):
            controller.update(0.5)


class TestInGRPOLoss:
    def test_matches_trl_over_steps(self):
        """Three optimizer steps of two micro-batches: the applied coefficients and the final
        one follow TRL's loop on the same measured entropies."""
        policy = token_policy()
        loss = GRPOLoss(
            policy,
            entropy_coeff=0.02,
            entropy_target=1.8,
            entropy_coeff_step=0.01,
            entropy_coeff_bounds=(0.0, 0.5),
        )
        applied, measured = [], []
        for step in range(3):
            total = count = 0.0
            for seed in (2 * step, 2 * step + 1):
                batch = token_batch(b=4, seed=seed)
                out = loss(batch)
                applied.append(out.entropy_coeff.item())
                torch.testing.assert_close(out.loss_entropy, -out.entropy_coeff * out.entropy)
                n = batch["mask"].sum().item()
                total, count = total + out.entropy.item() * n, count + n
            measured.append(total / count)
            loss.update_entropy_coeff()
        want, final = trl_adaptive_entropy(measured, 0.02, 1.8, 0.0, 0.5, 0.01)
        assert [a for a in applied[::2]] == pytest.approx(want)
        assert applied[::2] == pytest.approx(applied[1::2])  # fixed within a step
        assert loss.entropy_coeff.item() == pytest.approx(final)
        assert {m <= 1.8 for m in measured} == {True, False}  # both branches were taken

    def test_with_top_entropy_quantile_the_kept_tokens_are_measured(self):
        """TRL 1.16's controller measures the entropy of the tokens ``top_entropy_quantile``
        keeps (the objective's, one mask for both): the window holds those tokens' entropy and
        count only."""
        from torchrl_grpo.loss_terms import high_entropy_token_mask

        policy = token_policy()
        loss = GRPOLoss(policy, entropy_coeff=0.02, entropy_target=1.8, top_entropy_quantile=0.2)
        batch = token_batch(b=4, seed=3)
        loss(batch)
        with torch.no_grad():  # the policy's per-token entropy, as the loss computes it
            logits = policy.module[0](batch.copy())["logits"]
            entropy = torch.distributions.Categorical(logits=logits).entropy()
        kept = high_entropy_token_mask(entropy, batch["mask"], 0.2)
        assert 0 < kept.sum() < batch["mask"].sum()
        want = [float(entropy[kept].double().sum()), float(kept.sum())]
        assert loss.adaptive_entropy.window.tolist() == pytest.approx(want)

    def test_state_dict_round_trip(self):
        loss = GRPOLoss(token_policy(), entropy_target=5.0)
        loss(token_batch())
        loss.update_entropy_coeff()
        state = loss.state_dict()
        assert {"adaptive_entropy.window", "adaptive_entropy.last_entropy"} <= set(state)
        other = GRPOLoss(token_policy(), entropy_target=5.0)
        other.load_state_dict(state)
        assert other.entropy_coeff.item() == pytest.approx(0.015)  # 0.01 + one step
        assert other.adaptive_entropy.last_entropy.item() == loss.adaptive_entropy.last_entropy

    def test_errors(self):
        with pytest.raises(RuntimeError, match="needs GRPOLoss"):
            GRPOLoss(token_policy()).update_entropy_coeff()
        with pytest.raises(RuntimeError, match="no token seen"):
            GRPOLoss(token_policy(), entropy_target=1.0).update_entropy_coeff()
        with pytest.raises(ValueError, match="need an entropy_target"):
            GRPOLoss(token_policy(), entropy_coeff_step=0.1)
        with pytest.raises(ValueError, match="needs entropy_bonus=True"):
            GRPOLoss(token_policy(), entropy_target=1.0, entropy_bonus=False)
        with pytest.raises(ValueError, match="0 <= min <= max"):
            GRPOLoss(token_policy(), entropy_target=1.0, entropy_coeff_bounds=(0.5, 0.1))
