"""Per-token log-probs and entropies over a large vocabulary without full-vocabulary copies.

``torch.distributions.Categorical(logits=...)`` over ``[B, T, V]`` logits stores normalised
logits (``logits - logsumexp``) and, for the entropy, the softmax and ``p * log p``: each a full
``B x T x V`` tensor kept alive for the backward pass. For an LLM (``V`` ~ 32k-256k) these copies
dominate the memory of the loss. :func:`token_log_prob_entropy` computes both quantities in one
autograd node that saves only the logits (which the caller holds anyway) and three ``[B, T]``
vectors, and works through the vocabulary in row chunks, so that its temporaries are a few
``chunk x V`` blocks. :class:`TokenCategorical` wraps it as a ``torch.distributions``
distribution that torchrl actors and :class:`~torchrl_grpo.loss.GRPOLoss` use like
``Categorical``.

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

__all__ = ["TokenCategorical", "token_log_prob_entropy"]

#: Elements per chunk (rows x vocabulary) when no chunk size is given: 2**20 float32 = 4 MiB.
_CHUNK_ELEMENTS = 2**20


def _chunk_rows(chunk_size: int | None, vocab: int) -> int:
    if chunk_size is None:
        return max(1, _CHUNK_ELEMENTS // vocab)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}.")
    return chunk_size


class _TokenLogProbEntropy(torch.autograd.Function):
    """Fused, chunked log-prob of the sampled tokens and entropy; saves no ``(N, V)`` tensor."""

    @staticmethod
    def forward(ctx, logits, tokens, rows):
        # logits (N, V), tokens (N,) int64; negative tokens are padding
        n = logits.shape[0]
        dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16/fp16 -> fp32
        lse = torch.empty(n, dtype=dtype, device=logits.device)  # (N,)
        entropy = torch.empty_like(lse)  # (N,)
        log_prob = torch.empty_like(lse)  # (N,)
        is_pad = tokens < 0  # (N,)
        index = tokens.clamp_min(0).unsqueeze(-1)  # (N, 1)
        for start in range(0, n, rows):
            rows_ = slice(start, start + rows)
            x = logits[rows_].to(dtype)  # (n, V); a view when logits are float32
            chunk_lse = torch.logsumexp(x, -1)  # (n,)
            p = (x - chunk_lse.unsqueeze(-1)).exp_()  # (n, V)
            entropy[rows_] = chunk_lse - p.mul_(x).sum(-1)
            log_prob[rows_] = x.gather(-1, index[rows_]).squeeze(-1) - chunk_lse
            lse[rows_] = chunk_lse
        log_prob.masked_fill_(is_pad, 0.0)
        ctx.rows = rows
        ctx.save_for_backward(logits, index, is_pad, lse, entropy)
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_prob, grad_entropy):
        logits, index, is_pad, lse, entropy = ctx.saved_tensors
        if grad_log_prob is None and grad_entropy is None:
            return None, None, None
        grad = torch.empty_like(logits)  # (N, V): the gradient itself, the only full-size output
        dtype = lse.dtype
        if grad_log_prob is not None:
            grad_log_prob = grad_log_prob.to(dtype).masked_fill(is_pad, 0.0)
        for start in range(0, logits.shape[0], ctx.rows):
            rows_ = slice(start, start + ctx.rows)
            x = logits[rows_].to(dtype)  # (n, V)
            log_p = x - lse[rows_].unsqueeze(-1)  # (n, V), a new buffer
            p = log_p.exp()  # (n, V)
            # d/dx of  g_lp * log pi(a) + g_H * H  =  g_lp * ([v = a] - p) - g_H * p * (log p + H)
            if grad_entropy is not None:
                g = log_p.add_(entropy[rows_].unsqueeze(-1)).mul_(grad_entropy[rows_].unsqueeze(-1))
                if grad_log_prob is not None:
                    g.add_(grad_log_prob[rows_].unsqueeze(-1))
                g.mul_(p).neg_()
            else:
                g = p.mul_(grad_log_prob[rows_].unsqueeze(-1)).neg_()
            if grad_log_prob is not None:
                g.scatter_add_(-1, index[rows_], grad_log_prob[rows_].unsqueeze(-1))
            grad[rows_] = g
        return grad, None, None


def token_log_prob_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, *, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of the sampled tokens and entropy of a categorical over a large vocabulary.

    .. math:: \\log \\pi(a_t) = x_{t,a_t} - \\operatorname{logsumexp}_v x_{t,v}, \\qquad
        H_t = \\operatorname{logsumexp}_v x_{t,v} - \\sum_v \\operatorname{softmax}(x_t)_v\\, x_{t,v}

    Same values as ``Categorical(logits=logits).log_prob(tokens)`` and ``.entropy()`` (within
    float32 rounding), computed in one autograd node that keeps no full-vocabulary tensor for
    backward, with temporaries of ``chunk_size x V``. The backward pass writes the logits'
    gradient chunk by chunk into one ``[..., V]`` buffer. Computation is in float32 at least
    (bf16 / fp16 logits are upcast a chunk at a time; float64 stays float64), and the outputs
    have that dtype; the gradient has the logits' dtype.

    Tokens below zero are padding (e.g. ``-100``): their log-prob is ``0`` and sends no gradient;
    their entropy is still computed (mask it downstream). Not twice differentiable.

    Args:
        logits (torch.Tensor): unnormalised log-probabilities ``[..., V]``. Should be contiguous:
            a non-contiguous tensor is copied once by ``reshape``.
        tokens (torch.Tensor): integer token ids ``[...]``, in ``[0, V)`` or negative for padding.
        chunk_size (int, optional): rows (positions) per chunk. Defaults to ``2**20 // V``
            (4 MiB float32 blocks).

    Returns:
        tuple[torch.Tensor, torch.Tensor]: ``(log_prob, entropy)``, each ``[...]``, in float32
        (float64 for float64 logits).

    Raises:
        ValueError: if the shapes of ``logits`` and ``tokens`` do not match.
        IndexError: if a token id is ``>= V``.

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
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} do not match: "
            "expected logits of shape tokens.shape + (V,)."
        )
    vocab = logits.shape[-1]
    if tokens.numel() and int(tokens.max()) >= vocab:
        raise IndexError(
            f"token id {int(tokens.max())} is out of range for a vocabulary of {vocab}."
        )
    rows = _chunk_rows(chunk_size, vocab)
    log_prob, entropy = _TokenLogProbEntropy.apply(
        logits.reshape(-1, vocab), tokens.reshape(-1).long(), rows
    )
    return log_prob.view(tokens.shape), entropy.view(tokens.shape)


class TokenCategorical(Distribution):
    """Categorical over a token vocabulary with memory-lean log-prob and entropy.

    A drop-in for ``torch.distributions.Categorical(logits=...)`` as the ``distribution_class``
    of a torchrl actor whose head emits ``[B, T, V]`` logits. :meth:`log_prob` and
    :meth:`entropy` go through :func:`token_log_prob_entropy`; when both are asked for (as
    :class:`~torchrl_grpo.loss.GRPOLoss` does with an entropy bonus), the entropy is the second
    output of the same fused node, so the backward pass visits the logits once. Sampling and
    :attr:`mode` are not memory-optimised (they run without gradient).

    .. math:: \\pi(a) = \\operatorname{softmax}(x)_a

    Args:
        logits (torch.Tensor): unnormalised log-probabilities ``[..., V]``.
        chunk_size (int, optional): rows per chunk, see :func:`token_log_prob_entropy`.

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
    has_rsample = False

    def __init__(self, logits: torch.Tensor, chunk_size: int | None = None, validate_args=None):
        if logits.ndim < 1:
            raise ValueError("logits must have at least one dimension (the vocabulary).")
        self.logits = logits
        self.chunk_size = chunk_size
        self._entropy = None
        super().__init__(batch_shape=logits.shape[:-1], validate_args=False)

    @property
    def support(self):
        """Token ids ``0 .. V - 1``."""
        return constraints.integer_interval(0, self.logits.shape[-1] - 1)

    @property
    def probs(self) -> torch.Tensor:
        """``softmax(logits)``: a full ``[..., V]`` tensor, for inspection only."""
        return self.logits.softmax(-1)

    @property
    def mode(self) -> torch.Tensor:
        """The most likely token at each position."""
        return self.logits.argmax(-1)

    @property
    def deterministic_sample(self) -> torch.Tensor:
        """Same as :attr:`mode` (torchrl's deterministic exploration)."""
        return self.mode

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

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """Log-probability of token ids (negative ids are padding and score 0).

        Args:
            value (torch.Tensor): token ids of the batch shape.

        Returns:
            torch.Tensor: log-probs of the batch shape (float32 or float64).
        """
        log_prob, entropy = token_log_prob_entropy(self.logits, value, chunk_size=self.chunk_size)
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
        dummy = torch.zeros(self.batch_shape, dtype=torch.long, device=self.logits.device)
        _, entropy = token_log_prob_entropy(self.logits, dummy, chunk_size=self.chunk_size)
        return entropy
