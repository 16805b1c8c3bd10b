"""Tests of torchrl_grpo.loss: GRPOLoss on classic-control actors and token policies."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.modules import ProbabilisticActor
from torchrl.objectives import ClipPPOLoss

from torchrl_grpo.loss import (
    CISPOLoss,
    DAPOLoss,
    DrGRPOLoss,
    GRPOLoss,
    GRPOLossOutput,
    GSPOLoss,
)

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
    low, high = cispo._clip_bounds
    assert low.item() == -math.inf and high.exp().item() == pytest.approx(4.0)
    with pytest.raises(TypeError):
        DrGRPOLoss(policy)  # max_length is required
    assert DrGRPOLoss(policy, max_length=8).entropy_coeff.item() == 0.0
