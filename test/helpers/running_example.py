"""The running example of the loss-term tests, computed by hand.

Two sequences, the second one padded at its last token.

    row 0, A = +1: ratios 1.0, 1.1, 1.5
    row 1, A = -1: ratios 0.5, 4.0, (pad)

With clip 0.2 the PPO per-token losses are -min(rA, clip(r)A):
    row 0: -1.0, -1.1, -1.2        (sum -3.3)
    row 1:  max(0.5, 0.8) = 0.8, max(4.0, 1.2) = 4.0      (sum 4.8)
"""

from __future__ import annotations

import math

import torch

from torchrl_grpo.loss_terms import ppo_clip_loss

LOW, HIGH = math.log(0.8), math.log(1.2)
MASK = torch.tensor([[True, True, True], [True, True, False]])
RATIO = torch.tensor([[1.0, 1.1, 1.5], [0.5, 4.0, 7.0]])  # 7.0 sits in padding
ADV = torch.tensor([[1.0], [-1.0]])


def ppo_losses():
    return ppo_clip_loss(RATIO.log(), ADV, LOW, HIGH)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol
    )
