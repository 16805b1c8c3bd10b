"""The 2026 loss terms against the reference implementations' formulas, written out here from
their sources (not imported): verl 0.9.0 (``core_algos.py``: ``dppo_tv``, ``dppo_kl``,
``agg_loss("token-sum")``; ``rollout_corr_helper.py``: ``chi2_token``, ``chi2_seq``, the
``seq_max_k3`` rejection) and TRL 1.16.0 (``grpo_trainer.py``: ``delta``,
``use_bias_correction_kl``, ``loss_type="vespo"`` and ``"luspo"``). Values and gradients on a
random ragged batch, through GRPOLoss and its presets."""

import math

import pytest
import torch
from helpers.loss import token_batch, token_policy
from helpers.references import verl_dppo

from torchrl_grpo import DPPOLoss, GRPOLoss, LUSPOLoss, VESPOLoss
from torchrl_grpo.loss_terms import aggregate_token_sum, inference_mismatch, sequence_veto_mask


def masked_sum(x, mask):
    return (x * mask).sum()


def masked_mean(x, mask):
    return masked_sum(x, mask) / mask.sum()


def batch_and_log_prob(policy, drift=0.4, seed=2):
    """A ragged batch (no empty row) and the policy's log-probs of its tokens, with grad."""
    batch = token_batch(b=6, t=6, seed=seed, drift=drift)
    logits = policy.module[0](batch.copy())["logits"]
    log_prob = torch.distributions.Categorical(logits=logits).log_prob(batch["tokens"])
    # log pi_old near log pi_theta, so that every branch of the masks is taken
    batch["tokens_log_prob"] = log_prob.detach() + drift * torch.randn(
        log_prob.shape, generator=torch.Generator().manual_seed(seed)
    )
    return batch, log_prob


def check(loss, batch, log_prob, reference, key="loss_objective"):
    """GRPOLoss's term and its gradient against the reference's, on the same parameters."""
    params = list(loss.actor_network.parameters())
    got = loss(batch)[key]
    want = reference
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g_got = torch.autograd.grad(got, params, retain_graph=True)
    g_want = torch.autograd.grad(want, params)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def inputs(batch, log_prob):
    mask = batch["mask"].float()
    return log_prob, batch["tokens_log_prob"], batch["advantage"][:, None], mask


# --- verl 0.9.0 -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, bound", [("tv", 0.03), ("kl", 0.01)])
def test_dppo_matches_verl(mode, bound):
    policy = token_policy()
    batch, log_prob = batch_and_log_prob(policy, drift=0.8)  # probabilities near 1/7
    loss = DPPOLoss(policy, trust_region=f"dppo_{mode}", trust_region_bounds=bound)
    want, clipfrac, _ = verl_dppo(*inputs(batch, log_prob), mode, bound, bound, 10000.0)
    assert 0.0 < clipfrac < 1.0  # both kinds of token
    check(loss, batch, log_prob, want)
    torch.testing.assert_close(loss(batch).trust_region_masked_fraction, clipfrac)


def test_dppo_default_bounds_are_the_recipes():
    policy = token_policy()
    assert DPPOLoss(policy).trust_region_high.item() == pytest.approx(0.15)
    assert DPPOLoss(policy, trust_region="dppo_kl").trust_region_low.item() == pytest.approx(0.05)


def test_token_sum_matches_verl():
    """agg_loss(loss_agg_mode="token-sum", dp_size) = masked_sum * dp_size: GRPOLoss's
    token_sum, and the DDP scaling normalize_gradients(..., ranks=dp_size) applies."""
    g = torch.Generator().manual_seed(0)
    loss_mat, mask = torch.randn(4, 5, generator=g), torch.rand(4, 5, generator=g) > 0.3
    for dp_size in (1, 2, 4):
        verl = masked_sum(loss_mat, mask.float()) * dp_size
        torch.testing.assert_close(aggregate_token_sum(loss_mat, mask) * dp_size, verl)


def verl_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask):
    """verl's compute_offpolicy_metrics: chi2_token and chi2_seq (SAFETY_BOUND = 20)."""
    log_ratio = old_log_prob - rollout_log_prob
    rho_token = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    chi2_token = masked_mean(rho_token.square(), response_mask) - 1.0
    log_ratio_sum = masked_sum_rows(log_ratio, response_mask)
    rho_squared_seq = torch.exp(2.0 * torch.clamp(log_ratio_sum, min=-20.0, max=20.0))
    return chi2_token, rho_squared_seq.mean() - 1.0


def masked_sum_rows(x, mask):
    return (x * mask).sum(-1)


def verl_seq_max_k3(old_log_prob, rollout_log_prob, response_mask, upper):
    """verl's compute_rollout_rejection_mask, option seq_max_k3: k3 = e^r - 1 - r per token,
    the max over the valid tokens (-inf masked, empty -> 0), kept when <= upper."""
    r = old_log_prob - rollout_log_prob
    token_k3 = torch.exp(r) - 1 - r
    masked = torch.where(response_mask.bool(), token_k3, -torch.inf)
    seq_stat = masked.amax(-1)
    seq_stat = torch.where(response_mask.bool().any(-1), seq_stat, 0.0)
    return (seq_stat <= upper).unsqueeze(-1).expand_as(response_mask) & response_mask.bool()


def test_mismatch_statistics_and_veto_match_verl():
    batch = token_batch(b=6, t=6, drift=0.5)
    old, inference, mask = batch["tokens_log_prob"], batch["inference_log_prob"], batch["mask"]
    chi2_token, chi2_seq = verl_offpolicy_metrics(old, inference, mask.float())
    stats = inference_mismatch(old - inference, mask)
    torch.testing.assert_close(stats["chi2_token"], chi2_token)
    torch.testing.assert_close(stats["chi2_sequence"], chi2_seq)  # no empty row here
    for upper in (0.2, 0.5, 1.0):
        want = verl_seq_max_k3(old, inference, mask.float(), upper)
        assert 0 < want.any(-1).sum() < 6 or upper == 1.0
        assert torch.equal(sequence_veto_mask(old - inference, mask, upper), want)


# --- TRL 1.16.0 -------------------------------------------------------------------------------


def trl_coef_1(log_prob, old_log_prob, mask, level):
    log_ratio = log_prob - old_log_prob
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    return torch.exp(log_importance_weights)


def trl_clipped(coef_1, advantages, epsilon_low, epsilon_high, delta):
    """TRL's per-token loss of loss_type grpo / dapo / luspo, with its two-sided clip."""
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    return -torch.min(per_token_loss1, per_token_loss2)


@pytest.mark.parametrize("delta", [1.1, 1.5, 4.0])
def test_two_sided_clip_matches_trl(delta):
    policy = token_policy()
    batch, log_prob = batch_and_log_prob(policy, drift=0.8)
    lp, old, adv, mask = inputs(batch, log_prob)
    per_token = trl_clipped(trl_coef_1(lp, old, mask, "token"), adv, 0.2, 0.28, delta)
    want = masked_sum(per_token, mask) / mask.sum()  # "dapo": over the active tokens
    loss = GRPOLoss(policy, clip_epsilon=(0.2, 0.28), delta=delta, entropy_bonus=False)
    check(loss, batch, log_prob, want)


def test_unbiased_kl_matches_trl():
    policy = token_policy()
    batch, log_prob = batch_and_log_prob(policy)
    lp, old, _, mask = inputs(batch, log_prob)
    ref = batch["ref_log_prob"]
    per_token_kl = torch.exp(ref - lp) - (ref - lp) - 1
    per_token_kl = per_token_kl * trl_coef_1(lp, old, mask, "token")  # use_bias_correction_kl
    want = 0.1 * masked_sum(per_token_kl, mask) / mask.sum()
    loss = GRPOLoss(policy, kl_to_ref_coeff=0.1, kl_to_ref_unbiased=True, entropy_bonus=False)
    check(loss, batch, log_prob, want, key="loss_kl_to_ref")
    plain = GRPOLoss(policy, kl_to_ref_coeff=0.1, entropy_bonus=False)(batch).loss_kl_to_ref
    assert not torch.allclose(plain, want)  # off-policy: the weighting changes the value


def trl_vespo(log_prob, old_log_prob, advantages, mask, k_pos, lambda_pos, k_neg, lambda_neg):
    """TRL's get_gamma_weights and the vespo per-token loss (no vLLM importance ratio)."""
    with torch.no_grad():
        lower_clamp = math.log(1e-8)
        log_ratio_clamped = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
        seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
        log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
        w_seq = torch.exp(log_w_seq)
        is_nonneg_adv = advantages >= 0
        k_seq = torch.where(is_nonneg_adv, k_pos, k_neg)
        lambda_seq = torch.where(is_nonneg_adv, lambda_pos, lambda_neg).clamp(min=1e-4)
        log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
        phi_seq = torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return -phi_seq * advantages * log_prob


@pytest.mark.parametrize("k, lam", [((2.0, 3.0), (3.0, 2.0)), ((1.0, 4.0), (0.5, 0.0))])
def test_vespo_matches_trl(k, lam):
    policy = token_policy()
    batch, log_prob = batch_and_log_prob(policy, drift=0.2)
    lp, old, adv, mask = inputs(batch, log_prob)
    per_token = trl_vespo(lp, old, adv, mask, k[0], lam[0], k[1], lam[1])
    want = masked_sum(per_token, mask) / mask.sum()
    check(VESPOLoss(policy, vespo_k=k, vespo_lambda=lam), batch, log_prob, want)


def test_luspo_matches_trl():
    policy = token_policy()
    batch, log_prob = batch_and_log_prob(policy, drift=0.002)  # inside and outside the band
    lp, old, adv, mask = inputs(batch, log_prob)
    coef_1 = trl_coef_1(lp, old, mask, "sequence")
    per_token_loss = trl_clipped(coef_1, adv, 2e-3, 2.5e-3, None).expand_as(mask)
    want = (per_token_loss * mask).sum(-1).mean()  # every row holds a real token here
    loss = LUSPOLoss(policy)
    check(loss, batch, log_prob, want)
    assert 0 < loss(batch).clip_fraction < 1
