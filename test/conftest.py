"""Shared test helpers (fixtures and builders); test files never import from each other."""

from __future__ import annotations

import pytest
import torch

#: Every device tests run on: the CPU, and CUDA whenever a GPU is present (CI has none, so its
#: suite is the CPU one, complete; the device machine runs both).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Each available device in turn."""
    return torch.device(request.param)


# --------------------------------------------------------------------------------------------
# a tiny language model for torchrl's LLM stack, built locally (nothing is downloaded)
# --------------------------------------------------------------------------------------------

LLM_CHARS = "0123456789 ="


def tiny_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` over ``LLM_CHARS`` plus EOS and PAD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(LLM_CHARS)}
    vocab["<eos>"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")


def tiny_qwen2(tokenizer, seed: int = 0):
    """A one-layer ``Qwen2ForCausalLM`` (the family torchrl's recipe uses), in eval mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture
def tiny_llm():
    """``(model, tokenizer)``: a fresh tiny Qwen2 and its character tokenizer."""
    tokenizer = tiny_tokenizer()
    return tiny_qwen2(tokenizer), tokenizer


def llm_scorer(model, tokenizer, *, pad_output: bool = False):
    """torchrl's training-side wrapper: scores ``("tokens", "full")`` (``generate=False``)."""
    from torchrl.modules.llm import TransformersWrapper

    return TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        input_key=("tokens", "full"),
        generate=False,
        return_log_probs=True,
        pad_output=pad_output,
    )


def llm_batch(model, tokenizer, prompts, *, seed: int = 0, drift: float = 0.3):
    """A ragged lazy stack as torchrl's LLM stack writes it, ready for a GRPO loss.

    ``TransformersWrapper`` samples one completion per prompt (tokens input); the stored
    ``("log_probs", "full")`` are the scorer's, shifted by ``drift`` noise so that ratios leave
    the clip band; ``("next", "ref_log_probs", "full")`` likewise; ``advantage`` is per
    sequence, ``[B, 1, 1]`` as torchrl's LLM rewards; ``("masks", "all_assistant_mask")``
    marks the response tokens.
    """
    import tensordict
    from tensordict import TensorDict, lazy_stack
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.modules.llm.policies.common import Tokens

    sampler = TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=True,
        return_log_probs=True,
        pad_output=False,
        generate_kwargs={
            "max_new_tokens": 4,
            "do_sample": True,
            "suppress_tokens": [tokenizer.pad_token_id],
        },
    )
    prompt_ids = [torch.tensor(tokenizer(p)["input_ids"]) for p in prompts]
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    with tensordict.set_list_to_stack(True), torch.no_grad():
        data = sampler(lazy_stack([TensorDict({"tokens": Tokens(prompt=p)}) for p in prompt_ids]))
        scored = llm_scorer(model, tokenizer)(data.copy())
        steps = []
        for step, log_prob, prompt in zip(
            data.unbind(0), scored.get(("log_probs", "full"), as_list=True), prompt_ids
        ):
            assistant = torch.arange(log_prob.numel()) >= prompt.numel()
            step.set(("log_probs", "full"), log_prob + drift * torch.randn(log_prob.shape, generator=g))  # fmt: skip
            step.set(("next", "ref_log_probs", "full"), log_prob + drift * torch.randn(log_prob.shape, generator=g))  # fmt: skip
            step.set(("masks", "all_assistant_mask"), assistant)
            step.set("advantage", torch.randn(1, 1, generator=g))
            steps.append(step)
    return lazy_stack(steps)


@pytest.fixture
def make_llm_scorer():
    """:func:`llm_scorer`, as a fixture."""
    return llm_scorer


@pytest.fixture
def make_llm_batch():
    """:func:`llm_batch`, as a fixture; prompts default to five digit sums of ragged length."""

    def make(model, tokenizer, prompts=("3 9 1 4=", "1 2=", "5 5 5=", "7=", "2 0 8="), **kw):
        return llm_batch(model, tokenizer, list(prompts), **kw)

    return make
