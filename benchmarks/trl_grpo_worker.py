"""TRL's ``GRPOTrainer`` on the task, model, warm start and settings of examples/llm_grpo.py.

Run by benchmarks/trl_side_by_side.py in TRL's own virtual environment (``.venv-trl``, which it
makes), with the repository on ``PYTHONPATH``; it takes the example's flags::

    PYTHONPATH=. .venv-trl/bin/python benchmarks/trl_grpo_worker.py --seed 0
    PYTHONPATH=. .venv-trl/bin/python benchmarks/trl_grpo_worker.py --steps 4 --count-work

What it shares with the example, by calling the example's own functions: the settings and their
defaults (``parse_args``), the task and the held-out prompts, the tiny Qwen2 and its
character-level tokenizer (``tiny_qwen2``), the warm start (``warm_start``, to the same weights
as the example's for the same seed: the same draws in the same order), the training prompts (the
same 64 per step, in the same order), the reward (the example's decoding and ``task.reward``),
the learning-rate schedule (``lr_schedule``, stepped once per GRPO step) and the greedy accuracy
on the 500 held-out prompts (``GreedyAccuracy``). Importing the example module rather than
copying these keeps one definition of each, so that the two sides cannot drift apart; it needs
what the module imports (torchrl, tensordict, matplotlib: pinned in TRL's venv) and this
package, which comes from the working tree on ``PYTHONPATH`` (never installed there: both sides
run the same code). TRL's own code never sees torchrl.

What is TRL's: the loop (``GRPOTrainer.train()``), the sampling (``model.generate``), the
scoring (the log-probs of the sampling policy and of the reference), the advantages, the loss
and the optimizer step (an ``Adam`` built here as the example's, passed with ``optimizers=``).
A ``TrainerCallback`` ends each GRPO step (every ``steps_per_generation * num_iterations``
optimizer steps): it stops the step's clock, stops the training once the budget
(``--time-limit``, counted from this process's start, imports included, as the example's) is
spent, evaluates every ``--eval-every`` steps and at the end, and starts the next step's clock.
It prints the settings' mapping, the evaluations, the ``STEPS`` (and with ``--count-work``
``WORK``) lines of benchmarks/grpo_work.py and a ``RESULT`` line like the example's.
"""

# ruff: noqa: E402  (the clock starts before the imports, as the example's)
import time

T0 = time.perf_counter()

import gc
import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local

import torch
from datasets import Dataset
from grpo_work import StepClock
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.utils import logging as hf_logging
from trl import GRPOConfig, GRPOTrainer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llm_grpo.py"
#: Example settings this worker cannot give TRL, with the value it needs.
NOT_MAPPED = {
    "lora_rank": 0,
    "model": "",
    "resume": "",
    "eval_only": False,
    "dynamic_sampling": False,
    "group_minibatches": False,
    "device": "cpu",
}


def load_example():
    spec = importlib.util.spec_from_file_location("llm_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_mapped(cfg) -> None:
    """Refuse the example settings that have no counterpart here.

    Raises:
        SystemExit: naming the settings.
    """
    wrong = [f"--{k.replace('_', '-')} {getattr(cfg, k)!r}" for k in NOT_MAPPED]
    wrong = [w for w, (k, v) in zip(wrong, NOT_MAPPED.items(), strict=True) if getattr(cfg, k) != v]
    if (cfg.prompts_per_step * cfg.group_size) % cfg.minibatch:
        wrong.append("a --minibatch that does not divide --prompts-per-step x --group-size")
    if wrong:
        raise SystemExit(f"trl_grpo_worker.py: not mapped to TRL: {', '.join(wrong)}")


def warm_started(ex, cfg, task):
    """The example's ``main`` up to the end of its warm start, in the same order (the same
    draws of the same generators, hence the same weights for the same seed).

    Returns ``(model, tokenizer, train_gen, held_out, eval_accuracy, acc_before, sft_steps)``.
    """
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    model, tokenizer = ex.tiny_qwen2(cfg, task)
    ex.check_special_ids(model, tokenizer)
    eval_problems = ex.draw_problems(
        task, torch.Generator().manual_seed(1234), cfg.eval_prompts, set()
    )
    held_out = set(eval_problems["query"])
    train_gen = torch.Generator().manual_seed(cfg.seed)
    val_problems = ex.draw_problems(task, train_gen, 200, held_out)
    greedy = ex.make_sampler(model, tokenizer, cfg, greedy=True)
    val_accuracy = ex.GreedyAccuracy(tokenizer, task, val_problems, greedy)
    eval_accuracy = ex.GreedyAccuracy(tokenizer, task, eval_problems, greedy)
    sft_steps = ex.warm_start(model, tokenizer, cfg, task, train_gen, held_out, val_accuracy)
    return model, tokenizer, train_gen, held_out, eval_accuracy, eval_accuracy(), sft_steps


def training_prompts(ex, cfg, task, gen, held_out) -> Dataset:
    """The example's prompts, step after step: ``--steps`` draws of ``--prompts-per-step``
    distinct problems (its ``Problems`` stream), as TRL's ``prompt`` and ``answer`` columns."""
    batches = [
        ex.draw_problems(task, gen, cfg.prompts_per_step, held_out, distinct=True)
        for _ in range(cfg.steps)
    ]
    return Dataset.from_dict(
        {
            "prompt": [q for b in batches for q in b["query"]],
            "answer": [a for b in batches for a in b["answer"]],
        }
    )


def task_reward_function(ex, tokenizer, task):
    """The example's reward as a TRL reward function: each completion decoded up to its first
    end-of-sequence token, ``EOS`` appended if it has one (``TaskReward.completions``), then
    ``task.reward(completion, answer)``."""
    decoder = ex.TaskReward(tokenizer, task)

    def task_reward(prompts, completions, completion_ids, answer, **_):
        texts = decoder.completions([torch.tensor(ids) for ids in completion_ids])
        return [task.reward(t, a) for t, a in zip(texts, answer, strict=True)]

    return task_reward


def trl_config(cfg, tokenizer, out: Path) -> GRPOConfig:
    """The example's settings in TRL's terms (see :func:`mapping`)."""
    rows = cfg.prompts_per_step * cfg.group_size
    return GRPOConfig(
        output_dir=str(out),
        seed=cfg.seed,
        use_cpu=True,
        bf16=False,  # TRL's default is True: the example computes in float32
        gradient_checkpointing=False,  # TRL's default is True
        num_generations=cfg.group_size,
        per_device_train_batch_size=cfg.minibatch,
        gradient_accumulation_steps=1,
        steps_per_generation=rows // cfg.minibatch,
        num_iterations=cfg.epochs,
        max_completion_length=cfg.max_new_tokens,
        temperature=1.0,
        generation_kwargs={"bad_words_ids": [[tokenizer.pad_token_id]]},
        learning_rate=cfg.lr,
        beta=cfg.kl_coeff,
        use_bias_correction_kl=False,
        epsilon=cfg.clip_epsilon,
        epsilon_high=cfg.clip_epsilon_high,
        entropy_coef=cfg.entropy_coeff,
        loss_type="bnpo",
        scale_rewards="group",
        max_grad_norm=1.0,
        max_steps=cfg.steps * (rows // cfg.minibatch) * cfg.epochs,
        shuffle_dataset=False,
        logging_steps=(rows // cfg.minibatch) * cfg.epochs,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )


def mapping(cfg, args: GRPOConfig) -> list[tuple[str, str, str]]:
    """``(example setting, TRL setting, value)``: the values TRL runs with, read from ``args``."""
    updates = args.steps_per_generation * args.num_iterations
    return [
        ("--seed", "seed", args.seed),
        ("--group-size", "num_generations", args.num_generations),
        ("--prompts-per-step x --group-size", "generation_batch_size", args.generation_batch_size),
        ("--minibatch", "per_device_train_batch_size", args.per_device_train_batch_size),
        ("(one minibatch per update)", "gradient_accumulation_steps", 1),
        ("(rows / --minibatch)", "steps_per_generation", args.steps_per_generation),
        ("--epochs", "num_iterations", args.num_iterations),
        ("(optimizer steps per GRPO step)", "steps_per_generation x num_iterations", updates),
        ("--steps", "max_steps / that", f"{args.max_steps} / {updates} = {cfg.steps}"),
        ("--max-new-tokens", "max_completion_length", args.max_completion_length),
        ("(sampling: temperature 1)", "temperature, top_k, top_p", "1.0, 0 (off), 1.0"),
        ("(sampler: no padding token)", "generation_kwargs", args.generation_kwargs),
        ("--lr, --warmup-steps, --time-limit", "optimizers=(Adam, example's schedule)", cfg.lr),
        ("--clip-epsilon", "epsilon", args.epsilon),
        ("--clip-epsilon-high", "epsilon_high", args.epsilon_high),
        ("--kl-coeff (k3 KL, not IS-weighted)", "beta", args.beta),
        ("", "use_bias_correction_kl", args.use_bias_correction_kl),
        ("--entropy-coeff", "entropy_coef", args.entropy_coef),
        ("(token mean per minibatch)", "loss_type", args.loss_type),
        ("(group std, Bessel)", "scale_rewards", args.scale_rewards),
        ("(GRPOTrainer clip_norm=1.0)", "max_grad_norm", args.max_grad_norm),
        (
            "(float32)",
            "bf16, gradient_checkpointing",
            f"{args.bf16}, {args.gradient_checkpointing}",
        ),
        ("(prompts in the example's order)", "shuffle_dataset", args.shuffle_dataset),
        ("--threads", "torch.set_num_threads", torch.get_num_threads()),
    ]


def print_mapping(cfg, args: GRPOConfig) -> None:
    rows = [(a, b, str(c)) for a, b, c in mapping(cfg, args)]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    print(f"{'examples/llm_grpo.py':<{widths[0]}}  {'TRL GRPOConfig':<{widths[1]}}  value")
    for a, b, c in rows:
        print(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}")


class EveryGRPOStep:
    """The example's learning-rate schedule, stepped once per GRPO step (as the example's
    ``post_steps`` hook does) though HF's ``Trainer`` steps its scheduler after every optimizer
    step: every ``updates`` calls of :meth:`step`."""

    def __init__(self, schedule, updates: int):
        self.schedule, self.updates, self.calls = schedule, updates, 0

    def step(self) -> None:
        self.calls += 1
        if self.calls % self.updates == 0:
            self.schedule.step()

    def get_last_lr(self) -> list[float]:
        return self.schedule.get_last_lr()

    def state_dict(self) -> dict:
        return {"schedule": self.schedule.state_dict(), "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.schedule.load_state_dict(state["schedule"])
        self.calls = state["calls"]


class GRPOStepEnd(TrainerCallback):
    """What the example's trainer hooks do after each GRPO step, on TRL's optimizer steps.

    Every ``updates`` optimizer steps: stop ``clock``; past ``deadline`` stop the training;
    evaluate every ``eval_every`` steps, at ``last`` and when stopping; restart ``clock``.
    """

    def __init__(self, clock: StepClock, updates: int, cfg, deadline: float, evaluate):
        self.clock, self.updates, self.cfg = clock, updates, cfg
        self.deadline, self.evaluate = deadline, evaluate
        self.accuracy: list[tuple[int, float]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.clock.start()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.updates:
            return
        self.clock.stop()
        step = state.global_step // self.updates
        out_of_time = time.perf_counter() > self.deadline
        if out_of_time:
            control.should_training_stop = True
            print(f"time limit {self.cfg.time_limit:.0f} s reached after {step} GRPO steps")
        if out_of_time or step % self.cfg.eval_every == 0 or step == self.cfg.steps:
            self.accuracy.append((step, self.evaluate()))
            elapsed = time.perf_counter() - T0
            print(f"step {step:4d}  greedy accuracy {self.accuracy[-1][1]:.3f}  ({elapsed:.0f} s)")
        self.clock.start()


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    count_work = "--count-work" in argv
    ex = load_example()
    cfg = ex.parse_args([a for a in argv if a != "--count-work"])
    check_mapped(cfg)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # save_pretrained's bar
    task = ex.make_task(cfg)
    model, tokenizer, gen, held_out, eval_accuracy, acc_before, sft_steps = warm_started(
        ex, cfg, task
    )
    print(
        f"warm start: {sft_steps} supervised steps, greedy accuracy {acc_before:.3f} on "
        f"{cfg.eval_prompts} held-out prompts ({time.perf_counter() - T0:.0f} s)"
    )
    out = Path(cfg.out) / f"trl_seed{cfg.seed}"  # the example: <--out>/digit_sum_seed...
    model.save_pretrained(out / "warm_start")  # TRL loads its reference from the policy's path
    model.config._name_or_path = str(out / "warm_start")
    args = trl_config(cfg, tokenizer, out)
    print_mapping(cfg, args)
    updates = args.steps_per_generation * args.num_iterations
    optim = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    schedule = ex.lr_schedule(optim, cfg, deadline=T0 + cfg.time_limit)
    clock = StepClock(optim, cfg.time_limit, count_work)
    step_end = GRPOStepEnd(clock, updates, cfg, T0 + cfg.time_limit, eval_accuracy)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=task_reward_function(ex, tokenizer, task),
        args=args,
        train_dataset=training_prompts(ex, cfg, task, gen, held_out),
        processing_class=tokenizer,
        callbacks=[step_end],
        optimizers=(optim, EveryGRPOStep(schedule, updates)),
    )
    for quiet in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(quiet)
    gc.freeze()  # as the example: the set-up's objects stay out of the collector's scans
    trainer.train()
    clock.report()
    step, acc_after = step_end.accuracy[-1] if step_end.accuracy else (0, acc_before)
    wall_s = time.perf_counter() - T0
    print(f"greedy accuracy {acc_before:.3f} -> {acc_after:.3f} after {step} GRPO steps (TRL)")
    print(f"RESULT acc_before={acc_before:.4f} acc_after={acc_after:.4f} wall_s={wall_s:.1f}")


if __name__ == "__main__":
    main()
