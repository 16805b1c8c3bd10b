"""Tests of :mod:`torchrl_grpo.loss_terms.kl` against hand-computed values (the running
example of ``test/helpers/running_example.py``)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.running_example import close

from torchrl_grpo.loss_terms import (
    KL_ESTIMATORS,
    importance_weighted_kl,
    kl_k1,
    kl_k2,
    kl_k3,
    top_k_reverse_kl,
)


class TestKLEstimators:
    LOGP = torch.tensor([-1.0, -2.0, -0.5])
    REF = torch.tensor([-1.0, -1.0, -1.5])

    def test_k1(self):
        close(kl_k1(self.LOGP, self.REF), [0.0, -1.0, 1.0])

    def test_k2(self):
        close(kl_k2(self.LOGP, self.REF), [0.0, 0.5, 0.5])

    def test_k3(self):
        # exp(ref - logp) - (ref - logp) - 1
        close(kl_k3(self.LOGP, self.REF), [0.0, math.e - 2.0, math.exp(-1.0)])

    def test_k3_clamped_like_low_var_kl(self):
        logp, ref = torch.tensor([-30.0, -1.0]), torch.tensor([-1.0, -60.0])
        close(kl_k3(logp, ref), [10.0, 10.0])  # the estimate is clamped to [-10, 10]
        # the log-ratio is clamped to [-20, 20] first: e^-20 + 20 - 1, not e^-59 + 59 - 1
        close(kl_k3(logp, ref, clamp=100.0)[1], math.exp(-20.0) + 19.0)
        raw = kl_k3(logp, ref, clamp=None)
        torch.testing.assert_close(
            raw, torch.tensor([math.exp(29.0) - 30.0, 58.0]), rtol=1e-5, atol=0
        )

    def test_all_estimate_kl_on_samples(self):
        # Monte-Carlo check against the exact KL(p || q) of two categoricals
        g = torch.Generator().manual_seed(0)
        p = torch.tensor([0.5, 0.3, 0.2])
        q = torch.tensor([0.4, 0.4, 0.2])
        exact = (p * (p / q).log()).sum()
        samples = torch.multinomial(p, 200_000, replacement=True, generator=g)
        for name in ("k1", "k3"):  # the unbiased ones
            estimate = KL_ESTIMATORS[name](p.log()[samples], q.log()[samples]).mean()
            close(estimate, exact, atol=3e-3)
        assert kl_k2(p.log()[samples], q.log()[samples]).mean() > 0

    def test_k3_gradient(self):
        logp = torch.tensor([-2.0], requires_grad=True)
        kl_k3(logp, torch.tensor([-1.0])).sum().backward()
        close(logp.grad, [1.0 - math.e])  # d/dlogp (e^(ref-logp) - (ref-logp) - 1)


class TestImportanceWeightedKL:
    def test_hand_values_and_gradient(self):
        # r = 1.1 and 0.5: the estimate times r; the gradient of r k is r (log r... + k)
        log_prob = torch.tensor([0.55, 0.25]).log().requires_grad_()
        old, ref = torch.tensor([0.5, 0.5]).log(), torch.tensor([0.5, 0.5]).log()
        kl = kl_k3(log_prob, ref)
        weighted = importance_weighted_kl(kl, log_prob - old)
        close(weighted, torch.tensor([1.1, 0.5]) * kl.detach())
        weighted.sum().backward()
        # d/dlogp [r (e^{ref - lp} - 1 - (ref - lp))] = r k + r (1 - e^{ref - lp})
        d = (ref - log_prob).detach()
        want = torch.tensor([1.1, 0.5]) * (kl.detach() + 1 - d.exp())
        close(log_prob.grad, want)


class TestTopKReverseKL:
    """The KL over a teacher's top tokens and the rest as one outcome, by hand."""

    P = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]])
    Q = torch.tensor([[0.6, 0.3, 0.05, 0.05], [0.25, 0.25, 0.25, 0.25]])

    def test_two_tokens_and_the_rest_by_hand(self):
        top = torch.tensor([[0, 1], [2, 0]])  # the teacher's two first (any order)
        ours = top_k_reverse_kl(self.P.gather(-1, top).log(), self.Q.gather(-1, top).log())
        first = 0.5 * math.log(0.5 / 0.6) + 0.2 * math.log(0.2 / 0.3) + 0.3 * math.log(0.3 / 0.1)
        second = 2 * 0.1 * math.log(0.1 / 0.25) + 0.8 * math.log(0.8 / 0.5)
        close(ours, [first, second])

    def test_a_lower_bound_equal_at_the_vocabulary_with_the_students_gradient(self):
        full = (self.P * (self.P / self.Q).log()).sum(-1)
        close(top_k_reverse_kl(self.P.log(), self.Q.log()), full.tolist())
        logp = self.P[:, :1].log().requires_grad_()
        merged = top_k_reverse_kl(logp, self.Q[:, :1].log())
        assert (merged <= full).all()
        (grad,) = torch.autograd.grad(merged.sum(), logp)
        p, q = self.P[:, 0], self.Q[:, 0]  # d/dlog p of p log(p/q) + (1-p) log((1-p)/(1-q))
        close(grad[:, 0], (p * ((p / q).log() - ((1 - p) / (1 - q)).log())).tolist())

    def test_shapes_must_agree(self):
        with pytest.raises(ValueError, match="differ"):
            top_k_reverse_kl(torch.zeros(2, 3), torch.zeros(2, 2))
