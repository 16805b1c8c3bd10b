"""Shared-prefix scoring: a token prefix that several rows share goes through the model once.

GRPO scores the ``G`` completions of each prompt together, and an agent's turns each repeat the
dialog before them. Scored row by row, the model's body runs over every shared prompt ``G``
times, forward and backward. Here the rows of one scoring call are grouped by the longest token
prefix they share (found from the tokens: nothing is annotated); each group's prefix runs
through the model's body once, with its key/value cache; the group's suffixes run as one batch
against that cache (the cache indexed once per row, so that the gradient of every suffix
flows back into the prefix and the prefix's backward runs once). Rows that share less than
``min_shared`` tokens with any other row run as one ordinary batch.

The order of a call, as a record that computes nothing until :func:`shared_hidden` runs it:
:func:`prefix_plan` sorts the rows by their tokens, measures the common prefix of each
neighbour pair, cuts the sorted rows into runs whose neighbours share at least
``min_shared`` tokens (a run's prefix is the shortest shared length in it: one level, not a
tree), and buckets runs of equal prefix length so that their prefixes run as one batch.

Positions: the prefix holds positions ``0..P-1`` and each suffix ``P..``; suffixes are padded on
the right (a padding position attends to real tokens only, so no attention row is empty) and
the rows that share nothing are padded on the right too, with explicit position ids. For
rotary models (Qwen, Llama, Mistral) this is the dense left-padded pass up to float rounding.

Any Hugging Face decoder whose body takes ``past_key_values``, ``position_ids`` and
``use_cache`` and returns ``last_hidden_state`` and ``past_key_values`` (a ``Cache`` with
``reorder_cache``) works without edits. A model that does not raises :class:`SharingUnsupported`
and the caller scores densely.
"""

from __future__ import annotations

import inspect
import warnings
from collections import defaultdict
from dataclasses import dataclass
from numbers import Integral

import torch

__all__ = [
    "PrefixPlan",
    "PrefixSharing",
    "SharingUnsupported",
    "checked_min_shared",
    "prefix_plan",
    "shared_hidden",
]


class SharingUnsupported(RuntimeError):
    """The model's body cannot score suffixes against a cached prefix (the message says why)."""


def checked_min_shared(min_shared) -> int:
    """``min_shared`` as an ``int`` of at least 1, or a ``ValueError`` naming the value."""
    if isinstance(min_shared, bool) or not isinstance(min_shared, Integral) or min_shared < 1:
        raise ValueError(
            f"min_shared_length must be a positive integer (tokens a prefix must hold to be "
            f"computed once), got {min_shared!r}."
        )
    return int(min_shared)


@dataclass(frozen=True)
class PrefixPlan:
    """Which rows share which prefix: the record of one scoring call.

    Attributes:
        buckets (dict[int, list[tuple[int, ...]]]): prefix length ``P`` -> the groups of rows
            (each a tuple of row indices, two rows at least) whose first ``P`` tokens are equal.
        alone (list[int]): rows scored without sharing.
    """

    buckets: dict[int, list[tuple[int, ...]]]
    alone: list[int]

    @property
    def shared_tokens(self) -> int:
        """Token positions the plan does not compute again (prefix length x (rows - 1))."""
        return sum(p * (len(g) - 1) for p, groups in self.buckets.items() for g in groups)


def _common_length(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if len(differ) else n


def prefix_plan(sequences: list[torch.Tensor], min_shared: int) -> PrefixPlan:
    """Group rows by the token prefix they share (at least ``min_shared`` tokens).

    Args:
        sequences (list[torch.Tensor]): each row's real tokens ``[L_i]`` (no padding).
        min_shared (int): shortest prefix worth computing once.

    Returns:
        PrefixPlan: the groups, bucketed by prefix length, and the rows left alone.

    Examples:
        >>> import torch
        >>> from torchrl_grpo.llm.prefix import prefix_plan
        >>> rows = [torch.tensor(t) for t in ([1, 2, 3, 4], [9, 9], [1, 2, 3, 5, 6], [1, 2, 3])]
        >>> plan = prefix_plan(rows, min_shared=2)
        >>> plan.buckets, plan.alone
        ({3: [(3, 0, 2)]}, [1])
    """
    cpu = [s.detach().cpu() for s in sequences]
    order = sorted(range(len(cpu)), key=lambda i: cpu[i].tolist())
    buckets: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    alone: list[int] = []
    run, shared = [order[0]] if order else [], None
    for i in order[1:] + [None]:
        common = -1 if i is None else _common_length(cpu[run[-1]], cpu[i])
        if common >= min_shared:
            run.append(i)
            shared = common if shared is None else min(shared, common)
            continue
        if len(run) > 1:
            buckets[shared].append(tuple(run))
        else:
            alone.extend(run)
        run, shared = [i], None
    return PrefixPlan(dict(buckets), sorted(alone))


def _cache_keyword(body) -> str:
    """The body's name for the key/value cache: ``cache`` (transformers 5.2x) or
    ``past_key_values`` (earlier releases)."""
    try:
        params = inspect.signature(body.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _returned_cache(out):
    cache = getattr(out, "cache", None)
    return getattr(out, "past_key_values", None) if cache is None else cache


def _body_call(body, cache=None, **kwargs):
    if cache is not None:
        kwargs[_cache_keyword(body)] = cache
    try:
        return body(**kwargs)
    except (TypeError, ValueError, AttributeError, NotImplementedError) as err:
        raise SharingUnsupported(
            f"{type(body).__name__} cannot score suffixes against a cached prefix "
            f"({type(err).__name__}: {err})"
        ) from err


def _right_padded(rows: list[torch.Tensor], start: int):
    """``(ids [n, S], mask [n, S], positions [n, S])`` of rows padded on the right (with id 0,
    masked out)."""
    width = max(len(r) for r in rows)
    ids = rows[0].new_zeros((len(rows), width))
    mask = torch.zeros(len(rows), width, dtype=torch.long, device=ids.device)
    for k, r in enumerate(rows):
        ids[k, : len(r)] = r
        mask[k, : len(r)] = 1
    positions = torch.arange(width, device=ids.device).expand(len(rows), width) + start
    return ids, mask, positions


def _suffixes(body, sequences, groups, length, prefix_out):
    """Hidden states of each group row's suffix, scored against its group's cached prefix."""
    rows = [r for g in groups for r in g]
    owner = torch.tensor([k for k, g in enumerate(groups) for _ in g], device=sequences[0].device)
    tails = [sequences[r][length:] for r in rows]
    if max(len(t) for t in tails) == 0:  # every row is the prefix itself
        return rows, owner, [t.new_zeros(0) for t in tails], None
    cache = _returned_cache(prefix_out)
    if cache is None or not callable(getattr(cache, "reorder_cache", None)):
        raise SharingUnsupported(
            f"{type(body).__name__} returned no key/value cache with reorder_cache (got "
            f"{type(cache).__name__}; gradient checkpointing turns the cache off)"
        )
    cache.reorder_cache(owner)  # (groups, ...) -> (rows, ...): the prefix's gradients gather here
    ids, mask, positions = _right_padded(tails, length)  # a row that is the prefix: all padding
    attention = torch.cat([mask.new_ones(len(rows), length), mask], 1)  # (rows, P + S)
    out = _body_call(
        body,
        input_ids=ids,
        attention_mask=attention,
        position_ids=positions,
        cache=cache,
        use_cache=True,
    )
    return rows, owner, tails, out.last_hidden_state  # (rows, S, H)


def shared_hidden(body, sequences: list[torch.Tensor], plan: PrefixPlan) -> list[torch.Tensor]:
    """The body's last hidden states of each row, each shared prefix computed once.

    Args:
        body (torch.nn.Module): a Hugging Face decoder body (``model.base_model``).
        sequences (list[torch.Tensor]): each row's real tokens ``[L_i]``.
        plan (PrefixPlan): from :func:`prefix_plan`.

    Returns:
        list[torch.Tensor]: ``[L_i, H]`` per row, in the order of ``sequences``.

    Raises:
        SharingUnsupported: the body does not take a key/value cache this way.

    Examples:
        >>> import torch
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> from torchrl_grpo.llm.prefix import prefix_plan, shared_hidden
        >>> _ = torch.manual_seed(0)
        >>> body = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=16,
        ...     intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        ...     num_key_value_heads=2)).eval().base_model
        >>> prompt = torch.randint(50, (12,))
        >>> rows = [torch.cat([prompt, torch.randint(50, (n,))]) for n in (3, 5)]
        >>> hidden = shared_hidden(body, rows, prefix_plan(rows, min_shared=8))
        >>> dense = [body(input_ids=r[None]).last_hidden_state[0] for r in rows]
        >>> all(torch.allclose(h, d, atol=1e-5) for h, d in zip(hidden, dense))
        True
    """
    hidden: list[torch.Tensor | None] = [None] * len(sequences)
    for length, groups in plan.buckets.items():
        prefix = torch.stack([sequences[g[0]][:length] for g in groups])  # (groups, P)
        positions = torch.arange(length, device=prefix.device).expand_as(prefix)
        out = _body_call(body, input_ids=prefix, position_ids=positions, use_cache=True)
        head = out.last_hidden_state  # (groups, P, H)
        rows, owner, tails, tail_hidden = _suffixes(body, sequences, groups, length, out)
        for k, (r, t) in enumerate(zip(rows, tails)):
            own = head[owner[k]]
            hidden[r] = own if not len(t) else torch.cat([own, tail_hidden[k, : len(t)]])
    if plan.alone:
        ids, mask, positions = _right_padded([sequences[r] for r in plan.alone], 0)
        out = body(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        for k, r in enumerate(plan.alone):
            hidden[r] = out.last_hidden_state[k, : len(sequences[r])]
    return hidden


#: Largest relative difference (norm of the difference over the norm) between the shared and
#: the dense hidden states accepted by the first call's check, by the body's precision.
_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
_LOW_PRECISION_TOLERANCE = 3e-2


class PrefixSharing:
    """A wrapper's shared-prefix scoring: its switch, its threshold, and its first-call check.

    :meth:`hidden` returns each row's hidden states with the shared prefixes computed once, or
    ``None`` where the caller must score densely: sharing is off, no two rows share
    ``min_shared`` tokens, or the model cannot do it. The first call that shares checks two
    rows of its first group against the dense pass (no gradient); a body that cannot take a
    cache, or whose shared states differ from its dense ones, turns sharing off for good with
    one warning saying why, so that a wrong number is never returned.

    Args:
        enabled (bool): share prefixes at all.
        min_shared (int): shortest shared prefix (tokens) worth computing once.

    Raises:
        ValueError: ``min_shared`` is not a positive integer.

    Examples:
        >>> import torch
        >>> from torchrl_grpo.llm.prefix import PrefixSharing
        >>> sharing = PrefixSharing(True, 32)
        >>> sharing.plan([torch.arange(40), torch.arange(40)]).buckets
        {40: [(0, 1)]}
        >>> sharing.plan([torch.arange(10), torch.arange(10)]) is None  # shorter than 32
        True
        >>> PrefixSharing(True, 0)
        Traceback (most recent call last):
        ...
        ValueError: min_shared_length must be a positive integer ... got 0.
    """

    def __init__(self, enabled: bool, min_shared: int):
        self.enabled = bool(enabled)
        self.min_shared = checked_min_shared(min_shared)
        self.checked = False
        self.off_reason: str | None = None

    def plan(self, sequences: list[torch.Tensor]) -> PrefixPlan | None:
        """The rows' plan, or ``None`` when nothing is shared (or sharing is off)."""
        if not self.enabled or self.off_reason is not None or len(sequences) < 2:
            return None
        plan = prefix_plan(sequences, self.min_shared)
        return plan if plan.buckets else None

    def hidden(self, body, sequences: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Each row's last hidden states ``[L_i, H]``, or ``None``: score densely."""
        plan = self.plan(sequences)
        if plan is None:
            return None
        try:
            hidden = shared_hidden(body, sequences, plan)
        except SharingUnsupported as err:
            return self._turn_off(str(err))
        if not self.checked:
            error = _shared_error(body, sequences, plan, hidden)
            tolerance = _CHECK_TOLERANCE.get(hidden[0].dtype, _LOW_PRECISION_TOLERANCE)
            if error > tolerance:
                return self._turn_off(
                    f"its shared-prefix hidden states differ from the dense pass by {error:.2e} "
                    f"(relative; at most {tolerance:.0e} accepted; a model in training mode "
                    "with dropout differs on every pass: score in eval mode)"
                )
            self.checked = True
        return hidden

    def _turn_off(self, why: str) -> None:
        self.off_reason = why
        warnings.warn(
            f"Shared-prefix scoring is off for this wrapper: {why}. Every row is scored densely "
            "from now on (same numbers, more compute); pass share_prefix=False to silence this.",
            stacklevel=4,
        )
        return None


def _shared_error(body, sequences, plan, hidden) -> float:
    """Relative difference of the shared states of two rows of the first group from the dense."""
    rows = next(iter(plan.buckets.values()))[0][:2]
    worst = 0.0
    with torch.no_grad():
        for r in rows:
            dense = body(input_ids=sequences[r][None], use_cache=False).last_hidden_state[0]
            diff = (hidden[r].detach().float() - dense.float()).norm()
            worst = max(worst, float(diff / dense.float().norm().clamp_min(1e-12)))
    return worst
