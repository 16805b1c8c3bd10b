"""Tests of torchrl_grpo.token_chunk: one chunk's maths against float64 references, the compile
switch, and the compiled path against the eager one.

The compiled tests run ``torch.compile`` on the CPU (Inductor's C++ code, gcc): about 20-30 s
the first time in a fresh cache, a few seconds once Inductor's on-disk cache holds the graphs.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from torchrl_grpo import token_chunk
from torchrl_grpo.token_chunk import chunk_grad, chunk_stats, compiled, use_compile
from torchrl_grpo.token_dist import token_log_prob_entropy, token_log_prob_entropy_from_hidden


def chunk(n=6, vocab=50, dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(n, vocab, generator=g)).to(dtype)
    index = torch.randint(vocab, (n, 1), generator=g)
    return x, index


def stats(x, index, dtype=torch.float32):
    out = torch.empty(3, x.shape[0], dtype=dtype)
    chunk_stats(x, index, *out)
    return out  # lse, entropy, log_prob


class TestChunkStats:
    def test_matches_float64_reference(self):
        x, index = chunk()
        lse, entropy, log_prob = stats(x, index)
        ref = torch.distributions.Categorical(logits=x.double())
        torch.testing.assert_close(lse, x.double().logsumexp(-1).float(), rtol=1e-6, atol=0)
        torch.testing.assert_close(entropy.double(), ref.entropy(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(log_prob.double(), ref.log_prob(index[:, 0]), rtol=1e-5, atol=0)

    def test_peaked_rows_keep_their_entropy(self):
        # logits near 30, one 8 above the rest: H ~ 0.05 against lse ~ 38, so lse - E[x]
        # (the earlier form) loses 3 digits (5.9e-4 relative); log s - E[x - m] keeps them
        x, index = chunk(scale=1.0)
        x += 30.0
        x[:, 0] += 8.0
        entropy = stats(x, index)[1].double()
        ref = torch.distributions.Categorical(logits=x.double()).entropy()
        torch.testing.assert_close(entropy, ref, rtol=1e-5, atol=0)

    def test_bfloat16_read_in_float32(self):
        x, index = chunk(dtype=torch.bfloat16)
        torch.testing.assert_close(stats(x, index), stats(x.float(), index), rtol=0, atol=0)


class TestChunkGrad:
    @pytest.mark.parametrize("with_entropy", [True, False])
    def test_matches_autograd_in_float64(self, with_entropy):
        x, index = chunk()
        g = torch.Generator().manual_seed(1)
        g_lp, g_h = torch.randn(6, 1, generator=g), torch.randn(6, 1, generator=g)
        ref = x.double().requires_grad_()
        dist = torch.distributions.Categorical(logits=ref)
        loss = (g_lp[:, 0].double() * dist.log_prob(index[:, 0])).sum()
        if with_entropy:
            loss = loss + (g_h[:, 0].double() * dist.entropy()).sum()
        loss.backward()

        lse, entropy, _ = stats(x, index)
        shift = -(g_lp + g_h * entropy[:, None]) if with_entropy else -g_lp
        grad = chunk_grad(x, lse[:, None], -g_h if with_entropy else None, shift)
        grad.scatter_add_(-1, index, g_lp)  # the sampled token's term, the caller's part
        torch.testing.assert_close(grad.double(), ref.grad, rtol=1e-5, atol=1e-6)

    def test_out_is_rounded_once(self):
        x, index = chunk(dtype=torch.bfloat16)
        lse = stats(x, index)[0][:, None]
        scale, shift = -torch.ones(6, 1), torch.full((6, 1), -0.5)
        out = torch.empty_like(x)
        assert chunk_grad(x, lse, scale, shift, out) is out
        expected = chunk_grad(x.float(), lse, scale, shift).to(torch.bfloat16)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


class TestUseCompile:
    def test_the_argument_wins(self, monkeypatch):
        monkeypatch.setenv(token_chunk.COMPILE_ENV, "1")
        assert use_compile(torch.device("cpu"), compile=False) is False

    @pytest.mark.parametrize(
        ("setting", "expected"), [("0", False), ("off", False), ("1", True), ("", False)]
    )
    def test_the_environment(self, monkeypatch, setting, expected):
        monkeypatch.setenv(token_chunk.COMPILE_ENV, setting)
        assert use_compile(torch.device("cpu")) is expected

    def test_off_on_the_cpu_and_without_triton(self, monkeypatch):
        monkeypatch.delenv(token_chunk.COMPILE_ENV, raising=False)
        assert not use_compile(torch.device("cpu"))
        monkeypatch.setattr(token_chunk.importlib.util, "find_spec", lambda name: None)
        assert not use_compile(torch.device("cuda"))

    def test_a_bad_setting_is_named(self, monkeypatch):
        monkeypatch.setenv(token_chunk.COMPILE_ENV, "maybe")
        with pytest.raises(ValueError, match="TORCHRL_GRPO_COMPILE='maybe'"):
            use_compile(torch.device("cpu"))


def logits_step(compile, chunk_size=8, dtype=torch.float32):
    """Values and the logits' gradient of one forward+backward (padding included)."""
    x, _ = chunk(n=32, vocab=97, dtype=dtype)
    tokens = torch.randint(97, (32,), generator=torch.Generator().manual_seed(2))
    tokens[-3:] = -100
    w = torch.randn(2, 32, generator=torch.Generator().manual_seed(3))
    x.requires_grad_()
    lp, ent = token_log_prob_entropy(x, tokens, chunk_size=chunk_size, compile=compile)
    (w[0] * lp + w[1] * ent).sum().backward()
    return lp.detach(), ent.detach(), x.grad


def hidden_step(compile):
    g = torch.Generator().manual_seed(4)
    h, weight = torch.randn(32, 16, generator=g), torch.randn(97, 16, generator=g) / 4
    tokens = torch.randint(97, (32,), generator=g)
    h.requires_grad_(), weight.requires_grad_()
    lp, ent = token_log_prob_entropy_from_hidden(h, weight, tokens, chunk_size=8, compile=compile)
    (lp + 0.5 * ent).sum().backward()
    return lp.detach(), ent.detach(), h.grad, weight.grad


@pytest.fixture
def fresh_compiled(monkeypatch):
    """Uncompiled chunk functions and no failure on record (restored after the test)."""
    monkeypatch.setattr(token_chunk._Compiled, "failed", False)
    for fn in (chunk_stats, chunk_grad):
        monkeypatch.setitem(token_chunk._COMPILED, fn, token_chunk._Compiled(fn))


class TestCompiled:
    def test_equals_eager_on_the_logits_path(self):
        for ours, ref in zip(logits_step(True), logits_step(False), strict=True):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)

    def test_equals_eager_on_the_hidden_path(self):
        for ours, ref in zip(hidden_step(True), hidden_step(False), strict=True):
            torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-6)

    def test_a_failed_compilation_falls_back_with_one_warning(self, monkeypatch, fresh_compiled):
        calls = []

        def broken(fn, **kwargs):
            def run(*args):
                calls.append(fn.__name__)
                raise RuntimeError("no C++ compiler\nmore lines")

            return run

        monkeypatch.setattr(torch, "compile", broken)
        with pytest.warns(RuntimeWarning, match=r"failed \(RuntimeError: no C\+\+ compiler\)"):
            ours = logits_step(True)
        assert calls == ["chunk_stats"]  # after one failure nothing tries again
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = logits_step(True)
        for a, b, ref in zip(ours, again, logits_step(False), strict=True):
            torch.testing.assert_close(a, ref, rtol=0, atol=0)
            torch.testing.assert_close(b, ref, rtol=0, atol=0)

    def test_off_means_no_attempt(self, monkeypatch, fresh_compiled):
        monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled"))
        monkeypatch.setenv(token_chunk.COMPILE_ENV, "0")
        logits_step(None)
        monkeypatch.setenv(token_chunk.COMPILE_ENV, "1")
        with pytest.raises(pytest.fail.Exception):
            logits_step(None)

    def test_named_after_its_function(self):
        assert compiled(chunk_stats).__name__ == "compiled(chunk_stats)"
