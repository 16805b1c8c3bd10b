"""Tests of torchrl_grpo/loss/options.py: the keywords checked into one record, the variants
resolved from the registries or taken as callables, torchrl's arguments accepted or replaced.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from helpers.loss import (
    REAL_RATIOS,
    known_batch,
    known_policy,
    token_batch,
    token_policy,
)
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.objectives import ClipPPOLoss, PPOLoss

from torchrl_grpo.loss import DAPOLoss, GRPOLoss
from torchrl_grpo.loss.options import LossOptions, loss_options
from torchrl_grpo.loss.variants import SAPO, TIS, Clip
from torchrl_grpo.loss_terms import AGGREGATIONS, KL_ESTIMATORS, OBJECTIVES, RATIO_LEVELS

#: GRPOLoss's keyword-only arguments and their defaults, as loss_options receives them.
DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(GRPOLoss).parameters.items()
    if parameter.kind is parameter.KEYWORD_ONLY
}


def options(**keywords) -> LossOptions:
    """The record of a loss over a torchrl actor (not an LLM wrapper) with ``keywords``."""
    return loss_options(None, {**DEFAULTS, **keywords}, {})


class TestLossOptions:
    def test_defaults_are_the_registries_entries(self):
        record = options()
        assert record.objective == Clip()  # PPO's clip, OBJECTIVES["clip"], no dual clip
        assert record.ratio_level is RATIO_LEVELS["token"]
        assert record.aggregate is AGGREGATIONS["token_mean"]
        assert record.variants == ()  # no correction, no penalty
        kl = options(kl_to_ref_coeff=0.1, kl_to_inference_coeff=0.1).variants
        assert [v.estimator for v in kl] == ["k3", "k3"]
        assert KL_ESTIMATORS["k3"] is KL_ESTIMATORS[kl[0].estimator]
        assert record.masking_strategy == "sft" and record.functional and not record.is_llm
        assert record.reduction is None and record.clip_epsilon == 0.2
        assert dict(record.coefficients) == dict.fromkeys(record.coefficients)  # every one off

    def test_the_record_is_frozen(self):
        record = options()
        with pytest.raises(AttributeError, match="cannot assign to field 'variants'"):
            record.variants = ()
        with pytest.raises(TypeError, match="does not support item assignment"):
            record.coefficients["tis_cap"] = 2.0

    def test_variants_bind_their_settings(self):
        sapo = options(objective="sapo", sapo_temperature_neg=2.0).objective
        assert sapo == SAPO(temperature_pos=1.0, temperature_neg=2.0)
        assert "sapo" in OBJECTIVES
        dr_grpo = options(aggregation="seq_mean_token_sum_norm", max_length=16).aggregate
        assert dr_grpo.func is AGGREGATIONS["seq_mean_token_sum_norm"]
        assert dr_grpo.keywords == {"max_length": 16}

    def test_coefficients_and_the_inference_band(self):
        record = options(inference_correction="token_mask", kl_to_ref_coeff=0.1)
        assert record.coefficients["inference_correction_low"] is None
        assert record.coefficients["inference_correction_high"] == 3.0  # TRL's default
        assert record.coefficients["kl_to_ref_coeff"] == 0.1
        capped = options(tis_cap=2.0)  # the tis_cap buffer is the band: none of its own
        assert capped.variants == (TIS(2.0),) and capped.coefficients["tis_cap"] == 2.0
        assert capped.coefficients["inference_correction_high"] is None

    def test_torchrl_aggregation_names(self):
        assert options(aggregation="prompt_mean").aggregate is AGGREGATIONS["seq_mean_token_mean"]
        per_token = options(aggregation="none")
        assert per_token.reduction == "none" and per_token.aggregate is AGGREGATIONS["token_mean"]

    def test_no_lower_bound_is_given_to_clip_ppo_loss_as_zero(self):
        record = options(clip_epsilon=(1.0, 3.0))
        assert record.clip_epsilon == (0.0, 3.0) and record.no_lower_bound
        assert not options(clip_epsilon=(0.2, 0.28)).no_lower_bound

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
            ({"tis_cap": math.nan}, "tis_cap must be positive, got nan"),
            ({"kl_to_ref_coeff": -1.0}, "non-negative"),
            ({"kl_to_ref_coeff": math.nan}, "kl_to_ref_coeff must be non-negative, got nan"),
            ({"entropy_coeff": {"head": 0.1}}, "summed over its heads"),
        ],
    )
    def test_bad_configuration(self, kwargs, match):
        error = TypeError if isinstance(kwargs.get("entropy_coeff"), dict) else ValueError
        with pytest.raises(error, match=match):
            GRPOLoss(token_policy(), **kwargs)

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
    def test_bad_variant_configuration(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            GRPOLoss(token_policy(), **kwargs)


class TestClipBand:
    """``clip_epsilon``: a float is checked as each bound of a tuple, before anything is built
    (torchrl checks only the tuple)."""

    @pytest.mark.parametrize(
        "clip_epsilon, match",
        [
            (-0.1, r"clip_epsilon must be in \[0, 1\] .*got -0.1"),
            (1.5, r"clip_epsilon must be in \[0, 1\] .*got 1.5"),
            (math.nan, r"clip_epsilon must be in \[0, 1\] .*got nan"),
            ((1.5, 0.2), r"clip_epsilon_low must be in \[0, 1\] .*got 1.5"),
            ((-0.1, 0.2), r"clip_epsilon_low must be in \[0, 1\] .*got -0.1"),
            ((0.2, -0.1), "clip_epsilon_high must be non-negative .*got -0.1"),
            ((0.2, math.nan), "clip_epsilon_high must be non-negative .*got nan"),
            ((0.1, 0.2, 0.3), "tuple must have length 2"),
        ],
    )
    def test_out_of_range(self, clip_epsilon, match):
        with pytest.raises(ValueError, match=match):
            GRPOLoss(token_policy(), clip_epsilon=clip_epsilon)

    def test_not_a_number(self):
        with pytest.raises(TypeError, match="clip_epsilon must be a number, got 'wide'"):
            GRPOLoss(token_policy(), clip_epsilon="wide")

    def test_one_is_no_lower_bound_in_either_form(self):
        policy, batch = token_policy(), token_batch(drift=2.0)
        scalar = GRPOLoss(policy, clip_epsilon=1.0)(batch.clone())
        pair = GRPOLoss(policy, clip_epsilon=(1.0, 1.0))(batch.clone())
        torch.testing.assert_close(scalar.loss_objective, pair.loss_objective)
        assert scalar.clip_fraction_low == 0 and scalar.clip_fraction_high > 0


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
            if name in ("gamma", "clip_value"):  # no-ops at torchrl's default (None)
                GRPOLoss(token_policy(), **{name: param.default})
                continue
            with pytest.raises(TypeError, match=rf"takes no '{name}': "):
                GRPOLoss(
                    token_policy(),
                    **{name: param.default if param.default is not param.empty else 1},
                )

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

    @pytest.mark.parametrize("cls", [ClipPPOLoss, PPOLoss])
    def test_clip_ppo_signature_is_accepted(self, cls):
        """torchrl 0.14.1's ClipPPOLoss / PPOLoss arguments (and the two its ``**kwargs`` reads):
        each is a GRPOLoss argument, ``actor``, or names what replaces it."""
        ours = set(inspect.signature(GRPOLoss).parameters) | {"actor"}
        theirs = [
            name
            for name, param in inspect.signature(cls).parameters.items()
            if param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL)
        ]
        for name in [*theirs, "critic_coef", "entropy_coef"]:
            if name not in ours:
                with pytest.raises(TypeError, match=rf"takes no '{name}': "):
                    GRPOLoss(token_policy(), **{name: 1})

    @pytest.mark.parametrize(
        "name, match",
        [
            ("max_importance_ratio", r"pi_theta / pi_behav .* use corrections=\[TIS\(cap\)\]"),
            ("delay_actor", r"corrections=\[Decoupled\(\)\] and set_keys\(proximal_log_prob"),
            ("advantage_norm", "scale_rewards"),
            ("critic", "no critic"),
        ],
    )
    def test_clip_ppo_keywords_name_their_replacement(self, name, match):
        with pytest.raises(TypeError, match=match):
            GRPOLoss(token_policy(), **{name: 1})

    @pytest.mark.parametrize("cls", [GRPOLoss, DAPOLoss])
    def test_positional_critic(self, cls):
        policy = token_policy()
        critic = TensorDictModule(torch.nn.Linear(5, 1), ["hidden"], ["state_value"])
        with pytest.raises(
            TypeError,
            match=r"ClipPPOLoss\(actor, critic\).*GRPO has no critic.*"
            r"torchrl_grpo\.MCAdvantage",
        ):
            cls(policy, critic)

    def test_actor_is_actor_network(self):
        policy, batch = token_policy(), token_batch()
        by_alias = GRPOLoss(actor=policy)(batch.clone())
        torch.testing.assert_close(by_alias.loss_objective, GRPOLoss(policy)(batch).loss_objective)
        with pytest.raises(TypeError, match="both actor_network and actor"):
            GRPOLoss(policy, actor=policy)

    def test_without_a_policy_it_aggregates_and_refuses_a_forward(self):
        # torchrl builds GRPOLoss(actor_network=None) for its aggregation helpers: so here
        loss = GRPOLoss(aggregation="token_mean")
        value = torch.arange(6.0).view(2, 3, 1)
        mask = torch.tensor([[True, False, True], [False, True, True]])
        torch.testing.assert_close(loss._aggregate_loss_value(value, mask), torch.tensor(2.75))
        zeros = torch.zeros(2, 3)
        with pytest.raises(RuntimeError, match=r"without a policy \(actor_network=None\)"):
            loss(
                TensorDict(action=zeros, action_log_prob=zeros, advantage=zeros, batch_size=[2, 3])
            )

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
        default = GRPOLoss(policy, aggregation=None)(batch.clone())  # torchrl: "token_mean"
        token_mean = GRPOLoss(policy)(batch.clone())
        torch.testing.assert_close(default.loss_objective, token_mean.loss_objective)


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
