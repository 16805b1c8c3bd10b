"""Shared-prefix scoring: every token that several rows share goes through the model once.

GRPO scores the ``G`` completions of each prompt together, and an agent's turns each repeat the
dialog before them. Scored row by row, the model's body runs over every shared prompt ``G``
times, forward and backward. Here the rows of one scoring call are put in a prefix tree (a
trie whose edges are token runs, found from the tokens: nothing is annotated) and the tree's
tokens run through the body **once, in one pass**, as verl's PrefixGrouper and AReaL's tree
training do: each node's tokens follow its parent's in one packed sequence, each token attends
to its ancestors' tokens and causally to its own node's (a block attention mask), and its
position id is its depth in the tree (the position it holds in each of its rows). A row's
hidden states are then read from the packed ones along its path, with one index.

The order of a call, as a record that computes nothing until :func:`shared_hidden` runs it:
:func:`prefix_plan` sorts the rows by their tokens, measures the common prefix of each
neighbour pair, cuts the sorted rows into trees whose neighbours share at least
``min_shared_length`` tokens (a row that shares less with both neighbours is a tree of its own),
builds each tree's nodes (a dialog's turns share all of the history they have in common: every
level, not one), and packs the trees into rows of one batch. Everything is decided on the host
from one copy of the tokens; the device runs a fixed number of operators whatever the number of
rows or groups.

Exactness: a packed token sees the same keys at the same positions as in its own row, so for
rotary models (Qwen, Llama, Mistral) the hidden states are the dense pass's up to float
rounding; the gradient of every row flows into the shared tokens through the reading index.
Sliding-window layers get the window on the positions. The mask is built in the form the
model's attention implementation takes (``sdpa``: boolean, ``eager``: additive,
``flex_attention``: a ``BlockMask``); an implementation that takes no custom mask (flash
attention), or a body that refuses one, raises :class:`SharingUnsupported` and the caller scores
densely, with one warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from numbers import Integral

import numpy as np
import torch

from torchrl_grpo import _compat
from torchrl_grpo.ragged import upload

__all__ = [
    "PrefixPlan",
    "PrefixSharing",
    "SharingUnsupported",
    "checked_min_shared_length",
    "prefix_plan",
    "shared_hidden",
]


class SharingUnsupported(RuntimeError):
    """The model's body cannot score a packed prefix tree (the message says why)."""


def _renamed(min_shared_length, deprecated: dict, owner: str):
    """``min_shared_length``, or the value given under its earlier name ``min_shared`` (with a
    ``DeprecationWarning``); any other keyword is refused."""
    unknown = sorted(set(deprecated) - {"min_shared"})
    if unknown:
        raise TypeError(f"{owner} got unexpected keyword arguments {unknown}.")
    if "min_shared" in deprecated:
        if min_shared_length is not None:
            raise TypeError(f"{owner} got both min_shared_length and min_shared (its old name).")
        warnings.warn(
            f"{owner}: min_shared is deprecated, use min_shared_length (the same setting).",
            DeprecationWarning,
            stacklevel=3,
        )
        min_shared_length = deprecated["min_shared"]
    return min_shared_length


def checked_min_shared_length(min_shared_length) -> int:
    """``min_shared_length`` as an ``int`` of at least 1, or a ``ValueError`` naming the value."""
    if (
        isinstance(min_shared_length, bool)
        or not isinstance(min_shared_length, Integral)
        or min_shared_length < 1
    ):
        raise ValueError(
            f"min_shared_length must be a positive integer (tokens a prefix must hold to be "
            f"computed once), got {min_shared_length!r}."
        )
    return int(min_shared_length)


@dataclass(frozen=True)
class PrefixPlan:
    """The prefix tree of one scoring call and its packing: host arrays, nothing computed.

    Node ``n`` holds tokens ``depth[parent[n]]..depth[n]`` of the rows below it; rows that end
    at the same node are equal. Segment ``S`` (the last) is padding.

    Attributes:
        tokens (numpy.ndarray): ``[R, W]`` the packed token ids (``0`` at padding).
        positions (numpy.ndarray): ``[R, W]`` each packed token's position (its depth).
        segments (numpy.ndarray): ``[R, W]`` the node of each packed token (``S``: padding).
        ancestors (numpy.ndarray): ``[S + 1, S + 1]`` bool, ``[s, t]`` true when ``t`` is
            ``s`` or one of its ancestors (padding sees padding only).
        reads (numpy.ndarray): ``[B, T]`` for each row, left-padded to ``T``, the flat packed
            slot (``r * W + w``) of each of its tokens; ``R * W`` (a zero slot) at padding.
        trees (list[tuple[int, ...]]): the rows of each tree of two rows or more.
        alone (list[int]): the rows that share nothing.
        shared_tokens (int): token positions not computed again.
    """

    tokens: np.ndarray
    positions: np.ndarray
    segments: np.ndarray
    ancestors: np.ndarray
    reads: np.ndarray
    trees: list
    alone: list
    shared_tokens: int


def _common_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _tree_nodes(rows, order, common):
    """Nodes of one tree (rows ``order`` sorted, ``common[k]`` shared by ``order[k-1:k+1]``):
    ``(parent, depth, source row)`` each, and the node each row ends at. Node 0 is the root."""
    parent, depth, source = [-1], [0], [order[0]]
    end = {}
    stack = [0]  # the path from the root to the last row's node

    def add(up: int, at: int, row: int) -> int:
        parent.append(up)
        depth.append(at)
        source.append(row)
        return len(parent) - 1

    for k, row in enumerate(order):
        shared = 0 if k == 0 else common[k]
        last = None
        while depth[stack[-1]] > shared:
            last = stack.pop()
        if depth[stack[-1]] < shared:  # the branch point: a new node between top and last
            parent[last] = add(stack[-1], shared, row)
            stack.append(parent[last])
        if len(rows[row]) > depth[stack[-1]]:
            stack.append(add(stack[-1], len(rows[row]), row))
        end[row] = stack[-1]
    return parent, depth, source, end


def _trees(rows, min_shared_length: int):
    """The rows sorted by their tokens, cut where neighbours share under ``min_shared_length``."""
    order = sorted(range(len(rows)), key=lambda i: rows[i].tolist())
    common = [0] + [_common_length(rows[a], rows[b]) for a, b in zip(order, order[1:])]
    trees, start = [], 0
    for k in range(1, len(order) + 1):
        if k == len(order) or common[k] < min_shared_length:
            trees.append((order[start:k], [0] + common[start + 1 : k]))
            start = k
    return trees


def _pack(sizes: list[int]) -> tuple[list[int], list[int], int]:
    """First-fit decreasing of the trees (``sizes`` tokens each) into rows as wide as the
    largest: ``(packed row, offset)`` of each tree and the width."""
    width = max(sizes)
    used: list[int] = []
    row, offset = [0] * len(sizes), [0] * len(sizes)
    for t in sorted(range(len(sizes)), key=lambda t: -sizes[t]):
        fit = next((r for r, u in enumerate(used) if u + sizes[t] <= width), len(used))
        if fit == len(used):
            used.append(0)
        row[t], offset[t] = fit, used[fit]
        used[fit] += sizes[t]
    return row, offset, width


def prefix_plan(
    sequences, min_shared_length: int | None = None, width: int | None = None, **deprecated
) -> PrefixPlan:
    """The prefix tree of the rows (prefixes of at least ``min_shared_length`` tokens), packed.

    Args:
        sequences (list): each row's real tokens ``[L_i]`` (no padding), host arrays or
            tensors (read on the host).
        min_shared_length (int): shortest prefix worth computing once.
        width (int, optional): ``T`` of :attr:`PrefixPlan.reads`. Defaults to the longest row.

    Returns:
        PrefixPlan: the tree, its packing, and where each row reads its states.

    Examples:
        >>> import numpy as np
        >>> from torchrl_grpo.llm.prefix import prefix_plan
        >>> rows = [np.array(t) for t in ([1, 2, 3, 4], [9, 9], [1, 2, 3, 5, 6], [1, 2, 3])]
        >>> plan = prefix_plan(rows, min_shared_length=2)
        >>> plan.trees, plan.alone, plan.shared_tokens
        ([(3, 0, 2)], [1], 6)
        >>> plan.tokens.tolist()  # [1, 2, 3] once, then 4 and 5 6 after it; 9 9 beside
        [[1, 2, 3, 4, 5, 6], [9, 9, 0, 0, 0, 0]]
        >>> plan.positions[0].tolist()
        [0, 1, 2, 3, 3, 4]
    """
    min_shared_length = checked_min_shared_length(
        _renamed(min_shared_length, deprecated, "prefix_plan")
    )
    rows = [np.asarray(s.detach().cpu() if isinstance(s, torch.Tensor) else s) for s in sequences]
    width = max(len(r) for r in rows) if width is None else int(width)
    trees = _trees(rows, min_shared_length)
    built = [_tree_nodes(rows, order, common) for order, common in trees]
    sizes = [
        sum(d - depth[p] for p, d in zip(parent[1:], depth[1:])) for parent, depth, *_ in built
    ]
    packed_row, offset, packed_width = _pack([max(1, size) for size in sizes])
    tokens = np.zeros((max(packed_row) + 1, packed_width), dtype=np.int64)
    positions = np.zeros_like(tokens)
    segments = np.full_like(tokens, sum(len(parent) - 1 for parent, *_ in built))
    parents, slots = [], []  # per node: its parent (-1: a tree's top), its packed slots
    ids = []  # per tree: local node -> global node (a node's parent numbered before it)
    for t, (parent, depth, source, _) in enumerate(built):
        at, ids_t = offset[t], {0: -1}
        for n in sorted(range(1, len(parent)), key=lambda n: depth[parent[n]]):
            start, stop = depth[parent[n]], depth[n]
            where = (packed_row[t], slice(at, at + stop - start))
            tokens[where] = rows[source[n]][start:stop]
            positions[where] = np.arange(start, stop)
            ids_t[n] = len(parents)
            segments[where] = len(parents)
            parents.append(ids_t[parent[n]])
            slots.append(packed_row[t] * packed_width + np.arange(at, at + stop - start))
            at += stop - start
        ids.append(ids_t)
    reads = np.full((len(rows), width), tokens.size, dtype=np.int64)  # the zero slot
    for (_, _, _, end), (order, _), ids_t in zip(built, trees, ids, strict=True):
        for row in order:
            path = _path(parents, ids_t[end[row]])
            flat = np.concatenate([slots[n] for n in path] or [np.zeros(0, dtype=np.int64)])
            reads[row, width - len(flat) :] = flat
    return PrefixPlan(
        tokens=tokens,
        positions=positions,
        segments=segments,
        ancestors=_ancestors(parents),
        reads=reads,
        trees=[tuple(order) for order, _ in trees if len(order) > 1],
        alone=sorted(order[0] for order, _ in trees if len(order) == 1),
        shared_tokens=sum(len(r) for r in rows) - sum(sizes),
    )


def _path(parents: list[int], node: int) -> list[int]:
    """The nodes from a tree's top down to ``node`` (none for ``-1``)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _ancestors(parents: list[int]) -> np.ndarray:
    """``[S + 1, S + 1]``: ``[s, t]`` when ``t`` is ``s`` or its ancestor; ``S`` is padding."""
    size = len(parents) + 1
    out = np.eye(size, dtype=bool)
    for s, p in enumerate(parents):  # parents come before their children
        if p >= 0:
            out[s] |= out[p]
    return out


def _masks(body, plan_tensors, window_needed: bool):
    """The packed block mask in the form the body's attention takes: ``[R, 1, W, W]``, or one
    per layer type when sliding-window layers need their window on the positions."""
    _, positions, segments, ancestors = plan_tensors
    width = segments.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=segments.device).tril()
    seen = ancestors[segments[:, :, None], segments[:, None, :]] & causal  # (R, W, W)
    config = getattr(body, "config", None)
    kind = _compat.attention_implementation(body)
    types = set(getattr(config, "layer_types", None) or ())
    window = getattr(config, "sliding_window", None)
    if not types:  # one kind for every layer (Mistral: a window when the config has one)
        types = {"sliding_attention" if window else "full_attention"}
    unknown = types - {"full_attention", "sliding_attention"}
    if unknown:
        raise SharingUnsupported(f"its layers of type {sorted(unknown)} take no packed mask")
    masks = {}
    for kind_of_layer in types:
        mask = seen
        if kind_of_layer == "sliding_attention" and window_needed:
            mask = seen & (positions[:, :, None] - positions[:, None, :] < window)
        masks[kind_of_layer] = _as_attention_mask(mask, kind, body)
    if len(masks) == 1 or len({id(m) for m in masks.values()}) == 1:
        return next(iter(masks.values()))
    return masks


def _as_attention_mask(mask: torch.Tensor, kind: str | None, body):
    """A boolean ``[R, W, W]`` mask as ``kind`` of attention takes it."""
    if kind in (None, "sdpa"):
        return mask[:, None]
    if kind == "eager":
        dtype = next(body.parameters()).dtype
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return bias.masked_fill(~mask, torch.finfo(dtype).min)[:, None]
    if kind == "flex_attention":
        return _compat.block_mask(mask)
    raise SharingUnsupported(
        f"its attention implementation {kind!r} takes no custom attention mask (sdpa, eager "
        "and flex_attention do)"
    )


def _body_call(body, **kwargs):
    try:
        return body(**kwargs)
    except (TypeError, ValueError, AttributeError, NotImplementedError, IndexError) as err:
        raise SharingUnsupported(
            f"{type(body).__name__} cannot score a packed prefix tree ({type(err).__name__}: {err})"
        ) from err


def shared_hidden(body, plan: PrefixPlan) -> torch.Tensor:
    """The body's last hidden states of each row, every shared token computed once.

    One pass of the body over the packed tree (:class:`PrefixPlan`), then one index: a fixed
    number of operators whatever the number of rows.

    Args:
        body (torch.nn.Module): a Hugging Face decoder body (``model.base_model``).
        plan (PrefixPlan): from :func:`prefix_plan`.

    Returns:
        torch.Tensor: ``[B, T, H]``, each row left-padded to ``T`` with zeros.

    Raises:
        SharingUnsupported: the body cannot take the packed mask (the message says why).

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
        >>> hidden = shared_hidden(body, prefix_plan(rows, min_shared_length=8))  # (2, 17, 16)
        >>> dense = [body(input_ids=r[None]).last_hidden_state[0] for r in rows]
        >>> all(torch.allclose(hidden[i, -len(r):], d, atol=1e-5)
        ...     for i, (r, d) in enumerate(zip(rows, dense)))
        True
    """
    device = next(body.parameters()).device
    packed = upload(np.stack([plan.tokens, plan.positions, plan.segments]), device)
    tokens, positions, segments = packed.unbind(0)
    ancestors = upload(plan.ancestors, device)
    reads = upload(plan.reads, device)
    window = getattr(getattr(body, "config", None), "sliding_window", None)
    window_needed = window is not None and int(plan.positions.max()) >= window
    mask = _masks(body, (tokens, positions, segments, ancestors), window_needed)
    out = _body_call(
        body, input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=False
    )
    hidden = out.last_hidden_state  # (R, W, H)
    flat = hidden.reshape(-1, hidden.shape[-1])
    flat = torch.cat([flat, flat.new_zeros(1, flat.shape[-1])])  # the zero slot: padding
    return flat[reads]  # (B, T, H)


#: Largest relative difference (norm of the difference over the norm) between the shared and
#: the dense hidden states accepted by the first call's check, by the body's precision.
_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
_LOW_PRECISION_TOLERANCE = 3e-2


class PrefixSharing:
    """A wrapper's shared-prefix scoring: its switch, its threshold, and its first-call check.

    :meth:`hidden` returns the rows' hidden states with every shared token computed once, or
    ``None`` where the caller must score densely: sharing is off, no two rows share
    ``min_shared_length`` tokens, or the model cannot do it. The first call that shares checks two
    rows of its first tree against the dense pass (no gradient); a body that cannot take the
    packed mask, or whose shared states differ from its dense ones, turns sharing off for good
    with one warning saying why, so that a wrong number is never returned.

    Args:
        enabled (bool): share prefixes at all.
        min_shared_length (int): shortest shared prefix (tokens) worth computing once.

    Raises:
        ValueError: ``min_shared_length`` is not a positive integer.

    Examples:
        >>> import torch
        >>> from torchrl_grpo.llm.prefix import PrefixSharing
        >>> sharing = PrefixSharing(True, 32)
        >>> sharing.plan([torch.arange(40), torch.arange(40)]).trees
        [(0, 1)]
        >>> sharing.plan([torch.arange(10), torch.arange(10)]) is None  # shorter than 32
        True
        >>> PrefixSharing(True, 0)
        Traceback (most recent call last):
        ...
        ValueError: min_shared_length must be a positive integer ... got 0.
    """

    def __init__(self, enabled: bool, min_shared_length: int | None = None, **deprecated):
        min_shared_length = _renamed(min_shared_length, deprecated, "PrefixSharing")
        self.enabled = bool(enabled)
        self.min_shared_length = checked_min_shared_length(min_shared_length)
        self.checked = False
        self.off_reason: str | None = None

    @property
    def min_shared(self) -> int:
        """Deprecated: :attr:`min_shared_length` (the same setting, one name)."""
        warnings.warn(
            "PrefixSharing.min_shared is deprecated, use min_shared_length.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.min_shared_length

    def plan(self, sequences, width: int | None = None, pack: bool = False):
        """The rows' plan, or ``None`` when nothing is shared (or sharing is off); with
        ``pack``, the rows packed even when nothing is shared (each row a tree of its own),
        ``None`` only when the model cannot take a packed mask."""
        if self.off_reason is not None or not len(sequences):
            return None
        if not pack and (not self.enabled or len(sequences) < 2):
            return None
        width = max(len(s) for s in sequences) if width is None else int(width)
        min_shared_length = self.min_shared_length if self.enabled else width + 1
        plan = prefix_plan(sequences, min_shared_length, width)
        return plan if plan.trees or pack else None

    def hidden(self, body, sequences, width=None, pack: bool = False) -> torch.Tensor | None:
        """The rows' last hidden states ``[B, T, H]`` (left-padded with zeros), or ``None``:
        score densely. ``sequences`` are each row's real tokens, on the host; ``pack``: see
        :meth:`plan`."""
        plan = self.plan(sequences, width, pack)
        if plan is None:
            return None
        try:
            hidden = shared_hidden(body, plan)
        except SharingUnsupported as err:
            return self._turn_off(str(err))
        if not self.checked:
            error = _shared_error(body, sequences, plan, hidden)
            tolerance = _CHECK_TOLERANCE.get(hidden.dtype, _LOW_PRECISION_TOLERANCE)
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


def _shared_error(body, sequences, plan: PrefixPlan, hidden: torch.Tensor) -> float:
    """Relative difference from the dense pass of the packed states of two rows: two of the
    first tree, or the first two rows when nothing is shared."""
    worst = 0.0
    rows = plan.trees[0][:2] if plan.trees else range(min(2, len(sequences)))
    with torch.no_grad():
        for r in rows:
            row = sequences[r]
            row = row if isinstance(row, torch.Tensor) else torch.from_numpy(np.asarray(row))
            row = row.to(hidden.device)
            dense = body(input_ids=row[None], use_cache=False).last_hidden_state[0]
            diff = hidden[r, hidden.shape[1] - len(row) :].detach().float() - dense.float()
            worst = max(worst, float(diff.norm() / dense.float().norm().clamp_min(1e-12)))
    return worst
