"""Masked reductions and the aggregations that turn per-token losses into a scalar, with their
registry (:data:`AGGREGATIONS`) and the sums and counts behind each mean
(:data:`AGGREGATION_SUMS`, :func:`aggregation_sum`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is ``True``.

    .. math:: \\bar{x} = \\frac{\\sum_{b,t} m_{b,t}\\, x_{b,t}}{\\sum_{b,t} m_{b,t}}

    Masked-out entries are selected away (``torch.where``), never multiplied by zero, so a ``nan``
    or ``inf`` sitting in padding cannot leak into the result or its gradient.

    Args:
        x (torch.Tensor): values, any shape.
        mask (torch.Tensor): boolean, same shape as ``x``; ``True`` on real entries.

    Returns:
        torch.Tensor: a scalar. ``nan`` if ``mask`` has no ``True`` entry (the mean of nothing);
        :class:`~torchrl_grpo.GRPOLoss` rejects such a batch before it gets here.

    Examples:
        >>> import torch
        >>> x = torch.tensor([[1.0, 2.0], [3.0, float("nan")]])
        >>> mask = torch.tensor([[True, True], [True, False]])
        >>> masked_mean(x, mask)
        tensor(2.)
    """
    return torch.where(mask, x, 0.0).sum() / mask.sum()


def aggregate_token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Global token mean: every real token of the batch weighs the same (DAPO, CISPO).

    .. math:: L = \\frac{1}{\\sum_i |o_i|} \\sum_i \\sum_{t=1}^{|o_i|} \\ell_{i,t}

    Long sequences get more weight than short ones. This is DAPO's "token-level policy gradient
    loss" (Yu et al., 2025) and the normalisation of CISPO (MiniMax, 2025).

    Args:
        loss (torch.Tensor): per-token loss ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.

    Returns:
        torch.Tensor: a scalar.

    Examples:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[True, True, True], [True, False, False]])
        >>> aggregate_token_mean(loss, mask)  # (1 + 2 + 3 + 4) / 4
        tensor(2.5000)
    """
    return masked_mean(loss, mask)


def _sequence_sums(loss: torch.Tensor, mask: torch.Tensor):
    # per-sequence token sums and lengths, and which sequences hold any real token
    seq_sum = torch.where(mask, loss, 0.0).sum(-1)  # (B,)
    seq_len = mask.sum(-1)  # (B,)
    return seq_sum, seq_len, seq_len > 0


def aggregate_seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token mean within each sequence, then mean over sequences (GRPO, GSPO).

    .. math:: L = \\frac{1}{G} \\sum_{i=1}^{G} \\frac{1}{|o_i|} \\sum_{t=1}^{|o_i|} \\ell_{i,t}

    Every sequence weighs the same whatever its length: the original GRPO objective (Shao et al.,
    2024) and GSPO's sequence average (Zheng et al., 2025). Sequences with no real
    token are not sequences: they are left out of ``G``.

    Args:
        loss (torch.Tensor): per-token loss ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.

    Returns:
        torch.Tensor: a scalar.

    Examples:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[True, True, True], [True, False, False]])
        >>> aggregate_seq_mean_token_mean(loss, mask)  # (2 + 4) / 2
        tensor(3.)
    """
    seq_sum, seq_len, nonempty = _sequence_sums(loss, mask)
    seq_mean = seq_sum / seq_len.clamp_min(1)
    return torch.where(nonempty, seq_mean, 0.0).sum() / nonempty.sum()


def aggregate_seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token sum within each sequence, then mean over sequences.

    .. math:: L = \\frac{1}{G} \\sum_{i=1}^{G} \\sum_{t=1}^{|o_i|} \\ell_{i,t}

    The sequence-level REINFORCE estimate: a sequence's loss is the sum of its token losses
    (as in Dr. GRPO, Liu et al., 2025, before its constant normalisation). Sequences with no
    real token are left out of ``G``.

    Args:
        loss (torch.Tensor): per-token loss ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.

    Returns:
        torch.Tensor: a scalar.

    Examples:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[True, True, True], [True, False, False]])
        >>> aggregate_seq_mean_token_sum(loss, mask)  # (6 + 4) / 2
        tensor(5.)
    """
    seq_sum, _, nonempty = _sequence_sums(loss, mask)
    return seq_sum.sum() / nonempty.sum()


def aggregate_seq_mean_token_sum_norm(
    loss: torch.Tensor, mask: torch.Tensor, *, max_length: int
) -> torch.Tensor:
    """Dr. GRPO: token sum per sequence divided by a constant length, then mean over sequences.

    .. math:: L = \\frac{1}{G} \\sum_{i=1}^{G} \\frac{1}{L_{\\max}} \\sum_{t=1}^{|o_i|} \\ell_{i,t}

    Liu et al. (2025) show that dividing by the response length ``|o_i|`` biases GRPO
    towards long wrong answers; Dr. GRPO divides by a constant instead -- the generation budget
    ``L_max`` -- so every token's gradient has the same scale. ``L_max`` must be the same for
    every batch (the maximum number of new tokens), not the padded width of this batch.

    Args:
        loss (torch.Tensor): per-token loss ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.
        max_length (int): the constant ``L_max``, strictly positive.

    Returns:
        torch.Tensor: a scalar.

    Raises:
        ValueError: if ``max_length`` is not strictly positive.

    Examples:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[True, True, True], [True, False, False]])
        >>> aggregate_seq_mean_token_sum_norm(loss, mask, max_length=5)  # (6 + 4) / 2 / 5
        tensor(1.)
    """
    if max_length <= 0:
        raise ValueError(f"max_length must be strictly positive, got {max_length}.")
    return aggregate_seq_mean_token_sum(loss, mask) / max_length


def aggregate_token_sum(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""Sum over every real token of the batch, divided by nothing (verl's ``"token-sum"``).

    .. math:: L = \sum_i \sum_{t=1}^{|o_i|} \ell_{i,t}

    verl's ``loss_agg_mode="token-sum"`` (August 2026): no count, no constant, so the loss of a
    batch is the sum of the losses of its parts. Micro-batches add up as they are; with
    ``DistributedDataParallel`` (which averages the ranks' gradients) multiply the gradients
    by the world size, as verl multiplies the loss by ``dp_size``
    (``GRPOLoss.normalize_gradients(params, 1, ranks=world_size)``). The gradient's scale grows
    with the batch: pick the learning rate for the number of tokens of a step.

    Args:
        loss (torch.Tensor): per-token loss ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.

    Returns:
        torch.Tensor: a scalar.

    Examples:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 9.0]])
        >>> mask = torch.tensor([[True, True, True], [True, False, False]])
        >>> aggregate_token_sum(loss, mask)  # 1 + 2 + 3 + 4
        tensor(10.)
    """
    return torch.where(mask, loss, 0.0).sum()


def _token_mean_sum(loss: torch.Tensor, mask: torch.Tensor):
    return torch.where(mask, loss, 0.0).sum(), mask.sum()


def _seq_mean_token_mean_sum(loss: torch.Tensor, mask: torch.Tensor):
    seq_sum, seq_len, nonempty = _sequence_sums(loss, mask)
    return torch.where(nonempty, seq_sum / seq_len.clamp_min(1), 0.0).sum(), nonempty.sum()


def _seq_mean_token_sum_sum(loss: torch.Tensor, mask: torch.Tensor):
    seq_sum, _, nonempty = _sequence_sums(loss, mask)
    return seq_sum.sum(), nonempty.sum()


def _seq_mean_token_sum_norm_sum(loss: torch.Tensor, mask: torch.Tensor, *, max_length: int):
    seq_sum, _, nonempty = _sequence_sums(loss, mask)
    return seq_sum.sum() / max_length, nonempty.sum()


def _token_sum_sum(loss: torch.Tensor, mask: torch.Tensor):
    raise ValueError(
        "aggregation 'token_sum' is a sum already: the losses of micro-batches add up with "
        "no count to divide by. Call the loss outside summed(); with "
        "DistributedDataParallel, multiply the gradients by the world size: "
        "GRPOLoss.normalize_gradients(params, 1, ranks=world_size)."
    )


#: Aggregations by name, for ``GRPOLoss(aggregation=...)``. Each maps a per-token loss and its
#: mask, both ``(B, T)``, to a scalar; ``"seq_mean_token_sum_norm"`` also needs ``max_length``.
#: Add one with :func:`register_aggregation`, which records its sum and count beside it.
AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {}
#: Each aggregation of :data:`AGGREGATIONS` -> its ``(sum, count)`` function
#: (:func:`aggregation_sum`): the loss is ``sum / count``.
AGGREGATION_SUMS: dict[Callable[..., torch.Tensor], Callable[..., tuple]] = {}


def register_aggregation(
    name: str, aggregate: Callable[..., torch.Tensor], sum_and_count: Callable[..., tuple]
) -> None:
    """Add an aggregation under ``name``: its value ``aggregate(loss, mask)`` and its
    ``sum_and_count(loss, mask) -> (S, N)`` with ``aggregate == S / N`` (extra keywords, such as
    Dr. GRPO's ``max_length``, reach both). ``GRPOLoss(aggregation=name)`` then takes it, and
    :meth:`~torchrl_grpo.GRPOLoss.summed` adds its sums over micro-batches exactly.

    Raises:
        ValueError: ``name`` is taken.

    Examples:
        >>> import torch
        >>> from torchrl_grpo.loss_terms import AGGREGATIONS, aggregation_sum, register_aggregation
        >>> def longest_mean(loss, mask):  # each row's token mean over the longest row's length
        ...     return sum_longest(loss, mask)[0] / sum_longest(loss, mask)[1]
        >>> def sum_longest(loss, mask):
        ...     return (torch.where(mask, loss, 0.0).sum(-1) / mask.sum(-1).max()).sum(), (
        ...         mask.any(-1).sum())
        >>> register_aggregation("seq_mean_token_sum_longest", longest_mean, sum_longest)
        >>> loss, mask = torch.ones(2, 3), torch.tensor([[True, True, True], [True, False, False]])
        >>> AGGREGATIONS["seq_mean_token_sum_longest"](loss, mask)  # (3/3 + 1/3) / 2
        tensor(0.6667)
        >>> aggregation_sum(longest_mean, loss, mask)
        (tensor(1.3333), tensor(2))
        >>> del AGGREGATIONS["seq_mean_token_sum_longest"], AGGREGATION_SUMS[longest_mean]
    """
    if name in AGGREGATIONS:
        raise ValueError(f"aggregation {name!r} is registered already.")
    AGGREGATIONS[name] = aggregate
    AGGREGATION_SUMS[aggregate] = sum_and_count


register_aggregation("token_mean", aggregate_token_mean, _token_mean_sum)
register_aggregation("seq_mean_token_mean", aggregate_seq_mean_token_mean, _seq_mean_token_mean_sum)
register_aggregation("seq_mean_token_sum", aggregate_seq_mean_token_sum, _seq_mean_token_sum_sum)
register_aggregation(
    "seq_mean_token_sum_norm", aggregate_seq_mean_token_sum_norm, _seq_mean_token_sum_norm_sum
)
register_aggregation("token_sum", aggregate_token_sum, _token_sum_sum)


def aggregation_sum(
    aggregate: Callable[..., torch.Tensor], loss: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """An aggregation as a sum and a count: ``aggregate(loss, mask) == sum / count``.

    .. math:: L = \\frac{S}{N}, \\qquad S = \\sum_i s_i, \\qquad N = \\text{tokens or
        sequences}

    where, for the built-in ones, ``s_i`` is sequence ``i``'s share: its token sum
    (``"token_mean"``, ``"seq_mean_token_sum"``), its token mean (``"seq_mean_token_mean"``)
    or its token sum over ``L_max`` (``"seq_mean_token_sum_norm"``), and ``N`` counts the real
    tokens (``"token_mean"``) or the sequences holding one (the others). Both are sums over the
    batch, so the sums of ``K`` micro-batches (and of ``R`` ranks) add up to the whole batch's:
    divided by the whole batch's count, their gradients are the whole batch's. Averaging each
    micro-batch's own mean instead weighs a token by the size of its micro-batch (TRL issues
    3021 and 5619). :meth:`torchrl_grpo.GRPOLoss.summed` uses this. The sum and count of an
    aggregation are those :func:`register_aggregation` recorded beside it.

    Args:
        aggregate (callable): an aggregation of :data:`AGGREGATIONS` (Dr. GRPO's with its
            ``max_length`` bound by ``functools.partial``, as ``GRPOLoss`` binds it).
        loss (torch.Tensor): per-token loss ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: the sum ``S`` (a scalar, differentiable) and the
        count ``N`` (an int64 scalar).

    Raises:
        ValueError: ``aggregate`` was registered without its sum (a plain callable's sum is
            unknown), or is :func:`aggregate_token_sum`: a sum already, its parts add up with
            no count.

    Examples:
        >>> import torch
        >>> loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[True, True, True], [True, False, False]])
        >>> aggregation_sum(aggregate_token_mean, loss, mask)  # 10 / 4 = 2.5
        (tensor(10.), tensor(4))
        >>> aggregation_sum(aggregate_seq_mean_token_mean, loss, mask)  # (2 + 4) / 2 = 3
        (tensor(6.), tensor(2))
    """
    fn, keywords = aggregate, {}
    if isinstance(aggregate, functools.partial):
        fn, keywords = aggregate.func, aggregate.keywords
    sum_and_count = AGGREGATION_SUMS.get(fn)
    if sum_and_count is None:
        raise ValueError(
            f"aggregation {getattr(fn, '__name__', fn)!r} has no registered sum and count, so "
            "it cannot be summed over micro-batches exactly: add it with "
            "torchrl_grpo.loss_terms.register_aggregation(name, aggregate, sum_and_count)."
        )
    return sum_and_count(loss, mask, **keywords)
