"""Pieces for torchrl's LLM stack that torchrl does not have. The private names of torchrl they
rely on are checked in one place, :mod:`torchrl_grpo._compat`.

* :class:`LeanTransformersWrapper`: torchrl's ``TransformersWrapper`` that scores tokens from
  the model's last hidden states and output layer, chunk by chunk, so that the ``[B, T, V]``
  logits never exist (in the forward or the backward pass).
* :class:`HiddenLLMMaskedCategorical`: the distribution it hands to a loss, torchrl's
  ``LLMMaskedCategorical`` computed from hidden states.
* :class:`ExactLogProbsTransformersWrapper`: torchrl's ``TransformersWrapper`` whose generation
  log-probs keep the first generated token's value (torchrl 0.14.1 zeroes it), for a sampler
  whose log-probs a loss reads as the behaviour policy's.
* :class:`ExactTurns`: an env transform for multi-turn dialogs on torchrl's ``ChatEnv`` in tokens
  mode: the next prompt is the dialog's tokens exactly as sampled, with the environment's reply,
  its own attention mask, a dialog id, and the stored turns cut to their real tokens.
* :func:`ragged_prompts`: torchrl's ``ChatEnv`` in tokens mode resets with prompts of different
  token lengths (torchrl 0.14.1 fails to stack them).
* :class:`ToolReply`: the environment's reply to each turn from a Python function (a tool,
  feedback on a wrong answer), in tokens, for :class:`ExactTurns`; a function that raises
  replies with its error (encodable by construction) and the dialog goes on.
* :class:`TurnReward`: each turn's reward from a Python function, and the dialogs it ends, in
  torchrl's LLM shapes: the reward transform beside :class:`ToolReply`.
* :func:`check_vocabulary`: refuses a model whose vocabulary is smaller than its tokenizer's,
  naming both sizes (torch would fail later with "index out of range in self").
* :class:`TeacherLogProbs`: on-policy distillation's teacher, torchrl's ``RetrieveLogProb`` on
  a teacher wrapper, or on each row's task's teacher; a teacher with another tokenizer is
  refused.
"""

from torchrl_grpo.llm.exact_log_probs import ExactLogProbsTransformersWrapper
from torchrl_grpo.llm.head import check_vocabulary
from torchrl_grpo.llm.lean_wrapper import HiddenLLMMaskedCategorical, LeanTransformersWrapper
from torchrl_grpo.llm.ragged_chat import ragged_prompts
from torchrl_grpo.llm.replies import ToolReply, TurnReward
from torchrl_grpo.llm.teacher import TeacherLogProbs
from torchrl_grpo.llm.turns import ExactTurns

__all__ = [
    "ExactLogProbsTransformersWrapper",
    "ExactTurns",
    "HiddenLLMMaskedCategorical",
    "LeanTransformersWrapper",
    "TeacherLogProbs",
    "ToolReply",
    "TurnReward",
    "check_vocabulary",
    "ragged_prompts",
]
