"""Pieces for torchrl's LLM stack that torchrl does not have.

* :class:`LeanTransformersWrapper`: torchrl's ``TransformersWrapper`` that scores tokens from
  the model's last hidden states and output layer, chunk by chunk, so that the ``[B, T, V]``
  logits never exist (in the forward or the backward pass).
* :class:`HiddenLLMMaskedCategorical`: the distribution it hands to a loss, torchrl's
  ``LLMMaskedCategorical`` computed from hidden states.
"""

from torchrl_grpo.llm.lean_wrapper import HiddenLLMMaskedCategorical, LeanTransformersWrapper

__all__ = ["HiddenLLMMaskedCategorical", "LeanTransformersWrapper"]
