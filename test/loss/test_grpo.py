"""Tests of torchrl_grpo/loss/grpo.py: GRPOLoss, its keys and buffers, and its terms on
classic-control actors and token policies, checked against ClipPPOLoss and hand-computed values.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers.loss import (
    NEUTRAL,
    REAL_P,
    REAL_RATIOS,
    bernoulli_entropy,
    cartpole_actor,
    cartpole_batch,
    check_equals_clip_ppo,
    known_batch,
    known_policy,
    neutral_batch,
    outputs_and_grads,
    pad,
    run_loss,
    token_batch,
    token_policy,
)
from tensordict import TensorDict
from torchrl.objectives import ClipPPOLoss

from torchrl_grpo.loss import (
    CISPOLoss,
    DAPOLoss,
    DrGRPOLoss,
    GRPOLoss,
    GRPOLossOutput,
    GSPOLoss,
    SAPOLoss,
)
from torchrl_grpo.token_dist import TokenCategorical


class TestGRPOLoss:
    def test_default_keys_resolve_like_clip_ppo(self):
        actor = cartpole_actor()
        loss, ppo = GRPOLoss(actor), ClipPPOLoss(actor)
        assert loss.tensor_keys.sample_log_prob == ppo.tensor_keys.sample_log_prob
        assert loss.tensor_keys.action == ppo.tensor_keys.action == "action"
        assert loss.tensor_keys.advantage == "advantage"
        assert set(loss.in_keys) >= {"observation", "action", "action_log_prob", "advantage"}

    @pytest.mark.parametrize("clip_epsilon", [0.2, (0.1, 0.3)])
    def test_equals_clip_ppo_loss(self, clip_epsilon):
        actor = cartpole_actor()
        batch = cartpole_batch(actor)
        ppo = ClipPPOLoss(actor, clip_epsilon=clip_epsilon, entropy_coeff=0.05)
        grpo = GRPOLoss(actor, clip_epsilon=clip_epsilon, entropy_coeff=0.05)
        check_equals_clip_ppo(ppo, grpo, batch, list(actor.parameters()))

    def test_equals_clip_ppo_loss_without_padding(self):
        batch = token_batch().exclude("mask")
        batch["advantage"] = torch.randn(3, 6, 1)
        policy = token_policy()
        ppo = ClipPPOLoss(policy, clip_epsilon=(0.2, 0.28), entropy_coeff=0.02)
        grpo = GRPOLoss(policy, clip_epsilon=(0.2, 0.28), entropy_coeff=0.02)
        ref, out = ppo(batch.clone()), grpo(batch.clone())
        assert ref["clip_fraction"] > 0
        for key in ("loss_objective", "loss_entropy", "entropy", "clip_fraction", "kl_approx"):
            torch.testing.assert_close(out.get(key), ref[key], msg=key)

    @pytest.mark.parametrize("masking_strategy", ["sft", "rlhf", "generic"])
    @pytest.mark.parametrize("clip_epsilon", [0.2, (0.2, 0.28)])
    def test_equals_torchrl_grpo_loss(
        self, tiny_llm, make_llm_batch, make_llm_scorer, masking_strategy, clip_epsilon
    ):
        from torchrl.objectives.llm import GRPOLoss as TorchrlGRPOLoss

        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        scorer = make_llm_scorer(model, tokenizer)
        kwargs = dict(masking_strategy=masking_strategy, clip_epsilon=clip_epsilon)
        ref, ref_grad = run_loss(TorchrlGRPOLoss(scorer, **kwargs), batch, model)
        out, grad = run_loss(GRPOLoss(scorer, **kwargs), batch, model)

        assert 0 < ref.clip_fraction < 1  # the comparison exercises clipping
        for key in ("loss_objective", "loss_entropy", "ESS"):
            torch.testing.assert_close(out[key], ref.get(key), rtol=1e-5, atol=1e-7, msg=key)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-7)

    def test_kl_mask_threshold_matches_torchrl_objective(
        self, tiny_llm, make_llm_batch, make_llm_scorer
    ):
        from torchrl.objectives.llm import GRPOLoss as TorchrlGRPOLoss

        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer, drift=0.5)
        scorer = make_llm_scorer(model, tokenizer)
        ref, ref_grad = run_loss(
            TorchrlGRPOLoss(scorer, kl_mask_threshold=0.05, entropy_bonus=False), batch, model
        )
        out, grad = run_loss(
            GRPOLoss(scorer, kl_mask_threshold=0.05, entropy_bonus=False), batch, model
        )
        plain = GRPOLoss(scorer, entropy_bonus=False)(batch.copy())
        assert out.loss_objective != plain.loss_objective  # some tokens were left out
        torch.testing.assert_close(out.loss_objective, ref.loss_objective, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-7)

    def test_output_type_and_out_keys(self):
        actor = cartpole_actor()
        loss = GRPOLoss(actor)
        out = loss(cartpole_batch(actor))
        assert isinstance(out, GRPOLossOutput)
        present = [k for k in out.to_tensordict().keys()]
        assert sorted(present) == sorted(loss.out_keys)
        assert out.kl_to_ref is None and out.loss_kl_to_inference is None
        assert out.loss_objective.requires_grad and not out.ESS.requires_grad

    def test_clip_epsilon_and_coefficients_are_schedulable_buffers(self):
        actor = cartpole_actor()
        batch = cartpole_batch(actor)
        batch["ref_log_prob"] = batch["action_log_prob"] - 0.1
        loss = GRPOLoss(actor, clip_epsilon=0.2, entropy_coeff=0.01, kl_to_ref_coeff=0.1)
        buffers = dict(loss.named_buffers())
        assert {"clip_epsilon", "entropy_coeff", "kl_to_ref_coeff"} <= set(buffers)
        before = loss(batch).clip_fraction
        loss.clip_epsilon = 0.05
        loss.entropy_coeff = 0.5
        loss.kl_to_ref_coeff = 0.0
        assert isinstance(loss._buffers["clip_epsilon"], torch.Tensor)
        assert loss.clip_epsilon.item() == pytest.approx(0.05)
        out = loss(batch)
        assert out.clip_fraction > before
        torch.testing.assert_close(out.loss_entropy, -0.5 * out.entropy)
        assert out.loss_kl_to_ref.item() == 0.0

    def test_asymmetric_clip_buffers_schedulable(self):
        loss = DAPOLoss(cartpole_actor())
        loss.clip_epsilon_high = 0.4
        assert loss.clip_epsilon_high.item() == pytest.approx(0.4)
        with pytest.raises(AttributeError, match="clip_epsilon_low"):
            loss.clip_epsilon = 0.3

    def test_scheduled_values_are_checked_as_at_construction(self):
        loss = GRPOLoss(token_policy(), tis_cap=2.0, top_entropy_quantile=0.5)
        for name, value, match in (
            ("clip_epsilon", -0.1, r"clip_epsilon must be in \[0, 1\] .*got -0.1"),
            ("clip_epsilon", 1.5, r"clip_epsilon must be in \[0, 1\] .*got 1.5"),
            ("tis_cap", 0.0, "tis_cap must be positive, got 0.0"),
            ("top_entropy_quantile", 2.0, r"top_entropy_quantile must be in \[0, 1\], got 2.0"),
        ):
            before = getattr(loss, name).clone()
            with pytest.raises(ValueError, match=match):
                setattr(loss, name, value)
            assert getattr(loss, name) == before
        loss.clip_epsilon = 1.0  # no lower bound, as at construction
        dapo = DAPOLoss(token_policy())
        with pytest.raises(ValueError, match="clip_epsilon_high must be non-negative"):
            dapo.clip_epsilon_high = -0.1
        assert dapo.clip_epsilon_high.item() == pytest.approx(0.28)

    @pytest.mark.parametrize(
        "key, why",
        [
            ("value_target", "GRPO has no critic"),
            ("value", "GRPO has no critic"),
            ("reward", "no value estimator"),
            ("done", "rewards_key and done_key"),
            ("terminated", "no value estimator"),
        ],
    )
    def test_set_keys_rejects_the_keys_nothing_reads(self, key, why):
        loss = GRPOLoss(cartpole_actor())
        with pytest.raises(ValueError, match=rf"GRPOLoss reads no '{key}' key: .*{why}"):
            loss.set_keys(advantage="adv", **{key: "x"})
        assert loss.tensor_keys.advantage == "advantage"  # nothing changed

    def test_schedulable_variant_coefficients(self):
        loss = GRPOLoss(token_policy(), clip_ratio_c=3.0, tis_cap=2.0, kl_to_inference_coeff=0.1)
        for name, value in (
            ("clip_ratio_c", 5.0),
            ("tis_cap", 1.5),
            ("kl_to_inference_coeff", 0.0),
        ):
            setattr(loss, name, value)
            assert name in dict(loss.named_buffers())
            assert getattr(loss, name).item() == value

    def test_schedulable_buffers(self):
        loss = GRPOLoss(
            token_policy(),
            inference_correction="token_mask",
            inference_correction_bounds=(0.5, 5.0),
            off_policy_mask_threshold=0.5,
            decoupled=True,
            behaviour_weight_cap=5.0,
            top_entropy_quantile=0.2,
        )
        for name, value in (
            ("inference_correction_low", 0.25),
            ("inference_correction_high", 4.0),
            ("off_policy_mask_threshold", 0.1),
            ("behaviour_weight_cap", 2.0),
            ("top_entropy_quantile", 0.5),
        ):
            setattr(loss, name, value)
            assert name in dict(loss.named_buffers())
            assert getattr(loss, name).item() == pytest.approx(value)
        assert loss.inference_correction_bounds == (
            loss.inference_correction_low,
            loss.inference_correction_high,
        )

    def test_in_and_out_keys(self):
        loss = GRPOLoss(token_policy(), kl_to_ref_coeff=0.1, tis_cap=2.0)
        assert set(loss.in_keys) == {
            "hidden",
            "tokens",
            "tokens_log_prob",
            "advantage",
            "mask",
            "ref_log_prob",
            "inference_log_prob",
        }
        loss.set_keys(mask="response_mask", ref_log_prob=("ref", "log_prob"))
        assert {"response_mask", ("ref", "log_prob")} <= set(loss.in_keys)
        out = loss(
            token_batch()
            .rename_key_("mask", "response_mask")
            .rename_key_("ref_log_prob", ("ref", "log_prob"))
        )
        assert sorted(k for k, v in out.items() if v is not None) == sorted(loss.out_keys)

    def test_keys(self):
        loss = GRPOLoss(
            token_policy(),
            inference_correction="token_mask",
            decoupled=True,
            mask_truncated_completions=True,
        )
        assert {"inference_log_prob", "proximal_log_prob", "truncated"} <= set(loss.in_keys)
        assert {
            "inference_masked_fraction",
            "behaviour_masked_fraction",
            "truncated_fraction",
        } <= set(loss.out_keys)
        batch = token_batch()
        batch["proximal_log_prob"] = batch["tokens_log_prob"] + 0.1
        batch["trunc"] = torch.tensor([False, True, False])
        loss.set_keys(proximal_log_prob="proximal_log_prob", truncated="trunc")
        out = loss(batch)
        assert sorted(k for k, v in out.items() if v is not None) == sorted(loss.out_keys)
        assert GRPOLoss(token_policy()).out_keys == [
            "loss_objective",
            "clip_fraction",
            "clip_fraction_low",
            "clip_fraction_high",
            "kl_approx",
            "ESS",
            "max_ratio",
            "mean_ratio",
            "entropy",
            "loss_entropy",
        ]

    def test_learns_a_bandit(self):
        # two actions, advantage +1 for action 1 and -1 for action 0: p(action 1) must grow
        actor = cartpole_actor()
        loss = GRPOLoss(actor, entropy_coeff=0.0)
        opt = torch.optim.Adam(loss.parameters(), lr=0.05)
        obs = torch.zeros(64, 4)

        def p1():
            with torch.no_grad():
                return actor.get_dist(TensorDict({"observation": obs[:1]}, [1])).probs[0, 1]

        start = p1()
        for _ in range(10):
            with torch.no_grad():
                batch = actor(TensorDict({"observation": obs}, [64]))
            batch["advantage"] = batch["action"].float().mul(2).sub(1).unsqueeze(-1)
            for _ in range(2):
                out = loss(batch)
                opt.zero_grad()
                out.loss_objective.backward()
                opt.step()
        assert p1() > start + 0.2

    def test_has_no_critic(self):
        actor = cartpole_actor()
        loss = GRPOLoss(actor)
        assert loss.critic_network is None
        with pytest.raises(NotImplementedError, match="no critic"):
            loss.make_value_estimator()
        with pytest.raises(TypeError, match="takes no 'critic_coeff': GRPO has no critic"):
            GRPOLoss(actor, critic_coeff=1.0)

    def test_reduction(self):
        actor = cartpole_actor()
        batch = cartpole_batch(actor, n=8)
        per_sample = GRPOLoss(actor, reduction="none")(batch).loss_objective
        assert per_sample.shape == (8,)
        torch.testing.assert_close(per_sample.mean(), GRPOLoss(actor)(batch).loss_objective)
        with pytest.raises(ValueError, match="reduction"):
            GRPOLoss(actor, reduction="sum")

    def test_token_categorical_path_equals_categorical_path(self):
        batch = pad(token_batch())
        losses = {}
        for dist in (torch.distributions.Categorical, TokenCategorical):
            policy = token_policy()
            policy.module[-1].distribution_class = dist  # same weights, another distribution
            losses[dist] = outputs_and_grads(DAPOLoss(policy, entropy_coeff=0.1), batch)
        (out_a, grads_a), (out_b, grads_b) = losses.values()
        for key, value in out_a.items():
            torch.testing.assert_close(out_b.get(key), value, atol=1e-6, rtol=1e-5, msg=key)
        for a, b in zip(grads_a, grads_b, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)

    def test_gradient_matches_finite_differences(self):
        # DAPO clip band + k3 KL to the reference + entropy bonus, in float64
        torch.manual_seed(3)
        batch = known_batch(torch.float64)
        batch["logits"] = torch.randn(2, 3, 2, dtype=torch.float64)
        batch["tokens_log_prob"] = torch.where(
            batch["mask"],
            batch["logits"].log_softmax(-1)[..., 0] + 0.3 * torch.randn(2, 3, dtype=torch.float64),
            float("nan"),
        )
        batch["ref_log_prob"] = batch["logits"].log_softmax(-1)[..., 0] - 0.2
        loss = DAPOLoss(known_policy(), entropy_coeff=0.1, kl_to_ref_coeff=0.3)

        def total(logits):
            td = batch.clone()
            td["logits"] = logits
            out = loss(td)
            return out.loss_objective + out.loss_entropy + out.loss_kl_to_ref

        logits = batch["logits"].clone().requires_grad_()
        assert torch.autograd.gradcheck(total, (logits,))
        ratios = (logits.log_softmax(-1)[..., 0] - batch["tokens_log_prob"]).exp()[batch["mask"]]
        assert ((ratios - 0.8).abs() > 1e-3).all() and ((ratios - 1.28).abs() > 1e-3).all()


def sapo(r, a, tau):
    """SAPO's per-token loss for one ratio, from its formula."""
    return -(4 / tau) / (1 + math.exp(-tau * (r - 1))) * a


SAPO_ROWS = [
    [sapo(r, 1.0, 1.0) for r in (1.0, 1.1, 1.5)],
    [sapo(r, -1.0, 1.05) for r in (0.5, 4.0)],
]


HAND_VALUES = [
    ("default: clip 0.2, token mean", GRPOLoss, {}, (-3.3 + 4.8) / 5),
    ("seq_mean_token_mean", GRPOLoss, {"aggregation": "seq_mean_token_mean"}, (-1.1 + 2.4) / 2),
    ("seq_mean_token_sum", GRPOLoss, {"aggregation": "seq_mean_token_sum"}, (-3.3 + 4.8) / 2),
    ("Dr. GRPO, L_max = 5", DrGRPOLoss, {"max_length": 5}, (-3.3 + 4.8) / 2 / 5),
    # dual clip caps the A < 0, r = 4 token at c |A| = 3
    ("dual clip c = 3", GRPOLoss, {"clip_ratio_c": 3.0}, (-3.3 + 0.8 + 3.0) / 5),
    # clip-higher: 1.5 is clipped at 1.28 instead of 1.2
    ("DAPO", DAPOLoss, {}, (-1.0 - 1.1 - 1.28 + 4.8) / 5),
    # sequence ratios (1 * 1.1 * 1.5)^(1/3) = 1.1817 -> clipped at 1.0004; sqrt(0.5 * 4) = 1.4142
    ("GSPO", GSPOLoss, {}, (-1.0004 + math.sqrt(2.0)) / 2),
    # -w A log p with w = clip(r, 0, 4)
    (
        "CISPO",
        CISPOLoss,
        {},
        (
            -(1.0 * math.log(0.5) + 1.1 * math.log(0.55) + 1.5 * math.log(0.75))
            + (0.5 * math.log(0.25) + 4.0 * math.log(0.4))
        )
        / 5,
    ),
    # TIS weights min(p_old / p_inf, 2): row 0 -> 2, 1, 1; row 1 -> 1, 0.5
    ("TIS cap 2", GRPOLoss, {"tis_cap": 2.0}, (-2.0 - 1.1 - 1.2 + 0.8 + 2.0) / 5),
    # KL-Mask: 0.5 log(r)^2 = 0, .005, .082 | .240, .961: the last two leave the loss
    ("kl_mask_threshold 0.1", GRPOLoss, {"kl_mask_threshold": 0.1}, (-1.0 - 1.1 - 1.2) / 3),
    # SAPO: -(4 / tau) sigmoid(tau (r - 1)) A, tau 1 (A > 0) or 1.05; token mean, then the
    # preset's mean over sequences
    ("SAPO objective", GRPOLoss, {"objective": "sapo"}, sum(map(sum, SAPO_ROWS)) / 5),
    ("SAPOLoss", SAPOLoss, {}, (sum(SAPO_ROWS[0]) / 3 + sum(SAPO_ROWS[1]) / 2) / 2),
    # inference ratios p_old / p_inf: 2, 1, 1 | 1, 0.5 (PPO losses -1, -1.1, -1.2 | 0.8, 4)
    (
        "token_truncate, (None, 3)",
        GRPOLoss,
        {"inference_correction": "token_truncate"},
        (-2.0 - 1.1 - 1.2 + 0.8 + 2.0) / 5,
    ),
    # IcePop-style band [0.5, 1.5]: the first token (2) leaves, 0.5 (on the bound) stays
    (
        "token_mask, (0.5, 1.5)",
        GRPOLoss,
        {"inference_correction": "token_mask", "inference_correction_bounds": (0.5, 1.5)},
        (0.0 - 1.1 - 1.2 + 0.8 + 2.0) / 5,
    ),
    # sequence ratios 2 * 1 * 1 = 2 | 1 * 0.5 = 0.5
    (
        "sequence_truncate, (None, 1.5)",
        GRPOLoss,
        {"inference_correction": "sequence_truncate", "inference_correction_bounds": (None, 1.5)},
        (-3.3 * 1.5 + 4.8 * 0.5) / 5,
    ),
    (
        "sequence_mask, (None, 3)",
        GRPOLoss,
        {"inference_correction": "sequence_mask"},
        (-3.3 * 2.0 + 4.8 * 0.5) / 5,
    ),
    (
        "sequence_mask, (None, 1.5)",
        GRPOLoss,
        {"inference_correction": "sequence_mask", "inference_correction_bounds": (None, 1.5)},
        (4.8 * 0.5) / 5,
    ),
    # decoupled: PPO on p / p_prox: -1, -1, -1.2 | 1, 2; times p_prox / p_old 1, 1.1, 1.2 | 0.5, 2
    ("decoupled", GRPOLoss, {"decoupled": True}, (-1.0 - 1.1 - 1.44 + 0.5 + 4.0) / 5),
    (
        "decoupled, cap 1.5",
        GRPOLoss,
        {"decoupled": True, "behaviour_weight_cap": 1.5},
        (-1.0 - 1.1 - 1.44 + 0.5 + 0.0) / 5,
    ),
    # entropies H(p): .6931 .6881 .5623 | .5623 .6730; quantile 0.6 = .6790, 0.4 = .6287;
    # unselected tokens are zeroed, still counted by the token mean
    ("top_entropy_quantile 0.4", GRPOLoss, {"top_entropy_quantile": 0.4}, (-1.0 - 1.1) / 5),
    (
        "top_entropy_quantile 0.6",
        GRPOLoss,
        {"top_entropy_quantile": 0.6},
        (-1.0 - 1.1 + 4.0) / 5,
    ),
    # the second sequence is flagged truncated: it leaves the loss and its denominator
    ("mask_truncated_completions", GRPOLoss, {"mask_truncated_completions": True}, -3.3 / 3),
]


class TestGRPOLossHandValues:
    @pytest.mark.parametrize(
        "cls, kwargs, expected", [v[1:] for v in HAND_VALUES], ids=[v[0] for v in HAND_VALUES]
    )
    def test_loss_objective(self, cls, kwargs, expected):
        out = cls(known_policy(), **kwargs)(known_batch())
        assert out.loss_objective.item() == pytest.approx(expected, abs=1e-6)

    def test_metrics(self):
        out = GRPOLoss(known_policy(), entropy_coeff=0.1)(known_batch())
        w = torch.tensor(REAL_RATIOS)
        assert out.clip_fraction.item() == pytest.approx(0.6)
        assert out.clip_fraction_low.item() == pytest.approx(0.2)
        assert out.clip_fraction_high.item() == pytest.approx(0.4)
        assert out.ESS.item() == pytest.approx((w.sum() ** 2 / (w**2).sum() / 5).item())
        assert out.kl_approx.item() == pytest.approx(-sum(map(math.log, REAL_RATIOS)) / 5)
        entropy = sum(map(bernoulli_entropy, REAL_P)) / 5
        assert out.entropy.item() == pytest.approx(entropy)
        assert out.loss_entropy.item() == pytest.approx(-0.1 * entropy)

    def test_kl_to_ref_k3(self):
        out = GRPOLoss(known_policy(), kl_to_ref_coeff=0.1)(known_batch())
        ref_over_p = [0.5 / 0.5, 0.5 / 0.55, 0.5 / 0.75, 0.5 / 0.25, 0.1 / 0.4]
        k3 = sum(x - 1 - math.log(x) for x in ref_over_p) / 5
        assert out.kl_to_ref.item() == pytest.approx(k3)
        assert out.loss_kl_to_ref.item() == pytest.approx(0.1 * k3)

    @pytest.mark.parametrize(
        "estimator, per_token",
        [
            ("k1", lambda lr: lr),
            ("k2", lambda lr: 0.5 * lr**2),
            ("k3", lambda lr: math.exp(-lr) - 1 + lr),
        ],
    )
    def test_kl_to_inference(self, estimator, per_token):
        loss = GRPOLoss(
            known_policy(), kl_to_inference_coeff=0.5, kl_to_inference_estimator=estimator
        )
        out = loss(known_batch())
        p_inf = [0.25, 0.5, 0.5, 0.5, 0.2]
        expected = sum(per_token(math.log(p / q)) for p, q in zip(REAL_P, p_inf, strict=True)) / 5
        assert out.kl_to_inference.item() == pytest.approx(expected, rel=1e-6)
        assert out.loss_kl_to_inference.item() == pytest.approx(0.5 * expected, rel=1e-6)

    def test_kl_to_inference_falls_back_to_sample_log_prob(self):
        batch = known_batch().exclude("inference_log_prob")
        out = GRPOLoss(known_policy(), kl_to_inference_coeff=1.0, kl_to_inference_estimator="k1")(
            batch
        )
        assert out.kl_to_inference.item() == pytest.approx(sum(map(math.log, REAL_RATIOS)) / 5)

    def test_reduction_none_gives_per_token_losses(self):
        out = GRPOLoss(known_policy(), reduction="none")(known_batch())
        expected = torch.tensor([[-1.0, -1.1, -1.2], [0.8, 4.0, 0.0]])
        torch.testing.assert_close(out.loss_objective, expected)


class TestVariantMetrics:
    """The variants' masked fractions and the tokens they zero, by hand."""

    def test_masked_fractions_by_hand(self):
        batch = known_batch()
        out = GRPOLoss(
            known_policy(),
            inference_correction="token_mask",
            inference_correction_bounds=(0.5, 1.5),
        )(batch)
        assert out.inference_masked_fraction.item() == pytest.approx(1 / 5)
        out = GRPOLoss(
            known_policy(),
            inference_correction="sequence_mask",
            inference_correction_bounds=(None, 1.5),
        )(batch)
        assert out.inference_masked_fraction.item() == pytest.approx(3 / 5)
        out = GRPOLoss(known_policy(), tis_cap=2.0)(batch)  # truncation leaves nothing out
        assert out.inference_masked_fraction.item() == 0.0
        out = GRPOLoss(known_policy(), decoupled=True, behaviour_weight_cap=1.5)(batch)
        assert out.behaviour_masked_fraction.item() == pytest.approx(1 / 5)
        out = GRPOLoss(known_policy(), mask_truncated_completions=True)(batch)
        assert out.truncated_fraction.item() == 0.5
        # the metrics still describe every real token
        plain = GRPOLoss(known_policy())(batch)
        for key in ("clip_fraction", "ESS", "kl_approx", "entropy"):
            assert out[key] == plain[key], key

    def test_off_policy_sequence_masking_by_hand(self):
        batch = known_batch()
        # sampler log-probs of the A < 0 sequence: log(0.5 / 0.25) and log(0.8 / 0.4): KL ln 2
        batch["inference_log_prob"][1] = torch.tensor([0.5, 0.8, 0.3]).log()
        out = GRPOLoss(known_policy(), off_policy_mask_threshold=0.5)(batch)
        assert out.loss_objective.item() == pytest.approx(-3.3 / 5)  # zeroed, still counted
        assert out.off_policy_masked_fraction.item() == pytest.approx(2 / 5)
        out = GRPOLoss(known_policy(), off_policy_mask_threshold=0.7)(batch)  # ln 2 < 0.7
        assert out.loss_objective.item() == pytest.approx((-3.3 + 4.8) / 5)
        # without the sampler's log-probs, the drift is taken against sample_log_prob (as TRL):
        # log(0.5 / 0.25) and log(0.1 / 0.4) average to -0.35: kept
        out = GRPOLoss(known_policy(), off_policy_mask_threshold=0.01)(
            batch.exclude("inference_log_prob")
        )
        assert out.off_policy_masked_fraction.item() == 0.0

    def test_decoupled_ratio_metrics_are_against_the_proximal_policy(self):
        out = GRPOLoss(known_policy(), decoupled=True)(known_batch())
        ratios = [1.0, 1.0, 1.25, 1.0, 2.0]  # p / p_prox
        assert out.kl_approx.item() == pytest.approx(-sum(map(math.log, ratios)) / 5)
        assert out.clip_fraction_high.item() == pytest.approx(2 / 5)

    def test_top_entropy_quantile_leaves_the_entropy_bonus_on_every_token(self):
        plain = GRPOLoss(known_policy(), entropy_coeff=0.1)(known_batch())
        top = GRPOLoss(known_policy(), entropy_coeff=0.1, top_entropy_quantile=0.4)(known_batch())
        assert top.loss_entropy == plain.loss_entropy
        # and it needs no entropy bonus: the entropy is computed for the selection only
        out = GRPOLoss(known_policy(), entropy_bonus=False, top_entropy_quantile=0.4)(known_batch())
        assert out.loss_objective.item() == pytest.approx((-1.0 - 1.1) / 5)
        assert out.entropy is None and out.loss_entropy is None

    def test_gradients_of_zeroed_tokens_vanish(self):
        # sequence_mask with (None, 1.5) zeroes the first sequence: its logits get no gradient;
        # in the second, r = 4 (unclipped) still has one (r = 0.5 is clipped: none either way)
        batch = known_batch()
        batch["logits"].requires_grad_()
        loss = GRPOLoss(
            known_policy(),
            entropy_bonus=False,
            inference_correction="sequence_mask",
            inference_correction_bounds=(None, 1.5),
        )
        loss(batch).loss_objective.backward()
        assert (batch["logits"].grad[0] == 0).all() and (batch["logits"].grad[1, 1] != 0).all()

    def test_all_truncated_batch_sends_no_gradient(self):
        batch = known_batch()
        batch["truncated"] = torch.tensor([True, True])
        batch["logits"].requires_grad_()
        out = GRPOLoss(known_policy(), mask_truncated_completions=True)(batch)
        assert out.loss_objective.item() == 0.0 and out.truncated_fraction.item() == 1.0
        out.total_loss().backward()
        assert batch["logits"].grad.abs().max() == 0


class TestVariantsReduceToGRPO:
    """At its neutral setting every variant is plain GRPO: same values, same gradients."""

    @pytest.mark.parametrize("kwargs", [v[1] for v in NEUTRAL], ids=[v[0] for v in NEUTRAL])
    @pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
    def test_neutral_setting_is_grpo(self, kwargs, aggregation):
        batch = neutral_batch(pad(token_batch()))
        base = GRPOLoss(token_policy(), aggregation=aggregation, kl_to_ref_coeff=0.1)
        variant = GRPOLoss(token_policy(), aggregation=aggregation, kl_to_ref_coeff=0.1, **kwargs)
        expected, expected_grads = outputs_and_grads(base, batch)
        out, grads = outputs_and_grads(variant, batch)
        assert expected.clip_fraction > 0  # off-policy: the comparison exercises the clip
        for key, value in expected.items():
            torch.testing.assert_close(out.get(key), value, rtol=0, atol=0, msg=key)
        for a, b in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)

    def test_variants_move_off_neutral(self):
        # the same batch off the neutral setting: each variant changes the loss
        batch = pad(token_batch(drift=1.0))
        batch["proximal_log_prob"] = batch["tokens_log_prob"] + 0.5
        batch["truncated"] = torch.tensor([False, True, False, False])
        base = GRPOLoss(token_policy())(batch).loss_objective
        for kwargs in (
            {"inference_correction": "token_mask", "inference_correction_bounds": (0.8, 1.25)},
            {
                "inference_correction": "sequence_truncate",
                "inference_correction_bounds": (None, 1.0),
            },
            {"decoupled": True},
            {"top_entropy_quantile": 0.3},
            {"mask_truncated_completions": True},
            {"objective": "sapo"},
        ):
            assert GRPOLoss(token_policy(), **kwargs)(batch).loss_objective != base, kwargs

    def test_sapo_gradient_on_policy_is_grpo(self):
        policy = token_policy()
        batch = token_batch()
        with torch.no_grad():
            dist = policy.get_dist(batch)
            batch["tokens_log_prob"] = dist.log_prob(batch["tokens"])  # on-policy: r = 1
        expected = outputs_and_grads(GRPOLoss(policy, entropy_bonus=False), batch)[1]
        for loss in (
            GRPOLoss(policy, entropy_bonus=False, objective="sapo"),
            GRPOLoss(
                policy,
                entropy_bonus=False,
                objective="sapo",
                sapo_temperature_pos=5.0,
                sapo_temperature_neg=0.3,
            ),
        ):
            grads = outputs_and_grads(loss, batch)[1]
            for a, b in zip(grads, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    @pytest.mark.parametrize("kwargs", [v[1] for v in NEUTRAL[:4]], ids=[v[0] for v in NEUTRAL[:4]])
    def test_padding_invariance(self, kwargs):
        batch = neutral_batch(token_batch())
        batch["inference_log_prob"] = batch["inference_log_prob"] + 0.3 * torch.randn(3, 6)
        loss = GRPOLoss(token_policy(), **kwargs)
        out, grads = outputs_and_grads(loss, batch)
        padded_out, padded_grads = outputs_and_grads(loss, pad(batch))
        for key, value in out.items():
            torch.testing.assert_close(padded_out.get(key), value, msg=key)
        for a, b in zip(padded_grads, grads, strict=True):
            torch.testing.assert_close(a, b)


class TestDevices:
    """The loss on every available device equals the CPU's, variants included."""

    @pytest.mark.parametrize(
        "cls, kwargs",
        [
            (GRPOLoss, {"kl_to_ref_coeff": 0.1, "tis_cap": 2.0, "clip_ratio_c": 3.0}),
            (DAPOLoss, {"kl_mask_threshold": 0.05, "top_entropy_quantile": 0.5}),
            (GSPOLoss, {}),
            (CISPOLoss, {"inference_correction": "sequence_mask"}),
        ],
    )
    def test_token_policy(self, device, cls, kwargs):
        policy, batch = token_policy(), token_batch()
        ref = cls(policy, **kwargs)(batch.clone())
        moved = cls(token_policy().to(device), **kwargs).to(device)
        out = moved(batch.to(device))
        for key, value in ref.items():
            assert out[key].device.type == device.type, key
            torch.testing.assert_close(out[key].cpu(), value, rtol=1e-5, atol=1e-6, msg=key)

    def test_llm_wrapper(self, device, tiny_llm, make_llm_batch, make_llm_scorer):
        """torchrl's wrapper around a model on ``device``, fed a ragged batch moved there."""
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        kwargs = dict(kl_to_ref_coeff=0.1, clip_epsilon=(0.2, 0.28))
        ref, ref_grad = run_loss(
            GRPOLoss(make_llm_scorer(model, tokenizer), **kwargs), batch, model
        )
        moved = copy.deepcopy(model).to(device)
        loss = GRPOLoss(make_llm_scorer(moved, tokenizer), **kwargs).to(device)
        out, grad = run_loss(loss, batch.to(device), moved)
        for key, value in ref.items():
            assert out[key].device.type == device.type, key
            torch.testing.assert_close(out[key].cpu(), value, rtol=1e-4, atol=1e-6, msg=key)
        torch.testing.assert_close(grad.cpu(), ref_grad, rtol=1e-4, atol=1e-6)

    def test_classic_actor_gradient(self, device):
        actor = cartpole_actor()
        batch = cartpole_batch(actor)
        grads = torch.autograd.grad(
            GRPOLoss(actor)(batch.clone()).total_loss(), list(actor.parameters())
        )
        moved = cartpole_actor().to(device)
        out = GRPOLoss(moved)(batch.to(device))
        grads_moved = torch.autograd.grad(out.total_loss(), list(moved.parameters()))
        for a, b in zip(grads_moved, grads, strict=True):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6)
