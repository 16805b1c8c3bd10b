"""GRPO (the CartPole demo) and torchrl's PPO, seed by seed: steps and wall time to solve.

Each run is a fresh process, one after the other (runs do not share the machine's cores with each
other): ``examples/cartpole_grpo.py`` at its defaults, and ``benchmarks/cartpole_ppo.py``
(torchrl's ``ClipPPOLoss`` with a critic and GAE, the same collector, network and budget rules)
at its defaults. The tables are reStructuredText simple tables, ready for the docs.

Runs table. ``wall_s`` is the script's own count, from its first line (imports included) to its
RESULT line; ``process s`` is the whole process as timed from outside (interpreter start and exit
included). The ``reference`` row is a fresh process that only imports the demo's stack
(``torch``, ``torchrl``, ``tensordict``, ``gymnasium``, ``torchrl_grpo``), median of 3, measured
in the same run: the share of each run that no training design can remove. Both scripts stop at
the first greedy evaluation (20 fresh episodes) that reaches 475, and they evaluate after every
batch, so a lucky evaluation could end a run early; ``recheck`` guards against that: each saved
policy plays ``--recheck-episodes`` more fresh episodes (seeds neither script uses), greedily.
The side-by-side table puts the two algorithms' environment steps and wall time on one line per
seed.

Environment table. The cost of one environment step along the demo's path, against a bare
gymnasium ``CartPole-v1`` step measured in the same process: a torchrl ``GymEnv`` stepping one
env, a ``GymWrapper`` around a ``SyncVectorEnv`` of 64, and a torchrl ``Collector`` with the
untrained policy sampling actions, over several layouts (sub-envs, steps of each between two
polls), with and without ``SameStartGroups`` (PPO's layout, and the demo's two: ``stream``, 32
steps of each of 64 sub-envs a batch; ``episodes``, batches of 64 whole episodes assembled from
polls of 8 steps).

Run::

    python benchmarks/cartpole_seeds.py                               # seeds 0-4, GRPO and PPO
    python benchmarks/cartpole_seeds.py --algorithms grpo --advantage reward-to-go return
    python benchmarks/cartpole_seeds.py --algorithms grpo --layout stream episodes --no-env-costs
    python benchmarks/cartpole_seeds.py --seeds 0 1 2 -- --lr 3e-3   # extra demo arguments
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
PPO = ROOT / "benchmarks" / "cartpole_ppo.py"
RECHECK_SEED_OFFSET = 2**30 + 900_000_000  # above every seed the demo uses, for seeds < 100
RESULT = re.compile(
    r"^RESULT solved=(?P<solved>true|false) wall_s=(?P<wall_s>[\d.]+) "
    r"env_steps=(?P<env_steps>\d+) eval_return=(?P<eval_return>[\d.]+|nan)$",
    re.MULTILINE,
)
OUTPUTS = re.compile(r"^outputs: (?P<run_dir>.+)$", re.MULTILINE)
SECONDS = re.compile(r"^seconds: (?P<phases>.+)$", re.MULTILINE)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="seeds to run")
    p.add_argument(
        "--algorithms",
        nargs="+",
        default=["grpo", "ppo"],
        choices=["grpo", "ppo"],
        help="the GRPO demo, torchrl's PPO (benchmarks/cartpole_ppo.py), or both",
    )
    p.add_argument(
        "--layout",
        nargs="+",
        default=[None],
        choices=["stream", "episodes"],
        help="GRPO collector layouts to compare (default: the demo's default only)",
    )
    p.add_argument(
        "--advantage",
        nargs="+",
        default=[None],
        choices=["reward-to-go", "reward-to-go-time-step", "return"],
        help="GRPO advantage modes to compare (default: the demo's default only)",
    )
    p.add_argument("--output-dir", default="runs/cartpole_bench", help="output folder of the runs")
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


def run_script(script: Path, seed: int, output_dir: str, args: list[str]) -> dict:
    cmd = [sys.executable, str(script), "--seed", str(seed), "--output-dir", output_dir]
    cmd += ["--no-progress", *args]
    if script == EXAMPLE:  # many runs: no checkpoint of each (15 MB, the buffer's storage)
        cmd.append("--no-checkpoint")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    process_s = time.perf_counter() - start
    match, outputs = RESULT.search(proc.stdout), OUTPUTS.search(proc.stdout)
    phases = SECONDS.search(proc.stdout)
    if proc.returncode != 0 or match is None or outputs is None or phases is None:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    seconds = dict(phase.rsplit(" ", 1) for phase in phases["phases"].split(", "))
    return {
        "run_dir": (ROOT / outputs["run_dir"]).resolve(),
        "train_s": float(seconds["play"]) + float(seconds["optimize"]),
        "evaluate_s": float(seconds["evaluate"]),
        "solved": match["solved"] == "true",
        "wall_s": float(match["wall_s"]),
        "process_s": process_s,
        "env_steps": int(match["env_steps"]),
        "eval_return": float(match["eval_return"]),
    }


def recheck(demo, rows: list[dict], episodes: int, demo_args: list[str]) -> None:
    """Greedy mean return of each run's saved policy over ``episodes`` fresh episodes."""
    import torch

    hidden = demo.parse_args(demo_args).hidden  # the GRPO policy's width, if the runs changed it
    for row in rows:
        actor = demo.make_actor(hidden if row["algorithm"] == "grpo" else 64)
        actor.load_state_dict(torch.load(row["run_dir"] / "policy.pt"))
        first = RECHECK_SEED_OFFSET + row["seed"] * episodes
        env = demo.EvalEpisodes(episodes, range(first, first + episodes))
        row["recheck"] = demo.evaluate(env, actor)
        env.close()


def runs_table(rows: list[dict], reference: tuple[float, float], episodes: int) -> None:
    header = ["run", "seed", "solved", "wall_s", "train s", "eval s", "process s", "env steps"]
    header += ["eval return", f"recheck ({episodes} ep.)"]
    lines = [
        [
            r["label"],
            str(r["seed"]),
            str(r["solved"]).lower(),
            f"{r['wall_s']:.1f}",
            f"{r['train_s']:.1f}",
            f"{r['evaluate_s']:.1f}",
            f"{r['process_s']:.1f}",
            str(r["env_steps"]),
            f"{r['eval_return']:.1f}",
            f"{r['recheck']:.1f}",
        ]
        for r in rows
    ]
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == label]
        lines.append(
            [
                label,
                "median",
                f"{sum(r['solved'] for r in mine)}/{len(mine)}",
                f"{statistics.median(r['wall_s'] for r in mine):.1f}",
                f"{statistics.median(r['train_s'] for r in mine):.1f}",
                f"{statistics.median(r['evaluate_s'] for r in mine):.1f}",
                f"{statistics.median(r['process_s'] for r in mine):.1f}",
                str(int(statistics.median(r["env_steps"] for r in mine))),
                f"{statistics.median(r['eval_return'] for r in mine):.1f}",
                f"{statistics.median(r['recheck'] for r in mine):.1f}",
            ]
        )
    import_s, import_process_s = reference
    lines.append(
        ["reference", "import", "", f"{import_s:.1f}", "", "", f"{import_process_s:.1f}"]
        + ["", "", ""]
    )
    print_table(header, lines)


def side_by_side(rows: list[dict], episodes: int) -> None:
    """One line per seed: each run's environment steps, wall time and recheck, side by side."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    header = ["seed"]
    for label in labels:
        header += [f"{label} steps", f"{label} wall_s", f"{label} train s", f"{label} recheck"]
    by_key = {(r["label"], r["seed"]): r for r in rows}

    def cells(r: dict | None) -> list[str]:
        if r is None:
            return ["", "", "", ""]
        steps = str(r["env_steps"]) if r["solved"] else f"({r['env_steps']}, unsolved)"
        return [steps, f"{r['wall_s']:.1f}", f"{r['train_s']:.1f}", f"{r['recheck']:.1f}"]

    lines = []
    for seed in dict.fromkeys(r["seed"] for r in rows):
        line = [str(seed)]
        for label in labels:
            line += cells(by_key.get((label, seed)))
        lines.append(line)
    line = ["median"]
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        line += [
            str(int(statistics.median(r["env_steps"] for r in mine))),
            f"{statistics.median(r['wall_s'] for r in mine):.1f}",
            f"{statistics.median(r['train_s'] for r in mine):.1f}",
            f"{statistics.median(r['recheck'] for r in mine):.1f}",
        ]
    lines.append(line)
    print_table(header, lines)
    print(
        f"# train s: playing and optimizing, without evaluation; recheck: greedy mean return of "
        f"the saved policy over {episodes} fresh episodes"
    )


# --- the environment ------------------------------------------------------------------------------


def env_costs(demo) -> None:
    """Microseconds per environment step along the demo's path, against a bare gymnasium step."""
    import gymnasium as gym
    import torch
    from torchrl.collectors import Collector
    from torchrl.envs import GymEnv, GymWrapper

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

    def collector_stepper(env, steps_per_poll: int, episodes: int | None = None):
        """The untrained policy, sampling; with ``episodes``, batches of whole episodes. Each
        call takes a batch and returns the steps played for it (every poll's)."""
        torch.manual_seed(0)
        frames = env.batch_size.numel() * steps_per_poll
        whole = {} if episodes is None else dict(trajs_per_batch=episodes, traj_format="cat")
        polled = []
        collector = Collector(
            env,
            demo.make_actor(64),
            frames_per_batch=frames,
            total_frames=-1,
            post_collect_hook=lambda steps: polled.append(steps.numel()),
            auto_register_policy_transforms=False,
            **whole,
        )
        batches = iter(collector)

        def step() -> int:
            polled.clear()
            next(batches)
            return sum(polled)

        return step, collector

    single = GymEnv("CartPole-v1", categorical_action_encoding=True)
    vector = demo.make_env(64, range(2**20), 4).base_env  # the demo's env without the transform
    sync = GymWrapper(  # what the demo stepped before CartPoles: gymnasium's loop over 64 envs
        gym.vector.SyncVectorEnv(
            [lambda: gym.make("CartPole-v1")] * 64,
            autoreset_mode=gym.vector.AutoresetMode.DISABLED,
        ),
        categorical_action_encoding=True,
    )
    costs = [
        ("bare gymnasium CartPole-v1 (reference)", per_step(bare_step, 20_000)),
        ("torchrl GymEnv, 1 env", per_step(torchrl_stepper(single), 2_000)),
        ("torchrl GymWrapper(SyncVectorEnv), 64 envs", per_step(torchrl_stepper(sync), 300)),
        (
            "torchrl GymWrapper(CartPoles), 64 envs (the demo's)",
            per_step(torchrl_stepper(vector), 300),
        ),
    ]
    sync.close()
    single.close()
    layouts = [(64, 8, False, None), (16, 8, True, None), (32, 8, True, None)]
    layouts += [(64, 2, True, None), (64, 8, True, None), (64, 32, True, None)]
    layouts += [(64, 8, True, 64), (128, 8, True, None)]
    for num_envs, steps_per_poll, grouped, episodes in layouts:
        env = demo.make_env(num_envs, range(2**20), 4)
        stepper, collector = collector_stepper(
            env if grouped else env.base_env, steps_per_poll, episodes
        )
        name = f"Collector, {num_envs} envs x {steps_per_poll} steps a poll, policy"
        name += ", SameStartGroups" if grouped else " (PPO's layout)"
        if (num_envs, steps_per_poll, episodes) == (64, 32, None):
            name += " (stream layout)"
        elif episodes is not None:
            name += f", trajs_per_batch={episodes} (episodes layout)"
        calls = max(10, 20_000 // (num_envs * steps_per_poll)) if episodes is None else 10
        costs.append((name, per_step(stepper, calls)))
        collector.shutdown()
    reference = costs[0][1]
    lines = [[name, f"{us:.1f}", f"{us / reference:.1f}"] for name, us in costs]
    print_table(["one environment step", "us", "x bare"], lines)


def main(argv: list[str] | None = None) -> None:
    args, extra = parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as the runs do: tiny matrices on a shared 2-core machine
    reference = import_time()
    runs = []
    if "grpo" in args.algorithms:
        for layout in args.layout:
            for advantage in args.advantage:
                label = " ".join(["GRPO", *(v for v in (layout, advantage) if v is not None)])
                grpo_args = [*([] if layout is None else ["--layout", layout])]
                grpo_args += [*([] if advantage is None else ["--advantage", advantage]), *extra]
                runs.append(("grpo", label, EXAMPLE, grpo_args))
    if "ppo" in args.algorithms:
        runs.append(("ppo", "PPO", PPO, []))
    rows = []
    for algorithm, label, script, script_args in runs:
        output_dir = f"{args.output_dir}/{algorithm}"
        for seed in args.seeds:
            result = run_script(script, seed, output_dir, script_args)
            rows.append({"algorithm": algorithm, "label": label, "seed": seed, **result})
            print(f"# done: {rows[-1]}", file=sys.stderr, flush=True)
    demo = load_demo()
    recheck(demo, rows, args.recheck_episodes, extra)
    runs_table(rows, reference, args.recheck_episodes)
    print(f"# extra demo arguments: {' '.join(extra) or '(none)'}")
    print()
    side_by_side(rows, args.recheck_episodes)
    if not args.no_env_costs:
        print()
        env_costs(demo)


if __name__ == "__main__":
    main()
