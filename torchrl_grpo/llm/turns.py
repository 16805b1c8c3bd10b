"""Multi-turn dialogs on torchrl's ``ChatEnv`` in tokens mode, with every turn's tokens exact.

An agent's dialog is a trajectory whose steps are its turns: at each step the policy answers the
dialog so far, the environment replies (a tool's result, feedback on a wrong answer) and the next
prompt is the dialog so far, the answer and the reply. torchrl 0.14.1's ``ChatEnv`` in tokens mode
gets three things wrong across turns, and :class:`ExactTurns`, one env transform, puts them right:

1. **The next prompt.** ``ChatEnv`` makes the sampler's whole output, ``("tokens", "full")``, the
   next prompt. A sampler that pads (``pad_output=True``, which ``ChatEnv`` needs to stack ragged
   answers) leaves its padding inside it: left padding of the shorter prompts, right padding
   after the shorter answers. Generation hides them (its attention mask and position ids skip
   them) but a scorer that reads the stored sequence without position ids counts them, so the
   loss's ratio is not 1 on the policy that sampled (ESS 0.79 on a two-turn batch). Here the next
   prompt is the dialog's real tokens only, with the environment's reply appended (read from
   ``reply_key``, where any transform placed before this one may write it), exactly the tokens
   that were sampled: nothing is decoded and encoded again.
2. **The stale mask.** The sampler writes ``("masks", "all_attention_mask")`` for its output;
   ``step_mdp`` carries it into the next step, where the sampler reads it as the new (longer)
   prompt's mask: ``RuntimeError: The size of tensor a (12) must match ... (11)``. Worse, a row
   reset while others go on (a collector's partial reset) keeps the mask of its last dialog:
   no error, but the sampler attends to the new prompt's padding as if it were text, and the
   turns it samples come from another distribution than the one they are trained as. Here
   every step and every reset carries the mask of its own prompt.
3. **The stored turns.** The turn that a collector stores is the sampler's padded output. At
   each ``step_and_maybe_reset`` (collectors, ``rollout``) its token sequences, masks and
   log-probs are cut to the real tokens, so that the buffer holds each turn exactly as sampled
   (ragged rows of a lazy stack) whatever the sampler's ``pad_output``.

A sampler with ``pad_output=False`` is accepted too: ``ChatEnv`` cannot stack its ragged output
(``Failed to stack tensors within a tensordict``), so it is handed a padded copy.

It also writes a **dialog id** (``dialog_id_key``), new at each reset of a row and kept across
its turns: torchrl's ``LLMCollector`` writes no trajectory id, and without one
:class:`~torchrl_grpo.MCAdvantage` cannot hold a dialog that a collector batch cut after one of
its turns (``MCAdvantage(traj_key="dialog_id")`` joins them).

Where this belongs, and why: an env transform, because the next prompt and its mask are the
environment's output (a collector postproc or the loss would come after the sampler has read
them), and because the env's ``step_and_maybe_reset`` hook is where the stored turn and the next
prompt part (torchrl's ``Transform._post_step_mdp_hooks``, checked in
:mod:`torchrl_grpo._compat`).
"""

from __future__ import annotations

import itertools
import warnings
from numbers import Integral

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, TensorDictBase
from torchrl.data import Composite, Unbounded
from torchrl.envs import Transform
from torchrl.modules.llm import Masks

from torchrl_grpo import _compat, ragged

#: Where the environment's reply to a turn is written (one 1-D tensor of token ids per row) and
#: where :class:`ExactTurns` reads it: the default of both ``reply_key`` arguments
#: (:class:`~torchrl_grpo.llm.ToolReply`'s too).
REPLY_KEY = "reply_tokens"

__all__ = ["ExactTurns"]

#: What :class:`ExactTurns` does with a dialog that grows past its ``max_length``.
ON_OVERFLOW = ("truncate", "raise")

#: The per-token entries of a stored turn and the part of the sequence each one covers.
_ENTRIES = {
    ("tokens", "full"): "full",
    ("tokens", "prompt"): "prompt",
    ("tokens", "response"): "response",
    ("masks", "all_attention_mask"): "full",
    ("masks", "all_assistant_mask"): "full",
    ("log_probs", "full"): "full",
    ("log_probs", "prompt"): "prompt",
    ("log_probs", "response"): "response",
}


class ExactTurns(Transform):
    """The dialog so far as the next prompt, exactly as sampled, for a tokens-mode ``ChatEnv``.

    Append it to the env after the transforms that write the environment's reply (at
    ``reply_key``) and that end dialogs (the reward's, ``StepCounter``): a dialog that ended
    is not checked against ``max_length``. At each step it makes the next
    ``("tokens", "prompt")`` the row's real tokens (the sampler's ``("tokens", "full")``
    without its padding) followed by the reply's tokens, writes that prompt's attention mask, and
    keeps the row's dialog id; at each reset it gives the reset rows new dialog ids. Inside a
    collector (``step_and_maybe_reset``) the stored turn's tokens, masks and log-probs are cut to
    its real tokens. See the module's docstring for what torchrl does without it.

    Args:
        pad_token_id: the id the sampler pads with (its tokenizer's ``pad_token_id``). It must
            not be a token a dialog holds: a pad id equal to the end-of-sequence id (some base
            models' tokenizers) would cut the end of every earlier turn out of the prompt.
        eos_token_id: the tokenizer's end-of-sequence id, checked against ``pad_token_id``.
        reply_key: where the environment's reply to the turn is read from the step's output: a
            1-D integer tensor of token ids per row (empty, or absent, for no reply).
        dialog_id_key: where the dialog id is written (``int64``, one per row).
        max_length: the most tokens a prompt may hold (the model's context less the tokens of
            an answer); what a dialog that goes on longer does is ``on_overflow``'s (one that
            ended is not checked: its next prompt is never read). ``None``: no bound. Sizing:
            ``prompt + (turns - 1) * (answer + reply)`` tokens at least, where ``reply`` is
            the longest of the tool's replies and of an error's (``ToolReply``'s
            ``max_error_tokens``, 32); see :doc:`tutorial_multiturn`.
        on_overflow: ``"truncate"`` (the default: a run of hours goes on) ends such a dialog
            after the turn that made it too long: ``("next", "truncated")`` and ``("next",
            "done")`` set, as ``StepCounter`` ends one, the turn's reward left as the reward
            transform wrote it (under ``MCAdvantage(trajectory_return="last")`` that is the
            dialog's return), counted in :attr:`overflows`, one warning the first time.
            ``"raise"``: ``ValueError`` naming the row, before anything is written.

    Attributes:
        overflows (int): the dialogs ended at ``max_length`` so far.

    Raises:
        ValueError: ``pad_token_id`` is ``None`` or equal to ``eos_token_id``, ``max_length`` is
            not a positive integer or ``None``, or ``on_overflow`` is neither ``"truncate"``
            nor ``"raise"``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from torchrl_grpo.llm import ExactTurns
        >>> turns = ExactTurns(pad_token_id=0, eos_token_id=1)
        >>> # a padded turn: the second answer is one token shorter, the sampler padded it
        >>> full = torch.tensor([[5, 6, 7, 1], [5, 8, 1, 0]])
        >>> turns.dialog_tokens(full, full != 0)
        [tensor([5, 6, 7, 1]), tensor([5, 8, 1])]
    """

    def __init__(
        self,
        pad_token_id: int | None,
        eos_token_id: int | None = None,
        *,
        reply_key=REPLY_KEY,
        dialog_id_key="dialog_id",
        max_length: int | None = None,
        on_overflow: str = "truncate",
    ):
        if pad_token_id is None:
            raise ValueError(
                "ExactTurns needs the sampler's pad_token_id: set the tokenizer's pad token "
                "(tokenizer.pad_token = ...) to a token that no dialog holds."
            )
        if eos_token_id is not None and int(pad_token_id) == int(eos_token_id):
            raise ValueError(
                f"ExactTurns: the pad token id ({pad_token_id}) is the end-of-sequence id: every "
                "earlier turn's end-of-sequence token would be taken for padding and cut out of "
                "the dialog. Give the tokenizer a pad token of its own (for example "
                "tokenizer.add_special_tokens({'pad_token': '<pad>'}) and resize the model's "
                "embeddings), as torchrl's wrappers also mask every pad id."
            )
        if max_length is not None and (
            isinstance(max_length, bool) or not isinstance(max_length, Integral) or max_length < 1
        ):
            raise ValueError(
                f"ExactTurns: max_length must be a positive integer or None, got {max_length!r}."
            )
        if on_overflow not in ON_OVERFLOW:
            raise ValueError(
                f"ExactTurns: on_overflow must be one of {ON_OVERFLOW}, got {on_overflow!r}."
            )
        _compat.check_post_step_mdp_hook()  # the stored turns are cut through it
        super().__init__(in_keys=[("tokens", "full")], out_keys=[("tokens", "prompt")])
        self.pad_token_id = int(pad_token_id)
        self.reply_key = reply_key
        self.dialog_id_key = dialog_id_key
        self.max_length = None if max_length is None else int(max_length)
        self.on_overflow = on_overflow
        self.overflows = 0
        self._ids = itertools.count()

    @staticmethod
    def dialog_tokens(full, mask) -> list[torch.Tensor]:
        """The real tokens of each row: ``full[b][mask[b]]``, for a padded ``[B, T]`` batch or
        lists of rows (one host read of the masks, a fixed number of operators)."""
        rows, masks = list(full), list(mask)
        return ragged.kept(rows, [m.astype(bool) for m in ragged.host_rows(masks)])

    # -- step -------------------------------------------------------------------------------

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        # ChatEnv stacks ("tokens", "full"): give it a padded copy of a ragged sampler's output
        # (torchrl's Transform.inv hands this method a copy of the step's input)
        rows = tensordict.get(("tokens", "full"), None, as_list=True)
        if isinstance(rows, list) and len({row.shape for row in rows}) > 1:
            padded = ragged.padded(rows, self.pad_token_id, side="right")
            tensordict.set(("tokens", "full"), padded)
        return tensordict

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase):
        rows = self._real_rows(tensordict, ("tokens", "full"))
        replies = _rows_of(next_tensordict, self.reply_key, len(rows))
        prompts = _joined(rows, replies)
        too_long = self._too_long(prompts, next_tensordict.get("done", None))
        if too_long:
            next_tensordict = self._overflow(next_tensordict, too_long, prompts)
        next_tensordict = _as_rows(next_tensordict)
        masks = _ones_like_rows(prompts)
        _set_rows(next_tensordict, ("tokens", "prompt"), prompts)
        _set_rows(next_tensordict, ("masks", "all_attention_mask"), masks)
        if self.reply_key in next_tensordict.keys(True, True):
            del next_tensordict[self.reply_key]
        dialog_id = tensordict.get(self.dialog_id_key, None)
        if dialog_id is not None:
            next_tensordict.set(self.dialog_id_key, dialog_id)
        return next_tensordict

    def _too_long(self, prompts: list[torch.Tensor], done) -> list[int]:
        """The rows whose dialog goes on with a next prompt over ``max_length`` (the lengths
        are shapes; the done flags are read on the host only if a prompt is too long)."""
        if self.max_length is None:
            return []
        too_long = [i for i, prompt in enumerate(prompts) if prompt.numel() > self.max_length]
        if too_long and done is not None:  # an ended dialog's next prompt is unused
            ended = done.reshape(len(prompts), -1).any(-1).tolist()
            too_long = [i for i in too_long if not ended[i]]
        return too_long

    def _overflow(self, next_tensordict, too_long: list[int], prompts) -> TensorDictBase:
        """End the dialogs of the rows ``too_long`` (``truncated`` and ``done``), or raise
        (``on_overflow="raise"``) before anything is written."""
        index, length = too_long[0], prompts[too_long[0]].numel()
        where = (
            f"the dialog of row {index} holds {length} tokens after this turn, more than "
            f"max_length={self.max_length} (the model's context less an answer's tokens)"
        )
        if self.on_overflow == "raise":
            raise ValueError(
                f"ExactTurns: {where}. End such dialogs sooner (StepCounter(max_steps=...)), "
                "shorten the replies, use a model with a longer context, or pass "
                'on_overflow="truncate" to end them there.'
            )
        if not self.overflows:
            warnings.warn(
                f"ExactTurns: {where}: it ends here, truncated (its reward is its last turn's). "
                "Later dialogs ended so are counted in ExactTurns.overflows without a warning. "
                "Size max_length as docs/tutorial_multiturn.rst says, or pass "
                'on_overflow="raise" to stop instead.',
                UserWarning,
                stacklevel=2,
            )
        self.overflows += len(too_long)
        done = next_tensordict.get("done", None)
        shape = (len(prompts), 1) if done is None else done.shape
        device = None if done is None else done.device
        ends = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        ends[too_long] = True
        ends = ends.reshape(shape)
        for key in ("truncated", "done"):
            flags = next_tensordict.get(key, None)
            next_tensordict.set(key, ends if flags is None else flags | ends)
        return next_tensordict

    def _real_rows(self, tensordict: TensorDictBase, key) -> list[torch.Tensor]:
        """Each row's real tokens of ``key``: where ``("masks", "all_attention_mask")`` says,
        else where they are not the pad id."""
        tokens = tensordict.get(key, as_list=True)
        masks = tensordict.get(("masks", "all_attention_mask"), None, as_list=True)
        if masks is None or any(m.shape != t.shape for m, t in zip(masks, tokens, strict=True)):
            keep = [row != self.pad_token_id for row in ragged.host_rows(tokens)]
            return ragged.kept(tokens, keep)
        return self.dialog_tokens(tokens, masks)

    # -- reset ------------------------------------------------------------------------------

    def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase):
        shape = tensordict_reset.batch_size
        reset = None if tensordict is None else tensordict.get("_reset", None)
        old = None if tensordict is None else tensordict.get(self.dialog_id_key, None)
        if reset is None or old is None:  # every row starts a dialog
            reset = torch.ones(shape, dtype=torch.bool)
            ids = torch.zeros(shape, dtype=torch.long)
        else:
            reset, ids = reset.reshape(shape), old.reshape(shape).clone()
        ids[reset] = torch.tensor(
            [next(self._ids) for _ in range(int(reset.sum()))], dtype=torch.long
        )
        tensordict_reset.set(self.dialog_id_key, ids)
        done = tensordict_reset.get("done", None)
        if done is not None and "truncated" not in tensordict_reset.keys():
            tensordict_reset.set("truncated", torch.zeros_like(done))  # declared: see below
        prompts = tensordict_reset.get(("tokens", "prompt"), None, as_list=True)
        if prompts is not None:  # a reset row's mask is its new prompt's, not the last turn's
            tensordict_reset = _as_rows(tensordict_reset)
            masks = _ones_like_rows(prompts)
            _set_rows(tensordict_reset, ("masks", "all_attention_mask"), masks)
        return tensordict_reset

    def transform_done_spec(self, done_spec: Composite) -> Composite:
        # a dialog ended at max_length is truncated: the entry exists without StepCounter too
        if "truncated" not in done_spec.keys() and "done" in done_spec.keys():
            done_spec["truncated"] = done_spec["done"].clone()
        return done_spec

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        # the prompt's mask is an observation: step_mdp then carries it to the next step in
        # place of the sampler's mask of its whole output
        masks = Masks.default_spec(shape=observation_spec.shape, keys=["all_attention_mask"])
        observation_spec["masks"] = masks.to(observation_spec.device)
        observation_spec[self.dialog_id_key] = Unbounded(
            shape=observation_spec.shape, dtype=torch.int64, device=observation_spec.device
        )
        return observation_spec

    # -- the stored turn --------------------------------------------------------------------

    def _post_step_mdp_hooks(self, tensordict: TensorDictBase, tensordict_: TensorDictBase):
        return self.exact_turn(tensordict), tensordict_

    def exact_turn(self, tensordict: TensorDictBase) -> TensorDictBase:
        """A sampled turn with its token sequences, masks and log-probs cut to its real tokens
        (a lazy stack of ragged rows); a turn without padding is returned as it is."""
        keeps = self._real_parts(tensordict)
        if keeps is None:
            return tensordict
        tensordict = _as_rows(tensordict)
        for key, part in _ENTRIES.items():
            rows = tensordict.get(key, None, as_list=True)
            keep = keeps[part]
            if rows is None or keep is None:
                continue
            if any(r.shape[:1] != k.shape for r, k in zip(rows, keep, strict=True)):
                continue  # not per token of that part: left as it is
            _set_rows(tensordict, key, ragged.kept(rows, keep))
        return tensordict

    def _real_parts(self, tensordict: TensorDictBase) -> dict | None:
        """Each part's (``full``, ``prompt``, ``response``) rows of tokens that are not the pad
        id, as host masks, read with one copy; ``None`` when the full rows hold no pad."""
        parts = {}
        for part in ("full", "prompt", "response"):
            rows = tensordict.get(("tokens", part), None, as_list=True)
            parts[part] = rows if isinstance(rows, list) else None
        if parts["full"] is None:
            return None
        found = [rows for rows in parts.values() if rows is not None]
        host = iter(ragged.host_rows([row for rows in found for row in rows]))
        keeps = {
            part: None if rows is None else [next(host) != self.pad_token_id for _ in rows]
            for part, rows in parts.items()
        }
        return keeps if any((~k).any() for k in keeps["full"]) else None


def _joined(rows: list[torch.Tensor], replies: list) -> list[torch.Tensor]:
    """Each row followed by its reply (``None`` or empty: the row alone), with a fixed number
    of operators: one concatenation of everything, one index, one split."""
    replies = [r if r is not None else rows[0].new_zeros(0) for r in replies]
    lengths = np.array([r.numel() for r in rows], dtype=np.int64)
    extra = np.array([r.numel() for r in replies], dtype=np.int64)
    if not extra.any():
        return list(rows)
    flat = torch.cat([*rows, *(r.to(rows[0].dtype) for r in replies)])
    row_at = np.cumsum(lengths) - lengths  # where each row starts in ``flat``
    reply_at = lengths.sum() + np.cumsum(extra) - extra
    starts = np.stack([row_at, reply_at], 1).reshape(-1)  # row 0, reply 0, row 1, ...
    sizes = np.stack([lengths, extra], 1).reshape(-1)
    before = np.cumsum(sizes) - sizes
    index = np.arange(int(sizes.sum())) + np.repeat(starts - before, sizes)
    return list(flat[ragged.upload(index, flat.device)].split((lengths + extra).tolist()))


def _ones_like_rows(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """A boolean row of ones as long as each row, two operators in all."""
    lengths = [int(r.shape[-1]) for r in rows]
    device = rows[0].device if rows else None
    return list(torch.ones(sum(lengths), dtype=torch.bool, device=device).split(lengths))


def _rows_of(tensordict: TensorDictBase, key, n: int) -> list[torch.Tensor | None]:
    if key not in tensordict.keys(True, True):
        return [None] * n
    rows = tensordict.get(key, as_list=True)
    return [
        row
        if row is None or (row.ndim == 1 and row.dtype == torch.long)
        else row.reshape(-1).long()
        for row in rows
    ]


def _as_rows(tensordict: TensorDictBase) -> TensorDictBase:
    """``tensordict`` as a lazy stack of its rows (where ragged entries fit)."""
    if isinstance(tensordict, LazyStackedTensorDict) and tensordict.stack_dim == 0:
        return tensordict
    return tensordict.to_lazystack(0)


def _set_rows(tensordict: LazyStackedTensorDict, key, rows: list[torch.Tensor]) -> None:
    """Set ``key`` row by row in a lazy stack of rows (the rows may differ in length)."""
    for row, value in zip(tensordict.tensordicts, rows, strict=True):
        row.set(key, value)
