"""Many writers: ``MCAdvantage`` in shared mode against torchrl's, side by side in one run.

Three tables. **Per insertion**: one 64-step trajectory at a time is inserted
(``transform.inv``) into a transform holding ``P`` pending trajectories (inserted one at a time
before, in groups of ``grpo_size - 1`` that never complete), for ``P`` = 10, 40, 160, 1000: this
package's transform not shared (the reference), shared (``share_memory_()``, what
``ReplayBuffer(shared=True)`` calls), and torchrl 0.14.1's ``MCAdvantage`` shared. The timed
insertions fill fresh groups one trajectory at a time, so that three in four are held back and
one in four releases its group (``P`` to ``P + 3`` pending throughout). Times are wall-clock (in
shared mode the work is in another process), the median of each call, the best of interleaved
repeats.

**Writers**: 1, 2 and 4 spawned writer processes ``rb.extend`` their trajectories one at a time
into one ``ReplayBuffer(storage=LazyTensorStorage(n, shared_init=True), shared=True)``; each
group's trajectories are dealt to different writers, and every group completes. Steps stored per
second from the writers' common start to the last one's end, for: no transform (the storage's
own cost, a ceiling), this package's transform, torchrl's; then through torchrl's
``RayReplayBuffer`` (the transform in the buffer's actor, writers as Ray tasks calling
``rb.extend``, Ray local on 2 CPUs) with this package's transform and torchrl's. Best of
``--repeats`` runs.

**A shared-memory store instead**: the primitives of a design this package did not take (the
pending steps in shared memory, an index and a lock; see docs/transform.rst, "Many writers"),
what it would pay at least beyond a local insertion.

    python benchmarks/shared_writers.py            # the full tables
    python benchmarks/shared_writers.py --quick    # smaller, for a smoke run
    python benchmarks/shared_writers.py --no-ray   # without the RayReplayBuffer rows
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import multiprocessing as mp
import os
import shutil
import statistics
import time
import warnings
from dataclasses import dataclass
from functools import partial

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.objectives.llm import MCAdvantage as TorchRLMCAdvantage

from torchrl_grpo import MCAdvantage


@dataclass
class Settings:
    steps: int = 64  # steps per trajectory
    grpo_size: int = 4
    pending: tuple = (10, 40, 160, 1000)
    cycles: int = 40  # timed groups per row (grpo_size insertions each)
    writers: tuple = (1, 2, 4)
    groups: int = 100  # groups written in a writers run (grpo_size trajectories each)
    repeats: int = 3
    ray: bool = True
    ray_cpus: int = 2


QUICK = dict(pending=(10, 160), cycles=10, writers=(1, 2), groups=25, repeats=1)


def trajectory(group: int, steps: int, seed: int) -> TensorDict:
    """One trajectory of ``steps`` CartPole-sized steps, done at its last step."""
    gen = torch.Generator().manual_seed(seed)
    done = torch.zeros(steps, 1, dtype=torch.bool)
    done[-1] = True
    return TensorDict(
        seed=torch.full((steps,), group),
        observation=torch.randn(steps, 4, generator=gen),
        action=torch.randint(0, 2, (steps,), generator=gen),
        sample_log_prob=torch.randn(steps, generator=gen),
        next=TensorDict(
            observation=torch.randn(steps, 4, generator=gen),
            reward=torch.randn(steps, 1, generator=gen),
            done=done,
            terminated=done.clone(),
            batch_size=[steps],
        ),
        batch_size=[steps],
    )


# --- per insertion -------------------------------------------------------------------------------


def insertion_times(make, shared: bool, pending: int, s: Settings) -> list[float]:
    """Seconds of each timed ``inv`` call at ``pending`` pending trajectories."""
    transform = make()
    if shared:
        transform.share_memory_()
    held = s.grpo_size - 1  # background groups that never complete, inserted one by one
    for i in range(pending):
        transform.inv(trajectory(10**6 + i // held, s.steps, seed=i))
    assert transform.queued_trajectories == pending
    stream = [
        trajectory(c, s.steps, seed=c * s.grpo_size + k)
        for c in range(s.cycles)
        for k in range(s.grpo_size)
    ]
    times = []
    gc.disable()
    try:
        for traj in stream:
            start = time.perf_counter()
            transform.inv(traj)
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    assert transform.get_stats()["written_groups"] == s.cycles
    return times


def per_insertion_table(s: Settings) -> None:
    candidates = {
        "ours, local": (partial(MCAdvantage, s.grpo_size, prompt_key="seed"), False),
        "ours, shared": (partial(MCAdvantage, s.grpo_size, prompt_key="seed"), True),
        "torchrl, shared": (partial(TorchRLMCAdvantage, s.grpo_size, prompt_key="seed"), True),
    }
    print(
        f"Per insertion: one {s.steps}-step trajectory per inv() call, grpo_size={s.grpo_size}; "
        f"median ms per call, best of {s.repeats} (wall clock)"
    )
    header = (
        f"{'pending':>8} | {'ours local':>10} | {'ours shared':>11} | {'torchrl shared':>14} | "
        f"{'torchrl/ours':>12} | {'ours vs 10':>10}"
    )
    print(header)
    print("-" * len(header))
    first = None
    for pending in s.pending:
        best = dict.fromkeys(candidates, float("inf"))
        for _ in range(s.repeats):
            for name, (make, shared) in candidates.items():
                median = statistics.median(insertion_times(make, shared, pending, s))
                best[name] = min(best[name], median)
        ours, ref = best["ours, shared"], best["torchrl, shared"]
        first = ours if first is None else first
        print(
            f"{pending:>8} | {best['ours, local'] * 1e3:>10.3f} | {ours * 1e3:>11.3f} | "
            f"{ref * 1e3:>14.3f} | {ref / ours:>11.1f}x | {ours / first:>9.2f}x"
        )


# --- writers -------------------------------------------------------------------------------------


def dealt(s: Settings, writers: int) -> list[list[TensorDict]]:
    """Every group's trajectories dealt to different writers (round robin)."""
    trajs = [
        trajectory(g, s.steps, seed=g * s.grpo_size + k)
        for g in range(s.groups)
        for k in range(s.grpo_size)
    ]
    return [trajs[w::writers] for w in range(writers)]


def write(rb, trajs, barrier, times) -> None:
    torch.set_num_threads(1)
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    barrier.wait()
    start = time.monotonic()
    for traj in trajs:
        rb.extend(traj)
    times.put((start, time.monotonic()))


def shared_buffer_run(make_transform, writers: int, s: Settings) -> float:
    """Steps stored per second by ``writers`` spawned processes into one shared buffer."""
    total = s.groups * s.grpo_size * s.steps
    storage = LazyTensorStorage(total, shared_init=True)
    try:
        rb = ReplayBuffer(storage=storage, shared=True)
        if make_transform is not None:
            rb.append_transform(make_transform())
        ctx = mp.get_context("spawn")
        barrier, times = ctx.Barrier(writers), ctx.Queue()
        procs = [
            ctx.Process(target=write, args=(rb, part, barrier, times)) for part in dealt(s, writers)
        ]
        for p in procs:
            p.start()
        spans = [times.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert len(rb) == total, f"{len(rb)} of {total} steps stored"
    finally:  # the folder torchrl's shared_init leaves behind
        shutil.rmtree(getattr(storage, "scratch_dir", None) or "/nonexistent", ignore_errors=True)
    return total / (max(end for _, end in spans) - min(start for start, _ in spans))


def ray_run(transform_factory, writers: int, s: Settings) -> float:
    """Steps stored per second by ``writers`` Ray tasks into one ``RayReplayBuffer``."""
    import ray
    from torchrl.data import RayReplayBuffer

    total = s.groups * s.grpo_size * s.steps
    rb = RayReplayBuffer(  # on the Ray runtime started by writers_table
        storage=partial(LazyTensorStorage, total),
        transform_factory=transform_factory,
        remote_config={"num_cpus": 0},
    )
    try:

        @ray.remote(num_cpus=s.ray_cpus / max(s.writers))
        def remote_write(client, trajs, start):
            torch.set_num_threads(1)
            time.sleep(max(0.0, start - time.time()))  # all writers start together
            for traj in trajs:
                client.extend(traj)
            return start, time.time()

        assert len(rb) == 0  # waits for the buffer's actor to start
        client = rb.client()
        parts = [ray.put(part) for part in dealt(s, writers)]
        ray.get([remote_write.remote(client, [], time.time() + 1) for _ in range(writers)])  # warm
        start = time.time() + 1.0
        spans = ray.get([remote_write.remote(client, part, start) for part in parts])
        assert len(rb) == total, f"{len(rb)} of {total} steps stored"
    finally:
        rb.shutdown()
    return total / (max(end for _, end in spans) - min(start for start, _ in spans))


def writers_table(s: Settings) -> None:
    make = partial(MCAdvantage, s.grpo_size, prompt_key="seed")
    make_torchrl = partial(TorchRLMCAdvantage, s.grpo_size, prompt_key="seed")
    columns = {
        "no transform": partial(shared_buffer_run, None),
        "ours": partial(shared_buffer_run, make),
        "torchrl": partial(shared_buffer_run, make_torchrl),
    }
    if s.ray:
        columns["Ray: ours"] = partial(ray_run, make)
        columns["Ray: torchrl"] = partial(ray_run, make_torchrl)
    best = {name: {} for name in columns}
    if s.ray:
        import ray

        ray.init(
            num_cpus=s.ray_cpus,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
    for _ in range(s.repeats):
        for writers in s.writers:
            for name, run in columns.items():
                try:
                    rate = run(writers, s)
                except Exception as err:  # shown in the table: what does not work
                    print(f"{name}, {writers} writer(s): {type(err).__name__}: {err}")
                    rate = float("nan")
                best[name][writers] = max(best[name].get(writers, 0.0), rate)
    if s.ray:
        ray.shutdown()
    print(
        f"\nWriters: {s.groups} groups of {s.grpo_size} x {s.steps}-step trajectories, one "
        f"trajectory per rb.extend; thousand steps stored per second, best of {s.repeats}"
    )
    header = f"{'writers':>7} | " + " | ".join(f"{name:>12}" for name in columns)
    header += f" | {'ours/torchrl':>12} | {'ours vs 1':>9}"
    print(header)
    print("-" * len(header))
    one = best["ours"][s.writers[0]]
    for writers in s.writers:
        rates = [best[name][writers] for name in columns]
        ours, ref = best["ours"][writers], best["torchrl"][writers]
        print(
            f"{writers:>7} | "
            + " | ".join(f"{rate / 1e3:>12.1f}" for rate in rates)
            + f" | {ours / ref:>11.1f}x | {ours / one:>8.2f}x"
        )


def primitives_table(s: Settings) -> None:
    """What a design with the pending steps in shared memory would pay at least per insertion,
    beyond a local insertion: its lock, the copy of the steps into a shared store, the read of
    a shared index of 1,000 pending trajectories (microseconds, best of 5 x 2,000)."""
    traj = trajectory(0, s.steps, seed=0)
    store = torch.cat([traj] * 100).share_memory_()
    index = torch.zeros(1000, 6, dtype=torch.long).share_memory_()
    lock = mp.get_context("spawn").Lock()
    slot = iter(range(10**9))

    def locked():
        lock.acquire()
        lock.release()

    def copy():
        i = next(slot) % 99
        store[i * s.steps : (i + 1) * s.steps] = traj

    print("\nA shared-memory store instead (its primitives; us per call, best of 5 x 2,000):")
    for name, call in [
        ("multiprocessing lock, taken and released", locked),
        (f"{s.steps} steps copied into a shared-memory TensorDict", copy),
        ("1,000 x 6 shared index read", index.clone),
    ]:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(2000):
                call()
            best = min(best, (time.perf_counter() - start) / 2000)
        print(f"  {name:<52} {best * 1e6:8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, a smoke run")
    parser.add_argument("--no-ray", action="store_true", help="skip the RayReplayBuffer rows")
    parser.add_argument("--repeats", type=int, help="runs of each row (best kept)")
    args = parser.parse_args()
    s = Settings(**(QUICK if args.quick else {}))
    s.ray = not args.no_ray and importlib.util.find_spec("ray") is not None
    if not args.no_ray and not s.ray:
        print("ray is not installed (pip install torchrl_grpo[dist]): no RayReplayBuffer rows")
    if args.repeats:
        s.repeats = args.repeats
    torch.set_num_threads(1)
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    per_insertion_table(s)
    writers_table(s)
    primitives_table(s)


if __name__ == "__main__":
    main()
