"""Slow reference implementations of the advantage math, one group at a time in Python floats:
the definitions written plainly, for the estimators' tests to be checked against."""

from __future__ import annotations

import math

import torch


def reference_advantage(
    x, groups, baseline="mean", scale_rewards="group", epsilon=1e-6, whiten=False
):
    """One group at a time, in Python floats: the definition, written plainly."""
    x, groups = x.double().tolist(), groups.tolist()
    out = [0.0] * len(x)
    everything = torch.tensor(x, dtype=torch.float64)
    batch_std = float(everything.std()) if len(x) > 1 else 0.0
    for g in set(groups):
        idx = [i for i, gi in enumerate(groups) if gi == g]
        vals = [x[i] for i in idx]
        n = len(vals)
        mean = sum(vals) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
        scale = {"group": std, "batch": batch_std, "none": 1.0}[scale_rewards]
        for i in idx:
            if baseline == "mean":
                b = mean
            elif baseline == "leave_one_out":
                b = (sum(vals) - x[i]) / (n - 1) if n > 1 else x[i]
            else:  # pass_at_k: the best of the others (a group of one: itself)
                others = [x[j] for j in idx if j != i]
                b = x[i] - (max(vals) - max(others)) if others else x[i]
            out[i] = (x[i] - b) / max(scale, epsilon)
    if whiten:
        out = reference_whiten(out, [1.0] * len(out), epsilon).tolist()
    return torch.tensor(out, dtype=torch.float64)


def reference_whiten(x, weights, epsilon=1e-6):
    """Each sample repeated ``weights[i]`` times (integers), then whitened, in Python floats."""
    repeated = [v for v, w in zip(x, weights) for _ in range(int(w))]
    n = len(repeated)
    mean = sum(repeated) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in repeated) / (n - 1)) if n > 1 else 0.0
    return torch.tensor([(v - mean) / max(std, epsilon) for v in x], dtype=torch.float64)
