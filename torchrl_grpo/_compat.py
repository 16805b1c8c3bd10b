"""Every reliance of torchrl_grpo on a private name or an undocumented behaviour of torch, torchrl
or tensordict, one small function each.

Each function here has a test in ``test/test_compat.py`` whose failure message names it, so that
an upgrade that changes one of them fails in one known place. Everything else in the package uses
public APIs only.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import torch
from tensordict import TensorDictBase
from torch.distributions import Distribution
from torch.nn.utils.rnn import pad_sequence
from torchrl.data import ReplayBuffer
from torchrl.envs.transforms import Compose, Transform
from torchrl.modules.llm import TransformersWrapper

# The public methods of a replay buffer that hand data to (or append) its transforms; inside them
# the buffer is fully built, so reading its ``transform`` and ``storage`` is safe.
_BUFFER_METHODS = frozenset(
    {"extend", "add", "__setitem__", "append_transform", "insert_transform"}
)


def calling_replay_buffer(transform: Transform, depth: int = 16) -> ReplayBuffer | None:
    """The torchrl ``ReplayBuffer`` that is calling into ``transform``, if any (see
    :func:`buffer_call`)."""
    return buffer_call(transform, depth)[0]


def buffer_call(transform: Transform, depth: int = 16) -> tuple[ReplayBuffer | None, str | None]:
    """The torchrl ``ReplayBuffer`` that is calling into ``transform``, and the name of the
    buffer's method it calls from (``"extend"``, ``"add"``...); ``(None, None)`` if none.

    torchrl gives a transform no handle on its buffer: ``Transform.container`` is the buffer's
    ``Compose``, and that ``Compose`` has no container. The buffer is found instead as ``self`` of
    the buffer method that called into the transform (``extend``, ``add``, ``append_transform``...)
    a few frames up the call stack, and only if ``transform`` is one of its transforms.

    Reliance (torchrl 0.14.1): a buffer calls its transforms, and ``Compose.append``, from inside
    its own methods.

    Args:
        transform: the transform looking for its buffer.
        depth: how many frames up to look.

    Returns:
        ``(buffer, method)``, or ``(None, None)`` when the call does not come from a buffer
        holding ``transform``.
    """
    frame = inspect.currentframe()
    try:
        for _ in range(depth):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None, None
            name = frame.f_code.co_name
            if name not in _BUFFER_METHODS:
                continue
            buffer = frame.f_locals.get("self")
            if isinstance(buffer, ReplayBuffer) and _holds(buffer.transform, transform):
                return buffer, name
        return None, None
    finally:
        del frame  # frames reference their locals: do not keep them alive


#: Where torchrl's collectors live (a frame of code there is a collector at work).
_COLLECTORS = os.sep + os.path.join("torchrl", "collectors") + os.sep


def inside_collector(depth: int = 64) -> bool:
    """Whether a torchrl collector is on the call stack (it is driving the env that asks).

    Reliance (torchrl 0.14.1): collectors are the code of ``torchrl/collectors/``, and they
    reset and step their env from their own methods.
    """
    frame = inspect.currentframe()
    try:
        for _ in range(depth):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return False
            if _COLLECTORS in frame.f_code.co_filename:
                return True
        return False
    finally:
        del frame


def _holds(container: Transform, transform: Transform) -> bool:
    if container is transform:
        return True
    return isinstance(container, Compose) and any(_holds(t, transform) for t in container)


EMPTY_TENSOR_STORAGE_METADATA = {"metadata": {}, "is_pytree": True, "len": 0}


def write_empty_tensor_storage(path: str | Path) -> None:
    """Write at ``path`` what torchrl's ``TensorStorageCheckpointer.loads`` reads as an empty
    storage.

    torchrl's tensor storages refuse to save before their first write. The record written here
    is the one its checkpointer writes for a storage of no leaves: ``storage_metadata.json`` saying
    a pytree of no leaves and length 0. Loading it loads nothing and sets the storage's length to
    0, into a fresh storage or over a filled one.

    Reliance (torchrl 0.14.1): the format of ``storage_metadata.json`` and how
    ``TensorStorageCheckpointer.loads`` reads a pytree record.

    Args:
        path: the storage's checkpoint folder (created if missing).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "storage_metadata.json").write_text(json.dumps(EMPTY_TENSOR_STORAGE_METADATA))


# --- torch: the dispatcher hook that counts operators (torchrl_grpo.launches) -------------------

#: torch's Python hook at the dispatcher (``torch.utils._python_dispatch``, a private module):
#: every ATen operator, the backward pass's included (torch carries the mode into the autograd
#: engine's threads), calls ``__torch_dispatch__`` of the active mode.
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode  # noqa: E402

# --- torchrl.modules.llm: the masked token distribution of an LLM wrapper -------------------------

#: torchrl's masking strategies and the ``LLMWrapperBase`` method that builds each distribution.
#: torchrl's own ``GRPOLoss`` calls the same methods; they are provisional in torchrl ("will be
#: replaced by the ``get_dist`` method once we have a better masking strategy").
LLM_MASKED_DIST_METHODS = {
    "sft": "_get_sft_dist",  # response tokens: the attention mask without the prompt
    "rlhf": "_get_rlhf_dist",  # assistant tokens (history input)
    "generic": "_get_generic_dist",  # every attended token
}


def llm_masked_dist(wrapper, tensordict: TensorDictBase, masking_strategy: str) -> Distribution:
    """The wrapper's token distribution over ``("tokens", "full")``, masked by the strategy.

    Returns torchrl's ``LLMMaskedCategorical``: ``.logits`` ``[B, T, V]`` and ``.mask``
    ``[B, T]``, left-padded, aligned with ``tensordict.get(("tokens", "full"),
    as_padded_tensor=True, padding_side="left")``. With ``"rlhf"`` the wrapper may rewrite
    ``("tokens", "full")`` in ``tensordict`` (history input is tokenized again).

    Raises:
        NotImplementedError: the wrapper has no method for the strategy.
    """
    name = LLM_MASKED_DIST_METHODS[masking_strategy]
    method = getattr(wrapper, name, None)
    if method is None:
        raise NotImplementedError(
            f"{type(wrapper).__name__} has no {name}(), which torchrl uses for "
            f"masking_strategy={masking_strategy!r}; this torchrl release is not supported "
            "(see torchrl_grpo._compat)."
        )
    return method(tensordict)


# --- torchrl.modules.llm: where TransformersWrapper runs the model to score tokens --------------

#: The methods of ``TransformersWrapper`` through which every ``generate=False`` input mode runs
#: the causal LM, with the parameters ``LeanTransformersWrapper`` overrides them with (it returns
#: shifted hidden states where they return shifted logits), and the helpers it calls.
TRANSFORMERS_WRAPPER_SCORING = {
    "_model_forward_with_padded_sequences": (
        "tokens_full_padded",
        "attention_mask_full_padded",
        "pad_val",
        "logits_only",
    ),
    "_model_forward_with_packed_sequences": (
        "flat_input_ids",
        "block_diag_attention_mask",
        "pad",
        "logits_only",
    ),
    "_pack_sequences": ("input_ids", "attention_mask"),
    # the tokens path, whose input it reads for the response lengths (``log_probs_at``)
    "_from_transformers_logprobs_tokens": ("td", "cfg", "out", "logits_only"),
    "repeat_interleave_causal": ("sequence_lengths",),
    # the builders of the masked distributions, which it overrides to return them over hidden
    # states (``_get_sft_dist`` and the others of LLM_MASKED_DIST_METHODS call them)
    "_get_dist_with_prompt_mask": ("tensordict",),
    "_get_dist_with_assistant_mask": ("tensordict",),
    "_get_dist_with_attention_mask": ("tensordict",),
    "_get_dist_with_custom_mask": ("tensordict", "mask"),
    "get_dist": ("tensordict", "mask_key"),
}


def check_transformers_wrapper_scoring(cls: type = TransformersWrapper) -> None:
    """Raise unless ``cls`` still scores tokens through the methods the lean wrapper overrides.

    Reliance (torchrl 0.14.1): ``TransformersWrapper``'s ``generate=False`` paths (tokens,
    text, history) call ``_model_forward_with_padded_sequences`` or
    ``_model_forward_with_packed_sequences`` and read ``(log_probs, logits)`` back; the
    packed one packs with ``_pack_sequences`` (the lean one also builds its causal mask with
    ``repeat_interleave_causal``); the masking strategies' distributions are built by the
    ``_get_dist_with_*`` methods. If torchrl renamed them, a subclass overriding
    them would silently build the logits again.

    Raises:
        RuntimeError: a method is missing or its parameters changed (named in the message).
    """
    for name, params in TRANSFORMERS_WRAPPER_SCORING.items():
        method = getattr(cls, name, None)
        found = () if method is None else tuple(inspect.signature(method).parameters)
        missing = [p for p in params if p not in found]
        if method is None or missing:
            raise RuntimeError(
                f"torchrl's {cls.__name__}.{name} is missing or lost the parameters {missing}: "
                "this torchrl release scores tokens differently, and LeanTransformersWrapper "
                "would build the logits (see torchrl_grpo._compat)."
            )


# --- torchrl.modules.llm: the generation log-probs of TransformersWrapper -------------------------

#: The parameters of ``TransformersWrapper._log_probs_generate`` (torchrl 0.14.1), which
#: :class:`ExactLogProbsTransformersWrapper` overrides with the same signature.
LOG_PROBS_GENERATE_PARAMS = ("tokens", "logits", "pad_val", "pad")


class ExactLogProbsTransformersWrapper(TransformersWrapper):
    """torchrl's ``TransformersWrapper`` whose generation log-probs keep the first generated
    token's value.

    With ``generate=True, return_log_probs=True``, torchrl 0.14.1 sets the log-prob of every
    completion's first token to 0 (``td["log_probs"][:, 0] = 0`` in ``_log_probs_generate``).
    A loss that takes the sampler's log-probs as the behaviour policy (asynchronous GRPO:
    decoupled PPO's ``sample_log_prob``, or the ``inference_log_prob`` of truncated importance
    sampling) would then read ``pi_behaviour = 1`` for that token. This subclass computes
    ``log softmax(logits)[token]`` for every generated token, the first included: the same
    numbers as the scoring wrapper (``generate=False``) on the same model. Everything else is
    torchrl's wrapper, unchanged.

    Reliance (torchrl 0.14.1): the generation paths call the classmethod
    ``_log_probs_generate(tokens, logits, pad_val, pad)`` and read ``(log_probs, logits)``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
        >>> from torchrl_grpo.llm import ExactLogProbsTransformersWrapper
        >>> vocab = {c: i for i, c in enumerate("0123456789=")} | {"<eos>": 11, "<pad>": 12}
        >>> backend = Tokenizer(models.WordLevel(vocab, unk_token=None))
        >>> backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        >>> tok = PreTrainedTokenizerFast(
        ...     tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
        >>> _ = torch.manual_seed(0)
        >>> model = Qwen2ForCausalLM(Qwen2Config(
        ...     vocab_size=13, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=2, pad_token_id=12)).eval()
        >>> sampler = ExactLogProbsTransformersWrapper(
        ...     model, tokenizer=tok, input_mode="tokens", generate=True,
        ...     return_log_probs=True, pad_output=True,
        ...     generate_kwargs={"max_new_tokens": 2, "do_sample": True})
        >>> prompt = TensorDict(
        ...     {("tokens", "prompt"): torch.tensor([[3, 4, 10], [1, 2, 10]])}, batch_size=[2])
        >>> out = sampler(prompt)
        >>> log_probs = out["log_probs", "response"]  # (2, 2), the first token's too
        >>> bool((log_probs[:, 0] < 0).all())
        True
    """

    @classmethod
    def _log_probs_generate(cls, tokens, logits, pad_val=-100, pad: bool = True):
        if pad:
            tokens = pad_sequence(
                tokens, padding_value=pad_val, batch_first=True, padding_side="left"
            )
            logits = pad_sequence(logits, padding_value=0.0, batch_first=True, padding_side="left")
        log_probs = -torch.nn.functional.cross_entropy(
            logits.flatten(0, -2), tokens.flatten(), reduction="none", ignore_index=-100
        ).view(tokens.shape)  # (B, T): torchrl's computation, without zeroing column 0
        return log_probs, logits


def check_log_probs_generate(cls: type = TransformersWrapper) -> None:
    """Raise unless ``cls._log_probs_generate`` still has the parameters the override keeps.

    Raises:
        RuntimeError: the method is missing or its parameters changed (named in the message).
    """
    why = "ExactLogProbsTransformersWrapper's override of it would not run"
    _check_parameters(cls, "_log_probs_generate", LOG_PROBS_GENERATE_PARAMS, why)


def _check_parameters(cls: type, name: str, expected: tuple[str, ...], why: str) -> None:
    """Raise ``RuntimeError`` unless ``cls.<name>`` exists with the parameters ``expected``."""
    method = getattr(cls, name, None)
    found = () if method is None else tuple(inspect.signature(method).parameters)
    if found != expected:
        raise RuntimeError(
            f"torchrl's {cls.__name__}.{name} is missing or its parameters are {found}, not "
            f"{expected}: {why} (see torchrl_grpo._compat)."
        )


#: The parameters of torchrl's ``Transform._post_step_mdp_hooks`` that
#: :class:`~torchrl_grpo.llm.ExactTurns` overrides to cut the stored turn to its tokens.
POST_STEP_MDP_HOOK_PARAMS = ("self", "tensordict", "tensordict_")


def check_post_step_mdp_hook(cls: type = Transform) -> None:
    """Raise unless ``cls._post_step_mdp_hooks`` is still torchrl's hook of
    ``step_and_maybe_reset``, with the parameters ``ExactTurns`` overrides.

    Reliance (torchrl 0.14.1): ``EnvBase.step_and_maybe_reset`` calls the transforms'
    ``_post_step_mdp_hooks(tensordict, tensordict_)`` with the turn a collector stores and the
    next step's input, and uses what it returns. Documented as a hook to override, but private.

    Raises:
        RuntimeError: the hook is missing or its parameters changed (named in the message).
    """
    why = "ExactTurns could not cut the turns a collector stores to their tokens"
    _check_parameters(cls, "_post_step_mdp_hooks", POST_STEP_MDP_HOOK_PARAMS, why)


def ragged_prompts(env):
    """Let torchrl's ``ChatEnv`` in tokens mode reset with prompts of different token lengths.

    Reliance (torchrl 0.14.1, and its nightly of 2026-10-27): ``ChatEnv._reset_tokens`` reads
    the tokenized prompts of a reset as ``tokens["input_ids"]``, which stacks them, so a batch
    whose prompts differ in length fails at its first reset ("Failed to stack tensors within a
    tensordict"). This gives ``env``'s ``ChatEnv`` instance a subclass of its class
    (``RaggedChatEnv`` for ``ChatEnv``) whose ``_reset_tokens`` reads them as a list and
    writes the same ragged ``("tokens", "prompt")``; other instances are untouched, and copies
    and pickles of the env keep it. Envs in another input mode are left as they are.

    Args:
        env: a ``ChatEnv``, or a ``TransformedEnv`` over one (``DatasetChatEnv``).

    Returns:
        ``env``.

    Raises:
        TypeError: no ``ChatEnv`` under ``env``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> from torchrl.envs.llm import ChatEnv
        >>> from transformers import PreTrainedTokenizerFast
        >>> from torchrl_grpo.llm import ragged_prompts
        >>> vocab = {w: i for i, w in enumerate(["<pad>", "a", "b", "c"])}
        >>> backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        >>> backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        >>> tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")
        >>> tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        >>> env = ChatEnv(batch_size=(2,), tokenizer=tokenizer, input_mode="tokens",
        ...               system_prompt=None,
        ...               template_kwargs={"chat_template": tokenizer.chat_template})
        >>> env = ragged_prompts(env)  # torchrl alone: "Failed to stack tensors" below
        >>> td = env.reset(TensorDict(query=["a b", "a b c"], batch_size=[2]))
        >>> [t.tolist() for t in td.get(("tokens", "prompt"), as_list=True)]
        [[1, 2], [1, 2, 3]]
    """
    from torchrl.envs import TransformedEnv
    from torchrl.envs.llm import ChatEnv

    chat = env
    while isinstance(chat, TransformedEnv):
        chat = chat.base_env
    if not isinstance(chat, ChatEnv):
        raise TypeError(f"ragged_prompts: no torchrl ChatEnv under {type(env).__name__}.")
    if chat.input_mode != "tokens":
        return env

    if not isinstance(chat, _RaggedChatEnv):  # its class, so that copies and pickles keep it
        chat.__class__ = _ragged_class(type(chat))
    return env


class _RaggedChatEnv:
    """Mixed into a ``ChatEnv`` class by :func:`ragged_prompts`: its ``_reset_tokens`` reads
    the prompts as a list."""

    def _reset_tokens(self, tensordict: TensorDictBase, history) -> TensorDictBase:
        return _ragged_reset_tokens(self, tensordict, history)


_RAGGED_CLASSES: dict[type, type] = {}


def _ragged_class(cls: type) -> type:
    """``cls`` with :class:`_RaggedChatEnv` mixed in, one class per ``cls``; a module-level name
    (``Ragged<cls>``) so that pickle finds it."""
    if cls not in _RAGGED_CLASSES:
        name = f"Ragged{cls.__name__}"
        ragged = type(name, (_RaggedChatEnv, cls), {"__module__": __name__})
        globals()[name] = _RAGGED_CLASSES[cls] = ragged
    return _RAGGED_CLASSES[cls]


def _ragged_reset_tokens(self, tensordict: TensorDictBase, history) -> TensorDictBase:
    """torchrl's ``ChatEnv._reset_tokens``, the prompts read as a list (:func:`ragged_prompts`),
    and the chat template applied once per distinct query: ``DatasetChatEnv`` repeats each
    prompt of a group ``repeats`` times, and a template applied row by row (a tokenizer call
    and a ``TensorDict`` each) is most of a reset. Rows of one query share its token tensor."""
    from tensordict import LazyStackedTensorDict
    from torchrl.modules.llm.policies.common import Tokens

    where, distinct = _distinct_queries(tensordict.get(self.data_key, None), len(history))
    if distinct is not None:
        history = history[torch.tensor(distinct)]
    tokens = history.apply_chat_template(
        tokenizer=self.tokenizer,
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
        **self.template_kwargs,
    )
    if isinstance(tokens, LazyStackedTensorDict):  # rows of different lengths
        ids = tokens.get("input_ids", as_list=True)
    else:
        ids = tokens["input_ids"].unbind(0)
    if distinct is not None:
        ids = [ids[k] for k in where]
    prompts = Tokens._from_tensordict(tensordict.empty().to_lazystack(0))
    for row, prompt in zip(prompts.unbind(0), ids, strict=True):
        row.prompt = prompt
    return tensordict.empty(device=self.device).set("tokens", prompts)


def _distinct_queries(queries, rows: int) -> tuple[list[int] | None, list[int] | None]:
    """``(where, distinct)``: for each row the index of its query among the distinct ones, and
    the first row of each distinct query; ``(None, None)`` when the queries are not strings or
    all differ (nothing to save)."""
    values = queries.tolist() if hasattr(queries, "tolist") else queries
    if not isinstance(values, list) or len(values) != rows:
        return None, None
    if not all(isinstance(value, str) for value in values):
        return None, None
    first: dict[str, int] = {}
    for value in values:
        first.setdefault(value, len(first))
    if len(first) == rows:
        return None, None
    distinct = [0] * len(first)
    for row in reversed(range(rows)):
        distinct[first[values[row]]] = row
    return [first[value] for value in values], distinct


def __getattr__(name: str):
    """``RaggedChatEnv`` (torchrl's ``ChatEnv`` with ragged prompts) made on first use, so that a
    pickle of an env :func:`ragged_prompts` changed loads in a fresh process (a parallel env's
    worker, a Ray actor) without importing torchrl's LLM envs with this module."""
    if name == "RaggedChatEnv":
        from torchrl.envs.llm import ChatEnv

        return _ragged_class(ChatEnv)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- transformers: the attention a model runs, and flex attention's block mask ------------------


def attention_implementation(model) -> str | None:
    """The attention implementation a Hugging Face model runs (``"sdpa"``, ``"eager"``,
    ``"flex_attention"``, ``"flash_attention_2"``...), or ``None`` if it says none.

    Reliance (transformers 5.x): ``config._attn_implementation``, the attribute every model's
    attention reads to pick its function (transformers has no public getter).
    """
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def block_mask(mask: torch.Tensor):
    """A boolean ``[R, W, W]`` mask as flex attention's ``BlockMask`` (``True``: attend).

    Reliance (torch 2.5+): ``torch.nn.attention.flex_attention.create_block_mask`` with a
    ``mask_mod`` that indexes a tensor.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, kv):
        return mask[b, q, kv]

    rows, width, _ = mask.shape
    return create_block_mask(mask_mod, rows, None, width, width, device=mask.device)
