"""torchrl's ``TransformersWrapper`` without the logits.

At an LLM's vocabulary the ``[B, T, V]`` logits dominate the memory of a GRPO step: torchrl's
``TransformersWrapper`` builds them inside the model's forward, shifts them, unpads them into a
list and pads them again for the loss, so that the peak is several times their size whatever the
loss does with them. :class:`LeanTransformersWrapper` is the same wrapper with one change: where
torchrl calls the causal LM and reads its logits, it calls the model's body for the last hidden
states ``[B, T, H]`` and carries those, shifted and padded exactly as torchrl carries the logits.
Token log-probs and entropies are computed from them and the output layer chunk by chunk
(:func:`~torchrl_grpo.token_log_prob_entropy_from_hidden`): each chunk's logits are built,
reduced to three numbers per position and dropped, in the forward pass and again in the
backward pass. Everything else (input modes, tokenization, masks, output entries, generation)
is torchrl's own code, inherited.

For a loss, the wrapper's masked distributions (``_get_sft_dist`` and the others torchrl's and
this package's ``GRPOLoss`` call) are :class:`HiddenLLMMaskedCategorical`: torchrl's
``LLMMaskedCategorical`` with the same ``mask``, ``log_prob`` and ``entropy``, computed from the
hidden states.
"""

from __future__ import annotations

from contextlib import nullcontext
from numbers import Integral

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase
from torch.distributions import Categorical
from torchrl.modules.distributions import LLMMaskedCategorical
from torchrl.modules.llm import TransformersWrapper

from torchrl_grpo import _compat, ragged
from torchrl_grpo.llm.head import (
    causal_lm,
    check_logits,
    check_vocabulary,
    head_bias,
    head_tensors,
)
from torchrl_grpo.llm.prefix import PrefixSharing
from torchrl_grpo.llm.scoring import (
    TokenRows,
    compact_index,
    dist_mask,
    read_index,
    read_token_rows,
    response_starts,
    token_rows,
    unpadded,
    write_outputs,
)
from torchrl_grpo.ragged import upload
from torchrl_grpo.token_dist import (
    _HIDDEN_CHUNK_ELEMENTS,
    HiddenTokenCategorical,
    _chunk_rows,
    log_probs_at_from_hidden,
    token_log_prob_entropy_from_hidden,
    top_log_probs_from_hidden,
)

__all__ = ["HiddenLLMMaskedCategorical", "LeanTransformersWrapper", "output_layer"]

#: Config attributes of models whose logits are not ``lm_head(last hidden state)`` (Gemma 2's
#: and RecurrentGemma's soft caps, Cohere's scale, Granite's divisor, FalconH1's multiplier), with
#: the value that means "none". A soft cap barely moves small logits, so that the check of the
#: logits on a few tokens (:func:`~torchrl_grpo.llm.head.check_logits`, for what this list does
#: not know) may not see it on an untrained model: the known ones are refused by name.
_LOGIT_TRANSFORMS = {
    "final_logit_softcapping": None,
    "logits_soft_cap": None,
    "logit_scale": 1.0,
    "logits_scaling": 1.0,
    "lm_head_multiplier": 1.0,
}


class HiddenLLMMaskedCategorical(HiddenTokenCategorical):
    """torchrl's ``LLMMaskedCategorical`` over ``softmax(W h + b)``, without the logits.

    A position-level masked categorical as torchrl's: :attr:`mask` ``[B, T]`` marks the
    positions that count; :meth:`log_prob` is ``0`` (and sends no gradient) at masked positions
    and at tokens equal to ``ignore_index``; :meth:`entropy` is ``0`` at masked positions (as
    torchrl's). The values come from
    :func:`~torchrl_grpo.token_log_prob_entropy_from_hidden` on the hidden states and the output
    layer, so no ``[B, T, V]`` tensor exists; :meth:`log_prob` and :meth:`entropy` share one
    autograd node, and :meth:`log_prob_entropy` returns both at once.

    .. math:: \\pi(a \\mid h_t) = \\operatorname{softmax}(W h_t + b)_a

    Args:
        hidden (torch.Tensor): hidden states ``[..., H]``, aligned with the tokens they score.
        mask (torch.Tensor): boolean ``[...]`` (``hidden.shape[:-1]``), ``True`` where a
            position counts.
        weight (torch.Tensor): the output layer's weight ``[V, H]``.
        bias (torch.Tensor, optional): its bias ``[V]``.
        chunk_size (int, optional): positions per chunk; see
            :func:`~torchrl_grpo.token_log_prob_entropy_from_hidden`.
        ignore_index (int): the token id that means "no token". Defaults to ``-100``.
        positions (torch.Tensor, optional): the flat positions (of ``mask.reshape(-1)``) where
            ``mask`` is set, when the caller knows them: they save a host read (a wait for
            the device) at each call.

    Examples:
        >>> import torch
        >>> from torchrl.modules.distributions import LLMMaskedCategorical
        >>> _ = torch.manual_seed(0)
        >>> hidden, head = torch.randn(2, 5, 8), torch.nn.Linear(8, 50, bias=False)
        >>> mask = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.bool)
        >>> tokens = torch.randint(50, (2, 5))
        >>> lean = HiddenLLMMaskedCategorical(hidden, mask, head.weight)
        >>> ref = LLMMaskedCategorical(head(hidden), mask)
        >>> torch.allclose(lean.log_prob(tokens), ref.log_prob(tokens), atol=1e-6)
        True
        >>> torch.allclose(lean.entropy(), ref.entropy(), atol=1e-5)
        True
    """

    def __init__(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        chunk_size: int | None = None,
        ignore_index: int = -100,
        positions: torch.Tensor | None = None,
    ):
        head = _Head(weight, bias)
        super().__init__(hidden, head, chunk_size=chunk_size)
        if mask.shape != self.batch_shape:
            raise ValueError(
                f"mask {tuple(mask.shape)} does not match the hidden states "
                f"{tuple(hidden.shape)}: expected a position-level mask of shape "
                f"{tuple(self.batch_shape)}."
            )
        self._mask = mask.bool()
        self.ignore_index = ignore_index
        self._positions = positions

    @property
    def mask(self) -> torch.Tensor:
        """The position-level mask ``[B, T]``."""
        return self._mask

    @property
    def position_level_masking(self) -> bool:
        """Always ``True`` (torchrl's ``LLMMaskedCategorical`` attribute)."""
        return True

    def _tokens(self, value: torch.Tensor) -> torch.Tensor:
        value = value.long()
        ignored = ~self._mask | (value == self.ignore_index)
        return value.masked_fill(ignored, -100)

    def log_prob_entropy(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of ``value`` and entropies in one pass (one autograd node).

        The output layer runs at the positions of :attr:`mask` only (the positions a loss
        reads); masked positions get a log-prob and an entropy of ``0`` (torchrl's entropy
        there), as do ``ignore_index`` tokens' log-probs.

        Args:
            value (torch.Tensor): token ids ``[B, T]``.

        Returns:
            tuple[torch.Tensor, torch.Tensor]: ``(log_prob, entropy)``, each ``[B, T]``.
        """
        tokens = self._tokens(value)
        log_prob, entropy = _at_positions(
            self.hidden,
            self._mask,
            self.weight,
            tokens,
            self.bias,
            self.chunk_size,
            self._positions,
        )
        self._entropy = (entropy, torch.is_grad_enabled())
        return log_prob, entropy

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """Log-probs of token ids; ``0`` at masked positions and ``ignore_index`` tokens.

        Args:
            value (torch.Tensor): token ids ``[B, T]``.

        Returns:
            torch.Tensor: ``[B, T]`` log-probs (float32 at least).
        """
        return self.log_prob_entropy(value)[0]

    def entropy(self) -> torch.Tensor:
        """Entropies ``[B, T]``; ``0`` at masked positions, as torchrl's.

        (torchrl fills masked positions' logits with the dtype's lowest value, whose
        normalised logits round to zero, so that its ``Categorical`` entropy is zero there.)

        Returns:
            torch.Tensor: ``[B, T]`` entropies (float32 at least).
        """
        if self._entropy is not None and self._entropy[1] == torch.is_grad_enabled():
            return self._entropy[0]
        dummy = torch.zeros(self.batch_shape, dtype=torch.long, device=self.hidden.device)
        return self.log_prob_entropy(dummy)[1]

    def log_probs_at(self, ids: torch.Tensor) -> torch.Tensor:
        """The log-probs of ``K`` token ids at each position, with their gradient: the output
        layer runs at the positions of :attr:`mask` only, ``0`` elsewhere (a student's
        log-probs at a teacher's most likely tokens, :class:`~torchrl_grpo.TopKDistillationLoss`).

        Args:
            ids (torch.Tensor): token ids ``[B, T, K]`` (any value at masked positions).

        Returns:
            torch.Tensor: ``[B, T, K]`` log-probs (float32 at least).
        """
        if ids.shape[:-1] != self.batch_shape:
            raise ValueError(
                f"ids {tuple(ids.shape)} do not match the distribution's positions "
                f"{tuple(self.batch_shape)}: expected [B, T, K]."
            )
        index = self._positions
        if index is None:
            index = self._mask.reshape(-1).nonzero()[:, 0]  # (N,)
        width = ids.shape[-1]
        states = self.hidden.reshape(-1, self.hidden.shape[-1])[index]  # (N, F)
        chosen = ids.reshape(-1, width)[index]  # (N, K)
        found = log_probs_at_from_hidden(
            states, self.weight, chosen, self.bias, chunk_size=self.chunk_size
        )  # (N, K)
        out = found.new_zeros(self._mask.numel(), width)
        return out.index_put((index,), found).view(ids.shape)

    @property
    def mode(self) -> torch.Tensor:
        """The most likely token at each position (``0`` at masked positions, as torchrl's)."""
        return super().mode.masked_fill(~self._mask, 0)

    def sample(self, sample_shape: torch.Size | tuple[int, ...] = ()) -> torch.Tensor:
        """Sample token ids without gradient; uniform at masked positions, as torchrl's.

        Args:
            sample_shape (torch.Size or tuple of int): extra leading dimensions.

        Returns:
            torch.Tensor: token ids, ``sample_shape + batch_shape``.
        """
        drawn = super().sample(sample_shape)
        uniform = torch.randint_like(drawn, self.weight.shape[0])
        return torch.where(self._mask, drawn, uniform)


def _at_positions(hidden, where, weight, tokens, bias=None, chunk_size=None, index=None):
    """Token log-probs and entropies ``[B, T]`` computed where ``where`` is set, ``0`` elsewhere.

    The output layer runs on the selected hidden states only; the values there are those of
    :func:`~torchrl_grpo.token_log_prob_entropy_from_hidden` on every position. ``index``
    (flat positions of ``[B * T]`` on the device), when the caller knows them, replaces
    ``where`` and saves a host read.
    """
    shape = tokens.shape
    if index is None:
        index = where.reshape(-1).nonzero()[:, 0]  # (N,)
    states = hidden.reshape(-1, hidden.shape[-1])[index]  # (N, F)
    log_prob, entropy = token_log_prob_entropy_from_hidden(
        states, weight, tokens.reshape(-1)[index], bias, chunk_size=chunk_size
    )  # (N,), (N,)
    zeros = log_prob.new_zeros(shape.numel())
    return (
        zeros.index_put((index,), log_prob).view(shape),
        zeros.index_put((index,), entropy).view(shape),
    )


#: Where ``LeanTransformersWrapper`` computes the log-probs it writes.
LOG_PROBS_AT = ("all", "response")


def _checked_log_probs_at(log_probs_at) -> str:
    if log_probs_at not in LOG_PROBS_AT:
        raise ValueError(f"log_probs_at must be one of {LOG_PROBS_AT}, got {log_probs_at!r}.")
    return log_probs_at


def _checked_disable_adapters(disable_adapters, model) -> bool:
    if disable_adapters and not callable(getattr(model, "disable_adapter", None)):
        raise ValueError(
            f"disable_adapters=True needs a model with adapters (a peft PeftModel's "
            f"disable_adapter()); {type(model).__name__} has none."
        )
    return bool(disable_adapters)


class _Head:
    """An output layer given as tensors (what :class:`HiddenTokenCategorical` reads)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias


def _checked_chunk_size(chunk_size) -> int | None:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, Integral) or chunk_size <= 0:
        raise ValueError(
            f"chunk_size must be a positive integer (positions per chunk) or None, "
            f"got {chunk_size!r}."
        )
    return int(chunk_size)


def output_layer(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear]:
    """The body and the output layer of a causal LM: ``logits = head(body(...)[0])``.

    Found through the Hugging Face model API: the body is ``model.base_model`` (the
    ``base_model_prefix`` attribute, e.g. ``model.model`` for Qwen2 and Llama), the head
    ``model.get_output_embeddings()``.

    Args:
        model (torch.nn.Module): a ``...ForCausalLM`` model.

    Returns:
        tuple[torch.nn.Module, torch.nn.Linear]: ``(body, head)``.

    Raises:
        ValueError: the model has no body or output layer this can find (the attributes
            looked for are named), or the head is not a linear layer.
        NotImplementedError: the model transforms its logits beyond the head (a soft cap or a
            scale), which this wrapper does not reproduce.

    Examples:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=8,
        ...     intermediate_size=16, num_hidden_layers=1, num_attention_heads=2))
        >>> body, head = output_layer(model)
        >>> type(body).__name__, tuple(head.weight.shape)
        ('LlamaModel', (50, 8))
        >>> output_layer(model.model)
        Traceback (most recent call last):
        ...
        ValueError: LeanTransformersWrapper needs the model's output layer: LlamaModel...
    """
    model = causal_lm(model)  # a peft PeftModel: the causal LM with its adapters injected
    name = type(model).__name__
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        raise ValueError(
            f"LeanTransformersWrapper needs the model's output layer: {name}."
            "get_output_embeddings() is missing or returned None. Pass the causal LM "
            "(e.g. Qwen2ForCausalLM), not its base model."
        )
    head_tensors(head)  # a [V, H] weight (adapters included), or a ValueError naming the head
    body = getattr(model, "base_model", None)
    if not isinstance(body, torch.nn.Module) or body is model:
        prefix = getattr(model, "base_model_prefix", None)
        raise ValueError(
            f"LeanTransformersWrapper needs the model's body (the transformer without its "
            f"head): {name}.base_model (base_model_prefix={prefix!r}) is missing or is the "
            "model itself."
        )
    config = getattr(model, "config", None)
    for attribute, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(config, attribute, neutral)
        if value != neutral:
            raise NotImplementedError(
                f"{name} transforms its logits beyond the output layer (config.{attribute}="
                f"{value!r}); LeanTransformersWrapper computes head(hidden) only. Use "
                "torchrl's TransformersWrapper for this model."
            )
    return body, head


class LeanTransformersWrapper(TransformersWrapper):
    """torchrl's ``TransformersWrapper`` that never builds the ``[B, T, V]`` logits.

    Built exactly as ``TransformersWrapper`` (every argument of it is accepted, with its
    defaults), plus the two keywords below. With ``generate=False`` it scores tokens from the
    model's last hidden states and output layer chunk by chunk: the ``("log_probs", "full")``
    it writes, and the distributions a loss gets from it (:class:`HiddenLLMMaskedCategorical`),
    have torchrl's values and gradients, and no vocabulary-sized tensor exists at any time,
    in the forward or the backward pass. Input modes ``"tokens"``, ``"history"`` and
    ``"text"``, ``pad_output`` ``True`` or ``False``, packed or padded model input: all are
    torchrl's code, inherited; only the call of the model differs. With
    ``pad_model_input=False`` (packed sequences) each sequence attends causally to itself
    only, so that packed and padded input give the same numbers (torchrl 0.14.1's packed path
    lets a token see the rest of its sequence). With ``generate=True`` it is torchrl's wrapper
    unchanged (generation samples token by token, one position at a time).

    What is read, once: the distribution a loss gets runs the output layer on the loss's mask
    only, ``log_probs_at="response"`` does the same for the log-probs the wrapper writes, and
    rows that share a token prefix compute it once (``share_prefix``).

    It is an ``LLMWrapperBase`` and a ``TransformersWrapper``, so torchrl's ``GRPOLoss``,
    ``RetrieveLogProb``, ``GRPOTrainer`` and collectors accept it, as does this package's
    :class:`~torchrl_grpo.GRPOLoss`, which reads log-prob and entropy from one pass.

    Supported models: causal LMs whose logits are ``lm_head(base_model(...).last_hidden_state)``,
    such as the Qwen2 / Qwen2.5 / Qwen3, Llama and Mistral families, with tied or untied
    embeddings and a head with or without a bias, and ``peft`` LoRA models of them (a
    ``PeftModel``; adapters on the output layer included, as the weight they apply). Models that
    transform their logits further (Gemma 2's and RecurrentGemma's soft caps, Cohere's scale,
    FalconH1's multiplier) are rejected at construction, and so is any model whose logits, on a
    few tokens, are not what the lean path computes (the error names its class).

    Precision: the log-sum-exp is accumulated in float32 at least (bf16 and fp16 logits are
    upcast a chunk at a time), so the log-probs of a bf16 model are float32 where torchrl's
    are bf16. ``cast_head_to_float32=True`` also computes the head's matrix product in float32
    (as ScaleRL and TRL's ``cast_lm_head_to_fp32``), at the cost of a float32 copy of the head's
    weight for the step.

    Args:
        model: a Hugging Face causal LM (or a name, loaded by torchrl's constructor).

    Keyword Args:
        chunk_size (int, optional): positions per chunk. Defaults to a chunk of
            ``2**23`` logits (32 MiB in float32; 55 positions at Qwen's 151,936 tokens) on the
            CPU, and ``1/128`` of the positions at least on an accelerator. Larger chunks
            stream the head's weight fewer times (faster for a large ``H``), smaller ones hold
            less memory.
        cast_head_to_float32 (bool): compute the head in float32. Defaults to ``False``.
        share_prefix (bool): compute the tokens that several rows of a call share once (the
            prompt of ``G`` completions, a dialog's earlier turns): the call's rows as one
            prefix tree through the body in one pass, a block attention mask keeping each row
            to its own tokens (:mod:`torchrl_grpo.llm.prefix`). A model whose attention takes
            no custom mask, or whose shared states differ from its dense ones on the first
            call, is scored densely with one warning. Defaults to ``True``.
        min_shared_length (int): the shortest shared prefix, in tokens, computed once.
            Defaults to ``32``.
        log_probs_at (str): where the ``("log_probs", "full")`` it writes are computed:
            ``"all"`` (every position, torchrl's) or ``"response"`` (past each row's
            ``("tokens", "prompt")``, ``0`` on the prompt: the output layer runs on the response
            only). Use ``"response"`` for a scorer whose log-probs a loss reads on the response
            only (``RetrieveLogProb`` before a loss with ``masking_strategy="sft"``). Input
            whose stored prompt does not start each stored row of tokens (ragged, or padded
            as a sampler pads them) is scored everywhere. Defaults to ``"all"``.
        disable_adapters (bool): score with the model's adapters disabled (a ``peft``
            ``PeftModel``'s ``disable_adapter()``): the base model, as a LoRA policy's reference,
            without a second copy of the weights. Defaults to ``False``.
        **kwargs: every keyword of ``torchrl.modules.llm.TransformersWrapper``.

    Raises:
        ValueError: ``chunk_size`` or ``min_shared_length`` is not a positive integer,
            ``log_probs_at`` is neither ``"all"`` nor ``"response"``, or the model has no body
            or linear output layer this can find (the message names the attribute looked for),
            or fewer token rows than its tokenizer has ids (both sizes named:
            :func:`~torchrl_grpo.llm.check_vocabulary`; a larger model is accepted).
        NotImplementedError: the model transforms its logits beyond the head.
        RuntimeError: the installed torchrl no longer scores through the methods this class
            overrides (see ``torchrl_grpo._compat``).

    Examples:
        >>> import tensordict, torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from tokenizers import Tokenizer, models
        >>> from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
        >>> from torchrl.modules.llm import TransformersWrapper
        >>> from torchrl.modules.llm.policies.common import Tokens
        >>> words = {f"w{i}": i for i in range(99)} | {"<pad>": 99}
        >>> tokenizer = PreTrainedTokenizerFast(
        ...     tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="<pad>")),
        ...     pad_token="<pad>")
        >>> _ = torch.manual_seed(0)
        >>> model = Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=16,
        ...     intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        ...     num_key_value_heads=2, pad_token_id=99)).eval()
        >>> kwargs = dict(tokenizer=tokenizer, input_mode="tokens", generate=False,
        ...     return_log_probs=True, pad_output=False)
        >>> lean = LeanTransformersWrapper(model, **kwargs)
        >>> plain = TransformersWrapper(model, **kwargs)
        >>> with tensordict.set_list_to_stack(True):
        ...     batch = lazy_stack([TensorDict(tokens=Tokens(full=torch.randint(99, (n,))))
        ...                         for n in (5, 3)])
        ...     ours = lean(batch.copy()).get(("log_probs", "full"), as_list=True)
        ...     theirs = plain(batch.copy()).get(("log_probs", "full"), as_list=True)
        >>> all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, theirs))
        True

        A loss gets the same masked distribution, computed from the hidden states:

        >>> from torchrl_grpo import GRPOLoss
        >>> isinstance(GRPOLoss(lean).actor_network, TransformersWrapper)
        True
    """

    def __init__(
        self,
        model,
        *,
        chunk_size: int | None = None,
        cast_head_to_float32: bool = False,
        share_prefix: bool = True,
        min_shared_length: int = 32,
        log_probs_at: str = "all",
        disable_adapters: bool = False,
        **kwargs,
    ):
        chunk_size = _checked_chunk_size(chunk_size)
        sharing = PrefixSharing(share_prefix, min_shared_length)
        _compat.check_transformers_wrapper_scoring()
        super().__init__(model, **kwargs)
        self._output_layer()  # fail now, not at the first batch
        check_vocabulary(self.model, self.tokenizer)  # named now, not "index out of range" later
        self.chunk_size = chunk_size
        self.cast_head_to_float32 = bool(cast_head_to_float32)
        self.sharing = sharing
        self.log_probs_at = _checked_log_probs_at(log_probs_at)
        self.disable_adapters = _checked_disable_adapters(disable_adapters, self.model)
        if not self.generate:  # the model's own logits on a few tokens are what it computes
            with self._adapters():
                check_logits(self.model, self._check_logits)

    def forward(self, tensordict: TensorDictBase, *args, **kwargs) -> TensorDictBase:
        """torchrl's ``forward``; with ``disable_adapters=True``, under the model's
        ``disable_adapter()`` (the base model: a LoRA policy's reference, without a copy).

        A dense ``TensorDict`` of token rows (one ``[B, T]`` tensor, as a sampler with
        ``pad_output=True`` writes them) is scored as it is: torchrl makes it a lazy stack of
        one ``TensorDict`` per row and stacks its outputs back, which on a small model costs
        more than the model; the entries written are the same."""
        with self._adapters():
            if not args:
                scored = self._dense_forward(tensordict, **kwargs)
                if scored is not None:
                    return scored
            return super().forward(tensordict, *args, **kwargs)

    def _dense_forward(self, tensordict, logits_only: bool = False, **kwargs):
        """torchrl's ``forward`` (``inplace=True``) on dense token rows, or ``None`` where
        torchrl's must run (any other input, mode or option)."""
        if (
            kwargs
            or self.generate
            or self.input_mode != "tokens"
            or type(tensordict) is not TensorDict
            or tensordict.ndim != 1
            or self.inplace is not True
            or self.num_samples is not None
            or self._device
            or getattr(self, "batching", False)
        ):
            return None
        response = self.log_probs_at == "response" and not logits_only
        rows = self._token_rows(tensordict, prompts=response)
        if rows is None or not (self.pad_output or (rows.counts == rows.lengths).all()):
            return None
        log_probs, shifted = self._scored(rows, logits_only, response)
        keys = (self.text_key, self.tokens_key, self.masks_key, self.log_probs_key)
        logits = shifted if self._in_get_dist_call else None
        out = TensorDict(batch_size=tensordict.batch_size)
        write_outputs(out, tensordict, rows, log_probs, logits, keys, self.pad_output)
        result = tensordict.exclude(*self.out_keys, inplace=True)
        return result.update(out, keys_to_update=self.out_keys)

    def _adapters(self):
        """The context the model runs in: its adapters disabled, or as they are."""
        return self.model.disable_adapter() if self.disable_adapters else nullcontext()

    def get_new_version(self, **kwargs):
        """A new wrapper around the same model with some arguments changed (torchrl's method).

        The lean keywords (``chunk_size``, ``cast_head_to_float32``, ``share_prefix``,
        ``min_shared_length``, ``log_probs_at``, ``disable_adapters``) are kept unless given.

        Returns:
            LeanTransformersWrapper: the new wrapper.
        """
        chunk_size = kwargs.pop("chunk_size", self.chunk_size)
        cast = kwargs.pop("cast_head_to_float32", self.cast_head_to_float32)
        share = kwargs.pop("share_prefix", self.sharing.enabled)
        min_shared_length = kwargs.pop("min_shared_length", self.sharing.min_shared_length)
        log_probs_at = kwargs.pop("log_probs_at", self.log_probs_at)
        disable_adapters = kwargs.pop("disable_adapters", self.disable_adapters)
        new = super().get_new_version(**kwargs)
        new.disable_adapters = _checked_disable_adapters(disable_adapters, new.model)
        new.chunk_size = _checked_chunk_size(chunk_size)
        new.cast_head_to_float32 = bool(cast)
        new.sharing = PrefixSharing(share, min_shared_length)
        new.log_probs_at = _checked_log_probs_at(log_probs_at)
        return new

    # -- the head, as tensors ------------------------------------------------------------------

    def _output_layer(self) -> tuple[torch.nn.Module, torch.nn.Linear]:
        """:func:`output_layer` of the model, validated once: again only if the model or its
        output layer is another module than when last validated (a new model, a LoRA adapter
        injected on the head), since a call asks for it several times."""
        model = self.model
        get_head = getattr(causal_lm(model), "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        found = self.__dict__.get("_validated_layers")  # (model, head, (body, head))
        if found is None or found[0] is not model or found[1] is not head:
            found = self._validated_layers = (model, head, output_layer(model))
        return found[2]

    def _check_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """``[1, T, V]`` logits of the lean path on ``ids`` (for ``check_logits``)."""
        body, _ = self._output_layer()
        hidden = body(input_ids=ids, use_cache=False).last_hidden_state
        return torch.nn.functional.linear(self._features(hidden), self._head())

    def _head(self) -> torch.Tensor:
        """The output layer's weight ``[V, F]``, its bias (if any) folded in as a last column.

        Folding ``b`` into ``W`` (with a constant 1 appended to each hidden state) makes the
        zero rows torchrl uses for the first position give zero logits, as torchrl's shifted
        logits, with or without a bias.
        """
        _, head = self._output_layer()
        weight, bias = head_tensors(head)  # LoRA adapters on the output layer included
        if self.cast_head_to_float32:
            weight = weight.float()
            bias = None if bias is None else bias.float()
        if bias is not None:
            weight = torch.cat([weight, bias.to(weight.dtype).unsqueeze(-1)], -1)  # (V, H + 1)
        return weight

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[B, T, H]`` as the head's inputs: in float32 with
        ``cast_head_to_float32``, and with a constant-1 column when the head has a bias."""
        _, head = self._output_layer()
        if self.cast_head_to_float32:
            hidden = hidden.float()
        if head_bias(head) is not None:  # the bias alone: no adapter's weight is built
            hidden = torch.cat([hidden, torch.ones_like(hidden[..., :1])], -1)
        return hidden

    def _rows(self, vocab: int, positions: int, device: torch.device) -> int:
        """Positions per chunk: ``chunk_size``, or a chunk of ``_HIDDEN_CHUNK_ELEMENTS`` logits."""
        elements = _HIDDEN_CHUNK_ELEMENTS
        return _chunk_rows(self.chunk_size, vocab, positions, device, elements=elements)

    # -- scoring: one host copy of the rows, a fixed number of operators -----------------------

    def _from_transformers_logprobs_tokens(self, td, cfg, out, logits_only=False):
        """torchrl's tokens path, on hidden states, reading the rows once
        (:mod:`torchrl_grpo.llm.scoring`): the same output entries as torchrl's, a fixed number
        of operators whatever the number of rows. Input it does not take (rows that are not
        one-dimensional) runs torchrl's code."""
        response = self.log_probs_at == "response" and not logits_only
        rows = self._token_rows(td, prompts=response)
        if rows is None:
            return super()._from_transformers_logprobs_tokens(td, cfg, out, logits_only)
        log_probs, shifted = self._scored(rows, logits_only, response)
        keys = (self.text_key, self.tokens_key, self.masks_key, self.log_probs_key)
        logits = shifted if self._in_get_dist_call else None
        return write_outputs(out, td, rows, log_probs, logits, keys, self.pad_output)

    def _token_rows(self, td, prompts: bool = False) -> TokenRows | None:
        """The call's rows of tokens (masks, and stored prompts if asked), read once."""
        mask_keys = (("masks", "all_attention_mask"), self.attention_mask_key)
        prompt_key = (self.tokens_key, "prompt") if prompts else None
        pad = self.tokenizer.pad_token_id
        rows = read_token_rows(td, self.input_key, mask_keys, pad, prompt_key)
        if rows is not None:
            self._check_input(rows.width, int(rows.lengths.min()))
        return rows

    def _check_input(self, width: int, shortest: int) -> None:
        if not shortest:
            raise ValueError(
                "Input contains empty sequences. Packing/padding requires at least one token "
                "per sequence."
            )
        max_len = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        if max_len is not None and width > max_len:
            raise ValueError(
                f"Input sequence length ({width}) exceeds the model's "
                f"max_position_embeddings ({max_len})."
            )

    def _scored(self, rows: TokenRows, logits_only: bool, response: bool = False):
        """``(log_probs [B, T] or None, shifted features [B, T, F])`` of left-padded rows:
        position ``t`` holds the state that predicts token ``t`` (zeros at ``t = 0``, as
        torchrl's shifted logits); the log-prob is ``0`` at padding, at each row's first token
        and, with ``response``, on each row's prompt: the output layer runs only where a
        log-prob is kept."""
        features = self._features(self._rows_hidden(rows))  # (B, T, F)
        shifted = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1)
        if logits_only:
            return None, shifted
        index = read_index(rows, response_starts(rows) if response else None)
        weight = self._head()
        chunk = self._rows(weight.shape[0], len(index), shifted.device)
        index = upload(index, shifted.device)
        log_probs, _ = _at_positions(shifted, None, weight, rows.tokens, None, chunk, index)
        return log_probs, shifted

    def top_log_probs(self, tensordict: TensorDictBase, k: int):
        """The ``k`` most likely tokens at each position of a call's token rows and their
        log-probs, and the log-probs of the rows' own tokens, from one pass, without gradient
        and without the logits: what a teacher scores (:class:`~torchrl_grpo.llm.TeacherLogProbs`
        with ``top_k``).

        Position ``t`` holds the distribution that token ``t`` was drawn from (the model's
        output at ``t - 1``), laid out as the ``("log_probs", "full")`` this wrapper writes for
        the same call: ``[B, T, ...]`` (as the log-probs) with ``pad_output`` or a dense batch,
        else one ``[L_i, ...]`` tensor per row of a lazy stack. Zeros where no log-prob is
        computed (padding, each row's first token and, with ``log_probs_at="response"``, the
        prompt).

        Args:
            tensordict (TensorDictBase): the batch, with ``("tokens", "full")`` (input mode
                ``"tokens"``).
            k (int): tokens per position, at most the vocabulary.

        Returns:
            ``(log_probs, top_log_probs, top_ids)``: ``[B, T]``, ``[B, T, k]`` (float32 at
            least) and ``[B, T, k]`` (int64, the most likely first), or lists of rows.

        Raises:
            ValueError: ``k`` outside ``[1, V]`` (``V`` the tokenizer's ids: only they are
                ranked); rows that are not one-dimensional token ids.
        """
        response = self.log_probs_at == "response"
        with torch.no_grad(), self._adapters():
            rows = self._token_rows(tensordict, prompts=response)
            if rows is None:
                raise ValueError(
                    "top_log_probs reads one-dimensional rows of token ids (input_mode="
                    f"'tokens', {self.input_key!r})."
                )
            log_probs, shifted = self._scored(rows, False, response)
            index = read_index(rows, response_starts(rows) if response else None)
            weight = self._head()
            chunk = self._rows(weight.shape[0], len(index), shifted.device)
            index = upload(index, shifted.device)
            states = shifted.reshape(-1, shifted.shape[-1])[index]  # (N, F)
            values, ids = top_log_probs_from_hidden(
                states, weight, k, chunk_size=chunk, among=len(self.tokenizer)
            )  # the tokenizer's ids: a student's output layer may have other padding rows
        shape = (*rows.tokens.shape, k)
        values = values.new_zeros(rows.tokens.numel(), k).index_put((index,), values)
        ids = ids.new_zeros(rows.tokens.numel(), k).index_put((index,), ids)
        found = (log_probs, values.view(shape), ids.view(shape))
        if self.pad_output or not isinstance(tensordict, LazyStackedTensorDict):
            return found
        return tuple(unpadded(x, rows) for x in found)

    def _rows_hidden(self, rows: TokenRows) -> torch.Tensor:
        """The body's last hidden states ``[B, T, H]`` of the left-padded rows.

        Rows whose attended tokens are one block at their right end go through the body as
        one packed prefix tree (:class:`~torchrl_grpo.llm.prefix.PrefixSharing`: shared
        tokens once; with ``pad_model_input=False`` packed even when nothing is shared);
        otherwise, or where the model cannot, one dense padded pass. Padding holds zeros
        when packed.
        """
        body, _ = self._output_layer()
        hidden = None
        if rows.blocks:
            pack = not self.pad_model_input
            hidden = self.sharing.hidden(body, rows.real, rows.width, pack=pack)
        if hidden is None:
            hidden = body(
                input_ids=rows.tokens, attention_mask=rows.attention, use_cache=False
            ).last_hidden_state
        return hidden

    def _model_forward_with_padded_sequences(
        self,
        tokens_full_padded: torch.Tensor,
        attention_mask_full_padded: torch.Tensor,
        *,
        pad_val=None,
        logits_only: bool = False,
        **kwargs,
    ):
        """The model's body on left-padded tokens; ``(log_probs, shifted hidden states)``.

        Overrides torchrl's method of the same name (see ``torchrl_grpo._compat``), which
        returns ``(log_probs, shifted logits)``; torchrl's text and history paths call it.
        Generation keywords are not passed: they do not change the hidden states.
        """
        if tokens_full_padded.numel() == 0:
            self._check_input(0, 0)
        rows = token_rows(
            list(tokens_full_padded.unbind(0)),
            list(attention_mask_full_padded.unbind(0)),
            self.tokenizer.pad_token_id,
        )
        self._check_input(rows.width, int(rows.lengths.min()))
        return self._scored(rows, logits_only)

    def _model_forward_with_packed_sequences(
        self,
        flat_input_ids: torch.Tensor,
        block_diag_attention_mask: torch.Tensor,
        *,
        pad: bool = True,
        logits_only: bool = False,
        **kwargs,
    ):
        """The model's body on sequences given packed (nested); each attends causally to
        itself only.

        Overrides torchrl's method of the same name; returns nested (or right-padded,
        ``pad=True``) ``(log_probs, shifted hidden states)`` where torchrl returns logits.
        Unlike torchrl 0.14.1, which attends over the whole block of each sequence (later
        tokens included) and scores each sequence's first token from the end of the previous
        one, the mask is causal within each sequence and every sequence's first token has
        log-prob ``0``: the packed path gives the numbers of the padded one.
        """
        if flat_input_ids.numel() == 0:
            raise ValueError(
                "Input contains empty sequences. Packing requires at least one token per sequence."
            )
        ids, masks = list(flat_input_ids.unbind(0)), list(block_diag_attention_mask.unbind(0))
        rows = token_rows(ids, masks, self.tokenizer.pad_token_id)
        self._check_input(rows.width, int(rows.lengths.min()))
        log_probs, shifted = self._scored(rows, logits_only)

        def unpack(x):  # left-padded (B, T, ...) -> nested (B, j, ...), or right-padded
            found = ragged.rows_of(x, rows.lengths)
            if pad:
                return ragged.padded(found, 0.0, side="right")
            return torch.nested.as_nested_tensor(found, layout=torch.jagged)

        return (None if log_probs is None else unpack(log_probs)), unpack(shifted)

    # -- distributions: torchrl's masks, over hidden states -------------------------------------

    def _lean(self, dist) -> HiddenLLMMaskedCategorical:
        """torchrl's masked distribution, whose "logits" are our shifted hidden states."""
        if isinstance(dist, LLMMaskedCategorical):
            hidden, mask = dist.logits, dist.mask
        elif isinstance(dist, Categorical):
            raise NotImplementedError(
                "LeanTransformersWrapper.get_dist needs a position-level mask: pass mask_key "
                "(e.g. ('masks', 'all_attention_mask'))."
            )
        else:
            raise TypeError(f"Unexpected distribution {type(dist).__name__} from torchrl.")
        if hidden.is_nested:
            raise NotImplementedError(
                "LeanTransformersWrapper builds padded distributions only (as_nested_tensor "
                "is not supported)."
            )
        weight = self._head()
        rows = self._rows(weight.shape[0], mask.numel(), hidden.device)
        return HiddenLLMMaskedCategorical(hidden, mask, weight, chunk_size=rows)

    def get_dist(self, tensordict: TensorDictBase, *args, **kwargs) -> HiddenLLMMaskedCategorical:
        """torchrl's ``get_dist``, as a :class:`HiddenLLMMaskedCategorical`.

        Without ``mask_key`` the attention mask ``("masks", "all_attention_mask")`` is used
        (torchrl would compare the logits with the padding value, which has no meaning for
        hidden states).

        Returns:
            HiddenLLMMaskedCategorical: the masked token distribution.
        """
        if len(args) < 3 and kwargs.get("mask_key") is None:
            kwargs["mask_key"] = ("masks", "all_attention_mask")
        return self._lean(super().get_dist(tensordict, *args, **kwargs))

    def _get_dist_with_prompt_mask(self, tensordict, *args, **kwargs):
        dist = None if args or kwargs else self._masked(tensordict, "prompt")
        if dist is None:
            dist = self._lean(super()._get_dist_with_prompt_mask(tensordict, *args, **kwargs))
        return dist

    def _get_dist_with_assistant_mask(self, tensordict, *args, **kwargs):
        dist = None if args or kwargs else self._masked(tensordict, "assistant")
        if dist is None:
            dist = self._lean(super()._get_dist_with_assistant_mask(tensordict, *args, **kwargs))
        return dist

    def _get_dist_with_attention_mask(self, tensordict, *args, **kwargs):
        dist = None if args or kwargs else self._masked(tensordict, "attention")
        if dist is None:
            dist = self._lean(super()._get_dist_with_attention_mask(tensordict, *args, **kwargs))
        return dist

    def _masked(self, tensordict, strategy: str) -> HiddenLLMMaskedCategorical | None:
        """torchrl's masked distribution (``"prompt"``: ``"sft"``, ``"assistant"``:
        ``"rlhf"``, ``"attention"``: ``"generic"``) built from the rows read once
        (:func:`~torchrl_grpo.llm.scoring.dist_mask`), or ``None`` where torchrl's code must
        build it: text or history input, no stored prompts (``"sft"``), an assistant mask on
        rows that hold padding, or torchrl's ``pad_output=True`` paths that read a mask the
        batch lacks."""
        if self.generate or self.input_mode != "tokens" or tensordict.ndim != 1:
            return None
        td = tensordict  # a lazy stack of rows, or one TensorDict of rows of one length
        needs = {
            "prompt": (self.tokens_key, "prompt"),
            "assistant": ("masks", "all_assistant_mask"),
        }
        entry = None if strategy not in needs else td.get(needs[strategy], None, as_list=True)
        if strategy in needs and (
            entry is None or (isinstance(entry, list) and any(e is None for e in entry))
        ):
            return None
        if self.pad_output and td.get(("masks", "all_attention_mask"), None, as_list=True) is None:
            return None
        rows = self._token_rows(td)
        if rows is None:
            return None
        if strategy == "assistant" and (self.pad_output or (rows.counts != rows.lengths).any()):
            return None
        with self._adapters():
            _, shifted = self._scored(rows, logits_only=True)
        weight = self._head()
        if strategy == "assistant":  # the stored mask, each row whole: no host read of it
            mask = (ragged.padded(entry, False) if isinstance(entry, list) else entry).bool()
            chunk = self._rows(weight.shape[0], mask.numel(), shifted.device)
            return HiddenLLMMaskedCategorical(shifted, mask, weight, chunk_size=chunk)
        if entry is None:
            lengths = None
        elif isinstance(entry, list):
            lengths = [p.shape[-1] for p in entry]
        else:  # one [B, P] tensor of prompts
            lengths = [entry.shape[-1]] * entry.shape[0]
        mask, first = dist_mask(rows, strategy, self.pad_output, lengths)
        if self.pad_output or rows.blocks:
            features = shifted[:, first:]
        else:  # torchrl's unpadded rows, padded again: each row's attended columns
            flat = shifted.reshape(-1, shifted.shape[-1])
            flat = torch.cat([flat, flat.new_zeros(1, flat.shape[-1])])
            features = flat[upload(compact_index(rows), shifted.device)]
        chunk = self._rows(weight.shape[0], int(mask.sum()), shifted.device)
        return HiddenLLMMaskedCategorical(
            features,
            upload(mask, shifted.device),
            weight,
            chunk_size=chunk,
            positions=upload(np.flatnonzero(mask), shifted.device),
        )

    def _get_dist_with_custom_mask(self, tensordict, mask, *args, **kwargs):
        dist = super()._get_dist_with_custom_mask(tensordict, mask, *args, **kwargs)
        return self._lean(dist)
