"""Diagnostics of the importance ratios: the effective sample size and the clip fractions."""

from __future__ import annotations

import torch

from torchrl_grpo.loss_terms.aggregations import masked_mean


def effective_sample_size(log_weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Normalised effective sample size of the importance weights over the real tokens.

    .. math:: \\mathrm{ESS} = \\frac{1}{N} \\frac{\\left(\\sum_t w_t\\right)^2}{\\sum_t w_t^2},
        \\qquad w_t = e^{\\log w_t}

    Kish's effective sample size divided by the number ``N`` of real tokens: ``1`` when all
    weights are equal (on-policy), down to ``1/N`` when one weight dominates. The value of
    :class:`torchrl.objectives.ClipPPOLoss`'s ``ESS``; computed without gradient on weights
    rescaled by their maximum (``w_t / max w``, which cancels in the ratio), so that equal
    weights give exactly 1 and large log-weights cannot overflow.

    Args:
        log_weight (torch.Tensor): ``log w`` per token, ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.

    Returns:
        torch.Tensor: a scalar in ``(0, 1]``.

    Examples:
        >>> import torch
        >>> mask = torch.tensor([[True, True, False]])
        >>> effective_sample_size(torch.tensor([[0.3, 0.3, 5.0]]), mask)
        tensor(1.)
        >>> every = torch.ones(1, 3, dtype=torch.bool)
        >>> effective_sample_size(torch.tensor([[0.0, 2.0, 0.0]]).log(), every)
        tensor(0.3333)
    """
    with torch.no_grad():  # over the real tokens, without reading their number on the host
        lw = log_weight.masked_fill(~mask, -torch.inf)  # (B, T)
        w = (lw - lw.max()).exp()  # (B, T), in (0, 1] on real tokens, 0 elsewhere
        n = mask.sum()
        return (w.sum().square() / (w.square().sum() * n)).clamp(max=1.0)


def clip_fractions(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    log_clip_low: float | torch.Tensor,
    log_clip_high: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Share of real tokens whose ratio lies outside the clip band, in total, below and above.

    .. math:: f_{low} = \\frac{1}{N}\\sum_t [r_t < 1-\\varepsilon_{low}], \\quad
        f_{high} = \\frac{1}{N}\\sum_t [r_t > 1+\\varepsilon_{high}], \\quad f = f_{low} + f_{high}

    ``f`` is :class:`torchrl.objectives.ClipPPOLoss`'s ``clip_fraction`` (a ratio the clamp
    changes), restricted to real tokens. It counts a token whether or not the ``min`` of the
    surrogate then picks the clipped term; the split shows which bound binds (DAPO's clip-higher
    is about ``f_high``).

    Args:
        log_ratio (torch.Tensor): ``log r`` per token, ``(B, T)``.
        mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.
        log_clip_low (float or torch.Tensor): ``log(1 - eps_low)``.
        log_clip_high (float or torch.Tensor): ``log(1 + eps_high)``.

    Returns:
        tuple[torch.Tensor, torch.Tensor, torch.Tensor]: scalars ``(f, f_low, f_high)``.

    Examples:
        >>> import math, torch
        >>> ratio = torch.tensor([[0.5, 1.0, 1.5, 1.1]])
        >>> mask = torch.tensor([[True, True, True, False]])
        >>> clip_fractions(ratio.log(), mask, math.log(0.8), math.log(1.2))
        (tensor(0.6667), tensor(0.3333), tensor(0.3333))
    """
    with torch.no_grad():
        low = masked_mean((log_ratio < log_clip_low).to(log_ratio.dtype), mask)
        high = masked_mean((log_ratio > log_clip_high).to(log_ratio.dtype), mask)
        return low + high, low, high
