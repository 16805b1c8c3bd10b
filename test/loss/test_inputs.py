"""Tests of torchrl_grpo/loss/inputs.py: a batch read into aligned ``(B, T)`` tensors, from a
torchrl actor (classic control, padded tokens, hidden states) and from a torchrl LLM wrapper.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from helpers.loss import (
    NEUTRAL,
    VARIANTS,
    cartpole_actor,
    cartpole_batch,
    check_equals_clip_ppo,
    known_batch,
    known_policy,
    llm_extras,
    outputs_and_grads,
    pad,
    response_mask,
    response_values,
    run_loss,
    token_batch,
    token_policy,
    two_head_actor,
    two_head_batch,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, lazy_stack
from tensordict.nn import TensorDictModule, set_composite_lp_aggregate
from torchrl.modules import ProbabilisticActor
from torchrl.objectives import ClipPPOLoss

import torchrl_grpo.loss
from torchrl_grpo.llm import HiddenLLMMaskedCategorical
from torchrl_grpo.loss import (
    CISPOLoss,
    DAPOLoss,
    DrGRPOLoss,
    GRPOLoss,
    GSPOLoss,
    SAPOLoss,
)
from torchrl_grpo.loss.inputs import (
    ReadPlan,
    Stored,
    _as_sequences,
    _line_up,
    _match_shape,
    _per_token,
    _token_log_prob_entropy,
    read_stored,
)
from torchrl_grpo.token_dist import HiddenTokenCategorical, TokenCategorical


def read_plan(**settings) -> ReadPlan:
    """What a plain GRPOLoss over a torchrl actor reads, with ``settings`` changed."""
    plain = dict(
        owner="GRPOLoss",
        keys=GRPOLoss.default_keys(sample_log_prob="old_log_prob"),
        loss_mask_key=None,
        padded=False,
        masking_strategy="sft",
        ref_padding=("left", 0.0),
        ref=False,
        inference=None,
        inference_fallback=False,
        proximal=False,
        truncated=False,
        end_tokens=(),
        pad_token_id=None,
        pad_output=True,
        entropy=False,
        samples_mc_entropy=1,
    )
    return ReadPlan(**{**plain, **settings})


class TestReadStored:
    """The data entries, read before the policy runs: each setting reads its own."""

    def batch(self) -> TensorDict:
        return TensorDict(
            {"advantage": torch.ones(2), "old_log_prob": -torch.ones(2, 3)}, batch_size=[2]
        )

    def test_reads_only_what_the_settings_need(self):
        stored = read_stored(self.batch(), read_plan())
        assert stored.ref is stored.inference is stored.proximal is None
        with pytest.raises(KeyError, match=r"'ref_log_prob' \(for kl_to_ref_coeff\)"):
            read_stored(self.batch(), read_plan(ref=True))

    def test_sample_log_prob_stands_in_for_the_sampler_where_allowed(self):
        plan = read_plan(inference="for kl_to_inference_coeff", inference_fallback=True)
        stored = read_stored(self.batch(), plan)
        assert stored.inference is stored.old
        strict = read_plan(inference="for inference_correction")
        with pytest.raises(KeyError, match=r"'inference_log_prob' \(for inference_correction\)"):
            read_stored(self.batch(), strict)

    def test_multi_head_log_probs_are_summed_over_heads_and_their_dims(self):
        # one log-prob per element of the batch, [2, 3]: a head's own dims (4) are summed
        batch = TensorDict(
            {"advantage": torch.ones(2, 3), "a": -torch.ones(2, 3), "b": -torch.ones(2, 3, 4)},
            [2, 3],
        )
        keys = GRPOLoss.default_keys(sample_log_prob=["a", "b"])
        stored = read_stored(batch, read_plan(keys=keys))
        torch.testing.assert_close(stored.old, -torch.full((2, 3), 5.0))
        with pytest.raises(KeyError, match=r"needs 'other' \(a head's sampling log-probs\)"):
            keys = GRPOLoss.default_keys(sample_log_prob=["a", "other"])
            read_stored(batch, read_plan(keys=keys))


class TestReadActor:
    """A torchrl actor's batch: keys, shapes, masks and the entries each setting reads."""

    def test_flat_advantage_equals_trailing_dim(self):
        actor = cartpole_actor()
        batch = cartpole_batch(actor)
        loss = GRPOLoss(actor)
        flat = batch.clone()
        flat["advantage"] = batch["advantage"].squeeze(-1)
        torch.testing.assert_close(loss(flat).loss_objective, loss(batch).loss_objective)

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

    def test_missing_keys_are_named(self):
        batch = token_batch()
        with pytest.raises(KeyError, match=r"'proximal_log_prob' \(for Decoupled\)"):
            GRPOLoss(token_policy(), decoupled=True)(batch)
        with pytest.raises(KeyError, match=r"'truncated' \(for TruncatedCompletions\)"):
            GRPOLoss(token_policy(), mask_truncated_completions=True)(batch)
        with pytest.raises(KeyError, match=r"'inference_log_prob' \(for InferenceCorrection\)"):
            GRPOLoss(token_policy(), inference_correction="sequence_mask")(
                batch.exclude("inference_log_prob")
            )
        bad = batch.clone()
        bad["proximal_log_prob"] = torch.full_like(batch["tokens_log_prob"], float("nan"))
        with pytest.raises(
            ValueError, match="proximal log-probs under 'proximal_log_prob' are not finite"
        ):
            GRPOLoss(token_policy(), decoupled=True)(bad)

    def test_log_prob_requiring_grad(self):
        actor = cartpole_actor()
        batch = cartpole_batch(actor)
        batch["action_log_prob"] = batch["action_log_prob"].requires_grad_()
        with pytest.raises(RuntimeError, match="'action_log_prob' requires grad"):
            GRPOLoss(actor)(batch)

    def test_stored_inference_log_prob_requiring_grad(self):
        batch = token_batch()
        batch["inference_log_prob"] = batch["inference_log_prob"].requires_grad_()
        with pytest.raises(RuntimeError, match="'inference_log_prob' requires grad"):
            GRPOLoss(token_policy(), kl_to_inference_coeff=0.1)(batch)

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

    def test_truncated_flag_shapes_and_reduction_none(self):
        batch = known_batch()
        expected = torch.tensor([[-1.0, -1.1, -1.2], [0.0, 0.0, 0.0]])
        for flag in (torch.tensor([[False], [True]]), torch.tensor([[False] * 3, [True] * 3])):
            batch["truncated"] = flag
            out = GRPOLoss(known_policy(), mask_truncated_completions=True, reduction="none")(batch)
            torch.testing.assert_close(out.loss_objective, expected)

    def test_token_categorical_with_negative_pad_ids(self):
        batch = pad(token_batch())
        policy = token_policy()
        policy.module[-1].distribution_class = TokenCategorical
        loss = GRPOLoss(policy)
        expected = loss(batch)
        batch["tokens"] = torch.where(batch["mask"], batch["tokens"], -100)
        torch.testing.assert_close(loss(batch).loss_objective, expected.loss_objective)

    def test_input_batch_is_not_modified(self):
        batch = token_batch()
        keys = set(batch.keys(True, True))
        GRPOLoss(token_policy())(batch)
        assert set(batch.keys(True, True)) == keys


class TestMultiHead:
    """A multi-head (``CompositeDistribution``) actor, as ClipPPOLoss reads it: the heads'
    log-probs and entropies summed into one per step."""

    def test_equals_clip_ppo_loss(self):
        actor = two_head_actor()
        batch = two_head_batch(actor)
        ppo = ClipPPOLoss(actor, entropy_coeff=0.05)
        grpo = GRPOLoss(actor, entropy_coeff=0.05)
        assert set(ppo.in_keys) >= set(grpo.in_keys) - {"advantage", "mask"}
        # the heads are summed in another order: gradients within float32 rounding
        ref, out = check_equals_clip_ppo(ppo, grpo, batch, list(actor.parameters()), 1e-7)
        per_head = ref["composite_entropy"].squeeze(-1)  # ClipPPOLoss's, with a trailing dim
        assert (out.composite_entropy == per_head).all()

    def test_either_composite_lp_aggregate_mode(self):
        """With ``set_composite_lp_aggregate(True)`` the actor stores one summed log-prob
        (ClipPPOLoss 0.14.1 fails on it): the same loss."""
        actor = two_head_actor()
        batch = two_head_batch(actor)
        expected = GRPOLoss(actor)(batch.clone())
        cat, norm = (batch.get(key) for key in actor.log_prob_keys)
        summed = batch.exclude(*actor.log_prob_keys).set("sample_log_prob", cat + norm.sum(-1))
        with set_composite_lp_aggregate(True):
            loss = GRPOLoss(two_head_actor())
            assert loss.tensor_keys.sample_log_prob == "sample_log_prob"
            out = loss(summed)
        for key in ("loss_objective", "loss_entropy", "ESS"):
            torch.testing.assert_close(out[key], expected[key], msg=key)

    def test_head_keys_on_a_single_head_policy(self):
        loss = GRPOLoss(cartpole_actor())
        loss.set_keys(action=["a", "b"])
        with pytest.raises(ValueError, match=r"multi-head policy's, but .* is a Categorical"):
            loss(cartpole_batch(cartpole_actor()).set("a", torch.zeros(32)))


class TestLineUp:
    """Padding never enters the loss, its metrics or its gradient."""

    def test_shapes_accepted_per_token_and_per_sequence(self):
        shape = torch.Size([2, 3])
        for advantage in (torch.arange(2.0), torch.arange(2.0)[:, None, None]):
            expected = torch.tensor([[0.0] * 3, [1.0] * 3])
            torch.testing.assert_close(_per_token(advantage, shape, "advantage"), expected)
        assert _match_shape(torch.zeros(2, 3, 1), shape, "x").shape == shape
        with pytest.raises(ValueError, match=r"'x' has shape \(3, 2\).*expected \(2, 3\)"):
            _match_shape(torch.zeros(3, 2), shape, "x")
        with pytest.raises(ValueError, match=r"'advantage' has shape \(3,\).*one of"):
            _per_token(torch.zeros(3), shape, "advantage")

    def test_as_sequences(self):
        assert _as_sequences(torch.zeros(5)).shape == (5, 1)  # one-token sequences
        assert _as_sequences(torch.zeros(2, 3, 4)).shape == (6, 4)

    def test_padding_is_zero_before_any_arithmetic(self):
        mask = torch.tensor([[True, False]])
        nan = torch.tensor([[-1.0, float("nan")]])
        stored = Stored(advantage=torch.ones(1), old=nan, ref=None, inference=None, proximal=None)
        keys = GRPOLoss.default_keys()
        x = _line_up(nan, mask, None, stored, None, keys)
        assert x.log_prob.tolist() == x.old_log_prob.tolist() == [[-1.0, 0.0]]
        assert x.advantage.tolist() == [[1.0, 0.0]] and x.entropy is None
        with pytest.raises(ValueError, match="reference log-probs under 'ref_log_prob'"):
            _line_up(nan, mask, None, stored._replace(ref=nan.flip(-1)), None, keys)

    @pytest.mark.parametrize(
        "key, where, match",
        [
            ("advantage", 0, r"The advantage under 'advantage' is not finite on 6 of 11 real"),
            ("tokens_log_prob", (1, 2), r"sampling log-probs under 'tokens_log_prob' are not "),
        ],
    )
    @pytest.mark.parametrize("bad", [math.nan, -math.inf])
    def test_non_finite_stored_entry_on_a_real_token(self, key, where, match, bad):
        policy, batch = token_policy(), token_batch()
        batch[key][where] = bad
        with pytest.raises(ValueError, match=match):
            GRPOLoss(policy)(batch)

    def test_non_finite_stored_entries_on_padding_are_free(self):
        policy, batch = token_policy(), token_batch()
        expected = GRPOLoss(policy)(batch.clone()).loss_objective
        padding = ~batch["mask"]
        batch["advantage"] = batch["advantage"][:, None].expand(3, 6).masked_fill(padding, math.nan)
        batch["tokens_log_prob"] = batch["tokens_log_prob"].masked_fill(padding, -math.inf)
        torch.testing.assert_close(GRPOLoss(policy)(batch).loss_objective, expected)

    def test_classic_control_advantage(self):
        actor = cartpole_actor()
        batch = cartpole_batch(actor)
        batch["advantage"][3] = math.nan
        with pytest.raises(ValueError, match=r"'advantage' is not finite on 1 of 32 real tokens"):
            GRPOLoss(actor)(batch)

    def test_all_padding_batch(self):
        policy, batch = token_policy(), token_batch()
        batch["mask"] = torch.zeros_like(batch["mask"])
        with pytest.raises(ValueError, match="no real token"):
            GRPOLoss(policy)(batch)

    def test_empty_sequence_in_batch_is_ignored(self):
        batch = token_batch()
        loss = GRPOLoss(token_policy(), aggregation="seq_mean_token_mean")
        expected = loss(batch).loss_objective
        empty = pad(batch, extra_tokens=0, extra_rows=2)  # two sequences of length 0
        torch.testing.assert_close(loss(empty).loss_objective, expected)

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


class TestReadLLM:
    """A torchrl LLM wrapper's ragged batch, read as torchrl's GRPOLoss reads it."""

    def test_keys_default_to_torchrl_llm_layout(self, tiny_llm, make_llm_scorer):
        loss = GRPOLoss(make_llm_scorer(*tiny_llm))
        assert loss.tensor_keys.action == ("tokens", "full")
        assert loss.tensor_keys.sample_log_prob == ("log_probs", "full")
        assert loss.tensor_keys.ref_log_prob == ("next", "ref_log_probs", "full")
        assert loss.masking_strategy == "sft" and not loss.functional
        loss.set_keys(ref_log_probs=("ref", "full"))  # torchrl's name of the key
        assert loss.tensor_keys.ref_log_prob == ("ref", "full")

    def test_a_distribution_with_log_prob_entropy_is_asked(self):
        """Duck-typed: any distribution computing both itself is asked (the lean wrapper's,
        without logits); any other is read from its logits."""

        class Both:
            def log_prob_entropy(self, tokens):
                return tokens * 1.0, tokens * 2.0

        tokens = torch.tensor([[1, 2]])
        log_prob, entropy = _token_log_prob_entropy(Both(), tokens)
        assert log_prob.tolist() == [[1.0, 2.0]] and entropy.tolist() == [[2.0, 4.0]]
        logits = torch.zeros(1, 2, 4)  # uniform over 4 tokens
        log_prob, entropy = _token_log_prob_entropy(SimpleNamespace(logits=logits), tokens)
        torch.testing.assert_close(log_prob, torch.full((1, 2), -math.log(4)))
        torch.testing.assert_close(entropy, torch.full((1, 2), math.log(4)))
        with pytest.warns(DeprecationWarning, match="import it from torchrl_grpo.llm"):
            assert torchrl_grpo.loss.HiddenLLMMaskedCategorical is HiddenLLMMaskedCategorical

    def test_sft_counts_response_tokens_only(self, tiny_llm, make_llm_batch, make_llm_scorer):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        scorer = make_llm_scorer(model, tokenizer)
        sft = GRPOLoss(scorer, masking_strategy="sft", reduction="none")(batch.copy())
        full = batch.get(("tokens", "full"), as_list=True)
        response = [
            t.numel() - p.numel()
            for t, p in zip(full, batch.get(("tokens", "prompt"), as_list=True))
        ]
        # reduction="none": per-token terms [B, T], left-padded, zeros off the response
        assert sft.loss_objective.shape == (len(full), max(t.numel() for t in full))
        assert (sft.loss_objective != 0).sum(-1).tolist() == response

    def test_two_candidate_sampling_log_probs_warn(self, tiny_llm, make_llm_batch, make_llm_scorer):
        """The sampler's log-probs at the default key and RetrieveLogProb's under "next": the
        default is read, with a warning naming set_keys; nothing when they agree or when the
        key was set."""
        import warnings

        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        zeroed = [lp.clone() for lp in batch.get(("log_probs", "full"), as_list=True)]
        retrieved = lazy_stack(
            [
                s.clone().set(("next", "log_probs", "full"), lp + 0.1)
                for s, lp in zip(batch.unbind(0), zeroed)
            ]
        )
        loss = GRPOLoss(make_llm_scorer(model, tokenizer))
        with pytest.warns(UserWarning, match=r"two different sampling log-probs.*set_keys"):
            loss(retrieved.copy())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            same = lazy_stack(
                [
                    s.clone().set(("next", "log_probs", "full"), lp)
                    for s, lp in zip(batch.unbind(0), zeroed)
                ]
            )
            loss(same.copy())
            loss.set_keys(sample_log_prob=("next", "log_probs", "full"))
            loss(retrieved.copy())

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
        out, grad = run_loss(generic, with_nan, model)
        expected, expected_grad = run_loss(sft, batch, model)  # the same tokens: the responses
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
        out, grad = run_loss(cls(scorer, **kwargs), batch, model)
        for key, value in out.items():
            assert torch.isfinite(value).all(), key
        assert grad.abs().sum() > 0
        # per token: every loss term is zero off the responses (left padding and prompts)
        per_token = cls(scorer, reduction="none", **kwargs)(batch.copy())
        response = response_mask(batch)
        for key, value in per_token.items():
            if key.startswith("loss_"):
                assert value.shape == response.shape, key
                assert (value[~response] == 0).all(), key
        assert (per_token.loss_objective[response] != 0).any()

    def test_kl_to_ref_reads_torchrl_key(self, tiny_llm, make_llm_batch, make_llm_scorer):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        loss = GRPOLoss(
            make_llm_scorer(model, tokenizer), kl_to_ref_coeff=0.5, kl_to_ref_estimator="k1"
        )
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

    def test_errors_name_the_key(self, tiny_llm, make_llm_batch, make_llm_scorer):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        loss = GRPOLoss(make_llm_scorer(model, tokenizer))
        with pytest.raises(
            ValueError, match=r"masking_strategy='sft' needs \('tokens', 'prompt'\)"
        ):
            loss(batch.exclude(("tokens", "prompt"), ("masks", "all_assistant_mask")))
        short = batch.copy()
        short.set(
            ("log_probs", "full"), short.get(("log_probs", "full"), as_padded_tensor=True)[:, 2:]
        )
        with pytest.raises(ValueError, match=r"row 0 of \('log_probs', 'full'\) has 10 values"):
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
        with pytest.raises(
            ValueError,
            match=r"reference log-probs under \('next', 'ref_log_probs', 'full'\) are not finite",
        ):
            GRPOLoss(make_llm_scorer(model, tokenizer), kl_to_ref_coeff=0.1)(nan_ref)

    @pytest.mark.parametrize(
        "cls, kwargs", [v[1:] for v in LLM_VARIANTS], ids=[v[0] for v in LLM_VARIANTS]
    )
    def test_runs_ignores_padding_and_changes_the_loss(
        self, tiny_llm, make_llm_batch, make_llm_scorer, cls, kwargs
    ):
        model, tokenizer = tiny_llm
        batch = llm_extras(
            make_llm_batch(model, tokenizer), truncated=[True, False, True, False, False]
        )
        scorer = make_llm_scorer(model, tokenizer)
        out, grad = run_loss(cls(scorer, **kwargs), batch, model)
        for key, value in out.items():
            assert torch.isfinite(value).all(), key
        assert grad.abs().sum() > 0
        base = (DAPOLoss if cls is DAPOLoss else GRPOLoss)(scorer)
        assert out.loss_objective != base(batch.copy()).loss_objective
        per_token = cls(scorer, reduction="none", **kwargs)(batch.copy())
        response = response_mask(batch)
        for key, value in per_token.items():
            if key.startswith("loss_"):
                assert (value[~response] == 0).all(), key

    @pytest.mark.parametrize("kwargs", [v[1] for v in NEUTRAL], ids=[v[0] for v in NEUTRAL])
    def test_neutral_setting_is_grpo(self, tiny_llm, make_llm_batch, make_llm_scorer, kwargs):
        model, tokenizer = tiny_llm
        batch = llm_extras(make_llm_batch(model, tokenizer), drift=0.0, truncated=[False] * 5)
        scorer = make_llm_scorer(model, tokenizer)
        expected, expected_grad = run_loss(GRPOLoss(scorer), batch, model)
        out, grad = run_loss(GRPOLoss(scorer, **kwargs), batch, model)
        for key, value in expected.items():
            torch.testing.assert_close(out.get(key), value, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)

    def test_inference_masked_fraction_counts_the_responses(
        self, tiny_llm, make_llm_batch, make_llm_scorer
    ):
        model, tokenizer = tiny_llm
        batch = llm_extras(make_llm_batch(model, tokenizer))
        scorer = make_llm_scorer(model, tokenizer)
        out = GRPOLoss(
            scorer, inference_correction="token_mask", inference_correction_bounds=(0.8, 1.25)
        )(batch.copy())
        old = [o for _, o in response_values(batch, scorer, ("log_probs", "full"))]
        inf = [i for _, i in response_values(batch, scorer, "inference_log_prob")]
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
        out, grad = run_loss(GRPOLoss(scorer, mask_truncated_completions=True), batch, model)
        assert out.truncated_fraction.item() == pytest.approx(3 / 5)
        finished = lazy_stack(
            [
                s.set("mask", torch.tensor([i in (0, 3)]))
                for i, s in enumerate(batch.copy().unbind(0))
            ]
        )
        expected, expected_grad = run_loss(GRPOLoss(scorer), finished, model)
        torch.testing.assert_close(out.loss_objective, expected.loss_objective)
        torch.testing.assert_close(grad, expected_grad)
        # an explicit flag wins over the EOS rule
        flagged = lazy_stack(
            [s.set("truncated", torch.tensor([False])) for s in batch.copy().unbind(0)]
        )
        assert GRPOLoss(scorer, mask_truncated_completions=True)(flagged).truncated_fraction == 0
        # torchrl's ("next", "truncated") can be the flag too
        nested = lazy_stack(
            [
                s.set(("next", "truncated"), torch.tensor([i == 1]))
                for i, s in enumerate(batch.copy().unbind(0))
            ]
        )
        loss = GRPOLoss(scorer, mask_truncated_completions=True)
        loss.set_keys(truncated=("next", "truncated"))
        assert loss(nested).truncated_fraction.item() == pytest.approx(1 / 5)

    def test_llm_wrapper_computing_elsewhere(
        self, device, tiny_llm, make_llm_batch, make_llm_scorer
    ):
        """``TransformersWrapper(device=...)`` with the batch left where it is (on the CPU, as a
        replay buffer holds it): the loss follows the wrapper's logits."""
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        kwargs = dict(kl_to_ref_coeff=0.1)
        scorer = make_llm_scorer(model, tokenizer, device=None)
        ref, ref_grad = run_loss(GRPOLoss(scorer, **kwargs), batch, model)
        moved = copy.deepcopy(model).to(device)
        scorer = make_llm_scorer(moved, tokenizer, device=device)
        out, grad = run_loss(GRPOLoss(scorer, **kwargs), batch, moved)
        for key, value in ref.items():
            torch.testing.assert_close(out[key].cpu(), value, rtol=1e-4, atol=1e-6, msg=key)
        torch.testing.assert_close(grad.cpu(), ref_grad, rtol=1e-4, atol=1e-6)
