"""RayMCAdvantage (the pending groups in a Ray actor) against the local transform, side by side.

One-trajectory insertions (``transform.inv``) of 2-step trajectories, groups of 2, so that every
other insertion releases a group: the median wall time of an insertion that releases nothing
(one Ray call) and of one that releases a group (two: the released steps, then the commit), for
``RayMCAdvantage`` and for ``MCAdvantage`` in the same process. Ray local, ``--num-cpus`` CPUs.

    python benchmarks/ray_mcadvantage.py
"""

import argparse
import statistics
import time

import ray
import torch
from tensordict import TensorDict

from torchrl_grpo import MCAdvantage, RayMCAdvantage


def trajectory(group: int, reward: float) -> TensorDict:
    return TensorDict(
        seed=torch.full((2,), group),
        next=TensorDict(
            reward=torch.tensor([[0.0], [reward]]),
            done=torch.tensor([[False], [True]]),
            batch_size=[2],
        ),
        batch_size=[2],
    )


def medians(transform, trajs) -> tuple[float, float]:
    held, released = [], []
    for traj in trajs:
        start = time.perf_counter()
        out = transform.inv(traj)
        (held if out is None else released).append(time.perf_counter() - start)
    return 1e3 * statistics.median(held), 1e3 * statistics.median(released)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=500)
    parser.add_argument("--num-cpus", type=int, default=2)
    args = parser.parse_args()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    trajs = [trajectory(g, float(i)) for g in range(args.groups) for i in range(2)]
    remote = RayMCAdvantage(2, prompt_key="seed")
    medians(remote, trajs[:40])  # warm-up: the actor's first calls
    rows = [("RayMCAdvantage", *medians(remote, trajs[40:]))]
    rows.append(("MCAdvantage (local)", *medians(MCAdvantage(2, prompt_key="seed"), trajs[40:])))
    remote.close()
    ray.shutdown()
    print(f"{'transform':<22}{'held back (ms)':>16}{'releasing (ms)':>16}")
    for name, held, released in rows:
        print(f"{name:<22}{held:>16.2f}{released:>16.2f}")
    print(f"{'ratio':<22}{rows[0][1] / rows[1][1]:>15.1f}x{rows[0][2] / rows[1][2]:>15.1f}x")


if __name__ == "__main__":
    main()
