"""ExactLogProbsTransformersWrapper: torchrl's ``TransformersWrapper`` whose generation
log-probs keep the first generated token's value (torchrl 0.14.1 zeroes it), for a sampler whose
log-probs a loss reads as the behaviour policy's."""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence
from torchrl.modules.llm import TransformersWrapper

__all__ = ["ExactLogProbsTransformersWrapper"]


class ExactLogProbsTransformersWrapper(TransformersWrapper):
    """torchrl's ``TransformersWrapper`` whose generation log-probs keep the first generated
    token's value.

    With ``generate=True, return_log_probs=True``, torchrl 0.14.1 sets the log-prob of every
    completion's first token to 0 (``td["log_probs"][:, 0] = 0`` in ``_log_probs_generate``).
    A loss that takes the sampler's log-probs as the behaviour policy (asynchronous GRPO:
    decoupled PPO's ``sample_log_prob``, or the ``inference_log_prob`` of truncated importance
    sampling) would then read ``pi_behaviour = 1`` for that token. This subclass computes
    ``log softmax(logits)[token]`` for every generated token, the first included: the same
    numbers as the scoring wrapper (``generate=False``) on the same model. Everything else is
    torchrl's wrapper, unchanged.

    Reliance (torchrl 0.14.1): the generation paths call the classmethod
    ``_log_probs_generate(tokens, logits, pad_val, pad)`` and read ``(log_probs, logits)``
    (checked by :func:`torchrl_grpo._compat.check_log_probs_generate`, with the other private
    names of torchrl the package uses).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
        >>> from torchrl_grpo.llm import ExactLogProbsTransformersWrapper
        >>> vocab = {c: i for i, c in enumerate("0123456789=")} | {"<eos>": 11, "<pad>": 12}
        >>> backend = Tokenizer(models.WordLevel(vocab, unk_token=None))
        >>> backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        >>> tok = PreTrainedTokenizerFast(
        ...     tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
        >>> _ = torch.manual_seed(0)
        >>> model = Qwen2ForCausalLM(Qwen2Config(
        ...     vocab_size=13, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=2, pad_token_id=12)).eval()
        >>> sampler = ExactLogProbsTransformersWrapper(
        ...     model, tokenizer=tok, input_mode="tokens", generate=True,
        ...     return_log_probs=True, pad_output=True,
        ...     generate_kwargs={"max_new_tokens": 2, "do_sample": True})
        >>> prompt = TensorDict(
        ...     {("tokens", "prompt"): torch.tensor([[3, 4, 10], [1, 2, 10]])}, batch_size=[2])
        >>> out = sampler(prompt)
        >>> log_probs = out["log_probs", "response"]  # (2, 2), the first token's too
        >>> bool((log_probs[:, 0] < 0).all())
        True
    """

    @classmethod
    def _log_probs_generate(cls, tokens, logits, pad_val=-100, pad: bool = True):
        if pad:
            tokens = pad_sequence(
                tokens, padding_value=pad_val, batch_first=True, padding_side="left"
            )
            logits = pad_sequence(logits, padding_value=0.0, batch_first=True, padding_side="left")
        log_probs = -torch.nn.functional.cross_entropy(
            logits.flatten(0, -2), tokens.flatten(), reduction="none", ignore_index=-100
        ).view(tokens.shape)  # (B, T): torchrl's computation, without zeroing column 0
        return log_probs, logits
