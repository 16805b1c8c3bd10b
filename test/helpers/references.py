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


def reference_time_step_advantage(groups, baseline="mean", scale_rewards="group", epsilon=1e-6):
    """The time-step baseline in Python floats: ``groups`` is a list of groups, each a list of
    trajectories, each a list of samples in time order; the same nesting of advantages comes
    back. Each sample is compared with its group's samples at the same time step; the scale is
    the pooled std of those deviations (``sum dev^2 / (n - time steps)``, per group, or over
    every group with ``"batch"``)."""
    devs, m2s, dofs = [], [], []
    for trajs in groups:
        horizon = max((len(t) for t in trajs), default=0)
        at = [[t[s] for t in trajs if s < len(t)] for s in range(horizon)]  # samples at step s
        means = [sum(v) / len(v) for v in at]
        group_devs = [[x - means[s] for s, x in enumerate(t)] for t in trajs]
        devs.append(group_devs)
        m2s.append(sum(d * d for t in group_devs for d in t))
        dofs.append(sum(len(t) for t in trajs) - horizon)
    out = []
    for g, trajs in enumerate(groups):
        if scale_rewards == "group":
            scale = math.sqrt(m2s[g] / max(dofs[g], 1))
        elif scale_rewards == "batch":
            scale = math.sqrt(sum(m2s) / max(sum(dofs), 1))
        else:
            scale = 1.0
        advs = []
        for i, t in enumerate(trajs):
            adv = []
            for s, x in enumerate(t):
                others = [u[s] for j, u in enumerate(trajs) if j != i and s < len(u)]
                if baseline == "mean":
                    centred = devs[g][i][s]
                elif baseline == "leave_one_out":
                    centred = x - sum(others) / len(others) if others else 0.0
                else:  # pass_at_k: the gap to the best of the others, for the unique best
                    centred = max(x - max(others), 0.0) if others else 0.0
                adv.append(centred / max(scale, epsilon))
            advs.append(adv)
        out.append(advs)
    return out


def reward_to_go_reference(trajs, gamma, size, *, key="seed", step_norm=False, **estimator):
    """``{uid: advantage (steps, k)}`` of whole trajectories (flat TensorDicts) under
    ``MCAdvantage(size, estimator=RewardToGo(gamma), ...)``: each group's trajectories in arrival
    order form rounds of ``size``; every reward element's discounted sum to the end of its
    trajectory (element by element) is compared at its time step
    (:func:`reference_time_step_advantage`)."""
    rounds, queues = [], {}
    for traj in trajs:
        queue = queues.setdefault(int(traj[key][0]), [])
        queue.append(traj)
        if len(queue) == size:
            rounds.append(list(queue))
            queue.clear()
    samples = []
    for members in rounds:
        group = []
        for traj in members:
            reward = traj["next", "reward"].double().reshape(traj.shape[0], -1)  # (T, k)
            to_go, running = torch.zeros_like(reward), torch.zeros(reward.shape[1])
            for t in reversed(range(reward.shape[0])):
                running = reward[t] + gamma * running
                to_go[t] = running
            group.append(to_go.reshape(-1).tolist())  # element j of step t at t * k + j
        samples.append(group)
    advantages = reference_time_step_advantage(samples, **estimator)
    out = {}
    for members, advs in zip(rounds, advantages):
        for traj, adv in zip(members, advs):
            adv = torch.tensor(adv, dtype=torch.float64).view(traj.shape[0], -1)
            if step_norm:
                adv = adv / traj.shape[0]
            for uid, row in zip(traj["uid"].tolist(), adv.float()):
                out[uid] = row
    return out


def verl_dppo(log_prob, old_log_prob, advantages, mask, mode, low, high, clip_ratio_c):
    """verl 0.9.0's ``compute_policy_loss_dppo_tv`` / ``_dppo_kl`` (``core_algos.py``, its
    ``loss_agg_mode="token-mean"``), written out: ``(loss, pg_clipfrac, pg_clipfrac_lower)``,
    ``mask`` verl's float response mask, its ``masked_mean`` dividing by the count + 1e-8."""

    def masked_mean(x):
        return (x * mask).sum() / (mask.sum() + 1e-8)

    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    if mode == "tv":
        valid_positive_mask = (prob - old_prob) <= high
        valid_negative_mask = (prob - old_prob) >= -low
    else:
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
        )
        valid_positive_mask = (binary_kl <= high) | (prob <= old_prob)
        valid_negative_mask = (binary_kl <= low) | (prob >= old_prob)
    valid_mask = torch.where(advantages > 0, valid_positive_mask, valid_negative_mask)
    valid_mask = valid_mask.detach().float()
    pg_losses = -advantages * truncated_ratio * log_prob * valid_mask
    pg_clipfrac_lower = masked_mean((ratio > clip_ratio_c).float() * valid_mask)
    return masked_mean(pg_losses), masked_mean(1.0 - valid_mask), pg_clipfrac_lower
