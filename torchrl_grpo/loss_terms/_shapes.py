"""Shape checks shared by the loss terms (rlax's habit: a per-sequence tensor against a
per-token one raises instead of broadcasting)."""

from __future__ import annotations

import torch


def check_same_rank(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    # rlax's habit: a per-sequence (B,) tensor against per-token (B, T) ones would broadcast into
    # (B, B) silently; require the same rank and broadcastable shapes instead
    if x.ndim != ref.ndim:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} and {ref_name} has shape {tuple(ref.shape)}: "
            f"they must have the same number of dimensions (a per-sequence value is (B, 1) "
            f"against (B, T) tokens)."
        )
    try:
        torch.broadcast_shapes(x.shape, ref.shape)
    except RuntimeError:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}, which does not broadcast to {ref_name}'s "
            f"{tuple(ref.shape)}."
        ) from None


def check_same_shape(**tensors: torch.Tensor) -> None:
    # every named tensor must have exactly the shape of the first one
    (first, ref), *others = tensors.items()
    for name, x in others:
        if x.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but {first} has shape {tuple(ref.shape)}: "
                "they must be equal."
            )
