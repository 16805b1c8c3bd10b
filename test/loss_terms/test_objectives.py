"""Tests of :mod:`torchrl_grpo.loss_terms.objectives` against hand-computed values (the running
example of ``test/helpers/running_example.py``)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.running_example import ADV, HIGH, LOW, MASK, RATIO, close, ppo_losses

from torchrl_grpo.loss_terms import (
    cispo_loss,
    dual_clip_loss,
    ppo_clip_loss,
    sapo_loss,
    sequence_sum_log_ratio,
    two_sided_clip_loss,
    vespo_loss,
)


class TestPPOClipLoss:
    def test_hand_values(self):
        close(ppo_losses()[:, :2], [[-1.0, -1.1], [0.8, 4.0]])
        close(ppo_losses()[0, 2], -1.2)

    def test_clip_higher(self):
        # DAPO: the upper bound moves to 1.28, the lower one stays at 0.8
        loss = ppo_clip_loss(RATIO.log(), ADV, math.log(0.8), math.log(1.28))
        close(loss[0], [-1.0, -1.1, -1.28])
        close(loss[1, :2], [0.8, 4.0])

    def test_gradient_zero_outside_band_in_the_pessimistic_direction(self):
        log_ratio = RATIO.log().requires_grad_()
        ppo_clip_loss(log_ratio, ADV, LOW, HIGH).sum().backward()
        # d/dlog r of -rA is -rA where the unclipped term is the min, 0 where clipping binds
        close(log_ratio.grad, [[-1.0, -1.1, 0.0], [0.0, 4.0, 7.0]])


def test_ppo_clip_loss_survives_an_overflowing_ratio():
    """log r = 90 overflows float32 (e^88.7): the loss is finite whatever the advantage's sign
    and every gradient finite (the token's 0); below the cap nothing changes."""
    log_ratio = torch.tensor([90.0, 90.0, 90.0, 19.0, 0.1], requires_grad=True)
    advantage = torch.tensor([1.0, 0.0, -1.0, -1.0, 1.0])
    loss = ppo_clip_loss(log_ratio, advantage, math.log(0.8), math.log(1.2))
    capped = math.exp(20.0)
    want = [-1.2, 0.0, capped, math.exp(19.0), -math.exp(0.1)]
    torch.testing.assert_close(loss, torch.tensor(want), rtol=1e-6, atol=0)
    loss.sum().backward()
    assert torch.isfinite(log_ratio.grad).all()
    assert log_ratio.grad[:3].tolist() == [0.0, 0.0, 0.0]
    torch.testing.assert_close(log_ratio.grad[3:], torch.tensor([math.exp(19.0), -math.exp(0.1)]))


class TestDualClipLoss:
    def test_hand_values(self):
        # row 1 (A = -1): 0.8 stays, 4.0 is capped at c|A| = 3
        close(dual_clip_loss(ppo_losses(), ADV, 3.0)[:, :2], [[-1.0, -1.1], [0.8, 3.0]])

    def test_positive_advantages_untouched(self):
        loss = ppo_losses()
        close(dual_clip_loss(loss, ADV, 3.0)[0], loss[0])

    def test_capped_tokens_have_no_gradient(self):
        log_ratio = RATIO.log().requires_grad_()
        dual_clip_loss(ppo_clip_loss(log_ratio, ADV, LOW, HIGH), ADV, 3.0).sum().backward()
        assert log_ratio.grad[1, 1] == 0.0


class TestCISPOLoss:
    def test_hand_values(self):
        log_prob = torch.tensor([[0.5, 0.55, 0.75], [0.25, 0.4, 0.9]]).log()
        loss = cispo_loss(RATIO.log(), ADV, log_prob, LOW, HIGH)
        # weights clip(r, 0.8, 1.2): row 0 -> 1.0, 1.1, 1.2; row 1 -> 0.8, 1.2
        expected = [
            [-1.0 * math.log(0.5), -1.1 * math.log(0.55), -1.2 * math.log(0.75)],
            [0.8 * math.log(0.25), 1.2 * math.log(0.4)],
        ]
        close(loss[0], expected[0])
        close(loss[1, :2], expected[1])

    def test_tokens_outside_the_band_keep_a_gradient(self):
        log_prob = torch.tensor([[0.5, 0.55, 0.75], [0.25, 0.4, 0.9]]).log().requires_grad_()
        log_ratio = RATIO.log()
        cispo_loss(log_ratio, ADV, log_prob, LOW, HIGH).sum().backward()
        # d loss / d log pi = -clip(r) A, for every token, clipped or not
        close(log_prob.grad, [[-1.0, -1.1, -1.2], [0.8, 1.2, 1.2]])

    def test_torchrl_0_14_cispo_zeroes_those_gradients(self):
        # torchrl 0.14.1's CISPOLoss returns -clip(r) * A with the gradient through the clamp:
        # tokens whose ratio is outside the band get no gradient at all. Ours keeps it.
        from types import SimpleNamespace

        from torchrl.objectives.llm.grpo import CISPOLoss as TorchRLCISPO

        log_prob = torch.tensor([[0.5, 0.55, 0.75], [0.25, 0.4, 0.9]]).log().requires_grad_()
        old = log_prob.detach() - RATIO.log()
        fake = SimpleNamespace(_clip_bounds=(torch.tensor(LOW), torch.tensor(HIGH)))
        theirs, _ = TorchRLCISPO._compute_policy_objective(fake, (log_prob - old), ADV)
        (theirs_grad,) = torch.autograd.grad(theirs.sum(), log_prob)
        (ours_grad,) = torch.autograd.grad(
            cispo_loss(log_prob - old, ADV, log_prob, LOW, HIGH).sum(), log_prob
        )
        outside = torch.tensor([[False, False, True], [True, True, True]])
        assert (theirs_grad[outside] == 0).all()
        assert (ours_grad[outside] != 0).all()
        # inside the band, both are the policy gradient r * A
        close(ours_grad[~outside], theirs_grad[~outside])

    def test_no_lower_bound(self):
        log_prob = torch.tensor([[0.5, 0.55, 0.75], [0.25, 0.4, 0.9]]).log().requires_grad_()
        cispo_loss(RATIO.log(), ADV, log_prob, -math.inf, math.log(4.0)).sum().backward()
        close(log_prob.grad, [[-1.0, -1.1, -1.5], [0.5, 4.0, 4.0]])


class TestSAPOLoss:
    # -(4 / tau) sigmoid(tau (r - 1)) A, tau = 1 for A > 0 and 1.05 for A <= 0; by hand:
    #   row 0 (A = +1, tau 1):    r = 1   -> -4 * 0.5                       = -2
    #                             r = 1.1 -> -4 * sigmoid(0.1) = -4 * 0.524979 = -2.099917
    #                             r = 1.5 -> -4 * sigmoid(0.5) = -4 * 0.622459 = -2.489836
    #   row 1 (A = -1, tau 1.05): r = 0.5 -> (4 / 1.05) * sigmoid(-0.525) = 3.809524 * 0.371684
    #                             r = 4   -> (4 / 1.05) * sigmoid(3.15)   = 3.809524 * 0.958909
    def test_hand_values(self):
        loss = sapo_loss(RATIO.log(), ADV)
        close(loss[0], [-2.0, -2.099917, -2.489836], atol=2e-6)
        close(loss[1, :2], [1.415939, 3.652987], atol=2e-6)

    def test_temperatures_by_advantage_sign(self):
        # the same ratio 1.5 gated with tau_pos = 2 for A > 0, tau_neg = 0.5 for A = 0 or A < 0
        log_ratio = torch.full((1, 3), math.log(1.5))
        adv = torch.tensor([[2.0, 0.0, -2.0]])
        loss = sapo_loss(log_ratio, adv, 2.0, 0.5)
        # A = 2: -(4/2) sigmoid(1) * 2 = -2.924234; A = -2: (4/0.5) sigmoid(0.25) * 2 = 8.994824
        close(loss, [[-2.924234, 0.0, 8.994824]], atol=5e-6)

    def test_gradient_is_ppo_on_policy_and_soft_off_policy(self):
        log_ratio = torch.log(torch.tensor([[1.0, 1.5]])).requires_grad_()
        sapo_loss(log_ratio, torch.ones(1, 2), 1.0, 1.05).sum().backward()
        # d/dlog r = -r * 4 sigmoid(1 - sigmoid) A: -1 at r = 1 (PPO's -r A), and at r = 1.5
        # -1.5 * 4 * 0.622459 * 0.377541 = -1.410021, where PPO's clip (0.2) gives 0
        close(log_ratio.grad, [[-1.0, -1.410021]], atol=2e-6)

    def test_rank_mismatch_fails(self):
        with pytest.raises(ValueError, match=r"advantage has shape \(2,\).*same number of dim"):
            sapo_loss(RATIO.log(), torch.ones(2))


class TestTwoSidedClip:
    def test_hand_values(self):
        # row 1's ratio 4 with A = -1: PPO's loss 4.0, capped at delta = 3; the rest unchanged
        loss = two_sided_clip_loss(RATIO.log(), ADV, LOW, HIGH, 3.0)
        close(loss[MASK], [-1.0, -1.1, -1.2, 0.8, 3.0])

    def test_equals_the_dual_clip_above_the_band(self):
        ppo = ppo_losses()
        for delta in (1.2, 1.5, 3.0, 100.0):  # delta >= 1 + eps_high
            close(
                two_sided_clip_loss(RATIO.log(), ADV, LOW, HIGH, delta),
                dual_clip_loss(ppo, ADV, delta),
            )

    def test_below_the_band_it_caps_positive_advantages_too(self):
        # delta = 1.05 < 1.2: row 0's ratios 1.1 and 1.5 give -1.05 where PPO gives -1.1, -1.2
        loss = two_sided_clip_loss(RATIO.log(), ADV, LOW, HIGH, 1.05)
        close(loss[0], [-1.0, -1.05, -1.05])


class TestVESPO:
    def test_hand_values(self):
        # row 0: W = 1 * 1.1 * 1.5 = 1.65, A = +1: phi = 1.65^2 e^{3 (1 - 1.65)}
        # row 1: W = 0.5 * 4 = 2, A = -1: phi = 2^3 e^{2 (1 - 2)}
        log_w = sequence_sum_log_ratio(RATIO.log(), MASK)
        close(log_w[:, 0], [math.log(1.65), math.log(2.0)], atol=1e-5)
        log_prob = torch.full((2, 3), -1.0, requires_grad=True)
        vespo_loss(log_w, ADV, log_prob).sum().backward()
        phi = [1.65**2 * math.exp(3 * (1 - 1.65)), 8 * math.exp(-2.0)]
        close(log_prob.grad[:, 0], [-phi[0], phi[1]], atol=1e-5)

    def test_on_policy_is_reinforce(self):
        log_prob = torch.randn(2, 3, requires_grad=True)
        vespo_loss(torch.zeros(2, 3), ADV, log_prob).sum().backward()
        close(log_prob.grad, -ADV.expand(2, 3))

    def test_overflowing_weights_give_no_nan(self):
        log_prob = torch.full((1, 2), -1.0, requires_grad=True)
        loss = vespo_loss(torch.full((1, 2), 500.0), torch.ones(1, 1), log_prob)
        loss.sum().backward()
        assert torch.isfinite(log_prob.grad).all()

    def test_sequence_sum_clamps_tokens_and_sum(self):
        log_ratio = torch.tensor([[30.0, -5.0, 0.0], [-15.0, -15.0, 9.0]])
        mask = torch.tensor([[True, True, False], [True, True, False]])
        close(sequence_sum_log_ratio(log_ratio, mask)[:, 0], [15.0, -20.0])


class TestNames:
    """One name per concept: the callable alias is ObjectiveFn, the variant base Objective."""

    def test_the_callable_alias_has_its_own_name(self):
        import torchrl_grpo.loss
        import torchrl_grpo.loss_terms
        from torchrl_grpo.loss_terms import ObjectiveFn

        for module in (torchrl_grpo.loss_terms, torchrl_grpo.loss):
            with pytest.warns(DeprecationWarning, match="ObjectiveFn"):
                assert module.Objective is ObjectiveFn
        with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
            getattr(torchrl_grpo.loss_terms, "no_such_name")  # noqa: B009

    def test_defaults_are_written_once(self):
        import inspect

        from torchrl_grpo.loss.variants import SAPO, VESPO
        from torchrl_grpo.loss_terms import SAPO_TEMPERATURES, VESPO_K, VESPO_LAMBDA

        kernel = inspect.signature(vespo_loss).parameters
        assert (kernel["k_pos"].default, kernel["k_neg"].default) == VESPO_K == VESPO().k
        assert (kernel["lambda_pos"].default, kernel["lambda_neg"].default) == VESPO_LAMBDA
        assert VESPO().lambda_ == VESPO_LAMBDA
        taus = inspect.signature(sapo_loss).parameters
        sapo = SAPO()
        assert (
            taus["temperature_pos"].default,
            taus["temperature_neg"].default,
        ) == SAPO_TEMPERATURES
        assert (sapo.temperature_pos, sapo.temperature_neg) == SAPO_TEMPERATURES
