"""Tests of torchrl_grpo/llm/prefix.py and the lean wrapper's scoring of what is read, once.

Shared-prefix scoring is checked against the dense pass of the same model (hidden states and
gradients) and, through ``LeanTransformersWrapper``, against torchrl's ``TransformersWrapper``
and ``GRPOLoss`` on batches of groups (G completions of each prompt) and of dialog turns (each
turn a prefix of the next).
"""

import os
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

try:
    import transformers  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs the `llm` extra (make test): without it this is a failure, not a skip
    pytest.skip("needs the llm extra: pip install -e '.[llm]'", allow_module_level=True)

import tensordict
from tensordict import TensorDict, lazy_stack
from torchrl.modules.llm.policies.common import Tokens
from torchrl.objectives.llm import GRPOLoss as TorchrlGRPOLoss

from torchrl_grpo import GRPOLoss
from torchrl_grpo.llm import prefix as prefix_module
from torchrl_grpo.llm.prefix import (
    PrefixSharing,
    SharingUnsupported,
    prefix_plan,
    shared_hidden,
)
from torchrl_grpo.loss_terms import AGGREGATIONS

GROUP_PROMPTS = ["3 9 1 4 2 8=", "1 2 7 7 0=", "5 5 5 1="]


def _family_model(family: str, layers: int = 2, dtype=torch.float32):
    import transformers as tf

    config_cls, model_cls = {
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[family]
    config = config_cls(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return model_cls(config).eval().to(dtype)


def _rows(seed: int = 0):
    """Three prompts of 12 tokens, each with three completions, one row alone, and a turn that
    extends another row (a dialog's next turn)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(3):
        prompt = torch.randint(64, (12,), generator=g)
        rows += [torch.cat([prompt, torch.randint(64, (n,), generator=g)]) for n in (3, 6, 1)]
    rows.append(torch.randint(64, (9,), generator=g))
    rows.append(torch.cat([rows[1], torch.randint(64, (5,), generator=g)]))
    return rows


def _dense(body, rows):
    return [body(input_ids=r[None], use_cache=False).last_hidden_state[0] for r in rows]


def _rows_of(hidden, rows):
    """Each row's own states from the ``[B, T, H]`` left-padded output of shared_hidden."""
    return [hidden[i, hidden.shape[1] - len(r) :] for i, r in enumerate(rows)]


def _visible(plan, slot: int) -> set:
    """The packed slots that ``slot`` attends to under the plan's block mask."""
    width = plan.segments.shape[1]
    row, col = divmod(slot, width)
    seen = plan.ancestors[plan.segments[row, col], plan.segments[row, : col + 1]]
    return {row * width + j for j in np.flatnonzero(seen)}


class TestPrefixPlan:
    def test_trees_and_rows_alone(self):
        rows = _rows()
        plan = prefix_plan(rows, min_shared_length=4)
        assert sorted(sorted(t) for t in plan.trees) == [[0, 1, 2, 10], [3, 4, 5], [6, 7, 8]]
        assert plan.alone == [9]
        # each prompt once (12 tokens saved per extra row), and row 10 repeats row 1 (18 tokens)
        assert plan.shared_tokens == 12 * (3 + 2 + 2) + 6

    def test_a_turn_that_extends_another_shares_all_of_it(self):
        a = torch.arange(10)
        plan = prefix_plan([torch.cat([a, torch.tensor([3, 4])]), a], min_shared_length=4)
        assert plan.trees == [(1, 0)] and plan.alone == [] and plan.shared_tokens == 10
        assert plan.tokens.tolist() == [list(range(10)) + [3, 4]]

    def test_below_the_minimum_nothing_is_shared(self):
        plan = prefix_plan(_rows(), min_shared_length=13)  # the prompts (12 tokens) are too short
        assert plan.trees == [(1, 10)]  # row 10 extends row 1 (12 + 6 tokens)
        assert plan.alone == [0, 2, 3, 4, 5, 6, 7, 8, 9]

    def test_dialog_turns_share_every_level(self):
        """Two dialogs of three turns from one prompt: the prompt once, each dialog's
        history once more (a trie, not one level)."""
        g = torch.Generator().manual_seed(0)
        rows = []
        for dialog in range(2):  # the dialogs' tokens differ from their first answer on
            history = torch.arange(20)
            for _ in range(3):
                answer = 100 * (dialog + 1) + torch.randint(50, (4,), generator=g)
                full = torch.cat([history, answer])
                rows.append(full)
                history = torch.cat([full, torch.randint(50, (2,), generator=g)])
        plan = prefix_plan(rows, min_shared_length=8)
        assert plan.trees == [tuple(sorted(range(6), key=lambda i: rows[i].tolist()))]
        assert plan.tokens.size == 20 + 2 * (4 + 6 + 6)  # every token computed once

    @settings(max_examples=60, deadline=None)
    @given(
        st.lists(
            st.tuples(st.integers(0, 5), st.lists(st.integers(0, 3), max_size=6)),
            min_size=1,
            max_size=12,
        ),
        st.integers(1, 6),
    )
    def test_each_row_reads_its_tokens_positions_and_attention(self, specs, min_shared_length):
        """Whatever the rows (duplicates, prefixes of each other, nothing shared), a row reads
        back its own tokens at positions 0..L-1, and each of its tokens attends to exactly
        the slots of its row's earlier tokens and itself."""
        stems = [list(range(100, 100 + 3 * k)) for k in range(6)]
        rows = [np.array(stems[s] + tail or [7]) for s, tail in specs]
        plan = prefix_plan(rows, min_shared_length)
        flat_tokens = np.append(plan.tokens.reshape(-1), -1)
        flat_positions = np.append(plan.positions.reshape(-1), -1)
        for row, reads in zip(rows, plan.reads, strict=True):
            slots = reads[len(reads) - len(row) :]
            assert flat_tokens[slots].tolist() == row.tolist()
            assert flat_positions[slots].tolist() == list(range(len(row)))
            assert (reads[: len(reads) - len(row)] == plan.tokens.size).all()  # the zero slot
            for k, slot in enumerate(slots):
                assert _visible(plan, int(slot)) == set(slots[: k + 1].tolist())
        assert plan.tokens.size >= max(len(r) for r in rows)
        assert plan.tokens[0].size == max(map(len, rows)) or plan.trees  # width: largest tree

    @pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8", None])
    def test_min_shared_length_must_be_a_positive_integer(self, bad):
        with pytest.raises(ValueError, match="min_shared_length must be a positive integer"):
            PrefixSharing(True, bad)

    def test_min_shared_is_the_deprecated_name_of_min_shared_length(self):
        with pytest.warns(DeprecationWarning, match="use min_shared_length"):
            sharing = PrefixSharing(True, min_shared=4)
        assert sharing.min_shared_length == 4
        with pytest.warns(DeprecationWarning, match="use min_shared_length"):
            assert sharing.min_shared == 4
        with pytest.warns(DeprecationWarning, match="use min_shared_length"):
            old = prefix_plan(_rows(), min_shared=4)
        assert old.trees == prefix_plan(_rows(), min_shared_length=4).trees
        with pytest.raises(TypeError, match="both min_shared_length and min_shared"):
            prefix_plan(_rows(), 4, min_shared=4)


class TestSharedHidden:
    @pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "mistral"])
    def test_equals_the_dense_pass_and_its_gradients(self, family):
        model = _family_model(family)
        body, rows = model.base_model, _rows()
        plan = prefix_plan(rows, min_shared_length=4)
        shared = _rows_of(shared_hidden(body, plan), rows)
        dense = _dense(body, rows)
        for s, d in zip(shared, dense, strict=True):
            torch.testing.assert_close(s, d, rtol=1e-5, atol=1e-5)
        weights = [torch.randn_like(d) for d in dense]
        params = list(body.parameters())
        grads = [
            torch.autograd.grad(sum((h * w).sum() for h, w in zip(hs, weights)), params)
            for hs in (_rows_of(shared_hidden(body, plan), rows), _dense(body, rows))
        ]
        for a, b in zip(*grads, strict=True):  # within 1e-4 of each parameter's gradient norm
            assert float((a - b).norm()) <= 1e-4 * float(b.norm())

    def test_bf16_is_within_its_precision(self):
        model = _family_model("qwen2", dtype=torch.bfloat16).requires_grad_(False)
        rows = _rows()
        hidden = shared_hidden(model.base_model, prefix_plan(rows, min_shared_length=4))
        for s, d in zip(_rows_of(hidden, rows), _dense(model.base_model, rows), strict=True):
            assert float((s.float() - d.float()).norm() / d.float().norm()) < 3e-2

    def test_rows_that_are_the_prefix_itself(self):
        model = _family_model("qwen2")
        prompt = torch.randint(64, (8,))
        rows = [prompt, prompt.clone(), torch.cat([prompt, torch.tensor([1, 2])])]
        hidden = shared_hidden(model.base_model, prefix_plan(rows, min_shared_length=4))
        for s, d in zip(_rows_of(hidden, rows), _dense(model.base_model, rows)):
            torch.testing.assert_close(s, d, rtol=1e-5, atol=1e-5)

    def test_eager_attention_takes_an_additive_mask(self):
        model = _family_model("llama")
        model.config._attn_implementation = "eager"
        rows = _rows()
        hidden = shared_hidden(model.base_model, prefix_plan(rows, min_shared_length=4))
        for s, d in zip(_rows_of(hidden, rows), _dense(model.base_model, rows), strict=True):
            torch.testing.assert_close(s, d, rtol=1e-5, atol=1e-5)

    def test_sliding_window_layers_see_their_window_on_the_positions(self):
        """Qwen2 with a window of 6 on its second layer: the packed pass gives each sliding
        layer its own mask (a row's tokens more than 6 positions back are out of the window
        in the dense pass, whatever the packing put between them)."""
        import transformers as tf

        config = tf.Qwen2Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
        )
        torch.manual_seed(0)
        body = tf.Qwen2ForCausalLM(config).eval().base_model
        assert set(config.layer_types) == {"full_attention", "sliding_attention"}
        rows = _rows()
        hidden = shared_hidden(body, prefix_plan(rows, min_shared_length=4))
        for s, d in zip(_rows_of(hidden, rows), _dense(body, rows), strict=True):
            torch.testing.assert_close(s, d, rtol=1e-5, atol=1e-5)

    def test_flex_attention_takes_a_block_mask(self):
        """flex_attention gets the mask as a BlockMask (without gradient: torch 2.13's CPU flex
        attention has no backward; on a GPU it has)."""
        import transformers as tf

        config = tf.Qwen2Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_implementation="flex_attention",
        )
        torch.manual_seed(0)
        body = tf.Qwen2ForCausalLM(config).eval().base_model.requires_grad_(False)
        rows = _rows()
        with torch.no_grad():
            hidden = shared_hidden(body, prefix_plan(rows, min_shared_length=4))
            dense = _dense(body, rows)
        for s, d in zip(_rows_of(hidden, rows), dense, strict=True):
            torch.testing.assert_close(s, d, rtol=1e-5, atol=1e-5)

    def test_flash_attention_takes_no_packed_mask(self):
        model = _family_model("qwen2")
        model.config._attn_implementation = "flash_attention_2"
        with pytest.raises(SharingUnsupported, match="'flash_attention_2' takes no custom"):
            shared_hidden(model.base_model, prefix_plan(_rows(), min_shared_length=4))

    def test_one_pass_a_fixed_number_of_operators(self):
        """The body runs once whatever the number of groups, and the operators around it do
        not grow with the rows: 1 group and 8 groups of different prompt lengths."""
        from torchrl_grpo.launches import count_launches

        body = _family_model("qwen2").base_model.requires_grad_(False)
        g = torch.Generator().manual_seed(0)

        def groups(n):
            rows = []
            for length in range(12, 12 + 2 * n, 2):
                prompt = torch.randint(64, (length,), generator=g)
                rows += [torch.cat([prompt, torch.randint(64, (5,), generator=g)]) for _ in "ab"]
            return prefix_plan(rows, min_shared_length=4)

        counts = []
        for plan in (groups(1), groups(8)):
            with count_launches() as launches:
                shared_hidden(body, plan)
            counts.append(launches)
        assert counts[0].ops == counts[1].ops and counts[1].syncs == 0


class _TwoDMaskBody(torch.nn.Module):
    """A body that takes 2-D attention masks only (as some custom models)."""

    def __init__(self, body):
        super().__init__()
        self.inner = body
        self.config = body.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        if attention_mask is not None and attention_mask.ndim != 2:
            raise ValueError(f"expected a [B, T] attention mask, got {attention_mask.ndim}-D")
        return self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )


class TestPrefixSharingFallback:
    def test_a_body_without_a_packed_mask_warns_once_and_goes_dense(self):
        model, rows = _family_model("llama"), _rows()
        sharing = PrefixSharing(True, 4)
        body = _TwoDMaskBody(model.base_model)
        with pytest.warns(UserWarning, match="Shared-prefix scoring is off.*expected a .B, T."):
            assert sharing.hidden(body, rows) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert sharing.hidden(body, rows) is None  # no second warning
        assert "cannot score a packed prefix tree" in sharing.off_reason

    def test_a_wrong_shared_pass_is_caught_by_the_first_call_check(self, monkeypatch):
        model, rows = _family_model("qwen2"), _rows()
        honest = prefix_module.shared_hidden

        def off_by_a_little(body, plan):
            return honest(body, plan) + 1e-2

        monkeypatch.setattr(prefix_module, "shared_hidden", off_by_a_little)
        sharing = PrefixSharing(True, 4)
        with pytest.warns(UserWarning, match="differ from the dense pass"):
            assert sharing.hidden(model.base_model, rows) is None
        assert sharing.plan(rows) is None  # off for good

    def test_switched_off_or_nothing_shared(self):
        model, rows = _family_model("qwen2"), _rows()
        assert PrefixSharing(False, 4).hidden(model.base_model, rows) is None
        assert PrefixSharing(True, 100).hidden(model.base_model, rows) is None
        packed = PrefixSharing(False, 4).hidden(model.base_model, rows, pack=True)
        for s, d in zip(_rows_of(packed, rows), _dense(model.base_model, rows), strict=True):
            torch.testing.assert_close(s, d, rtol=1e-5, atol=1e-5)  # packed, nothing shared


def _group_batch(model, tokenizer, make_llm_batch, group: int = 4):
    """GRPO groups: each prompt of ``GROUP_PROMPTS`` sampled ``group`` times."""
    prompts = [p for p in GROUP_PROMPTS for _ in range(group)]
    return make_llm_batch(model, tokenizer, prompts)


def _run(loss, batch, model):
    model.zero_grad(set_to_none=True)
    out = loss(batch.copy())
    sum(value for key, value in out.items() if key.startswith("loss_")).backward()
    return out, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _scorers(model, tokenizer, make_llm_scorer, **kwargs):
    """torchrl's wrapper (padded model input: torchrl 0.14.1's packed input lets a token see
    the rest of its sequence) and the lean one, sharing prefixes of 2 tokens or more."""
    plain = make_llm_scorer(model, tokenizer, **(kwargs | {"pad_model_input": True}))
    lean = make_llm_scorer(model, tokenizer, lean=True, min_shared_length=2, **kwargs)
    return plain, lean


class TestLeanWrapperSharesPrefixes:
    @pytest.mark.parametrize("pad_model_input", [True, False])
    @pytest.mark.parametrize("pad_output", [False, True])
    def test_log_probs_equal_torchrls(
        self, tiny_llm, make_llm_batch, make_llm_scorer, pad_model_input, pad_output
    ):
        model, tokenizer = tiny_llm
        batch = _group_batch(model, tokenizer, make_llm_batch)
        if pad_output:  # as a sampler with pad_output=True stores it: left-padded, with a mask
            full = batch.get(
                ("tokens", "full"),
                as_padded_tensor=True,
                padding_side="left",
                padding_value=tokenizer.pad_token_id,
            )
            mask = batch.get(
                ("masks", "all_attention_mask"),
                as_padded_tensor=True,
                padding_side="left",
                padding_value=False,
            )
            batch = TensorDict(
                tokens=Tokens(full=full, batch_size=[len(full)]),
                masks=TensorDict(all_attention_mask=mask, batch_size=[len(full)]),
                batch_size=[len(full)],
            )
        kwargs = dict(pad_model_input=pad_model_input, pad_output=pad_output)
        plain, lean = _scorers(model, tokenizer, make_llm_scorer, **kwargs)
        calls = []
        original = prefix_module.shared_hidden
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(
                prefix_module,
                "shared_hidden",
                lambda *a: calls.append(a[1]) or original(*a),
            )
            with torch.no_grad():
                ours = lean(batch.copy()).get(("log_probs", "full"), as_list=True)
                theirs = plain(batch.copy()).get(("log_probs", "full"), as_list=True)
        assert calls and calls[0].shared_tokens >= len(GROUP_PROMPTS) * 3 * 8  # it did share
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("masking_strategy", ["sft", "rlhf", "generic"])
    @pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
    def test_loss_and_gradients_equal_torchrls(
        self, tiny_llm, make_llm_batch, make_llm_scorer, masking_strategy, aggregation
    ):
        model, tokenizer = tiny_llm
        batch = _group_batch(model, tokenizer, make_llm_batch)
        plain, lean = _scorers(model, tokenizer, make_llm_scorer)
        kwargs = dict(masking_strategy=masking_strategy, clip_epsilon=(0.2, 0.28))
        if aggregation == "seq_mean_token_sum_norm":  # Dr. GRPO's constant length
            kwargs["max_length"] = 32
        ref, ref_grad = _run(GRPOLoss(plain, aggregation=aggregation, **kwargs), batch, model)
        out, grad = _run(GRPOLoss(lean, aggregation=aggregation, **kwargs), batch, model)
        assert lean.sharing.checked and lean.sharing.off_reason is None
        for key in ("loss_objective", "loss_entropy", "ESS"):
            torch.testing.assert_close(out.get(key), ref.get(key), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
        if aggregation == "token_mean" and masking_strategy == "sft":  # torchrl's own loss too
            kwargs.pop("max_length", None)
            theirs, theirs_grad = _run(TorchrlGRPOLoss(plain, **kwargs), batch, model)
            torch.testing.assert_close(
                out.loss_objective, theirs.loss_objective, rtol=1e-5, atol=1e-6
            )
            torch.testing.assert_close(grad, theirs_grad, rtol=1e-4, atol=1e-6)

    def test_bf16_model(self, tiny_llm, make_llm_batch, make_llm_scorer):
        model, tokenizer = tiny_llm
        batch = _group_batch(model, tokenizer, make_llm_batch)
        model = model.to(torch.bfloat16)
        shared = make_llm_scorer(model, tokenizer, lean=True, min_shared_length=2)
        dense = make_llm_scorer(model, tokenizer, lean=True, share_prefix=False)
        with torch.no_grad():
            ours = shared(batch.copy()).get(("log_probs", "full"), as_list=True)
            theirs = dense(batch.copy()).get(("log_probs", "full"), as_list=True)
        assert shared.sharing.checked and shared.sharing.off_reason is None
        for a, b in zip(ours, theirs, strict=True):  # bf16 hidden states, float32 log-probs
            torch.testing.assert_close(a, b, rtol=0, atol=1e-2)

    def test_dialog_turns_each_extending_the_last(self, tiny_llm, make_llm_scorer):
        model, tokenizer = tiny_llm
        g = torch.Generator().manual_seed(3)
        turns, tokens = [], torch.tensor(tokenizer("3 9 1 4=")["input_ids"])
        for _ in range(3):  # prompt, answer; the next prompt is it all plus a reply
            answer = torch.randint(10, (3,), generator=g)
            turns.append(TensorDict(tokens=Tokens(prompt=tokens, full=torch.cat([tokens, answer]))))
            tokens = torch.cat([tokens, answer, torch.randint(10, (2,), generator=g)])
        with tensordict.set_list_to_stack(True), torch.no_grad():
            batch = lazy_stack(turns)
            plain, lean = _scorers(model, tokenizer, make_llm_scorer)
            ours = lean(batch.copy()).get(("log_probs", "full"), as_list=True)
            theirs = plain(batch.copy()).get(("log_probs", "full"), as_list=True)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert lean.sharing.checked


class TestMultiTurnBatch:
    def test_exact_turns_of_an_agent_score_as_torchrl(self, tiny_llm, make_llm_scorer):
        """Two turns of four dialogs through ``ExactTurns`` (each second turn starts with its
        whole first turn), stored as a collector stores them: the loss on the shared path
        equals torchrl's loss on torchrl's wrapper, gradients included."""
        from helpers.llm import dialog_env, dialog_sampler

        model, tokenizer = tiny_llm
        queries = ["3 9 1 4=", "1 2 0 5=", "5 5 5 1=", "7 0 0 2="]
        env, policy = dialog_env(tokenizer, queries), dialog_sampler(model, tokenizer)
        g = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        with tensordict.set_list_to_stack(True):
            td = env.reset(TensorDict(query=queries, batch_size=[len(queries)]))
            turns = []
            for _ in range(2):
                stored, td = env.step_and_maybe_reset(policy(td))
                turns += list(stored.unbind(0))
            batch = lazy_stack(turns)
            plain, lean = _scorers(model, tokenizer, make_llm_scorer)
            with torch.no_grad():
                scored = plain(batch.copy()).get(("log_probs", "full"), as_list=True)
            for row, lp in zip(batch.tensordicts, scored, strict=True):
                row.set(("log_probs", "full"), lp + 0.3 * torch.randn(lp.shape, generator=g))
                row.set("advantage", torch.randn(1, 1, generator=g))
            ref, ref_grad = _run(TorchrlGRPOLoss(plain, masking_strategy="sft"), batch, model)
            out, grad = _run(GRPOLoss(lean, masking_strategy="sft"), batch, model)
        fulls = batch.get(("tokens", "full"), as_list=True)
        assert all(torch.equal(fulls[i + 4][: len(fulls[i])], fulls[i]) for i in range(4))
        assert lean.sharing.checked and lean.sharing.off_reason is None
        torch.testing.assert_close(out.loss_objective, ref.loss_objective, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.ESS, ref.ESS, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)


def _head_positions(monkeypatch) -> list:
    """The number of positions the lean wrapper runs its output layer on, call by call."""
    from torchrl_grpo.llm import lean_wrapper

    scored = []
    original = lean_wrapper.token_log_prob_entropy_from_hidden

    def counting(hidden, *args, **kwargs):
        scored.append(hidden.shape[0])
        return original(hidden, *args, **kwargs)

    monkeypatch.setattr(lean_wrapper, "token_log_prob_entropy_from_hidden", counting)
    return scored


class TestLogProbsAtResponse:
    @pytest.mark.parametrize("pad_model_input", [True, False], ids=["padded", "packed"])
    def test_the_response_is_torchrls_and_the_prompt_is_zero(
        self, tiny_llm, make_llm_batch, make_llm_scorer, monkeypatch, pad_model_input
    ):
        model, tokenizer = tiny_llm
        batch = _group_batch(model, tokenizer, make_llm_batch, group=2)
        plain = make_llm_scorer(model, tokenizer)
        lean = make_llm_scorer(
            model, tokenizer, lean=True, log_probs_at="response", pad_model_input=pad_model_input
        )
        scored = _head_positions(monkeypatch)
        with torch.no_grad():
            ours = lean(batch.copy()).get(("log_probs", "full"), as_list=True)
            theirs = plain(batch.copy()).get(("log_probs", "full"), as_list=True)
        prompts = batch.get(("tokens", "prompt"), as_list=True)
        for a, b, p in zip(ours, theirs, prompts, strict=True):
            torch.testing.assert_close(a[len(p) :], b[len(p) :], rtol=1e-5, atol=1e-5)
            assert not a[: len(p)].any()
        assert scored == [sum(len(a) - len(p) for a, p in zip(ours, prompts))]

    def test_padded_as_a_sampler_pads(self, tiny_llm, make_llm_batch, make_llm_scorer):
        model, tokenizer = tiny_llm
        ragged = _group_batch(model, tokenizer, make_llm_batch, group=2)
        pad = tokenizer.pad_token_id
        prompts = ragged.get(("tokens", "prompt"), as_list=True)
        responses = [
            f[len(p) :] for f, p in zip(ragged.get(("tokens", "full"), as_list=True), prompts)
        ]
        left = torch.nn.utils.rnn.pad_sequence(prompts, True, pad, padding_side="left")
        right = torch.nn.utils.rnn.pad_sequence(responses, True, pad)
        masks = [
            torch.nn.utils.rnn.pad_sequence(
                [torch.ones(len(x), dtype=torch.bool) for x in xs], True, False, padding_side=side
            )
            for xs, side in ((prompts, "left"), (responses, "right"))
        ]
        n = len(prompts)
        batch = TensorDict(
            tokens=Tokens(prompt=left, full=torch.cat([left, right], 1), batch_size=[n]),
            masks=TensorDict(all_attention_mask=torch.cat(masks, 1), batch_size=[n]),
            batch_size=[n],
        )
        plain = make_llm_scorer(model, tokenizer, pad_output=True)
        lean = make_llm_scorer(
            model, tokenizer, lean=True, pad_output=True, log_probs_at="response"
        )
        with torch.no_grad():
            ours = lean(batch.copy()).get(("log_probs", "full"))
            theirs = plain(batch.copy()).get(("log_probs", "full"))
        width = left.shape[1]
        torch.testing.assert_close(ours[:, width:], theirs[:, width:], rtol=1e-5, atol=1e-5)
        assert not ours[:, :width].any() and theirs[:, 1:width].any()

    def test_without_a_prompt_every_position_is_scored(self, tiny_llm, make_llm_scorer):
        model, tokenizer = tiny_llm
        lean = make_llm_scorer(model, tokenizer, lean=True, log_probs_at="response")
        plain = make_llm_scorer(model, tokenizer)
        full = [torch.tensor(tokenizer(t)["input_ids"]) for t in ("1 2=3", "4 4 4=12")]
        with tensordict.set_list_to_stack(True), torch.no_grad():
            batch = lazy_stack([TensorDict(tokens=Tokens(full=f)) for f in full])
            ours = lean(batch.copy()).get(("log_probs", "full"), as_list=True)
            theirs = plain(batch.copy()).get(("log_probs", "full"), as_list=True)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    def test_bad_values(self, tiny_llm, make_llm_scorer):
        model, tokenizer = tiny_llm
        with pytest.raises(ValueError, match="log_probs_at must be one of"):
            make_llm_scorer(model, tokenizer, lean=True, log_probs_at="prompt")
        with pytest.raises(ValueError, match="min_shared_length must be a positive integer"):
            make_llm_scorer(model, tokenizer, lean=True, min_shared_length=0)
        lean = make_llm_scorer(model, tokenizer, lean=True, min_shared_length=8)
        new = lean.get_new_version(log_probs_at="response")  # the lean keywords carried over
        assert (new.sharing.min_shared_length, new.log_probs_at) == (8, "response")

    def test_the_loss_runs_the_head_on_its_mask_only(
        self, tiny_llm, make_llm_batch, make_llm_scorer, monkeypatch
    ):
        model, tokenizer = tiny_llm
        batch = _group_batch(model, tokenizer, make_llm_batch, group=2)
        lean = make_llm_scorer(model, tokenizer, lean=True)
        scored = _head_positions(monkeypatch)
        GRPOLoss(lean, masking_strategy="sft")(batch.copy())
        prompts = batch.get(("tokens", "prompt"), as_list=True)
        fulls = batch.get(("tokens", "full"), as_list=True)
        assert scored == [sum(len(f) - len(p) for f, p in zip(fulls, prompts))]
