"""ragged_prompts: torchrl's ``ChatEnv`` in tokens mode resetting with prompts of different token
lengths (torchrl 0.14.1 stacks them, and fails), by giving the env's instance a subclass of its
class (``RaggedChatEnv`` for ``ChatEnv``) that reads them as a list."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

__all__ = ["ragged_prompts"]


def ragged_prompts(env):
    """Let torchrl's ``ChatEnv`` in tokens mode reset with prompts of different token lengths.

    Reliance (torchrl 0.14.1, and its nightly of 2026-10-27; the private names are checked by
    :func:`torchrl_grpo._compat.check_private_names`): ``ChatEnv._reset_tokens`` reads
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
