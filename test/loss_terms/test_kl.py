"""Tests of :mod:`torchrl_grpo.loss_terms.kl` against hand-computed values (the running
example of ``test/helpers/running_example.py``)."""

from __future__ import annotations

import math

import torch
from helpers.running_example import close

from torchrl_grpo.loss_terms import (
    KL_ESTIMATORS,
    importance_weighted_kl,
    kl_k1,
    kl_k2,
    kl_k3,
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
