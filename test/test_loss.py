"""Tests of torchrl_grpo.loss: GRPOLoss on classic-control actors and token policies."""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, lazy_stack
from tensordict.nn import ProbabilisticTensorDictModule, TensorDictModule
from torchrl.modules import ProbabilisticActor
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
from torchrl_grpo.token_dist import HiddenTokenCategorical, TokenCategorical

# --------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------


def cartpole_actor(seed: int = 0) -> ProbabilisticActor:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    module = TensorDictModule(net, ["observation"], ["logits"])
    return ProbabilisticActor(
        module,
        in_keys=["logits"],
        distribution_class=torch.distributions.Categorical,
        return_log_prob=True,
    )


def cartpole_batch(actor, n: int = 32, seed: int = 1, drift: float = 0.5) -> TensorDict:
    """A sampled batch whose stored log-probs are perturbed, so ratios leave the clip band."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        td = actor(TensorDict({"observation": torch.randn(n, 4, generator=g)}, [n]))
    td["action_log_prob"] = td["action_log_prob"] + drift * torch.randn(n, generator=g)
    td["advantage"] = torch.randn(n, 1, generator=g)
    return td


def token_policy(vocab: int = 7, hidden: int = 5, seed: int = 0) -> ProbabilisticActor:
    torch.manual_seed(seed)
    module = TensorDictModule(torch.nn.Linear(hidden, vocab), ["hidden"], ["logits"])
    return ProbabilisticActor(
        module,
        in_keys=["logits"],
        out_keys=["tokens"],
        distribution_class=torch.distributions.Categorical,
    )


def token_batch(b=3, t=6, vocab=7, hidden=5, seed=2, drift=0.3) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([t, t - 2, 1, t - 1, 2, t][:b])
    mask = torch.arange(t) < lengths[:, None]
    return TensorDict(
        {
            "hidden": torch.randn(b, t, hidden, generator=g),
            "tokens": torch.randint(vocab, (b, t), generator=g),
            "tokens_log_prob": -2.0 + drift * torch.randn(b, t, generator=g),
            "ref_log_prob": -2.0 + drift * torch.randn(b, t, generator=g),
            "inference_log_prob": -2.0 + drift * torch.randn(b, t, generator=g),
            "advantage": torch.randn(b, generator=g),
            "mask": mask,
        },
        [b],
    )


# --------------------------------------------------------------------------------------------
# classic control
# --------------------------------------------------------------------------------------------


class TestGRPOLossClassicControl:
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

        params = list(actor.parameters())
        ref = ppo(batch.clone())
        ref_grads = torch.autograd.grad(ref["loss_objective"] + ref["loss_entropy"], params)
        out = grpo(batch.clone())
        out_grads = torch.autograd.grad(out.loss_objective + out.loss_entropy, params)

        assert ref["clip_fraction"] > 0  # the comparison exercises clipping
        for key in ("loss_objective", "loss_entropy", "entropy", "clip_fraction", "kl_approx"):
            torch.testing.assert_close(out.get(key), ref[key], rtol=0, atol=1e-7, msg=key)
        torch.testing.assert_close(out.ESS, ref["ESS"], rtol=1e-6, atol=0)
        for a, b in zip(out_grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)

    def test_flat_advantage_equals_trailing_dim(self):
        actor = cartpole_actor()
        batch = cartpole_batch(actor)
        loss = GRPOLoss(actor)
        flat = batch.clone()
        flat["advantage"] = batch["advantage"].squeeze(-1)
        torch.testing.assert_close(loss(flat).loss_objective, loss(batch).loss_objective)

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
        with pytest.raises(TypeError):
            GRPOLoss(actor, critic_coeff=1.0)

    def test_reduction(self):
        actor = cartpole_actor()
        batch = cartpole_batch(actor, n=8)
        per_sample = GRPOLoss(actor, reduction="none")(batch).loss_objective
        assert per_sample.shape == (8,)
        torch.testing.assert_close(per_sample.mean(), GRPOLoss(actor)(batch).loss_objective)
        with pytest.raises(ValueError, match="reduction"):
            GRPOLoss(actor, reduction="sum")


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------


class TestGRPOLossErrors:
    def test_missing_advantage(self):
        actor = cartpole_actor()
        batch = cartpole_batch(actor).exclude("advantage")
        with pytest.raises(KeyError, match="'advantage'"):
            GRPOLoss(actor)(batch)

    def test_missing_log_prob(self):
        actor = cartpole_actor()
        batch = cartpole_batch(actor).exclude("action_log_prob")
        with pytest.raises(KeyError, match="'action_log_prob'"):
            GRPOLoss(actor)(batch)

    def test_missing_ref_log_prob(self):
        actor = cartpole_actor()
        with pytest.raises(KeyError, match="'ref_log_prob'"):
            GRPOLoss(actor, kl_to_ref_coeff=0.1)(cartpole_batch(actor))

    def test_missing_inference_log_prob_for_tis(self):
        actor = cartpole_actor()
        with pytest.raises(KeyError, match="'inference_log_prob'"):
            GRPOLoss(actor, tis_cap=2.0)(cartpole_batch(actor))

    def test_log_prob_requiring_grad(self):
        actor = cartpole_actor()
        batch = cartpole_batch(actor)
        batch["action_log_prob"] = batch["action_log_prob"].requires_grad_()
        with pytest.raises(RuntimeError, match="'action_log_prob' requires grad"):
            GRPOLoss(actor)(batch)

    def test_mismatched_advantage_shape(self):
        actor = cartpole_actor()
        batch = cartpole_batch(actor, n=8)
        batch.set("advantage", torch.randn(8, 2))
        with pytest.raises(ValueError, match=r"'advantage' has shape \(8, 2\)"):
            GRPOLoss(actor)(batch)

    def test_mismatched_token_shapes(self):
        policy, batch = token_policy(), token_batch()
        loss = GRPOLoss(policy)
        bad = batch.clone()
        bad["advantage"] = torch.randn(3, 5)
        with pytest.raises(ValueError, match=r"'advantage' has shape \(3, 5\).*\(3, 6\)"):
            loss(bad)
        bad = batch.clone()
        bad["tokens_log_prob"] = torch.randn(3, 5)
        with pytest.raises(ValueError, match=r"'tokens_log_prob' has shape \(3, 5\)"):
            loss(bad)
        bad = batch.clone()
        bad["mask"] = batch["mask"][:, :4]
        with pytest.raises(ValueError, match=r"'mask' has shape \(3, 4\)"):
            loss(bad)

    def test_all_padding_batch(self):
        policy, batch = token_policy(), token_batch()
        batch["mask"] = torch.zeros_like(batch["mask"])
        with pytest.raises(ValueError, match="no real token"):
            GRPOLoss(policy)(batch)

    @pytest.mark.parametrize(
        "kwargs, match",
        [
            ({"aggregation": "median"}, "Unknown aggregation"),
            ({"objective": "ppo2"}, "Unknown objective"),
            ({"ratio_level": "word"}, "Unknown ratio_level"),
            ({"kl_to_ref_estimator": "k4", "kl_to_ref_coeff": 0.1}, "Unknown KL estimator"),
            ({"aggregation": "seq_mean_token_sum_norm"}, "needs max_length"),
            ({"max_length": 16}, "max_length=16 is only used"),
            ({"clip_ratio_c": 0.5}, "greater than 1"),
            ({"objective": "cispo", "clip_ratio_c": 3.0}, "not CISPO"),
            ({"tis_cap": 0.0}, "positive"),
            ({"kl_to_ref_coeff": -1.0}, "non-negative"),
        ],
    )
    def test_bad_configuration(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            GRPOLoss(token_policy(), **kwargs)


def test_presets_defaults():
    policy = token_policy()
    dapo = DAPOLoss(policy)
    assert (dapo.clip_epsilon_low.item(), dapo.clip_epsilon_high.item()) == pytest.approx(
        (0.2, 0.28)
    )
    gspo = GSPOLoss(policy)
    assert (gspo.clip_epsilon_low.item(), gspo.clip_epsilon_high.item()) == pytest.approx(
        (3e-4, 4e-4)
    )
    cispo = CISPOLoss(policy)
    low, high = cispo.clip_bounds
    assert low.item() == -math.inf and high.exp().item() == pytest.approx(4.0)
    with pytest.raises(TypeError):
        DrGRPOLoss(policy)  # max_length is required
    assert DrGRPOLoss(policy, max_length=8).entropy_coeff.item() == 0.0


# --------------------------------------------------------------------------------------------
# token policies: hand-computed values for every variant
# --------------------------------------------------------------------------------------------
#
# Two sequences over a two-token vocabulary, always sampling token 0 with probability p:
#   row 0, A = +1: p = 0.5, 0.55, 0.75  vs p_old = 0.5, 0.5, 0.5  -> ratios 1.0, 1.1, 1.5
#   row 1, A = -1: p = 0.25, 0.4, (pad) vs p_old = 0.5, 0.1, nan  -> ratios 0.5, 4.0
# PPO per-token losses with clip 0.2: row 0 -1.0, -1.1, -1.2 (sum -3.3); row 1 0.8, 4.0 (sum 4.8)

P = [[0.5, 0.55, 0.75], [0.25, 0.4, 0.9]]
P_OLD = [[0.5, 0.5, 0.5], [0.5, 0.1, float("nan")]]
REAL_P = [0.5, 0.55, 0.75, 0.25, 0.4]
REAL_RATIOS = [1.0, 1.1, 1.5, 0.5, 4.0]


def known_policy():
    return ProbabilisticTensorDictModule(
        in_keys=["logits"], out_keys=["tokens"], distribution_class=torch.distributions.Categorical
    )


def known_batch(dtype=torch.float32) -> TensorDict:
    p = torch.tensor(P, dtype=dtype)
    return TensorDict(
        {
            "logits": torch.stack([p.log(), (1 - p).log()], -1),
            "tokens": torch.zeros(2, 3, dtype=torch.long),
            "tokens_log_prob": torch.tensor(P_OLD, dtype=dtype).log(),
            "ref_log_prob": torch.tensor(P_OLD, dtype=dtype).log(),
            "inference_log_prob": torch.tensor(
                [[0.25, 0.5, 0.5], [0.5, 0.2, 0.3]], dtype=dtype
            ).log(),
            # decoupled PPO: ratios p / p_prox 1, 1, 1.25 | 1, 2; weights p_prox / p_old
            # 1, 1.1, 1.2 | 0.5, 2
            "proximal_log_prob": torch.tensor(
                [[0.5, 0.55, 0.6], [0.25, 0.2, float("nan")]], dtype=dtype
            ).log(),
            "truncated": torch.tensor([False, True]),
            "advantage": torch.tensor([1.0, -1.0], dtype=dtype),
            "mask": torch.tensor([[True, True, True], [True, True, False]]),
        },
        [2],
    )


def sapo(r, a, tau):
    """SAPO's per-token loss for one ratio, from its formula."""
    return -(4 / tau) / (1 + math.exp(-tau * (r - 1))) * a


SAPO_ROWS = [
    [sapo(r, 1.0, 1.0) for r in (1.0, 1.1, 1.5)],
    [sapo(r, -1.0, 1.05) for r in (0.5, 4.0)],
]


def bernoulli_entropy(p):
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


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

    def test_gspo_clip_fraction_counts_tokens(self):
        out = GSPOLoss(known_policy())(known_batch())
        assert out.clip_fraction_high.item() == 1.0 and out.clip_fraction_low.item() == 0.0

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


class TestCallableExtensionPoints:
    """Each variant slot takes a callable, called with the lined-up (B, T) tensors."""

    def test_objective(self):
        def plain_ratio(log_ratio, advantage, log_prob, log_clip_low, log_clip_high):
            return -log_ratio.exp() * advantage  # no clip: -r A

        out = GRPOLoss(known_policy(), objective=plain_ratio)(known_batch())
        expected = (-1.0 - 1.1 - 1.5 + 0.5 + 4.0) / 5
        assert out.loss_objective.item() == pytest.approx(expected, abs=1e-6)

    def test_ratio_level(self):
        def on_policy(log_ratio, mask):
            return torch.zeros_like(log_ratio)  # every ratio 1: the loss is -mean(A)

        out = GRPOLoss(known_policy(), ratio_level=on_policy)(known_batch())
        assert out.loss_objective.item() == pytest.approx((-3.0 + 2.0) / 5, abs=1e-6)
        assert out.ESS.item() == 1.0 and out.clip_fraction.item() == 0.0

    def test_aggregation(self):
        def worst_token(loss, mask):
            return loss[mask].max()

        out = GRPOLoss(known_policy(), aggregation=worst_token)(known_batch())
        assert out.loss_objective.item() == pytest.approx(4.0)

    def test_kl_estimator(self):
        def squared(log_prob, ref_log_prob):
            return (log_prob - ref_log_prob).square()

        loss = GRPOLoss(known_policy(), kl_to_ref_coeff=0.1, kl_to_ref_estimator=squared)
        out = loss(known_batch())
        expected = sum(math.log(r) ** 2 for r in REAL_RATIOS) / 5
        assert out.kl_to_ref.item() == pytest.approx(expected, rel=1e-5)
        assert out.loss_kl_to_ref.item() == pytest.approx(0.1 * expected, rel=1e-5)

    def test_kl_mask_threshold_keeps_metrics_and_empties_to_zero(self):
        masked = GRPOLoss(known_policy(), kl_mask_threshold=0.1)(known_batch())
        plain = GRPOLoss(known_policy())(known_batch())
        for key in ("clip_fraction", "ESS", "kl_approx", "entropy"):  # every real token
            assert masked[key] == plain[key], key
        batch = known_batch()
        batch["logits"].requires_grad_()
        out = GRPOLoss(known_policy(), kl_mask_threshold=1e-9)(batch)  # only r = 1 is left
        assert out.loss_objective.item() == pytest.approx(-1.0)
        batch["tokens_log_prob"] = batch["tokens_log_prob"] - 1.0  # every token drifted
        out = GRPOLoss(known_policy(), kl_mask_threshold=1e-3)(batch)
        assert out.loss_objective.item() == 0.0 and out.loss_entropy.item() == 0.0
        out.total_loss().backward()
        assert batch["logits"].grad.abs().max() == 0


# --------------------------------------------------------------------------------------------
# token policies: shapes, padding, equivalences, gradients
# --------------------------------------------------------------------------------------------

VARIANTS = [
    ("grpo", GRPOLoss, {}),
    (
        "grpo_kl_tis_dual",
        GRPOLoss,
        {
            "kl_to_ref_coeff": 0.1,
            "kl_to_inference_coeff": 0.2,
            "kl_to_inference_estimator": "k2",
            "tis_cap": 2.0,
            "clip_ratio_c": 3.0,
            "aggregation": "seq_mean_token_sum",
        },
    ),
    ("seq_mean_token_mean", GRPOLoss, {"aggregation": "seq_mean_token_mean"}),
    ("dapo", DAPOLoss, {"entropy_coeff": 0.05}),
    ("drgrpo", DrGRPOLoss, {"max_length": 8}),
    ("gspo", GSPOLoss, {"clip_epsilon": 0.05}),
    ("cispo", CISPOLoss, {"kl_to_ref_coeff": 0.1, "kl_to_ref_estimator": "k1"}),
]


def pad(batch: TensorDict, extra_tokens: int = 3, extra_rows: int = 1, seed: int = 9) -> TensorDict:
    """The same batch with garbage pad columns (nan log-probs) and all-padding rows appended."""
    g = torch.Generator().manual_seed(seed)
    b, t = batch["mask"].shape
    out = {}
    for key, value in batch.items():
        if key == "advantage":
            out[key] = torch.cat([value, torch.randn(extra_rows, generator=g)])
            continue
        if key == "truncated":  # per sequence
            out[key] = torch.cat([value, torch.rand(extra_rows, generator=g) > 0.5])
            continue
        if key == "mask":
            filler = torch.zeros(b + extra_rows, t + extra_tokens, dtype=torch.bool)
        elif key == "tokens":
            filler = torch.randint(7, (b + extra_rows, t + extra_tokens), generator=g)
        elif key == "hidden":
            filler = torch.randn(b + extra_rows, t + extra_tokens, value.shape[-1], generator=g)
        else:  # log-probs: padding holds nan
            filler = torch.full((b + extra_rows, t + extra_tokens), float("nan"))
        filler[:b, :t] = value
        out[key] = filler
    return TensorDict(out, [b + extra_rows])


def outputs_and_grads(loss, batch):
    out = loss(batch)
    total = sum(v for k, v in out.items() if k.startswith("loss_"))
    grads = torch.autograd.grad(total, list(loss.actor_network.parameters()))
    return out, grads


class TestGRPOLossTokens:
    @pytest.mark.parametrize("cls, kwargs", [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
    def test_padding_invariance(self, cls, kwargs):
        batch = token_batch()
        loss = cls(token_policy(), **kwargs)
        out, grads = outputs_and_grads(loss, batch)
        padded_out, padded_grads = outputs_and_grads(loss, pad(batch))
        for key, value in out.items():
            torch.testing.assert_close(padded_out.get(key), value, msg=key)
        for a, b in zip(padded_grads, grads, strict=True):
            torch.testing.assert_close(a, b)
        assert all(torch.isfinite(g).all() for g in padded_grads)

    def test_per_token_advantage_equals_broadcast_sequence_advantage(self):
        batch, loss = token_batch(), GRPOLoss(token_policy(), aggregation="seq_mean_token_mean")
        expected = loss(batch).loss_objective
        for per_token in (
            batch["advantage"][:, None].expand(3, 6),
            batch["advantage"][:, None, None].expand(3, 6, 1),
            batch["advantage"][:, None],
        ):
            other = batch.clone()
            other.set("advantage", per_token.clone(), inplace=False)
            torch.testing.assert_close(loss(other).loss_objective, expected)

    def test_per_token_advantage_is_used_per_token(self):
        batch, loss = token_batch(), GRPOLoss(token_policy())
        other = batch.clone()
        adv = batch["advantage"][:, None].expand(3, 6).clone()
        adv[0, 0] += 5.0
        other.set("advantage", adv)
        assert loss(other).loss_objective != loss(batch).loss_objective

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

    def test_token_categorical_with_negative_pad_ids(self):
        batch = pad(token_batch())
        policy = token_policy()
        policy.module[-1].distribution_class = TokenCategorical
        loss = GRPOLoss(policy)
        expected = loss(batch)
        batch["tokens"] = torch.where(batch["mask"], batch["tokens"], -100)
        torch.testing.assert_close(loss(batch).loss_objective, expected.loss_objective)

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

    def test_mask_key_changed_with_set_keys(self):
        batch = token_batch()
        loss = GRPOLoss(token_policy())
        expected = loss(batch).loss_objective
        loss.set_keys(mask="response_mask")
        renamed = batch.clone().rename_key_("mask", "response_mask")
        torch.testing.assert_close(loss(renamed).loss_objective, expected)
        # without its mask, padding would count: a different value
        assert loss(batch.exclude("mask")).loss_objective != expected

    def test_torchrl_collector_mask_is_honoured(self):
        batch = token_batch()
        loss = GRPOLoss(token_policy())
        expected = loss(batch).loss_objective
        collector = batch.clone().rename_key_("mask", ("collector", "mask"))
        torch.testing.assert_close(loss(collector).loss_objective, expected)

    def test_empty_sequence_in_batch_is_ignored(self):
        batch = token_batch()
        loss = GRPOLoss(token_policy(), aggregation="seq_mean_token_mean")
        expected = loss(batch).loss_objective
        empty = pad(batch, extra_tokens=0, extra_rows=2)  # two sequences of length 0
        torch.testing.assert_close(loss(empty).loss_objective, expected)

    @settings(max_examples=20, deadline=None)
    @given(
        extra_tokens=st.integers(0, 4),
        extra_rows=st.integers(0, 3),
        seed=st.integers(0, 10_000),
        variant=st.sampled_from(VARIANTS),
    )
    def test_padding_invariance_property(self, extra_tokens, extra_rows, seed, variant):
        _, cls, kwargs = variant
        batch = token_batch()
        loss = cls(token_policy(), **kwargs)
        expected = loss(batch)
        out = loss(pad(batch, extra_tokens=extra_tokens, extra_rows=extra_rows, seed=seed))
        for key, value in expected.items():
            torch.testing.assert_close(out.get(key), value, msg=key)

    def test_input_batch_is_not_modified(self):
        batch = token_batch()
        keys = set(batch.keys(True, True))
        GRPOLoss(token_policy())(batch)
        assert set(batch.keys(True, True)) == keys

    def test_stored_inference_log_prob_requiring_grad(self):
        batch = token_batch()
        batch["inference_log_prob"] = batch["inference_log_prob"].requires_grad_()
        with pytest.raises(RuntimeError, match="'inference_log_prob' requires grad"):
            GRPOLoss(token_policy(), kl_to_inference_coeff=0.1)(batch)


# --------------------------------------------------------------------------------------------
# torchrl LLM wrappers (TransformersWrapper on a tiny local Qwen2)
# --------------------------------------------------------------------------------------------


def _grads(module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])


def _run(loss, batch, module):
    """The loss on a copy of ``batch`` and the gradient of its loss terms."""
    module.zero_grad()
    out = loss(batch.copy())
    sum(value for key, value in out.items() if key.startswith("loss_")).backward()
    return out, _grads(module)


class TestGRPOLossLLMWrapper:
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
        ref, ref_grad = _run(TorchrlGRPOLoss(scorer, **kwargs), batch, model)
        out, grad = _run(GRPOLoss(scorer, **kwargs), batch, model)

        assert 0 < ref.clip_fraction < 1  # the comparison exercises clipping
        for key in ("loss_objective", "loss_entropy", "ESS"):
            torch.testing.assert_close(out[key], ref.get(key), rtol=1e-5, atol=1e-7, msg=key)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-7)

    def test_keys_default_to_torchrl_llm_layout(self, tiny_llm, make_llm_scorer):
        loss = GRPOLoss(make_llm_scorer(*tiny_llm))
        assert loss.tensor_keys.action == ("tokens", "full")
        assert loss.tensor_keys.sample_log_prob == ("log_probs", "full")
        assert loss.tensor_keys.ref_log_prob == ("next", "ref_log_probs", "full")
        assert loss.masking_strategy == "sft" and not loss.functional
        loss.set_keys(ref_log_probs=("ref", "full"))  # torchrl's name of the key
        assert loss.tensor_keys.ref_log_prob == ("ref", "full")

    def test_sft_counts_response_tokens_only(self, tiny_llm, make_llm_batch, make_llm_scorer):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        scorer = make_llm_scorer(model, tokenizer)
        sft = GRPOLoss(scorer, masking_strategy="sft", reduction="none")(batch.copy())
        full = batch.get(("tokens", "full"), as_list=True)
        response = [t.numel() - p.numel() for t, p in zip(full, batch.get(("tokens", "prompt"), as_list=True))]  # fmt: skip
        # reduction="none": per-token terms [B, T], left-padded, zeros off the response
        assert sft.loss_objective.shape == (len(full), max(t.numel() for t in full))
        assert (sft.loss_objective != 0).sum(-1).tolist() == response

    def test_nan_placeholders_are_not_tokens(self, tiny_llm, make_llm_batch, make_llm_scorer):
        """vLLM writes NaN for the prompt slice of LogProbs.full: those tokens are not real."""
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        scorer = make_llm_scorer(model, tokenizer)
        with_nan = batch.copy()
        steps = []
        for step, prompt in zip(with_nan.unbind(0), batch.get(("tokens", "prompt"), as_list=True)):
            log_prob = step.get(("log_probs", "full")).clone()
            log_prob[: prompt.numel()] = float("nan")
            steps.append(step.set(("log_probs", "full"), log_prob))
        with_nan = lazy_stack(steps)
        generic = GRPOLoss(scorer, masking_strategy="generic")
        sft = GRPOLoss(scorer, masking_strategy="sft")
        out, grad = _run(generic, with_nan, model)
        expected, expected_grad = _run(sft, batch, model)  # the same tokens: the responses
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(out.loss_objective, expected.loss_objective)
        torch.testing.assert_close(out.ESS, expected.ESS)
        torch.testing.assert_close(grad, expected_grad)

    @pytest.mark.parametrize(
        "cls, kwargs",
        [
            (GRPOLoss, {"aggregation": "seq_mean_token_mean"}),
            (GRPOLoss, {"aggregation": "prompt_mean"}),
            (GRPOLoss, {"clip_ratio_c": 3.0, "kl_to_inference_coeff": 0.1}),
            (GRPOLoss, {"kl_to_ref_coeff": 0.1, "kl_to_ref_estimator": "k2"}),
            (GRPOLoss, {"kl_mask_threshold": 0.02}),
            (DAPOLoss, {}),
            (DrGRPOLoss, {"max_length": 4}),
            (GSPOLoss, {}),
            (CISPOLoss, {}),
        ],
    )
    def test_every_variant_runs_and_ignores_padding(
        self, tiny_llm, make_llm_batch, make_llm_scorer, cls, kwargs
    ):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        scorer = make_llm_scorer(model, tokenizer)
        out, grad = _run(cls(scorer, **kwargs), batch, model)
        for key, value in out.items():
            assert torch.isfinite(value).all(), key
        assert grad.abs().sum() > 0
        # per token: every loss term is zero off the responses (left padding and prompts)
        per_token = cls(scorer, reduction="none", **kwargs)(batch.copy())
        full = batch.get(("tokens", "full"), as_list=True)
        width = max(t.numel() for t in full)
        response = torch.zeros(len(full), width, dtype=torch.bool)
        for row, (t, p) in enumerate(zip(full, batch.get(("tokens", "prompt"), as_list=True))):
            response[row, width - t.numel() + p.numel() :] = True
        for key, value in per_token.items():
            if key.startswith("loss_"):
                assert value.shape == response.shape, key
                assert (value[~response] == 0).all(), key
        assert (per_token.loss_objective[response] != 0).any()

    def test_kl_to_ref_reads_torchrl_key(self, tiny_llm, make_llm_batch, make_llm_scorer):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        loss = GRPOLoss(make_llm_scorer(model, tokenizer), kl_to_ref_coeff=0.5, kl_to_ref_estimator="k1")  # fmt: skip
        out = loss(batch.copy())
        # k1 = log pi - log pi_ref, averaged over the response tokens
        scored = make_llm_scorer(model, tokenizer)(batch.copy())
        diffs = []
        for lp, ref, prompt in zip(
            scored.get(("log_probs", "full"), as_list=True),
            batch.get(("next", "ref_log_probs", "full"), as_list=True),
            batch.get(("tokens", "prompt"), as_list=True),
        ):
            diffs.append((lp - ref)[prompt.numel() :])
        expected = torch.cat(diffs).mean()
        torch.testing.assert_close(out.kl_to_ref, expected.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.loss_kl_to_ref, 0.5 * expected, rtol=1e-5, atol=1e-6)

    def test_kl_mask_threshold_matches_torchrl_objective(
        self, tiny_llm, make_llm_batch, make_llm_scorer
    ):
        from torchrl.objectives.llm import GRPOLoss as TorchrlGRPOLoss

        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer, drift=0.5)
        scorer = make_llm_scorer(model, tokenizer)
        ref, ref_grad = _run(TorchrlGRPOLoss(scorer, kl_mask_threshold=0.05, entropy_bonus=False), batch, model)  # fmt: skip
        out, grad = _run(GRPOLoss(scorer, kl_mask_threshold=0.05, entropy_bonus=False), batch, model)  # fmt: skip
        plain = GRPOLoss(scorer, entropy_bonus=False)(batch.copy())
        assert out.loss_objective != plain.loss_objective  # some tokens were left out
        torch.testing.assert_close(out.loss_objective, ref.loss_objective, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-7)

    def test_errors_name_the_key(self, tiny_llm, make_llm_batch, make_llm_scorer):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        loss = GRPOLoss(make_llm_scorer(model, tokenizer))
        with pytest.raises(ValueError, match=r"masking_strategy='sft' needs \('tokens', 'prompt'\)"):  # fmt: skip
            loss(batch.exclude(("tokens", "prompt"), ("masks", "all_assistant_mask")))
        short = batch.copy()
        short.set(("log_probs", "full"), short.get(("log_probs", "full"), as_padded_tensor=True)[:, 2:])  # fmt: skip
        with pytest.raises(ValueError, match=r"\('log_probs', 'full'\) has shape"):
            loss(short)
        with pytest.raises(KeyError, match=r"needs .+advantage.+ \(the advantage\)"):
            loss(batch.exclude("advantage"))
        with pytest.raises(ValueError, match="masking_strategy='rlhf' applies to torchrl LLM"):
            GRPOLoss(token_policy(), masking_strategy="rlhf")
        with pytest.raises(ValueError, match="masking_strategy must be one of"):
            GRPOLoss(make_llm_scorer(model, tokenizer), masking_strategy="response")
        nan_ref = batch.copy()
        refs = nan_ref.get(("next", "ref_log_probs", "full"), as_padded_tensor=True)
        nan_ref.set(("next", "ref_log_probs", "full"), torch.full_like(refs, float("nan")))
        with pytest.raises(ValueError, match=r"reference log-probs under \('next', 'ref_log_probs', 'full'\) are not finite"):  # fmt: skip
            GRPOLoss(make_llm_scorer(model, tokenizer), kl_to_ref_coeff=0.1)(nan_ref)


class TestTorchrlArguments:
    """Every argument of torchrl's GRPOLoss / ClipPPOLoss is accepted or names its replacement."""

    def test_torchrl_grpo_signature_is_accepted(self):
        from torchrl.objectives.llm import GRPOLoss as TorchrlGRPOLoss

        ours = set(inspect.signature(GRPOLoss).parameters)
        for name, param in inspect.signature(TorchrlGRPOLoss).parameters.items():
            if param.kind is param.VAR_KEYWORD:
                continue
            if name in ours:
                continue
            with pytest.raises(TypeError, match=rf"takes no '{name}': "):
                GRPOLoss(token_policy(), **{name: param.default if param.default is not param.empty else 1})  # fmt: skip

    @pytest.mark.parametrize(
        "name, match",
        [
            ("critic_network", "no critic"),
            ("clip_value", "no critic"),
            ("gamma", "no value estimator"),
            ("normalize_advantage", "scale_rewards"),
            ("advantage_key", r"set_keys\(advantage"),
        ],
    )
    def test_replaced_keywords(self, name, match):
        with pytest.raises(TypeError, match=match):
            GRPOLoss(token_policy(), **{name: 1})

    def test_unknown_keyword(self):
        with pytest.raises(TypeError, match=r"unexpected keyword arguments \['clip_eps'\]"):
            GRPOLoss(token_policy(), clip_eps=0.1)

    def test_aggregation_names(self):
        policy, batch = token_policy(), token_batch()
        prompt_mean = GRPOLoss(policy, aggregation="prompt_mean")(batch.clone())
        seq_mean = GRPOLoss(policy, aggregation="seq_mean_token_mean")(batch.clone())
        torch.testing.assert_close(prompt_mean.loss_objective, seq_mean.loss_objective)
        none = GRPOLoss(policy, aggregation="none")(batch.clone())
        assert none.loss_objective.shape == batch["tokens"].shape


class TestGRPOLossOutputConsumers:
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


# --------------------------------------------------------------------------------------------
# SAPO, inference corrections, OPSM, decoupled PPO, high-entropy tokens, truncated completions
# --------------------------------------------------------------------------------------------


class TestVariantMetricsAndErrors:
    def test_masked_fractions_by_hand(self):
        batch = known_batch()
        out = GRPOLoss(known_policy(), inference_correction="token_mask", inference_correction_bounds=(0.5, 1.5))(batch)  # fmt: skip
        assert out.inference_masked_fraction.item() == pytest.approx(1 / 5)
        out = GRPOLoss(known_policy(), inference_correction="sequence_mask", inference_correction_bounds=(None, 1.5))(batch)  # fmt: skip
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
        out = GRPOLoss(known_policy(), off_policy_mask_threshold=0.01)(batch.exclude("inference_log_prob"))  # fmt: skip
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
        loss = GRPOLoss(known_policy(), entropy_bonus=False, inference_correction="sequence_mask", inference_correction_bounds=(None, 1.5))  # fmt: skip
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

    def test_truncated_flag_shapes_and_reduction_none(self):
        batch = known_batch()
        expected = torch.tensor([[-1.0, -1.1, -1.2], [0.0, 0.0, 0.0]])
        for flag in (torch.tensor([[False], [True]]), torch.tensor([[False] * 3, [True] * 3])):
            batch["truncated"] = flag
            out = GRPOLoss(known_policy(), mask_truncated_completions=True, reduction="none")(batch)  # fmt: skip
            torch.testing.assert_close(out.loss_objective, expected)

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
        assert loss.inference_correction_bounds == (loss.inference_correction_low, loss.inference_correction_high)  # fmt: skip

    def test_keys(self):
        loss = GRPOLoss(token_policy(), inference_correction="token_mask", decoupled=True, mask_truncated_completions=True)  # fmt: skip
        assert {"inference_log_prob", "proximal_log_prob", "truncated"} <= set(loss.in_keys)
        assert {"inference_masked_fraction", "behaviour_masked_fraction", "truncated_fraction"} <= set(loss.out_keys)  # fmt: skip
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
            "entropy",
            "loss_entropy",
        ]

    def test_missing_keys_are_named(self):
        batch = token_batch()
        with pytest.raises(KeyError, match=r"'proximal_log_prob' \(for decoupled=True\)"):
            GRPOLoss(token_policy(), decoupled=True)(batch)
        with pytest.raises(KeyError, match=r"'truncated' \(for mask_truncated_completions\)"):
            GRPOLoss(token_policy(), mask_truncated_completions=True)(batch)
        with pytest.raises(KeyError, match=r"'inference_log_prob' \(for inference_correction\)"):
            GRPOLoss(token_policy(), inference_correction="sequence_mask")(batch.exclude("inference_log_prob"))  # fmt: skip
        bad = batch.clone()
        bad["proximal_log_prob"] = torch.full_like(batch["tokens_log_prob"], float("nan"))
        with pytest.raises(ValueError, match="proximal log-probs under 'proximal_log_prob' are not finite"):  # fmt: skip
            GRPOLoss(token_policy(), decoupled=True)(bad)

    @pytest.mark.parametrize(
        "kwargs, match",
        [
            ({"sapo_temperature_pos": 2.0}, "apply to objective='sapo'"),
            ({"objective": "sapo", "sapo_temperature_neg": 0.0}, "temperatures must be positive"),
            ({"objective": "sapo", "clip_ratio_c": 3.0}, "not SAPO"),
            ({"inference_correction": "token_clip"}, "Unknown inference_correction"),
            ({"inference_correction_bounds": (0.5, 2.0)}, "needs an inference_correction"),
            (
                {"inference_correction": "token_mask", "inference_correction_bounds": (2.0, 1.0)},
                "low < high",
            ),
            (
                {"inference_correction": "token_mask", "inference_correction_bounds": (None, 0.0)},
                "high > 0",
            ),
            ({"tis_cap": 2.0, "inference_correction": "token_truncate"}, "pass one or the other"),
            ({"off_policy_mask_threshold": 0.0}, "positive"),
            ({"behaviour_weight_cap": 5.0}, "decoupled=True only"),
            ({"decoupled": True, "behaviour_weight_cap": 1.0}, "greater than 1"),
            ({"top_entropy_quantile": 1.5}, r"in \[0, 1\]"),
        ],
    )
    def test_bad_configuration(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            GRPOLoss(token_policy(), **kwargs)

    def test_sapo_preset(self):
        loss = SAPOLoss(token_policy())
        assert loss._objective.keywords == {"temperature_pos": 1.0, "temperature_neg": 1.05}
        assert loss.entropy_coeff.item() == 0.0
        custom = SAPOLoss(token_policy(), sapo_temperature_neg=2.0)
        assert custom._objective.keywords["temperature_neg"] == 2.0


def _neutral(batch: TensorDict) -> TensorDict:
    """The token batch with the entries each variant's neutral setting needs."""
    batch = batch.clone()
    batch["inference_log_prob"] = batch["tokens_log_prob"].clone()  # sampler = trainer
    batch["proximal_log_prob"] = batch["tokens_log_prob"].clone()  # proximal = behaviour
    batch["truncated"] = torch.zeros(batch.shape[0], dtype=torch.bool)
    return batch


NEUTRAL = [
    ("token_truncate", {"inference_correction": "token_truncate"}),
    (
        "token_mask",
        {"inference_correction": "token_mask", "inference_correction_bounds": (0.5, 5.0)},
    ),
    ("sequence_truncate", {"inference_correction": "sequence_truncate"}),
    ("sequence_mask", {"inference_correction": "sequence_mask"}),
    ("opsm, delta = inf", {"off_policy_mask_threshold": math.inf}),
    ("decoupled, proximal = behaviour", {"decoupled": True, "behaviour_weight_cap": 2.0}),
    ("top_entropy_quantile 1", {"top_entropy_quantile": 1.0}),
    ("no truncated completion", {"mask_truncated_completions": True}),
]


class TestVariantsReduceToGRPO:
    """At its neutral setting every variant is plain GRPO: same values, same gradients."""

    @pytest.mark.parametrize("kwargs", [v[1] for v in NEUTRAL], ids=[v[0] for v in NEUTRAL])
    @pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
    def test_neutral_setting_is_grpo(self, kwargs, aggregation):
        batch = _neutral(pad(token_batch()))
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
        batch = _neutral(token_batch())
        batch["inference_log_prob"] = batch["inference_log_prob"] + 0.3 * torch.randn(3, 6)
        loss = GRPOLoss(token_policy(), **kwargs)
        out, grads = outputs_and_grads(loss, batch)
        padded_out, padded_grads = outputs_and_grads(loss, pad(batch))
        for key, value in out.items():
            torch.testing.assert_close(padded_out.get(key), value, msg=key)
        for a, b in zip(padded_grads, grads, strict=True):
            torch.testing.assert_close(a, b)


class TestHiddenStatePolicy:
    """HiddenTokenCategorical in an actor: the loss, its metrics and gradients are the logits
    path's, head and body parameters included."""

    class TinyLM(torch.nn.Module):
        def __init__(self, hidden=5, vocab=7):
            super().__init__()
            self.body = torch.nn.Linear(hidden, hidden)
            self.lm_head = torch.nn.Linear(hidden, vocab)

        def forward(self, x):
            return torch.tanh(self.body(x))

    def actors(self):
        torch.manual_seed(0)
        lm = self.TinyLM()
        hidden_actor = ProbabilisticActor(
            TensorDictModule(lm, ["hidden"], ["last_hidden"]),
            in_keys={"hidden": "last_hidden"},
            out_keys=["tokens"],
            distribution_class=HiddenTokenCategorical,
            distribution_kwargs={"head": lm.lm_head, "chunk_size": 4},
        )
        logits_net = torch.nn.Sequential(lm, lm.lm_head)  # the same parameters
        logits_actor = ProbabilisticActor(
            TensorDictModule(logits_net, ["hidden"], ["logits"]),
            in_keys=["logits"],
            out_keys=["tokens"],
            distribution_class=TokenCategorical,
        )
        return lm, hidden_actor, logits_actor

    @pytest.mark.parametrize(
        "cls, kwargs",
        [
            (GRPOLoss, {"kl_to_ref_coeff": 0.1}),
            (DAPOLoss, {"entropy_coeff": 0.05, "top_entropy_quantile": 0.5}),
            (SAPOLoss, {"inference_correction": "token_mask"}),
        ],
    )
    def test_equals_the_logits_path(self, cls, kwargs):
        lm, hidden_actor, logits_actor = self.actors()
        batch = pad(token_batch())
        results = []
        for actor in (hidden_actor, logits_actor):
            lm.zero_grad()
            out = cls(actor, **kwargs)(batch.clone())
            out.total_loss().backward()
            results.append((out, [p.grad.clone() for p in lm.parameters()]))
        (out, grads), (ref, ref_grads) = results
        for key, value in ref.items():
            torch.testing.assert_close(out.get(key), value, rtol=1e-5, atol=1e-6, msg=key)
        for a, b in zip(grads, ref_grads, strict=True):
            assert b.abs().sum() > 0
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# the variants on torchrl LLM wrappers
# --------------------------------------------------------------------------------------------


def _llm_extras(batch, *, seed=5, drift=0.3, truncated=None):
    """The LLM batch with per-token sampler and proximal log-probs (ragged, like torchrl's
    ("log_probs", "full")) and, optionally, a per-sequence ``truncated`` flag."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for i, step in enumerate(batch.unbind(0)):
        log_prob = step.get(("log_probs", "full"))
        step.set("inference_log_prob", log_prob + drift * torch.randn(log_prob.shape, generator=g))
        step.set("proximal_log_prob", log_prob + drift * torch.randn(log_prob.shape, generator=g))
        if truncated is not None:
            step.set("truncated", torch.tensor([truncated[i]]))
        steps.append(step)
    return lazy_stack(steps)


def _response_values(batch, scorer, key):
    """Per response: (trainer log-probs, stored ``key`` values) over the response tokens."""
    scored = scorer(batch.copy())
    prompts = batch.get(("tokens", "prompt"), as_list=True)
    return [
        (lp[p.numel() :], other[p.numel() :])
        for lp, other, p in zip(
            scored.get(("log_probs", "full"), as_list=True), batch.get(key, as_list=True), prompts
        )
    ]


LLM_VARIANTS = [
    ("sapo", GRPOLoss, {"objective": "sapo"}),
    ("SAPOLoss", SAPOLoss, {}),
    (
        "token_mask",
        GRPOLoss,
        {"inference_correction": "token_mask", "inference_correction_bounds": (0.8, 1.25)},
    ),
    ("sequence_mask", GRPOLoss, {"inference_correction": "sequence_mask"}),
    ("sequence_truncate", GRPOLoss, {"inference_correction": "sequence_truncate"}),
    ("opsm", GRPOLoss, {"off_policy_mask_threshold": 0.05}),
    ("decoupled", GRPOLoss, {"decoupled": True, "behaviour_weight_cap": 1.3}),
    ("top_entropy", DAPOLoss, {"top_entropy_quantile": 0.3}),
    ("truncated", GRPOLoss, {"mask_truncated_completions": True}),
]


class TestVariantsOnLLMWrapper:
    @pytest.mark.parametrize("cls, kwargs", [v[1:] for v in LLM_VARIANTS], ids=[v[0] for v in LLM_VARIANTS])  # fmt: skip
    def test_runs_ignores_padding_and_changes_the_loss(self, tiny_llm, make_llm_batch, make_llm_scorer, cls, kwargs):  # fmt: skip
        model, tokenizer = tiny_llm
        batch = _llm_extras(make_llm_batch(model, tokenizer), truncated=[True, False, True, False, False])  # fmt: skip
        scorer = make_llm_scorer(model, tokenizer)
        out, grad = _run(cls(scorer, **kwargs), batch, model)
        for key, value in out.items():
            assert torch.isfinite(value).all(), key
        assert grad.abs().sum() > 0
        base = (DAPOLoss if cls is DAPOLoss else GRPOLoss)(scorer)
        assert out.loss_objective != base(batch.copy()).loss_objective
        per_token = cls(scorer, reduction="none", **kwargs)(batch.copy())
        full = batch.get(("tokens", "full"), as_list=True)
        width = max(t.numel() for t in full)
        response = torch.zeros(len(full), width, dtype=torch.bool)
        for row, (t, p) in enumerate(zip(full, batch.get(("tokens", "prompt"), as_list=True))):
            response[row, width - t.numel() + p.numel() :] = True
        for key, value in per_token.items():
            if key.startswith("loss_"):
                assert (value[~response] == 0).all(), key

    @pytest.mark.parametrize("kwargs", [v[1] for v in NEUTRAL], ids=[v[0] for v in NEUTRAL])
    def test_neutral_setting_is_grpo(self, tiny_llm, make_llm_batch, make_llm_scorer, kwargs):
        model, tokenizer = tiny_llm
        batch = _llm_extras(make_llm_batch(model, tokenizer), drift=0.0, truncated=[False] * 5)
        scorer = make_llm_scorer(model, tokenizer)
        expected, expected_grad = _run(GRPOLoss(scorer), batch, model)
        out, grad = _run(GRPOLoss(scorer, **kwargs), batch, model)
        for key, value in expected.items():
            torch.testing.assert_close(out.get(key), value, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)

    def test_sapo_from_the_scorer_log_probs(self, tiny_llm, make_llm_batch, make_llm_scorer):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        scorer = make_llm_scorer(model, tokenizer)
        out = SAPOLoss(scorer)(batch.copy())
        means = []  # per response: token mean of -(4 / tau) sigmoid(tau (r - 1)) A
        for (lp, old), adv in zip(_response_values(batch, scorer, ("log_probs", "full")), batch["advantage"].flatten()):  # fmt: skip
            tau = 1.0 if adv > 0 else 1.05
            means.append((-(4 / tau) * torch.sigmoid(tau * ((lp - old).exp() - 1)) * adv).mean())
        torch.testing.assert_close(out.loss_objective, torch.stack(means).mean().detach(), rtol=1e-5, atol=1e-6)  # fmt: skip

    def test_inference_masked_fraction_counts_the_responses(self, tiny_llm, make_llm_batch, make_llm_scorer):  # fmt: skip
        model, tokenizer = tiny_llm
        batch = _llm_extras(make_llm_batch(model, tokenizer))
        scorer = make_llm_scorer(model, tokenizer)
        out = GRPOLoss(scorer, inference_correction="token_mask", inference_correction_bounds=(0.8, 1.25))(batch.copy())  # fmt: skip
        old = [o for _, o in _response_values(batch, scorer, ("log_probs", "full"))]
        inf = [i for _, i in _response_values(batch, scorer, "inference_log_prob")]
        ratio = (torch.cat(old) - torch.cat(inf)).exp()
        outside = ((ratio < 0.8) | (ratio > 1.25)).float().mean()
        assert 0 < outside < 1
        torch.testing.assert_close(out.inference_masked_fraction, outside)

    def test_truncation_from_eos(self, tiny_llm, make_llm_batch, make_llm_scorer):
        """Without a ``truncated`` entry, a response that does not end with EOS (or pad) is
        truncated (TRL's rule); the loss equals plain GRPO on the finished responses."""
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        steps = []
        for i, step in enumerate(batch.unbind(0)):  # responses 0 and 3 end with EOS
            last = tokenizer.eos_token_id if i in (0, 3) else tokenizer.convert_tokens_to_ids("7")
            for key in (("tokens", "full"), ("tokens", "response")):
                tokens = step.get(key).clone()
                tokens[-1] = last
                step.set(key, tokens)
            steps.append(step)
        batch = lazy_stack(steps)
        scorer = make_llm_scorer(model, tokenizer)
        out, grad = _run(GRPOLoss(scorer, mask_truncated_completions=True), batch, model)
        assert out.truncated_fraction.item() == pytest.approx(3 / 5)
        finished = lazy_stack([s.set("mask", torch.tensor([i in (0, 3)])) for i, s in enumerate(batch.copy().unbind(0))])  # fmt: skip
        expected, expected_grad = _run(GRPOLoss(scorer), finished, model)
        torch.testing.assert_close(out.loss_objective, expected.loss_objective)
        torch.testing.assert_close(grad, expected_grad)
        # an explicit flag wins over the EOS rule
        flagged = lazy_stack([s.set("truncated", torch.tensor([False])) for s in batch.copy().unbind(0)])  # fmt: skip
        assert GRPOLoss(scorer, mask_truncated_completions=True)(flagged).truncated_fraction == 0
        # torchrl's ("next", "truncated") can be the flag too
        nested = lazy_stack(
            [s.set(("next", "truncated"), torch.tensor([i == 1])) for i, s in enumerate(batch.copy().unbind(0))]
        )  # fmt: skip
        loss = GRPOLoss(scorer, mask_truncated_completions=True)
        loss.set_keys(truncated=("next", "truncated"))
        assert loss(nested).truncated_fraction.item() == pytest.approx(1 / 5)


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
        ref, ref_grad = _run(GRPOLoss(make_llm_scorer(model, tokenizer), **kwargs), batch, model)
        moved = copy.deepcopy(model).to(device)
        loss = GRPOLoss(make_llm_scorer(moved, tokenizer), **kwargs).to(device)
        out, grad = _run(loss, batch.to(device), moved)
        for key, value in ref.items():
            assert out[key].device.type == device.type, key
            torch.testing.assert_close(out[key].cpu(), value, rtol=1e-4, atol=1e-6, msg=key)
        torch.testing.assert_close(grad.cpu(), ref_grad, rtol=1e-4, atol=1e-6)

    def test_llm_wrapper_computing_elsewhere(self, device, tiny_llm, make_llm_batch):
        """``TransformersWrapper(device=...)`` with the batch left where it is (on the CPU, as a
        replay buffer holds it): the loss follows the wrapper's logits."""
        from torchrl.modules.llm import TransformersWrapper

        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        kwargs = dict(kl_to_ref_coeff=0.1)

        def scorer(m, dev):
            return TransformersWrapper(
                m, tokenizer=tokenizer, input_mode="tokens", input_key=("tokens", "full"),
                generate=False, return_log_probs=True, pad_output=False, device=dev,
            )  # fmt: skip

        ref, ref_grad = _run(GRPOLoss(scorer(model, None), **kwargs), batch, model)
        moved = copy.deepcopy(model).to(device)
        out, grad = _run(GRPOLoss(scorer(moved, device), **kwargs), batch, moved)
        for key, value in ref.items():
            torch.testing.assert_close(out[key].cpu(), value, rtol=1e-4, atol=1e-6, msg=key)
        torch.testing.assert_close(grad.cpu(), ref_grad, rtol=1e-4, atol=1e-6)

    def test_classic_actor_gradient(self, device):
        actor = cartpole_actor()
        batch = cartpole_batch(actor)
        grads = torch.autograd.grad(GRPOLoss(actor)(batch.clone()).total_loss(), list(actor.parameters()))  # fmt: skip
        moved = cartpole_actor().to(device)
        out = GRPOLoss(moved)(batch.to(device))
        grads_moved = torch.autograd.grad(out.total_loss(), list(moved.parameters()))
        for a, b in zip(grads_moved, grads, strict=True):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6)
