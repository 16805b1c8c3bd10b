"""Run examples/llm_grpo.py at its defaults for several seeds, one after the other; print a table.

    .venv/bin/python benchmarks/llm_seeds.py                  # seeds 0, 1, 2: about 3 x 3 min
    .venv/bin/python benchmarks/llm_seeds.py --seeds 3 4      # other seeds
    .venv/bin/python benchmarks/llm_seeds.py -- --steps 300   # after --: flags for the example
    .venv/bin/python benchmarks/llm_seeds.py --example async  # examples/llm_grpo_async.py
    .venv/bin/python benchmarks/llm_seeds.py --example both   # each seed: sync, then async

With ``--example both`` every seed runs the synchronous example, then the asynchronous one, on
the same seed and budget, and the table adds the async run's largest policy lag (``max_lag``);
a second table compares them seed by seed: the ratio of their GRPO steps in the budget (the
steps per second, async over sync) and the difference of their final accuracies, against the
asynchronous example's targets (at least 1.3x the steps, at most 0.03 below in accuracy).

Each run is a fresh process (the example's own ``wall_s`` starts before its imports; the table
also shows the process's wall time measured from here). The targets are those of the example on
torchrl's LLM stack: greedy accuracy on the held-out prompts up by at least 45 points
(absolute) from the warm start, within 200 s of process wall time on a 2-core CPU. The runs are
sequential so that they do not compete for the CPU; other jobs on the machine still do, so the
load average is printed with each run (run it under ``flock /tmp/heavy.lock`` on a shared
machine).
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
EXAMPLES = {
    "sync": ROOT / "examples" / "llm_grpo.py",
    "async": ROOT / "examples" / "llm_grpo_async.py",
}
RESULT = re.compile(
    r"^RESULT acc_before=(\S+) acc_after=(\S+) wall_s=(\S+)(?: max_lag=(\S+))?$", re.MULTILINE
)
MIN_GAIN = 0.45  # absolute accuracy points, as a fraction
MAX_WALL_S = 200.0
MIN_STEP_RATIO = 1.3  # async GRPO steps over sync's, in the same budget
MAX_ACC_LOSS = 0.03  # async's final accuracy at most this far below sync's


def run(seed: int, out: str, extra: list[str], example: str = "sync") -> dict:
    """One run of the example; its RESULT line, the process's wall time and the load around it."""
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES[example]), "--seed", str(seed), "--out", out, *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # the progress bar
        text=True,
    )
    process_s = time.perf_counter() - start
    match = RESULT.search(proc.stdout)
    if proc.returncode != 0 or match is None:
        sys.exit(f"seed {seed}: the example failed (exit {proc.returncode}):\n{proc.stdout}")
    before, after, wall_s = map(float, match.groups()[:3])
    steps = re.search(r"after (\d+) GRPO steps", proc.stdout)
    return {
        "example": example,
        "max_lag": match.group(4) or "-",
        "seed": seed,
        "before": before,
        "after": after,
        "wall_s": wall_s,
        "process_s": process_s,
        "load": (load_before, os.getloadavg()[0]),
        "steps": steps.group(1) if steps else "?",
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/llm_seeds")
    parser.add_argument("--example", choices=["sync", "async", "both"], default="sync")
    parser.add_argument("extra", nargs="*", help="flags passed to the example (after --)")
    args = parser.parse_args(argv)

    examples = ["sync", "async"] if args.example == "both" else [args.example]
    names = ", ".join(EXAMPLES[e].name for e in examples)
    print(f"{names} {' '.join(args.extra) or '(defaults)'}, {os.cpu_count()} CPUs")
    header = (
        f"{'example':>7}  {'seed':>4}  {'acc before':>10}  {'acc after':>9}  {'gain':>6}  "
        f"{'GRPO steps':>10}  {'max_lag':>7}  {'wall s':>6}  {'process s':>9}  "
        f"{'load 1-min':>11}  target met"
    )
    print(header)
    print("-" * len(header))
    rows, results = [], []
    for seed in args.seeds:
        for example in examples:
            r = run(seed, args.out, args.extra, example)
            results.append(r)
            met = r["after"] - r["before"] >= MIN_GAIN and r["process_s"] <= MAX_WALL_S
            rows.append(met)
            print(
                f"{example:>7}  {r['seed']:>4}  {r['before']:>10.3f}  {r['after']:>9.3f}  "
                f"{r['after'] - r['before']:>+6.3f}  {r['steps']:>10}  {r['max_lag']:>7}  "
                f"{r['wall_s']:>6.0f}  {r['process_s']:>9.0f}  "
                f"{r['load'][0]:>5.2f}-{r['load'][1]:<5.2f}  {'yes' if met else 'NO'}",
                flush=True,
            )
    print(
        f"\ntarget: gain >= {MIN_GAIN:+.2f} and process wall time <= {MAX_WALL_S:.0f} s; "
        f"met by {sum(rows)} of {len(rows)} runs"
    )
    if args.example == "both":
        compare(results)


def compare(results: list[dict]) -> None:
    """Async against sync, seed by seed: the steps in the budget and the final accuracy."""
    print(
        f"\n{'seed':>4}  {'steps sync':>10}  {'steps async':>11}  {'ratio':>5}  "
        f"{'acc sync':>8}  {'acc async':>9}  {'diff':>6}  target met"
    )
    met = 0
    for sync_run, async_run in zip(results[::2], results[1::2], strict=True):
        ratio = int(async_run["steps"]) / int(sync_run["steps"])
        diff = async_run["after"] - sync_run["after"]
        ok = ratio >= MIN_STEP_RATIO and diff >= -MAX_ACC_LOSS
        met += ok
        print(
            f"{sync_run['seed']:>4}  {sync_run['steps']:>10}  {async_run['steps']:>11}  "
            f"{ratio:>5.2f}  {sync_run['after']:>8.3f}  {async_run['after']:>9.3f}  "
            f"{diff:>+6.3f}  {'yes' if ok else 'NO'}"
        )
    print(
        f"target: async steps >= {MIN_STEP_RATIO}x sync's and accuracy >= sync's - "
        f"{MAX_ACC_LOSS}; met by {met} of {len(results) // 2} seeds"
    )


if __name__ == "__main__":
    main()
