"""Trajectories for the transform's tests: one group's trajectory, random interleaved streams of
them, a collector's batches, bad inputs, and the comparison of every release with torchrl's
``MCAdvantage``."""

from __future__ import annotations

import random

import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict
from torchrl.objectives.llm import MCAdvantage as TorchRLMCAdvantage

from torchrl_grpo import MCAdvantage

_uid = iter(range(10**9))


def next_uid() -> int:
    """A number no other step of the test session has (steps are told apart by it)."""
    return next(_uid)


def trajectory(group, rewards, key="seed", width=1, **extra):
    """One trajectory: ``len(rewards)`` steps, the last one done; every step has a unique uid.

    ``extra``: more per-step entries, ``name=values`` (a tensor with one row per step, or a list
    of strings); a name starting with ``next_`` goes under ``"next"``.
    """
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
    for name, values in extra.items():
        where = ("next", name[len("next_") :]) if name.startswith("next_") else name
        if isinstance(values, list) and isinstance(values[0], str):
            td.set(where, NonTensorStack(*values, batch_size=[steps]))
        else:
            td.set(where, torch.as_tensor(values))
    return td


def reference_discounted_returns(rewards, lengths, gamma):
    """``y_t = r_t + gamma * y_{t+1}`` within each run of ``lengths``, one step at a time (a
    backward loop per trajectory, as verl-agent's ``compute_step_discounted_returns``)."""
    out, start = [], 0
    for n in lengths:
        running, returns = 0.0, [0.0] * n
        for t in reversed(range(n)):
            running = rewards[start + t] + gamma * running
            returns[t] = running
        out += returns
        start += n
    return torch.tensor(out, dtype=torch.float64)


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


# --- streams of a collector: trajectories that cross insertions --------------------------------


def collector_stream(num_envs, num_groups, size, seed, *, max_len=7, steps_per_batch=5):
    """What a torchrl collector yields: ``[num_envs, T]`` batches cut every ``T`` steps.

    Each environment plays trajectories one after the other; trajectory ids are handed out in
    the order trajectories start (as torchrl's trajectory pool does); every step has a unique
    ``uid``, a ``("collector", "traj_ids")`` entry and a ``"step_count"``. Every environment's
    timeline is cut to a multiple of ``T`` by shortening its last trajectory, so that nothing is
    left unfinished at the end. Groups (``"seed"``) of ``size`` trajectories each.

    Returns:
        ``(batches, completed)``: the ``[num_envs, T]`` batches, and for each batch the
        trajectories (flat TensorDicts) that end in it, in the order of their last step in the
        row-major flattened batch: what inserting whole trajectories would insert.
    """
    rng = random.Random(seed)
    seeds = [g for g in range(num_groups) for _ in range(size)]
    rng.shuffle(seeds)
    per_env = [[] for _ in range(num_envs)]  # (seed, length) per env
    for i, s in enumerate(seeds):
        per_env[i % num_envs].append([s, rng.randint(1, max_len)])
    horizon = max(sum(n for _, n in trajs) for trajs in per_env)
    horizon = -(-horizon // steps_per_batch) * steps_per_batch
    for trajs in per_env:  # pad every timeline to the horizon with its last trajectory
        trajs[-1][1] += horizon - sum(n for _, n in trajs)
    # ids in the order trajectories start (ties by env), as torchrl's pool hands them out
    starts = sorted(
        (sum(n for _, n in trajs[:k]), env, k)
        for env, trajs in enumerate(per_env)
        for k in range(len(trajs))
    )
    ids = {(env, k): i for i, (_, env, k) in enumerate(starts)}
    rows = []
    for env, trajs in enumerate(per_env):
        steps = []
        for k, (s, n) in enumerate(trajs):
            rewards = torch.tensor([[rng.gauss(0, 1)] for _ in range(n)])
            done = torch.zeros(n, 1, dtype=torch.bool)
            done[-1] = True
            steps.append(
                TensorDict(
                    seed=torch.full((n,), s),
                    uid=torch.tensor([next_uid() for _ in range(n)]),
                    step_count=torch.arange(n).unsqueeze(-1),
                    collector=TensorDict(traj_ids=torch.full((n,), ids[env, k]), batch_size=[n]),
                    next=TensorDict(reward=rewards, done=done, batch_size=[n]),
                    batch_size=[n],
                )
            )
        rows.append(torch.cat(steps))
    timeline = torch.stack(rows)  # (num_envs, horizon)
    batches, completed = [], []
    for t in range(0, horizon, steps_per_batch):
        batch = timeline[:, t : t + steps_per_batch]
        batches.append(batch)
        flat = batch.reshape(-1)
        ends = flat["next", "done"].squeeze(-1).nonzero().squeeze(-1).tolist()
        whole = []
        for end in ends:  # the trajectory ending here, from its first step in the timeline
            env, col = divmod(end, steps_per_batch)
            traj = int(flat["collector", "traj_ids"][end])
            row = timeline[env]
            mask = row["collector", "traj_ids"] == traj
            whole.append(row[mask])
        completed.append(whole)
    return batches, completed


def halves(num_groups=4, size=4, seed=0):
    """Trajectories of ``num_groups`` groups: the first halves, then the second halves."""
    gen = torch.Generator().manual_seed(seed)
    trajs = [
        [
            trajectory(g, torch.randn(int(torch.randint(1, 4, (1,), generator=gen)), generator=gen))
            for _ in range(size)
        ]
        for g in range(num_groups)
    ]
    first = [t for group in trajs for t in group[: size // 2]]
    second = [t for group in trajs for t in group[size // 2 :]]
    return torch.cat(first), torch.cat(second)


def stream_outputs(transform, chunks):
    """uid -> advantage of everything ``transform`` released over the insertions ``chunks``."""
    out = {}
    for chunk in chunks:
        out.update(released(transform.inv(chunk)))
    return out


def same_output(got, want):
    """Two insertions' outputs release the same steps, with bit-identical advantages."""
    if want is None:
        assert got is None
        return
    assert got is not None and got["uid"].tolist() == want["uid"].tolist()
    torch.testing.assert_close(got["advantage"], want["advantage"], rtol=0, atol=0)


def streaming(**kwargs):
    """The transform of the streaming tests: groups of 3 by ``"seed"``, joined by trajectory id."""
    return MCAdvantage(grpo_size=3, prompt_key="seed", **kwargs)


def flat_items(state, prefix=()):
    """``(path, leaf)`` of a nested checkpoint (dicts, lists and tuples walked through)."""
    if isinstance(state, dict):
        for key, value in state.items():
            yield from flat_items(value, (*prefix, str(key)))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from flat_items(value, (*prefix, str(i)))
    else:
        yield prefix, state


# two rewards, "reward" and "format" (agent_episodes writes both), and their GDPO weights
GDPO_KEYS = {("next", "reward"): 1.0, ("next", "format"): 0.5}


def agent_episodes(num_groups=2, size=3, seed=0, strings=False):
    """Multi-step episodes whose states repeat within a group: (trajectories, the pieces)."""
    gen = torch.Generator().manual_seed(seed)
    trajs, returns, rewards, lengths, states, groups = [], [], [], [], [], []
    for g in range(num_groups):
        for _ in range(size):
            n = int(torch.randint(1, 5, (1,), generator=gen))
            r = torch.randint(0, 2, (n,), generator=gen).float()
            s = torch.randint(0, 3, (n,), generator=gen)
            obs = [f"room {int(v)}" for v in s] if strings else s
            fmt = torch.rand(n, generator=gen)
            trajs.append(trajectory(g, r.tolist(), obs=obs, next_format=fmt.reshape(n, 1)))
            returns.append(float(r.sum()))
            rewards.append(r)
            lengths.append(n)
            states.append(s)
            groups.append(g)
    pieces = (
        torch.tensor(returns),
        torch.tensor(groups),
        torch.cat(rewards),
        torch.tensor(lengths),
        torch.cat(states),
    )
    return trajs, pieces
