"""How far the distillation advantage is from its own limit without sampling noise: from one warm
start, GRPO alone, the example's distillation run, and the same run trained on the exact
per-position reverse KL to the teacher instead (``llm_distill.ExactReverseKL``: every token of
the vocabulary at each response position of the student's own samples, the quantity the
advantage estimates from one sampled token with ``gamma = 0``), each for ``--budget`` seconds.

    .venv/bin/python benchmarks/llm_distill_exact.py -- --teacher runs/teacher/<run> --seed 3
    .venv/bin/python benchmarks/llm_distill_exact.py -- --teacher runs/teacher/<run> \\
        --sft-target 0.1 --seed 3     # a less trained student
    .venv/bin/python benchmarks/llm_distill_exact.py --top 2 2 -- --teacher runs/teacher/<run>

``--top TEACHER_K STUDENT_K`` adds a fourth run: the same objective over the teacher's and the
student's most likely tokens at each position only, the rest of the vocabulary as one outcome
(``ExactReverseKL(teacher, top=...)``).

Everything after ``--`` is ``examples/llm_distill.py``'s flags (``--teacher`` is needed; the
exact run takes the distillation run's settings, ``--distill-flags`` included; the distillation
run is the advantage's, ``--top-k 0``, whatever is given: this is its yardstick; the tables of
``docs/tutorial_distill.rst`` ran with ``--distill-flags "--kl-coeff 0"``). Printed, per
run: the greedy accuracy on the held-out prompts at each evaluation, the final accuracy and
reverse KL to the teacher, and the training time at which it first reached GRPO's final
accuracy, also as a share of the budget (the example's target: at most 0.5). The exact run
needs the teacher's logits, which the lean path never builds at an LLM's vocabulary: it is the
yardstick of the estimator, not a method this package offers.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import llm_distill  # noqa: E402  (examples/ is not a package)

llm_grpo = llm_distill.llm_grpo


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--top",
        type=int,
        nargs=2,
        metavar=("TEACHER_K", "STUDENT_K"),
        help="a fourth run: the exact reverse KL over the teacher's and the student's most "
        "likely tokens at each position only, the rest of the vocabulary as one outcome",
    )
    parser.add_argument("example", nargs="*", help="examples/llm_distill.py's flags (after --)")
    args = parser.parse_args(argv)
    cfg = llm_grpo.parse_args(args.example, settings_cls=llm_distill.Settings)
    cfg = dataclasses.replace(cfg, top_k=0)  # the advantage: the estimator this measures
    if not cfg.teacher:
        parser.error("--teacher <examples/llm_grpo.py run folder> after --")
    grpo, distill, _ = llm_distill.three_runs(cfg)
    setup = llm_distill.prepare(cfg, time.perf_counter())
    exact = llm_distill.Run("exact", "exact reverse KL", None, distill.settings)
    objective = llm_distill.ExactReverseKL(setup.teacher_model)
    curves = {
        "grpo": llm_distill.train(grpo, setup),
        "distill": llm_distill.train(distill, setup),
        "exact": llm_distill.train(exact, setup, objective=objective),
    }
    if args.top:
        name = "top {}+{}".format(*args.top)
        few = llm_distill.Run(name, f"reverse KL, {name}", None, distill.settings)
        objective = llm_distill.ExactReverseKL(setup.teacher_model, top=tuple(args.top))
        curves[name] = llm_distill.train(few, setup, objective=objective)
    target = curves["grpo"]["accuracy"][-1]
    print(f"\nteacher {setup.teacher_acc:.3f}; student after its warm start {setup.acc_start:.3f}")
    print(f"{'run':>9}  {'final acc':>9}  {'KL end':>7}  {'t to GRPO':>9}  {'t/budget':>8}  curve")
    for name, c in curves.items():
        t = llm_distill.time_to_reach(c, target)
        curve = " ".join(f"{s:.0f}:{a:.2f}" for s, a in zip(c["time"], c["accuracy"], strict=True))
        print(
            f"{name:>9}  {c['accuracy'][-1]:>9.3f}  {c['kl'][-1]:>7.3f}  {t:>9.1f}  "
            f"{t / cfg.budget:>8.2f}  {curve}"
        )


if __name__ == "__main__":
    main()
