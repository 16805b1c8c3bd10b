"""Checkpoints of ``MCAdvantage`` written by torchrl_grpo 0.1.0 before the package's layout
changed (commit 62fa4a3), kept in ``test/data``, and the streams that made them.

Each checkpoint is the transform's ``state_dict()`` after the first part of a seeded stream; a
test loads it, inserts the rest, and compares with a transform that saw the whole stream. The
streams build every step from a ``torch.Generator`` (uids included), so they are the same in any
process. To write the files again (only ever with the code the files are named after)::

    cd test && ../.venv/bin/python -m helpers.checkpoints data
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tensordict import NonTensorData, TensorDict, lazy_stack

#: name -> (MCAdvantage keyword arguments, how many insertions go before the checkpoint)
CASES = {
    "tensor_ids": (dict(grpo_size=4, prompt_key="seed", trajectory_return="sum"), 3),
    "per_step": (dict(grpo_size=3, prompt_key="seed", max_pending_groups=50), 3),
    "streaming": (dict(grpo_size=3, prompt_key="seed", trajectory_return="mean"), 2),
    "prompts_ragged": (dict(grpo_size=2, trajectory_return="sum"), 2),
}


def _trajectory(gen, group, length, uid):
    rewards = torch.randn(length, 1, generator=gen)
    done = torch.zeros(length, 1, dtype=torch.bool)
    done[-1] = True
    return TensorDict(
        seed=torch.full((length,), group),
        uid=torch.arange(uid, uid + length),
        observation=torch.randn(length, 3, generator=gen),
        next=TensorDict(reward=rewards, done=done, batch_size=[length]),
        batch_size=[length],
    )


def _whole_trajectories(size, seed):
    gen = torch.Generator().manual_seed(seed)
    groups = torch.arange(6).repeat_interleave(size)[torch.randperm(6 * size, generator=gen)]
    trajs, uid = [], 0
    for g in groups.tolist():
        length = int(torch.randint(1, 5, (1,), generator=gen))
        trajs.append(_trajectory(gen, g, length, uid))
        uid += length
    return [torch.cat(trajs[i : i + 5]) for i in range(0, len(trajs), 5)]


def _collector_batches():
    """``[2, 4]`` batches of two environments, trajectories cut across batches."""
    gen = torch.Generator().manual_seed(7)
    rows = []
    lengths = [[3, 6, 2, 5], [6, 3, 4, 3]]  # each row: 16 steps
    starts = sorted((sum(row[:k]), env, k) for env, row in enumerate(lengths) for k in range(4))
    ids = {(env, k): i for i, (_, env, k) in enumerate(starts)}
    for env, row in enumerate(lengths):
        parts = []
        for k, n in enumerate(row):
            part = _trajectory(gen, ids[env, k] // 3, n, 100 * env + sum(row[:k]))
            part["step_count"] = torch.arange(n).unsqueeze(-1)
            part["collector", "traj_ids"] = torch.full((n,), ids[env, k])
            parts.append(part)
        rows.append(torch.cat(parts))
    timeline = torch.stack(rows)
    return [timeline[:, t : t + 4].clone() for t in range(0, 16, 4)]


def _ragged_prompts():
    gen = torch.Generator().manual_seed(3)

    def step(prompt, n, done, uid):
        return TensorDict(
            query=NonTensorData(prompt),
            uid=torch.tensor(uid),
            tokens=torch.randint(0, 50, (n,), generator=gen),
            next=TensorDict(reward=torch.randn(n, 1, generator=gen), done=torch.tensor([done])),
        )

    prompts = ["2+2=", "3*3=", "2+2=", "7-1=", "3*3=", "7-1="]
    return [
        lazy_stack([step(p, 2 + (i % 3), False, 10 * i), step(p, 3, True, 10 * i + 1)])
        for i, p in enumerate(prompts)
    ]


def stream(name: str) -> list:
    """The insertions of case ``name``, in order."""
    if name == "tensor_ids":
        return _whole_trajectories(4, seed=0)
    if name == "per_step":
        return _whole_trajectories(3, seed=1)
    if name == "streaming":
        return _collector_batches()
    if name == "prompts_ragged":
        return _ragged_prompts()
    raise KeyError(name)


def path(folder: Path | str, name: str) -> Path:
    return Path(folder) / f"mcadvantage_0.1.0_{name}.pt"


def write(folder: Path | str) -> None:
    from torchrl_grpo import MCAdvantage

    for name, (kwargs, before) in CASES.items():
        transform = MCAdvantage(**kwargs)
        for insertion in stream(name)[:before]:
            transform.inv(insertion)
        torch.save(transform.state_dict(), path(folder, name))
        print(name, transform.get_stats())


if __name__ == "__main__":
    write(sys.argv[1])
