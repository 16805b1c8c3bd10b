"""Where each stored entry of an LLM batch lies on the positions the wrapper scores.

torchrl's LLM stack stores a sequence's tokens, masks and log-probs either as rows of a lazy stack
(ragged, one row per sequence) or as rows of one tensor padded by the sampler; its wrappers score
``("tokens", "full")`` read left-padded, keeping every stored position (``pad_output=True``) or
only those their attention mask keeps (``pad_output=False``: the pads are dropped, the rest read
left-padded again). The loss reads every entry left-padded as well. Four things can then put a
value on another token than its own, and torchrl's ``GRPOLoss`` says nothing of any of them:

1. an entry whose row is not as long as its tokens (scored with ``pad_output=False`` on tokens
   stored with padding, which drops the pads): :func:`rows_on_tokens` puts it back, or raises;
2. a wrapper with ``pad_output=False`` on tokens stored with padding: its positions are the
   stored ones without the pads, so every stored entry is moved onto them (:func:`kept_positions`,
   :func:`relayout`);
3. torchrl's ``"sft"`` mask, which leaves out the first ``P`` columns (``P`` the widest prompt)
   and so, on ragged rows whose answers differ in length, counts the end of a shorter answer's
   prompt as answer: :func:`response_positions` gives each row's answer exactly;
4. pads inside a sequence (a multi-turn prompt built from padded output), which generation left
   out and scoring counts: :func:`check_no_inner_pads` raises, naming the cause.

Every function takes and returns ``(B, T)`` tensors in the *stored layout* (each stored row
left-padded to the batch's widest), unless it says otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase, unravel_key

from torchrl_grpo import ragged

__all__ = [
    "check_no_inner_pads",
    "inner_pads",
    "kept_index",
    "kept_mask",
    "kept_positions",
    "raise_inner_pads",
    "relayout",
    "response_positions",
    "rows_on_tokens",
]


def rows_on_tokens(tensordict: TensorDictBase, key, rows: list, plan: Any) -> list:
    """The ragged rows of a per-token entry, each as long as its row of tokens.

    The loss reads every ragged entry left-padded, so an entry's row lines up with its tokens
    only if both have the same length. Two ways a row can differ are read exactly:

    * longer than its tokens: it was computed on the row padded on the left (a wrapper with
      ``pad_output=True`` scoring a ragged batch); its last values are the tokens'.
    * shorter by exactly the row's pad tokens: it was computed with ``pad_output=False`` on
      tokens stored with padding (a sampler's padded output), which drops every pad; its values
      are put back on the tokens that are not padding (the pads are outside the loss's mask).

    Any other difference raises: reading it would shift the entry against its tokens. An entry
    of one value per row (a mask per sequence) is not per token and is returned as it is.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from types import SimpleNamespace
        >>> plan = SimpleNamespace(owner="GRPOLoss", pad_token_id=0,
        ...                        keys=SimpleNamespace(action=("tokens", "full")))
        >>> batch = lazy_stack([TensorDict({("tokens", "full"): torch.tensor([5, 6, 0])})])
        >>> rows_on_tokens(batch, "lp", [torch.tensor([-1.0, -2.0])], plan)  # the pad dropped
        [tensor([-1., -2.,  0.])]
    """
    tokens = tensordict.get(plan.keys.action, None, as_list=True)
    if tokens is None or len(tokens) != len(rows) or all(row.numel() == 1 for row in rows):
        return rows
    out = []
    for index, (row, row_tokens) in enumerate(zip(rows, tokens, strict=True)):
        length = row_tokens.shape[-1]
        if row.shape[0] == length:
            out.append(row)
        elif row.shape[0] > length:
            out.append(row[row.shape[0] - length :])
        else:
            real = None if plan.pad_token_id is None else row_tokens != plan.pad_token_id
            if real is None or int(real.sum()) != row.shape[0]:
                pads = "" if real is None else f", {length - int(real.sum())} of them pad tokens"
                raise ValueError(
                    f"{plan.owner}: row {index} of {key!r} has {row.shape[0]} values but its "
                    f"tokens {plan.keys.action!r} have {length}{pads}: the entry cannot be "
                    "lined up with its tokens, and reading it would shift every value against "
                    "its token. Store each sequence without padding (torchrl_grpo.llm."
                    "ExactTurns, or a sampler with pad_output=False) and score it again."
                )
            full = row.new_zeros(row_tokens.shape + row.shape[1:])
            full[real] = row
            out.append(full)
    return out


def check_no_inner_pads(tokens: torch.Tensor, plan: Any) -> None:
    """Raise if a sequence holds pad tokens between its real tokens.

    A multi-turn prompt made of a padded sampler output (torchrl's ``ChatEnv`` in tokens mode)
    keeps the padding of every earlier turn inside the sequence. Generation skipped it (its
    attention mask and position ids leave pads out); a scorer that counts them places every
    later token at another distance from the earlier ones, so the loss trains on other numbers
    than were sampled, while its own ratio still reads 1. Pads at either end are padding.

    Args:
        tokens: ``(B, T)`` token ids, left-padded with ``-100``.
        plan: the loss's read plan (``pad_token_id``, ``owner``, ``keys.action``).
    """
    inner = inner_pads(tokens, plan)
    if inner is not None and bool(inner.any()):
        raise_inner_pads(inner, plan)


def inner_pads(tokens: torch.Tensor, plan: Any) -> torch.Tensor | None:
    """``(B, T)`` bool: the pad tokens between real tokens (see :func:`check_no_inner_pads`),
    computed without a host read; ``None`` without a pad id."""
    if plan.pad_token_id is None or tokens.ndim != 2:
        return None
    pad = tokens == plan.pad_token_id
    real = ~pad & (tokens != -100)
    before = real.cumsum(1) > 0  # a real token at or before each position
    after = real.flip(1).cumsum(1).flip(1) > 0  # ... at or after
    return pad & before & after


def raise_inner_pads(inner: torch.Tensor, plan: Any) -> None:
    """The error of :func:`check_no_inner_pads`, for ``inner`` (:func:`inner_pads`) not all
    False."""
    row = int(inner.any(1).nonzero()[0])
    raise ValueError(
        f"{plan.owner}: row {row} of {plan.keys.action!r} holds {int(inner[row].sum())} pad "
        f"tokens (id {plan.pad_token_id}) between its real tokens: a multi-turn prompt built "
        "from a padded sampler output (torchrl's ChatEnv in tokens mode), or a tokenizer "
        "whose pad id is a real token (the end-of-sequence id). Generation left those pads "
        "out of the positions and the attention; scoring counts them, so the loss would "
        "train on other log-probs than were sampled. Build the dialogs with "
        "torchrl_grpo.llm.ExactTurns, and give the tokenizer a pad token of its own."
    )


def kept_positions(
    tensordict: TensorDictBase, tokens: torch.Tensor, plan: Any
) -> torch.Tensor | None:
    """Where a wrapper with ``pad_output=False`` reads each stored position.

    Such a wrapper drops the positions its attention mask leaves out (the stored
    ``("masks", "all_attention_mask")``, else the tokens that are not the pad id) and reads the
    rest left-padded. Returns ``(B, T')``: the stored column of each of its positions, ``-1``
    for its padding; ``None`` when it keeps every stored position (``pad_output=True``, or
    nothing to drop).

    Args:
        tokens: ``(B, T)`` the stored tokens, left-padded with ``-100``.
    """
    keep = kept_mask(tensordict, tokens, plan)
    if keep is None or bool((keep == (tokens != -100)).all()):
        return None
    return kept_index(keep)


def kept_mask(tensordict: TensorDictBase, tokens: torch.Tensor, plan: Any):
    """``(B, T)`` bool: the stored positions a wrapper with ``pad_output=False`` keeps (see
    :func:`kept_positions`), without a host read; ``None`` when it keeps every one."""
    if plan.pad_output or tokens.ndim != 2:
        return None
    present = tokens != -100
    if unravel_key(("masks", "all_attention_mask")) in tensordict.keys(True, True):
        rows = tensordict.get(("masks", "all_attention_mask"), as_list=True)
        if isinstance(rows, list):
            mask = ragged.padded(rows, False)
        else:
            mask = rows
        if mask.shape == tokens.shape:
            return present & mask.to(present.device).bool()
        return None
    if plan.pad_token_id is not None:
        return present & (tokens != plan.pad_token_id)
    return None


def kept_index(keep: torch.Tensor) -> torch.Tensor:
    """:func:`kept_positions`'s index from its mask ``keep`` ``(B, T)``."""
    counts = keep.sum(1)  # (B,)
    width = int(counts.max())
    rank = keep.cumsum(1) - 1  # (B, T) rank of each kept position among its row's
    column = width - counts[:, None] + rank  # (B, T) where it goes, right-aligned
    index = torch.full((keep.shape[0], width), -1, dtype=torch.long, device=keep.device)
    rows = torch.arange(keep.shape[0], device=keep.device)[:, None].expand_as(keep)
    positions = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
    index[rows[keep], column[keep]] = positions[keep]
    return index


def relayout(x: torch.Tensor | None, index: torch.Tensor | None, fill=0) -> torch.Tensor | None:
    """``x`` (``(B, T, ...)``, stored layout) on the positions of ``index``
    (:func:`kept_positions`), ``fill`` where ``index`` is ``-1``; an entry that is not per
    stored position (``(B, 1, 1)`` per sequence) is returned as it is.

    Examples:
        >>> import torch
        >>> relayout(torch.tensor([[1, 2, 3]]), torch.tensor([[-1, 0, 2]]), fill=-100)
        tensor([[-100,    1,    3]])
    """
    if x is None or index is None or x.ndim < 2 or x.shape[1] == 1 and index.shape[1] != 1:
        return x
    gather = index.clamp_min(0).to(x.device)
    gather = gather.reshape(gather.shape + (1,) * (x.ndim - 2)).expand(gather.shape + x.shape[2:])
    out = x.gather(1, gather)
    missing = (index < 0).to(x.device).reshape(index.shape + (1,) * (x.ndim - 2))
    return out.masked_fill(missing, fill)


def response_positions(
    tensordict: TensorDictBase, shape: torch.Size, plan: Any
) -> torch.Tensor | None:
    """``(B, T)`` bool in the stored layout: each row's answer, its last ``L - P`` positions
    (``L`` its stored tokens, ``P`` its stored prompt), for ``masking_strategy="sft"``; ``None``
    without ``("tokens", "prompt")`` (torchrl then reads the assistant mask) or another
    strategy.

    torchrl's ``"sft"`` mask leaves out the first ``P`` columns of the padded batch, ``P`` the
    widest prompt: right when every answer is as wide (a sampler's padded output), wrong on
    ragged rows whose answers differ in length (a shorter answer's row starts later, and the
    end of its prompt falls after column ``P``). The loss ands this mask with the wrapper's.
    """
    prompt_key = ("tokens", "prompt")
    if plan.masking_strategy != "sft" or unravel_key(prompt_key) not in tensordict.keys(True, True):
        return None
    full = tensordict.get(plan.keys.action, as_list=True)
    prompt = tensordict.get(prompt_key, as_list=True)
    lengths = [f.shape[-1] for f in full] if isinstance(full, list) else [full.shape[-1]] * shape[0]
    prompts = (
        [p.shape[-1] for p in prompt] if isinstance(prompt, list) else [prompt.shape[-1]] * shape[0]
    )
    answer = torch.tensor(lengths) - torch.tensor(prompts)  # (B,)
    return torch.arange(shape[1]) >= shape[1] - answer[:, None]
