"""The CartPole demo with its numpy-vectorized ``CartPoles``, against the ``SyncVectorEnv`` of
``gym.make("CartPole-v1")`` it used before: the same seed plays the same episodes (the start
states are gymnasium's), so the steps are equal and the seconds of playing compare the two envs.

Each run is a fresh process, one after the other, alternating the two envs; prints a table.
Run::

    python benchmarks/cartpole_env_ab.py                 # seed 0, 2 runs of each
    python benchmarks/cartpole_env_ab.py --seed 1 --runs 3
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = """
import importlib.util, sys
import gymnasium as gym
from torchrl.envs import GymWrapper, TransformedEnv
spec = importlib.util.spec_from_file_location("demo", {example!r})
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)
if {sync!r}:
    def make_env(num_envs, seeds, group_size, device="cpu"):
        vector_env = gym.vector.SyncVectorEnv(
            [lambda: gym.make("CartPole-v1")] * num_envs,
            autoreset_mode=gym.vector.AutoresetMode.DISABLED,
        )
        env = GymWrapper(vector_env, categorical_action_encoding=True, device=device)
        return TransformedEnv(env, demo.SameStartGroups(group_size, seeds=seeds))
    demo.make_env = make_env
demo.main(["--seed", "{seed}", "--no-progress", "--logger", "none", "--output-dir", {out!r}])
"""
PLAY = re.compile(r"play ([\d.]+)")
STEPS = re.compile(r"env_steps=(\d+)")


def run(sync: bool, seed: int, out: str) -> tuple[float, int]:
    code = RUN.format(
        example=str(ROOT / "examples" / "cartpole_grpo.py"), sync=sync, seed=seed, out=out
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(PLAY.search(proc.stdout)[1]), int(STEPS.search(proc.stdout)[1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=2, help="runs of each env")
    p.add_argument("--output-dir", default="runs/cartpole_env_ab")
    args = p.parse_args(argv)
    results = {True: [], False: []}
    for _ in range(args.runs):
        for sync in (True, False):
            results[sync].append(run(sync, args.seed, args.output_dir))
    reference = statistics.median(s for s, _ in results[True])
    print(f"seed {args.seed}, {args.runs} runs of each, one after the other")
    print("=====================================  =========  ============  ===========")
    print("training env                           env steps  play s (med)  x SyncVector")
    print("=====================================  =========  ============  ===========")
    for sync, name in (
        (True, "SyncVectorEnv of gym.make (before)"),
        (False, "CartPoles (the demo's)"),
    ):
        play = statistics.median(s for s, _ in results[sync])
        steps = {n for _, n in results[sync]}
        print(f"{name:37s}  {','.join(map(str, steps)):9s}  {play:12.2f}  {play / reference:11.2f}")
    print("=====================================  =========  ============  ===========")


if __name__ == "__main__":
    main()
