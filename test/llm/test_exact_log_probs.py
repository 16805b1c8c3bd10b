"""Tests of torchrl_grpo/llm/exact_log_probs.py: the sampler's log-probs, the first token's
included, are the scoring wrapper's (the signature it overrides: test/test_compat.py)."""

import torch
from tensordict import TensorDict

from torchrl_grpo.llm import ExactLogProbsTransformersWrapper


class TestExactLogProbsTransformersWrapper:
    MESSAGE = (
        "torchrl_grpo.llm.ExactLogProbsTransformersWrapper: torchrl's "
        "TransformersWrapper._log_probs_generate {what}, so the override that keeps the first "
        "generated token's log-prob (examples/llm_grpo_async.py's behaviour policy) {then}."
    )

    def test_first_token_log_prob_is_the_scorers(self, tiny_llm, make_llm_scorer):
        """Sampled by each wrapper under the same seed: the override's log-probs equal the
        scoring wrapper's on every generated token, the first included; torchrl's own are 0 on
        the first token (when torchrl fixes that, this test says so)."""
        from torchrl.modules.llm import TransformersWrapper

        model, tokenizer = tiny_llm
        prompts = torch.tensor(
            [tokenizer("3 9 1 4=")["input_ids"], tokenizer("1 2 5 5=")["input_ids"]]
        )
        kwargs = {
            "max_new_tokens": 3,
            "do_sample": True,
            "bad_words_ids": [[tokenizer.pad_token_id]],
        }
        responses = {}
        for cls in (ExactLogProbsTransformersWrapper, TransformersWrapper):
            sampler = cls(
                model,
                tokenizer=tokenizer,
                input_mode="tokens",
                generate=True,
                return_log_probs=True,
                pad_output=True,
                generate_kwargs=kwargs,
            )
            torch.manual_seed(0)
            with torch.no_grad():
                responses[cls] = sampler(
                    TensorDict({("tokens", "prompt"): prompts}, batch_size=[2])
                )
        exact, torchrl_own = responses.values()
        scorer = make_llm_scorer(model, tokenizer, pad_output=True)
        with torch.no_grad():
            scored = scorer(exact.select(("tokens", "full")).copy())
        width = exact["tokens", "response"].shape[-1]
        expected = scored["log_probs", "full"][:, -width:]  # (2, width): the response tokens
        generated = exact["log_probs", "response"]  # (2, width)
        real = exact["tokens", "response"] != tokenizer.pad_token_id
        torch.testing.assert_close(generated[real], expected[real], atol=1e-5, rtol=0)
        assert bool((generated[:, 0] < 0).all())
        if torch.equal(torchrl_own["tokens", "response"], exact["tokens", "response"]):
            torch.testing.assert_close(
                torchrl_own["log_probs", "response"][:, 1:], generated[:, 1:]
            )
        assert torch.equal(torchrl_own["log_probs", "response"][:, 0], torch.zeros(2)), (
            self.MESSAGE.format(
                what="no longer zeroes the first generated token's log-prob",
                then="is no longer needed: use torchrl's TransformersWrapper",
            )
        )
