"""examples/llm_grpo.py beside TRL's GRPOTrainer: the same task, model, warm start, settings and
wall-clock budget, one after the other, seed by seed; prints a table.

    .venv/bin/python benchmarks/trl_side_by_side.py --quick            # smoke run: 4 steps, seed 0
    .venv/bin/python benchmarks/trl_side_by_side.py                    # seeds 0 1 2: about 17 min
    .venv/bin/python benchmarks/trl_side_by_side.py --seeds 0 --budget 120
    .venv/bin/python benchmarks/trl_side_by_side.py -- --minibatch 128 # after --: example flags
    .venv/bin/python benchmarks/trl_side_by_side.py --trl-version 1.14.2 --trl-venv .venv-trl-1.14

The first run makes TRL's virtual environment (``--trl-venv``, default ``.venv-trl``, git-ignored;
about 2 minutes): ``python3 -m venv``, then ``torch==2.13.0`` first (the CPU wheel: an open range
pulls a multi-GB CUDA build), then TRL and the versions pinned in ``PINS`` (the main venv's, for
what both sides share); it prints the versions. TRL is never a dependency of this package. Each
seed runs the example (benchmarks/llm_grpo_steps.py: the example as it is, with a clock per GRPO
step) in this venv, then TRL (benchmarks/trl_grpo_worker.py) in TRL's, each a fresh process with
this working tree on ``PYTHONPATH``. Run it alone on the machine (``flock /tmp/heavy.lock`` on a
shared one): the table's times are wall times. A seed takes about 5.5 minutes at the example's
190 s budget (the example uses all of it; TRL 1.16 ended its 150 steps in 136 s on a 2-core
CPU), 3 seeds about 17 minutes, plus the venv the first time.

What is compared, per seed: the GRPO steps each side fits in the budget (counted from its
process's start, imports and warm start included, as the example counts it), the median and mean
wall seconds of a GRPO step (sampling, scoring, advantages, optimization and their logging; the
warm start and the evaluations left out), the ratio ours/TRL of those (below 1: the example's
steps are faster), and the greedy accuracy on the 500 held-out prompts after the warm start
(the same on both sides: the same weights) and at the end of the budget.

The same work per GRPO step (``--count-work``, on with ``--quick``, prints it, counted by forward
hooks, benchmarks/grpo_work.py): 512 completions sampled (64 prompts x 8), 16 optimizer steps
(2 epochs of 8 minibatches of 64), one scoring pass without gradients over the 512 by the
policy (the sampling policy's log-probs) and one by the frozen reference, 1024 rows scored with
gradients (16 x 64). Both sides sample with ``model.generate``, temperature 1, the padding
token forbidden, 3 new tokens at most; the same prompts step by step; the same reward, clip
range, KL (k3, coefficient 0.02, not importance-weighted), token-mean loss per minibatch,
gradient clipping, Adam and learning-rate schedule. What still differs, and why:

* Minibatches: the example draws each epoch's 8 minibatches afresh (a sampler without
  replacement over the step's 512 completions); TRL shuffles the 512 once and uses the same
  8 minibatches, in the same order, in both epochs (its buffered generation batch).
* Advantages: the example divides by the group's standard deviation floored at 1e-6, TRL adds
  1e-4 to it (with 0/1 rewards a non-zero standard deviation is at least 0.35: the advantages
  differ by less than 0.03 %); the example's k3 KL clamps the log-ratio to [-20, 20] and the
  estimate to [-10, 10] (verl's ``low_var_kl``), TRL's does not (no effect at these KLs).
* Scoring: the example's ``LeanTransformersWrapper`` computes the log-probs from the hidden
  states (no logits), at the response's positions only, each scoring pass over the 512 rows in
  one forward; TRL scores in forwards of ``per_device_train_batch_size`` rows (8 of 64 per
  pass). TRL from 1.15 computes them from the hidden states too (its fused LM head, which also
  computes every token's entropy for its metrics, and on a CPU projects every position); TRL up
  to 1.14.2 computes the completion's logits (``--trl-version 1.14.2`` in a venv of its own).
* Sampling randomness: TRL seeds torch again (``set_seed(seed)``) when its trainer is built,
  after the warm start; the example goes on from the warm start's random state. The runs see
  the same prompts but not the same completions, so accuracies differ by sampling noise too.
* Budget: TRL's process also imports the example's module (torchrl, tensordict, matplotlib:
  a few seconds of its budget) to share the example's code; TRL's import is its own cost. The
  steps in the budget carry this; the seconds per step do not.
* Set-up outside the steps: TRL saves the warm-started model and loads its reference from it
  (``GRPOTrainer`` builds the reference from the policy's path); the example copies it.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TORCH = "torch==2.13.0"  # first, alone: the CPU wheel
TRL_VERSION = "1.16.0"  # the newest release, checked with transformers 5.24 and torch 2.13
#: What TRL's venv needs besides torch and TRL, pinned to the main venv's versions: TRL's own
#: dependencies that the example shares, and what the example's module imports (the TRL worker
#: calls its functions).
PINS = (
    "transformers==5.24.0",
    "accelerate==1.15.0",
    "datasets==5.2.0",
    "tokenizers==0.23.3",
    "torchrl==0.14.1",
    "tensordict==0.14.3",
    "matplotlib==3.11.2",
    "tqdm==4.70.1",
)
QUICK = ("--steps", "4", "--eval-every", "2")  # the example's flags of a smoke run
RESULT = re.compile(r"^RESULT acc_before=(\S+) acc_after=(\S+) wall_s=(\S+)", re.MULTILINE)
STEPS = re.compile(r"^STEPS budget_s=(\S+) step_s=(\S*)$", re.MULTILINE)
WORK = re.compile(r"^WORK (.+)$", re.MULTILINE)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", help="default: 0 1 2 (--quick: 0)")
    parser.add_argument("--budget", type=float, help="seconds (default: the example's)")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {' '.join(QUICK)}")
    parser.add_argument(
        "--count-work",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="count each step's work (default: with --quick only)",
    )
    parser.add_argument("--trl-venv", type=Path, default=ROOT / ".venv-trl")
    parser.add_argument("--trl-version", default=TRL_VERSION)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "trl_side_by_side")
    parser.add_argument("extra", nargs="*", help="example flags for both sides (after --)")
    args = parser.parse_args(argv)
    args.seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    args.count_work = args.quick if args.count_work is None else args.count_work
    return args


def wanted(trl_version: str) -> dict[str, str]:
    """Package name -> version, for TRL's venv (torch aside)."""
    return {"trl": trl_version} | dict(pin.split("==") for pin in PINS)


def installed_versions(python: Path, names) -> dict[str, str]:
    """The versions of ``names`` in the interpreter ``python`` (``-``: not installed)."""
    code = (
        "import importlib.metadata as m, sys\n"
        "for name in sys.argv[1:]:\n"
        "    try: print(name, m.version(name))\n"
        "    except m.PackageNotFoundError: print(name, '-')\n"
    )
    out = subprocess.run([python, "-c", code, *names], capture_output=True, text=True, check=True)
    return dict(line.split() for line in out.stdout.splitlines())


def ensure_trl_venv(venv: Path, trl_version: str) -> dict[str, str]:
    """TRL's venv, made (torch first) or brought to the pinned versions; what it has.

    Raises:
        SystemExit: its torch is not ``TORCH`` (a CUDA build pulled by an open range).
    """
    python = venv / "bin" / "python"
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if not python.exists():
        print(f"making {venv} (torch first, then TRL {trl_version}): about 2 minutes", flush=True)
        subprocess.run(["python3", "-m", "venv", venv], check=True)
        subprocess.run([*pip, TORCH], check=True)
    names = ["torch", *wanted(trl_version)]
    have = installed_versions(python, names)
    if any(have[name] != version for name, version in wanted(trl_version).items()):
        subprocess.run([*pip, f"trl=={trl_version}", *PINS], check=True)
        have = installed_versions(python, names)
    if not have["torch"].startswith(TORCH.split("==")[1]):
        sys.exit(f"{venv} has torch {have['torch']}, not {TORCH}: remove it and run again")
    return have


def run_side(name: str, python: Path, script: str, flags: list[str], log: Path) -> dict:
    """One run; its output shown as it comes (prefixed), parsed at the end."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    log.parent.mkdir(parents=True, exist_ok=True)
    load_before, start = os.getloadavg()[0], time.perf_counter()
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [python, str(BENCH / script), *flags],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        lines = []
        for line in proc.stdout:
            lines.append(line)
            print(f"  [{name}] {line}", end="", flush=True)
    text = "".join(lines)
    result, steps = RESULT.search(text), STEPS.search(text)
    if proc.wait() != 0 or result is None or steps is None:
        sys.exit(f"{name}: the run failed (exit {proc.returncode}); its stderr: {log}")
    step_s = [float(s) for s in steps.group(2).split(",") if s]
    work = WORK.search(text)
    return {
        "acc_before": float(result.group(1)),
        "acc_after": float(result.group(2)),
        "wall_s": float(result.group(3)),
        "budget_s": float(steps.group(1)),
        "step_s": step_s,
        "work": dict(kv.split("=") for kv in work.group(1).split()) if work else None,
        "process_s": time.perf_counter() - start,
        "load": (load_before, os.getloadavg()[0]),
    }


def print_table(rows: list[tuple[int, dict, dict]]) -> None:
    """One line per seed: steps in the budget, seconds per step, their ratio, accuracies."""
    head = (
        f"{'seed':>4}  {'steps ours':>10}  {'steps TRL':>9}  {'median s ours':>13}  "
        f"{'median s TRL':>12}  {'ratio':>5}  {'mean s ours':>11}  {'mean s TRL':>10}  "
        f"{'ratio':>5}  {'acc start':>9}  {'acc ours':>8}  {'acc TRL':>7}"
    )
    print(f"\n{head}\n{'-' * len(head)}")
    for seed, ours, trl in rows:
        med = [statistics.median(r["step_s"]) for r in (ours, trl)]
        mean = [statistics.fmean(r["step_s"]) for r in (ours, trl)]
        start = f"{ours['acc_before']:.3f}" + (
            "" if ours["acc_before"] == trl["acc_before"] else "*"
        )
        print(
            f"{seed:>4}  {len(ours['step_s']):>10}  {len(trl['step_s']):>9}  {med[0]:>13.3f}  "
            f"{med[1]:>12.3f}  {med[0] / med[1]:>5.2f}  {mean[0]:>11.3f}  {mean[1]:>10.3f}  "
            f"{mean[0] / mean[1]:>5.2f}  {start:>9}  {ours['acc_after']:>8.3f}  "
            f"{trl['acc_after']:>7.3f}"
        )
    print(
        "ratio: ours / TRL seconds per GRPO step (below 1: ours faster); acc start: after the "
        "warm start, both sides (* where they differ)"
    )


def print_work(rows: list[tuple[int, dict, dict]]) -> None:
    """The mean work per GRPO step of each side (--count-work)."""
    for seed, ours, trl in rows:
        if ours["work"] is None or trl["work"] is None:
            continue
        print(f"\nwork per GRPO step, seed {seed}:  {'ours':>6}  {'TRL':>6}")
        for key in ours["work"]:
            same = "" if ours["work"][key] == trl["work"].get(key) else "  differs"
            print(f"  {key:<26}  {ours['work'][key]:>6}  {trl['work'].get(key, '-'):>6}{same}")


def print_runs(rows: list[tuple[int, dict, dict]]) -> None:
    """Each run's wall times and the load around it (other jobs inflate wall times)."""
    print(f"\n{'seed':>4}  {'side':>4}  {'wall s':>6}  {'process s':>9}  load 1-min")
    for seed, *runs in rows:
        for side, r in zip(("ours", "TRL"), runs, strict=True):
            load = f"{r['load'][0]:.2f}-{r['load'][1]:.2f}"
            print(f"{seed:>4}  {side:>4}  {r['wall_s']:>6.0f}  {r['process_s']:>9.0f}  {load}")


def main(argv=None) -> list[tuple[int, dict, dict]]:
    args = parse_args(argv)
    versions = ensure_trl_venv(args.trl_venv, args.trl_version)
    print("TRL venv: " + ", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)
    flags = [*(["--time-limit", str(args.budget)] if args.budget else [])]
    flags += [*(QUICK if args.quick else ()), *args.extra]
    flags += ["--count-work"] if args.count_work else []
    print(f"seeds {args.seeds}, example flags: {' '.join(flags) or '(defaults)'}", flush=True)
    rows = []
    for seed in args.seeds:
        out = args.out / f"seed{seed}"  # each side's run folder in it, and its stderr
        seeded = ["--seed", str(seed), "--out", str(out), *flags]
        ours = run_side(
            f"ours s{seed}", Path(sys.executable), "llm_grpo_steps.py", seeded, out / "ours.log"
        )
        trl_python = args.trl_venv / "bin" / "python"
        trl = run_side(f"TRL s{seed}", trl_python, "trl_grpo_worker.py", seeded, out / "trl.log")
        rows.append((seed, ours, trl))
    print(f"\nbudget {rows[0][1]['budget_s']:.0f} s per run; TRL {versions['trl']}")
    print_table(rows)
    print_work(rows)
    print_runs(rows)
    return rows


if __name__ == "__main__":
    main()
