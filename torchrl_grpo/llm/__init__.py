"""Pieces for torchrl's LLM stack that torchrl does not have.

* :class:`LeanTransformersWrapper`: torchrl's ``TransformersWrapper`` that scores tokens from
  the model's last hidden states and output layer, chunk by chunk, so that the ``[B, T, V]``
  logits never exist (in the forward or the backward pass).
* :class:`HiddenLLMMaskedCategorical`: the distribution it hands to a loss, torchrl's
  ``LLMMaskedCategorical`` computed from hidden states.
* :class:`ExactLogProbsTransformersWrapper`: torchrl's ``TransformersWrapper`` whose generation
  log-probs keep the first generated token's value (torchrl 0.14.1 zeroes it), for a sampler
  whose log-probs a loss reads as the behaviour policy's. Defined in :mod:`torchrl_grpo._compat`,
  where every reliance on a private torchrl name lives.
"""

from torchrl_grpo._compat import ExactLogProbsTransformersWrapper
from torchrl_grpo.llm.lean_wrapper import HiddenLLMMaskedCategorical, LeanTransformersWrapper

__all__ = [
    "ExactLogProbsTransformersWrapper",
    "HiddenLLMMaskedCategorical",
    "LeanTransformersWrapper",
]
