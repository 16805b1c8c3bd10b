"""The output layer as the lean path computes it: tensors, adapters included, and checks.

``LeanTransformersWrapper`` never calls the causal LM's head: it multiplies the last hidden
states by the head's weight chunk by chunk. That is exact only if the head is what its weight
says. Two things here keep it so:

* :func:`head_tensors` reads the weight and bias the head applies, LoRA adapters included: a
  ``peft`` LoRA layer on the output layer applies ``W + s B A`` (its ``get_delta_weight``), so
  that is the weight used, and the adapters' parameters get their gradients through it.
* :func:`check_logits` compares, on a few tokens, the model's own logits with the lean path's,
  and refuses a model whose logits are something else (a multiplier, an adapter variant,
  anything unforeseen), naming its class.

And :func:`check_vocabulary` refuses, naming both sizes, a model with fewer token rows than
its tokenizer has ids: torch would fail at the first such token with "index out of range in
self", inside the embedding, far from the cause.
"""

from __future__ import annotations

import torch

__all__ = ["causal_lm", "check_logits", "check_vocabulary", "head_bias", "head_tensors"]

#: Largest relative difference of the logits (norm of the difference over the norm) accepted by
#: :func:`check_logits`, by precision: rounding, not a transform (bf16 rounds at 4e-3).
_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
_LOW_PRECISION = 3e-2


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM inside ``model``: a ``peft`` ``PeftModel``'s base model (its adapters
    injected in place), or ``model`` itself."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and hasattr(model, "peft_config"):
        return get_base()
    return model


def _active_head(head: torch.nn.Module) -> torch.nn.Module:
    """A ``peft`` ``modules_to_save`` copy of the head, as its wrapper applies it."""
    copies = getattr(head, "modules_to_save", None)
    if copies is None or getattr(head, "disable_adapters", False):
        return getattr(head, "original_module", head)
    name = getattr(head, "active_adapter", None)
    name = name[0] if isinstance(name, (list, tuple)) else name
    return copies[name] if name in copies else head.original_module


def head_tensors(head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``(weight [V, H], bias [V] or None)`` that ``head`` applies to a hidden state.

    A linear layer's own; for a ``peft`` LoRA layer, the base layer's plus each active
    adapter's ``get_delta_weight`` (and its ``lora_B`` bias, times the scaling), unless the
    adapters are disabled or merged.

    Raises:
        NotImplementedError: a LoRA variant (DoRA and the like) whose output is not a weight
            delta.
        ValueError: a head without a ``[V, H]`` weight.

    Examples:
        >>> import peft, torch
        >>> from torchrl_grpo.llm.head import head_tensors
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 50, bias=False))
        >>> lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["0"]))
        >>> head = lora.base_model.model[0]
        >>> _ = torch.nn.init.ones_(head.lora_B["default"].weight)  # as after training
        >>> weight, bias = head_tensors(head)
        >>> h = torch.randn(3, 8)
        >>> torch.allclose(h @ weight.T, head(h), atol=1e-5), bias is None
        (True, True)
    """
    head = _active_head(head)
    if not _is_lora(head):
        weight = getattr(head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            raise ValueError(
                f"LeanTransformersWrapper needs a linear output layer with a [V, H] weight; the "
                f"model's get_output_embeddings() is a {type(head).__name__}."
            )
        return weight, getattr(head, "bias", None)
    weight, _ = head_tensors(head.base_layer)
    for name in _adapters(head):
        weight = weight + head.get_delta_weight(name).to(weight.dtype)
    return weight, head_bias(head)


def head_bias(head: torch.nn.Module) -> torch.Tensor | None:
    """The bias ``[V]`` that ``head`` adds (a LoRA adapter's ``lora_B`` bias, times its
    scaling, included), or ``None``; the weight is not computed.

    Examples:
        >>> import torch
        >>> from torchrl_grpo.llm.head import head_bias
        >>> head_bias(torch.nn.Linear(8, 50, bias=False)) is None
        True
        >>> head_bias(torch.nn.Linear(8, 50)).shape
        torch.Size([50])
    """
    head = _active_head(head)
    if not _is_lora(head):
        return getattr(head, "bias", None)
    bias = head_bias(head.base_layer)
    for name in _adapters(head):
        extra = getattr(head.lora_B[name], "bias", None)
        if extra is not None:
            extra = extra * head.scaling[name]
            bias = extra if bias is None else bias + extra
    return bias


def _is_lora(head: torch.nn.Module) -> bool:
    return getattr(head, "base_layer", None) is not None and hasattr(head, "lora_A")


def _adapters(head: torch.nn.Module) -> list[str]:
    """The LoRA adapters ``head`` applies on top of its base layer (none if disabled or merged).

    Raises:
        NotImplementedError: one is a LoRA variant whose output is not a weight delta.
    """
    if getattr(head, "disable_adapters", False) or getattr(head, "merged", False):
        return []
    names = [name for name in head.active_adapters if name in head.lora_A]
    for name in names:
        if name in getattr(head, "lora_variant", {}):
            raise NotImplementedError(
                f"The output layer's adapter {name!r} is a LoRA variant "
                f"({type(head.lora_variant[name]).__name__}) whose output is not a weight delta; "
                "LeanTransformersWrapper computes head(hidden) from a weight. Use torchrl's "
                "TransformersWrapper, or leave the output layer out of target_modules."
            )
    return names


@torch.no_grad()
def check_logits(model: torch.nn.Module, logits_fn, tokens: int = 8) -> None:
    """Refuse ``model`` unless the lean path's logits are its own.

    Runs the causal LM on ``tokens`` token ids (in eval mode, then back to its mode) and
    compares ``model(ids).logits`` with ``logits_fn(ids)`` (``[1, T, V]``), relative to their
    size. A soft cap barely moves an untrained model's small logits: the lean wrapper also
    refuses the known ones by their config attribute.

    Raises:
        ValueError: they differ by more than the precision allows; the message names the model
            class and what usually causes it.

    Examples:
        >>> import torch
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> from torchrl_grpo.llm.head import check_logits
        >>> model = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=16,
        ...     intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        ...     num_key_value_heads=2))
        >>> def lean(ids):  # head(hidden), as the lean path computes it
        ...     return model.model(input_ids=ids).last_hidden_state @ model.lm_head.weight.T
        >>> check_logits(model, lean)  # passes
        >>> check_logits(model, lambda ids: 2 * lean(ids))  # a logit multiplier
        Traceback (most recent call last):
        ...
        ValueError: LeanTransformersWrapper cannot score Qwen2ForCausalLM: its logits are not...
    """
    parameter = next(model.parameters())
    vocab = head_tensors(causal_lm(model).get_output_embeddings())[0].shape[0]
    ids = torch.arange(tokens, device=parameter.device)[None] % vocab  # (1, T)
    training = model.training
    model.eval()
    try:
        expected = model(input_ids=ids, use_cache=False).logits.float()
        ours = logits_fn(ids).float()
    finally:
        model.train(training)
    gap = float((ours - expected).norm() / expected.norm().clamp_min(1e-12))
    tolerance = _TOLERANCE.get(parameter.dtype, _LOW_PRECISION)
    if not gap <= tolerance:
        raise ValueError(
            f"LeanTransformersWrapper cannot score {type(model).__name__}: its logits are not "
            f"the output layer applied to the last hidden state (they differ by {gap:.3g}, "
            f"relative, on {tokens} tokens; at most {tolerance:g} accepted). Models that scale, "
            "soft-cap or otherwise transform their logits need torchrl's TransformersWrapper."
        )


def check_vocabulary(model: torch.nn.Module, tokenizer) -> None:
    """Refuse a model whose vocabulary is smaller than its tokenizer's, naming both sizes.

    The tokenizer's size is ``len(tokenizer)``: its ``vocab_size`` plus the tokens added to it
    (a pad token, chat markers), every id it can write. The model's is the smaller of its input
    embedding's rows (``get_input_embeddings().num_embeddings``) and its output layer's
    (``get_output_embeddings()``): the tables a token id indexes; its ``config.vocab_size`` is
    named in the message, not trusted. A model *larger* than its tokenizer is accepted: many
    pad their tables to a round size (Qwen2.5's 151,936 rows for 151,665 ids). ``torchrl``'s
    ``TransformersWrapper`` does not check it; :class:`~torchrl_grpo.LeanTransformersWrapper`
    calls this at construction, and the examples call it before building torchrl's.

    Args:
        model (torch.nn.Module): a Hugging Face causal LM (a ``peft`` model included); one
            without embeddings to read is not checked.
        tokenizer: its ``transformers`` tokenizer; ``None`` is not checked.

    Raises:
        ValueError: the model has fewer rows than the tokenizer has ids.

    Examples:
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> from torchrl_grpo.llm import check_vocabulary
        >>> class Tokenizer:  # 40 ids: a vocab_size of 38 and 2 added tokens
        ...     vocab_size = 38
        ...     def __len__(self):
        ...         return 40
        >>> def model(vocab_size):
        ...     return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab_size, hidden_size=8,
        ...         intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        ...         num_key_value_heads=2))
        >>> check_vocabulary(model(64), Tokenizer())  # padded to 64 rows: accepted
        >>> check_vocabulary(model(38), Tokenizer())
        Traceback (most recent call last):
        ...
        ValueError: The model has 38 token rows (input embedding 38, output layer 38, ...
    """
    if tokenizer is None:
        return
    lm = causal_lm(model)
    tables = {}
    for name, getter in (
        ("input embedding", "get_input_embeddings"),
        ("output layer", "get_output_embeddings"),
    ):
        get = getattr(lm, getter, None)
        table = get() if callable(get) else None
        weight = getattr(table, "weight", None) if table is not None else None
        if isinstance(weight, torch.Tensor) and weight.ndim == 2:
            tables[name] = int(weight.shape[0])
    if not tables:
        return
    ids = len(tokenizer)
    rows = min(tables.values())
    if rows < ids:
        sizes = ", ".join(f"{name} {n}" for name, n in tables.items())
        config = getattr(getattr(lm, "config", None), "vocab_size", None)
        raise ValueError(
            f"The model has {rows} token rows ({sizes}, config.vocab_size={config}) but its "
            f"tokenizer writes {ids} ids (len(tokenizer): vocab_size="
            f"{getattr(tokenizer, 'vocab_size', None)} plus added tokens): a token id of "
            f"{rows} or more would fail inside the model with torch's 'index out of range in "
            "self'. Use the tokenizer the model was trained with, or grow its tables "
            "(model.resize_token_embeddings(len(tokenizer)))."
        )
