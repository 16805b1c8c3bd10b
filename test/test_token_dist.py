"""Tests of torchrl_grpo.token_dist against torch.distributions.Categorical."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.modules import ProbabilisticActor

from torchrl_grpo.token_dist import TokenCategorical, token_log_prob_entropy


def logits_and_tokens(shape=(3, 5), vocab=13, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*shape, vocab, generator=g)).to(dtype)
    tokens = torch.randint(vocab, shape, generator=g)
    return logits, tokens


class TestTokenLogProbEntropy:
    @pytest.mark.parametrize("chunk_size", [None, 1, 4, 100])
    def test_values_and_gradients_match_categorical(self, chunk_size):
        logits, tokens = logits_and_tokens()
        g = torch.Generator().manual_seed(1)
        w_lp, w_h = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)

        ours = logits.clone().requires_grad_()
        log_prob, entropy = token_log_prob_entropy(ours, tokens, chunk_size=chunk_size)
        (w_lp * log_prob + w_h * entropy).sum().backward()

        ref = logits.clone().requires_grad_()
        dist = torch.distributions.Categorical(logits=ref)
        ref_lp, ref_h = dist.log_prob(tokens), dist.entropy()
        (w_lp * ref_lp + w_h * ref_h).sum().backward()

        torch.testing.assert_close(log_prob, ref_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(entropy, ref_h, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours.grad, ref.grad, rtol=0, atol=1e-5)

    @pytest.mark.parametrize("which", ["log_prob", "entropy"])
    def test_one_output_alone(self, which):
        logits, tokens = logits_and_tokens()
        ours, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        out = dict(zip(("log_prob", "entropy"), token_log_prob_entropy(ours, tokens), strict=True))
        dist = torch.distributions.Categorical(logits=ref)
        expected = {"log_prob": dist.log_prob(tokens), "entropy": dist.entropy()}
        out[which].sum().backward()
        expected[which].sum().backward()
        torch.testing.assert_close(ours.grad, ref.grad, rtol=0, atol=1e-5)

    def test_gradcheck_float64(self):
        logits, tokens = logits_and_tokens(shape=(2, 3), vocab=5, dtype=torch.float64)
        logits.requires_grad_()
        w = torch.randn(2, 3, dtype=torch.float64)

        def fn(x):
            log_prob, entropy = token_log_prob_entropy(x, tokens, chunk_size=2)
            return (log_prob + w * entropy).sum()

        assert torch.autograd.gradcheck(fn, (logits,))

    def test_negative_tokens_are_padding(self):
        logits, tokens = logits_and_tokens()
        tokens[1, 2:] = -100
        logits.requires_grad_()
        log_prob, entropy = token_log_prob_entropy(logits, tokens)
        assert (log_prob[1, 2:] == 0).all()
        log_prob.sum().backward()
        assert (logits.grad[1, 2:] == 0).all()
        assert (logits.grad[0] != 0).any()
        ref = torch.distributions.Categorical(logits=logits.detach()).entropy()
        torch.testing.assert_close(entropy, ref, rtol=0, atol=1e-5)

    def test_bfloat16_logits_are_computed_in_float32(self):
        logits, tokens = logits_and_tokens(dtype=torch.bfloat16)
        logits.requires_grad_()
        log_prob, entropy = token_log_prob_entropy(logits, tokens)
        assert log_prob.dtype == entropy.dtype == torch.float32
        ref = torch.distributions.Categorical(logits=logits.detach().float())
        torch.testing.assert_close(log_prob, ref.log_prob(tokens), rtol=0, atol=1e-5)
        log_prob.sum().backward()
        assert logits.grad.dtype == torch.bfloat16

    def test_errors(self):
        logits, tokens = logits_and_tokens()
        with pytest.raises(ValueError, match=r"logits \(3, 5, 13\) and tokens \(3, 4\)"):
            token_log_prob_entropy(logits, tokens[:, :4])
        tokens[0, 0] = 13
        with pytest.raises(IndexError, match="token id 13 is out of range"):
            token_log_prob_entropy(logits, tokens)
        with pytest.raises(ValueError, match="chunk_size"):
            token_log_prob_entropy(logits, tokens.clamp(max=3), chunk_size=0)

    def test_saves_no_full_vocabulary_tensor(self):
        # everything autograd keeps for backward: the logits themselves plus (N,)-sized vectors
        logits, tokens = logits_and_tokens(shape=(4, 8), vocab=64)
        logits.requires_grad_()
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            log_prob, entropy = token_log_prob_entropy(logits, tokens)
        big = [t for t in saved if t.numel() >= logits.numel()]
        assert all(t.data_ptr() == logits.data_ptr() for t in big), [t.shape for t in big]
        assert sum(t.numel() for t in saved if t.data_ptr() != logits.data_ptr()) <= 4 * 32


class TestTokenCategorical:
    def test_matches_categorical(self):
        logits, tokens = logits_and_tokens()
        dist, ref = TokenCategorical(logits), torch.distributions.Categorical(logits=logits)
        torch.testing.assert_close(dist.log_prob(tokens), ref.log_prob(tokens), atol=1e-5, rtol=0)
        torch.testing.assert_close(dist.entropy(), ref.entropy(), atol=1e-5, rtol=0)
        torch.testing.assert_close(dist.probs, ref.probs)
        assert dist.batch_shape == ref.batch_shape == (3, 5)
        assert (dist.mode == ref.mode).all()
        assert dist.sample((2,)).shape == (2, 3, 5)

    def test_entropy_shares_the_log_prob_node(self):
        logits, tokens = logits_and_tokens()
        dist = TokenCategorical(logits.requires_grad_())
        log_prob = dist.log_prob(tokens)

        def node(t):  # the outputs are views of the fused node's outputs
            return t.grad_fn.next_functions[0][0]

        assert type(node(log_prob)).__name__ == "_TokenLogProbEntropyBackward"
        assert node(dist.entropy()) is node(log_prob)

    def test_entropy_before_any_log_prob(self):
        logits, _ = logits_and_tokens()
        ref = torch.distributions.Categorical(logits=logits).entropy()
        torch.testing.assert_close(TokenCategorical(logits).entropy(), ref, atol=1e-5, rtol=0)

    def test_as_a_torchrl_actor_head(self):
        torch.manual_seed(0)
        head = TensorDictModule(torch.nn.Linear(4, 9), ["hidden"], ["logits"])
        actor = ProbabilisticActor(
            head,
            in_keys=["logits"],
            out_keys=["tokens"],
            distribution_class=TokenCategorical,
            distribution_kwargs={"chunk_size": 2},
            return_log_prob=True,
        )
        td = actor(TensorDict({"hidden": torch.randn(2, 3, 4)}, [2]))
        ref = torch.distributions.Categorical(logits=td["logits"]).log_prob(td["tokens"])
        torch.testing.assert_close(td["tokens_log_prob"], ref, atol=1e-5, rtol=0)

    def test_entropy_has_a_gradient_after_a_no_grad_log_prob(self):
        """torch's Categorical keeps the entropy's gradient whatever ran before; so must this."""
        logits = torch.randn(2, 3, 7, requires_grad=True)
        dist = TokenCategorical(logits)
        with torch.no_grad():
            dist.log_prob(torch.zeros(2, 3, dtype=torch.long))
        entropy = dist.entropy()
        assert entropy.requires_grad
        (grad,) = torch.autograd.grad(entropy.sum(), logits)
        (expected,) = torch.autograd.grad(
            torch.distributions.Categorical(logits=logits).entropy().sum(), logits
        )
        torch.testing.assert_close(grad, expected)
