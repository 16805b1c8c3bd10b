"""Per-token log-probs and entropies over a large vocabulary without full-vocabulary copies.

``torch.distributions.Categorical(logits=...)`` over ``[B, T, V]`` logits stores normalised
logits (``logits - logsumexp``) and, for the entropy, the softmax and ``p * log p``: each a full
``B x T x V`` tensor kept alive for the backward pass. For an LLM (``V`` ~ 32k-256k) these copies
dominate the memory of the loss. :func:`token_log_prob_entropy` computes both quantities in one
autograd node that saves only the logits (which the caller holds anyway) and three ``[B, T]``
vectors, and works through the vocabulary in row chunks, so that its temporaries are a few
``chunk x V`` blocks. :class:`TokenCategorical` wraps it as a ``torch.distributions``
distribution that torchrl actors and :class:`~torchrl_grpo.GRPOLoss` use like
``Categorical``.

One step further, :func:`token_log_prob_entropy_from_hidden` starts from the last hidden states
``[B, T, H]`` and the output layer (weight ``[V, H]``, optional bias) and computes each chunk's
logits on the fly, in the forward pass and again in the backward pass, so that the ``[B, T, V]``
logits never exist (as Liger-Kernel's fused-linear losses). :class:`HiddenTokenCategorical`
wraps it as a distribution for a torchrl actor whose network returns hidden states. The chunks'
size lives in one helper, :func:`_chunk_rows`; the maths of one chunk, eager or compiled by
``torch.compile``, in :mod:`torchrl_grpo.token_chunk`.

The maths, for one position with logits ``x``, ``lse = log sum_v exp(x_v)``, ``p = softmax(x)``
and sampled token ``a``:

.. math::

    \\log \\pi(a) = x_a - \\mathrm{lse}, \\qquad
    H = \\mathrm{lse} - \\sum_v p_v x_v, \\qquad
    \\frac{\\partial \\log \\pi(a)}{\\partial x_v} = [v = a] - p_v, \\qquad
    \\frac{\\partial H}{\\partial x_v} = -p_v (\\log p_v + H).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
from torch.distributions import Distribution, constraints

from torchrl_grpo import token_chunk
from torchrl_grpo.token_chunk import chunk_grad, chunk_stats

__all__ = [
    "HiddenTokenCategorical",
    "TokenCategorical",
    "log_probs_at_from_hidden",
    "token_log_prob_entropy",
    "token_log_prob_entropy_from_hidden",
    "top_log_probs_from_hidden",
]

#: Elements per chunk (rows x vocabulary) when no chunk size is given: 2**20 float32 = 4 MiB.
_CHUNK_ELEMENTS = 2**20
#: The same for :class:`~torchrl_grpo.LeanTransformersWrapper`, 32 MiB: each chunk streams the
#: whole output layer (``V x H``) through three matrix products, so a chunk must be tall enough
#: for that read to pay off (55 positions at Qwen's vocabulary), and at most 32 MiB, the largest
#: block glibc's allocator keeps for reuse instead of mapping it afresh (page faults) every
#: time. See ``docs/loss.rst``, "Without the logits".
_HIDDEN_CHUNK_ELEMENTS = 2**23
#: On an accelerator (CUDA...), the logits of one chunk: at most ``2**25`` (a 128 MiB float32
#: block; 220 positions at Qwen's V=151,936). There a pass over a chunk is one kernel launch
#: (5-20 us of host time) plus its memory traffic: at this size an eager pass moves 0.2-0.3 GB,
#: 40-60 us on an H200, so the device does not wait for the host to launch a chunk's ~17 eager
#: kernels (compiled: two, each about 30 us), while the eager chunk's temporaries (two float32
#: chunks) stay within 256 MiB whatever the batch. See :func:`_chunk_rows` for the bound.
_ACCELERATOR_CHUNK_ELEMENTS = 2**25


def _chunk_rows(
    chunk_size: int | None,
    vocab: int,
    positions: int = 0,
    device: torch.device | None = None,
    *,
    elements: int = _CHUNK_ELEMENTS,
) -> int:
    """Rows (positions) per chunk: ``chunk_size``, or the default for the device.

    The one place that sizes the chunks of both the logits and the hidden-state paths. On the
    CPU the default fills ``elements`` (by default ``_CHUNK_ELEMENTS``, a cache-friendly 4 MiB
    block). On an accelerator (any device but the CPU) a chunk holds up to
    ``_ACCELERATOR_CHUNK_ELEMENTS = 2**25`` logits (or ``elements`` if larger), and the
    ``positions`` are cut into chunks of equal size at most that: each chunk's passes are then
    long enough for the device's time to hide the host's launches.

    The memory bound of that rule: the eager chunk math holds at most two float32 chunks
    (:mod:`torchrl_grpo.token_chunk`), ``2 * 4 * 2**25`` bytes = 256 MiB whatever the batch and
    the vocabulary; the hidden-state path holds the chunk's logits besides (64 MiB in bf16),
    and the compiled chunk math no float32 chunk at all on the logits path. At the GPU
    benchmark's shape (8 x 1,024 positions, V=151,936: 2,374 MiB of bf16 logits) that is 38
    chunks of 216 positions and 0.11x the logits, where the earlier rule (at most 128 chunks)
    cut them into 128 chunks of 64 positions, holding three float32 chunks at a time (0.05x).

    Examples:
        >>> _chunk_rows(None, 32768)  # CPU: 32 positions of a 32k vocabulary
        32
        >>> _chunk_rows(None, 151936, 8192, torch.device("cuda"))  # 38 chunks of 216 or fewer
        216
        >>> _chunk_rows(None, 4096, 8192, torch.device("cuda"))  # a small vocabulary: one chunk
        8192
        >>> _chunk_rows(10, 151936, 8192, torch.device("cuda"))  # an explicit size wins
        10
        >>> _chunk_rows(None, 151936, elements=_HIDDEN_CHUNK_ELEMENTS)  # the lean wrapper's
        55
    """
    if chunk_size is None:
        rows = max(1, elements // vocab)
        if device is not None and device.type != "cpu":
            rows = max(rows, _ACCELERATOR_CHUNK_ELEMENTS // vocab)
            if positions > 0:  # equal chunks: as many as the bound needs, no small last one
                rows = -(-positions // -(-positions // rows))
        return rows
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}.")
    return chunk_size


def _chunks(n: int, rows: int):
    """Slices of ``rows`` consecutive positions covering ``range(n)``."""
    return (slice(start, start + rows) for start in range(0, n, rows))


def _check_tokens(tokens: torch.Tensor, batch_shape: torch.Size, vocab: int, what: str) -> None:
    """Shapes, and the range of the token ids where reading them costs no wait.

    On CUDA the ids are not read on the host (that would wait for the device): an id ``>= V``
    trips the device-side bounds assertion of the ``gather`` that reads it ("index out of
    bounds"), which stops the process loudly. A meta tensor has no values to read.
    """
    if batch_shape != tokens.shape:
        raise ValueError(
            f"{what} and tokens {tuple(tokens.shape)} do not match: expected {what} of shape "
            "tokens.shape + (...)."
        )
    if tokens.device.type in ("cuda", "meta") or not tokens.numel():
        return
    if int(tokens.max()) >= vocab:
        raise IndexError(
            f"token id {int(tokens.max())} is out of range for a vocabulary of {vocab}."
        )


def _chunk_fns(compile: bool):
    """The chunk functions of :mod:`torchrl_grpo.token_chunk`, compiled or as written."""
    if compile:
        return token_chunk.compiled(chunk_stats), token_chunk.compiled(chunk_grad)
    return chunk_stats, chunk_grad


def _grad_terms(grad_log_prob, grad_entropy, entropy, is_pad):
    """``(g_lp, c, b)`` of :func:`~torchrl_grpo.token_chunk.chunk_grad` for every row, as
    ``(N, 1)`` columns: ``g_lp`` (``None`` if the log-prob has no gradient; 0 at padding),
    ``c = -g_H`` (``None`` if the entropy has none) and ``b = -(g_lp + g_H H)``."""
    dtype = entropy.dtype
    g_lp = scale = None
    shift = torch.zeros_like(entropy)  # (N,)
    if grad_log_prob is not None:
        g_lp = grad_log_prob.to(dtype).masked_fill(is_pad, 0.0)  # (N,)
        shift = shift.sub_(g_lp)
        g_lp = g_lp.unsqueeze(-1)
    if grad_entropy is not None:
        g_h = grad_entropy.to(dtype)  # (N,)
        shift = shift.sub_(g_h * entropy)
        scale = g_h.neg().unsqueeze(-1)
    return g_lp, scale, shift.unsqueeze(-1)


def _rows(x: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if x is None else x[rows]


class _TokenLogProbEntropy(torch.autograd.Function):
    """Fused, chunked log-prob of the sampled tokens and entropy; saves no ``(N, V)`` tensor."""

    @staticmethod
    def forward(ctx, logits, tokens, rows, compile):
        # logits (N, V), tokens (N,) int64; negative tokens are padding
        n = logits.shape[0]
        dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16/fp16 -> fp32
        lse = torch.empty(n, dtype=dtype, device=logits.device)  # (N,)
        entropy, log_prob = torch.empty_like(lse), torch.empty_like(lse)  # (N,), (N,)
        is_pad = tokens < 0  # (N,)
        index = tokens.clamp_min(0).unsqueeze(-1)  # (N, 1)
        stats, _ = _chunk_fns(compile)
        for r in _chunks(n, rows):
            stats(logits[r], index[r], lse[r], entropy[r], log_prob[r])
        log_prob.masked_fill_(is_pad, 0.0)
        ctx.rows, ctx.compile = rows, compile
        ctx.save_for_backward(logits, index, is_pad, lse, entropy)
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_prob, grad_entropy):
        logits, index, is_pad, lse, entropy = ctx.saved_tensors
        if grad_log_prob is None and grad_entropy is None:
            return None, None, None, None
        g_lp, scale, shift = _grad_terms(grad_log_prob, grad_entropy, entropy, is_pad)
        lse = lse.unsqueeze(-1)  # (N, 1)
        grad = torch.empty_like(logits)  # (N, V): the gradient itself, the only full-size output
        _, grad_fn = _chunk_fns(ctx.compile)
        for r in _chunks(logits.shape[0], ctx.rows):
            grad_fn(logits[r], lse[r], _rows(scale, r), shift[r], grad[r])
        if g_lp is not None:  # the sampled token's entry, g_lp added, rounded once: (N, 1)
            at_token = chunk_grad(logits.gather(-1, index), lse, scale, shift).add_(g_lp)
            grad.scatter_(-1, index, at_token.to(grad.dtype))
        return grad, None, None, None


def token_log_prob_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    chunk_size: int | None = None,
    compile: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of the sampled tokens and entropy of a categorical over a large vocabulary.

    .. math:: \\log \\pi(a_t) = x_{t,a_t} - \\operatorname{logsumexp}_v x_{t,v}, \\qquad
        H_t = \\operatorname{logsumexp}_v x_{t,v}
            - \\sum_v \\operatorname{softmax}(x_t)_v\\, x_{t,v}

    Same values as ``Categorical(logits=logits).log_prob(tokens)`` and ``.entropy()`` (within
    float32 rounding), computed in one autograd node that keeps no full-vocabulary tensor for
    backward, with temporaries of ``chunk_size x V``. The backward pass writes the logits'
    gradient chunk by chunk into one ``[..., V]`` buffer. Computation is in float32 at least
    (bf16 / fp16 logits are upcast as they are read; float64 stays float64), and the outputs
    have that dtype; the gradient has the logits' dtype, rounded once. Each chunk goes through
    the chunk math of :mod:`torchrl_grpo.token_chunk` (five passes over it forward, four
    backward), compiled by ``torch.compile`` on CUDA when Triton is installed (one or two fused
    kernels, no temporary of the chunk's size); ``compile`` or ``TORCHRL_GRPO_COMPILE`` decide
    otherwise, and a failed compilation falls back to eager with one warning.

    Tokens below zero are padding (e.g. ``-100``): their log-prob is ``0`` and sends no gradient;
    their entropy is still computed (mask it downstream). Not twice differentiable.

    Args:
        logits (torch.Tensor): unnormalised log-probabilities ``[..., V]``. Should be contiguous:
            a non-contiguous tensor is copied once by ``reshape``.
        tokens (torch.Tensor): integer token ids ``[...]``, in ``[0, V)`` or negative for padding.
        chunk_size (int, optional): rows (positions) per chunk. Defaults to ``2**20 // V``
            (4 MiB float32 blocks) on the CPU, chunks of at most ``2**25`` logits (128 MiB in
            float32) on an accelerator (``_chunk_rows``).
        compile (bool, optional): run the chunk math through ``torch.compile``. Defaults to
            :func:`torchrl_grpo.token_chunk.use_compile`: ``TORCHRL_GRPO_COMPILE`` if set,
            else on CUDA with Triton.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``(log_prob, entropy)``, each ``[...]``, in float32
        (float64 for float64 logits).

    Raises:
        ValueError: if the shapes of ``logits`` and ``tokens`` do not match.
        IndexError: if a token id is ``>= V`` (on CUDA, the device's bounds assertion instead:
            checking on the host would wait for the device).

    Examples:
        >>> import torch
        >>> logits = torch.tensor([[0.0, 0.0], [2.0, 0.0]]).log_softmax(-1).requires_grad_()
        >>> log_prob, entropy = token_log_prob_entropy(logits, torch.tensor([1, -100]))
        >>> log_prob.detach(), entropy.detach()
        (tensor([-0.6931,  0.0000]), tensor([0.6931, 0.3653]))
        >>> log_prob.sum().backward()
        >>> logits.grad[0]  # [v == a] - p
        tensor([-0.5000,  0.5000])
        >>> logits.grad[1].abs().max()  # the pad sends no gradient
        tensor(0.)
    """
    vocab = logits.shape[-1]
    _check_tokens(tokens, logits.shape[:-1], vocab, f"logits {tuple(logits.shape)}")
    rows = _chunk_rows(chunk_size, vocab, tokens.numel(), logits.device)
    log_prob, entropy = _TokenLogProbEntropy.apply(
        logits.reshape(-1, vocab),
        tokens.reshape(-1).long(),
        rows,
        token_chunk.use_compile(logits.device, compile),
    )
    return log_prob.view(tokens.shape), entropy.view(tokens.shape)


class _HeadGrads:
    """The gradients of an output layer's inputs, accumulated chunk by chunk from each chunk's
    gradient on its logits ``g`` ``(n, V)``: ``grad_hidden = g W`` row by row, ``grad_W +=
    g^T h`` and ``grad_b += sum(g)`` in float32 at least; ``None`` where no input needs one."""

    def __init__(self, hidden, weight, bias, needs: tuple, dtype: torch.dtype):
        self.weight, self.bias = weight, bias
        self.hidden = torch.empty_like(hidden) if needs[0] else None  # (N, H)
        self.w = torch.zeros_like(weight, dtype=dtype) if needs[1] else None  # (V, H)
        self.b = torch.zeros_like(bias, dtype=dtype) if needs[2] else None  # (V,)

    def add(self, g: torch.Tensor, h: torch.Tensor, rows: slice) -> None:
        if self.hidden is not None:
            torch.mm(g.to(self.weight.dtype), self.weight, out=self.hidden[rows])  # (n, H)
        if self.w is not None:
            self.w.addmm_(g.t(), h.to(g.dtype))  # (V, H)
        if self.b is not None:
            self.b += g.sum(0)

    def result(self) -> tuple:
        """``(grad_hidden, grad_weight, grad_bias)`` in the inputs' dtypes."""
        w = None if self.w is None else self.w.to(self.weight.dtype)
        b = None if self.b is None else self.b.to(self.bias.dtype)
        return self.hidden, w, b


class _TokenLogProbEntropyFromHidden(torch.autograd.Function):
    """Log-prob and entropy from hidden states and an output layer; no ``(N, V)`` tensor lives
    beyond one chunk: each chunk's logits are computed in forward and recomputed in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, rows, compile):
        # hidden (N, H), weight (V, H), bias (V,) or None, tokens (N,) int64 (< 0: padding)
        n = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)  # (N,)
        entropy, log_prob = torch.empty_like(lse), torch.empty_like(lse)  # (N,), (N,)
        is_pad = tokens < 0  # (N,)
        index = tokens.clamp_min(0).unsqueeze(-1)  # (N, 1)
        stats, _ = _chunk_fns(compile)
        for r in _chunks(n, rows):
            x = torch.nn.functional.linear(hidden[r], weight, bias)  # (n, V)
            stats(x, index[r], lse[r], entropy[r], log_prob[r])
        log_prob.masked_fill_(is_pad, 0.0)
        ctx.rows, ctx.compile = rows, compile
        ctx.save_for_backward(hidden, weight, bias, index, is_pad, lse, entropy)
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_prob, grad_entropy):
        hidden, weight, bias, index, is_pad, lse, entropy = ctx.saved_tensors
        if grad_log_prob is None and grad_entropy is None:
            return None, None, None, None, None, None
        dtype = lse.dtype
        g_lp, scale, shift = _grad_terms(grad_log_prob, grad_entropy, entropy, is_pad)
        lse = lse.unsqueeze(-1)  # (N, 1)
        grads = _HeadGrads(hidden, weight, bias, ctx.needs_input_grad[:3], dtype)
        _, grad_fn = _chunk_fns(ctx.compile)
        for r in _chunks(hidden.shape[0], ctx.rows):
            h = hidden[r]  # (n, H)
            x = torch.nn.functional.linear(h, weight, bias)  # (n, V), recomputed
            g = grad_fn(x, lse[r], _rows(scale, r), shift[r])  # (n, V) float32
            if g_lp is not None:
                g.scatter_add_(-1, index[r], g_lp[r])
            grads.add(g, h, r)
        return *grads.result(), None, None, None


def token_log_prob_entropy_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
    compile: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token log-probs and entropy from the last hidden states, the logits never materialised.

    .. math:: x_t = W h_t + b, \\qquad \\log \\pi(a_t) = x_{t,a_t} - \\operatorname{logsumexp}_v
        x_{t,v}, \\qquad H_t = \\operatorname{logsumexp}_v x_{t,v} - \\sum_v
        \\operatorname{softmax}(x_t)_v\\, x_{t,v}

    The values of :func:`token_log_prob_entropy` on ``logits = hidden @ weight.T + bias``, and
    the same gradients with respect to ``hidden``, ``weight`` and ``bias``, computed chunk by
    chunk over the positions: each chunk's ``chunk_size x V`` logits are built from the hidden
    states, reduced to three numbers per position and dropped; the backward pass builds them
    again, turns them into the chunk's gradient on the logits ``g`` and accumulates
    ``grad_hidden = g W`` and ``grad_W += g^T h`` (as Liger-Kernel's fused linear losses do). The
    ``[..., V]`` logits never exist: memory beyond the inputs and their gradients is a few
    ``chunk_size x V`` blocks (and, for bf16/fp16 weights, a float32 accumulator of ``W``'s
    size). The price is the head's matrix product computed twice. Computation is in float32 at
    least; the outputs have that dtype, the gradients the inputs' dtypes.

    Tokens below zero are padding: log-prob ``0`` and no gradient (their entropy is computed;
    mask it downstream). Not twice differentiable.

    Args:
        hidden (torch.Tensor): last hidden states ``[..., H]``.
        weight (torch.Tensor): the output layer's weight ``[V, H]`` (``nn.Linear`` layout).
        tokens (torch.Tensor): integer token ids ``[...]`` (``hidden.shape[:-1]``), in
            ``[0, V)`` or negative for padding.
        bias (torch.Tensor, optional): the output layer's bias ``[V]``.
        chunk_size (int, optional): positions per chunk. Defaults to ``2**20 // V`` on the
            CPU, chunks of at most ``2**25`` logits on an accelerator.
        compile (bool, optional): run the chunk math through ``torch.compile``; see
            :func:`token_log_prob_entropy`.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``(log_prob, entropy)``, each ``[...]``.

    Raises:
        ValueError: if the shapes of ``hidden``, ``weight``, ``bias`` and ``tokens`` disagree.
        IndexError: if a token id is ``>= V`` (on CUDA, the device's bounds assertion).

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> hidden = torch.randn(2, 3, 4, requires_grad=True)
        >>> head = torch.nn.Linear(4, 7)
        >>> tokens = torch.randint(7, (2, 3))
        >>> log_prob, entropy = token_log_prob_entropy_from_hidden(
        ...     hidden, head.weight, tokens, head.bias, chunk_size=2)
        >>> ref_lp, ref_h = token_log_prob_entropy(head(hidden), tokens)
        >>> torch.allclose(log_prob, ref_lp, atol=1e-6), torch.allclose(entropy, ref_h, atol=1e-6)
        (True, True)
        >>> (log_prob.sum() + entropy.sum()).backward()
        >>> grad = torch.autograd.grad((ref_lp.sum() + ref_h.sum()), hidden)[0]
        >>> torch.allclose(hidden.grad, grad, atol=1e-6)
        True
    """
    vocab = _check_head(hidden, weight, bias)
    _check_tokens(tokens, hidden.shape[:-1], vocab, f"hidden {tuple(hidden.shape)}")
    rows = _chunk_rows(chunk_size, vocab, tokens.numel(), hidden.device)
    log_prob, entropy = _TokenLogProbEntropyFromHidden.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        tokens.reshape(-1).long(),
        rows,
        token_chunk.use_compile(hidden.device, compile),
    )
    return log_prob.view(tokens.shape), entropy.view(tokens.shape)


class _LogProbsAtFromHidden(torch.autograd.Function):
    """Log-probs of ``K`` given tokens per position from hidden states and an output layer; no
    ``(N, V)`` tensor lives beyond one chunk (built in forward, built again in backward)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, rows):
        # hidden (N, H), weight (V, H), bias (V,) or None, ids (N, K) int64 in [0, V)
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        lse = torch.empty(hidden.shape[0], 1, dtype=dtype, device=hidden.device)  # (N, 1)
        out = torch.empty(ids.shape, dtype=dtype, device=hidden.device)  # (N, K)
        for r in _chunks(hidden.shape[0], rows):
            x = torch.nn.functional.linear(hidden[r], weight, bias).to(dtype)  # (n, V)
            torch.logsumexp(x, -1, keepdim=True, out=lse[r])
            torch.sub(x.gather(-1, ids[r]), lse[r], out=out[r])
        ctx.rows = rows
        ctx.save_for_backward(hidden, weight, bias, ids, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        # d log p_k / d x_v = [v = id_k] - p_v: g = scatter(grad) - (sum_k grad_k) p
        hidden, weight, bias, ids, lse = ctx.saved_tensors
        dtype = lse.dtype
        grad_out = grad_out.to(dtype)  # (N, K)
        total = grad_out.sum(-1, keepdim=True)  # (N, 1)
        grads = _HeadGrads(hidden, weight, bias, ctx.needs_input_grad[:3], dtype)
        for r in _chunks(hidden.shape[0], ctx.rows):
            h = hidden[r]  # (n, H)
            x = torch.nn.functional.linear(h, weight, bias).to(dtype)  # (n, V), recomputed
            g = x.sub_(lse[r]).exp_().mul_(total[r].neg())  # (n, V)
            g.scatter_add_(-1, ids[r], grad_out[r])
            grads.add(g, h, r)
        return *grads.result(), None, None


def _check_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The vocabulary size of ``weight`` ``[V, H]``, after checking it against ``hidden`` and
    ``bias``."""
    if weight.ndim != 2 or hidden.shape[-1:] != weight.shape[1:]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not match: "
            "expected hidden [..., H] and weight [V, H]."
        )
    vocab = weight.shape[0]
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({vocab},).")
    return vocab


def log_probs_at_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The log-probs of ``K`` given tokens at each position, with their gradient, the logits
    never materialised: ``log_softmax(hidden @ weight.T + bias)`` read at ``ids``.

    A student's log-probs at a teacher's most likely tokens (:func:`top_log_probs_from_hidden`,
    :class:`~torchrl_grpo.TopKDistillationLoss`). As
    :func:`token_log_prob_entropy_from_hidden`, chunk by chunk over the positions: each chunk's
    logits are built, reduced to ``K + 1`` numbers per position and dropped, and built again in
    the backward pass. Computation is in float32 at least.

    Args:
        hidden (torch.Tensor): last hidden states ``[..., H]``.
        weight (torch.Tensor): the output layer's weight ``[V, H]``.
        ids (torch.Tensor): token ids ``[..., K]`` (``hidden.shape[:-1] + (K,)``) in ``[0, V)``.
        bias (torch.Tensor, optional): the output layer's bias ``[V]``.
        chunk_size (int, optional): positions per chunk, as
            :func:`token_log_prob_entropy_from_hidden`'s.

    Returns:
        torch.Tensor: ``[..., K]`` log-probs.

    Raises:
        ValueError: the shapes of ``hidden``, ``weight``, ``bias`` and ``ids`` disagree.
        IndexError: an id is outside ``[0, V)`` (read on the CPU only, as the tokens of
            :func:`token_log_prob_entropy_from_hidden`).

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> hidden, head = torch.randn(2, 3, 4, requires_grad=True), torch.nn.Linear(4, 7)
        >>> ids = torch.randint(7, (2, 3, 2))
        >>> lean = log_probs_at_from_hidden(hidden, head.weight, ids, head.bias, chunk_size=2)
        >>> dense = head(hidden).log_softmax(-1).gather(-1, ids)
        >>> torch.allclose(lean, dense, atol=1e-6)
        True
        >>> g_lean = torch.autograd.grad(lean.sum(), hidden)[0]
        >>> torch.allclose(g_lean, torch.autograd.grad(dense.sum(), hidden)[0], atol=1e-6)
        True
    """
    vocab = _check_head(hidden, weight, bias)
    if ids.ndim != hidden.ndim or ids.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"ids {tuple(ids.shape)} do not match hidden {tuple(hidden.shape)}: expected "
            "ids of shape hidden.shape[:-1] + (K,)."
        )
    flat_ids = ids.reshape(-1, ids.shape[-1]).long()  # (N, K)
    if flat_ids.device.type == "cpu" and flat_ids.numel():
        low, high = int(flat_ids.min()), int(flat_ids.max())
        if low < 0 or high >= vocab:
            raise IndexError(
                f"token id {low if low < 0 else high} is out of range for a vocabulary of {vocab}."
            )
    rows = _chunk_rows(chunk_size, vocab, flat_ids.shape[0], hidden.device)
    out = _LogProbsAtFromHidden.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, flat_ids, rows
    )
    return out.view(ids.shape)


def top_log_probs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
    among: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens at each position and their log-probs, without gradient and
    without the ``[..., V]`` logits: a teacher's top tokens
    (:class:`~torchrl_grpo.llm.TeacherLogProbs` with ``top_k``), a chunk of positions at a
    time. The log-probs are normalised over the whole output layer; ``among`` ranks the ids
    below it only (a tokenizer's ids, where the layer has padding rows beyond them).

    Args:
        hidden (torch.Tensor): last hidden states ``[..., H]``.
        weight (torch.Tensor): the output layer's weight ``[V, H]``.
        k (int): tokens per position, ``1 <= k <= V``.
        bias (torch.Tensor, optional): the output layer's bias ``[V]``.
        chunk_size (int, optional): positions per chunk.
        among (int, optional): rank the ids ``[0, among)`` only. Defaults to ``V``.

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``(log_probs, ids)``, each ``[..., k]``, the most
        likely first (float32 at least, and int64).

    Raises:
        ValueError: ``k`` outside ``[1, among]``, or the shapes disagree.

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> hidden, head = torch.randn(2, 3, 4), torch.nn.Linear(4, 7)
        >>> values, ids = top_log_probs_from_hidden(hidden, head.weight, 2, head.bias)
        >>> dense = head(hidden).log_softmax(-1).topk(2, -1)
        >>> torch.allclose(values, dense.values, atol=1e-6), torch.equal(ids, dense.indices)
        (True, True)
    """
    vocab = _check_head(hidden, weight, bias)
    among = vocab if among is None else min(among, vocab)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= among:
        raise ValueError(f"k must be an integer in [1, {among}] (the vocabulary), got {k!r}.")
    flat = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    rows = _chunk_rows(chunk_size, vocab, flat.shape[0], flat.device)
    values = torch.empty(flat.shape[0], k, dtype=dtype, device=flat.device)  # (N, k)
    ids = torch.empty(flat.shape[0], k, dtype=torch.long, device=flat.device)  # (N, k)
    with torch.no_grad():
        for r in _chunks(flat.shape[0], rows):
            x = torch.nn.functional.linear(flat[r], weight, bias).to(dtype)  # (n, V)
            top = x[:, :among].topk(k, -1)
            torch.sub(top.values, x.logsumexp(-1, keepdim=True), out=values[r])
            ids[r] = top.indices
    shape = hidden.shape[:-1] + (k,)
    return values.view(shape), ids.view(shape)


class _TokenDistribution(Distribution):
    """What :class:`TokenCategorical` and :class:`HiddenTokenCategorical` share: token ids
    ``0 .. V - 1``; the log-prob and the entropy from one fused autograd node
    (:meth:`_log_prob_entropy`), the entropy of the last :meth:`log_prob` reused when asked for
    in the same grad mode; the deterministic sample is the mode."""

    has_rsample = False

    def __init__(self, batch_shape: torch.Size, vocab_size: int, device: torch.device):
        self._vocab_size, self._device, self._entropy = vocab_size, device, None
        super().__init__(batch_shape=batch_shape, validate_args=False)

    def _log_prob_entropy(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @property
    def support(self):
        """Token ids ``0 .. V - 1``."""
        return constraints.integer_interval(0, self._vocab_size - 1)

    @property
    def deterministic_sample(self) -> torch.Tensor:
        """Same as :attr:`mode` (torchrl's deterministic exploration)."""
        return self.mode

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """Log-probability of token ids (negative ids are padding and score 0).

        Args:
            value (torch.Tensor): token ids of the batch shape.

        Returns:
            torch.Tensor: log-probs of the batch shape (float32 or float64).
        """
        log_prob, entropy = self._log_prob_entropy(value)
        # kept for entropy() only if it is what entropy() would compute now (same grad mode)
        self._entropy = (entropy, torch.is_grad_enabled())
        return log_prob

    def entropy(self) -> torch.Tensor:
        """Entropy at each position.

        Shares the autograd node of the last :meth:`log_prob` when that call ran in the same
        grad mode (one backward visit of the logits); otherwise it is computed again, so that
        ``entropy()`` has a gradient whenever the logits do, as ``Categorical.entropy()``.

        Returns:
            torch.Tensor: entropies of the batch shape (float32 or float64).
        """
        if self._entropy is not None and self._entropy[1] == torch.is_grad_enabled():
            return self._entropy[0]
        dummy = torch.zeros(self.batch_shape, dtype=torch.long, device=self._device)
        return self._log_prob_entropy(dummy)[1]


class TokenCategorical(_TokenDistribution):
    """Categorical over a token vocabulary with memory-lean log-prob and entropy.

    A drop-in for ``torch.distributions.Categorical(logits=...)`` as the ``distribution_class``
    of a torchrl actor whose head emits ``[B, T, V]`` logits. :meth:`log_prob` and
    :meth:`entropy` go through :func:`token_log_prob_entropy`; when both are asked for (as
    :class:`~torchrl_grpo.GRPOLoss` does with an entropy bonus), the entropy is the second
    output of the same fused node, so the backward pass visits the logits once. Sampling and
    :attr:`mode` are not memory-optimised (they run without gradient).

    .. math:: \\pi(a) = \\operatorname{softmax}(x)_a

    Args:
        logits (torch.Tensor): unnormalised log-probabilities ``[..., V]``.
        chunk_size (int, optional): rows per chunk, see :func:`token_log_prob_entropy`.
        compile (bool, optional): compile the chunk math, see :func:`token_log_prob_entropy`.

    Examples:
        >>> import torch
        >>> logits = torch.randn(2, 3, 11)
        >>> dist = TokenCategorical(logits)
        >>> tokens = dist.sample()
        >>> reference = torch.distributions.Categorical(logits=logits)
        >>> torch.allclose(dist.log_prob(tokens), reference.log_prob(tokens), atol=1e-6)
        True
        >>> torch.allclose(dist.entropy(), reference.entropy(), atol=1e-6)
        True

        As the head of a torchrl actor:

        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor
        >>> head = TensorDictModule(torch.nn.Linear(4, 11), ["hidden"], ["logits"])
        >>> actor = ProbabilisticActor(head, in_keys=["logits"], out_keys=["tokens"],
        ...     distribution_class=TokenCategorical, return_log_prob=True)
        >>> actor(TensorDict({"hidden": torch.randn(2, 3, 4)}, [2]))["tokens_log_prob"].shape
        torch.Size([2, 3])
    """

    arg_constraints = {"logits": constraints.real_vector}

    def __init__(
        self,
        logits: torch.Tensor,
        chunk_size: int | None = None,
        validate_args=None,
        *,
        compile: bool | None = None,
    ):
        if logits.ndim < 1:
            raise ValueError("logits must have at least one dimension (the vocabulary).")
        self.logits = logits
        self.chunk_size, self.compile = chunk_size, compile
        super().__init__(logits.shape[:-1], logits.shape[-1], logits.device)

    @property
    def probs(self) -> torch.Tensor:
        """``softmax(logits)``: a full ``[..., V]`` tensor, for inspection only."""
        return self.logits.softmax(-1)

    @property
    def mode(self) -> torch.Tensor:
        """The most likely token at each position."""
        return self.logits.argmax(-1)

    def sample(self, sample_shape: torch.Size | tuple[int, ...] = ()) -> torch.Tensor:
        """Sample token ids (without gradient).

        Args:
            sample_shape (torch.Size or tuple of int): extra leading dimensions.

        Returns:
            torch.Tensor: token ids, ``sample_shape + batch_shape``.
        """
        with torch.no_grad():
            dist = torch.distributions.Categorical(logits=self.logits)
            return dist.sample(torch.Size(sample_shape))

    def _log_prob_entropy(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_log_prob_entropy(
            self.logits, value, chunk_size=self.chunk_size, compile=self.compile
        )

    def log_probs_at(self, ids: torch.Tensor) -> torch.Tensor:
        """The log-probs of ``K`` token ids at each position (``batch_shape + (K,)`` ids and
        log-probs), as :meth:`HiddenTokenCategorical.log_probs_at`."""
        return self.logits.log_softmax(-1).gather(-1, ids.long())


class HiddenTokenCategorical(_TokenDistribution):
    """Categorical over a vocabulary, given the last hidden states and the output layer.

    The distribution of :class:`TokenCategorical` with ``logits = head(hidden)``, but the
    ``[..., V]`` logits are never built: :meth:`log_prob` and :meth:`entropy` go through
    :func:`token_log_prob_entropy_from_hidden`, which computes them chunk by chunk, and share
    one autograd node when both are asked for (as :class:`~torchrl_grpo.GRPOLoss` does).
    Use it as the ``distribution_class`` of a torchrl actor whose network returns hidden states,
    with the output layer passed as ``distribution_kwargs={"head": lm_head}``; every term of
    :class:`~torchrl_grpo.GRPOLoss` then works unchanged. The head's parameters must belong
    to the actor's network (e.g. the network holds the whole causal LM and returns its last
    hidden states) so that the loss sees and trains them. Sampling and :attr:`mode` work chunk by
    chunk too, without gradient.

    .. math:: \\pi(a \\mid h) = \\operatorname{softmax}(W h + b)_a

    Args:
        hidden (torch.Tensor): last hidden states ``[..., H]``.
        head (torch.nn.Module): the output layer: ``head.weight`` ``[V, H]`` and an optional
            ``head.bias`` ``[V]`` (a ``torch.nn.Linear``), read when the distribution is built.
        chunk_size (int, optional): positions per chunk, see
            :func:`token_log_prob_entropy_from_hidden`.
        compile (bool, optional): compile the chunk math, see :func:`token_log_prob_entropy`.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.modules import ProbabilisticActor
        >>> class TinyLM(torch.nn.Module):  # returns hidden states; holds its head
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.body, self.lm_head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 11)
        ...     def forward(self, x):
        ...         return torch.tanh(self.body(x))
        >>> lm = TinyLM()
        >>> actor = ProbabilisticActor(TensorDictModule(lm, ["x"], ["hidden"]),
        ...     in_keys=["hidden"], out_keys=["tokens"], distribution_class=HiddenTokenCategorical,
        ...     distribution_kwargs={"head": lm.lm_head}, return_log_prob=True)
        >>> td = actor(TensorDict(x=torch.randn(2, 3, 4), batch_size=[2]))
        >>> td["tokens"].shape, td["tokens_log_prob"].shape
        (torch.Size([2, 3]), torch.Size([2, 3]))
        >>> reference = TokenCategorical(lm.lm_head(td["hidden"]))
        >>> torch.allclose(td["tokens_log_prob"], reference.log_prob(td["tokens"]), atol=1e-6)
        True
    """

    arg_constraints = {}

    def __init__(
        self,
        hidden: torch.Tensor,
        head: torch.nn.Module,
        chunk_size: int | None = None,
        validate_args=None,
        *,
        compile: bool | None = None,
    ):
        weight = getattr(head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            raise ValueError(
                "head must have a 2-d weight [V, H] (a torch.nn.Linear); "
                f"got {type(head).__name__}."
            )
        if hidden.ndim < 1 or hidden.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"hidden {tuple(hidden.shape)} does not match the head's weight "
                f"{tuple(weight.shape)}: expected hidden [..., {weight.shape[1]}]."
            )
        self.hidden = hidden
        self.weight = weight
        self.bias = getattr(head, "bias", None)
        self.chunk_size, self.compile = chunk_size, compile
        super().__init__(hidden.shape[:-1], weight.shape[0], hidden.device)

    @property
    def logits(self) -> torch.Tensor:
        """``head(hidden)``: a full ``[..., V]`` tensor, for inspection only."""
        return torch.nn.functional.linear(self.hidden, self.weight, self.bias)

    def _per_chunk(self, fn) -> torch.Tensor:
        # fn(logits (n, V)) -> (..., n) ids, applied chunk by chunk without gradient
        flat = self.hidden.reshape(-1, self.hidden.shape[-1])  # (N, H)
        rows = _chunk_rows(self.chunk_size, self.weight.shape[0], flat.shape[0], flat.device)
        with torch.no_grad():
            parts = [
                fn(torch.nn.functional.linear(flat[r], self.weight, self.bias))
                for r in _chunks(flat.shape[0], rows)
            ]
        return torch.cat(parts, -1)

    @property
    def mode(self) -> torch.Tensor:
        """The most likely token at each position."""
        return self._per_chunk(lambda x: x.argmax(-1)).view(self.batch_shape)

    def sample(self, sample_shape: torch.Size | tuple[int, ...] = ()) -> torch.Tensor:
        """Sample token ids (without gradient), chunk by chunk.

        Args:
            sample_shape (torch.Size or tuple of int): extra leading dimensions.

        Returns:
            torch.Tensor: token ids, ``sample_shape + batch_shape``.
        """
        shape = torch.Size(sample_shape)

        def draw(x):  # (n, V) -> (*shape, n)
            return torch.distributions.Categorical(logits=x).sample(shape)

        return self._per_chunk(draw).view(shape + self.batch_shape)

    def _log_prob_entropy(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_log_prob_entropy_from_hidden(
            self.hidden,
            self.weight,
            value,
            self.bias,
            chunk_size=self.chunk_size,
            compile=self.compile,
        )

    def log_probs_at(self, ids: torch.Tensor) -> torch.Tensor:
        """The log-probs of ``K`` token ids at each position, with their gradient, chunk by
        chunk (:func:`log_probs_at_from_hidden`).

        Args:
            ids (torch.Tensor): ``batch_shape + (K,)`` token ids.

        Returns:
            torch.Tensor: ``batch_shape + (K,)`` log-probs.
        """
        return log_probs_at_from_hidden(
            self.hidden, self.weight, ids, self.bias, chunk_size=self.chunk_size
        )
