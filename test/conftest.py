"""Helpers shared by the test files (import them with ``from conftest import ...``).

Transform side: trajectories of one group id, random interleaved streams of them, and the
comparison of every release with torchrl's ``MCAdvantage``.
"""

from __future__ import annotations

import random

import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict
from torchrl.objectives.llm import MCAdvantage as TorchRLMCAdvantage

from torchrl_grpo import MCAdvantage

_uid = iter(range(10**9))


def next_uid() -> int:
    """A number no other step of the test session has (steps are told apart by it)."""
    return next(_uid)


def trajectory(group, rewards, key="seed", width=1):
    """One trajectory: ``len(rewards)`` steps, the last one done; every step has a unique uid."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(len(rewards), -1)
    steps = rewards.shape[0]
    done = torch.zeros(steps, 1, dtype=torch.bool)
    done[-1] = True
    if isinstance(group, str):
        gid = NonTensorData(group, batch_size=[steps])
    else:
        gid = torch.full((steps, width), group, dtype=torch.long).squeeze(-1)
    td = TensorDict(
        uid=torch.tensor([next_uid() for _ in range(steps)]),
        next=TensorDict(reward=rewards, done=done, batch_size=[steps]),
        batch_size=[steps],
    )
    td.set(key, gid)
    return td


def random_stream(num_groups, size, seed, *, max_len=5, binary=False, strings=False, key="seed"):
    """``num_groups * size`` trajectories of random lengths, interleaved at random."""
    rng = random.Random(seed)
    trajs = []
    for g in range(num_groups):
        gid = f"prompt {g}" if strings else g
        for _ in range(size):
            length = rng.randint(1, max_len)
            if binary:
                rewards = [0.0] * (length - 1) + [float(rng.random() < 0.5)]
            else:
                rewards = [rng.gauss(0, 1) for _ in range(length)]
            trajs.append(trajectory(gid, rewards, key=key))
    rng.shuffle(trajs)
    return trajs


def random_chunks(trajs, seed):
    """Cut a stream of trajectories into flat ``extend`` batches of random sizes."""
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(trajs):
        j = min(len(trajs), i + rng.randint(1, 12))
        chunks.append(torch.cat(trajs[i:j]))
        i = j
    return chunks


def released(out):
    """uid -> advantage row, for one output (or {} for None)."""
    if out is None:
        return {}
    if isinstance(out, LazyStackedTensorDict):
        return {int(step["uid"]): step["advantage"] for step in out.unbind(0)}
    return dict(zip(out["uid"].tolist(), out["advantage"].unbind(0)))


def assert_same_releases(chunks, kwargs):
    """Feed both implementations; each call must release the same steps, same advantages."""
    ours, ref = MCAdvantage(**kwargs), TorchRLMCAdvantage(**kwargs)
    for chunk in chunks:
        got, want = released(ours.inv(chunk)), released(ref.inv(chunk))
        assert got.keys() == want.keys()
        for uid, adv in want.items():
            torch.testing.assert_close(got[uid], adv, atol=1e-6, rtol=1e-6)
    for name, value in ref.get_stats().items():
        assert ours.get_stats()[name] == pytest.approx(value, rel=1e-5), name
    return ours


def bad_inputs():
    """(description, batch, exception, words the message must contain, the first a pattern)."""
    good = trajectory(0, [1.0, 2.0])
    not_done = good.clone()
    not_done["next", "done"][-1] = False
    nan = good.clone()
    nan["next", "reward"][0] = float("nan")
    inf = good.clone()
    inf["next", "reward"][1] = float("inf")
    two_flags = good.clone()
    two_flags["next", "done"] = torch.ones(2, 2, dtype=torch.bool)
    empty_reward = good.clone()
    empty_reward["next", "reward"] = torch.zeros(2, 0)
    unhashable = good.clone()
    unhashable["seed"] = NonTensorData({"a": 1}, batch_size=[2])
    stringy = trajectory("a prompt", [1.0], key="seed")
    return [
        ("no done at the end", not_done, RuntimeError, ["expected complete", "done"]),
        ("missing group id", good.exclude("seed"), KeyError, ["group id key", "seed"]),
        ("missing reward", good.exclude(("next", "reward")), KeyError, ["reward key", "reward"]),
        ("missing done", good.exclude(("next", "done")), KeyError, ["done key", "done"]),
        ("nan reward", nan, ValueError, ["non-finite", "reward", "nan", "step 0"]),
        ("inf reward", inf, ValueError, ["non-finite", "reward", "inf", "step 1"]),
        ("two done flags per step", two_flags, ValueError, ["one flag per step", "(2, 2)"]),
        ("empty reward", empty_reward, ValueError, ["is empty at step 0", "reward"]),
        ("unhashable group id", unhashable, TypeError, ["string or a tensor", "seed", "dict"]),
        ("string id among tensor ids", stringy, TypeError, ["are strings", "seed"]),
    ]
