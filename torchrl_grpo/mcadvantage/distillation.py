"""On-policy distillation on insertion: the teacher's log-probs read from torchrl's LLM rows,
checked, and turned into per-token advantages on the released turns.

The math is :mod:`torchrl_grpo.advantages.distillation`; this module fetches its inputs and
writes its output, as :mod:`~torchrl_grpo.mcadvantage.release` does for the group's advantage.
A step (a turn) is one row of torchrl's LLM layout: its tokens ``("tokens", "full")``, the
prompt ``("tokens", "prompt")`` they start with, the sampling policy's and the teacher's
log-probs of every token (what ``RetrieveLogProb`` writes), and, where the wrappers write it,
``("masks", "all_attention_mask")``. Its response is the tokens after the prompt that the mask
keeps (a padded sampler's trailing pads are left out); the advantage written has the tokens'
shape, ``A_t`` on the response and ``0`` elsewhere, which the loss reads as it reads the
log-probs.

Two entry points: :func:`check_insertion`, run on every insertion before anything is queued
(a step the teacher did not score never waits in a group to fail later), and
:func:`token_advantages`, run on what a release takes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from torchrl_grpo.advantages.distillation import (
    distillation_advantage,
    distillation_metrics,
    future_reverse_kl,
    group_mean_baseline,
)
from torchrl_grpo.mcadvantage.host import read_ints
from torchrl_grpo.mcadvantage.records import Insertion
from torchrl_grpo.mcadvantage.steps import Steps

__all__ = ["STATS_PREFIX", "check_insertion", "token_advantages"]

#: The statistics of :func:`~torchrl_grpo.advantages.distillation_metrics`, in ``get_stats()``
#: as ``distill_<name>`` (absent until a release computed them).
STATS_PREFIX = "distill_"


class _Rows(NamedTuple):
    """Some steps' rows, flat: every token of every row, row after row, on the CPU."""

    student: Tensor  # (T,) the sampling policy's log-probs
    teacher: Tensor  # (T,) the teacher's
    real: Tensor  # (T,) bool: a real response token
    index: Tensor  # (T,) the token's index in its row
    position: Tensor  # (T,) of a real token: how many real tokens precede it in its row
    row: Tensor  # (T,) the row of each token
    full: Tensor  # (N,) tokens of each row
    prompt: Tensor  # (N,) of them the prompt's
    prompt_real: Tensor  # (N,) the prompt's real tokens
    end: Tensor  # (N,) the row's real tokens


def check_insertion(distillation, batch: Insertion, *, per_step: bool, reward_key) -> None:
    """Refuse an insertion a release could not turn into distillation advantages.

    Every step must carry the teacher's and the sampling policy's log-probs, one per token of
    its row, finite on its response; with ``per_step`` (``alpha > 0`` and per-step rewards,
    ``trajectory_return=None``), every step one reward element (its turn's advantage).

    Args:
        distillation: the :class:`~torchrl_grpo.mcadvantage.estimators.Distillation`.
        batch: the insertion.
        per_step: whether each step's reward element is its turn's group advantage.
        reward_key: the key of the rewards (named in the message).

    Raises:
        KeyError: a step without the teacher's (or the policy's) log-probs: the teacher did not
            score the batch.
        ValueError: a step whose log-probs are not as many as its tokens, or not finite on its
            response (the step, the key and the value named), or several reward elements.
    """
    rows = _read_rows(distillation, batch.steps)
    finite = torch.isfinite(rows.student) & torch.isfinite(rows.teacher) | ~rows.real
    one_each = (batch.reward_lengths == batch.lengths).all() if per_step else True
    all_finite, one_each = read_ints(finite.all(), one_each)
    if not all_finite:
        _raise_not_finite(distillation, rows, ~finite)
    if not one_each:
        raise ValueError(
            f"MCAdvantage: Distillation(alpha={distillation.alpha}) adds each turn's group "
            f"advantage to its tokens, which needs one reward element per step under "
            f"{reward_key!r} (torchrl's [1, 1]) or a trajectory_return; this "
            "insertion's steps have several."
        )


def token_advantages(
    distillation,
    steps: Steps,
    step_advantage: Tensor | None,
    trajectory_steps: Tensor,
    groups: tuple[Tensor, int] | None = None,
) -> tuple[Tensor, dict]:
    """The distillation advantage of every token of released steps, and its statistics.

    Args:
        distillation: the weights and keys.
        steps: the released steps, trajectory after trajectory, each in order.
        step_advantage: the group's advantage of each step, ``(N,)``; ``None`` with
            ``alpha = 0``.
        trajectory_steps: steps per released trajectory, ``(M,)``.
        groups: ``(group of each released trajectory (M,), number of groups)``, read with a
            ``baseline``.

    Returns:
        ``(advantage, stats)``: every token's advantage, ``(T,)`` in the log-probs' dtype, row
        after row (``0`` off the response), and ``{distill_<name>: 0-d tensor}``.
    """
    rows = _read_rows(distillation, steps)
    real = rows.real
    student, teacher = rows.student[real], rows.teacher[real]  # (K,) the response tokens
    token_row = rows.row[real]  # (K,)
    kl = student.double() - teacher.double()  # (K,) d_t
    per_row = rows.full.new_zeros(rows.full.shape).index_add_(0, rows.row, real.long())  # (N,)
    if distillation.gamma:
        segment, count = _segments(rows, trajectory_steps)  # (N,) and their number
        tokens = torch.zeros(count, dtype=torch.long).index_add_(0, segment, per_row)
        kl = future_reverse_kl(kl, tokens, distillation.gamma, positions=rows.position[real])
    group = None if distillation.alpha == 0.0 else step_advantage.cpu()[token_row]
    baseline = None
    if distillation.baseline:
        member, num_groups = groups
        step_group = member.cpu().repeat_interleave(
            trajectory_steps.cpu(), output_size=len(per_row)
        )
        token_group = step_group[token_row]
        if distillation.baseline == "position":  # a mean per group and position in the response
            offset = rows.position[real] - rows.prompt_real[token_row]  # real tokens before it
            [width] = read_ints(offset.max() + 1) if len(offset) else [1]
            token_group, num_groups = token_group * width + offset, num_groups * width
        baseline = group_mean_baseline(kl, token_group, num_groups)
    adv = distillation_advantage(
        kl,
        beta=distillation.beta,
        alpha=distillation.alpha,
        group_advantage=group,
        baseline=baseline,
    )
    out = rows.student.new_zeros(rows.student.shape).masked_scatter_(real, adv.to(student.dtype))
    metrics = distillation_metrics(student, teacher, per_row, trajectory_lengths=trajectory_steps)
    return out, {STATS_PREFIX + name: value for name, value in metrics.items()}


def _segments(rows: _Rows, trajectory_steps: Tensor) -> tuple[Tensor, int]:
    """``(segment of each row, number of segments)``: the runs of rows over which the future
    reverse KL is summed. A trajectory's row continues the one before it when its prompt holds
    at least as many tokens as that row's real ones (the next turn extends the dialog, as
    :class:`~torchrl_grpo.llm.ExactTurns` builds it); otherwise the sum stops there, as Tinker
    starts a new sequence when an observation does not extend the previous one."""
    num_rows = rows.full.shape[0]
    first = torch.zeros(num_rows, dtype=torch.bool)
    first[torch.cumsum(trajectory_steps, 0)[:-1]] = True
    first[0] = True
    first[1:] |= rows.prompt_real[1:] < rows.end[:-1]
    segment = torch.cumsum(first.long(), 0) - 1  # (N,)
    [count] = read_ints(first.sum())
    return segment, count


def _read_rows(distillation, steps: Steps) -> _Rows:
    """The rows' tokens, log-probs and masks, flat, checked to line up (see :class:`_Rows`).

    Positions count real tokens only, so that a row's padding (a padded sampler's trailing
    pads, prompts padded on the left) moves no token: a dialog's tokens have the same positions
    in every layout."""
    tokens = steps.entries(distillation.tokens_key, "tokens")
    full = _lengths(tokens)  # (N,)
    prompt = torch.zeros_like(full)  # no prompt key: every token is the response
    if distillation.prompt_tokens_key is not None:
        prompt = _lengths(steps.entries(distillation.prompt_tokens_key, "prompt tokens"))
    student = _values(steps, distillation.log_prob_key, full, prompt, "sampling log-probs")
    teacher = _values(steps, distillation.teacher_key, full, prompt, "teacher's log-probs")
    total = student.shape[0]
    row = torch.arange(full.shape[0]).repeat_interleave(full, output_size=total)  # (T,)
    index = torch.arange(total) - (torch.cumsum(full, 0) - full)[row]  # (T,)
    mask = _mask(steps, distillation.mask_key, full, prompt, total)
    in_prompt = index < prompt[row]
    end = full.new_zeros(full.shape).index_add_(0, row, mask.long())  # (N,) real tokens
    prompt_real = full.new_zeros(full.shape).index_add_(0, row, (mask & in_prompt).long())
    before = torch.cumsum(end, 0) - end  # (N,) real tokens of the rows before
    position = torch.cumsum(mask.long(), 0) - 1 - before[row]  # (T,)
    real = ~in_prompt & mask
    return _Rows(student, teacher, real, index, position, row, full, prompt, prompt_real, end)


def _lengths(entries: Tensor | list) -> Tensor:
    """Tokens per row of an entry (a tensor with one row per step, or one tensor per step)."""
    if isinstance(entries, Tensor):
        return torch.full((entries.shape[0],), entries[0].numel() if entries.shape[0] else 0)
    return torch.tensor([entry.numel() for entry in entries], dtype=torch.long)


def _flat(entries: Tensor | list) -> Tensor:
    """An entry's rows one after the other, on the CPU: one copy to the host (one wait on a
    device), not one per step."""
    if isinstance(entries, Tensor):
        return entries.reshape(-1).cpu()
    if not entries:
        return torch.zeros(0)
    return torch.cat([entry.reshape(-1) for entry in entries]).cpu()


def _values(steps: Steps, key, full: Tensor, prompt: Tensor, what: str) -> Tensor:
    """The log-probs under ``key`` of every token, flat; a step without them, or with another
    number of them than its tokens, raises."""
    try:
        entries = steps.entries(key, what)
    except KeyError as error:
        raise KeyError(
            f"{error.args[0]} Distillation reads the {what} of every token of each step: "
            "score the batch with the teacher before extending the buffer "
            "(torchrl_grpo.llm.TeacherLogProbs, or torchrl's RetrieveLogProb); a batch the "
            "teacher did not score is refused, never trained on with A_t = 0."
        ) from None
    lengths = _lengths(entries)
    wrong = lengths != full
    if bool(wrong.any()):
        step = int(wrong.nonzero()[0])
        raise ValueError(
            f"MCAdvantage: step {step} has {int(lengths[step])} {what} under {key!r}, but "
            f"{int(full[step])} tokens (a prompt of {int(prompt[step])} and a response of "
            f"{int(full[step] - prompt[step])}): Distillation needs one per token of "
            "('tokens', 'full'), as RetrieveLogProb writes them, so that teacher and student "
            "score the same tokens."
        )
    return _flat(entries)


def _mask(steps: Steps, key, full: Tensor, prompt: Tensor, total: int) -> Tensor:
    """The real tokens of every row, flat: the mask under ``key`` where every step has it,
    else every token."""
    if key is None:
        return torch.ones(total, dtype=torch.bool)
    try:
        entries = steps.entries(key, "mask")
    except KeyError:
        return torch.ones(total, dtype=torch.bool)
    mask = _flat(entries).bool()
    if mask.shape[0] != total:
        lengths = _lengths(entries)
        step = int((lengths != full).nonzero()[0])
        raise ValueError(
            f"MCAdvantage: step {step} has a mask of {int(lengths[step])} entries under {key!r} "
            f"for {int(full[step])} tokens (a prompt of {int(prompt[step])})."
        )
    return mask


def _raise_not_finite(distillation, rows: _Rows, bad: Tensor) -> None:
    """Name the first response token whose log-prob is not finite, its step and its key."""
    token = int(bad.nonzero()[0])
    step = int(rows.row[token])
    at = int(rows.index[token] - rows.prompt[step])
    for key, values in (
        (distillation.teacher_key, rows.teacher),
        (distillation.log_prob_key, rows.student),
    ):
        if not bool(torch.isfinite(values[token])):
            raise ValueError(
                f"MCAdvantage: the log-prob under {key!r} of response token {at} of step {step} "
                f"is {float(values[token])}: Distillation needs finite log-probs on every "
                "response token (a teacher that gives a sampled token probability 0 cannot "
                "score it)."
            )
