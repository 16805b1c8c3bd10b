"""Multi-turn GRPO against the single-turn policy, seed by seed: examples/llm_grpo_multiturn.py.

    .venv/bin/python benchmarks/llm_multiturn_seeds.py                # seeds 0, 1, 2: ~25 min
    .venv/bin/python benchmarks/llm_multiturn_seeds.py --seeds 3 4
    .venv/bin/python benchmarks/llm_multiturn_seeds.py -- --estimator per_step  # flags, after --

Each seed runs the example twice, one after the other, each a fresh process: at its defaults
(dialogs of up to two turns: guess at once, or ask the tool and answer after its reply) and with
``--max-turns 1`` (the single-turn policy: the same warm start and budget, one answer per task).
The table gives the greedy success on the 500 held-out tasks before and after GRPO, the share of
greedy dialogs that ask the tool, the turns a dialog takes, the smallest ESS of a step's first
minibatch (the batch is scored by the weights that train on it: 1 unless something is misaligned),
and the process wall time measured from here. Targets (seeds 0-2, a 2-core CPU): the multi-turn
run gains at least 30 points within 240 s, and ends at least 10 points above the single-turn one.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "llm_grpo_multiturn.py"
RESULT = re.compile(
    r"^RESULT success_before=(\S+) success_after=(\S+) turns_mean=(\S+) wall_s=(\S+) "
    r"first_minibatch_ess_min=(\S+)$",
    re.MULTILINE,
)
ASKED = re.compile(r"greedy after \d+ GRPO steps: .*asked the tool (\S+?),")
STEPS = re.compile(r"greedy after (\d+) GRPO steps")
MIN_GAIN, MIN_MARGIN, MAX_WALL_S, MIN_ESS = 0.30, 0.10, 240.0, 0.999


def run(seed: int, out: str, extra: list[str]) -> dict:
    """One run of the example; its RESULT line, and the process's wall time."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--seed", str(seed), "--out", out, *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # the progress bar
        text=True,
    )
    process_s = time.perf_counter() - start
    match = RESULT.search(proc.stdout)
    if proc.returncode != 0 or match is None:
        sys.exit(
            f"seed {seed} {extra}: the example failed (exit {proc.returncode}):\n{proc.stdout}"
        )
    before, after, turns, wall_s, ess = map(float, match.groups())
    asked = ASKED.search(proc.stdout)
    return {
        "before": before,
        "after": after,
        "turns": turns,
        "wall_s": wall_s,
        "ess": ess,
        "asked": float(asked.group(1)) if asked else float("nan"),
        "steps": int(STEPS.search(proc.stdout).group(1)),
        "process_s": process_s,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/llm_multiturn_seeds")
    parser.add_argument("extra", nargs="*", help="flags passed to both runs (after --)")
    args = parser.parse_args(argv)
    print(f"{EXAMPLE.name} {' '.join(args.extra) or '(defaults)'}, {os.cpu_count()} CPUs")
    header = (
        f"{'seed':>4}  {'policy':>11}  {'before':>6}  {'after':>6}  {'gain':>6}  {'asks':>5}  "
        f"{'turns':>5}  {'steps':>5}  {'ESS min':>8}  {'wall s':>6}  {'process s':>9}"
    )
    print(header)
    print("-" * len(header))
    met = []
    for seed in args.seeds:
        runs = {
            "multi-turn": run(seed, args.out, args.extra),
            "single-turn": run(seed, args.out, [*args.extra, "--max-turns", "1"]),
        }
        for name, r in runs.items():
            print(
                f"{seed:>4}  {name:>11}  {r['before']:>6.3f}  {r['after']:>6.3f}  "
                f"{r['after'] - r['before']:>+6.3f}  {r['asked']:>5.2f}  {r['turns']:>5.2f}  "
                f"{r['steps']:>5}  {r['ess']:>8.6f}  {r['wall_s']:>6.0f}  {r['process_s']:>9.0f}",
                flush=True,
            )
        multi, single = runs["multi-turn"], runs["single-turn"]
        met.append(
            multi["after"] - multi["before"] >= MIN_GAIN
            and multi["after"] - single["after"] >= MIN_MARGIN
            and max(r["process_s"] for r in runs.values()) <= MAX_WALL_S
            and min(r["ess"] for r in runs.values()) >= MIN_ESS
        )
    print(
        f"\ntargets: multi-turn gain >= {MIN_GAIN:+.2f}, multi-turn - single-turn success >= "
        f"{MIN_MARGIN:+.2f}, process wall time <= {MAX_WALL_S:.0f} s, first-minibatch ESS >= "
        f"{MIN_ESS}; met by {sum(met)} of {len(met)} seeds"
    )


if __name__ == "__main__":
    main()
