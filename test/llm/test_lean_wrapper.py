"""Tests of torchrl_grpo/llm/lean_wrapper.py: LeanTransformersWrapper and its distribution.

Every number is checked against torchrl's own ``TransformersWrapper`` (and torchrl's
``GRPOLoss``) on the same model and batch; the memory promise (no ``[B, T, V]`` tensor) is
checked by recording every tensor that torch creates during a forward and backward pass.
"""

import math
import os

import pytest
import torch

try:
    import transformers  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs the `llm` extra (make test): without it this is a failure, not a skip
    pytest.skip("needs the llm extra: pip install -e '.[llm]'", allow_module_level=True)

import tensordict
from tensordict import TensorDict, lazy_stack
from torch.utils._python_dispatch import TorchDispatchMode
from torchrl.data.llm import History
from torchrl.envs.llm import RetrieveLogProb
from torchrl.modules.distributions import LLMMaskedCategorical
from torchrl.modules.llm import LLMWrapperBase, TransformersWrapper
from torchrl.modules.llm.policies.common import Tokens
from torchrl.objectives.llm import GRPOLoss as TorchrlGRPOLoss

from torchrl_grpo import (
    CISPOLoss,
    DAPOLoss,
    DrGRPOLoss,
    GRPOLoss,
    GSPOLoss,
    HiddenLLMMaskedCategorical,
    LeanTransformersWrapper,
    SAPOLoss,
)
from torchrl_grpo.loss_terms import AGGREGATIONS

LOSS_KEYS = ("loss_objective", "loss_entropy", "ESS")
#: a chat template with the assistant's turn marked, for history input
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
)
TEXTS = ["3 9 1 4=17", "1 2=3", "5 5 5=15", "7=7"]


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _run(loss, batch, model):
    """The loss on a copy of ``batch``, and the gradient of its ``loss_*`` terms."""
    model.zero_grad(set_to_none=True)
    out = loss(batch.copy())
    sum(value for key, value in out.items() if key.startswith("loss_")).backward()
    return out, _grads(model)


def _assert_same_loss(out, grad, ref, ref_grad, keys=LOSS_KEYS):
    for key in keys:
        torch.testing.assert_close(out.get(key), ref.get(key), rtol=1e-5, atol=1e-6, msg=key)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)


def _inputs(tokenizer, mode: str):
    """``TEXTS`` as a ragged lazy stack of the input mode's entry."""
    if mode == "tokens":
        full = [torch.tensor(tokenizer(t)["input_ids"]) for t in TEXTS]
        return lazy_stack([TensorDict(tokens=Tokens(full=f)) for f in full])
    if mode == "text":
        return lazy_stack([TensorDict(text=TensorDict(full=t)) for t in TEXTS])
    chats = []
    for t in TEXTS:
        prompt, answer = t.split("=")
        chat = [{"role": "user", "content": prompt + "="}, {"role": "assistant", "content": answer}]
        chats.append(History.from_chats([chat])[0])
    return lazy_stack([TensorDict(history=TensorDict(full=h)) for h in chats])


def _wrappers(model, tokenizer, **kwargs):
    """``(torchrl's TransformersWrapper, LeanTransformersWrapper)`` with the same arguments."""
    kwargs = dict(tokenizer=tokenizer, generate=False, return_log_probs=True) | kwargs
    return TransformersWrapper(model, **kwargs), LeanTransformersWrapper(model, **kwargs)


class _LargestOutputs(TorchDispatchMode):
    """Records the shape of every tensor an operation returns whose last dimension is ``V``."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.shapes = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor) and x.ndim and x.shape[-1] == self.vocab:
                self.shapes.append(tuple(x.shape))
        return out


def _word_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab - 1)} | {"<pad>": vocab - 1}
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>")


class TestLeanTransformersWrapper:
    def test_is_a_torchrl_transformers_wrapper(self, tiny_llm):
        model, tokenizer = tiny_llm
        plain, lean = _wrappers(model, tokenizer, input_mode="tokens")
        assert isinstance(lean, LLMWrapperBase) and isinstance(lean, TransformersWrapper)
        assert lean.in_keys == plain.in_keys and lean.out_keys == plain.out_keys
        # the model is registered once: no second copy of the body or head in the state
        assert list(lean.state_dict()) == list(plain.state_dict())

    @pytest.mark.parametrize("pad_model_input", [True, False], ids=["padded", "packed"])
    @pytest.mark.parametrize("mode", ["tokens", "text", "history"])
    def test_log_probs_and_entries_are_torchrl(self, tiny_llm, mode, pad_model_input):
        """The numbers of torchrl's padded model input, packed or padded, in every input mode."""
        model, tokenizer = tiny_llm
        kwargs = dict(input_mode=mode, pad_output=False, chat_template=TEMPLATE)
        plain, _ = _wrappers(model, tokenizer, pad_model_input=True, **kwargs)
        _, lean = _wrappers(model, tokenizer, pad_model_input=pad_model_input, **kwargs)
        with tensordict.set_list_to_stack(True), torch.no_grad():
            expected = plain(_inputs(tokenizer, mode))
            out = lean(_inputs(tokenizer, mode))
        assert set(out.keys(True, True)) == set(expected.keys(True, True))
        for a, b in zip(
            out.get(("log_probs", "full"), as_list=True),
            expected.get(("log_probs", "full"), as_list=True),
        ):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for key in (("tokens", "full"), ("masks", "all_attention_mask")):
            for a, b in zip(out.get(key, as_list=True), expected.get(key, as_list=True)):
                assert torch.equal(a, b), key

    def test_packed_input_is_causal_per_sequence(self, tiny_llm):
        """Each packed sequence is scored as if alone (torchrl 0.14.1's packed path is not:
        its mask lets a token see the rest of its sequence; this test shows the gap)."""
        model, tokenizer = tiny_llm
        packed, lean = _wrappers(model, tokenizer, input_mode="tokens", pad_model_input=False)
        lean.pad_model_input = False
        with tensordict.set_list_to_stack(True), torch.no_grad():
            ours = lean(_inputs(tokenizer, "tokens")).get(("log_probs", "full"), as_list=True)
            theirs = packed(_inputs(tokenizer, "tokens")).get(("log_probs", "full"), as_list=True)
            for row, tokens in enumerate(
                _inputs(tokenizer, "tokens").get(("tokens", "full"), as_list=True)
            ):  # noqa: E501
                alone = model(tokens[None]).logits[0, :-1].log_softmax(-1)
                alone = alone.gather(-1, tokens[1:, None])[:, 0]
                torch.testing.assert_close(ours[row][1:], alone, rtol=1e-5, atol=1e-5)
                assert ours[row][0] == 0
        assert max((a - b).abs().max() for a, b in zip(ours, theirs)) > 1e-2  # torchrl's gap

    def test_pad_output_true(self, tiny_llm):
        model, tokenizer = tiny_llm
        plain, lean = _wrappers(model, tokenizer, input_mode="tokens", pad_output=True)
        same_length = lazy_stack(
            [TensorDict(tokens=Tokens(full=torch.randint(12, (6,)))) for _ in range(3)]
        )
        with tensordict.set_list_to_stack(True), torch.no_grad():
            expected = plain(same_length.copy()).get(("log_probs", "full"))
            out = lean(same_length.copy()).get(("log_probs", "full"))
        assert out.shape == (3, 6)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize(
        "family, tied, head_bias",
        [
            ("qwen2", False, False),
            ("qwen2", True, False),
            ("qwen2", False, True),
            ("llama", False, False),
            ("llama", True, True),
        ],
        ids=["qwen2", "qwen2-tied", "qwen2-head-bias", "llama", "llama-tied-bias"],
    )
    def test_model_families(
        self, tiny_llm, make_causal_lm, make_llm_batch, family, tied, head_bias
    ):
        _, tokenizer = tiny_llm
        model = make_causal_lm(tokenizer, family, tied=tied, head_bias=head_bias)
        batch = make_llm_batch(model, tokenizer)
        plain, lean = _wrappers(model, tokenizer, input_mode="tokens", input_key=("tokens", "full"))
        with tensordict.set_list_to_stack(True), torch.no_grad():
            for a, b in zip(
                lean(batch.copy()).get(("log_probs", "full"), as_list=True),
                plain(batch.copy()).get(("log_probs", "full"), as_list=True),
            ):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for strategy in ("sft", "generic"):
            ref, ref_grad = _run(TorchrlGRPOLoss(plain, masking_strategy=strategy), batch, model)
            out, grad = _run(GRPOLoss(lean, masking_strategy=strategy), batch, model)
            _assert_same_loss(out, grad, ref, ref_grad)

    def test_chunk_size_changes_nothing(self, tiny_llm, make_llm_batch):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        results = []
        for chunk_size in (1, 3, None):
            lean = LeanTransformersWrapper(
                model,
                tokenizer=tokenizer,
                input_mode="tokens",
                generate=False,
                return_log_probs=True,
                chunk_size=chunk_size,
            )
            results.append(_run(GRPOLoss(lean), batch, model))
        for out, grad in results[:2]:
            _assert_same_loss(out, grad, *results[2])

    def test_output_layer_validated_once(self, tiny_llm, make_llm_batch, monkeypatch):
        """The model's output layer is checked at construction, not at each use in a call;
        again only when it is another module (a new head)."""
        from torchrl_grpo.llm import lean_wrapper

        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        lean = LeanTransformersWrapper(
            model, tokenizer=tokenizer, input_mode="tokens", generate=False
        )
        calls = []
        checked = lean_wrapper.output_layer
        monkeypatch.setattr(lean_wrapper, "output_layer", lambda m: calls.append(m) or checked(m))
        GRPOLoss(lean)(batch.copy()).loss_objective.backward()
        assert calls == []
        head = model.lm_head
        model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=False)
        lean(batch.select(("tokens", "full")).copy())
        assert calls == [model]

    def test_never_builds_the_logits(self):
        """No tensor with the vocabulary as last dimension is larger than one chunk, in the
        forward or the backward pass (the same probe sees torchrl's wrapper build them)."""
        from transformers import Qwen2Config, Qwen2ForCausalLM

        vocab, chunk = 2000, 4
        tokenizer = _word_tokenizer(vocab)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=vocab,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                pad_token_id=vocab - 1,
            )
        ).eval()
        g = torch.Generator().manual_seed(0)
        steps = []
        for n in (24, 17, 30):
            full = torch.randint(vocab - 1, (n,), generator=g)
            steps.append(
                TensorDict(
                    tokens=Tokens(full=full, prompt=full[:5]),
                    log_probs=TensorDict(full=-8.0 + torch.randn(n, generator=g)),
                    advantage=torch.randn(1, 1, generator=g),
                )
            )
        batch = lazy_stack(steps)
        kwargs = dict(tokenizer=tokenizer, input_mode="tokens", generate=False)
        lean = LeanTransformersWrapper(model, chunk_size=chunk, return_log_probs=True, **kwargs)
        plain = TransformersWrapper(model, return_log_probs=True, **kwargs)
        for policy, builds_logits in ((plain, True), (lean, False)):
            probe = _LargestOutputs(vocab)
            with probe, tensordict.set_list_to_stack(True):
                out = GRPOLoss(policy, entropy_coeff=0.01)(batch.copy())
                (out.loss_objective + out.loss_entropy).backward()
                policy(batch.copy())  # the forward pass that writes ("log_probs", "full")
            positions = max(math.prod(s) for s in probe.shapes) // vocab
            if builds_logits:
                assert positions >= 3 * 30, probe.shapes  # [B, T, V]
            else:
                # chunks of logits, and the head's weight seen as [H, V] (a view, in F.linear)
                assert positions <= 16, set(probe.shapes)
                assert all(s[0] <= chunk or s == (16, vocab) for s in probe.shapes), probe.shapes

    def test_retrieve_log_prob_with_a_lean_reference(self, tiny_llm, make_llm_batch):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        kwargs = dict(input_mode="tokens", log_probs_key="ref_log_probs")
        plain, lean = _wrappers(model, tokenizer, **kwargs)
        with tensordict.set_list_to_stack(True), torch.no_grad():
            expected = RetrieveLogProb(plain, assistant_only=False)(batch.copy())
            out = RetrieveLogProb(lean, assistant_only=False)(batch.copy())
        key = ("next", "ref_log_probs", "full")  # RetrieveLogProb writes into "next"
        stored = batch.get(key, as_list=True)
        assert not torch.equal(stored[0], expected.get(key, as_list=True)[0])  # overwritten
        for a, b in zip(out.get(key, as_list=True), expected.get(key, as_list=True)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    def test_bf16_model_accumulates_in_float32(self, tiny_llm, make_llm_batch):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        model = model.to(torch.bfloat16)
        results = {}
        for cast in (False, True):
            lean = LeanTransformersWrapper(
                model,
                tokenizer=tokenizer,
                input_mode="tokens",
                generate=False,
                cast_head_to_float32=cast,
            )
            with tensordict.set_list_to_stack(True), torch.no_grad():
                results[cast] = lean(batch.copy()).get(("log_probs", "full"), as_list=True)
        # by hand: the body's hidden states, the head in bf16 or float32, log-softmax in float32
        with torch.no_grad():
            for row, tokens in enumerate(batch.get(("tokens", "full"), as_list=True)):
                hidden = model.model(input_ids=tokens[None]).last_hidden_state[0, :-1]
                weight = model.lm_head.weight
                for cast, logits in (
                    (False, (hidden @ weight.T).float()),
                    (True, hidden.float() @ weight.float().T),
                ):
                    expected = logits.log_softmax(-1).gather(-1, tokens[1:, None])[:, 0]
                    out = results[cast][row]
                    assert out.dtype == torch.float32
                    # bf16 rounding would be ~1e-2: the reduction is in float32
                    torch.testing.assert_close(out[1:], expected, rtol=1e-4, atol=1e-4)
                    assert out[0] == 0  # torchrl's first position
        # and within bf16 rounding of torchrl's own bf16 path
        plain, _ = _wrappers(model, tokenizer, input_mode="tokens")
        with tensordict.set_list_to_stack(True), torch.no_grad():
            theirs = plain(batch.copy()).get(("log_probs", "full"), as_list=True)
        for a, b in zip(results[True], theirs):
            torch.testing.assert_close(a, b.float(), rtol=0.05, atol=0.05)
        model.zero_grad(set_to_none=True)
        out = GRPOLoss(lean)(batch.copy())  # cast_head_to_float32=True
        out.loss_objective.backward()
        assert model.lm_head.weight.grad.dtype == torch.bfloat16
        assert torch.isfinite(model.lm_head.weight.grad.float()).all()

    def test_get_new_version_keeps_the_lean_arguments(self, tiny_llm):
        model, tokenizer = tiny_llm
        lean = LeanTransformersWrapper(
            model,
            tokenizer=tokenizer,
            input_mode="tokens",
            generate=False,
            chunk_size=7,
            cast_head_to_float32=True,
        )
        new = lean.get_new_version(input_mode="text")
        assert isinstance(new, LeanTransformersWrapper) and new.input_mode == "text"
        assert (new.chunk_size, new.cast_head_to_float32) == (7, True)
        assert lean.get_new_version(chunk_size=3).chunk_size == 3

    def test_generation_is_torchrls(self, tiny_llm):
        model, tokenizer = tiny_llm
        kwargs = dict(
            tokenizer=tokenizer,
            input_mode="tokens",
            generate=True,
            generate_kwargs={"max_new_tokens": 3, "do_sample": True},
        )
        ids = [torch.tensor(tokenizer(p)["input_ids"]) for p in ("1 2=", "7=")]
        prompts = lazy_stack([TensorDict(tokens=Tokens(prompt=p)) for p in ids])
        outs = []
        for cls in (TransformersWrapper, LeanTransformersWrapper):
            torch.manual_seed(3)
            with tensordict.set_list_to_stack(True), torch.no_grad():
                outs.append(cls(model, **kwargs)(prompts.copy()))
        for key in (("tokens", "response"), ("log_probs", "response")):
            for a, b in zip(outs[0].get(key, as_list=True), outs[1].get(key, as_list=True)):
                torch.testing.assert_close(a, b)

    def test_get_dist_masks_by_attention_without_mask_key(self, tiny_llm, make_llm_batch):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        plain, lean = _wrappers(model, tokenizer, input_mode="tokens")
        with tensordict.set_list_to_stack(True):
            dist = lean.get_dist(batch.copy())
            expected = plain.get_dist(batch.copy(), mask_key=("masks", "all_attention_mask"))
        assert isinstance(dist, HiddenLLMMaskedCategorical)
        assert torch.equal(dist.mask, expected.mask)
        tokens = batch.get(("tokens", "full"), as_padded_tensor=True, padding_side="left")
        torch.testing.assert_close(dist.log_prob(tokens), expected.log_prob(tokens))

    @pytest.mark.parametrize("chunk_size", [0, -2, 1.5, True, "8"])
    def test_bad_chunk_size(self, tiny_llm, chunk_size):
        model, tokenizer = tiny_llm
        with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
            LeanTransformersWrapper(model, tokenizer=tokenizer, chunk_size=chunk_size)

    def test_model_without_output_layer(self, tiny_llm):
        model, tokenizer = tiny_llm
        with pytest.raises(ValueError, match=r"Qwen2Model.get_output_embeddings\(\) is missing"):
            LeanTransformersWrapper(model.model, tokenizer=tokenizer, generate=False)

    def test_model_that_transforms_its_logits(self, tiny_llm):
        model, tokenizer = tiny_llm
        model.config.final_logit_softcapping = 30.0
        with pytest.raises(NotImplementedError, match="config.final_logit_softcapping=30.0"):
            LeanTransformersWrapper(model, tokenizer=tokenizer, generate=False)


# the loss on the lean wrapper equals torchrl's loss on the plain one, for every strategy,
# aggregation and variant
VARIANTS = [
    (GRPOLoss, {}),
    *[(GRPOLoss, {"aggregation": a}) for a in AGGREGATIONS if a != "seq_mean_token_sum_norm"],
    (GRPOLoss, {"kl_to_ref_coeff": 0.1, "kl_to_ref_estimator": "k3"}),
    (GRPOLoss, {"kl_to_inference_coeff": 0.1, "clip_ratio_c": 3.0}),
    (GRPOLoss, {"top_entropy_quantile": 0.5, "entropy_coeff": 0.05}),
    (DAPOLoss, {}),
    (DrGRPOLoss, {"max_length": 8}),
    (GSPOLoss, {}),
    (CISPOLoss, {}),
    (SAPOLoss, {}),
]


class TestGRPOLossOnLeanWrapper:
    @pytest.mark.parametrize("masking_strategy", ["sft", "rlhf", "generic"])
    def test_equals_torchrl_grpo_loss_on_torchrls_wrapper(
        self, tiny_llm, make_llm_batch, make_llm_scorer, masking_strategy
    ):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        plain = make_llm_scorer(model, tokenizer)
        lean = make_llm_scorer(model, tokenizer, lean=True)
        kwargs = dict(masking_strategy=masking_strategy, clip_epsilon=(0.2, 0.28))
        ref, ref_grad = _run(TorchrlGRPOLoss(plain, **kwargs), batch, model)
        assert 0 < ref.clip_fraction < 1  # the comparison exercises clipping
        for loss_cls in (GRPOLoss, TorchrlGRPOLoss):  # ours, and torchrl's own on the lean one
            out, grad = _run(loss_cls(lean, **kwargs), batch, model)
            _assert_same_loss(out, grad, ref, ref_grad)

    def test_packed_model_input_gives_the_padded_loss(
        self, tiny_llm, make_llm_batch, make_llm_scorer
    ):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        plain = make_llm_scorer(model, tokenizer)
        packed = make_llm_scorer(model, tokenizer, lean=True, pad_model_input=False)
        ref, ref_grad = _run(TorchrlGRPOLoss(plain, masking_strategy="sft"), batch, model)
        out, grad = _run(GRPOLoss(packed, masking_strategy="sft"), batch, model)
        _assert_same_loss(out, grad, ref, ref_grad)

    @pytest.mark.parametrize(
        "cls, kwargs", VARIANTS, ids=[f"{c.__name__}-{k}" for c, k in VARIANTS]
    )
    def test_every_variant_equals_the_logits_path(
        self, tiny_llm, make_llm_batch, make_llm_scorer, cls, kwargs
    ):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        plain = make_llm_scorer(model, tokenizer)
        lean = make_llm_scorer(model, tokenizer, lean=True)
        ref, ref_grad = _run(cls(plain, **kwargs), batch, model)
        out, grad = _run(cls(lean, **kwargs), batch, model)
        keys = [k for k, v in ref.items() if v is not None and v.numel() == 1]
        assert "loss_objective" in keys and "ESS" in keys
        _assert_same_loss(out, grad, ref, ref_grad, keys=keys)


class TestHiddenLLMMaskedCategorical:
    def _pair(self):
        torch.manual_seed(0)
        hidden, head = torch.randn(3, 6, 8), torch.nn.Linear(8, 40)
        mask = torch.rand(3, 6) > 0.4
        lean = HiddenLLMMaskedCategorical(hidden, mask, head.weight, head.bias, chunk_size=4)
        return lean, LLMMaskedCategorical(head(hidden), mask), mask

    def test_log_prob_entropy_as_torchrl(self):
        lean, ref, mask = self._pair()
        tokens = torch.randint(40, (3, 6))
        tokens[0, 0] = -100  # ignore_index
        torch.testing.assert_close(lean.log_prob(tokens), ref.log_prob(tokens))
        torch.testing.assert_close(lean.entropy(), ref.entropy(), rtol=1e-5, atol=1e-5)
        assert (lean.entropy()[~mask] == 0).all()  # torchrl's masked logits: entropy 0
        assert (lean.log_prob(tokens)[~mask] == 0).all()
        log_prob, entropy = lean.log_prob_entropy(tokens)
        torch.testing.assert_close(log_prob, ref.log_prob(tokens))
        torch.testing.assert_close(entropy[mask], ref.entropy()[mask], rtol=1e-5, atol=1e-5)

    def test_sample_and_mode(self):
        lean, ref, mask = self._pair()
        assert lean.sample().shape == (3, 6) and lean.sample((2,)).shape == (2, 3, 6)
        assert torch.equal(lean.mode[mask], ref.mode[mask])
        assert (lean.mode[~mask] == 0).all()

    def test_mask_shape_is_checked(self):
        with pytest.raises(ValueError, match=r"mask \(3, 5\) does not match"):
            HiddenLLMMaskedCategorical(
                torch.randn(3, 6, 8), torch.ones(3, 5, dtype=torch.bool), torch.randn(40, 8)
            )

    def test_log_probs_at_ids_on_the_mask_only(self):
        lean, ref, mask = self._pair()
        ids = torch.randint(40, (3, 6, 5))
        ours = lean.log_probs_at(ids)
        expected = ref.logits.log_softmax(-1).gather(-1, ids)
        torch.testing.assert_close(ours[mask], expected[mask])
        assert (ours[~mask] == 0).all()
        with pytest.raises(ValueError, match=r"ids \(3, 5, 2\) do not match"):
            lean.log_probs_at(torch.zeros(3, 5, 2, dtype=torch.long))


class TestTopLogProbs:
    """``LeanTransformersWrapper.top_log_probs``: a teacher's top tokens, laid out as the
    log-probs the wrapper writes, against the model's own logits."""

    @pytest.mark.parametrize("log_probs_at", ["all", "response"])
    def test_top_tokens_of_ragged_rows(self, tiny_llm, make_llm_scorer, log_probs_at):
        model, tokenizer = tiny_llm
        lean = make_llm_scorer(model, tokenizer, lean=True, log_probs_at=log_probs_at)
        full = [torch.tensor(tokenizer(t)["input_ids"]) for t in TEXTS]
        batch = lazy_stack([TensorDict(tokens=Tokens(full=f, prompt=f[:3])) for f in full])
        token_log_probs, values, ids = lean.top_log_probs(batch, 3)
        written = lean(batch.copy()).get(("log_probs", "full"), as_list=True)
        for a, b in zip(token_log_probs, written, strict=True):
            torch.testing.assert_close(a, b)
        first = 3 if log_probs_at == "response" else 1  # no log-prob before it
        for row, v, i in zip(full, values, ids, strict=True):
            with torch.no_grad():
                top = model(row[None]).logits[0, first - 1 : -1].log_softmax(-1).topk(3, -1)
            assert v.shape == i.shape == (len(row), 3)
            torch.testing.assert_close(v[first:], top.values, rtol=1e-5, atol=1e-5)
            assert torch.equal(i[first:], top.indices)
            assert not v[:first].any() and not i[:first].any()
        with pytest.raises(ValueError, match="k must be an integer"):
            lean.top_log_probs(batch, 0)
