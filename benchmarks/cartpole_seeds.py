"""Run the CartPole GRPO demo for several seeds and print wall time, env steps and eval return.

Each run is ``examples/cartpole_grpo.py`` at its defaults in a fresh process, one after the other
(runs do not share the machine's cores with each other). The tables are reStructuredText simple
tables, ready for ``docs/tutorial_cartpole.rst``.

Runs table. ``wall_s`` is the demo's own count, from its first line (imports included) to its
RESULT line; ``process s`` is the whole process as timed from outside (interpreter start and exit
included). The ``reference`` row is a fresh process that only imports the demo's stack
(``torch``, ``torchrl``, ``tensordict``, ``gymnasium``, ``torchrl_grpo``), median of 3, measured
in the same run: the share of each run that no training design can remove. The demo stops at the
first greedy evaluation (20 fresh episodes) that reaches 475, and it evaluates after every batch,
so a lucky evaluation could end a run early; ``recheck`` guards against that: each saved policy
plays ``--recheck-episodes`` more fresh episodes (seeds the demo never uses), greedily.

Environment table. The cost of one environment step along the demo's path, against a bare
gymnasium ``CartPole-v1`` step measured in the same process: a torchrl ``GymEnv`` stepping one
env, the demo's ``GymWrapper`` around a ``SyncVectorEnv`` of 64, and the demo's
``play_episodes`` (64 sub-envs, the untrained policy sampling actions, seeded partial resets).

Run::

    python benchmarks/cartpole_seeds.py                               # seeds 0 1 2, defaults
    python benchmarks/cartpole_seeds.py --advantage reward-to-go return   # both modes, side by side
    python benchmarks/cartpole_seeds.py --seeds 0 1 2 3 4 -- --lr 3e-3   # extra demo arguments
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cartpole_grpo.py"
RECHECK_SEED_OFFSET = 2**30 + 900_000_000  # above every seed the demo uses, for seeds < 100
RESULT = re.compile(
    r"^RESULT solved=(?P<solved>true|false) wall_s=(?P<wall_s>[\d.]+) "
    r"env_steps=(?P<env_steps>\d+) eval_return=(?P<eval_return>[\d.]+|nan)$",
    re.MULTILINE,
)
OUTPUTS = re.compile(r"^outputs: (?P<run_dir>.+)$", re.MULTILINE)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds to run")
    p.add_argument(
        "--advantage",
        nargs="+",
        default=[None],
        choices=["reward-to-go", "return"],
        help="advantage modes to compare (default: the demo's default only)",
    )
    p.add_argument(
        "--output-dir", default="runs/cartpole_bench", help="output folder of the demo runs"
    )
    p.add_argument(
        "--recheck-episodes", type=int, default=100, help="fresh greedy episodes per saved policy"
    )
    p.add_argument("--no-env-costs", action="store_true", help="skip the environment table")
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    return p.parse_args(argv), extra


def load_demo():
    """The example as a module (its functions, without running ``main``)."""
    spec = importlib.util.spec_from_file_location("cartpole_grpo", EXAMPLE)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def print_table(header: list[str], lines: list[list[str]]) -> None:
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    rule = "  ".join("=" * w for w in widths)
    print(rule)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    print(rule)
    for line in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    print(rule)


# --- the runs ---------------------------------------------------------------------------------


def import_time(repeats: int = 3) -> tuple[float, float]:
    """The reference: a fresh process that only imports the demo's stack, median of ``repeats``.

    Returns:
        ``(import_s, process_s)``: the imports as timed inside the process (comparable to the
        demo's ``wall_s``), and the whole process as timed from outside.
    """
    code = (
        "import time; t = time.perf_counter(); "
        "import gymnasium, torch, torchrl, tensordict, torchrl_grpo; "
        "print(time.perf_counter() - t)"
    )
    inside, outside = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        outside.append(time.perf_counter() - start)
        inside.append(float(proc.stdout.decode().split()[-1]))
    return statistics.median(inside), statistics.median(outside)


def run_demo(seed: int, advantage: str | None, output_dir: str, extra: list[str]) -> dict:
    cmd = [sys.executable, str(EXAMPLE), "--seed", str(seed), "--output-dir", output_dir]
    cmd += ["--no-progress", *([] if advantage is None else ["--advantage", advantage]), *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    process_s = time.perf_counter() - start
    match, outputs = RESULT.search(proc.stdout), OUTPUTS.search(proc.stdout)
    if proc.returncode != 0 or match is None or outputs is None:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {
        "run_dir": (ROOT / outputs["run_dir"]).resolve(),
        "solved": match["solved"] == "true",
        "wall_s": float(match["wall_s"]),
        "process_s": process_s,
        "env_steps": int(match["env_steps"]),
        "eval_return": float(match["eval_return"]),
    }


def recheck(demo, rows: list[dict], episodes: int, demo_args: list[str]) -> None:
    """Greedy mean return of each run's saved policy over ``episodes`` fresh episodes."""
    import torch

    cfg = demo.parse_args(demo_args)  # the policy's width, if the runs changed it
    env = demo.make_env(episodes)
    for row in rows:
        actor = demo.make_actor(cfg.hidden)
        actor.load_state_dict(torch.load(row["run_dir"] / "policy.pt"))
        first = RECHECK_SEED_OFFSET + row["seed"] * episodes
        row["recheck"] = demo.evaluate(env, actor, list(range(first, first + episodes)))
    env.close()


def runs_table(rows: list[dict], reference: tuple[float, float], episodes: int) -> None:
    header = ["advantage", "seed", "solved", "wall_s", "process s", "env steps", "eval return"]
    header.append(f"recheck ({episodes} ep.)")
    lines = [
        [
            r["advantage"],
            str(r["seed"]),
            str(r["solved"]).lower(),
            f"{r['wall_s']:.1f}",
            f"{r['process_s']:.1f}",
            str(r["env_steps"]),
            f"{r['eval_return']:.1f}",
            f"{r['recheck']:.1f}",
        ]
        for r in rows
    ]
    for advantage in dict.fromkeys(r["advantage"] for r in rows):
        mine = [r for r in rows if r["advantage"] == advantage]
        lines.append(
            [
                advantage,
                "median",
                f"{sum(r['solved'] for r in mine)}/{len(mine)}",
                f"{statistics.median(r['wall_s'] for r in mine):.1f}",
                f"{statistics.median(r['process_s'] for r in mine):.1f}",
                str(int(statistics.median(r["env_steps"] for r in mine))),
                f"{statistics.median(r['eval_return'] for r in mine):.1f}",
                f"{statistics.median(r['recheck'] for r in mine):.1f}",
            ]
        )
    import_s, import_process_s = reference
    lines.append(
        ["reference", "import", "", f"{import_s:.1f}", f"{import_process_s:.1f}", "", "", ""]
    )
    print_table(header, lines)


# --- the environment ------------------------------------------------------------------------------


def env_costs(demo) -> None:
    """Microseconds per environment step along the demo's path, against a bare gymnasium step."""
    import gymnasium as gym
    import torch
    from torchrl.envs import ExplorationType, GymEnv, set_exploration_type

    def per_step(fn, calls: int) -> float:
        """``fn()`` returns the environment steps it took; microseconds per step."""
        fn()  # warm-up
        start, steps = time.perf_counter(), sum(fn() for _ in range(calls))
        return (time.perf_counter() - start) / steps * 1e6

    bare = gym.make("CartPole-v1")
    bare.reset(seed=0)

    def bare_step() -> int:
        _, _, terminated, truncated, _ = bare.step(bare.action_space.sample())
        if terminated or truncated:
            bare.reset()
        return 1

    def torchrl_stepper(env):  # random actions, torchrl's own partial resets
        state = {"td": env.reset()}

        def step() -> int:
            state["td"]["action"] = env.action_spec.rand()
            _, state["td"] = env.step_and_maybe_reset(state["td"])
            return env.batch_size.numel()

        return step

    single, batched = GymEnv("CartPole-v1", categorical_action_encoding=True), demo.make_env(64)
    torch.manual_seed(0)
    actor = demo.make_actor(64)
    seeds = [g for g in range(16) for _ in range(4)]  # the demo's batch: 16 groups of 4

    def play() -> int:
        with set_exploration_type(ExplorationType.RANDOM):
            return demo.play_episodes(batched, actor, seeds).shape[0]

    costs = [
        ("bare gymnasium CartPole-v1 (reference)", per_step(bare_step, 20_000)),
        ("torchrl GymEnv, 1 env", per_step(torchrl_stepper(single), 2_000)),
        ("torchrl GymWrapper(SyncVectorEnv), 64 envs", per_step(torchrl_stepper(batched), 300)),
        ("play_episodes: 64 envs, policy, seeded resets", per_step(play, 20)),
    ]
    single.close()
    batched.close()
    reference = costs[0][1]
    lines = [[name, f"{us:.1f}", f"{us / reference:.1f}"] for name, us in costs]
    print_table(["one environment step", "us", "x bare"], lines)


def main(argv: list[str] | None = None) -> None:
    args, extra = parse_args(argv)
    reference = import_time()
    rows = []
    for advantage in args.advantage:
        for seed in args.seeds:
            result = run_demo(seed, advantage, args.output_dir, extra)
            rows.append({"advantage": advantage or "default", "seed": seed, **result})
            print(f"# done: {rows[-1]}", file=sys.stderr, flush=True)
    demo = load_demo()
    recheck(demo, rows, args.recheck_episodes, extra)
    runs_table(rows, reference, args.recheck_episodes)
    print(f"# extra demo arguments: {' '.join(extra) or '(none)'}")
    if not args.no_env_costs:
        print()
        env_costs(demo)


if __name__ == "__main__":
    main()
