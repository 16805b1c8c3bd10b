"""Throughput of ``torchrl_grpo.MCAdvantage`` against torchrl's, side by side in one run.

Every row writes the same data with ``rb.extend`` into a fresh ``ReplayBuffer`` over a
``LazyTensorStorage``: a flat batch of shuffled groups (groups x group size x steps), with the
transform from this package, with torchrl 0.14.1's ``MCAdvantage``, and with no transform (the
copy into storage, the floor). Times are the CPU time of this process (``time.process_time``; torch
runs on one thread; with ``--device cuda`` the data and the storage are on the GPU and times are
wall time after a synchronization), so that other processes sharing the machine do not inflate
them, with the garbage collector paused while timing (as ``timeit`` does); the three are timed in
turn, repeatedly, and each keeps its fastest time (as ``timeit`` advises). Ratios are within one
run. ``torchrl/ours`` compares whole ``extend`` calls; ``own cost`` compares what each
transform adds to the plain copy, ``(torchrl - plain) / (ours - plain)``.

A second table times the estimators beyond torchrl's (REINFORCE++-baseline's whitening, pass@k,
GDPO with two rewards, GiGPO with a state id or a grid cell as anchor) on the same batches, which
then also carry a second reward and the anchors, against the plain copy and GRPO of that data.

    python benchmarks/transform_throughput.py            # the full table
    python benchmarks/transform_throughput.py --quick    # smaller shapes, for a smoke run
    python benchmarks/transform_throughput.py --device cuda  # data and storage on a GPU
"""

from __future__ import annotations

import argparse
import gc
import logging
import time
import warnings

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs.transforms import Transform
from torchrl.objectives.llm import MCAdvantage as TorchRLMCAdvantage

from torchrl_grpo import MCAdvantage
from torchrl_grpo.mcadvantage import GroupRelative, StepGroups

SHAPES = [(512, 8, 4), (64, 8, 32), (128, 16, 64)]
#: Where the data and the storage live (``--device``).
DEVICE = torch.device("cpu")


def clock() -> float:
    """CPU time of this process on the CPU; on an accelerator, wall time once its queue is done
    (the copies into its storage run there, not on this process's CPU)."""
    if DEVICE.type == "cpu":
        return time.process_time()
    torch.accelerator.synchronize()
    return time.perf_counter()


QUICK_SHAPES = [(64, 8, 4), (16, 8, 16)]


def shuffled_groups(
    groups: int, size: int, steps: int, seed: int = 0, *, agent: bool = False
) -> TensorDict:
    """Flat steps of ``groups * size`` trajectories of ``steps`` steps, trajectories shuffled.

    ``agent``: each step also has a second reward ``("next", "format")``, a discrete state id
    ``state`` (one of 16) and a grid cell ``cell`` (two coordinates in ``[0, 4)``), as anchors.
    """
    gen = torch.Generator().manual_seed(seed)
    n = groups * size
    ids = torch.arange(groups).repeat_interleave(size)[torch.randperm(n, generator=gen)]
    num = n * steps
    done = torch.zeros(n, steps, 1, dtype=torch.bool)
    done[:, -1] = True
    td = TensorDict(
        seed=ids.repeat_interleave(steps),
        observation=torch.randn(num, 4, generator=gen),
        action=torch.randint(0, 2, (num,), generator=gen),
        sample_log_prob=torch.randn(num, generator=gen),
        next=TensorDict(
            observation=torch.randn(num, 4, generator=gen),
            reward=torch.randn(num, 1, generator=gen),
            done=done.reshape(num, 1),
            terminated=done.reshape(num, 1),
            batch_size=[num],
        ),
        batch_size=[num],
    )
    if agent:
        td["next", "format"] = torch.rand(num, 1, generator=gen)
        td["state"] = torch.randint(0, 16, (num,), generator=gen)
        td["cell"] = torch.randint(0, 4, (num, 2), generator=gen)
    return td


def time_extend(data: TensorDict, make_transform) -> float:
    """Seconds of one ``rb.extend(data)`` into a fresh buffer (setup excluded)."""
    rb = ReplayBuffer(storage=LazyTensorStorage(data.numel() * 2, device=DEVICE))
    if make_transform is not None:
        rb.append_transform(make_transform())
    gc.disable()
    try:
        start = clock()
        rb.extend(data)
        elapsed = clock() - start
    finally:
        gc.enable()
    if make_transform is not None:
        assert len(rb) == data.numel(), "every group must be complete and written"
    return elapsed


def fastest(data: TensorDict, candidates: dict, repeats: dict) -> dict:
    """Fastest time of each candidate, timed in turn so that they share the same disturbances;
    ``nan`` for a candidate that raises (its error printed once)."""
    best = dict.fromkeys(candidates, float("inf"))
    for rep in range(max(repeats.values())):
        for name, make in candidates.items():
            if rep < repeats[name] and best[name] == best[name]:  # not nan
                try:
                    best[name] = min(best[name], time_extend(data, make))
                except Exception as error:  # noqa: BLE001 - reported, then left out
                    print(f"  {name} failed on {DEVICE}: {type(error).__name__}: {error!s:.200}")
                    best[name] = float("nan")
    return best


def one_at_a_time(groups: int, size: int, steps: int, make_transform, limit: int) -> float:
    """Mean seconds per ``transform.inv`` call when trajectories arrive one by one."""
    data = shuffled_groups(groups, size, steps, seed=1).to(DEVICE)
    trajs = data.split(steps)[:limit]
    best = float("inf")
    for _ in range(5):
        transform = make_transform()
        gc.disable()
        try:
            start = clock()
            for traj in trajs:
                transform.inv(traj)
            best = min(best, (clock() - start) / len(trajs))
        finally:
            gc.enable()
    return best


def waiting_and_completing(groups: int, size: int, steps: int, make_transform, limit: int):
    """Mean seconds of the calls that hold their trajectory back, and of those that complete a
    group, in the pass of :func:`one_at_a_time`'s stream with the least total time."""
    data = shuffled_groups(groups, size, steps, seed=1).to(DEVICE)
    trajs = data.split(steps)[:limit]
    best = None
    for _ in range(5):
        transform, waiting, completing = make_transform(), [], []
        gc.disable()
        try:
            for traj in trajs:
                start = clock()
                out = transform.inv(traj)
                (waiting if out is None else completing).append(clock() - start)
        finally:
            gc.enable()
        total = sum(waiting) + sum(completing)
        if best is None or total < best[0]:
            best = (total, sum(waiting) / len(waiting), sum(completing) / len(completing))
    return best[1:]


class _DoNothing(Transform):
    """A transform whose insertion does nothing: the cost of ``Transform.inv`` itself."""

    def _inv_call(self, tensordict):
        return None


def collector_batches(envs: int, steps: int, mean_len: int, batches: int, group: int, seed=0):
    """A collector's ``[envs, steps]`` batches: episodes of random lengths (mean ``mean_len``)
    run back to back on each env, cut every ``steps`` steps; ``("collector", "traj_ids")``
    handed out as episodes start, ``"step_count"``, ``"seed"`` groups of ``group`` episodes.

    Returns the batches and, for each, the episodes that end in it laid flat one after the other
    (what inserting whole episodes would insert).
    """
    g = torch.Generator().manual_seed(seed)
    horizon = steps * batches
    ids = torch.empty(envs, horizon, dtype=torch.long)
    count = torch.empty(envs, horizon, dtype=torch.long)
    done = torch.zeros(envs, horizon, dtype=torch.bool)
    starts = []  # (time, env, length) of every episode
    for env in range(envs):
        t = 0
        while t < horizon:
            n = int(torch.randint(1, 2 * mean_len, (1,), generator=g))
            starts.append((t, env, min(n, horizon - t), n <= horizon - t))
            t += n
    starts.sort()
    for traj, (t, env, n, ends) in enumerate(starts):
        ids[env, t : t + n] = traj
        count[env, t : t + n] = torch.arange(n)
        done[env, t + n - 1] = ends
    seeds = ids // group
    timeline = TensorDict(
        {
            "seed": seeds,
            "step_count": count.unsqueeze(-1),
            "observation": torch.randn(envs, horizon, 4, generator=g),
            ("collector", "traj_ids"): ids,
            ("next", "reward"): torch.randn(envs, horizon, 1, generator=g),
            ("next", "done"): done.unsqueeze(-1),
        },
        batch_size=[envs, horizon],
    )
    out, whole = [], []
    for b in range(batches):
        batch = timeline[:, b * steps : (b + 1) * steps].clone()
        flat_done = batch["next", "done"].reshape(-1)
        ended = batch["collector", "traj_ids"].reshape(-1)[flat_done]  # in last-step order
        episodes = [
            timeline.reshape(-1)[(timeline["collector", "traj_ids"] == i).reshape(-1)]
            for i in ended.tolist()
        ]
        out.append(batch)
        whole.append(torch.cat(episodes) if episodes else None)
    return out, whole


def time_stream(batches, make_transform) -> float:
    """CPU seconds per ``rb.extend`` of a stream of batches (fastest of 3 passes)."""
    best = float("inf")
    for _ in range(3):
        size = sum(b.numel() for b in batches if b is not None)
        rb = ReplayBuffer(storage=LazyTensorStorage(size, device=DEVICE))
        if make_transform is not None:
            rb.append_transform(make_transform())
        gc.disable()
        try:
            start = clock()
            for batch in batches:
                if batch is not None:
                    rb.extend(batch if make_transform is not None else batch.reshape(-1))
            elapsed = clock() - start
        finally:
            gc.enable()
        best = min(best, elapsed)
    return best / len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    parser.add_argument("--repeats", type=int, default=25, help="repeats of the fast rows")
    parser.add_argument(
        "--device", default="cpu", help="where the data and the storage live (cpu, cuda, ...)"
    )
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    warnings.filterwarnings("ignore")
    logging.getLogger("torchrl").setLevel(logging.WARNING)  # one INFO line per fresh storage
    torch.set_num_threads(1)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    repeats = 3 if args.quick else args.repeats

    where = (
        "CPU time" if DEVICE.type == "cpu" else f"wall time, data and storage on {_device_name()}"
    )
    print(
        f"torch {torch.__version__}, 1 thread; {where}; fastest of {repeats} rb.extend into "
        "LazyTensorStorage"
    )
    header = (
        f"{'mode':<6} {'groups x G x T':>15} {'steps':>7} {'plain ms':>9} {'ours ms':>9} "
        f"{'torchrl ms':>11} {'ours/plain':>11} {'torchrl/ours':>13} {'own cost':>9}"
    )
    print(header)
    print("-" * len(header))
    for mode in (None, "sum"):
        for groups, size, steps in shapes:
            data = shuffled_groups(groups, size, steps).to(DEVICE)
            kw = dict(grpo_size=size, prompt_key="seed", trajectory_return=mode)
            times = fastest(
                data,
                {
                    "plain": None,
                    "ours": lambda kw=kw: MCAdvantage(**kw),
                    "torchrl": lambda kw=kw: TorchRLMCAdvantage(**kw),
                },
                {"plain": repeats, "ours": repeats, "torchrl": 2},
            )
            plain, ours, ref = times["plain"], times["ours"], times["torchrl"]
            print(
                f"{mode or 'step':<6} {f'{groups}x{size}x{steps}':>15} {data.numel():>7} "
                f"{plain * 1e3:>9.2f} {ours * 1e3:>9.2f} {ref * 1e3:>11.1f} "
                f"{ours / plain:>10.2f}x {ref / ours:>12.0f}x "
                f"{(ref - plain) / max(ours - plain, 1e-9):>8.0f}x"
            )
    estimator_table(shapes, repeats)
    print()
    print("one trajectory per call, mean over the stream, fastest of 5 passes")
    print("(64 groups x 8 trajectories x 16 steps, shuffled; up to ~450 trajectories pending):")
    limit = 128 if args.quick else 512
    floor = one_at_a_time(64, 8, 16, _DoNothing, limit)
    for mode in (None, "sum"):
        kw = dict(grpo_size=8, prompt_key="seed", trajectory_return=mode)
        ours = one_at_a_time(64, 8, 16, lambda kw=kw: MCAdvantage(**kw), limit)
        ref = one_at_a_time(64, 8, 16, lambda kw=kw: TorchRLMCAdvantage(**kw), limit)
        print(
            f"  mode={mode or 'step':<5} ours {ours * 1e3:.3f} ms/call, torchrl {ref * 1e3:.3f} "
            f"ms/call, torchrl/ours {ref / ours:.2f}x"
        )
    print(f"where the time goes (ms/call; Transform.inv itself, doing nothing: {floor * 1e3:.3f}):")
    _where_the_time_goes()
    print()
    _streaming_table(args.quick)


def _streaming_table(quick: bool) -> None:
    """A collector's frames_per_batch batches, episodes crossing them (``traj_key``)."""
    envs, steps = (16, 32) if quick else (64, 64)
    print(
        f"a collector's [{envs}, {steps}] batches (episodes cross batches, ids and step counts "
        "checked), ms per batch, fastest of 3 passes over 12 batches:"
    )
    header = (
        f"{'mean episode':>13} {'held steps':>11} {'plain':>7} {'streaming':>10} "
        f"{'whole episodes':>15} {'streaming/plain':>16}"
    )
    print(header)
    print("-" * len(header))
    for mean_len in (16, 64, 256):
        batches, whole = collector_batches(envs, steps, mean_len, 12, group=4)
        batches = [None if b is None else b.to(DEVICE) for b in batches]
        whole = [None if b is None else b.to(DEVICE) for b in whole]
        kw = dict(grpo_size=4, prompt_key="seed", trajectory_return="sum")
        plain = time_stream(batches, None)
        streaming = time_stream(batches, lambda kw=kw: MCAdvantage(**kw))
        episodes = time_stream(whole, lambda kw=kw: MCAdvantage(**kw, traj_key=None))
        probe = MCAdvantage(**kw)
        held = []
        for batch in batches:
            probe.inv(batch)
            held.append(probe.get_stats()["held_steps"])
        print(
            f"{mean_len:>13} {sum(held) // len(held):>11} {plain * 1e3:>7.2f} "
            f"{streaming * 1e3:>10.2f} {episodes * 1e3:>15.2f} {streaming / plain:>15.2f}x"
        )


def _where_the_time_goes() -> None:
    for mode in (None, "sum"):
        kw = dict(grpo_size=8, prompt_key="seed", trajectory_return=mode)
        # the whole stream: its first calls alone may complete no group
        ours = waiting_and_completing(64, 8, 16, lambda kw=kw: MCAdvantage(**kw), 512)
        ref = waiting_and_completing(64, 8, 16, lambda kw=kw: TorchRLMCAdvantage(**kw), 512)
        print(
            f"  mode={mode or 'step':<5} held back: ours {ours[0] * 1e3:.3f}, torchrl "
            f"{ref[0] * 1e3:.3f}; completing a group: ours {ours[1] * 1e3:.3f}, torchrl "
            f"{ref[1] * 1e3:.3f}"
        )


ESTIMATORS = {
    "whiten": dict(estimator="reinforce_pp_baseline"),  # REINFORCE++-baseline
    "pass@k": dict(estimator="pass_at_k"),
    "GDPO x2": dict(
        estimator=GroupRelative(reward_weights={("next", "reward"): 1.0, ("next", "format"): 1.0})
    ),
    "GiGPO id": dict(estimator=StepGroups(anchor_key="state")),
    "GiGPO cell": dict(estimator=StepGroups(anchor_key="cell")),
}


def estimator_table(shapes, repeats: int) -> None:
    """Each estimator beyond torchrl's against the plain copy and GRPO, same batches."""
    print()
    print("estimators beyond torchrl (trajectory_return='sum'); batches with a second reward and")
    print("anchors; est/GRPO: over this package's GRPO on the same batch")
    header = (
        f"{'estimator':<11} {'groups x G x T':>15} {'steps':>7} {'plain ms':>9} {'GRPO ms':>8} "
        f"{'est ms':>8} {'est/plain':>10} {'est/GRPO':>9}"
    )
    print(header)
    print("-" * len(header))
    for groups, size, steps in shapes:
        data = shuffled_groups(groups, size, steps, agent=True).to(DEVICE)
        kw = dict(grpo_size=size, prompt_key="seed", trajectory_return="sum")
        candidates = {"plain": None, "GRPO": lambda kw=kw: MCAdvantage(**kw)}
        for name, extra in ESTIMATORS.items():
            candidates[name] = lambda kw=kw, extra=extra: MCAdvantage(**kw, **extra)
        times = fastest(data, candidates, dict.fromkeys(candidates, repeats))
        plain, grpo = times["plain"], times["GRPO"]
        for name in ESTIMATORS:
            est = times[name]
            print(
                f"{name:<11} {f'{groups}x{size}x{steps}':>15} {data.numel():>7} "
                f"{plain * 1e3:>9.2f} {grpo * 1e3:>8.2f} {est * 1e3:>8.2f} "
                f"{est / plain:>9.2f}x {est / grpo:>8.2f}x"
            )


def _device_name() -> str:
    if DEVICE.type == "cuda":
        return f"{torch.cuda.get_device_name(DEVICE)} ({DEVICE})"
    return str(DEVICE)


if __name__ == "__main__":
    main()
