"""Tests of torchrl_grpo.loss_terms against hand-computed values.

The running example: two sequences, the second one padded at its last token.

    row 0, A = +1: ratios 1.0, 1.1, 1.5
    row 1, A = -1: ratios 0.5, 4.0, (pad)

With clip 0.2 the PPO per-token losses are -min(rA, clip(r)A):
    row 0: -1.0, -1.1, -1.2        (sum -3.3)
    row 1:  max(0.5, 0.8) = 0.8, max(4.0, 1.2) = 4.0      (sum 4.8)
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from torchrl_grpo.loss_terms import (
    AGGREGATIONS,
    INFERENCE_CORRECTIONS,
    KL_ESTIMATORS,
    aggregate_seq_mean_token_mean,
    aggregate_seq_mean_token_sum,
    aggregate_seq_mean_token_sum_norm,
    aggregate_token_mean,
    aggregate_token_sum,
    cispo_loss,
    clip_fractions,
    decoupled_behaviour_weight,
    dppo_kl_mask,
    dppo_tv_mask,
    dual_clip_loss,
    effective_sample_size,
    high_entropy_token_mask,
    importance_weighted_kl,
    inference_mismatch,
    kl_k1,
    kl_k2,
    kl_k3,
    mask_importance_weight,
    masked_mean,
    masked_quantile,
    off_policy_sequence_mask,
    ppo_clip_loss,
    sapo_loss,
    sequence_log_ratio,
    sequence_sum_log_ratio,
    sequence_veto_mask,
    truncate_importance_weight,
    truncated_is_weight,
    two_sided_clip_loss,
    vespo_loss,
)

LOW, HIGH = math.log(0.8), math.log(1.2)
MASK = torch.tensor([[True, True, True], [True, True, False]])
RATIO = torch.tensor([[1.0, 1.1, 1.5], [0.5, 4.0, 7.0]])  # 7.0 sits in padding
ADV = torch.tensor([[1.0], [-1.0]])


def ppo_losses():
    return ppo_clip_loss(RATIO.log(), ADV, LOW, HIGH)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol
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


class TestSequenceLogRatio:
    def test_hand_values(self):
        s = sequence_log_ratio(RATIO.log(), MASK).exp()
        # geometric means over real tokens: (1 * 1.1 * 1.5)^(1/3), (0.5 * 4)^(1/2)
        close(s[0], [1.65 ** (1 / 3)] * 3)
        close(s[1], [math.sqrt(2.0)] * 3)

    def test_gradient_is_spread_over_the_real_tokens(self):
        log_ratio = RATIO.log().requires_grad_()
        sequence_log_ratio(log_ratio, MASK)[:, 0].sum().backward()
        close(log_ratio.grad, [[1 / 3, 1 / 3, 1 / 3], [0.5, 0.5, 0.0]])

    def test_empty_sequence_has_ratio_one(self):
        mask = torch.tensor([[True, False], [False, False]])
        close(
            sequence_log_ratio(torch.tensor([[0.3, 5.0], [2.0, 2.0]]), mask), [[0.3, 0.3], [0, 0]]
        )


class TestAggregations:
    # per-token losses of the running example: rows sum to -3.3 (3 tokens) and 4.8 (2 tokens)
    def test_token_mean(self):
        close(aggregate_token_mean(ppo_losses(), MASK), (-3.3 + 4.8) / 5)

    def test_seq_mean_token_mean(self):
        close(aggregate_seq_mean_token_mean(ppo_losses(), MASK), (-3.3 / 3 + 4.8 / 2) / 2)

    def test_seq_mean_token_sum(self):
        close(aggregate_seq_mean_token_sum(ppo_losses(), MASK), (-3.3 + 4.8) / 2)

    def test_seq_mean_token_sum_norm(self):
        close(aggregate_seq_mean_token_sum_norm(ppo_losses(), MASK, max_length=5), 0.75 / 5)
        with pytest.raises(ValueError, match="max_length"):
            aggregate_seq_mean_token_sum_norm(ppo_losses(), MASK, max_length=0)

    def test_registry(self):
        assert set(AGGREGATIONS) == {
            "token_mean",
            "seq_mean_token_mean",
            "seq_mean_token_sum",
            "seq_mean_token_sum_norm",
            "token_sum",
        }

    @pytest.mark.parametrize("name", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
    def test_empty_sequences_and_nan_pads_are_ignored(self, name):
        fn = AGGREGATIONS[name]
        loss = ppo_losses()
        padded = torch.cat([loss, torch.full((1, 3), float("nan"))])  # an all-padding row
        padded = torch.cat([padded, torch.full((3, 2), float("inf"))], 1)  # two pad columns
        mask = torch.cat([MASK, torch.zeros(1, 3, dtype=torch.bool)])
        mask = torch.cat([mask, torch.zeros(3, 2, dtype=torch.bool)], 1)
        close(fn(padded, mask), fn(loss, MASK))

    @settings(max_examples=25, deadline=None)
    @given(perm_seed=st.integers(0, 1000))
    def test_invariant_to_sequence_order(self, perm_seed):
        g = torch.Generator().manual_seed(perm_seed)
        loss = torch.randn(6, 5, generator=g)
        mask = torch.rand(6, 5, generator=g) > 0.4
        mask[0, 0] = True
        perm = torch.randperm(6, generator=g)
        for fn in (
            aggregate_token_mean,
            aggregate_seq_mean_token_mean,
            aggregate_seq_mean_token_sum,
        ):
            close(fn(loss[perm], mask[perm]), fn(loss, mask), atol=1e-5)


class TestKLEstimators:
    LOGP = torch.tensor([-1.0, -2.0, -0.5])
    REF = torch.tensor([-1.0, -1.0, -1.5])

    def test_k1(self):
        close(kl_k1(self.LOGP, self.REF), [0.0, -1.0, 1.0])

    def test_k2(self):
        close(kl_k2(self.LOGP, self.REF), [0.0, 0.5, 0.5])

    def test_k3(self):
        # exp(ref - logp) - (ref - logp) - 1
        close(kl_k3(self.LOGP, self.REF), [0.0, math.e - 2.0, math.exp(-1.0)])

    def test_k3_clamped_like_low_var_kl(self):
        logp, ref = torch.tensor([-30.0, -1.0]), torch.tensor([-1.0, -60.0])
        close(kl_k3(logp, ref), [10.0, 10.0])  # the estimate is clamped to [-10, 10]
        # the log-ratio is clamped to [-20, 20] first: e^-20 + 20 - 1, not e^-59 + 59 - 1
        close(kl_k3(logp, ref, clamp=100.0)[1], math.exp(-20.0) + 19.0)
        raw = kl_k3(logp, ref, clamp=None)
        torch.testing.assert_close(
            raw, torch.tensor([math.exp(29.0) - 30.0, 58.0]), rtol=1e-5, atol=0
        )

    def test_all_estimate_kl_on_samples(self):
        # Monte-Carlo check against the exact KL(p || q) of two categoricals
        g = torch.Generator().manual_seed(0)
        p = torch.tensor([0.5, 0.3, 0.2])
        q = torch.tensor([0.4, 0.4, 0.2])
        exact = (p * (p / q).log()).sum()
        samples = torch.multinomial(p, 200_000, replacement=True, generator=g)
        for name in ("k1", "k3"):  # the unbiased ones
            estimate = KL_ESTIMATORS[name](p.log()[samples], q.log()[samples]).mean()
            close(estimate, exact, atol=3e-3)
        assert kl_k2(p.log()[samples], q.log()[samples]).mean() > 0

    def test_k3_gradient(self):
        logp = torch.tensor([-2.0], requires_grad=True)
        kl_k3(logp, torch.tensor([-1.0])).sum().backward()
        close(logp.grad, [1.0 - math.e])  # d/dlogp (e^(ref-logp) - (ref-logp) - 1)


class TestTruncatedISWeight:
    def test_hand_values(self):
        w = truncated_is_weight(
            torch.tensor([0.6, 0.3, 0.1]).log(), torch.tensor([0.2, 0.3, 0.5]).log(), 2.0
        )
        close(w, [2.0, 1.0, 0.2])

    def test_detached(self):
        old = torch.zeros(2, requires_grad=True)
        assert not truncated_is_weight(old, torch.zeros(2), 2.0).requires_grad


class TestDiagnostics:
    def test_masked_mean_ignores_nan_padding(self):
        close(masked_mean(torch.tensor([[1.0, float("nan")]]), torch.tensor([[True, False]])), 1.0)

    def test_effective_sample_size(self):
        # weights 1, 1.1, 1.5, 0.5, 4.0 over the real tokens: (sum w)^2 / sum w^2 / N
        expected = 8.1**2 / (1 + 1.21 + 2.25 + 0.25 + 16) / 5
        close(effective_sample_size(RATIO.log(), MASK), expected)

    def test_effective_sample_size_on_policy_is_one(self):
        assert effective_sample_size(torch.zeros(2, 3), MASK).item() == 1.0  # exactly, N = 5

    def test_effective_sample_size_large_log_weights(self):
        # weights e^100 and e^101: the ratio only depends on their quotient e
        expected = (1 + math.e) ** 2 / (2 * (1 + math.e**2))
        close(
            effective_sample_size(
                torch.tensor([[100.0, 101.0]]), torch.ones(1, 2, dtype=torch.bool)
            ),
            expected,
        )

    def test_clip_fractions(self):
        total, low, high = clip_fractions(RATIO.log(), MASK, LOW, HIGH)
        # real ratios 1.0, 1.1, 1.5, 0.5, 4.0: 0.5 below, 1.5 and 4.0 above
        close(low, 0.2)
        close(high, 0.4)
        close(total, 0.6)


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


class TestInferenceCorrections:
    # log pi_old - log pi_inference: row 0 ratios 2, 1, 0.25 | row 1 ratios 0.5, 8, (pad: 100)
    LOG_W = torch.tensor([[2.0, 1.0, 0.25], [0.5, 8.0, 100.0]]).log()

    def test_registry(self):
        assert set(INFERENCE_CORRECTIONS) == {
            "token_truncate",
            "token_mask",
            "sequence_truncate",
            "sequence_mask",
        }

    def test_token_truncate(self):
        weight, keep = INFERENCE_CORRECTIONS["token_truncate"](self.LOG_W, MASK, 0.5, 3.0)
        close(weight[0], [2.0, 1.0, 0.5])
        close(weight[1, :2], [0.5, 3.0])
        assert torch.equal(keep, MASK)

    def test_token_truncate_is_tis(self):
        old = torch.tensor([0.6, 0.3, 0.1]).log()
        inference = torch.tensor([0.2, 0.3, 0.5]).log()
        weight, _ = truncate_importance_weight(
            (old - inference)[None], torch.ones(1, 3, dtype=torch.bool), None, 2.0
        )
        torch.testing.assert_close(
            weight[0], truncated_is_weight(old, inference, 2.0), rtol=0, atol=0
        )

    def test_token_mask_icepop_band(self):
        weight, keep = INFERENCE_CORRECTIONS["token_mask"](self.LOG_W, MASK, 0.5, 5.0)
        # 0.25 < 0.5 and 8 > 5 leave; 0.5 (at the bound) stays; the pad is not kept
        assert keep.tolist() == [[True, True, False], [True, False, False]]
        close(weight, [[2.0, 1.0, 0.0], [0.5, 0.0, 0.0]])

    def test_sequence_levels(self):
        # products over the real tokens: row 0: 2 * 1 * 0.25 = 0.5; row 1: 0.5 * 8 = 4
        weight, keep = INFERENCE_CORRECTIONS["sequence_truncate"](self.LOG_W, MASK, None, 3.0)
        close(weight, [[0.5] * 3, [3.0] * 3])
        assert torch.equal(keep, MASK)
        weight, keep = INFERENCE_CORRECTIONS["sequence_mask"](self.LOG_W, MASK, None, 3.0)
        close(weight, [[0.5] * 3, [0.0] * 3])
        assert keep.tolist() == [[True, True, True], [False, False, False]]
        _, keep = mask_importance_weight(self.LOG_W, MASK, 0.6, None, level="sequence")
        assert keep.tolist() == [[False, False, False], [True, True, False]]

    def test_equal_log_probs_give_weight_one(self):
        for name, fn in INFERENCE_CORRECTIONS.items():
            weight, keep = fn(torch.zeros(2, 3), MASK, 0.5, 3.0)
            assert torch.equal(keep, MASK), name
            close(weight[MASK], [1.0] * 5)

    def test_weights_are_detached_and_shapes_checked(self):
        log_w = self.LOG_W.clone().requires_grad_()
        for fn in INFERENCE_CORRECTIONS.values():
            assert not fn(log_w, MASK, None, 3.0)[0].requires_grad
        with pytest.raises(ValueError, match=r"mask has shape \(2, 2\)"):
            truncate_importance_weight(self.LOG_W, MASK[:, :2], None, 3.0)
        with pytest.raises(ValueError, match="level must be one of"):
            mask_importance_weight(self.LOG_W, MASK, None, 3.0, level="group")


class TestOffPolicySequenceMask:
    # per-token drift log pi_old - log pi_theta: row 0: 1, 1 | row 1: 2, 0, (pad) | row 2: 3, 1
    LOGP = torch.tensor([[-2.0, -2.0, 0.0], [-3.0, -1.0, 5.0], [-4.0, -2.0, 0.0]])
    OLD = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, float("nan")], [-1.0, -1.0, 0.0]])
    MASK3 = torch.tensor([[True, True, False], [True, True, False], [True, True, False]])

    def test_hand_values(self):
        # sequence KLs (mean over real tokens): 1, 1, 2; only A < 0 and KL > 1.5 leaves: row 2
        adv = torch.tensor([[-1.0], [1.0], [-0.5]])
        keep = off_policy_sequence_mask(self.LOGP, self.OLD, adv, self.MASK3, 1.5)
        assert keep.tolist() == [[True, True, False], [True, True, False], [False, False, False]]
        # a threshold below 1 drops row 0 too; row 1 (A > 0) always stays
        keep = off_policy_sequence_mask(self.LOGP, self.OLD, adv, self.MASK3, 0.5)
        assert keep[:, 0].tolist() == [False, True, False]

    def test_zero_advantage_stays_and_infinite_threshold_keeps_all(self):
        adv = torch.tensor([[0.0], [-1.0], [-1.0]])
        keep = off_policy_sequence_mask(self.LOGP, self.OLD, adv, self.MASK3, 0.5)
        assert keep[:, 0].tolist() == [True, False, False]
        keep = off_policy_sequence_mask(self.LOGP, self.OLD, adv, self.MASK3, math.inf)
        assert torch.equal(keep, self.MASK3)

    def test_per_token_advantage_sign(self):
        adv = torch.tensor([[1.0, -1.0, 0.0], [1.0, 1.0, 0.0], [-1.0, 1.0, 0.0]])
        keep = off_policy_sequence_mask(self.LOGP, self.OLD, adv, self.MASK3, 1.5)
        assert keep.tolist() == [[True, True, False], [True, True, False], [False, True, False]]

    def test_checks_shapes(self):
        with pytest.raises(ValueError, match=r"advantage has shape \(3,\)"):
            off_policy_sequence_mask(self.LOGP, self.OLD, torch.ones(3), self.MASK3, 1.0)


class TestDecoupledBehaviourWeight:
    def test_hand_values(self):
        prox = torch.tensor([[0.3, 0.6, 0.9]]).log()
        behav = torch.tensor([[0.6, 0.3, 0.1]]).log()
        weight, keep = decoupled_behaviour_weight(prox, behav)
        close(weight, [[0.5, 2.0, 9.0]], atol=1e-5)
        assert keep.all()
        weight, keep = decoupled_behaviour_weight(prox, behav, cap=3.0)  # 9 > 3 leaves
        close(weight, [[0.5, 2.0, 0.0]], atol=1e-5)
        assert keep.tolist() == [[True, True, False]]

    def test_proximal_equal_to_behaviour_is_weight_one(self):
        lp = torch.randn(2, 3)
        weight, keep = decoupled_behaviour_weight(lp, lp.clone(), cap=1.5)
        assert (weight == 1).all() and keep.all()

    def test_detached(self):
        prox = torch.zeros(2, requires_grad=True)
        assert not decoupled_behaviour_weight(prox, torch.zeros(2))[0].requires_grad


class TestHighEntropyTokenMask:
    # real entropies 0.1, 2.0, 0.5 | 1.0, 0.2 (9.0 is padding)
    H = torch.tensor([[0.1, 2.0, 0.5], [1.0, 0.2, 9.0]])

    def test_hand_values(self):
        # 1 - rho = 0.6: sorted 0.1 0.2 0.5 1.0 2.0, position 2.4 -> 0.5 + 0.4 * 0.5 = 0.7
        assert high_entropy_token_mask(self.H, MASK, 0.4).tolist() == [
            [False, True, False],
            [True, False, False],
        ]
        # rho = 0.2: position 3.2 -> 1.0 + 0.2 * 1.0 = 1.2: only 2.0
        assert high_entropy_token_mask(self.H, MASK, 0.2).sum() == 1

    def test_extremes_and_ties(self):
        assert torch.equal(high_entropy_token_mask(self.H, MASK, 1.0), MASK)  # every real token
        top = high_entropy_token_mask(self.H, MASK, 0.0)  # the maximum (not the 9.0 pad)
        assert top.tolist() == [[False, True, False], [False, False, False]]
        ties = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
        assert torch.equal(high_entropy_token_mask(ties, MASK, 0.2), MASK)  # all at the threshold

    def test_empty_mask_selects_nothing(self):
        empty = torch.zeros(2, 3, dtype=torch.bool)
        assert not high_entropy_token_mask(self.H, empty, 0.5).any()

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    @pytest.mark.parametrize("as_tensor", [False, True])
    @pytest.mark.parametrize("rho", [0.1, 0.2, 0.25, 0.3, 0.5, 0.7, 0.9])
    def test_threshold_exactly_on_a_token_keeps_it(self, rho, as_tensor, dtype):
        """``(1 - rho) (N - 1)`` a whole number: the threshold is that token's entropy and it
        is kept (TRL's torch.quantile keeps it). 1 - 0.2 in float32 is 0.800000011920929,
        which put the threshold just above the token and dropped it."""
        g = torch.Generator().manual_seed(int(rho * 100))
        for n in (11, 21, 41, 51, 101, 1001):
            entropy = torch.rand(1, n, generator=g, dtype=torch.float64).to(dtype)
            mask = torch.ones(1, n, dtype=torch.bool)
            position = round((1 - rho) * (n - 1))
            if abs((1 - rho) * (n - 1) - position) > 1e-9:
                continue
            level = torch.tensor(rho) if as_tensor else rho  # a scheduled rho is float32
            kept = high_entropy_token_mask(entropy, mask, level)
            threshold = entropy.sort().values[0, position]  # the reference, written out
            assert torch.equal(kept, entropy >= threshold), (n, position)
            assert int(kept.sum()) == n - position

    @settings(max_examples=25, deadline=None)
    @given(seed=st.integers(0, 1000), q=st.floats(0.0, 1.0))
    @example(seed=0, q=1.192092896e-07)  # a position within 1e-6 of 0: interpolated all the same
    def test_masked_quantile_matches_torch_quantile(self, seed, q):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(5, 7, generator=g, dtype=torch.float64)
        mask = torch.rand(5, 7, generator=g) > 0.3
        mask[0, 0] = True
        close(masked_quantile(x, mask, q), torch.quantile(x[mask], q), atol=1e-12)


# --- the 2026 terms, on the running example -------------------------------------------------


class TestTokenSum:
    def test_hand_value(self):
        close(aggregate_token_sum(ppo_losses(), MASK), -3.3 + 4.8)


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


class TestImportanceWeightedKL:
    def test_hand_values_and_gradient(self):
        # r = 1.1 and 0.5: the estimate times r; the gradient of r k is r (log r... + k)
        log_prob = torch.tensor([0.55, 0.25]).log().requires_grad_()
        old, ref = torch.tensor([0.5, 0.5]).log(), torch.tensor([0.5, 0.5]).log()
        kl = kl_k3(log_prob, ref)
        weighted = importance_weighted_kl(kl, log_prob - old)
        close(weighted, torch.tensor([1.1, 0.5]) * kl.detach())
        weighted.sum().backward()
        # d/dlogp [r (e^{ref - lp} - 1 - (ref - lp))] = r k + r (1 - e^{ref - lp})
        d = (ref - log_prob).detach()
        want = torch.tensor([1.1, 0.5]) * (kl.detach() + 1 - d.exp())
        close(log_prob.grad, want)


class TestDPPOMasks:
    # p_old 0.5 everywhere but row 1's second token (0.1); p 0.5, 0.55, 0.75 | 0.25, 0.4
    P_NOW = torch.tensor([[0.5, 0.55, 0.75], [0.25, 0.4, 0.9]])
    P_OLD = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.1, 0.5]])

    def test_tv_hand_values(self):
        # moves +0, +.05, +.25 (A > 0: > .1 masked) | -.25, +.3 (A < 0: < -.1 masked)
        keep = dppo_tv_mask(self.P_NOW.log(), self.P_OLD.log(), ADV, MASK, 0.1, 0.1)
        assert keep.tolist() == [[True, True, False], [False, True, False]]

    def test_kl_hand_values(self):
        d = lambda p, q: q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))  # noqa: E731
        # 0.75 vs 0.5: D = 0.144 (A > 0, rising: masked above 0.1); 0.25 vs 0.5: D = 0.144
        # (A < 0, falling: masked); 0.4 vs 0.1: rising against A < 0: kept whatever D
        assert d(0.75, 0.5) > 0.1 and d(0.55, 0.5) < 0.1
        keep = dppo_kl_mask(self.P_NOW.log(), self.P_OLD.log(), ADV, MASK, 0.1, 0.1)
        assert keep.tolist() == [[True, True, False], [False, True, False]]
        keep = dppo_kl_mask(self.P_NOW.log(), self.P_OLD.log(), ADV, MASK, 0.2, 0.2)
        assert keep.tolist() == [[True, True, True], [True, True, False]]

    def test_zero_advantage_takes_the_negative_branch(self):
        # verl: only A > 0 reads the positive bound; A = 0 is bounded below
        keep = dppo_tv_mask(self.P_NOW.log(), self.P_OLD.log(), torch.zeros(2, 1), MASK, 0.1, 0.1)
        assert keep.tolist() == [[True, True, True], [False, True, False]]


class TestMismatch:
    # rho = pi_old / pi_inference: 2, 1, 1 | 1, 0.5 (the running example's real tokens)
    RHO = torch.tensor([[2.0, 1.0, 1.0], [1.0, 0.5, 7.0]])

    def test_hand_values(self):
        stats = inference_mismatch(self.RHO.log(), MASK)
        close(stats["chi2_token"], (4 + 1 + 1 + 1 + 0.25) / 5 - 1)
        close(stats["chi2_sequence"], (4 + 0.25) / 2 - 1)
        k3 = [2 - 1 - math.log(2), 0.5 - 1 - math.log(0.5)]
        close(stats["seq_max_k3_mean"], sum(k3) / 2)
        close(stats["seq_max_k3_max"], max(k3))

    def test_agreement_is_zero(self):
        stats = inference_mismatch(torch.zeros(2, 3), MASK)
        for value in stats.values():
            close(value, 0.0)

    def test_veto(self):
        keep = sequence_veto_mask(self.RHO.log(), MASK, 0.25)  # k3: 0.307 | 0.193
        assert keep.tolist() == [[False, False, False], [True, True, False]]
        empty = torch.zeros(1, 3, dtype=torch.bool)
        assert not sequence_veto_mask(torch.zeros(1, 3), empty, 0.1).any()
