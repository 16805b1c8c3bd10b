"""examples/llm_grpo.py as it is, with a clock on each GRPO step (benchmarks/grpo_work.py).

    .venv/bin/python benchmarks/llm_grpo_steps.py --seed 0          # the example's flags
    .venv/bin/python benchmarks/llm_grpo_steps.py --count-work --steps 4

Runs the example's ``main`` in this process; the only change is that torchrl's ``GRPOTrainer``
is subclassed to register two more hooks after the example's own: a GRPO step's clock stops
after its ``post_steps`` hooks (the optimization and the learning-rate schedule) and starts again
after its ``post_steps_log`` hooks (the evaluation every ``--eval-every`` steps), so the step
times leave the evaluations out. The example's output is printed as usual, its ``RESULT`` line
last, and before it the clock's ``STEPS`` line (and with ``--count-work`` the ``WORK`` line of
what each step did). Nothing heavy is imported before the example: its clock (``wall_s``, the
``--time-limit`` budget) starts as in a run of the example itself.
"""

import importlib.util
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llm_grpo.py"


def load_example():
    spec = importlib.util.spec_from_file_location("llm_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clocked(trainer_cls, budget_s: float, count_work: bool):
    """``trainer_cls`` with a :class:`~grpo_work.StepClock` around each GRPO step."""
    from grpo_work import StepClock

    class ClockedGRPOTrainer(trainer_cls):
        def train(self):
            clock = StepClock(self.optimizer, budget_s, count_work)
            self.register_op("post_steps", clock.stop)
            self.register_op("post_steps_log", lambda _batch: clock.start())
            clock.start()
            try:
                return super().train()
            finally:
                clock.report()

    return ClockedGRPOTrainer


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    count_work = "--count-work" in argv
    argv = [a for a in argv if a != "--count-work"]
    example = load_example()  # its clock starts here
    budget_s = example.parse_args(argv).time_limit
    example.GRPOTrainer = clocked(example.GRPOTrainer, budget_s, count_work)
    example.main(argv)


if __name__ == "__main__":
    main()
