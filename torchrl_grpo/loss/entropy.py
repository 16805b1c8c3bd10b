"""The adaptive entropy coefficient of Skywork-OR1, as a module a GRPOLoss holds.

:class:`AdaptiveEntropy` keeps what the controller needs between calls (the entropy seen since
its last update and the entropy it measured then) as buffers, so that they are saved with the
loss's ``state_dict``; the update rule itself is
:func:`~torchrl_grpo.loss_terms.adaptive_entropy_coeff`.
"""

from __future__ import annotations

import torch

from torchrl_grpo.loss_terms import adaptive_entropy_coeff

__all__ = ["AdaptiveEntropy"]


class AdaptiveEntropy(torch.nn.Module):
    """The entropy bonus's coefficient steered toward a target entropy (TRL's rule).

    Every call in training mode with gradients on (not an evaluation under
    ``torch.no_grad()``) adds its real tokens' entropy to a window (float64); :meth:`update`
    (once per optimizer step) measures the window's token-weighted mean entropy ``H``, moves
    the coefficient by ``step`` toward keeping ``H`` at ``target`` and empties the window. A
    call applies the coefficient only while the ``H`` last measured is at or below the target
    (0 before the first update), as TRL's ``use_adaptive_entropy``.

    Args:
        target (float): the target entropy ``H*`` (nats per token).
        low (float): the coefficient's minimum.
        high (float): its maximum.
        step (float): its step per update.

    Examples:
        >>> import torch
        >>> from torchrl_grpo.loss.entropy import AdaptiveEntropy
        >>> controller = AdaptiveEntropy(target=0.5, low=0.0, high=1.0, step=0.1)
        >>> coeff = torch.tensor(0.2)
        >>> entropy, mask = torch.tensor([[0.3, 0.1, 9.0]]), torch.tensor([[True, True, False]])
        >>> controller.applied(coeff, entropy, mask)  # nothing measured yet: no bonus
        tensor(0.)
        >>> controller.update(0.2)  # H = 0.2 <= 0.5: up by one step
        0.30000000000000004
        >>> controller.applied(torch.tensor(0.3), entropy, mask)
        tensor(0.3000)
    """

    def __init__(self, target: float, low: float, high: float, step: float, device=None):
        super().__init__()
        self.target, self.low, self.high, self.step = target, low, high, step
        # (entropy sum, token count) since the last update, and the entropy it measured
        self.register_buffer("window", torch.zeros(2, dtype=torch.float64, device=device))
        self.register_buffer("last_entropy", torch.tensor(float("inf"), device=device))

    def applied(
        self, coeff: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The coefficient this call applies (``coeff`` or 0); records the batch's entropy in
        training mode, with gradients on.

        Args:
            coeff (torch.Tensor): the coefficient now (the loss's ``entropy_coeff``).
            entropy (torch.Tensor): per-token entropy ``(B, T)``.
            mask (torch.Tensor): boolean ``(B, T)``, ``True`` on real tokens.
        """
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                real = mask.to(torch.float64)
                self.window += torch.stack([(entropy.double() * real).sum(), real.sum()])
        return torch.where(self.last_entropy <= self.target, coeff, 0.0)

    def update(self, coeff: float) -> float:
        """One step of the controller from the window; returns the new coefficient.

        Raises:
            RuntimeError: no token recorded since the last update.
        """
        total, count = self.window.tolist()
        if count <= 0:
            raise RuntimeError(
                "update_entropy_coeff: no token seen since the last update; call the loss on "
                "the step's batches (in training mode) first."
            )
        entropy = total / count
        coeff = adaptive_entropy_coeff(coeff, entropy, self.target, self.low, self.high, self.step)
        self.last_entropy.fill_(entropy)
        self.window.zero_()
        return coeff
