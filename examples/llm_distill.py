"""On-policy distillation against GRPO: a student learns the digit sum from a teacher, on a CPU.

The task (``--task``), model, wrappers and pipeline are ``examples/llm_grpo.py``'s (imported
from it). A teacher is a model that ``examples/llm_grpo.py`` trained (``--teacher <its run
folder>``; without it, this example first trains one with it, for ``--time-limit`` seconds). The
student is a fresh tiny Qwen2 (``--n-layer``, ``--n-embd``: smaller than the teacher if you
like) after the same short supervised warm start only. From that one warm start, three runs of
the same training budget (``--budget`` seconds each, the evaluations left out of the clock), side
by side:

* **GRPO alone**: the task's reward, group-relative advantages, as ``llm_grpo.py``;
* **distillation alone**, no reward read, the teacher scoring the student's own samples
  (``TeacherLogProbs`` on a ``LeanTransformersWrapper`` of the teacher), its own training
  settings with ``--distill-flags`` (default: no KL to the warm start, 8 epochs): by default
  (``--top-k 4``) ``TopKDistillationLoss``, the student's reverse KL over the teacher's 4 most
  likely tokens at each response position and the rest of the vocabulary as one outcome, the
  teacher writing its top tokens beside its log-probs (``TeacherLogProbs(top_k=4)``), neither
  model building its logits; with ``--top-k 0`` the distillation advantage,
  ``Distillation(alpha=0, beta=--beta)``: each response token's advantage is ``-beta`` times the
  student's reverse KL to the teacher on that token (its one-sample estimate), less its group's
  mean at that position (``--baseline``), in GRPO's clipped objective;
* **GRPO with the teacher**: ``Distillation(alpha=1, beta=--both-beta)``: the group's advantage
  plus the teacher's term, per token.

Every ``--eval-every`` steps each run's greedy accuracy on the 500 held-out prompts and its
reverse KL to the teacher there (the exact per-token KL(student || teacher) over the whole
vocabulary, on the student's greedy completions, averaged over their tokens) are measured.
Run (needs the ``llm`` and ``examples`` extras: ``pip install -e ".[llm,examples]"``)::

    .venv/bin/python examples/llm_grpo.py --out runs/teacher      # a teacher: about 3 minutes
    .venv/bin/python examples/llm_distill.py --teacher runs/teacher/<run>    # about 4 minutes
    .venv/bin/python examples/llm_distill.py          # trains the teacher first: about 7 minutes
    .venv/bin/python examples/llm_distill.py --help   # every setting

It saves ``llm_distill.png`` (accuracy and KL against training time, the three runs) and the
curves (``curves.json``) in a new folder under ``--out``, and ends with one line::

    RESULT acc_grpo=<float> acc_distill=<float> acc_both=<float> t_distill_to_grpo=<float>
    budget_s=<float> wall_s=<float> kl_start=<float> kl_end=<float>

(on one line): the three runs' final accuracies, the training time the distillation run took to
reach GRPO's final accuracy (``inf``: it did not), each run's budget, the whole process's wall
time, and the distillation run's held-out reverse KL before and after.
"""

# ruff: noqa: E402  (the clock starts before the imports: wall_s covers the whole run)
import time

T0 = time.perf_counter()

import argparse
import contextlib
import copy
import dataclasses
import json
import shlex
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from torch.utils.data import DataLoader
from torchrl.collectors.llm import LLMCollector
from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement
from torchrl.envs import Compose, ExcludeTransform, InitTracker
from tqdm import tqdm
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llm_grpo  # the single-turn example: task, tokenizer, model, wrappers, warm start

from torchrl_grpo import MCAdvantage, TopKDistillationLoss
from torchrl_grpo.llm import TeacherLogProbs
from torchrl_grpo.mcadvantage import Distillation

RUN_NAMES = ("grpo", "distill", "both")
BASELINES = ["none", "group", "position"]  # --baseline's choices; none: baseline=False


@dataclass
class Settings(llm_grpo.Settings):
    """Every setting; each is a command-line flag. ``llm_grpo.py``'s settings shape the student
    and its training (``--lr``, ``--group-size``...), the same in the three runs."""

    out: str = field(
        default="runs/llm_distill",
        metadata={"help": "each run writes its curves and plot in a new folder here"},
    )
    teacher: str = field(
        default="",
        metadata={
            "help": "the teacher: a run folder of examples/llm_grpo.py (its model/ and "
            "tokenizer/), or a model folder with tokenizer/ beside it; empty: train one first "
            "with examples/llm_grpo.py for --time-limit seconds (saved under --out/teacher)"
        },
    )
    time_limit: float = field(
        default=190.0,
        metadata={"help": "without --teacher: the teacher's training budget (llm_grpo.py's)"},
    )
    teacher_flags: str = field(
        default="",
        metadata={
            "help": "without --teacher: more flags for examples/llm_grpo.py, as one string "
            "('--n-layer 4 --steps 300'); --seed, --task, --digits, --eval-prompts, --threads and "
            "--device are passed on"
        },
    )
    budget: float = field(
        default=60.0,
        metadata={
            "help": "seconds of training of each of the three runs (collection, scoring, "
            "optimization; the held-out evaluations are not counted); the learning-rate "
            "schedule ends there"
        },
    )
    steps: int = field(
        default=1000,
        metadata={"help": "at most this many steps per run (the budget usually ends it first)"},
    )
    eval_every: int = field(
        default=2,
        metadata={
            "help": "steps between two held-out evaluations of a run (t_distill_to_grpo is "
            "read at them: a step is about 1/40 of the default budget)"
        },
    )
    beta: float = field(
        default=1.0,
        metadata={
            "help": "distillation alone: the reverse KL's weight (the advantage's beta with "
            "alpha=0, or TopKDistillationLoss's coeff)"
        },
    )
    both_beta: float = field(
        default=1.0, metadata={"help": "GRPO with the teacher: the reverse KL's weight (alpha=1)"}
    )
    gamma: float = field(
        default=0.0,
        metadata={"help": "discount of the future reverse KL (Tinker's kl_discount_factor)"},
    )
    baseline: str = field(
        default="position",
        metadata={
            "choices": BASELINES,
            "help": "runs with the teacher: each token's reverse KL less its group's mean at "
            "its position in the response (Distillation(baseline='position')), over all the "
            "group's response tokens (group), or not centred (none: the peers' form)",
        },
    )
    epochs: int = field(
        default=4,
        metadata={
            "help": "passes over each step's data, the three runs (llm_grpo.py's default is 2; "
            "4 gave GRPO alone and distillation both more in the same budget here)"
        },
    )
    top_k: int = field(
        default=4,
        metadata={
            "help": "distillation alone: train on the student's reverse KL over the teacher's "
            "K most likely tokens at each response position (TopKDistillationLoss; the teacher "
            "scores them, TeacherLogProbs(top_k=K)); 0: on the distillation advantage "
            "(Distillation(alpha=0, beta=--beta), GRPO's clipped objective)"
        },
    )
    distill_flags: str = field(
        default="--kl-coeff 0 --epochs 8",
        metadata={
            "help": "the distillation-alone run's own training settings, as examples/"
            "llm_grpo.py flags in one string (the default: no KL to the warm start, the teacher "
            "is the anchor, and eight passes over each batch, which the top-k loss turns into "
            "speed; another: '--lr 1e-3 --group-size 4 --prompts-per-step 32'); only how it "
            "trains (RUN_FLAGS), the other two runs keep the flags given"
        },
    )


class Run(NamedTuple):
    """One of the three runs: its name, its label, its distillation (``None``: GRPO) and its
    settings (``--distill-flags`` applied for the distillation-alone run)."""

    name: str
    label: str
    distillation: Distillation | None
    settings: Settings


def run_objective(run: Run, setup: "Setup"):
    """The run's loss, an ``objective`` of :func:`train`: with ``--top-k K`` the distillation-
    alone run's is :class:`TopKObjective`; ``None`` otherwise (GRPO's clipped objective on the
    advantages the run's buffer writes)."""
    k = run.settings.top_k
    return TopKObjective(setup.tokenizer) if k and run.name == "distill" else None


class TopKObjective:
    """``--top-k K``: :class:`~torchrl_grpo.TopKDistillationLoss` on the student's samples, the
    reverse KL over the teacher's ``K`` most likely tokens at each response position and the
    rest of the vocabulary as one outcome, from the student's hidden states (its
    ``LeanTransformersWrapper``) and the teacher's top tokens, which ``TeacherLogProbs(top_k=K)``
    wrote before the buffer; no advantage read. ``TopKObjective(tokenizer)(model, cfg)`` is an
    ``objective`` of :func:`train`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, model, cfg):
        scorer = llm_grpo.make_scorer(model, self.tokenizer, cfg)
        return TopKDistillationLoss(scorer, coeff=cfg.beta)  # --beta: the reverse KL's weight


def baseline_option(choice: str) -> bool | str:
    """``Distillation``'s ``baseline`` for a choice of :data:`BASELINES` (``"none"``: ``False``)."""
    return False if choice == "none" else choice


def three_runs(cfg: Settings) -> list[Run]:
    """The three runs; ``--distill-flags`` is read (and a flag it may not set refused) here, and
    a negative ``--top-k``."""
    if cfg.top_k < 0:
        raise SystemExit(
            f"--top-k must be 0 (the advantage) or a number of tokens, not {cfg.top_k}"
        )
    centred = {"baseline": baseline_option(cfg.baseline)}
    alone = Distillation(0.0, cfg.beta, cfg.gamma, **centred)
    both = Distillation(1.0, cfg.both_beta, cfg.gamma, **centred)
    return [
        Run("grpo", "GRPO alone", None, cfg),
        Run("distill", "distillation alone", alone, with_flags(cfg, cfg.distill_flags)),
        Run("both", "GRPO with the teacher", both, cfg),
    ]


#: What ``--distill-flags`` may set apart from the other runs: how a run trains, not the
#: student, the task, the teacher or the budget, which the comparison holds equal.
RUN_FLAGS = (
    "prompts_per_step",
    "group_size",
    "epochs",
    "minibatch",
    "lr",
    "warmup_steps",
    "clip_epsilon",
    "clip_epsilon_high",
    "kl_coeff",
    "entropy_coeff",
    "eval_every",
)


def with_flags(cfg: Settings, flags: str) -> Settings:
    """``cfg`` with ``flags`` applied: ``examples/llm_grpo.py`` flags of :data:`RUN_FLAGS`, in
    one string; another flag, a value of the wrong type or a group smaller than 2 is refused
    (``SystemExit``, naming it)."""
    parser = argparse.ArgumentParser(
        prog="--distill-flags", add_help=False, allow_abbrev=False, exit_on_error=False
    )
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for name in RUN_FLAGS:
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=type(defaults[name]), default=argparse.SUPPRESS)
    try:
        given, rest = parser.parse_known_args(shlex.split(flags))
    except argparse.ArgumentError as error:
        raise SystemExit(f"--distill-flags: {error}") from None
    if rest:
        allowed = " ".join("--" + name.replace("_", "-") for name in RUN_FLAGS)
        raise SystemExit(
            f"--distill-flags: {' '.join(rest)} is not one of the settings a run may set apart "
            f"(the student, task, teacher and budget are the three runs'): {allowed}"
        )
    settings = dataclasses.replace(cfg, **vars(given))
    if settings.group_size < 2 or settings.epochs < 1 or settings.minibatch < 1:
        raise SystemExit(
            "--distill-flags: --group-size must be at least 2, --epochs and --minibatch at least 1"
        )
    return settings


# --------------------------------------------------------------------------------------------
# The teacher, and the student's distance to it
# --------------------------------------------------------------------------------------------


def teacher_folder(cfg: Settings) -> Path:
    """``--teacher``'s model folder, or one trained here by ``examples/llm_grpo.py``'s ``main``
    (its output and progress bar in ``teacher.log`` beside it)."""
    if cfg.teacher:
        folder = Path(cfg.teacher)
        return folder / "model" if (folder / "model").is_dir() else folder
    out = Path(cfg.out) / "teacher"
    out.mkdir(parents=True, exist_ok=True)
    argv = ["--seed", str(cfg.seed), "--task", cfg.task, "--digits", str(cfg.digits)]
    argv += ["--out", str(out)]
    argv += ["--eval-prompts", str(cfg.eval_prompts), "--threads", str(cfg.threads)]
    argv += [
        "--device",
        cfg.device,
        "--time-limit",
        str(cfg.time_limit),
        *cfg.teacher_flags.split(),
    ]
    print(f"training the teacher: examples/llm_grpo.py {' '.join(argv)}", flush=True)
    with open(out / "teacher.log", "w") as log:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            result = llm_grpo.main(argv)
    print(
        f"teacher: greedy accuracy {result['acc_before']:.3f} -> {result['acc_after']:.3f} in "
        f"{result['wall_s']:.0f} s; saved in {result['run_dir']}",
        flush=True,
    )
    return Path(result["run_dir"]) / "model"


def load_teacher(cfg: Settings, task: llm_grpo.Task, tokenizer, top_k: int = 0):
    """The teacher's model and its scorer of the student's tokens, ``TeacherLogProbs``, which
    refuses a teacher whose tokenizer is not the student's (both named); with ``top_k`` it
    writes the teacher's ``top_k`` most likely tokens too (``--top-k``)."""
    folder = teacher_folder(cfg)
    model, teacher_tokenizer = llm_grpo.from_folder(
        dataclasses.replace(cfg, model=str(folder), tokenizer=""), task
    )
    model = suppress_padding(model.eval().requires_grad_(False), tokenizer).to(cfg.device)
    # the teacher's log-probs of the student's tokens, on the response (the prompt's are 0)
    wrapper = llm_grpo.make_scorer(
        model, teacher_tokenizer, cfg, "teacher_log_probs", response_only=True
    )
    return model, TeacherLogProbs(wrapper, tokenizer=tokenizer, top_k=top_k or None)


#: The padding's logit offset: ``exp(-30)`` is 1e-13 of a token's mass, far below any other.
PAD_LOGIT = -30.0


def suppress_padding(model, tokenizer):
    """Give the padding token no mass in the model's own softmax (a fixed logit offset, not
    trained), so that the distribution the loss and the teacher's term read is the one sampled.

    The samplers never emit padding (``bad_words_ids``: the wrapper would strip it), but the
    scoring softmax still gives it mass. A teacher's term that pushes sampled tokens down then
    moves their mass onto the one token no sample can penalise: on seed 0, 14 distillation steps
    took the padding's share of the response positions from 0.01 to 0.14, and after 16 the
    sampled reverse KL had fallen (1.77 to 1.13) while the exact one rose (1.80 to 2.10; 2.23 held
    out). With the offset in the head, what is sampled is what is scored, for the three runs and
    the teacher (docs/tutorial_distill.rst, "Results on this CPU").
    """
    head = model.get_output_embeddings()
    bias = torch.zeros(head.out_features, dtype=head.weight.dtype, device=head.weight.device)
    bias[tokenizer.pad_token_id] = PAD_LOGIT
    head.bias = torch.nn.Parameter(bias, requires_grad=False)
    return model


def reverse_kl(student, teacher, tokens: torch.Tensor, response: torch.Tensor) -> float:
    """Mean over the response tokens of KL(student || teacher), exact over the vocabulary.

    ``tokens`` ``(B, T)``: prompts and completions, right-padded; ``response`` ``(B, T)``: the
    positions of the completions' real tokens. Token ``t``'s distributions are the models'
    outputs at ``t - 1``.
    """
    with torch.no_grad():
        return float(exact_reverse_kl(student, teacher, tokens, response))


def exact_reverse_kl(student, teacher, tokens: torch.Tensor, response: torch.Tensor):
    """:func:`reverse_kl` as a 0-d tensor, differentiable in the student's weights (the
    teacher's log-probs are read without gradient)."""
    logp, logq = _log_softmaxes(student, teacher, tokens)
    kl = (logp.exp() * (logp - logq)).sum(-1)  # (B, T-1): at the position predicting t + 1
    return kl[response[:, 1:]].mean()


def _log_softmaxes(student, teacher, tokens: torch.Tensor):
    """The student's (with its gradient) and the teacher's log-softmax at every position but the
    last, ``(B, T-1, V)`` each: position ``t`` predicts token ``t + 1``."""
    logp = student(tokens).logits.log_softmax(-1)[:, :-1]
    with torch.no_grad():
        return logp, teacher(tokens).logits.log_softmax(-1)[:, :-1]


def few_tokens_reverse_kl(
    student, teacher, tokens: torch.Tensor, response: torch.Tensor, teacher_k: int, student_k: int
):
    """:func:`exact_reverse_kl` over a few tokens per position: the teacher's ``teacher_k`` most
    likely and the student's ``student_k`` (chosen without gradient), the rest of the vocabulary
    as one more outcome (a KL over at most ``teacher_k + student_k + 1`` outcomes, a lower
    bound of the full one; without that outcome the student would lower the sum by moving its
    mass off the chosen tokens). Only the teacher's log-probs of the chosen tokens are read."""
    logp, logq = _log_softmaxes(student, teacher, tokens)  # (B, T-1, V)
    with torch.no_grad():
        chosen = torch.zeros_like(logp, dtype=torch.bool)
        chosen.scatter_(-1, logq.topk(teacher_k, -1).indices, True)
        chosen.scatter_(-1, logp.topk(student_k, -1).indices, True)
        rest_q = (1 - torch.where(chosen, logq.exp(), 0).sum(-1)).clamp_min(1e-12)
    p = logp.exp()
    kl = torch.where(chosen, p * (logp - logq), 0).sum(-1)  # (B, T-1)
    rest_p = (1 - torch.where(chosen, p, 0).sum(-1)).clamp_min(1e-12)
    kl = kl + rest_p * (rest_p.log() - rest_q.log())
    return kl[response[:, 1:]].mean()


class ExactReverseKL:
    """A loss on the student's own batches without the estimator's sampling noise: the exact
    per-position reverse KL to the teacher (:func:`exact_reverse_kl`, over the vocabulary) on
    each completion's response tokens, the zero-noise limit of the distillation advantage with
    ``gamma = 0`` (``benchmarks/llm_distill_exact.py``). It needs the teacher's logits, which the
    lean path never builds, so it is a yardstick here, not a method for LLM vocabularies.

    ``top=(teacher_k, student_k)``: over those few tokens per position and the rest as one
    outcome (:func:`few_tokens_reverse_kl`): what a teacher scoring a few tokens per position
    instead of the sampled one would give.

    ``ExactReverseKL(teacher)(model, cfg)`` is an ``objective`` of :func:`train`.
    """

    def __init__(self, teacher, top: tuple[int, int] | None = None):
        self.teacher, self.top = teacher, top

    def __call__(self, model, cfg):
        return lambda batch: _Total(self.loss(model, batch))

    def loss(self, model, batch):
        """The batch's exact reverse KL, a 0-d tensor with the student's gradient."""
        tokens, response = batch["tokens", "full"], response_mask(batch)
        if self.top is None:
            return exact_reverse_kl(model, self.teacher, tokens, response)
        return few_tokens_reverse_kl(model, self.teacher, tokens, response, *self.top)


def response_mask(batch) -> torch.Tensor:
    """``(B, T)``: where a collected batch's completions' real tokens are (after the prompt,
    not the padding)."""
    response = batch["masks", "all_attention_mask"].clone()
    response[:, : batch["tokens", "prompt"].shape[-1]] = False
    return response


class _Total(NamedTuple):
    """A loss's value as :func:`train` reads it: ``total_loss()``."""

    value: torch.Tensor

    def total_loss(self) -> torch.Tensor:
        return self.value


class HeldOut:
    """Greedy accuracy and reverse KL to the teacher of a model on the held-out prompts.

    The env (``llm_grpo.GreedyAccuracy``'s) is reset once; each call samples greedily from the
    model, scores the completions with the task's reward, and the teacher and the model read
    the same tokens (:func:`reverse_kl`).
    """

    def __init__(self, tokenizer, task, problems, teacher, cfg: Settings):
        self.accuracy = llm_grpo.GreedyAccuracy(tokenizer, task, problems, policy=None)
        self.tokenizer, self.teacher, self.cfg = tokenizer, teacher, cfg

    @torch.no_grad()
    def __call__(self, model) -> tuple[float, float]:
        greedy = llm_grpo.make_sampler(model, self.tokenizer, self.cfg, greedy=True)
        out = self.accuracy.env.step(greedy(self.accuracy.prompts.clone()))
        acc = out["next", "reward"].mean().item()
        prompts = out.get(("tokens", "prompt"), as_list=True)
        completions = out.get(("tokens", "response"), as_list=True)
        tokens, response = self.sequences(prompts, completions)
        return acc, reverse_kl(model, self.teacher, tokens, response)

    def sequences(self, prompts, completions) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt and completion up to its end-of-sequence, right-padded; where the completion
        is."""
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        rows, spans = [], []
        for prompt, completion in zip(prompts, completions, strict=True):
            ends = (completion == eos).nonzero()
            real = completion[: int(ends[0]) + 1] if len(ends) else completion[completion != pad]
            rows.append(torch.cat([prompt, real]))
            spans.append((len(prompt), len(prompt) + len(real)))
        width = max(len(r) for r in rows)
        tokens = torch.full((len(rows), width), pad, dtype=torch.long)
        response = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, (row, (a, b)) in enumerate(zip(rows, spans, strict=True)):
            tokens[i, : len(row)] = row
            response[i, a:b] = True
        return tokens.to(self.cfg.device), response.to(self.cfg.device)


# --------------------------------------------------------------------------------------------
# One run: llm_grpo.py's pipeline, the teacher scored where the reference is
# --------------------------------------------------------------------------------------------


def make_collector(cfg, task, model, ref_model, tokenizer, gen, exclude, teacher, run: Run):
    """``llm_grpo.make_collector`` with the teacher: ``TeacherLogProbs`` after the sampling
    policy's and the reference's ``RetrieveLogProb`` (:func:`llm_grpo.log_prob_scorers`: no
    reference at ``--kl-coeff 0``, the distillation-alone run's default), and
    ``MCAdvantage(estimator=Distillation(...))`` writing each response token's advantage on
    insertion (distillation alone: no reward read, ``rewards_key=None``)."""
    rows = cfg.prompts_per_step * cfg.group_size
    loader = DataLoader(
        llm_grpo.Problems(task, gen, cfg.prompts_per_step, exclude),
        batch_size=None,
        collate_fn=lambda td: td,
    )
    env = llm_grpo.make_env(tokenizer, task, loader, batch=rows, repeats=cfg.group_size)
    env.append_transform(InitTracker())
    rb = ReplayBuffer(
        storage=LazyStackStorage(rows), sampler=SamplerWithoutReplacement(), batch_size=rows
    )
    rb.append_transform(llm_grpo.Contiguous())
    rb.append_transform(ExcludeTransform("query", inverse=True))
    pure = run.distillation is not None and run.distillation.alpha == 0.0
    rewards = {"rewards_key": None} if pure else {}
    rb.append_transform(
        MCAdvantage(
            grpo_size=cfg.group_size,
            prompt_key="query",
            trajectory_return=None if pure else "sum",
            estimator=run.distillation,
            **rewards,
        )
    )
    unread = ("answer", "step_count", "terminated", "truncated", "is_init")
    score = Compose(
        llm_grpo.Contiguous(),
        ExcludeTransform(*unread, *[("next", key) for key in (*unread, "query", "tokens")]),
        *llm_grpo.log_prob_scorers(cfg, model, ref_model, tokenizer),  # pi_old; ref if weighed
    )
    if run.distillation is not None:
        score.append(teacher)  # ("next", "teacher_log_probs", "full"), before the buffer
    collector = LLMCollector(
        env,
        policy=llm_grpo.make_sampler(model, tokenizer, cfg),
        dialog_turns_per_batch=rows,
        total_dialog_turns=cfg.steps * rows,
        replay_buffer=rb,
        postproc=torch.no_grad()(score),
    )
    return collector, rb


class Stopwatch:
    """Training time: runs from ``start()``, stopped inside ``paused()`` (the evaluations)."""

    def __init__(self):
        self.spent, self.since = 0.0, None

    def start(self):
        self.since = time.perf_counter()

    def __call__(self) -> float:
        running = time.perf_counter() - self.since if self.since is not None else 0.0
        return self.spent + running

    @contextmanager
    def paused(self):
        self.spent, self.since = self(), None
        try:
            yield
        finally:
            self.start()


def train(run: Run, setup: "Setup", objective=None):
    """One run from the warm-started weights of ``setup``, for ``--budget`` seconds of training,
    with the run's settings (``run.settings``).

    ``objective(model, settings)``: the loss the run minimizes on each minibatch (its output's
    ``total_loss()``); by default GRPO's clipped objective (:func:`llm_grpo.make_loss`) on the
    advantages the run's buffer writes. Returns its curves: training time, step, greedy accuracy
    and reverse KL at each evaluation, and the advantage's shape in the last batch.
    """
    cfg = run.settings
    task, tokenizer, teacher, held_out = setup.task, setup.tokenizer, setup.teacher, setup.held_out
    student, evaluate = setup.weights, setup.evaluate
    torch.manual_seed(cfg.seed)  # the same sampling noise and prompts in each run
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    model = llm_grpo.make_model(cfg, tokenizer, task.prompt_length + cfg.max_new_tokens)
    model = suppress_padding(model, tokenizer)
    model.load_state_dict(student)
    model = model.to(cfg.device)
    ref_model = copy.deepcopy(model).requires_grad_(False) if cfg.kl_coeff else None
    collector, rb = make_collector(
        cfg, task, model, ref_model, tokenizer, gen, held_out, teacher, run
    )
    if objective is None:
        loss_fn = llm_grpo.make_loss(llm_grpo.make_scorer(model, tokenizer, cfg), cfg)
    else:
        loss_fn = objective(model, cfg)
    optim = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    clock = Stopwatch()
    schedule = llm_grpo.lr_schedule(optim, cfg, deadline=cfg.budget, clock=clock)
    acc, kl = evaluate(model)
    curves = {"time": [0.0], "step": [0], "accuracy": [acc], "kl": [kl], "reward": []}
    step = 0
    clock.start()
    for _ in collector:  # each batch: prompts_per_step groups, scored, into rb through MCAdvantage
        if len(rb) == 0:
            continue
        step += 1
        batch = rb[:]
        rb.empty()
        for _epoch in range(cfg.epochs):
            for rows in torch.randperm(len(batch)).split(cfg.minibatch):
                out = loss_fn(batch[rows])
                optim.zero_grad()
                out.total_loss().backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optim.step()
        schedule.step()
        curves["reward"].append(float(batch["next", "reward"].mean()))
        done = clock() >= cfg.budget or step >= cfg.steps
        if step % cfg.eval_every == 0 or done:
            with clock.paused():
                acc, kl = evaluate(model)
                curves["time"].append(clock())
                curves["step"].append(step)
                curves["accuracy"].append(acc)
                curves["kl"].append(kl)
                tqdm.write(
                    f"{run.label:>22}: step {step:4d}  {clock():5.1f} s  greedy accuracy "
                    f"{acc:.3f}  reverse KL {kl:.4f}"
                )
        if done:
            break
    collector.shutdown()
    curves["advantage_shape"] = list(batch["advantage"].shape)
    curves["tokens_shape"] = list(batch["tokens", "full"].shape)
    return curves


# --------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------


def time_to_reach(curves: dict, target: float) -> float:
    """The first evaluation's training time where the accuracy is at least ``target``."""
    for t, acc in zip(curves["time"], curves["accuracy"], strict=True):
        if acc >= target:
            return t
    return float("inf")


def plot(results: dict, runs: list[Run], teacher_acc: float, path: Path, title: str) -> None:
    """Accuracy and reverse KL to the teacher against training time, the three runs."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 6.4), dpi=100, sharex=True)
    colors = {"grpo": "tab:blue", "distill": "tab:red", "both": "tab:purple"}
    for run in runs:
        c = results[run.name]
        top.plot(c["time"], c["accuracy"], "o-", ms=3, color=colors[run.name], label=run.label)
        bottom.plot(c["time"], c["kl"], "o-", ms=3, color=colors[run.name], label=run.label)
    top.axhline(teacher_acc, color="gray", ls="--", lw=1, label="the teacher")
    top.set_ylabel("greedy accuracy, held-out")
    top.set_ylim(0, 1)
    bottom.set_ylabel("reverse KL to the teacher\n(per token, held-out)")
    bottom.set_xlabel("training time of the run (s), evaluations excluded")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    top.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


class Setup(NamedTuple):
    """What the runs share: the task and tokenizer, the teacher (its model and its scorer of the
    student's tokens), the student's warm-started weights, the held-out prompts and their
    evaluation, and the teacher's and the student's standing before any run."""

    task: llm_grpo.Task
    tokenizer: object
    teacher_model: torch.nn.Module
    teacher: TeacherLogProbs
    weights: dict
    held_out: set
    evaluate: HeldOut
    teacher_acc: float
    acc_start: float
    kl_start: float


def prepare(cfg: Settings, start: float) -> Setup:
    """The teacher (refused before any training if its tokenizer is not the student's), then the
    student's warm start; ``start`` is the clock the printed time counts from."""
    task = llm_grpo.make_task(cfg)
    torch.set_num_threads(cfg.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tokenizer = llm_grpo.make_tokenizer(task.alphabet)
    teacher_model, teacher = load_teacher(cfg, task, tokenizer, cfg.top_k)
    torch.manual_seed(cfg.seed)
    student = llm_grpo.make_model(cfg, tokenizer, task.prompt_length + cfg.max_new_tokens)
    student = suppress_padding(student, tokenizer).to(cfg.device)

    eval_problems = llm_grpo.draw_problems(
        task, torch.Generator().manual_seed(1234), cfg.eval_prompts, set()
    )
    held_out = set(eval_problems["query"])
    train_gen = torch.Generator().manual_seed(cfg.seed)
    val_problems = llm_grpo.draw_problems(task, train_gen, 200, held_out)
    greedy = llm_grpo.make_sampler(student, tokenizer, cfg, greedy=True)
    val_accuracy = llm_grpo.GreedyAccuracy(tokenizer, task, val_problems, greedy)
    evaluate = HeldOut(tokenizer, task, eval_problems, teacher_model, cfg)
    teacher_acc = evaluate(teacher_model)[0]
    sft_steps = llm_grpo.warm_start(
        student, tokenizer, cfg, task, train_gen, held_out, val_accuracy
    )
    acc_start, kl_start = evaluate(student)
    print(
        f"teacher: greedy accuracy {teacher_acc:.3f}; student after {sft_steps} warm-start "
        f"steps: {acc_start:.3f}, reverse KL to the teacher {kl_start:.4f} "
        f"({time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    weights = copy.deepcopy(student.state_dict())
    return Setup(
        task,
        tokenizer,
        teacher_model,
        teacher,
        weights,
        held_out,
        evaluate,
        teacher_acc,
        acc_start,
        kl_start,
    )


def main(argv=None) -> dict:
    """The teacher, the student's warm start, then the three runs; returns the RESULT's fields
    and each run's curves."""
    start = T0 if main.first_call else time.perf_counter()
    main.first_call = False
    cfg = llm_grpo.parse_args(argv, settings_cls=Settings)
    if cfg.dynamic_sampling or cfg.group_minibatches:  # not read by this example's pipeline
        raise SystemExit("--dynamic-sampling and --group-minibatches: examples/llm_grpo.py only")
    runs = three_runs(cfg)  # a bad --distill-flags is refused before any training
    setup = prepare(cfg, start)
    task, teacher_acc = setup.task, setup.teacher_acc
    acc_start, kl_start = setup.acc_start, setup.kl_start
    results = {run.name: train(run, setup, objective=run_objective(run, setup)) for run in runs}

    final = {name: results[name]["accuracy"][-1] for name in RUN_NAMES}
    t_reach = time_to_reach(results["distill"], final["grpo"])
    kl_end = results["distill"]["kl"][-1]
    run_dir = Path(cfg.out) / f"{task.name}_seed{cfg.seed}_{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = {"settings": dataclasses.asdict(cfg), "teacher_acc": teacher_acc}
    summary |= {"acc_start": acc_start, "kl_start": kl_start, "runs": results}
    (run_dir / "curves.json").write_text(json.dumps(summary, indent=1))
    title = f"{task.name.replace('_', ' ').capitalize()}, tiny Qwen2 on {cfg.device}: "
    title += f"{cfg.budget:.0f} s of training per run\ndistillation alone: "
    title += f"top-{cfg.top_k} reverse KL" if cfg.top_k else "the distillation advantage"
    plot(results, runs, teacher_acc, run_dir / "llm_distill.png", title)
    wall_s = time.perf_counter() - start
    for run in runs:
        c = results[run.name]
        print(
            f"{run.label:>22}: greedy accuracy {acc_start:.3f} -> {c['accuracy'][-1]:.3f}, "
            f"reverse KL {kl_start:.4f} -> {c['kl'][-1]:.4f} in {c['step'][-1]} steps"
        )
    print(
        f"distillation reached GRPO's final accuracy after {t_reach:.1f} s of its "
        f"{cfg.budget:.0f} s ({t_reach / cfg.budget:.2f}x); in {run_dir}: llm_distill.png, "
        "curves.json"
    )
    print(
        f"RESULT acc_grpo={final['grpo']:.4f} acc_distill={final['distill']:.4f} "
        f"acc_both={final['both']:.4f} t_distill_to_grpo={t_reach:.1f} budget_s={cfg.budget:.1f} "
        f"wall_s={wall_s:.1f} kl_start={kl_start:.4f} kl_end={kl_end:.4f}"
    )
    return {
        "acc": final,
        "t_distill_to_grpo": t_reach,
        "budget_s": cfg.budget,
        "wall_s": wall_s,
        "kl_start": kl_start,
        "kl_end": kl_end,
        "teacher_acc": teacher_acc,
        "runs": results,
        "run_dir": run_dir,
    }


main.first_call = True  # the first call's clock starts at import (wall_s counts the imports)


if __name__ == "__main__":
    main()
