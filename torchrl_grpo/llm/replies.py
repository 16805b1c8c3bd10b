"""The environment's side of an agent's turn, from plain Python functions: its reply and its
reward.

:class:`ToolReply` is the env transform a multi-turn task writes its replies with: after each
turn it decodes the answer, calls ``reply(text, row)`` (a tool, a checker, feedback on a wrong
answer) and writes the reply's tokens where :class:`~torchrl_grpo.llm.ExactTurns` appends them
to the dialog. torchrl's own tool transforms (``SimpleToolTransform``, ``ExecuteToolsInOrder``)
work on ``History`` (history mode, re-tokenized at every turn); this one stays in tokens mode, so
the tokens trained on are the tokens sampled. :class:`TurnReward` scores each turn with
``score(text, row)`` and ends the dialogs ``ends(text, row)`` says, in torchrl's LLM shapes.

A reply function that raises does not stop the run: the dialog goes on with the error as the
reply (an agent has to learn what a failing tool means), the row is flagged (``"tool_error"``,
stored with the turn) and counted (:attr:`ToolReply.errors`); nothing already collected is lost.
A reply the tokenizer cannot encode is such an error too. The error's reply is encodable by
construction: its text (``error_reply``, by default ``"error: <type>: <message>"``) if the
tokenizer encodes all of it, cut to ``max_error_tokens``; else no reply at all, with one warning
naming the characters it cannot encode (a character tokenizer of digits cannot write
``"error"``: give it an ``error_reply`` it can). Dropping the characters it cannot encode was
not chosen: what is left can read as a real answer (``"error: 404"`` would reply ``" 404"``).

"Cannot encode": the tokenizer raises (a ``tokenizers`` word-level model without an unknown
token), or the text's ids hold its unknown token's id or its pad token's id (a model that maps
what it does not know to a token that means nothing; a pad id inside a dialog is also cut out
of it by :class:`~torchrl_grpo.llm.ExactTurns`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from numbers import Integral

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase
from torchrl.data import Composite, Unbounded
from torchrl.envs import Transform

from torchrl_grpo.llm.turns import REPLY_KEY

__all__ = ["ToolReply", "TurnReward"]


def _answers(tokenizer, responses: list[torch.Tensor]) -> list[str]:
    """Each answer's text up to its first end-of-sequence token (written as ``eos_token``); the
    pad tokens a sampler leaves after it are not read."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    texts = []
    for tokens in responses:
        ends = (tokens == eos).nonzero()
        cut = tokens[: int(ends[0])] if len(ends) else tokens[tokens != pad]
        texts.append(tokenizer.decode(cut) + (tokenizer.eos_token if len(ends) else ""))
    return texts


class ToolReply(Transform):
    """Write the environment's reply to each turn, computed by ``reply(text, row)``.

    Args:
        reply: called once per row after each turn with the decoded answer (up to its first
            end-of-sequence token, which is written as the tokenizer's ``eos_token``) and the
            row of the step (a ``TensorDict``: the task's data, ``"answer"`` say); returns the
            reply's text, or ``None`` for no reply. An exception, or a text the tokenizer cannot
            encode, makes the reply the error's (see ``error_reply`` and the module's docstring).
        tokenizer: a ``transformers`` tokenizer: decodes the answers, encodes the replies
            (without special tokens added).

    Keyword Args:
        reply_key: where the reply's token ids are written in the step's output (one 1-D tensor
            per row; empty for no reply): :class:`~torchrl_grpo.llm.ExactTurns` reads them there.
        error_key: where a row's ``True`` says its reply function raised, or replied with a
            text the tokenizer cannot encode.
        error_reply: the reply to such a row: a text, a function of the exception returning
            one (if it raises: the default, one warning), or ``None`` for ``"error: <type>:
            <message>"``. A text the tokenizer cannot encode gives no reply (one warning); a
            text given here is checked at construction.
        max_error_tokens: the most tokens an error's reply holds (it is cut there: a long
            message would fill the model's context); ``None``: no bound. Defaults to ``32``.

    Attributes:
        calls (int): replies asked for so far.
        errors (int): those whose function raised or replied with a text the tokenizer cannot
            encode.

    Raises:
        ValueError: ``error_reply`` is a text the tokenizer cannot encode (the characters are
            named), or ``max_error_tokens`` is not a positive integer or ``None``.

    Examples:
        >>> from torchrl_grpo.llm import ToolReply
        >>> def check(text, row):  # feedback on a wrong answer, nothing after a right one
        ...     return None if text == row["answer"] + "<eos>" else "wrong, try again:"
        >>> replies = ToolReply(check, tokenizer=None)
        >>> replies.calls, replies.errors
        (0, 0)

        With a character tokenizer of digits (``"error"`` cannot be written), an error's reply
        that it can encode:

        >>> from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        >>> from transformers import PreTrainedTokenizerFast
        >>> vocab = {c: i for i, c in enumerate("0123456789=?")} | {"<eos>": 12, "<pad>": 13}
        >>> core = Tokenizer(models.WordLevel(vocab, unk_token=None))
        >>> core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        >>> core.decoder = decoders.Fuse()
        >>> digits = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>",
        ...                                  pad_token="<pad>")
        >>> replies = ToolReply(lambda text, row: 1 / 0, digits, error_reply="?=")
        >>> replies.error_tokens(ZeroDivisionError("division by zero"))
        [11, 10]
        >>> ToolReply(check, digits, error_reply="error")
        Traceback (most recent call last):
        ...
        ValueError: ToolReply: the tokenizer cannot encode error_reply='error' (...'e', 'o', 'r'...
    """

    def __init__(
        self,
        reply: Callable[[str, TensorDictBase], str | None],
        tokenizer,
        *,
        reply_key=REPLY_KEY,
        error_key="tool_error",
        error_reply: str | Callable[[Exception], str] | None = None,
        max_error_tokens: int | None = 32,
    ):
        if max_error_tokens is not None and (
            isinstance(max_error_tokens, bool)
            or not isinstance(max_error_tokens, Integral)
            or max_error_tokens < 1
        ):
            raise ValueError(
                f"ToolReply: max_error_tokens must be a positive integer or None, got "
                f"{max_error_tokens!r}."
            )
        if isinstance(error_reply, str) and tokenizer is not None:
            if _encoded(tokenizer, [error_reply])[0] is None:
                raise ValueError(
                    f"ToolReply: the tokenizer cannot encode error_reply={error_reply!r} (it "
                    f"cannot encode {_unencodable(tokenizer, error_reply)}): give a text of "
                    "characters it has."
                )
        super().__init__(in_keys=[("tokens", "response")], out_keys=[error_key])
        self.reply, self.tokenizer = reply, tokenizer
        self.reply_key, self.error_key = reply_key, error_key
        self.error_reply = error_reply
        self.max_error_tokens = None if max_error_tokens is None else int(max_error_tokens)
        self.calls = self.errors = 0
        self._warned = False

    def answers(self, responses: list[torch.Tensor]) -> list[str]:
        """Each answer's text up to its first end-of-sequence token (written as
        ``eos_token``); the pad tokens a sampler leaves after it are not read."""
        return _answers(self.tokenizer, responses)

    def error_tokens(self, error: Exception) -> list[int]:
        """The token ids of the reply to a row whose function raised ``error``: the text of
        ``error_reply`` if the tokenizer encodes all of it, cut to ``max_error_tokens``; else
        none (and one warning, the first time, naming the characters)."""
        text = f"error: {type(error).__name__}: {error}"
        if isinstance(self.error_reply, str):
            text = self.error_reply
        elif self.error_reply is not None:
            try:
                text = str(self.error_reply(error))
            except Exception as err:  # noqa: BLE001 (the default text, then: the run goes on)
                self._warn(f"ToolReply: error_reply raised {err!r}; the default text is used.")
        ids = _encoded(self.tokenizer, [text])[0]
        if ids is None:
            self._warn(
                f"ToolReply: the tokenizer cannot encode the reply to an error, {text!r} (it "
                f"cannot encode {_unencodable(self.tokenizer, text)}): such rows get no reply "
                "(they are still flagged and counted). Pass error_reply= a text it encodes."
            )
            return []
        return ids if self.max_error_tokens is None else ids[: self.max_error_tokens]

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase):
        texts = self.answers(tensordict.get(("tokens", "response"), as_list=True))
        replies, errors = [], []
        for text, row in zip(texts, tensordict.unbind(0), strict=True):
            try:
                out = self.reply(text, row)
                replies.append("" if out is None else str(out))
                errors.append(None)
            except Exception as err:  # noqa: BLE001 (any failure of the tool is its answer)
                replies.append("")
                errors.append(err)
        ids = _encoded(self.tokenizer, replies)
        for i, (encoded, error) in enumerate(zip(ids, errors, strict=True)):
            if error is None and encoded is None:
                chars = _unencodable(self.tokenizer, replies[i])
                errors[i] = ValueError(f"a reply the tokenizer cannot encode ({chars})")
                self._warn(
                    f"ToolReply: the tokenizer cannot encode the reply {replies[i]!r} "
                    f"({chars}); it is taken as the tool's error."
                )
            if errors[i] is not None:
                ids[i] = self.error_tokens(errors[i])
        if not isinstance(next_tensordict, LazyStackedTensorDict):
            next_tensordict = next_tensordict.to_lazystack(0)
        for row, reply in zip(next_tensordict.tensordicts, ids, strict=True):
            row.set(self.reply_key, torch.tensor(reply, dtype=torch.long))
        failed = [error is not None for error in errors]
        next_tensordict.set(self.error_key, torch.tensor(failed).reshape(-1, 1))
        self.calls += len(failed)
        self.errors += sum(failed)
        return next_tensordict

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(message, UserWarning, stacklevel=3)

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase):
        flags = torch.zeros(tensordict_reset.batch_size + (1,), dtype=torch.bool)
        tensordict_reset.set(self.error_key, flags)
        return tensordict_reset

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        observation_spec[self.error_key] = Unbounded(
            shape=observation_spec.shape + (1,), dtype=torch.bool, device=observation_spec.device
        )
        return observation_spec


def _encoded(tokenizer, texts: list[str]) -> list[list[int] | None]:
    """Each text's token ids (no special tokens added), ``None`` where the tokenizer cannot
    encode it: it raises, or writes its unknown or its pad token's id (see the module's
    docstring). One call for the batch; text by text only if that call raises."""
    try:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    except Exception:  # noqa: BLE001 (tokenizers raise a bare Exception on an unknown token)
        ids = [_encoded_alone(tokenizer, text) for text in texts]
    refused = {tokenizer.unk_token_id, tokenizer.pad_token_id} - {None}
    return [None if row is None or refused.intersection(row) else list(row) for row in ids]


def _encoded_alone(tokenizer, text: str) -> list[int] | None:
    try:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    except Exception:  # noqa: BLE001 (as in _encoded)
        return None


def _unencodable(tokenizer, text: str) -> str:
    """The characters of ``text`` the tokenizer cannot encode alone, as a readable list."""
    chars = sorted(set(text))
    bad = [c for c, ids in zip(chars, _encoded(tokenizer, chars), strict=True) if ids is None]
    return ", ".join(map(repr, bad)) if bad else "its characters together"


class TurnReward(Transform):
    """Score each turn with ``score(text, row)``; end the dialogs whose turn ``ends(text, row)``.

    The reward transform of a multi-turn task, beside :class:`ToolReply`: after each turn it
    decodes the answer as :class:`ToolReply` does (up to its first end-of-sequence token,
    written as ``eos_token``) and writes ``("next", "reward")`` in torchrl's LLM shape
    ``[B, 1, 1]`` (float32); a row whose ``ends`` is true is ``terminated`` (and ``done``).
    Append it before :class:`~torchrl_grpo.llm.ExactTurns`, so that an ended dialog's next
    prompt is not checked against its ``max_length``; ``StepCounter`` ends the dialogs that
    never end on their own (``truncated``).

    Args:
        score: ``(text, row) -> float``, the turn's reward (``row``: the step's data, the
            task's ``"answer"`` say). An exception stops the step, naming the row: a reward
            that cannot be computed is a bug of the task, not an answer of the agent.
        tokenizer: a ``transformers`` tokenizer: decodes the answers.

    Keyword Args:
        ends: ``(text, row) -> bool``, whether the dialog ends after this turn (a final
            answer); ``None``: no dialog ends here.

    Examples:
        >>> from torchrl_grpo.llm import TurnReward
        >>> def right(text, row):
        ...     return float(text == row["answer"] + "<eos>")
        >>> def final(text, row):  # any turn that does not call the tool answers
        ...     return not text.startswith("add ")
        >>> rewards = TurnReward(right, tokenizer=None, ends=final)
        >>> rewards.out_keys
        ['reward', 'terminated', 'done']
    """

    def __init__(
        self,
        score: Callable[[str, TensorDictBase], float],
        tokenizer,
        *,
        ends: Callable[[str, TensorDictBase], bool] | None = None,
    ):
        super().__init__(
            in_keys=[("tokens", "response")], out_keys=["reward", "terminated", "done"]
        )
        self.score, self.tokenizer, self.ends = score, tokenizer, ends

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase):
        texts = _answers(self.tokenizer, tensordict.get(("tokens", "response"), as_list=True))
        rewards, ends = [], []
        for i, (text, row) in enumerate(zip(texts, tensordict.unbind(0), strict=True)):
            try:
                rewards.append(float(self.score(text, row)))
                ends.append(bool(self.ends(text, row)) if self.ends is not None else False)
            except Exception as err:
                raise RuntimeError(
                    f"TurnReward: scoring row {i} raised (answer {text!r}): {err!r}"
                ) from err
        next_tensordict.set("reward", torch.tensor(rewards, dtype=torch.float32).view(-1, 1, 1))
        if any(ends):
            for key in ("terminated", "done"):
                flags = next_tensordict.get(key)
                ended = torch.tensor(ends, device=flags.device).view(flags.shape)
                next_tensordict.set(key, flags | ended)
        return next_tensordict

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        reward_spec["reward"] = Unbounded(
            reward_spec.shape + (1, 1), dtype=torch.float32, device=reward_spec.device
        )
        return reward_spec
