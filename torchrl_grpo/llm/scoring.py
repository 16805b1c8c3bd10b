"""One scoring call of :class:`~torchrl_grpo.LeanTransformersWrapper` on token rows, read once.

torchrl's ``TransformersWrapper`` pads its ragged input and unpads its outputs row by row (a few
operators per row each time, and a host read of the row lengths). Here a call's token rows
(and their attention masks, and the prompts where the wrapper scores the response only) are
read on the host with **one copy**, and everything that depends on them (each row's length and
attended tokens, which rows share a prefix, where a log-prob is read, where each output row
lies) is decided there; the device runs a fixed number of operators whatever the number of
rows: one concatenation, one index to pad, one index to read each output back.

:func:`read_token_rows` returns ``None`` for input this path does not take (rows that are not
one-dimensional, masks not as long as their rows): the wrapper then runs torchrl's own code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, MetaData, TensorDict, TensorDictBase
from torchrl.modules.llm import LogProbs, Masks, Text, Tokens

from torchrl_grpo import ragged

__all__ = [
    "TokenRows",
    "attended_index",
    "compact_index",
    "dist_mask",
    "read_index",
    "read_token_rows",
    "response_starts",
    "token_rows",
    "unpadded",
    "write_outputs",
]


@dataclass(frozen=True)
class TokenRows:
    """A call's token rows: padded on the device, described on the host.

    Attributes:
        tokens (torch.Tensor): ``[B, T]`` left-padded with the pad id.
        attention (torch.Tensor): ``[B, T]`` bool, left-padded with ``False``.
        stored (list[torch.Tensor] | None): the rows as given, if ragged (``None``: given as
            one ``[B, T]`` tensor, :attr:`tokens`).
        lengths (numpy.ndarray): ``[B]`` stored length of each row.
        counts (numpy.ndarray): ``[B]`` attended tokens of each row.
        blocks (bool): every row's attended tokens are one block at its right end (so that
            dropping the unattended ones keeps every row right-aligned).
        real (list[numpy.ndarray]): each row's attended tokens, on the host.
        prompts (numpy.ndarray | None): ``[B]`` the prompt length of each row whose stored
            prompt starts its tokens; ``None`` when any does not (or none was read).
        attended (numpy.ndarray): ``[B, T]`` bool, ``attention`` on the host.
    """

    tokens: torch.Tensor
    attention: torch.Tensor
    stored: list | None
    lengths: np.ndarray
    counts: np.ndarray
    blocks: bool
    real: list
    prompts: np.ndarray | None
    attended: np.ndarray

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])


def read_token_rows(
    td: TensorDictBase, input_key, mask_keys, pad_val, prompt_key=None
) -> TokenRows | None:
    """Read the rows of ``input_key`` (the first of ``mask_keys`` present as their masks, and
    with ``prompt_key`` the stored prompts) with one copy to the host: ragged rows of a lazy
    stack, or one dense ``[B, T]`` tensor as stored (never unbound into rows).

    Returns ``None`` where torchrl's own path must run: the rows are not one-dimensional, a
    mask is not as long as its row, or there is no row.
    """
    dense = not isinstance(td, LazyStackedTensorDict)
    get = td.get if dense else functools.partial(td.get, as_list=True)
    rows = get(input_key, None)
    if rows is None or not _rows_of_tokens(rows, dense) or not len(rows):
        return None
    masks = None
    for key in mask_keys:
        masks = get(key, None)
        if masks is not None:
            break
    if masks is not None and _shapes(masks, dense) != _shapes(rows, dense):
        return None
    prompts = None if prompt_key is None else get(prompt_key, None)
    if prompts is not None and not _rows_of_tokens(prompts, dense):
        prompts = None
    return token_rows(rows, masks, pad_val, prompts)


def _rows_of_tokens(rows, dense: bool) -> bool:
    """One-dimensional rows: a ``[B, L]`` tensor, or a list of ``[L_i]`` tensors."""
    if dense:
        return isinstance(rows, torch.Tensor) and rows.ndim == 2
    return isinstance(rows, list) and all(r.ndim == 1 for r in rows)


def _shapes(rows, dense: bool):
    if dense:
        return tuple(rows.shape) if isinstance(rows, torch.Tensor) else None
    return [r.shape for r in rows] if isinstance(rows, list) else None


def token_rows(rows, masks=None, pad_val=None, prompts=None) -> TokenRows:
    """:class:`TokenRows` of 1-D rows (their masks, if any; prompts, if any), one host copy.

    ``rows``, ``masks`` and ``prompts`` are lists of ragged rows, or each one ``[B, L]``
    tensor of rows of one length.

    Raises:
        ValueError: the rows lie on several devices, or the padding their masks leave out
            holds several token ids (rows padded by different tokenizers: without a mask the
            scorer would take another tokenizer's pad id for a token).
    """
    dense = isinstance(rows, torch.Tensor)
    if not dense and len({r.device for r in rows}) > 1:
        raise ValueError(
            f"The rows of one scoring call lie on several devices "
            f"({sorted({str(r.device) for r in rows})}): move the batch to one device first."
        )
    flat = (lambda x: x.reshape(-1)) if dense else torch.cat
    parts = [flat(rows).long()]
    if masks is not None:
        parts.append(flat(masks).to(parts[0].device).long())
    if prompts is not None:
        parts.append(flat(prompts).to(parts[0].device).long())
    host = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy()
    if dense:
        lengths = np.full(rows.shape[0], rows.shape[1], dtype=np.int64)
    else:
        lengths = np.array([r.shape[0] for r in rows], dtype=np.int64)
    n, cuts = int(lengths.sum()), np.cumsum(lengths)[:-1]
    values = np.split(host[:n], cuts)
    if masks is None:
        seen = [row != pad_val for row in values]
    else:
        seen = [m.astype(bool) for m in np.split(host[n : 2 * n], cuts)]
        _check_one_pad_id(host[:n], host[n : 2 * n])
    tokens = rows if dense else ragged.padded(rows, pad_val)
    if masks is None:
        attention = tokens != pad_val
    elif dense:
        attention = masks.bool()
    else:
        attention = ragged.padded(masks, False, width=tokens.shape[1]).bool()
    width = tokens.shape[1]
    attended = np.zeros((len(rows), width), dtype=bool)
    for b, m in enumerate(seen):
        attended[b, width - len(m) :] = m
    counts = attended.sum(1)
    start = n if masks is None else 2 * n
    return TokenRows(
        tokens=tokens,
        attention=attention,
        stored=None if dense else rows,
        lengths=lengths,
        counts=counts,
        blocks=bool((attended == (np.arange(width) >= width - counts[:, None])).all()),
        real=[row[m] for row, m in zip(values, seen, strict=True)],
        prompts=_prompt_lengths(prompts, host, start, values),
        attended=attended,
    )


def _check_one_pad_id(tokens: np.ndarray, mask: np.ndarray) -> None:
    """The tokens the masks leave out (the rows' padding) hold one id, or a ValueError."""
    pads = np.unique(tokens[mask == 0])
    if len(pads) > 1:
        raise ValueError(
            f"The rows of one scoring call are padded with different token ids "
            f"({pads.tolist()[:8]}): a batch that mixes the outputs of several tokenizers. "
            "Score each tokenizer's rows with a wrapper of that tokenizer."
        )


def _prompt_lengths(prompts, host, start, values) -> np.ndarray | None:
    """Each row's prompt length, if every stored prompt is the start of its row's tokens."""
    if prompts is None or len(prompts) != len(values):
        return None
    if isinstance(prompts, torch.Tensor):  # one [B, P] tensor
        lengths = np.full(prompts.shape[0], prompts.shape[-1], dtype=np.int64)
    else:
        lengths = np.array([p.shape[-1] for p in prompts], dtype=np.int64)
    found = np.split(host[start : start + int(lengths.sum())], np.cumsum(lengths)[:-1])
    for prompt, row in zip(found, values, strict=True):
        if len(prompt) > len(row) or not np.array_equal(row[: len(prompt)], prompt):
            return None
    return lengths


def attended_index(rows: TokenRows) -> np.ndarray:
    """Flat ``[B * T]`` positions of the attended tokens, row after row."""
    return np.flatnonzero(rows.attended)


def response_starts(rows: TokenRows) -> np.ndarray | None:
    """``[B]`` the first column (of the ``[B, T]`` layout) of each row's response, or ``None``
    without prompt lengths."""
    if rows.prompts is None:
        return None
    return rows.width - (rows.lengths - rows.prompts)


def read_index(rows: TokenRows, from_column: np.ndarray | None = None) -> np.ndarray:
    """Flat ``[B * T]`` positions whose log-prob is computed: attended, not a row's first
    attended token (log-prob ``0``, as torchrl's), and from ``from_column`` on if given."""
    attended = rows.attended
    first = attended.argmax(1)  # (B,) each row's first attended column
    kept = attended.copy()
    kept[np.arange(len(first)), first] = False
    if from_column is not None:
        kept &= np.arange(rows.width) >= np.asarray(from_column)[:, None]
    return np.flatnonzero(kept)


def unpadded(x: torch.Tensor, rows: TokenRows) -> list[torch.Tensor]:
    """The attended positions of each row of ``x`` (``[B, T, ...]``), one tensor per row:
    torchrl's ``_unpad_tensors``, with three operators whatever the number of rows."""
    index = ragged.upload(attended_index(rows), x.device)
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])[index]
    return list(flat.split(rows.counts.tolist()))


def write_outputs(out, td, rows: TokenRows, log_probs, logits, keys, pad_output: bool):
    """torchrl's output entries of a tokens call (``_from_transformers_logprobs_tokens``):
    text (empty), tokens, masks and log-probs, and ``"logits"`` (here the shifted hidden
    states) when given; unpadded rows when ``pad_output`` is ``False``. A row whose every
    stored token is attended is written as the stored tensor itself. ``out``: torchrl's lazy
    stack of rows, or a ``TensorDict`` (dense entries, for rows of one length that are
    written whole or padded)."""
    text_key, tokens_key, masks_key, log_probs_key = keys
    dense = not isinstance(out, LazyStackedTensorDict)

    def container(cls):
        empty = TensorDict(batch_size=out.batch_size)
        return cls._from_tensordict(empty if dense else empty.to_lazystack(0))

    text = container(Text)
    text.prompt = text.response = text.full = None
    out.set(text_key, text)
    whole = bool((rows.counts == rows.lengths).all())  # nothing to drop from a stored row
    tokens = container(Tokens)
    if pad_output or (dense and whole):
        tokens.full = rows.tokens
    else:
        stored = rows.stored if rows.stored is not None else list(rows.tokens.unbind(0))
        tokens.full = list(stored) if whole else unpadded(rows.tokens, rows)
    tokens.response = None
    tokens.padded = MetaData(pad_output)
    out.set(tokens_key, tokens)
    masks = container(Masks)
    if pad_output:
        masks.all_attention_mask = rows.attention
        assistant = td.get(("masks", "all_assistant_mask"), None, as_list=True)
        if isinstance(assistant, list):  # ragged rows: padded as the tokens (torchrl stacks)
            assistant = ragged.padded(assistant, False, width=rows.width)
        masks.all_assistant_mask = assistant
    elif dense:  # every row whole and of one length
        masks.all_attention_mask = rows.attention
        masks.all_assistant_mask = td.get(("masks", "all_assistant_mask"), None)
    else:
        ones = torch.ones(int(rows.counts.sum()), dtype=torch.bool, device=rows.tokens.device)
        masks.all_attention_mask = list(ones.split(rows.counts.tolist()))
        masks.all_assistant_mask = td.get(("masks", "all_assistant_mask"), None, as_list=True)
    masks.padded = MetaData(pad_output)
    out.set(masks_key, masks)
    if log_probs is not None:
        found = container(LogProbs)
        found.full = log_probs if pad_output or dense else unpadded(log_probs, rows)
        found.response = None
        found.padded = MetaData(pad_output)
        out.set(log_probs_key, found)
    if logits is not None:
        out.set("logits", logits if pad_output or dense else unpadded(logits, rows))
    return out


def dist_mask(rows: TokenRows, strategy: str, pad_output: bool, prompt_lengths=None):
    """torchrl's masks of the masked distributions (``LLMWrapperBase._get_dist_with_*``) on
    the host: ``(mask [B, C], first column)``; the distribution's columns are those of
    ``[B, T]`` from ``first column`` on when ``pad_output`` or the rows are
    :attr:`~TokenRows.blocks`, else each row's attended columns (:func:`compact_index`).

    With ``pad_output=False`` torchrl's distribution covers each row's attended tokens
    (its unpadded output) left-padded to the longest, ``C = max`` of the attended counts;
    with ``pad_output=True`` the whole ``[B, T]``. ``strategy``:

    * ``"attention"``: the attended tokens.
    * ``"prompt"`` (``"sft"``): without each row's first ``P_i`` tokens (its stored prompt's
      length, ``prompt_lengths``); with ``pad_output=True``, torchrl's rule: without the first
      ``max P_i`` columns, which on rows whose answers differ in length counts a shorter
      answer's prompt end as answer (the loss corrects it).
    """
    columns = np.arange(rows.width)
    if pad_output:
        if strategy == "attention":
            return rows.attended, 0
        prompt_lengths = np.asarray(prompt_lengths, dtype=np.int64)
        return rows.attended & (columns >= int(prompt_lengths.max(initial=0))), 0
    first = rows.width - int(rows.counts.max())
    starts = rows.width - rows.counts  # (B,) each row's first attended column
    if strategy == "prompt":
        starts = starts + np.asarray(prompt_lengths, dtype=np.int64)
    return (columns[first:] >= starts[:, None]), first


def compact_index(rows: TokenRows) -> np.ndarray:
    """``[B, C]`` the flat ``[B * T]`` position of each row's attended tokens, left-padded to
    ``C`` (the most attended tokens) with ``B * T`` (a zero slot): torchrl's unpadded rows
    padded again."""
    width = int(rows.counts.max())
    out = np.full(len(rows.counts) * width, rows.attended.size, dtype=np.int64)
    out[ragged.padded_index(rows.counts, width)] = np.flatnonzero(rows.attended)
    return out.reshape(len(rows.counts), width)
