"""The peers' on-policy distillation, transcribed step by step (the references of
test/advantages/test_distillation.py and test/mcadvantage/test_distillation.py).

Each function follows its source's operations in their order -- which tensor is masked, in
which dtype, which std -- with only the containers replaced: a verl ``DataProto``'s ``batch`` is
a dict of tensors, a tinker ``Datum`` a dict with its ``loss_fn_inputs``' tensors, a teacher
sampling client the log-probs it would return (a list, ``None`` first, one per token).

* Trinity-RFT, ``trinity.algorithm.advantage_fn.on_policy_distill_advantage``:
  ``OnPolicyDistillAdvantage`` (modelscope/Trinity-RFT at bc88283), and ``_compute_opd_advantage``
  with the multi-turn ``MultiTurnOpdAdvantage`` (the Trinity-RFT fork jasonchen505/TCOD at
  63bab6f, the same module).
* Tinker, thinking-machines-lab/tinker-cookbook: ``incorporate_kl_penalty`` of
  ``tinker_cookbook.distillation.train_on_policy`` (at 53aaf8d),
  ``discounted_future_sum_vectorized`` of ``tinker_cookbook.rl.metrics`` (at 1f65611, the loop
  that replaced ``scipy.signal.lfilter([1], [1, -gamma], x[::-1])[::-1]``, the same numbers), and
  ``compute_advantages`` / ``trajectory_to_data`` of ``tinker_cookbook.rl.data_processing``
  (the group-centred advantage; 0f838c0 also multiplies it by ``G / (G - 1)``, which is not
  transcribed).
* NeMo-RL, NVIDIA-NeMo/RL at 00925dd: ``OPDAdvantageEstimator`` of
  ``nemo_rl.algorithms.advantage_estimator`` (``adv_estimator: opd``).
"""

from __future__ import annotations

from collections import defaultdict

import torch

# --- Trinity-RFT -------------------------------------------------------------------------------


def trinity_compute_opd_advantage(old_log_probs, teacher_log_probs, response_mask, valid, kl_coef):
    """``_compute_opd_advantage``: ``kl_coef * (teacher - old)`` times the mask of response
    tokens the teacher scored, with the per-row KL sums' mean and (Bessel) std as metrics."""
    effective = response_mask & valid
    advantages = kl_coef * (teacher_log_probs - old_log_probs) * effective
    kl_sum = ((old_log_probs - teacher_log_probs) * effective).sum(dim=-1)
    metrics = {
        "kl/mean": kl_sum.mean().item(),
        "kl/std": kl_sum.std().item() if kl_sum.numel() > 1 else 0.0,
        "advantages/mean": advantages.sum(dim=-1).mean().item(),
    }
    return advantages, metrics


def trinity_on_policy_distill(batch: dict, kl_coef: float = 1.0):
    """``OnPolicyDistillAdvantage``: one response per row, the teacher valid on the response."""
    mask = batch["response_mask"]
    advantages, metrics = trinity_compute_opd_advantage(
        batch["old_log_probs"], batch["teacher_logprobs"], mask, mask, kl_coef
    )
    return {**batch, "advantages": advantages, "returns": advantages.clone()}, metrics


def trinity_multi_turn_opd(batch: dict, kl_coef: float = 1.0):
    """``MultiTurnOpdAdvantage``: one turn per row; the turns of a run (``unique_ids``
    ``batch/task/run/step``) summed into a trajectory KL, its mean and population std."""
    mask = batch["response_mask"]
    valid = batch.get("teacher_logprobs_valid_mask")
    valid = mask if valid is None else valid.to(dtype=mask.dtype)
    old, teacher = batch["old_log_probs"], batch["teacher_logprobs"]
    advantages, metrics = trinity_compute_opd_advantage(old, teacher, mask, valid, kl_coef)
    if batch.get("unique_ids") is not None:
        runs = [
            "/".join(str(u).split("/")[:3]) if len(str(u).split("/")) >= 4 else str(u)
            for u in batch["unique_ids"]
        ]
        per_turn = ((old - teacher) * (mask & valid)).sum(dim=-1)
        sums: dict = defaultdict(float)
        for run, kl in zip(runs, per_turn.tolist()):
            sums[run] += kl
        values = list(sums.values())
        mean = sum(values) / len(values)
        metrics["kl/trajectory_mean"] = mean
        metrics["kl/trajectory_std"] = (
            (sum((x - mean) ** 2 for x in values) / len(values)) ** 0.5 if len(values) > 1 else 0.0
        )
    return {**batch, "advantages": advantages, "returns": advantages.clone()}, metrics


# --- Tinker ------------------------------------------------------------------------------------


def tinker_discounted_future_sum(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """``discounted_future_sum_vectorized``: ``y_t = x_t + gamma * y_{t+1}``, from the end."""
    out = torch.empty_like(x)
    running = torch.zeros(1, dtype=x.dtype)
    for t in reversed(range(len(x))):
        running = x[t] + gamma * running
        out[t] = running
    return out


def tinker_compute_advantages(rewards_per_group: list[list[float]]) -> list[torch.Tensor]:
    """``compute_advantages``: each trajectory's total reward minus its group's mean."""
    out = []
    for rewards in rewards_per_group:
        r = torch.tensor(rewards)
        out.append(r - r.mean())
    return out


def tinker_trajectory_to_data(transitions, traj_advantage: float) -> list[dict]:
    """``trajectory_to_data``: a dialog's turns ``(observation tokens, action tokens, action
    log-probs)`` as datums; an observation that extends the sequence so far continues its datum
    (the new observation tokens with log-prob, advantage and mask 0), any other starts a new
    one. A datum's entries are shifted by one: entry ``t`` is about token ``t + 1``."""
    data, seq, logprobs, advantages, mask = [], [], [], [], []

    def flush():
        data.append(
            {
                "tokens": list(seq),
                "target_tokens": torch.tensor(seq[1:]),
                "logprobs": torch.tensor(logprobs[1:]),
                "advantages": torch.tensor(advantages[1:], dtype=torch.float32),
                "mask": torch.tensor(mask[1:]),
            }
        )

    for ob, ac, ac_logprobs in transitions:
        if not seq:
            delta = list(ob)
        elif len(seq) <= len(ob) and list(ob[: len(seq)]) == seq:
            delta = list(ob[len(seq) :])
        else:
            flush()
            seq, logprobs, advantages, mask = [], [], [], []
            delta = list(ob)
        seq += delta + list(ac)
        logprobs += [0.0] * len(delta) + list(ac_logprobs)
        advantages += [0.0] * len(delta) + [traj_advantage] * len(ac)
        mask += [0.0] * len(delta) + [1.0] * len(ac)
    if seq:
        flush()
    return data


def tinker_incorporate_kl_penalty(
    data_D, teacher_logprobs_D, dataset_indices_D, kl_penalty_coef, kl_discount_factor
):
    """``incorporate_kl_penalty``: ``reverse_kl = (sampled - teacher[1:]) * mask``; each datum's
    advantages plus ``-coef * mask * reverse_kl``, its discounted future sum when
    ``kl_discount_factor > 0``; the mean reverse KL over the masked tokens, overall and per
    dataset."""
    sampled = [datum["logprobs"] for datum in data_D]
    masks = [datum["mask"].float() for datum in data_D]
    reverse_kl = [
        (s - torch.tensor(t[1:])) * m for t, s, m in zip(teacher_logprobs_D, sampled, masks)
    ]
    per_dataset: dict = {}
    for i, datum in enumerate(data_D):
        kl_advantages = -kl_penalty_coef * masks[i] * reverse_kl[i]
        if kl_discount_factor > 0:
            kl_advantages = tinker_discounted_future_sum(kl_advantages, kl_discount_factor)
        datum["advantages"] = datum["advantages"] + kl_advantages
        index = dataset_indices_D[i]
        kl_sum, mask_sum = per_dataset.get(index, (0.0, 0.0))
        per_dataset[index] = (kl_sum + reverse_kl[i].sum().item(), mask_sum + masks[i].sum().item())
    average = sum(d.sum() for d in reverse_kl) / sum(m.sum() for m in masks)
    metrics = {"teacher_kl": float(average)}
    for index, (kl_sum, mask_sum) in per_dataset.items():
        if mask_sum > 0:
            metrics[f"teacher_kl/dataset_{index}"] = float(kl_sum / mask_sum)
    return metrics


# --- NeMo-RL -----------------------------------------------------------------------------------


def nemo_opd_advantage(teacher_logprobs, prev_logprobs, mask):
    """``OPDAdvantageEstimator.compute_advantage``: ``sg[teacher - student] * mask`` (MOPD's
    Eq. 8), and its metrics over the mask's tokens (the std with Bessel's correction)."""
    if teacher_logprobs is None:
        raise ValueError("OPD requires teacher_logprobs")
    if prev_logprobs is None:
        raise ValueError("OPD requires prev_logprobs")
    distill = (teacher_logprobs - prev_logprobs).detach()
    advantages = distill * mask
    valid = mask.bool()
    distill_valid = torch.masked_select(distill, valid)
    adv_valid = torch.masked_select(advantages, valid)
    metrics = {
        "on_policy_distillation/teacher_student_logprob_gap_mean": (
            distill_valid.mean().item() if distill_valid.numel() > 0 else 0.0
        ),
        "on_policy_distillation/adv_mean": adv_valid.mean().item() if adv_valid.numel() else 0.0,
        "on_policy_distillation/adv_std": adv_valid.std().item() if adv_valid.numel() > 1 else 0.0,
    }
    return advantages, metrics
