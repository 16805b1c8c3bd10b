"""Each private name of torch/torchrl/tensordict that torchrl_grpo relies on, checked by name.

A failure here means an upgrade moved something ``torchrl_grpo._compat`` reaches into: the
message says which reliance, so that the fix is one function in ``_compat.py``.
"""

from __future__ import annotations

import pytest
import torch

from torchrl_grpo import _compat


class TestLLMMaskedDist:
    @pytest.mark.parametrize("wrapper", ["TransformersWrapper", "vLLMWrapper", "LLMWrapperBase"])
    @pytest.mark.parametrize("strategy, method", sorted(_compat.LLM_MASKED_DIST_METHODS.items()))
    def test_wrappers_have_the_masking_methods(self, wrapper, strategy, method):
        import torchrl.modules.llm as llm

        cls = getattr(llm, wrapper)
        assert callable(getattr(cls, method, None)), (
            f"torchrl's {wrapper} no longer has {method}(), which _compat.llm_masked_dist "
            f"uses for masking_strategy={strategy!r}"
        )

    @pytest.mark.parametrize("strategy", sorted(_compat.LLM_MASKED_DIST_METHODS))
    def test_returns_logits_and_a_position_mask(
        self, strategy, tiny_llm, make_llm_batch, make_llm_scorer
    ):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        dist = _compat.llm_masked_dist(make_llm_scorer(model, tokenizer), batch.copy(), strategy)
        tokens = batch.get(("tokens", "full"), as_padded_tensor=True, padding_side="left")
        assert dist.logits.shape == tokens.shape + (len(tokenizer),), (
            f"{_compat.LLM_MASKED_DIST_METHODS[strategy]}() no longer returns left-padded "
            "[B, T, V] logits aligned with ('tokens', 'full')"
        )
        assert dist.mask.shape == tokens.shape and dist.mask.dtype == torch.bool, (
            f"{_compat.LLM_MASKED_DIST_METHODS[strategy]}() no longer returns a [B, T] "
            "position mask"
        )

    def test_missing_method_is_a_clear_error(self):
        with pytest.raises(NotImplementedError, match="has no _get_sft_dist"):
            _compat.llm_masked_dist(object(), None, "sft")
