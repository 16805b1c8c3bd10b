"""Tests of torchrl_grpo.token_dist against torch.distributions.Categorical."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.modules import ProbabilisticActor

from torchrl_grpo.launches import count_launches
from torchrl_grpo.token_dist import (
    HiddenTokenCategorical,
    TokenCategorical,
    _chunk_rows,
    log_probs_at_from_hidden,
    token_log_prob_entropy,
    token_log_prob_entropy_from_hidden,
    top_log_probs_from_hidden,
)


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

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    def test_operators_on_an_accelerator(self, dtype):
        # the GPU benchmark's shape on the meta device (no memory), which _chunk_rows sizes as
        # an accelerator: 38 chunks of 216 positions, 30 operators each (10 of them views) and
        # no host sync; the earlier rule's 128 chunks took 5,277 (bf16) and one sync
        logits = torch.empty(8, 1024, 151936, device="meta", dtype=dtype).requires_grad_()
        tokens = torch.empty(8, 1024, device="meta", dtype=torch.long)
        assert _chunk_rows(None, 151936, 8192, logits.device) == 216
        with count_launches() as launches:
            log_prob, entropy = token_log_prob_entropy(logits, tokens, compile=False)
            (log_prob.sum() + entropy.sum()).backward()
        assert launches.ops <= 1200 and launches.syncs == 0, (launches.ops, launches.syncs)

    def test_one_host_sync_on_the_cpu_for_the_range_check(self):
        logits, tokens = logits_and_tokens()
        with count_launches() as launches:
            token_log_prob_entropy(logits, tokens)
        assert dict(launches.by_sync) == {"_local_scalar_dense": 1}


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


def hidden_head_tokens(shape=(3, 5), hidden=6, vocab=13, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, hidden, generator=g).to(dtype)
    weight = (torch.randn(vocab, hidden, generator=g) / 2).to(dtype)
    b = torch.randn(vocab, generator=g).to(dtype) if bias else None
    tokens = torch.randint(vocab, shape, generator=g)
    return h, weight, b, tokens


class TestTokenLogProbEntropyFromHidden:
    """Against the logits path ``token_log_prob_entropy(hidden @ W.T + b)``: values and the
    gradients of the hidden states, the weight and the bias."""

    @pytest.mark.parametrize("chunk_size", [None, 1, 4, 100])
    @pytest.mark.parametrize("bias", [True, False])
    def test_values_and_gradients_match_the_logits_path(self, chunk_size, bias):
        h, weight, b, tokens = hidden_head_tokens(bias=bias)
        tokens[2, 3:] = -100  # padding
        g = torch.Generator().manual_seed(1)
        w_lp, w_h = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
        inputs = [t for t in (h, weight, b) if t is not None]

        ours = [t.clone().requires_grad_() for t in inputs]
        lp, ent = token_log_prob_entropy_from_hidden(
            ours[0], ours[1], tokens, ours[2] if bias else None, chunk_size=chunk_size
        )
        (w_lp * lp + w_h * ent).sum().backward()

        ref = [t.clone().requires_grad_() for t in inputs]
        logits = torch.nn.functional.linear(ref[0], ref[1], ref[2] if bias else None)
        ref_lp, ref_ent = token_log_prob_entropy(logits, tokens)
        (w_lp * ref_lp + w_h * ref_ent).sum().backward()

        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
        assert (lp[2, 3:] == 0).all()
        for a, r in zip(ours, ref, strict=True):
            torch.testing.assert_close(a.grad, r.grad, rtol=1e-5, atol=1e-5)

    def test_gradcheck_float64(self):
        h, weight, b, tokens = hidden_head_tokens(
            shape=(2, 3), hidden=3, vocab=5, dtype=torch.float64
        )
        w = torch.randn(2, 3, dtype=torch.float64)

        def fn(h, weight, b):
            lp, ent = token_log_prob_entropy_from_hidden(h, weight, tokens, b, chunk_size=2)
            return (lp + w * ent).sum()

        inputs = tuple(t.requires_grad_() for t in (h, weight, b))
        assert torch.autograd.gradcheck(fn, inputs)

    def test_only_what_needs_a_gradient_gets_one(self):
        h, weight, b, tokens = hidden_head_tokens()
        h.requires_grad_()  # a frozen head
        lp, _ = token_log_prob_entropy_from_hidden(h, weight, tokens, b)
        lp.sum().backward()
        assert h.grad is not None and weight.grad is None and b.grad is None

    def test_bfloat16_in_float32(self):
        h, weight, b, tokens = hidden_head_tokens(dtype=torch.bfloat16)
        h.requires_grad_(), weight.requires_grad_()
        lp, ent = token_log_prob_entropy_from_hidden(h, weight, tokens, b)
        assert lp.dtype == ent.dtype == torch.float32
        lp.sum().backward()
        assert h.grad.dtype == weight.grad.dtype == torch.bfloat16
        ref = torch.nn.functional.linear(h.detach(), weight.detach(), b).float()
        torch.testing.assert_close(lp, token_log_prob_entropy(ref, tokens)[0], rtol=0, atol=1e-5)

    def test_never_builds_the_logits(self):
        # autograd keeps the inputs and (N,)-sized vectors; no tensor the size of the logits
        # exists at any point: every allocation on the way is at most a chunk of them
        h, weight, b, tokens = hidden_head_tokens(shape=(4, 16), hidden=8, vocab=64)
        h.requires_grad_(), weight.requires_grad_()
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, ent = token_log_prob_entropy_from_hidden(h, weight, tokens, b, chunk_size=8)
        inputs = (h.data_ptr(), weight.data_ptr(), b.data_ptr())
        own = [t for t in saved if t.data_ptr() not in inputs]
        assert sum(t.numel() for t in own) <= 4 * 64  # index, pad flags, lse, entropy

        n_logits = 4 * 16 * 64
        biggest = []

        class Track(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if isinstance(out, torch.Tensor):
                    biggest.append(out.numel())
                return out

        with Track():
            lp, ent = token_log_prob_entropy_from_hidden(h, weight, tokens, b, chunk_size=8)
            (lp.sum() + ent.sum()).backward()
        assert max(biggest) <= max(weight.numel(), 8 * 64) < n_logits

    def test_errors(self):
        h, weight, b, tokens = hidden_head_tokens()
        with pytest.raises(ValueError, match=r"hidden \(3, 5, 6\) and weight \(13, 5\)"):
            token_log_prob_entropy_from_hidden(h, weight[:, :5], tokens)
        with pytest.raises(ValueError, match=r"bias has shape \(12,\)"):
            token_log_prob_entropy_from_hidden(h, weight, tokens, b[:12])
        with pytest.raises(ValueError, match=r"hidden \(3, 5, 6\) and tokens \(3, 4\)"):
            token_log_prob_entropy_from_hidden(h, weight, tokens[:, :4])
        tokens[0, 0] = 13
        with pytest.raises(IndexError, match="token id 13 is out of range"):
            token_log_prob_entropy_from_hidden(h, weight, tokens)

    def test_operators_on_an_accelerator(self):
        # the same on the hidden-state path: 6,432 operators before, 1,599 now
        hidden = torch.empty(8, 1024, 1024, device="meta", dtype=torch.bfloat16)
        weight = torch.empty(151936, 1024, device="meta", dtype=torch.bfloat16)
        tokens = torch.empty(8, 1024, device="meta", dtype=torch.long)
        hidden.requires_grad_(), weight.requires_grad_()
        with count_launches() as launches:
            lp, ent = token_log_prob_entropy_from_hidden(hidden, weight, tokens, compile=False)
            (lp.sum() + ent.sum()).backward()
        assert launches.ops <= 1700 and launches.syncs == 0, (launches.ops, launches.syncs)


class TestHiddenTokenCategorical:
    def test_matches_token_categorical(self):
        h, weight, b, tokens = hidden_head_tokens()
        head = torch.nn.Linear(6, 13)
        with torch.no_grad():
            head.weight.copy_(weight), head.bias.copy_(b)
        dist, ref = HiddenTokenCategorical(h, head, chunk_size=4), TokenCategorical(head(h))
        torch.testing.assert_close(dist.log_prob(tokens), ref.log_prob(tokens), atol=1e-5, rtol=0)
        torch.testing.assert_close(dist.entropy(), ref.entropy(), atol=1e-5, rtol=0)
        torch.testing.assert_close(dist.logits, head(h))
        assert dist.batch_shape == (3, 5)
        assert (dist.mode == ref.mode).all() and (dist.deterministic_sample == ref.mode).all()

    def test_sampling_follows_the_distribution(self):
        torch.manual_seed(0)
        head = torch.nn.Linear(2, 3, bias=False)
        with torch.no_grad():
            head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
        h = torch.tensor([[2.0, 0.0], [0.0, 0.0]])  # probs softmax(2, 0, 0) and uniform
        samples = HiddenTokenCategorical(h, head, chunk_size=1).sample((20_000,))
        assert samples.shape == (20_000, 2)
        freq = torch.stack([(samples == k).float().mean(0) for k in range(3)], -1)
        expected = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]).softmax(-1)
        torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)

    def test_entropy_shares_the_log_prob_node(self):
        h, _, _, tokens = hidden_head_tokens()
        dist = HiddenTokenCategorical(h.requires_grad_(), torch.nn.Linear(6, 13))
        log_prob = dist.log_prob(tokens)

        def node(t):
            return t.grad_fn.next_functions[0][0]

        assert type(node(log_prob)).__name__ == "_TokenLogProbEntropyFromHiddenBackward"
        assert node(dist.entropy()) is node(log_prob)
        fresh = HiddenTokenCategorical(h, torch.nn.Linear(6, 13))
        assert fresh.entropy().requires_grad  # before any log_prob: computed on its own

    def test_errors(self):
        h = torch.randn(2, 3, 6)
        with pytest.raises(ValueError, match="2-d weight"):
            HiddenTokenCategorical(h, torch.nn.Identity())
        with pytest.raises(ValueError, match=r"expected hidden \[\.\.\., 4\]"):
            HiddenTokenCategorical(h, torch.nn.Linear(4, 9))

    def test_tiny_qwen2_actor_equals_the_logits_path(self, tiny_llm):
        """A causal LM's backbone returns hidden states, its lm_head is the distribution's
        head: GRPOLoss's values and every parameter's gradient equal the logits path's."""
        from torchrl_grpo import GRPOLoss

        model, _ = tiny_llm

        class LastHidden(torch.nn.Module):
            def __init__(self, lm):
                super().__init__()
                self.lm = lm

            def forward(self, input_ids):
                return self.lm.model(input_ids=input_ids).last_hidden_state

        class Logits(LastHidden):
            def forward(self, input_ids):
                return self.lm(input_ids=input_ids).logits

        g = torch.Generator().manual_seed(0)
        ids = torch.randint(12, (3, 6), generator=g)
        batch = TensorDict(
            input_ids=ids,
            tokens=torch.randint(14, (3, 6), generator=g),
            tokens_log_prob=-2.5 + 0.3 * torch.randn(3, 6, generator=g),
            advantage=torch.tensor([1.0, -0.5, 0.3]),
            mask=torch.arange(6) < torch.tensor([[6], [4], [2]]),
            batch_size=[3],
        )
        results = []
        for net, dist_class, in_keys, kwargs in (
            (
                LastHidden(model),
                HiddenTokenCategorical,
                {"hidden": "h"},
                {"head": model.lm_head, "chunk_size": 5},
            ),
            (Logits(model), TokenCategorical, {"logits": "h"}, {}),
        ):
            actor = ProbabilisticActor(
                TensorDictModule(net, ["input_ids"], ["h"]),
                in_keys=in_keys,
                out_keys=["tokens"],
                distribution_class=dist_class,
                distribution_kwargs=kwargs,
            )
            model.zero_grad()
            out = GRPOLoss(actor, entropy_coeff=0.1)(batch.clone())
            out.total_loss().backward()
            results.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
        (out, grads), (ref, ref_grads) = results
        for key, value in ref.items():
            torch.testing.assert_close(out.get(key), value, rtol=1e-5, atol=1e-6, msg=key)
        assert ref_grads["lm_head.weight"].abs().sum() > 0
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


class TestDevices:
    """Same values and gradients on every available device as on the CPU (float64 reference),
    with the chunk math eager and as by default (compiled on CUDA when Triton is installed)."""

    @pytest.mark.parametrize("compile", [False, None])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_logits_path(self, device, dtype, compile):
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(3, 5, 97, generator=g)
        tokens = torch.randint(97, (3, 5), generator=g)
        tokens[0, -2:] = -100
        ref = logits.double().requires_grad_()
        lp_ref, ent_ref = token_log_prob_entropy(ref, tokens)
        (lp_ref.sum() + ent_ref.sum()).backward()
        x = logits.to(device, dtype).requires_grad_()
        lp, ent = token_log_prob_entropy(x, tokens.to(device), chunk_size=4, compile=compile)
        (lp.sum() + ent.sum()).backward()
        assert lp.device == ent.device == x.grad.device == x.device
        tol = dict(atol=5e-2, rtol=5e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lp.double().cpu(), lp_ref.detach(), **tol)
        torch.testing.assert_close(ent.double().cpu(), ent_ref.detach(), **tol)
        torch.testing.assert_close(x.grad.double().cpu(), ref.grad, **tol)

    @pytest.mark.parametrize("compile", [False, None])
    def test_hidden_path(self, device, compile):
        g = torch.Generator().manual_seed(1)
        hidden, weight = torch.randn(2, 4, 6, generator=g), torch.randn(31, 6, generator=g)
        tokens = torch.randint(31, (2, 4), generator=g)
        h, w = hidden.to(device).requires_grad_(), weight.to(device).requires_grad_()
        lp, ent = token_log_prob_entropy_from_hidden(
            h, w, tokens.to(device), chunk_size=3, compile=compile
        )
        (lp.sum() + ent.sum()).backward()
        logits = (hidden @ weight.T).requires_grad_()
        lp_ref, ent_ref = token_log_prob_entropy(logits, tokens)
        torch.testing.assert_close(lp.cpu(), lp_ref.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent.cpu(), ent_ref.detach(), atol=1e-5, rtol=1e-5)
        assert h.grad.device == h.device and w.grad.device == w.device


class TestTopTokens:
    """``log_probs_at_from_hidden`` (a student's log-probs at a teacher's tokens, with
    gradient) and ``top_log_probs_from_hidden`` (a teacher's top tokens), against the logits."""

    @pytest.mark.parametrize("chunk_size", [None, 1, 4])
    @pytest.mark.parametrize("bias", [False, True])
    def test_log_probs_at_ids_match_the_logits_with_gradients(self, chunk_size, bias):
        g = torch.Generator().manual_seed(0)
        head = torch.nn.Linear(6, 17, bias=bias)
        hidden = torch.randn(3, 5, 6, generator=g, requires_grad=True)
        ids = torch.randint(17, (3, 5, 4), generator=g)
        weight = torch.randn(3, 5, 4, generator=g)
        ours = log_probs_at_from_hidden(hidden, head.weight, ids, head.bias, chunk_size=chunk_size)
        ref = head(hidden).log_softmax(-1).gather(-1, ids)
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
        inputs = [hidden, *head.parameters()]
        grads = torch.autograd.grad((weight * ours).sum(), inputs)
        expected = torch.autograd.grad((weight * ref).sum(), inputs)
        for a, b in zip(grads, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        dist = HiddenTokenCategorical(hidden, head, chunk_size=chunk_size)
        torch.testing.assert_close(dist.log_probs_at(ids), ours)
        torch.testing.assert_close(TokenCategorical(head(hidden)).log_probs_at(ids), ref)

    def test_bf16_weights_accumulate_in_float32(self):
        g = torch.Generator().manual_seed(1)
        hidden = torch.randn(8, 6, generator=g).bfloat16()
        weight = torch.randn(11, 6, generator=g).bfloat16()
        ids = torch.randint(11, (8, 2), generator=g)
        ours = log_probs_at_from_hidden(hidden, weight, ids)
        assert ours.dtype == torch.float32
        ref = (hidden.float() @ weight.float().T).log_softmax(-1).gather(-1, ids)
        torch.testing.assert_close(ours, ref, atol=2e-2, rtol=1e-2)

    @pytest.mark.parametrize("chunk_size", [None, 2])
    def test_top_tokens_match_the_logits(self, chunk_size):
        g = torch.Generator().manual_seed(2)
        head = torch.nn.Linear(6, 17)
        hidden = torch.randn(3, 5, 6, generator=g)
        values, ids = top_log_probs_from_hidden(
            hidden, head.weight, 4, head.bias, chunk_size=chunk_size
        )
        ref = head(hidden).log_softmax(-1).topk(4, -1)
        torch.testing.assert_close(values, ref.values.detach())
        assert torch.equal(ids, ref.indices) and not values.requires_grad

    def test_only_the_ids_below_among_are_ranked(self):
        g = torch.Generator().manual_seed(3)
        hidden, weight = torch.randn(4, 6, generator=g), torch.randn(9, 6, generator=g)
        weight[7:] = 10 * hidden.mean(0)  # two padding rows that would rank first
        values, ids = top_log_probs_from_hidden(hidden, weight, 3, among=7)
        ref = (hidden @ weight.T).log_softmax(-1)  # normalised over every row
        top = ref[:, :7].topk(3, -1)
        torch.testing.assert_close(values, top.values)
        assert torch.equal(ids, top.indices) and (ids < 7).all()
        assert (top_log_probs_from_hidden(hidden, weight, 3)[1] >= 7).any()  # without it
        with pytest.raises(ValueError, match="k must be an integer in \\[1, 7\\]"):
            top_log_probs_from_hidden(hidden, weight, 8, among=7)

    def test_bad_input_is_refused(self):
        hidden, weight = torch.randn(2, 3, 4), torch.randn(7, 4)
        for k in (0, 8, 1.5, True):
            with pytest.raises(ValueError, match="k must be an integer in \\[1, 7\\]"):
                top_log_probs_from_hidden(hidden, weight, k)
        with pytest.raises(ValueError, match="do not match"):
            top_log_probs_from_hidden(hidden, torch.randn(7, 5), 2)
        with pytest.raises(ValueError, match="ids \\(2, 2, 3\\) do not match"):
            log_probs_at_from_hidden(hidden, weight, torch.zeros(2, 2, 3, dtype=torch.long))
        with pytest.raises(IndexError, match="token id 7 is out of range"):
            log_probs_at_from_hidden(hidden, weight, torch.full((2, 3, 2), 7))
        with pytest.raises(IndexError, match="token id -1 is out of range"):
            log_probs_at_from_hidden(hidden, weight, torch.full((2, 3, 2), -1))
