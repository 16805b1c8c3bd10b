"""Tests of :mod:`torchrl_grpo.loss_terms.rejection` against hand-computed values and against the
reference implementations' formulas, written out here from their sources (not imported):
verl 0.9.0 (verl's ``trainer.ppo.rollout_corr_helper``: ``compute_rollout_rejection_mask`` and
its threshold parsing, ``compute_offpolicy_metrics``; ``core_algos.py``:
``compute_policy_loss_dppo_tv`` / ``_dppo_kl``'s ``pg_clipfrac_lower``) and TRL
(``grpo_trainer.py``, main of 2026-07-24: ``get_gamma_weights`` and ``vespo/phi_seq_mean``).
Random ragged batches hold ``nan`` in their padding."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.references import verl_dppo

from torchrl_grpo.loss_terms.rejection import (
    REJECTION_MODES,
    RejectionMode,
    dppo_truncation_fraction,
    perplexity_metrics,
    rejection_mask,
    vespo_phi_sequence_mean,
)
from torchrl_grpo.loss_terms.selection import dppo_kl_mask, dppo_tv_mask, sequence_veto_mask


def ragged_batch(b=8, t=7, scale=0.3, seed=0, empty_row=False):
    """Trainer and inference log-probs ``(B, T)`` with ``nan`` in the padding, and the mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t  # one full row
    if empty_row:
        lengths[-1] = 0
    mask = torch.arange(t) < lengths[:, None]  # (B, T)
    inference = -torch.rand(b, t, generator=g) * 3.0
    trainer = inference + scale * torch.randn(b, t, generator=g)
    nan = torch.tensor(float("nan"))
    return torch.where(mask, trainer, nan), torch.where(mask, inference, nan), mask


# --- verl 0.9.0, rollout_corr_helper.py --------------------------------------------------------


def verl_masked_sum(values, mask, axis=None):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def verl_masked_mean(values, mask, axis=None):
    return verl_masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def verl_parse_thresholds(options, threshold_spec):
    """_parse_rollout_rs_thresholds: one spec shared or one per option; k1: lower_upper."""
    if isinstance(threshold_spec, int | float):
        raw_specs = [str(threshold_spec)]
    else:
        raw_specs = [part.strip() for part in threshold_spec.split(",") if part.strip()]
    assert len(raw_specs) in (1, len(options))
    if len(raw_specs) == 1 and len(options) > 1:
        raw_specs = raw_specs * len(options)
    thresholds = {}
    for option, spec in zip(options, raw_specs, strict=False):
        if option.endswith("k1"):
            if "_" in spec:
                lower_str, upper_str = spec.split("_", 1)
            else:
                upper_str = spec
                lower_str = str(1.0 / float(upper_str))
            thresholds[option] = {"lower": float(lower_str), "upper": float(upper_str)}
        else:
            thresholds[option] = {"lower": None, "upper": float(spec)}
    return thresholds


def verl_sequence_stat(option_name, token_stat, response_mask):
    if option_name.startswith("seq_sum"):
        return verl_masked_sum(token_stat, response_mask, axis=-1)
    if option_name.startswith("seq_mean"):
        return verl_masked_mean(token_stat, response_mask, axis=-1)
    neg_inf = torch.tensor(float("-inf"), dtype=token_stat.dtype)
    max_values = token_stat.masked_fill(~response_mask.bool(), neg_inf).max(dim=-1).values
    return torch.where(max_values == neg_inf, torch.zeros_like(max_values), max_values)


def verl_rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold):
    """compute_rollout_rejection_mask's modified_response_mask (float response_mask)."""
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    specs = verl_parse_thresholds(options, rollout_rs_threshold)
    log_ratio_safe = torch.clamp(log_ratio, min=-20.0, max=20.0)
    token_stats = {
        "k1": -log_ratio_safe,
        "k2": 0.5 * log_ratio_safe**2,
        "k3": torch.exp(log_ratio_safe) - 1.0 - log_ratio_safe,
    }
    combined_mask = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    for option_name in options:
        upper, lower = specs[option_name]["upper"], specs[option_name]["lower"]
        stat = token_stats[option_name[-2:]]
        if not option_name.startswith("token"):
            stat = verl_sequence_stat(option_name, stat, response_mask).unsqueeze(-1)
        if option_name.endswith("k1"):
            keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            keep = stat <= upper
        combined_mask = combined_mask * keep.expand_as(response_mask).to(log_ratio.dtype)
    return (response_mask * combined_mask).to(dtype=response_mask.dtype)


def verl_offpolicy_ppl_metrics(old_log_prob, rollout_log_prob, response_mask):
    """compute_offpolicy_metrics, its perplexity part."""
    metrics = {}
    mean_log_prob_training = verl_masked_mean(old_log_prob, response_mask, axis=-1)
    metrics["training_ppl"] = torch.exp(-mean_log_prob_training).mean()
    metrics["training_log_ppl"] = (-mean_log_prob_training).mean()
    mean_log_prob_rollout = verl_masked_mean(rollout_log_prob, response_mask, axis=-1)
    metrics["rollout_ppl"] = torch.exp(-mean_log_prob_rollout).mean()
    metrics["rollout_log_ppl"] = (-mean_log_prob_rollout).mean()
    log_ppl_diff = mean_log_prob_rollout - mean_log_prob_training
    metrics["log_ppl_diff"] = log_ppl_diff.mean()
    metrics["log_ppl_abs_diff"] = log_ppl_diff.abs().mean()
    metrics["log_ppl_diff_max"] = log_ppl_diff.max()
    metrics["log_ppl_diff_min"] = log_ppl_diff.min()
    metrics["ppl_ratio"] = torch.exp(log_ppl_diff).mean()
    return metrics


ALL_MODES = sorted(REJECTION_MODES)


class TestRejectionModes:
    # row 0: d = 0, log 3 | row 1: d = 0.1, -0.1 | row 2: d = -log 2, (pad)
    LOG_W = torch.tensor([[0.0, math.log(3.0)], [0.1, -0.1], [-math.log(2.0), float("nan")]])
    MASK = torch.tensor([[True, True], [True, True], [True, False]])

    def test_the_modes_are_verls(self):
        assert set(REJECTION_MODES) == {
            *(f"token_k{k}" for k in (1, 2, 3)),
            *(f"seq_sum_k{k}" for k in (1, 2, 3)),
            *(f"seq_mean_k{k}" for k in (1, 2, 3)),
            "seq_max_k2",
            "seq_max_k3",
        }
        assert all(isinstance(mode, RejectionMode) for mode in REJECTION_MODES.values())

    @pytest.mark.parametrize("mode", ALL_MODES)
    @pytest.mark.parametrize("seed", [0, 1])
    def test_matches_verl(self, mode, seed):
        trainer, inference, mask = ragged_batch(b=16, t=9, scale=0.4, seed=seed, empty_row=True)
        log_w = trainer - inference
        # thresholds under which some tokens stay and some do not
        specs = {"k1": ["0.8_1.25", "0.5_1.1", "1.5"], "k2": ["0.02", "0.06", "0.3"]}
        specs["k3"] = specs["k2"]
        if mode.startswith("seq_sum"):
            specs = {"k1": ["0.3_3.0", "0.5_1.5", "2.0"], "k2": ["0.2", "0.6"], "k3": ["0.2", "1"]}
        partial = False
        for spec in specs[mode[-2:]]:
            want = verl_rejection_mask(log_w, mask.float(), mode, spec).bool()
            got = rejection_mask(log_w, mask, mode, spec)
            assert torch.equal(got, want), (mode, spec)
            partial |= bool(0 < got.sum() < mask.sum())
        assert partial, mode

    def test_hand_values_token_modes(self):
        token_k1 = REJECTION_MODES["token_k1"]
        # k1 = -d: 0, -1.099 | -0.1, 0.1 | 0.693; band [log 0.5, log 2] = [-0.693, 0.693]
        assert token_k1(self.LOG_W, self.MASK, None, 2.0).tolist() == [
            [True, False],
            [True, True],
            [True, False],  # log 2 sits on the bound; padding never stays
        ]
        # k2 = d^2 / 2: 0, 0.603 | 0.005, 0.005 | 0.240
        keep = REJECTION_MODES["token_k2"](self.LOG_W, self.MASK, None, 0.2)
        assert keep.tolist() == [[True, False], [True, True], [False, False]]
        # k3 = e^d - 1 - d: 0, 0.901 | 0.00517, 0.00484 | 0.193
        keep = REJECTION_MODES["token_k3"](self.LOG_W, self.MASK, None, 0.2)
        assert keep.tolist() == [[True, False], [True, True], [True, False]]

    def test_k1_band_is_on_the_inference_over_trainer_ratio(self):
        # verl's k1 = -log r: [0.5, 1.5] keeps pi_old / pi_inference in [1/1.5, 2]
        log_w = torch.tensor([[math.log(1.8), math.log(0.6), math.log(0.7)]])
        keep = REJECTION_MODES["token_k1"](log_w, torch.ones(1, 3, dtype=torch.bool), 0.5, 1.5)
        assert keep.tolist() == [[True, False, True]]

    def test_hand_values_sequence_modes(self):
        def rows(name, high, low=None):
            return REJECTION_MODES[name](self.LOG_W, self.MASK, low, high)[:, 0].tolist()

        # sums of k1: -log 3, 0, log 2; band [1/2.5, 2.5] = [-0.916, 0.916] in log
        assert rows("seq_sum_k1", 2.5) == [False, True, True]
        # means of k1: -0.549, 0, 0.693; band [0.6, 1.9] = [-0.511, 0.642]
        assert rows("seq_mean_k1", 1.9, 0.6) == [False, True, False]
        # sums of k2: 0.603, 0.01, 0.240 | means: 0.302, 0.005, 0.240 | max: 0.603, 0.005, 0.240
        assert rows("seq_sum_k2", 0.5) == [False, True, True]
        assert rows("seq_mean_k2", 0.25) == [False, True, True]
        assert rows("seq_max_k2", 0.25) == [False, True, True]
        # k3: sums 0.901, 0.0100, 0.193 | means 0.451, 0.0050, 0.193 | max 0.901, 0.0052, 0.193
        assert rows("seq_sum_k3", 0.01) == [False, False, False]
        assert rows("seq_sum_k3", 0.011) == [False, True, False]
        assert rows("seq_mean_k3", 0.5) == [True, True, True]
        assert rows("seq_max_k3", 0.5) == [False, True, True]

    def test_sequence_modes_reject_whole_sequences(self):
        trainer, inference, mask = ragged_batch(b=12, scale=0.5, seed=3)
        for name in ALL_MODES:
            if name.startswith("seq"):
                keep = REJECTION_MODES[name](trainer - inference, mask, None, 1.2)
                kept_rows = keep.any(-1, keepdim=True)
                assert torch.equal(keep, mask & kept_rows), name

    def test_seq_max_k3_is_the_veto(self):
        trainer, inference, mask = ragged_batch(b=16, scale=0.5, seed=4, empty_row=True)
        for tau in (0.05, 0.2, 1.0):
            got = REJECTION_MODES["seq_max_k3"](trainer - inference, mask, None, tau)
            assert torch.equal(got, sequence_veto_mask(trainer - inference, mask, tau))

    def test_empty_row_and_padding(self):
        # the empty row's statistics are 0, outside the k1 band [1.1, 2]: it stays empty
        log_w = torch.tensor([[-0.5, float("nan")], [float("inf"), float("nan")]])
        mask = torch.tensor([[True, False], [False, False]])
        for name in ALL_MODES:
            keep = REJECTION_MODES[name](log_w, mask, 1.1 if "k1" in name else None, 2.0)
            assert keep.tolist() == [[True, False], [False, False]], name

    def test_no_gradient_and_float16(self):
        log_w = torch.tensor([[25.0, 0.0]], dtype=torch.float16, requires_grad=True)
        keep = REJECTION_MODES["token_k3"](log_w, torch.ones(1, 2, dtype=torch.bool), None, 1.0)
        assert keep.tolist() == [[False, True]] and not keep.requires_grad

    def test_bad_bounds_raise(self):
        mask = torch.ones(1, 1, dtype=torch.bool)
        log_w = torch.zeros(1, 1)
        with pytest.raises(ValueError, match="upper bound only, got low=0.5"):
            REJECTION_MODES["seq_max_k2"](log_w, mask, 0.5, 2.0)
        with pytest.raises(ValueError, match="0 < low <= high, got low=3.0, high=2.0"):
            REJECTION_MODES["token_k1"](log_w, mask, 3.0, 2.0)
        with pytest.raises(ValueError, match="must be positive, got high=0.0"):
            REJECTION_MODES["token_k3"](log_w, mask, None, 0.0)
        with pytest.raises(ValueError, match="mask has shape"):
            REJECTION_MODES["token_k3"](log_w, torch.ones(2, 1, dtype=torch.bool), None, 1.0)


class TestRejectionMask:
    def test_chained_matches_verl(self):
        # verl's own test case: "token_k1,seq_max_k3" with "0.4_1.8,3.0", and others
        trainer, inference, mask = ragged_batch(b=16, t=9, scale=0.6, seed=5, empty_row=True)
        log_w = trainer - inference
        for modes, spec in [
            ("token_k1,seq_max_k3", "0.4_1.8,3.0"),
            ("token_k1,seq_max_k2", "0.5_2.0,0.4"),
            ("seq_mean_k1, seq_sum_k3,token_k2", "0.8_1.3,2.0,0.5"),
            ("seq_mean_k3,token_k3", 0.3),
        ]:
            want = verl_rejection_mask(log_w, mask.float(), modes, spec).bool()
            got = rejection_mask(log_w, mask, modes, spec)
            assert torch.equal(got, want), (modes, spec)
            assert 0 < got.sum() < mask.sum(), (modes, spec)  # both kinds of token

    def test_is_the_and_of_the_modes(self):
        trainer, inference, mask = ragged_batch(b=10, scale=0.6, seed=6)
        log_w = trainer - inference
        token = REJECTION_MODES["token_k1"](log_w, mask, 0.5, 2.0)
        sequence = REJECTION_MODES["seq_max_k2"](log_w, mask, None, 0.3)
        chained = rejection_mask(log_w, mask, ["token_k1", "seq_max_k2"], ["0.5_2.0", 0.3])
        assert torch.equal(chained, token & sequence)
        assert not torch.equal(chained, token) and not torch.equal(chained, sequence)

    def test_threshold_forms(self):
        trainer, inference, mask = ragged_batch(b=10, scale=0.6, seed=7)
        log_w = trainer - inference
        want = rejection_mask(log_w, mask, "token_k1,seq_sum_k2", "0.5_2.0,0.5")
        assert torch.equal(rejection_mask(log_w, mask, "token_k1,seq_sum_k2", [2.0, "0.5"]), want)
        # one threshold shared; duplicates dropped (so one entry per distinct mode)
        shared = rejection_mask(log_w, mask, "token_k3, seq_mean_k3", 0.1)
        twice = rejection_mask(log_w, mask, "token_k3,seq_mean_k3,token_k3", "0.1,0.1")
        assert torch.equal(shared, twice)

    def test_errors(self):
        log_w, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
        with pytest.raises(ValueError, match=r"unknown \['seq_max_k1'\]"):
            rejection_mask(log_w, mask, "token_k1,seq_max_k1", 2.0)
        with pytest.raises(ValueError, match="none given"):
            rejection_mask(log_w, mask, " , ", 2.0)
        with pytest.raises(ValueError, match="2 thresholds"):
            rejection_mask(log_w, mask, "token_k1,token_k2,token_k3", "2.0,0.1")
        with pytest.raises(ValueError, match="upper bound only"):
            rejection_mask(log_w, mask, "token_k1,seq_max_k2", "0.5_2.0")


class TestPerplexityMetrics:
    def test_matches_verl(self):
        trainer, inference, mask = ragged_batch(b=16, t=9, scale=0.5, seed=8)
        want = verl_offpolicy_ppl_metrics(trainer, inference, mask.float())
        got = perplexity_metrics(trainer, inference, mask)
        assert set(got) == set(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], msg=key)

    def test_hand_values(self):
        # row 0: trainer -1, -3 (mean -2), inference -1, -1 (mean -1) | row 1: -2, -2, (pad)
        trainer = torch.tensor([[-1.0, -3.0], [-2.0, float("nan")]])
        inference = torch.tensor([[-1.0, -1.0], [-2.0, 7.0]])
        stats = perplexity_metrics(trainer, inference, torch.tensor([[1, 1], [1, 0]]).bool())
        e = math.e
        expected = {
            "training_ppl": e**2,
            "training_log_ppl": 2.0,
            "rollout_ppl": (e + e**2) / 2,
            "rollout_log_ppl": 1.5,
            "log_ppl_diff": 0.5,
            "log_ppl_abs_diff": 0.5,
            "log_ppl_diff_max": 1.0,
            "log_ppl_diff_min": 0.0,
            "ppl_ratio": (e + 1) / 2,
        }
        for key, value in expected.items():
            assert stats[key].item() == pytest.approx(value, rel=1e-6), key

    def test_empty_row_is_not_counted(self):
        trainer, inference, mask = ragged_batch(b=9, scale=0.5, seed=9, empty_row=True)
        got = perplexity_metrics(trainer, inference, mask)
        want = perplexity_metrics(trainer[:-1], inference[:-1], mask[:-1])
        for key in want:
            torch.testing.assert_close(got[key], want[key], msg=key)
        # verl counts it: a perplexity of 1 and a difference of 0
        verl = verl_offpolicy_ppl_metrics(trainer, inference, mask.float())
        assert verl["log_ppl_diff_max"].item() >= 0.0

    def test_detached(self):
        trainer, inference, mask = ragged_batch(seed=10)
        trainer.requires_grad_(True)
        stats = perplexity_metrics(trainer, inference, mask)
        assert not any(value.requires_grad for value in stats.values())
        assert all(value.isfinite() for value in stats.values())


# --- verl 0.9.0, core_algos.py: DPPO (its transcription: helpers.references.verl_dppo) ----------


class TestDppoTruncationFraction:
    @pytest.mark.parametrize(
        "mode, trust_region, bound", [("tv", dppo_tv_mask, 0.2), ("kl", dppo_kl_mask, 0.1)]
    )
    def test_matches_verl(self, mode, trust_region, bound):
        # the ratio pi_theta / pi_old far from 1, so that the cap C = 3 (verl's default) bites
        old, log_prob, mask = ragged_batch(b=16, t=9, scale=1.5, seed=11)
        adv = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
        _, _, want = verl_dppo(log_prob, old, adv, mask.float(), mode, bound, bound, 3.0)
        keep = trust_region(log_prob, old, adv, mask, bound, bound)
        got = dppo_truncation_fraction(log_prob - old, keep, mask, 3.0)
        torch.testing.assert_close(got, want)
        assert 0 < got < 1

    def test_hand_values(self):
        # ratios 1, 4, 5, (pad): over the 3 real tokens, the 4 is kept and above C = 3
        log_r = torch.tensor([[0.0, math.log(4.0), math.log(5.0), float("nan")]])
        mask = torch.tensor([[True, True, True, False]])
        keep = torch.tensor([[True, True, False, True]])
        assert dppo_truncation_fraction(log_r, keep, mask, 3.0).item() == pytest.approx(1 / 3)
        assert dppo_truncation_fraction(log_r, mask, mask, 3.0).item() == pytest.approx(2 / 3)
        # the recipe's C = 10^4 truncates nothing; log-ratios clamped at 20: e^20 < 10^9
        huge = torch.tensor([[30.0]])
        one = torch.ones(1, 1, dtype=torch.bool)
        assert dppo_truncation_fraction(log_r, mask, mask, 1e4) == 0
        assert dppo_truncation_fraction(huge, one, one, 1e9) == 0


# --- TRL, grpo_trainer.py: VESPO ---------------------------------------------------------------


def trl_phi_seq_mean(advantages, log_ratio_per_token, mask, k_pos, lambda_pos, k_neg, lambda_neg):
    """get_gamma_weights (no vLLM ratio), then the metric global_masked_mean(phi_seq) of a
    (B, 1) tensor: the plain mean over the rows."""
    lower_clamp = math.log(1e-8)
    log_ratio_clamped = torch.clamp(log_ratio_per_token, -20.0, 20.0)
    seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
    log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
    w_seq = torch.exp(log_w_seq)
    is_nonneg_adv = advantages >= 0
    k_seq = torch.where(is_nonneg_adv, k_pos, k_neg)
    lambda_seq = torch.where(is_nonneg_adv, lambda_pos, lambda_neg).clamp(min=1e-4)
    log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
    phi_seq = torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return phi_seq.sum() / max(float(phi_seq.shape[0]), 1.0)


class TestVespoPhiSequenceMean:
    @pytest.mark.parametrize("k, lam", [((2.0, 3.0), (3.0, 2.0)), ((1.0, 4.0), (0.5, 0.0))])
    def test_matches_trl(self, k, lam):
        trainer, old, mask = ragged_batch(b=16, t=9, scale=0.3, seed=12)
        log_r = trainer - old
        adv = torch.randn(16, 1, generator=torch.Generator().manual_seed(2))
        adv[0] = 0.0  # A = 0 takes the A >= 0 kernel
        zero_padded = torch.where(mask, log_r, 0.0)  # TRL multiplies by the mask: no nan there
        want = trl_phi_seq_mean(adv, zero_padded, mask.float(), k[0], lam[0], k[1], lam[1])
        got = vespo_phi_sequence_mean(log_r, adv, mask, k[0], lam[0], k[1], lam[1])
        torch.testing.assert_close(got, want)
        assert not 0.99 < got < 1.01  # off-policy: the kernel is not 1

    def test_hand_values(self):
        # W = 1, 2, 2, and e^-30 clamped to 1e-8 (phi ~ 0)
        log_r = torch.tensor([[0.0, 0.0], [math.log(2.0), 0.0], [math.log(2.0), 0.0], [-30.0, 0]])
        mask = torch.ones(4, 2, dtype=torch.bool)
        adv = torch.tensor([[1.0], [1.0], [-1.0], [1.0]])
        want = (1.0 + 4.0 * math.exp(-3.0) + 8.0 * math.exp(-2.0) + 0.0) / 4
        assert vespo_phi_sequence_mean(log_r, adv, mask).item() == pytest.approx(want, rel=1e-5)
        on_policy = vespo_phi_sequence_mean(torch.zeros(4, 2), adv, mask)
        assert on_policy.item() == pytest.approx(1.0)

    def test_empty_row_is_not_counted(self):
        trainer, old, mask = ragged_batch(b=9, scale=0.3, seed=13, empty_row=True)
        adv = torch.randn(9, 1, generator=torch.Generator().manual_seed(3))
        got = vespo_phi_sequence_mean(trainer - old, adv, mask)
        want = vespo_phi_sequence_mean(trainer[:-1] - old[:-1], adv[:-1], mask[:-1])
        torch.testing.assert_close(got, want)
        assert got.isfinite() and not got.requires_grad

    def test_advantage_shape_is_checked(self):
        with pytest.raises(ValueError, match=r"advantage has shape \(3,\)"):
            vespo_phi_sequence_mean(torch.zeros(3, 2), torch.zeros(3), torch.ones(3, 2).bool())
