"""Tests of torchrl_grpo/llm/head.py: the output layer the lean path computes, LoRA adapters
included, the check that refuses a model whose logits are something else, and the one that
refuses a model whose vocabulary is smaller than its tokenizer's.

LoRA models are ``peft`` ``PeftModel``s on the tiny Qwen2, compared with torchrl's
``TransformersWrapper`` on the same ``PeftModel`` (log-probs, the loss, and the gradients of the
adapters, those on the output layer included).
"""

import os

import pytest
import torch

try:
    import peft
    import transformers
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs the `llm` extra (make test): without it this is a failure, not a skip
    pytest.skip("needs the llm extra: pip install -e '.[llm]'", allow_module_level=True)

import tensordict
from helpers.llm import tiny_qwen2, tiny_tokenizer
from tensordict import TensorDict, lazy_stack
from torchrl.modules.llm.policies.common import Tokens
from torchrl.objectives.llm import GRPOLoss as TorchrlGRPOLoss

from torchrl_grpo import GRPOLoss
from torchrl_grpo.llm import check_vocabulary
from torchrl_grpo.llm.head import causal_lm, head_bias, head_tensors


def _lora(model, targets=("q_proj", "v_proj", "lm_head"), seed=0, **kwargs):
    """``model`` with LoRA adapters, their B matrices random (peft starts them at 0)."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), **kwargs)
    lora = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return lora.eval()


def _adapter_grads(model) -> dict:
    return {
        n: p.grad.clone()
        for n, p in model.named_parameters()
        if "lora_" in n and p.grad is not None
    }


def _run(loss, batch, model):
    model.zero_grad(set_to_none=True)
    out = loss(batch.copy())
    (out.loss_objective + out.loss_entropy).backward()
    return out, _adapter_grads(model)


class TestHeadTensors:
    def test_lora_on_the_output_layer_is_its_delta_weight(self, tiny_llm):
        model, _ = tiny_llm
        lora = _lora(model)
        head = causal_lm(lora).get_output_embeddings()
        weight, bias = head_tensors(head)
        h = torch.randn(3, weight.shape[1])
        torch.testing.assert_close(torch.nn.functional.linear(h, weight, bias), head(h))
        with lora.disable_adapter():  # the base layer alone
            weight, _ = head_tensors(head)
            torch.testing.assert_close(weight, head.base_layer.weight)

    def test_an_adapter_with_its_own_bias(self):
        """``lora_bias=True`` on a head with a bias: the weight and the bias it applies."""
        model = torch.nn.Sequential(torch.nn.Linear(8, 50))
        lora = peft.get_peft_model(
            model, peft.LoraConfig(r=2, target_modules=["0"], lora_bias=True)
        )
        head = lora.base_model.model[0]
        with torch.no_grad():
            for p in head.lora_B.parameters():
                p.normal_()
        weight, bias = head_tensors(head)
        h = torch.randn(3, 8)
        torch.testing.assert_close(torch.nn.functional.linear(h, weight, bias), head(h))
        assert not torch.equal(bias, head.base_layer.bias)

    def test_a_plain_linear_head(self, tiny_llm):
        model, _ = tiny_llm
        weight, bias = head_tensors(model.lm_head)
        assert weight is model.lm_head.weight and bias is None is head_bias(model.lm_head)


class TestLeanWrapperOnLoRA:
    @pytest.mark.parametrize("targets", [("q_proj", "v_proj", "lm_head"), ("q_proj", "v_proj")])
    def test_log_probs_loss_and_adapter_gradients_equal_torchrls(
        self, tiny_llm, make_llm_batch, make_llm_scorer, targets
    ):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        lora = _lora(model, targets)
        plain = make_llm_scorer(lora, tokenizer)
        lean = make_llm_scorer(lora, tokenizer, lean=True)
        with torch.no_grad():
            ours = lean(batch.copy()).get(("log_probs", "full"), as_list=True)
            theirs = plain(batch.copy()).get(("log_probs", "full"), as_list=True)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        ref, ref_grads = _run(TorchrlGRPOLoss(plain, entropy_coeff=0.01), batch, lora)
        out, grads = _run(GRPOLoss(lean, entropy_coeff=0.01), batch, lora)
        torch.testing.assert_close(out.loss_objective, ref.loss_objective, rtol=1e-5, atol=1e-6)
        assert grads.keys() == ref_grads.keys()
        assert any("lm_head" in n for n in grads) == ("lm_head" in targets)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)

    def test_the_reference_as_the_model_with_adapters_disabled(
        self, tiny_llm, make_llm_batch, make_llm_scorer
    ):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        with torch.no_grad():
            base = make_llm_scorer(model, tokenizer)(batch.copy())
        lora = _lora(model)
        lean = make_llm_scorer(lora, tokenizer, lean=True)
        with torch.no_grad(), lora.disable_adapter():
            ours = lean(batch.copy()).get(("log_probs", "full"), as_list=True)
        for a, b in zip(ours, base.get(("log_probs", "full"), as_list=True), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _ScaledLogits(transformers.Qwen2ForCausalLM):
    """A causal LM whose logits are not its head's output (as an unforeseen architecture)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = 0.5 * out.logits
        return out


class TestCheckLogits:
    def test_a_model_that_transforms_its_logits_is_refused_by_name(self, tiny_llm, make_llm_scorer):
        model, tokenizer = tiny_llm
        scaled = _ScaledLogits(model.config).eval()
        with pytest.raises(ValueError, match=r"cannot score _ScaledLogits: its logits are not"):
            make_llm_scorer(scaled, tokenizer, lean=True)

    @pytest.mark.parametrize("family", ["recurrent_gemma", "falcon_h1"])
    def test_architectures_whose_logits_are_not_the_head_s(self, family, make_llm_scorer):
        from helpers.llm import tiny_tokenizer

        tokenizer = tiny_tokenizer()
        vocab = len(tokenizer)
        if family == "recurrent_gemma":
            config = transformers.RecurrentGemmaConfig(
                vocab_size=vocab,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                lru_width=32,
                attention_window_size=16,
                block_types=["recurrent", "attention"],
            )  # default logits_soft_cap=30
            cls = transformers.RecurrentGemmaForCausalLM
        else:
            config = transformers.FalconH1Config(
                vocab_size=vocab,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                mamba_d_ssm=32,
                mamba_n_heads=2,
                mamba_d_head=16,
                mamba_n_groups=1,
                mamba_d_state=8,
                lm_head_multiplier=2.0,
            )
            cls = transformers.FalconH1ForCausalLM
        torch.manual_seed(0)
        model = cls(config).eval()
        with pytest.raises((ValueError, NotImplementedError), match=type(model).__name__):
            make_llm_scorer(model, tokenizer, lean=True)

    def test_a_bf16_model_passes(self, tiny_llm, make_llm_scorer):
        model, tokenizer = tiny_llm
        make_llm_scorer(model.to(torch.bfloat16), tokenizer, lean=True)  # no error

    def test_the_model_keeps_its_mode(self, tiny_llm, make_llm_scorer):
        model, tokenizer = tiny_llm
        model.train()
        make_llm_scorer(model, tokenizer, lean=True)
        assert model.training


def test_lora_batch_of_turns_through_the_shared_prefix_path(tiny_llm, make_llm_scorer):
    """LoRA adapters (the head's included) and shared prefixes together."""
    model, tokenizer = tiny_llm
    lora = _lora(model)
    prompt = torch.tensor(tokenizer("3 9 1 4 2 8 5=")["input_ids"])
    g = torch.Generator().manual_seed(0)
    rows = [torch.cat([prompt, torch.randint(10, (n,), generator=g)]) for n in (2, 3, 4)]
    with tensordict.set_list_to_stack(True), torch.no_grad():
        batch = lazy_stack([TensorDict(tokens=Tokens(full=r)) for r in rows])
        lean = make_llm_scorer(lora, tokenizer, lean=True, min_shared_length=4)
        ours = lean(batch.copy()).get(("log_probs", "full"), as_list=True)
        theirs = make_llm_scorer(lora, tokenizer)(batch.copy()).get(
            ("log_probs", "full"), as_list=True
        )
    assert lean.sharing.checked and lean.sharing.off_reason is None
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_disable_adapters_scores_the_base_model(tiny_llm, make_llm_batch, make_llm_scorer):
    """A LoRA policy's reference without a copy: the same PeftModel, adapters disabled."""
    model, tokenizer = tiny_llm
    batch = make_llm_batch(model, tokenizer)
    with torch.no_grad():
        base = make_llm_scorer(model, tokenizer)(batch.copy()).get(
            ("log_probs", "full"), as_list=True
        )
    lora = _lora(model)
    ref = make_llm_scorer(lora, tokenizer, lean=True, disable_adapters=True)
    policy = make_llm_scorer(lora, tokenizer, lean=True)
    with torch.no_grad():
        ours = ref(batch.copy()).get(("log_probs", "full"), as_list=True)
        adapted = policy(batch.copy()).get(("log_probs", "full"), as_list=True)
    for a, b, c in zip(ours, base, adapted, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(c, b, atol=1e-3)  # the adapters are back for the policy
    assert ref.get_new_version(return_log_probs=True).disable_adapters
    with pytest.raises(ValueError, match="disable_adapters=True needs a model with adapters"):
        make_llm_scorer(model, tokenizer, lean=True, disable_adapters=True)


def test_a_trained_copy_of_the_output_layer(tiny_llm, make_llm_batch, make_llm_scorer):
    """``modules_to_save=["lm_head"]``: peft trains a copy of the head; its weight is the one
    scored (after a change only the copy has)."""
    model, tokenizer = tiny_llm
    batch = make_llm_batch(model, tokenizer)
    lora = _lora(model, ("q_proj",), modules_to_save=["lm_head"])
    head = causal_lm(lora).get_output_embeddings()
    with torch.no_grad():
        for p in head.modules_to_save.parameters():
            p.add_(0.3 * torch.randn_like(p))
        ours = make_llm_scorer(lora, tokenizer, lean=True)(batch.copy())
        theirs = make_llm_scorer(lora, tokenizer)(batch.copy())
    for a, b in zip(*(t.get(("log_probs", "full"), as_list=True) for t in (ours, theirs))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class TestCheckVocabulary:
    """A model with fewer token rows than its tokenizer has ids is refused, both sizes named;
    torch alone fails at the first such id with "index out of range in self"."""

    def test_a_smaller_model_fails_in_torch_and_is_refused_here(self, make_llm_scorer):
        tokenizer = tiny_tokenizer()  # 14 ids
        model = tiny_qwen2(_Vocab(12))
        batch = TensorDict(tokens=Tokens(full=torch.tensor([[13, 12, 3]])), batch_size=[1])
        with pytest.raises(IndexError, match="index out of range in self"):
            make_llm_scorer(model, tokenizer)(batch)  # torchrl's wrapper
        message = r"12 token rows \(input embedding 12, output layer 12.*writes 14 ids"
        with pytest.raises(ValueError, match=message):
            check_vocabulary(model, tokenizer)
        with pytest.raises(ValueError, match=message):
            make_llm_scorer(model, tokenizer, lean=True)

    def test_added_tokens_count(self):
        """``len(tokenizer)``, not ``vocab_size``: a token added to the tokenizer (a tool
        marker) needs its row too."""
        tokenizer = tiny_tokenizer()
        model = tiny_qwen2(tokenizer)
        check_vocabulary(model, tokenizer)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<tool>"]})
        with pytest.raises(ValueError, match=r"14 token rows .* writes 15 ids .*vocab_size=14"):
            check_vocabulary(model, tokenizer)
        model.resize_token_embeddings(len(tokenizer))
        check_vocabulary(model, tokenizer)

    def test_a_larger_model_is_accepted(self, make_llm_scorer):
        """Padded tables (Qwen2.5's 151,936 rows for 151,665 ids) are normal."""
        tokenizer = tiny_tokenizer()
        model = tiny_qwen2(_Vocab(64))
        check_vocabulary(model, tokenizer)
        make_llm_scorer(model, tokenizer, lean=True)

    def test_the_smaller_table_counts(self):
        tokenizer = tiny_tokenizer()
        model = tiny_qwen2(tokenizer)
        model.lm_head = torch.nn.Linear(32, 12, bias=False)
        with pytest.raises(
            ValueError, match=r"12 token rows \(input embedding 14, output layer 12"
        ):
            check_vocabulary(model, tokenizer)

    def test_through_a_lora_model(self):
        tokenizer = tiny_tokenizer()
        lora = _lora(tiny_qwen2(_Vocab(12)))
        with pytest.raises(ValueError, match="12 token rows"):
            check_vocabulary(lora, tokenizer)

    def test_no_tokenizer_is_not_checked(self, tiny_llm):
        model, _ = tiny_llm
        check_vocabulary(model, None)


class _Vocab:
    """What :func:`helpers.llm.tiny_causal_lm` reads of a tokenizer, for a model of ``n``
    token rows (pad and end-of-sequence ids inside them)."""

    def __init__(self, n: int):
        self.n, self.eos_token_id, self.pad_token_id = n, 1, 0

    def __len__(self):
        return self.n
