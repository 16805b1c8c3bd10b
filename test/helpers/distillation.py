"""Dialogs scored by a student and a teacher, in torchrl's LLM layout, and the same dialogs in
the peers' layouts (test/mcadvantage/test_distillation.py).

A dialog is a list of turns; turn ``k``'s prompt is turn ``k - 1``'s tokens and the
environment's reply (the dialog grows by appending, as :class:`~torchrl_grpo.llm.ExactTurns`
builds it), its response one to four sampled tokens, each with the student's and the teacher's
log-probs. :func:`rows` lays the turns out as torchrl's rows: ragged (a lazy stack, each row
its own length) or padded (one ``TensorDict``, prompts padded on the left, responses on the
right, ``("masks", "all_attention_mask")`` marking the real tokens, junk log-probs on the pads).
"""

from __future__ import annotations

import random
from typing import NamedTuple

import torch
from tensordict import TensorDict, lazy_stack

PAD = 99  # the pad token of the padded layout
JUNK = 7.5  # the log-probs written on pads and prompts: never read


class Turn(NamedTuple):
    prompt: list  # every token before the response
    response: list
    student: list  # log-probs of the response tokens
    teacher: list
    reward: float


def dialogs(num_groups: int, size: int, turns: int, seed: int) -> list[list[Turn]]:
    """``num_groups * size`` dialogs of ``turns`` turns (group ``d // size``)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_groups * size):
        tokens, dialog = [rng.randrange(10) for _ in range(rng.randint(2, 4))], []
        for k in range(turns):
            if k:
                tokens = tokens + [rng.randrange(10) for _ in range(rng.randint(1, 3))]
            n = rng.randint(1, 4)
            response = [rng.randrange(10) for _ in range(n)]
            student = [-rng.uniform(0.05, 3.0) for _ in range(n)]
            teacher = [-rng.uniform(0.05, 3.0) for _ in range(n)]
            dialog.append(Turn(tokens, response, student, teacher, float(rng.randint(0, 2))))
            tokens = tokens + response
        out.append(dialog)
    return out


def rows(dialogs_: list[list[Turn]], size: int, *, padded: bool):
    """The turns as torchrl's rows, dialog after dialog: ragged (a lazy stack) or padded."""
    turns = [
        (d // size, k == len(dialog) - 1, t)
        for d, dialog in enumerate(dialogs_)
        for k, t in enumerate(dialog)
    ]
    if not padded:
        return lazy_stack([_row(g, last, t, 0, 0) for g, last, t in turns])
    left = max(len(t.prompt) for _, _, t in turns)
    right = max(len(t.response) for _, _, t in turns)
    return torch.stack(
        [_row(g, last, t, left - len(t.prompt), right - len(t.response)) for g, last, t in turns]
    )


def _row(group: int, last: bool, turn: Turn, left: int, right: int) -> TensorDict:
    """One turn's row: ``left`` pads before its prompt, ``right`` after its response."""
    full = [PAD] * left + turn.prompt + turn.response + [PAD] * right
    real = [False] * left + [True] * (len(turn.prompt) + len(turn.response)) + [False] * right
    start = left + len(turn.prompt)

    def log_probs(values):
        out = torch.full((len(full),), JUNK)
        out[start : start + len(values)] = torch.tensor(values)
        return out

    data = TensorDict(
        group=torch.tensor(group),
        tokens=TensorDict(full=torch.tensor(full), prompt=torch.tensor(full[:start])),
        masks=TensorDict(all_attention_mask=torch.tensor(real)),
        next=TensorDict(
            reward=torch.tensor([[turn.reward]]),
            done=torch.tensor([last]),
            log_probs=TensorDict(full=log_probs(turn.student)),
            teacher_log_probs=TensorDict(full=log_probs(turn.teacher)),
        ),
    )
    return data


def response_advantages(out, dialogs_: list[list[Turn]]) -> list[torch.Tensor]:
    """The advantage written on each turn's response tokens, turn after turn."""
    turns = [t for dialog in dialogs_ for t in dialog]
    values = out.get("advantage", as_list=True) if out.batch_dims else [out["advantage"]]
    found = []
    for value, row, turn in zip(values, out.get(("tokens", "prompt"), as_list=True), turns):
        start = row.shape[-1]
        found.append(value[start : start + len(turn.response)])
    return found


def padded_responses(dialogs_: list[list[Turn]]) -> dict:
    """verl's layout of every turn, one row each: the response tokens' log-probs right-padded
    with 0, the response mask, and Trinity-RFT's run ids (``batch/task/run/step``)."""
    turns = [(d, k, t) for d, dialog in enumerate(dialogs_) for k, t in enumerate(dialog)]
    width = max(len(t.response) for _, _, t in turns)

    def pad(values):
        return torch.tensor(values + [0.0] * (width - len(values)))

    return {
        "old_log_probs": torch.stack([pad(t.student) for _, _, t in turns]),
        "teacher_logprobs": torch.stack([pad(t.teacher) for _, _, t in turns]),
        "response_mask": torch.stack([torch.arange(width) < len(t.response) for _, _, t in turns]),
        "unique_ids": [f"0/task/{d}/{k}" for d, k, _ in turns],
    }


def tinker_transitions(dialog: list[Turn]):
    """A dialog as Tinker's transitions ``(observation, action, action log-probs)``, and the
    teacher's log-probs of its whole sequence (``None`` first, as ``compute_logprobs``; ``0``
    off the actions)."""
    transitions = [(t.prompt, t.response, t.student) for t in dialog]
    last = dialog[-1]
    teacher = [0.0] * (len(last.prompt) + len(last.response))
    for t in dialog:
        teacher[len(t.prompt) : len(t.prompt) + len(t.response)] = t.teacher
    return transitions, [None, *teacher[1:]]


def centred_per_position(d: torch.Tensor, real: torch.Tensor, prompts: torch.Tensor):
    """``d`` (``[B, R]``: the log-ratio at each response position of right-padded completions)
    less the mean over the real tokens of its group (its rows of one prompt, ``prompts``
    ``[B, P]``) at the same position: ``Distillation(baseline="position")``, transcribed."""
    d = d.clone()
    _, group = torch.unique(prompts, dim=0, return_inverse=True)
    for g in group.unique():
        rows = group == g
        for k in range(d.shape[1]):  # the completions are right-padded: k is the position
            here = real[rows, k]
            d[rows, k] -= torch.where(here, d[rows, k][here].mean() if here.any() else 0, 0)
    return d
