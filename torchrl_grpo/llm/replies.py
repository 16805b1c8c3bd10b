"""The environment's reply to an agent's turn, from a plain Python function.

:class:`ToolReply` is the env transform a multi-turn task writes its replies with: after each
turn it decodes the answer, calls ``reply(text, row)`` (a tool, a checker, feedback on a wrong
answer) and writes the reply's tokens where :class:`~torchrl_grpo.llm.ExactTurns` appends them
to the dialog. torchrl's own tool transforms (``SimpleToolTransform``, ``ExecuteToolsInOrder``)
work on ``History`` (history mode, re-tokenized at every turn); this one stays in tokens mode, so
the tokens trained on are the tokens sampled.

A reply function that raises does not stop the run: the dialog goes on with the error as the
reply (an agent has to learn what a failing tool means), the row is flagged (``"tool_error"``,
stored with the turn) and counted (:attr:`ToolReply.errors`); nothing already collected is lost.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase
from torchrl.data import Composite, Unbounded
from torchrl.envs import Transform

__all__ = ["ToolReply"]


class ToolReply(Transform):
    """Write the environment's reply to each turn, computed by ``reply(text, row)``.

    Args:
        reply: called once per row after each turn with the decoded answer (up to its first
            end-of-sequence token, which is written as the tokenizer's ``eos_token``) and the
            row of the step (a ``TensorDict``: the task's data, ``"answer"`` say); returns the
            reply's text, or ``None`` for no reply. An exception becomes the reply
            ``"error: <type>: <message>"`` (see the module's docstring).
        tokenizer: a ``transformers`` tokenizer: decodes the answers, encodes the replies
            (without special tokens added).

    Keyword Args:
        reply_key: where the reply's token ids are written in the step's output (one 1-D tensor
            per row; empty for no reply): :class:`~torchrl_grpo.llm.ExactTurns` reads them there.
        error_key: where a row's ``True`` says its reply function raised.

    Attributes:
        calls (int): replies asked for so far.
        errors (int): those whose function raised.

    Examples:
        >>> from torchrl_grpo.llm import ToolReply
        >>> def check(text, row):  # feedback on a wrong answer, nothing after a right one
        ...     return None if text == row["answer"] + "<eos>" else "wrong, try again:"
        >>> replies = ToolReply(check, tokenizer=None)
        >>> replies.calls, replies.errors
        (0, 0)
    """

    def __init__(
        self,
        reply: Callable[[str, TensorDictBase], str | None],
        tokenizer,
        *,
        reply_key="reply_tokens",
        error_key="tool_error",
    ):
        super().__init__(in_keys=[("tokens", "response")], out_keys=[error_key])
        self.reply, self.tokenizer = reply, tokenizer
        self.reply_key, self.error_key = reply_key, error_key
        self.calls = self.errors = 0

    def answers(self, responses: list[torch.Tensor]) -> list[str]:
        """Each answer's text up to its first end-of-sequence token (written as
        ``eos_token``); the pad tokens a sampler leaves after it are not read."""
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        texts = []
        for tokens in responses:
            ends = (tokens == eos).nonzero()
            cut = tokens[: int(ends[0])] if len(ends) else tokens[tokens != pad]
            texts.append(
                self.tokenizer.decode(cut) + (self.tokenizer.eos_token if len(ends) else "")
            )
        return texts

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase):
        texts = self.answers(tensordict.get(("tokens", "response"), as_list=True))
        rows = tensordict.unbind(0)
        replies, failed = [], []
        for text, row in zip(texts, rows, strict=True):
            self.calls += 1
            try:
                out = self.reply(text, row)
                failed.append(False)
            except Exception as err:  # noqa: BLE001 (any failure of the tool is its answer)
                self.errors += 1
                out = f"error: {type(err).__name__}: {err}"
                failed.append(True)
            replies.append("" if out is None else str(out))
        ids = self.tokenizer(replies, add_special_tokens=False)["input_ids"]
        if not isinstance(next_tensordict, LazyStackedTensorDict):
            next_tensordict = next_tensordict.to_lazystack(0)
        for row, reply in zip(next_tensordict.tensordicts, ids, strict=True):
            row.set(self.reply_key, torch.tensor(reply, dtype=torch.long))
        next_tensordict.set(self.error_key, torch.tensor(failed).reshape(-1, 1))
        return next_tensordict

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase):
        flags = torch.zeros(tensordict_reset.batch_size + (1,), dtype=torch.bool)
        tensordict_reset.set(self.error_key, flags)
        return tensordict_reset

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        observation_spec[self.error_key] = Unbounded(
            shape=observation_spec.shape + (1,), dtype=torch.bool, device=observation_spec.device
        )
        return observation_spec
