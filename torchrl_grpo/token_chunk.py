"""One chunk of the token loss: its statistics, its gradient, and their compiled form.

:mod:`torchrl_grpo.token_dist` works through the positions in chunks of ``n`` rows of logits
``x`` ``(n, V)`` (sliced from the logits, or computed from hidden states), and each chunk goes
through two functions: :func:`chunk_stats` in the forward pass and :func:`chunk_grad` in the
backward pass. They are written for as few passes over the ``(n, V)`` block as eager PyTorch
allows (a pass moves the block through memory, and on an accelerator each is a kernel launch):
five forward and four backward, every temporary float32, at most two ``(n, V)`` temporaries
alive. Where a compiler is available (:func:`use_compile`), the same functions run through
``torch.compile``, which fuses each into one or two kernels that keep no ``(n, V)`` temporary.

The maths, for one row with ``m = max_v x_v``, ``d_v = x_v - m``, ``s = sum_v exp(d_v)``, sampled
token ``a`` and upstream gradients ``g_lp`` (of the log-prob) and ``g_H`` (of the entropy):

.. math::

    \\mathrm{lse} = m + \\log s, \\qquad \\log \\pi(a) = x_a - \\mathrm{lse}, \\qquad
    H = \\log s - \\frac{1}{s} \\sum_v e^{d_v} d_v,

    \\frac{\\partial (g_{lp} \\log \\pi(a) + g_H H)}{\\partial x_v}
    = p_v \\, (c \\log p_v + b) + g_{lp} [v = a], \\qquad
    c = -g_H, \\quad b = -(g_{lp} + g_H H),

with ``p = softmax(x)``, ``log p_v = x_v - lse``. The entropy is written with ``d <= 0`` so that
its two terms are both non-negative (no cancellation, unlike ``lse - sum_v p_v x_v``). The term
``g_lp [v = a]`` (one entry per row) is left to the caller, which adds it once for all rows.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

__all__ = ["chunk_grad", "chunk_stats", "compiled", "use_compile"]

#: ``0`` runs the eager chunk math everywhere, ``1`` compiles it everywhere (the CPU included);
#: unset, it is compiled on CUDA when Triton is installed.
COMPILE_ENV = "TORCHRL_GRPO_COMPILE"
_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def chunk_stats(x, index, lse, entropy, log_prob) -> None:
    """Log-sum-exp, entropy and sampled log-prob of one chunk of logits, written in place.

    .. math:: \\mathrm{lse} = m + \\log s, \\quad H = \\log s - \\frac{1}{s} \\sum_v e^{d_v}
        d_v, \\quad \\log \\pi(a) = x_a - \\mathrm{lse}

    Five passes over ``x`` in eager mode (``amax``, ``sub``, ``exp``, ``sum``, ``mul``, the last
    sum read from the product); two float32 ``(n, V)`` temporaries.

    Args:
        x (torch.Tensor): a chunk of logits ``(n, V)``, any floating dtype.
        index (torch.Tensor): the sampled token of each row ``(n, 1)``, int64 in ``[0, V)``.
        lse (torch.Tensor): ``(n,)`` output, float32 or wider (the dtype of the computation).
        entropy (torch.Tensor): ``(n,)`` output, same dtype.
        log_prob (torch.Tensor): ``(n,)`` output, same dtype.

    Examples:
        >>> import torch
        >>> from torchrl_grpo.token_chunk import chunk_stats
        >>> x = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
        >>> lse, entropy, log_prob = torch.empty(3, 2)
        >>> chunk_stats(x, torch.tensor([[1], [0]]), lse, entropy, log_prob)
        >>> torch.allclose(lse, x.logsumexp(-1)), log_prob
        (True, tensor([-0.6931, -0.1269]))
        >>> torch.allclose(entropy, torch.distributions.Categorical(logits=x).entropy())
        True
    """
    m = x.amax(-1, keepdim=True).to(lse.dtype)  # (n, 1), exact
    d = torch.sub(x, m)  # (n, V) in lse's dtype (type promotion: bf16 x is read, not copied)
    e = d.exp()  # (n, V)
    s = e.sum(-1)  # (n,)
    log_s = s.log()
    torch.sub(log_s, e.mul_(d).sum(-1).div_(s), out=entropy)
    torch.add(log_s, m.squeeze(-1), out=lse)
    torch.sub(x.gather(-1, index).squeeze(-1), lse, out=log_prob)


def chunk_grad(x, lse, scale, shift, out=None) -> torch.Tensor:
    """The gradient on one chunk of logits, without the sampled token's term.

    .. math:: g_v = p_v \\, (c \\log p_v + b), \\qquad \\log p_v = x_v - \\mathrm{lse}

    Four passes over ``x`` in eager mode (three without ``scale``); two float32 ``(n, V)``
    temporaries, the second reused for the result when ``out`` is not given.

    Args:
        x (torch.Tensor): a chunk of logits ``(n, V)``, any floating dtype.
        lse (torch.Tensor): its log-sum-exp ``(n, 1)``, float32 or wider.
        scale (torch.Tensor or None): ``c = -g_H`` ``(n, 1)``; ``None`` when the entropy has no
            gradient.
        shift (torch.Tensor): ``b = -(g_lp + g_H H)`` ``(n, 1)``.
        out (torch.Tensor, optional): where to write the result ``(n, V)``, of any floating
            dtype (the logits' gradient in their dtype, rounded once).

    Returns:
        torch.Tensor: ``out``, or a new ``(n, V)`` tensor in ``lse``'s dtype.

    Examples:
        >>> import torch
        >>> from torchrl_grpo.token_chunk import chunk_grad
        >>> x = torch.tensor([[0.0, 0.0]])  # p = (1/2, 1/2); d log pi(a) / dx = [v = a] - p
        >>> chunk_grad(x, x.logsumexp(-1, keepdim=True), None, torch.tensor([[-1.0]]))
        tensor([[-0.5000, -0.5000]])
    """
    log_p = torch.sub(x, lse)  # (n, V) in lse's dtype
    if scale is None:
        p = log_p.exp_()
        return torch.mul(p, shift, out=p if out is None else out)
    p = log_p.exp()
    torch.addcmul(shift, scale, log_p, out=log_p)  # c log p + b, in place
    return torch.mul(p, log_p, out=p if out is None else out)


def use_compile(device: torch.device, compile: bool | None = None) -> bool:
    """Whether the chunk math runs compiled: ``compile`` if given, else the environment.

    ``TORCHRL_GRPO_COMPILE=0`` turns it off, ``=1`` on (the CPU included, where the first call
    compiles for 20-30 s and later ones take about two thirds of the eager time); unset,
    it is on for CUDA tensors when Triton, Inductor's GPU code generator, is installed.

    Args:
        device (torch.device): where the logits are.
        compile (bool, optional): the caller's choice, which wins.

    Returns:
        bool: ``True`` to run :func:`compiled` chunk functions.

    Raises:
        ValueError: if ``TORCHRL_GRPO_COMPILE`` is set to something else than 0/1.

    Examples:
        >>> import torch
        >>> from torchrl_grpo.token_chunk import use_compile
        >>> use_compile(torch.device("cpu")), use_compile(torch.device("cpu"), compile=True)
        (False, True)
    """
    if compile is not None:
        return bool(compile)
    setting = os.environ.get(COMPILE_ENV, "").strip().lower()
    if setting in _ON or setting in _OFF:
        return setting in _ON
    if setting:
        raise ValueError(f"{COMPILE_ENV}={setting!r}: expected 0 or 1 (or unset).")
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


class _Compiled:
    """``fn`` through ``torch.compile``; ``fn`` itself once a compilation has failed.

    A failure (no compiler, an unsupported operator) warns once and turns every compiled chunk
    function of the process back to eager: the numbers are the same to float rounding, only the
    number of kernels differs. Inside a caller's own ``torch.compile`` region, ``fn`` is traced
    as written.
    """

    failed = False  # shared: after one failure, no chunk function tries again

    def __init__(self, fn):
        self.fn = fn
        self._compiled = None
        self.__name__ = f"compiled({fn.__name__})"

    def __call__(self, *args):
        if _Compiled.failed or torch.compiler.is_compiling():
            return self.fn(*args)
        try:
            if self._compiled is None:
                self._compiled = torch.compile(self.fn)
            return self._compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # whatever failed in compiling: fall back
            _Compiled.failed = True
            cause = (str(error).strip().splitlines() or [""])[0]
            warnings.warn(
                f"torch.compile of the token loss's chunk math failed ({type(error).__name__}: "
                f"{cause}); running it eagerly from now on (same numbers, more kernels). Set "
                f"{COMPILE_ENV}=0 to skip the attempt.",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.fn(*args)


#: The compiled forms, one per function (each compiles at its first call).
_COMPILED = {fn: _Compiled(fn) for fn in (chunk_stats, chunk_grad)}


def compiled(fn):
    """The compiled form of :func:`chunk_stats` or :func:`chunk_grad` (same arguments).

    Args:
        fn: one of the two chunk functions.

    Returns:
        A callable that runs ``torch.compile(fn)``, or ``fn`` after a compilation failure.

    Examples:
        >>> from torchrl_grpo.token_chunk import chunk_grad, compiled
        >>> compiled(chunk_grad).__name__
        'compiled(chunk_grad)'
    """
    return _COMPILED[fn]
