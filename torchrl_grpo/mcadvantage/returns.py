"""Each trajectory's return, in the two precisions the transform uses.

The advantage is computed from float64 returns (:func:`insertion_returns`, reduced by
:data:`~torchrl_grpo.advantages.RETURN_REDUCTIONS`). Dynamic sampling and candidate selection
compare returns as torchrl computes them, in the reward's dtype (:func:`torchrl_returns`), so
that a group on the edge of a bound is decided as torchrl decides it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchrl_grpo.advantages import RETURN_REDUCTIONS, Segments
from torchrl_grpo.mcadvantage.records import Insertion, Returns
from torchrl_grpo.mcadvantage.store import ranges

__all__ = ["concat", "insertion_returns", "take", "torchrl_returns"]

_NO_RETURN = torch.zeros(1, dtype=torch.float64)  # a lone trajectory's unused return (read-only)


def insertion_returns(batch: Insertion, mode: str | None, *, exact: bool) -> Returns:
    """The incoming trajectories' returns: ``(n,)`` float64 (zeros without a return ``mode``),
    and with ``exact`` also as torchrl computes them (for its bounds and selector)."""
    n = batch.num_trajectories
    if mode is None:
        value = _NO_RETURN if n == 1 else torch.zeros(n, dtype=torch.float64)
    else:
        runs = Segments(None, lengths=batch.reward_lengths, width=batch.reward_width)
        value = RETURN_REDUCTIONS[mode](batch.rewards.double(), runs)
    exact = (
        torchrl_returns(batch.rewards, batch.reward_lengths, mode, width=batch.reward_width)
        if exact
        else None
    )
    return Returns(value, exact)


def torchrl_returns(
    rewards: Tensor, lengths: Tensor, mode: str, *, width: int | None = None
) -> Tensor:
    """Returns as torchrl computes them: ``reward.sum()`` (``.max()``, ``.mean()``) of each
    trajectory's reward tensor, in its dtype, so that they round as torchrl's do.

    A reduction over the rows of a ``(n, L)`` tensor rounds as the same reduction over each row
    alone, so trajectories are reduced a length at a time (one pass per distinct length).

    Args:
        rewards: ``(E,)`` every reward element, trajectory after trajectory.
        lengths: ``(n,)`` reward elements of each trajectory.
        mode: ``"sum"``, ``"max"``, ``"mean"`` or ``"last"``.
        width: the length of every trajectory when they all have one (``0``: they differ), if
            known (else found from ``lengths``).

    Returns:
        ``(n,)`` in the reward's dtype (the default float dtype for integer rewards).

    Examples:
        >>> import torch
        >>> torchrl_returns(torch.tensor([1.0, 2.0, 5.0]), torch.tensor([2, 1]), "sum")
        tensor([3., 5.])
    """
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if mode == "last":
        return rewards[torch.cumsum(lengths, 0) - 1]

    def reduce(rows: Tensor) -> Tensor:  # (m, L) -> (m,)
        if mode == "sum":
            return rows.sum(1)
        return rows.amax(1) if mode == "max" else rows.mean(1)

    if width is None:
        shortest, longest = (int(v) for v in torch.aminmax(lengths))
        width = shortest if shortest == longest else 0
    if width:
        return reduce(rewards.view(-1, width))
    out = torch.empty(lengths.shape[0], dtype=rewards.dtype)
    starts = torch.cumsum(lengths, 0) - lengths
    for length in torch.unique(lengths).tolist():
        which = (lengths == length).nonzero().squeeze(1)  # trajectories of this length
        out[which] = reduce(rewards[ranges(starts[which], lengths[which])].view(-1, length))
    return out


def concat(pending: Returns, incoming: Returns) -> Returns:
    """The returns of pending ++ incoming trajectories. Pending ones restored from a checkpoint
    written before torchrl's returns were kept stand in with their float64 values."""
    if pending.value.shape[0] == 0:
        return incoming
    exact = None
    if incoming.torchrl is not None:
        held = pending.value if pending.torchrl is None else pending.torchrl
        exact = torch.cat([held.to(incoming.torchrl.dtype), incoming.torchrl])
    return Returns(torch.cat([pending.value, incoming.value]), exact)


def take(returns: Returns, index: Tensor) -> Returns:
    """The returns of trajectories ``index``."""
    exact = None if returns.torchrl is None else returns.torchrl[index]
    return Returns(returns.value[index], exact)
