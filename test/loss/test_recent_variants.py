"""GRPOLoss's 2026 terms: DPPO's trust region, the two-sided clip, the unbiased KL, VESPO,
LUSPO, token-sum aggregation, the mismatch statistics and the veto. Hand values on the running
example of helpers.loss (known_batch), what moves them off their neutral setting, and the
errors. Their neutral settings are in helpers.loss.NEUTRAL; the reference formulas of verl and
TRL in loss_terms/test_references.py; the adaptive entropy coefficient in test_entropy.py."""

import math

import pytest
import torch
from helpers.loss import known_batch, known_policy, pad, token_batch, token_policy

from torchrl_grpo import DPPOLoss, GRPOLoss, LUSPOLoss, VESPOLoss
from torchrl_grpo.loss_terms import dppo_tv_mask, inference_mismatch, vespo_loss

# the running example: real tokens' PPO losses -1.0, -1.1, -1.2 | 0.8, 4.0 (5 tokens);
# p = .5, .55, .75 | .25, .4 against p_old = .5, .5, .5 | .5, .1
PPO_LOSSES = [-1.0, -1.1, -1.2, 0.8, 4.0]
# rho = pi_old / pi_inference: 2, 1, 1 | 1, 0.5
RHO = [2.0, 1.0, 1.0, 1.0, 0.5]


class TestHandValues:
    def test_dppo_tv(self):
        # moves 0, +.05, +.25 (A > 0) | -.25, +.3 (A < 0): with 0.1, tokens 3 and 4 are zeroed
        out = GRPOLoss(known_policy(), trust_region="dppo_tv", trust_region_bounds=0.1)(
            known_batch()
        )
        assert out.trust_region_masked_fraction.item() == pytest.approx(2 / 5)
        assert out.loss_objective.item() == pytest.approx((-1.0 - 1.1 + 4.0) / 5)

    def test_two_sided_clip(self):
        out = GRPOLoss(known_policy(), delta=3.0)(known_batch())  # 4.0 capped at 3 |A|
        assert out.loss_objective.item() == pytest.approx((-3.3 + 0.8 + 3.0) / 5)

    def test_token_sum(self):
        out = GRPOLoss(known_policy(), aggregation="token_sum", entropy_coeff=0.1)(known_batch())
        assert out.loss_objective.item() == pytest.approx(sum(PPO_LOSSES))
        mean = GRPOLoss(known_policy(), entropy_coeff=0.1)(known_batch())
        assert out.loss_entropy.item() == pytest.approx(5 * mean.loss_entropy.item())

    def test_unbiased_kl(self):
        out = GRPOLoss(known_policy(), kl_to_ref_coeff=0.1, kl_to_ref_unbiased=True)(known_batch())
        ref_over_p = [0.5 / 0.5, 0.5 / 0.55, 0.5 / 0.75, 0.5 / 0.25, 0.1 / 0.4]
        ratios = [1.0, 1.1, 1.5, 0.5, 4.0]
        k3 = [x - 1 - math.log(x) for x in ref_over_p]
        want = sum(r * k for r, k in zip(ratios, k3, strict=True)) / 5
        assert out.kl_to_ref.item() == pytest.approx(want, rel=1e-6)
        assert out.loss_kl_to_ref.item() == pytest.approx(0.1 * want, rel=1e-6)

    def test_vespo(self):
        # W = 1.65 (A = +1) | 2 (A = -1); loss -phi A log p per token, token mean
        out = VESPOLoss(known_policy())(known_batch())
        phi = [1.65**2 * math.exp(3 * (1 - 1.65)), 8 * math.exp(-2.0)]
        log_p = [math.log(p) for p in (0.5, 0.55, 0.75, 0.25, 0.4)]
        want = (-phi[0] * sum(log_p[:3]) + phi[1] * sum(log_p[3:])) / 5
        assert out.loss_objective.item() == pytest.approx(want, rel=1e-5)

    def test_veto_and_mismatch(self):
        # k3(rho) worst per sequence: 2 - 1 - log 2 = 0.307 | 0.5 - 1 - log 0.5 = 0.193
        out = GRPOLoss(known_policy(), inference_veto_threshold=0.25)(known_batch())
        assert out.inference_vetoed_fraction.item() == pytest.approx(0.5)
        assert out.loss_objective.item() == pytest.approx((0.8 + 4.0) / 2)  # row 0 left out
        assert out.inference_chi2_token.item() == pytest.approx(
            sum(r * r for r in RHO) / 5 - 1, rel=1e-6
        )
        assert out.inference_chi2_sequence.item() == pytest.approx((4 + 0.25) / 2 - 1, rel=1e-6)
        k3 = [2 - 1 - math.log(2), 0.5 - 1 - math.log(0.5)]
        assert out.inference_seq_max_k3_mean.item() == pytest.approx(sum(k3) / 2, rel=1e-6)
        assert out.inference_seq_max_k3_max.item() == pytest.approx(k3[0], rel=1e-6)

    def test_mismatch_reported_with_any_reader(self):
        out = GRPOLoss(known_policy(), tis_cap=2.0)(known_batch())
        assert out.inference_chi2_token.item() == pytest.approx(0.45, rel=1e-6)
        assert GRPOLoss(known_policy())(known_batch()).inference_chi2_token is None


class TestOffNeutral:
    def test_each_term_changes_the_loss(self):
        batch = pad(token_batch(drift=1.0))
        base = GRPOLoss(token_policy(), kl_to_ref_coeff=0.1)(batch)
        for kwargs in (
            {"trust_region": "dppo_tv", "trust_region_bounds": 0.01},
            {"trust_region": "dppo_kl", "trust_region_bounds": 0.001},
            {"delta": 1.5},
            {"inference_veto_threshold": 0.3},
            {"aggregation": "token_sum"},
        ):
            out = GRPOLoss(token_policy(), kl_to_ref_coeff=0.1, **kwargs)(batch)
            assert not torch.isclose(out.loss_objective, base.loss_objective), kwargs
        unbiased = GRPOLoss(token_policy(), kl_to_ref_coeff=0.1, kl_to_ref_unbiased=True)(batch)
        assert not torch.isclose(unbiased.loss_kl_to_ref, base.loss_kl_to_ref)

    def test_unbiased_kl_changes_the_gradient_on_policy(self):
        """r = 1 in value, not in gradient (TRL's note): the values agree, the gradients not."""
        policy = token_policy()
        batch = token_batch()
        logits = policy.module[0](batch.copy())["logits"]
        batch["tokens_log_prob"] = (
            torch.distributions.Categorical(logits=logits).log_prob(batch["tokens"]).detach()
        )
        plain = GRPOLoss(policy, kl_to_ref_coeff=0.1, entropy_bonus=False)
        unbiased = GRPOLoss(
            policy, kl_to_ref_coeff=0.1, entropy_bonus=False, kl_to_ref_unbiased=True
        )
        a, b = plain(batch).loss_kl_to_ref, unbiased(batch).loss_kl_to_ref
        torch.testing.assert_close(a, b)
        weight = policy.module[0].module.weight
        (ga,), (gb,) = torch.autograd.grad(a, [weight]), torch.autograd.grad(b, [weight])
        assert not torch.allclose(ga, gb)

    def test_dppo_is_measured_against_the_proximal_policy(self):
        batch = known_batch()
        batch["proximal_log_prob"] = torch.tensor([[0.5, 0.55, 0.75], [0.25, 0.4, 0.5]]).log()
        out = GRPOLoss(
            known_policy(), trust_region="dppo_tv", trust_region_bounds=0.01, decoupled=True
        )(batch)
        assert out.trust_region_masked_fraction.item() == 0.0  # p = p_prox: nothing moved

    def test_luspo_is_gspo_times_the_length(self):
        batch = token_batch(b=4, t=5, drift=0.002)
        batch["mask"] = torch.ones(4, 5, dtype=torch.bool)  # equal lengths: L = 5 x GSPO's
        gspo = GRPOLoss(
            token_policy(),
            ratio_level="sequence",
            clip_epsilon=(2e-3, 2.5e-3),
            aggregation="seq_mean_token_mean",
            entropy_coeff=0.0,
        )
        luspo = LUSPOLoss(token_policy())
        torch.testing.assert_close(
            luspo(batch).loss_objective, 5 * gspo(batch).loss_objective, rtol=1e-6, atol=1e-7
        )


class TestWiring:
    def test_keys(self):
        loss = GRPOLoss(
            token_policy(),
            inference_veto_threshold=0.5,
            trust_region="dppo_kl",
            entropy_target=1.0,
        )
        assert "inference_log_prob" in loss.in_keys
        for key in (
            "inference_vetoed_fraction",
            "trust_region_masked_fraction",
            "entropy_coeff",
            "inference_chi2_token",
            "inference_seq_max_k3_max",
        ):
            assert key in loss.out_keys
        out = loss(token_batch())
        assert set(loss.out_keys) <= {k for k, v in out.items()}
        assert "inference_chi2_token" not in GRPOLoss(token_policy()).out_keys

    def test_veto_needs_the_inference_log_probs(self):
        batch = token_batch().exclude("inference_log_prob")
        with pytest.raises(KeyError, match=r"\(for InferenceVeto\)"):
            GRPOLoss(token_policy(), inference_veto_threshold=0.5)(batch)

    def test_schedulable(self):
        loss = GRPOLoss(token_policy(), trust_region="dppo_tv", delta=4.0)
        loss.trust_region_high = 0.3
        loss.delta = 2.0
        assert loss.trust_region_high.item() == pytest.approx(0.3)
        with pytest.raises(ValueError, match="delta must be greater than 1"):
            loss.delta = 0.5
        with pytest.raises(ValueError, match="trust_region_low must be positive"):
            loss.trust_region_low = 0.0

    def test_callable_trust_region(self):
        loss = GRPOLoss(known_policy(), trust_region=dppo_tv_mask, trust_region_bounds=(0.1, 0.1))
        assert loss(known_batch()).trust_region_masked_fraction.item() == pytest.approx(0.4)

    def test_presets(self):
        policy = token_policy()
        assert DPPOLoss(policy).clip_bounds[0].item() == -math.inf  # CISPO without lower bound
        assert VESPOLoss(policy, vespo_k=(1.0, 1.0))(token_batch()).loss_objective.isfinite()

    @pytest.mark.parametrize(
        "kwargs, match",
        [
            (dict(delta=3.0, clip_ratio_c=3.0), "pass one"),
            (dict(delta=3.0, objective="cispo"), "objective='clip' only"),
            (dict(delta=1.0), "delta must be greater than 1"),
            (dict(clip_ratio_c=3.0, objective="vespo", ratio_level="sequence_sum"), "not VESPO"),
            (dict(objective="vespo"), "ratio_level='sequence_sum'"),
            (dict(vespo_k=(1.0, 1.0)), "apply to objective='vespo'"),
            (dict(objective="vespo", ratio_level="sequence_sum", vespo_k=(1.0,)), "pairs"),
            (dict(trust_region_bounds=0.1), "needs a trust_region"),
            (dict(trust_region=dppo_tv_mask), "needs trust_region_bounds"),
            (dict(trust_region="dppo"), "Unknown trust_region"),
            (dict(trust_region="dppo_tv", trust_region_bounds=-0.1), "must be positive"),
            (dict(kl_to_ref_unbiased=True), "set kl_to_ref_coeff"),
            (dict(inference_veto_threshold=0.0), "must be positive"),
        ],
    )
    def test_errors(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            GRPOLoss(token_policy(), **kwargs)


class TestReviewEdges:
    def test_a_variant_off_at_construction_stays_off(self):
        loss = GRPOLoss(token_policy(), objective="cispo")
        with pytest.raises(ValueError, match="delta was off"):
            loss.delta = 4.0  # would have replaced CISPO by PPO's clip, unchecked
        with pytest.raises(ValueError, match="inference_veto_threshold was off"):
            loss.inference_veto_threshold = 0.1
        assert loss.delta is None
        on = GRPOLoss(token_policy(), kl_to_ref_coeff=0.0)
        on.kl_to_ref_coeff = 0.1  # built on (at 0): schedulable
        assert on.kl_to_ref_coeff.item() == pytest.approx(0.1)

    def test_vespo_keeps_the_dtype(self):
        log_prob = torch.zeros(2, 3, dtype=torch.bfloat16, requires_grad=True)
        adv = torch.tensor([[1.0], [-1.0]], dtype=torch.bfloat16)
        loss = vespo_loss(torch.zeros(2, 3, dtype=torch.bfloat16), adv, log_prob)
        assert loss.dtype == torch.bfloat16

    def test_mismatch_statistics_in_half_precision(self):
        log_w = torch.full((2, 3), 15.0, dtype=torch.float16)  # e^(2 * 20) overflows float16
        mask = torch.tensor([[True, True, True], [False, False, False]])  # an empty row
        stats = inference_mismatch(log_w, mask)
        assert all(torch.isfinite(v) for v in stats.values())
        assert stats["chi2_sequence"].item() == pytest.approx(math.exp(40.0) - 1, rel=1e-3)

    def test_evaluations_do_not_move_the_adaptive_entropy(self):
        loss = GRPOLoss(token_policy(), entropy_target=1.0)
        with torch.no_grad():
            loss(token_batch())
        assert loss.adaptive_entropy.window.tolist() == [0.0, 0.0]
        loss(token_batch())
        assert loss.adaptive_entropy.window.dtype == torch.float64
        assert loss.adaptive_entropy.window[1].item() == token_batch()["mask"].sum().item()
