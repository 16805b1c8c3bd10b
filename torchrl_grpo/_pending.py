"""The trajectories ``MCAdvantage`` holds back until their group is complete.

Pure storage, no advantage math: what each insertion left pending is kept as it came (a *chunk*,
never copied), trajectories are addressed by ``(chunk, offset, length)``, and the whole store is
one immutable :class:`Pending` value that the transform replaces at the end of a successful
insertion (so a rejected insertion changes nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack
from torch import Tensor

from torchrl_grpo._reading import on_one_device
from torchrl_grpo._tails import IdRegistry, Tails

if TYPE_CHECKING:
    from torchrl_grpo._reading import Insertion

# The empty state's tensors, shared: a state's tensors are never written in place (every change
# builds a new Pending), so one empty tensor of each kind serves every fresh state.
_NO_SPANS = torch.zeros(0, 4, dtype=torch.long)
_NO_RETURN = torch.zeros(0, dtype=torch.float64)
CHUNK, OFFSET, LENGTH, ARRIVAL = range(4)  # the columns of ``Pending.spans``


@dataclass
class Pending:
    """Everything the transform holds between insertions; replaced whole, never mutated.

    The pending steps live in ``chunks``: what each insertion left pending, kept as it came (a
    flat TensorDict, or a list of step TensorDicts once ragged data has been seen), so holding a
    trajectory back copies nothing. Pending trajectory ``j`` is steps
    ``offset[j] : offset[j] + lengths[j]`` of ``chunks[chunk[j]]``, and arrived with insertion
    ``arrival[j]``: the four columns of ``spans`` (one tensor, so that queueing a trajectory is one
    concatenation); trajectories are in arrival order. ``keys`` holds one group id per pending
    trajectory: a ``(Q, k)`` tensor for tensor ids, a list of strings for prompts.
    """

    chunks: list = field(default_factory=list)
    chunk_sizes: list = field(default_factory=list)  # steps in each chunk, released ones included
    # (Q, 4): chunk, offset, length, arrival of each pending trajectory
    spans: Tensor = field(default_factory=lambda: _NO_SPANS)
    keys: Tensor | list | None = None
    returns: Tensor = field(default_factory=lambda: _NO_RETURN)  # (Q,) float64
    # (Q,) the returns in the reward's dtype, reduced as torchrl does; None: not kept (only
    # ``keep_return_bounds`` and candidate selection compare them)
    torchrl_returns: Tensor | None = None
    stats: dict = field(default_factory=dict)
    ragged: bool = False
    insertions: int = 0  # successful insertions so far: the clock of ``arrival``
    # trajectories not ended yet, whose first steps arrived (see torchrl_grpo._tails)
    tails: Tails = field(default_factory=Tails)

    @property
    def num_pending(self) -> int:
        return self.spans.shape[0]

    # The columns of ``spans`` by name, as (Q,) views.
    chunk = property(lambda self: self.spans[:, CHUNK])
    offset = property(lambda self: self.spans[:, OFFSET])
    lengths = property(lambda self: self.spans[:, LENGTH])
    arrival = property(lambda self: self.spans[:, ARRIVAL])


def spans_of(chunk, offset, lengths, arrival) -> Tensor:
    """The ``(n, 4)`` spans of ``n`` trajectories (each argument a tensor or an int)."""
    out = torch.empty(lengths.numel(), 4, dtype=torch.long)
    for column, value in enumerate((chunk, offset, lengths, arrival)):
        out[:, column] = value
    return out


_FIELDS = frozenset(f.name for f in fields(Pending))


def evolve(state: Pending, **changes) -> Pending:
    """``dataclasses.replace`` without its per-call introspection (the hot path's copy).

    Raises:
        TypeError: for a name that is not a field of :class:`Pending`.
    """
    if not _FIELDS.issuperset(changes):
        unknown = sorted(set(changes) - _FIELDS)
        raise TypeError(f"Pending has no field {unknown[0]!r} (fields: {sorted(_FIELDS)}).")
    new = object.__new__(Pending)
    new.__dict__.update(state.__dict__, **changes)
    return new


class Returns(NamedTuple):
    """The returns of some trajectories, in the two precisions the transform uses."""

    value: Tensor  # (n,) float64: what the advantage is computed from
    torchrl: Tensor | None  # (n,) reward dtype, reduced as torchrl does; None: not needed

    def take(self, index: Tensor) -> Returns:
        return Returns(self.value[index], None if self.torchrl is None else self.torchrl[index])


def returns_of(state: Pending) -> Returns:
    """The pending trajectories' returns."""
    return Returns(state.returns, state.torchrl_returns)


def concat(pending: Returns, incoming: Returns) -> Returns:
    """Returns of pending ++ incoming (``pending.torchrl`` may be missing when nothing is held)."""
    if pending.value.shape[0] == 0:
        return incoming
    torchrl = None
    if incoming.torchrl is not None:  # (a checkpoint without them: their float64 values)
        held = pending.value if pending.torchrl is None else pending.torchrl
        torchrl = torch.cat([held.to(incoming.torchrl.dtype), incoming.torchrl])
    return Returns(torch.cat([pending.value, incoming.value]), torchrl)


def ranges(starts: Tensor, lengths: Tensor) -> Tensor:
    """Concatenate ``arange(s, s + l)`` for each pair, without a Python loop."""
    total = int(lengths.sum())
    offsets = torch.cumsum(lengths, 0) - lengths  # (n,)
    return torch.arange(total) - torch.repeat_interleave(offsets - starts, lengths)


def take(data: TensorDictBase | list, index: Tensor) -> TensorDictBase | list:
    """Rows ``index`` of a flat TensorDict, or of a list of step TensorDicts."""
    if isinstance(data, list):
        return [data[i] for i in index.tolist()]
    return data[index]


def as_list(keys) -> list:
    return keys if isinstance(keys, list) else []


def take_sorted(data: TensorDictBase | list, index: Tensor) -> TensorDictBase | list:
    """Like :func:`take` for an increasing ``index``; a contiguous run is a view, not a copy."""
    first, last = int(index[0]), int(index[-1])
    if last - first + 1 == index.numel():
        return data if first == 0 and index.numel() == len(data) else data[first : last + 1]
    return take(data, index)


def steps_of(data: TensorDictBase | list) -> list:
    return data if isinstance(data, list) else list(data.unbind(0))


def group_counts(state: Pending) -> list[int]:
    if state.num_pending == 0:
        return []
    if isinstance(state.keys, list):
        counts: dict = {}
        for key in state.keys:
            counts[key] = counts.get(key, 0) + 1
        return list(counts.values())
    return torch.unique(state.keys, dim=0, return_counts=True)[1].tolist()


def python_keys(keys: Tensor | list) -> list:
    if isinstance(keys, list):
        return list(keys)
    return [row[0] if len(row) == 1 else tuple(row) for row in keys.tolist()]


def gather(state: Pending, batch: Insertion | None, members: Tensor):
    """All steps of trajectories ``members`` (increasing indices into pending ++ incoming).

    Chunks are appended in arrival order, so increasing members are also in (chunk, offset)
    order: the steps come out as one concatenation of contiguous pieces, with no reordering.
    Returns a new flat TensorDict (the insertion itself when all of it is taken), or a list of
    step copies when the data is ragged.
    """
    q = state.num_pending
    if q == 0 and batch is not None and members.numel() == batch.lengths.numel():
        return batch.data  # all of the insertion, as it came: no copy
    ragged = state.ragged or (batch is not None and isinstance(batch.data, list))
    from_pending = members < q
    pending = members[from_pending]
    pieces = []
    few = 0 < pending.numel() <= 32
    chunk_list = state.chunk[pending].tolist() if few else None
    if few and len(set(chunk_list)) == len(chunk_list):  # a few, each from its own chunk
        spans = zip(chunk_list, state.offset[pending].tolist(), state.lengths[pending].tolist())
        pieces = [  # one slice (a view) each; a whole chunk as it is (one trajectory per
            # insertion): no slicing
            state.chunks[c] if n == state.chunk_sizes[c] else state.chunks[c][o : o + n]
            for c, o, n in spans
        ]
    elif pending.numel():  # many, or several per chunk: one take (or slice) per chunk
        lengths = state.lengths[pending]
        step_chunk = torch.repeat_interleave(state.chunk[pending], lengths)  # (K,)
        step_pos = ranges(state.offset[pending], lengths)  # (K,)
        chunk_ids, counts = torch.unique_consecutive(step_chunk, return_counts=True)
        pieces = [
            take_sorted(state.chunks[c], pos)
            for c, pos in zip(chunk_ids.tolist(), step_pos.split(counts.tolist()))
        ]
    if pending.numel() < members.numel():
        incoming = members[~from_pending] - q
        if incoming.numel() == batch.lengths.numel():  # all of it, in order: no copy
            pieces.append(batch.data)
        else:
            index = ranges(batch.starts[incoming], batch.lengths[incoming])
            pieces.append(take(batch.data, index))
    pieces = on_one_device(pieces)
    if not ragged:
        if len(pieces) == 1:
            return pieces[0]
        try:
            return torch.cat(pieces)
        except RuntimeError:  # per-step shapes differ between insertions: go ragged
            pass
    return [step.copy() for piece in pieces for step in steps_of(piece)]


def trajectory(state: Pending, batch: Insertion | None, j: int) -> TensorDictBase:
    """Trajectory ``j`` of pending ++ incoming, as one TensorDict (a lazy stack if ragged)."""
    out = gather(state, batch, torch.tensor([j]))
    return lazy_stack(out) if isinstance(out, list) else out


def append(
    state: Pending,
    piece: TensorDictBase | list,
    *,
    offset: Tensor,
    lengths: Tensor,
    group_ids: Tensor | list,
    returns: Returns,
) -> Pending:
    """``state`` with the trajectories of ``piece`` (a new chunk) queued after the others.

    Trajectory ``i`` is steps ``offset[i] : offset[i] + lengths[i]`` of ``piece``.
    """
    if isinstance(group_ids, list):
        keys = as_list(state.keys) + group_ids
    elif state.keys is None or state.keys.numel() == 0:
        keys = group_ids
    elif group_ids.dtype == state.keys.dtype:
        keys = torch.cat([state.keys, group_ids])
    else:
        keys = torch.cat([state.keys, group_ids.to(state.keys.dtype)])
    if lengths.shape[0] == 1:  # one trajectory: its span from Python ints (numpy builds a
        # small tensor from a literal a few times faster than torch.tensor does)
        row = [[len(state.chunks), int(offset), int(lengths), state.insertions]]
        span = torch.from_numpy(np.array(row, dtype=np.int64))
    else:
        span = spans_of(len(state.chunks), offset, lengths, state.insertions)
    held = concat(returns_of(state), returns) if state.num_pending else returns
    return evolve(
        state,
        chunks=[*state.chunks, piece],
        chunk_sizes=[*state.chunk_sizes, len(piece)],
        spans=torch.cat([state.spans, span]),
        keys=keys,
        returns=held.value,
        torchrl_returns=held.torchrl,
    )


def drop(state: Pending, keep: Tensor) -> Pending:
    """``state`` without the pending trajectories where ``keep`` is False.

    A chunk left with no pending trajectory is released (its slot set to ``None``, so chunk
    numbers stay valid); the list itself is compacted once most of its slots are empty.
    """
    kept = keep.nonzero().squeeze(1)  # (Q',) the trajectories that stay
    spans = state.spans.index_select(0, kept)
    alive = torch.bincount(spans[:, CHUNK], minlength=len(state.chunks))  # (C,) left in each
    chunks, sizes = list(state.chunks), list(state.chunk_sizes)
    for c in (alive == 0).logical_and_(_touched(state, keep)).nonzero().squeeze(1).tolist():
        chunks[c], sizes[c] = None, 0  # no pending trajectory left in it
    # A released slot has size 0 (a held chunk has steps); count with ints, not chunk == None.
    if len(sizes) > 2 * (len(sizes) - sizes.count(0)) + 64:  # mostly empty slots: renumber
        renumber = torch.cumsum(alive > 0, 0) - 1  # (C,) new number of each live chunk
        spans[:, CHUNK] = renumber[spans[:, CHUNK]]  # a fresh tensor: ours to write
        chunks = [chunk for chunk, size in zip(chunks, sizes) if size]
        sizes = [size for size in sizes if size]
    return evolve(
        state,
        chunks=chunks,
        chunk_sizes=sizes,
        spans=spans,
        keys=_select(state.keys, kept),
        returns=state.returns.index_select(0, kept),
        torchrl_returns=(
            None if state.torchrl_returns is None else state.torchrl_returns.index_select(0, kept)
        ),
    )


def _touched(state: Pending, keep: Tensor) -> Tensor:
    """``(C,)`` bool: the chunks that held a trajectory now dropped."""
    touched = torch.zeros(len(state.chunks), dtype=torch.bool)
    return touched.index_fill_(0, state.chunk[~keep], True)


def _select(group_ids: Tensor | list, index: Tensor) -> Tensor | list:
    """The group ids at ``index`` (increasing positions)."""
    if isinstance(group_ids, list):
        return [group_ids[i] for i in index.tolist()]
    return group_ids.index_select(0, index)


def remaining(
    state: Pending, batch: Insertion, consumed: Tensor | None, incoming: Returns
) -> Pending:
    """The next state: the pending and incoming trajectories that no released group consumed.

    Args:
        state: what was held before the insertion.
        batch: the insertion.
        consumed: ``(Q + n,)`` bool, the trajectories that leave (released or given up);
            ``None``: none does.
        incoming: the incoming trajectories' returns.
    """
    q = state.num_pending
    ragged = state.ragged or batch.ragged
    if consumed is None:  # everything stays: queue the insertion as it came, no copy
        new = state if ragged == state.ragged else evolve(state, ragged=ragged)
        return append(
            new,
            batch.data,
            offset=batch.starts,
            lengths=batch.lengths,
            group_ids=batch.group_ids,
            returns=incoming,
        )
    if q == 0 and bool(consumed.all()):  # everything released: nothing left to hold
        return Pending(
            stats=state.stats, ragged=ragged, insertions=state.insertions, tails=state.tails
        )
    keep_pending, keep_incoming = ~consumed[:q], ~consumed[q:]
    new = state if bool(keep_pending.all()) else drop(state, keep_pending)
    if ragged != new.ragged:
        new = evolve(new, ragged=ragged)
    if keep_incoming.any():
        lengths = batch.lengths[keep_incoming]
        if keep_incoming.all():  # keep the insertion as it came: no copy
            piece, offset, group_ids = batch.data, batch.starts, batch.group_ids
        else:
            piece = take(batch.data, ranges(batch.starts[keep_incoming], lengths))
            offset = torch.cumsum(lengths, 0) - lengths
            group_ids = _select(batch.group_ids, keep_incoming.nonzero().squeeze(1))
        new = append(
            new,
            piece,
            offset=offset,
            lengths=lengths,
            group_ids=group_ids,
            returns=incoming.take(keep_incoming),
        )
    # Held-back chunks also hold released steps; compact once those outnumber the live ones.
    live = int(new.lengths.sum())
    if sum(new.chunk_sizes) > 2 * live + 1024:
        data = gather(new, None, torch.arange(new.num_pending))
        lengths = new.lengths
        offset = torch.cumsum(lengths, 0) - lengths
        new = evolve(
            new, chunks=[data], chunk_sizes=[live], spans=spans_of(0, offset, lengths, new.arrival)
        )
    return new


# --- checkpoints: the state as tensors and plain Python values (``torch.load(weights_only=True)``)


def to_plain(state: Pending) -> dict:
    """The pending trajectories (steps in arrival order) and counters, as plain data."""
    steps = None
    if state.num_pending:
        data = gather(state, None, torch.arange(state.num_pending))
        steps = [step.to_dict() for step in data] if isinstance(data, list) else data.to_dict()
    tail_steps, tail_lengths = state.tails.steps()
    return {
        "tails": {
            "steps": None if tail_steps is None else tail_steps.to_dict(),
            "lengths": tail_lengths,
            "meta": state.tails.meta.clone(),
            "registry": None
            if state.tails.registry is None
            else state.tails.registry.marks.clone(),
        },
        "steps": steps,
        "num_steps": int(state.lengths.sum()),
        "ragged": state.ragged,
        "lengths": state.lengths.clone(),
        "keys": list(state.keys) if isinstance(state.keys, list) else state.keys,
        "returns": state.returns.clone(),
        "torchrl_returns": None if state.torchrl_returns is None else state.torchrl_returns.clone(),
        "arrival": state.arrival.clone(),
        "insertions": state.insertions,
        "stats": dict(state.stats),
    }


def from_plain(plain: dict) -> Pending:
    """Inverse of :func:`to_plain`. The steps stay on the device they were loaded onto; the
    bookkeeping comes back to the CPU (where ``torch.load(..., map_location=...)`` put it)."""
    lengths = _cpu(plain["lengths"])
    offset = torch.cumsum(lengths, 0) - lengths
    state = Pending(
        spans=spans_of(0, offset, lengths, _cpu(plain["arrival"])),
        keys=_cpu(plain["keys"]),
        returns=_cpu(plain["returns"]),
        torchrl_returns=_cpu(plain.get("torchrl_returns")),  # absent from older checkpoints
        stats=dict(plain["stats"]),
        ragged=plain["ragged"],
        insertions=plain["insertions"],
    )
    if plain.get("tails") is not None:  # absent from checkpoints before streaming
        state = evolve(state, tails=_tails_from_plain(plain["tails"]))
    if plain["steps"] is None:
        return state
    if plain["ragged"]:
        data = [TensorDict.from_dict(step, batch_size=[]) for step in plain["steps"]]
    else:
        data = TensorDict.from_dict(plain["steps"], batch_size=[plain["num_steps"]])
    return evolve(state, chunks=[data], chunk_sizes=[plain["num_steps"]])


def _tails_from_plain(plain: dict) -> Tails:
    registry = None if plain["registry"] is None else IdRegistry(_cpu(plain["registry"]))
    meta = _cpu(plain["meta"])
    if plain["steps"] is None:
        return Tails(meta=meta, registry=registry)
    lengths = _cpu(plain["lengths"])  # (H,) in meta order
    steps = TensorDict.from_dict(plain["steps"], batch_size=[int(lengths.sum())])
    offset = torch.cumsum(lengths, 0) - lengths
    pieces = torch.stack([torch.zeros_like(offset), offset, lengths, meta[:, 0]], 1)
    return Tails(chunks=(steps,), pieces=pieces, meta=meta, registry=registry)


def _cpu(value):
    """A checkpoint's bookkeeping tensor on the CPU (lists, ``None`` and CPU tensors as they are)."""
    return value.cpu() if isinstance(value, Tensor) else value
