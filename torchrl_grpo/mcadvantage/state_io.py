"""Checkpoints: the state as tensors and plain Python values, for ``state_dict()``.

:func:`to_plain` writes what :func:`from_plain` reads: every pending trajectory's steps (in
arrival order), its group id, returns and queue time, the unfinished tails and the trajectory ids
already ended, the counters and the insertion clock. It holds only what
``torch.load(..., weights_only=True)`` reads. The format is the one torchrl_grpo 0.1.0 wrote;
entries that later versions added are optional when reading, so older checkpoints load.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchrl_grpo.mcadvantage.ids import ids_from_plain
from torchrl_grpo.mcadvantage.pending import gather
from torchrl_grpo.mcadvantage.records import (
    NO_VERSION,
    QUEUED_AT,
    TAIL_ID,
    VERSION,
    Pending,
    Returns,
    State,
    Tails,
)
from torchrl_grpo.mcadvantage.registry import IdRegistry
from torchrl_grpo.mcadvantage.stats import fresh_stats, plain
from torchrl_grpo.mcadvantage.steps import DenseSteps, RaggedSteps
from torchrl_grpo.mcadvantage.store import LENGTH, Chunks
from torchrl_grpo.mcadvantage.tails import held_steps

__all__ = ["from_plain", "to_plain", "upgrade_state_dict"]


def to_plain(state: State) -> dict:
    """The state as plain data (tensors, lists, dicts, numbers)."""
    pending = state.pending
    steps = None
    if pending.num_pending:
        steps = gather(pending, None, torch.arange(pending.num_pending)).to_plain()
    tail_steps, tail_lengths = held_steps(state.tails)
    registry = state.tails.registry
    return {
        "tails": {
            "steps": None if tail_steps is None else tail_steps.to_dict(),
            "lengths": tail_lengths,
            "meta": state.tails.meta.clone(),
            "registry": None if registry is None else registry.marks.clone(),
        },
        "steps": steps,
        "num_steps": int(pending.spans[:, LENGTH].sum()),
        "ragged": pending.ragged,
        "lengths": pending.spans[:, LENGTH].clone(),
        "keys": None if pending.ids is None else pending.ids.to_plain(),
        "returns": pending.returns.value.clone(),
        "torchrl_returns": _clone(pending.returns.torchrl),
        "arrival": pending.spans[:, QUEUED_AT].clone(),
        "versions": pending.spans[:, VERSION].clone(),
        "newest_version": state.newest_version,
        "insertions": state.insertions,
        "stats": plain(state.stats),
    }


def from_plain(plain: dict) -> State:
    """Inverse of :func:`to_plain`. The steps stay on the device they were loaded onto; the
    bookkeeping comes back to the CPU (where ``torch.load(..., map_location=...)`` put it).
    Counters missing from an older checkpoint start at their start values."""
    lengths = _cpu(plain["lengths"])
    versions = _cpu(plain.get("versions"))  # absent before policy versions were kept
    if versions is None:
        versions = torch.full_like(lengths, NO_VERSION)
    spans = torch.cat([_spans(lengths, _cpu(plain["arrival"])), versions[:, None]], 1)
    chunks = Chunks()
    if plain["steps"] is not None:
        kind = RaggedSteps if isinstance(plain["steps"], list) else DenseSteps
        chunks = chunks.add(kind.from_plain(plain["steps"], plain["num_steps"]))
    pending = Pending(
        chunks=chunks,
        spans=spans,
        ids=ids_from_plain(_cpu(plain["keys"])),
        # torchrl's returns are absent from checkpoints written before they were kept
        returns=Returns(_cpu(plain["returns"]), _cpu(plain.get("torchrl_returns"))),
        ragged=plain["ragged"],
    )
    tails = Tails() if plain.get("tails") is None else _tails(plain["tails"])
    stats = {**fresh_stats(), **plain["stats"]}
    return State(
        pending=pending,
        tails=tails,
        stats=stats,
        insertions=plain["insertions"],
        newest_version=plain.get("newest_version"),
    )


def upgrade_state_dict(state_dict: dict, prefix: str, grpo_size: int) -> None:
    """Move the entries of a checkpoint written before the transform kept its state as extra
    state (``pending`` and ``grpo_size``) to ``_extra_state``, in place."""
    if prefix + "pending" in state_dict and prefix + "_extra_state" not in state_dict:
        state_dict[prefix + "_extra_state"] = {
            "pending": state_dict.pop(prefix + "pending"),
            "grpo_size": state_dict.pop(prefix + "grpo_size", grpo_size),
        }


def _tails(plain: dict) -> Tails:
    registry = None if plain["registry"] is None else IdRegistry(_cpu(plain["registry"]))
    meta = _cpu(plain["meta"])
    if plain["steps"] is None:
        return Tails(meta=meta, registry=registry)
    lengths = _cpu(plain["lengths"])  # (H,) in meta order
    steps = DenseSteps.from_plain(plain["steps"], int(lengths.sum()))
    pieces = _spans(lengths, meta[:, TAIL_ID])
    return Tails(chunks=Chunks().add(steps), pieces=pieces, meta=meta, registry=registry)


def _spans(lengths: Tensor, last: Tensor) -> Tensor:
    """Spans of one chunk holding ``lengths`` steps one after the other, with a fourth column."""
    offset = torch.cumsum(lengths, 0) - lengths
    return torch.stack([torch.zeros_like(offset), offset, lengths, last], 1)


def _clone(value: Tensor | None) -> Tensor | None:
    return None if value is None else value.clone()


def _cpu(value):
    """A checkpoint's bookkeeping tensor on the CPU (lists, ``None``, CPU tensors as they are)."""
    return value.cpu() if isinstance(value, Tensor) else value
