"""Every private name of torch, torchrl or tensordict that torchrl_grpo relies on, in one place.

The package uses public APIs wherever they exist. What remains has no public equivalent in the
supported torchrl release (``setup.py``); each reliance is one small function here, and
``test/test_compat.py`` checks each one by name, so that an upgrade that moves it fails there,
with a message that says what changed, instead of somewhere deep in a training run.
"""

from __future__ import annotations

from tensordict import TensorDictBase
from torch.distributions import Distribution

# --- torchrl.modules.llm: the masked token distribution of an LLM wrapper -------------------------

#: torchrl's masking strategies and the ``LLMWrapperBase`` method that builds each distribution.
#: torchrl's own ``GRPOLoss`` calls the same methods; they are provisional in torchrl ("will be
#: replaced by the ``get_dist`` method once we have a better masking strategy").
LLM_MASKED_DIST_METHODS = {
    "sft": "_get_sft_dist",  # response tokens: the attention mask without the prompt
    "rlhf": "_get_rlhf_dist",  # assistant tokens (history input)
    "generic": "_get_generic_dist",  # every attended token
}


def llm_masked_dist(wrapper, tensordict: TensorDictBase, masking_strategy: str) -> Distribution:
    """The wrapper's token distribution over ``("tokens", "full")``, masked by the strategy.

    Returns torchrl's ``LLMMaskedCategorical``: ``.logits`` ``[B, T, V]`` and ``.mask``
    ``[B, T]``, left-padded, aligned with ``tensordict.get(("tokens", "full"),
    as_padded_tensor=True, padding_side="left")``. With ``"rlhf"`` the wrapper may rewrite
    ``("tokens", "full")`` in ``tensordict`` (history input is tokenized again).

    Raises:
        NotImplementedError: the wrapper has no method for the strategy.
    """
    name = LLM_MASKED_DIST_METHODS[masking_strategy]
    method = getattr(wrapper, name, None)
    if method is None:
        raise NotImplementedError(
            f"{type(wrapper).__name__} has no {name}(), which torchrl uses for "
            f"masking_strategy={masking_strategy!r}; this torchrl release is not supported "
            "(see torchrl_grpo._compat)."
        )
    return method(tensordict)
