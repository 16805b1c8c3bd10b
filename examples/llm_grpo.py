"""GRPO makes a tiny language model better at a verifiable task, on a CPU, with torchrl's LLM stack.

The task: read four digits and write their sum (``"3 9 1 4=" -> "17"``); the reward is 1 for the
exact answer followed by the end-of-sequence token, else 0 (``--task running-sum``: every partial
sum, ``"3 9 1 4=" -> "3 12 13 17"``, a longer answer). Everything runs on torchrl's LLM
components, nothing is downloaded:

* a ``transformers`` Qwen2 with a tiny config, created locally, and a character-level
  ``PreTrainedTokenizerFast`` built with the ``tokenizers`` library;
* a ``TransformersWrapper`` that samples ``group_size`` completions per prompt, and
  ``torchrl_grpo.LeanTransformersWrapper`` (``generate=False``, torchrl's wrapper scoring tokens
  from hidden states, without the logits) for the log-probs of the loss, the warm start and the
  reference policy (``--no-lean``: torchrl's ``TransformersWrapper`` for those too);
* the task as a torchrl LLM environment (``DatasetChatEnv`` fed by a ``DataLoader``, repeating
  each prompt ``group_size`` times) whose reward is a torchrl ``Transform``;
* an ``LLMCollector`` writing into a ``ReplayBuffer`` (``LazyStackStorage``) whose
  ``torchrl_grpo.MCAdvantage`` turns rewards into group-relative advantages keyed by the prompt;
  torchrl's ``RetrieveLogProb`` transforms add the sampling policy's and the frozen reference
  policy's log-probs on the way;
* ``GRPOLoss`` on the scoring wrapper, with the KL to the reference in the loss, driven by
  torchrl's ``GRPOTrainer``.

A short supervised warm start makes the policy partly right first (GRPO needs groups whose
completions differ). Run (needs the ``llm`` and ``examples`` extras:
``pip install -e ".[llm,examples]"``)::

    .venv/bin/python examples/llm_grpo.py                      # defaults: about 3 minutes
    .venv/bin/python examples/llm_grpo.py --seed 1 --out runs/llm_grpo/seed1
    .venv/bin/python examples/llm_grpo.py --help               # every setting

It prints the greedy accuracy on 500 held-out prompts after the warm start and during GRPO, logs
every metric with torchrl's ``CSVLogger`` (``--logger``: tensorboard, wandb, none) under
``--out`` (through the trainer), saves
``llm_grpo.png`` and the trained model and tokenizer (``model/``, ``tokenizer/``) there, and
ends with one line::

    RESULT acc_before=<float> acc_after=<float> wall_s=<float>

Another task or model, without editing this file: ``main(task=Task(...))`` and
``main(model_and_tokenizer=...)`` (see ``Task``, ``tiny_qwen2`` and docs/tutorial_llm.rst).
"""

# ruff: noqa: E402  (the clock starts before the imports: wall_s covers the whole run)
import time

T0 = time.perf_counter()

import argparse
import copy
import dataclasses
import gc
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from tensordict import TensorDict, lazy_stack, set_list_to_stack
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as CharLevelTokenizer
from torch.utils.data import DataLoader, IterableDataset
from torchrl.collectors.llm import LLMCollector
from torchrl.data import (
    Composite,
    LazyStackStorage,
    ReplayBuffer,
    SamplerWithoutReplacement,
    Unbounded,
)
from torchrl.envs import Compose, ExcludeTransform, InitTracker, StepCounter, Transform
from torchrl.envs.llm import DatasetChatEnv, RetrieveLogProb
from torchrl.modules.llm import TransformersWrapper
from torchrl.record.loggers import generate_exp_name, get_logger
from torchrl.trainers.algorithms.grpo import GRPOTrainer
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from torchrl_grpo import GroupSampler, GRPOLoss, LeanTransformersWrapper, MCAdvantage, checkpoint
from torchrl_grpo.llm import ragged_prompts
from torchrl_grpo.llm.head import check_vocabulary

set_list_to_stack(True).set()  # torchrl's LLM envs keep lists of strings as stacks


@dataclass
class Settings:
    """Every setting of the run; each is a command-line flag (``--group-size 8``)."""

    seed: int = field(default=0, metadata={"help": "seed of torch and of the training prompts"})
    out: str = field(
        default="runs/llm_grpo",
        metadata={
            "help": "each run writes its metrics, plot and trained model in a new folder here"
        },
    )
    threads: int = field(
        default=1, metadata={"help": "torch threads (1 is fastest on a 2-core machine)"}
    )
    device: str = field(
        default="cpu",
        metadata={"help": "where the model and its wrappers compute (cpu, cuda, ...)"},
    )
    lean: bool = field(
        default=True,
        metadata={
            "help": "score with LeanTransformersWrapper (log-probs without the logits); "
            "--no-lean: torchrl's TransformersWrapper"
        },
    )
    group_minibatches: bool = field(
        default=False,
        metadata={
            "help": "minibatches of whole groups (GroupSampler: a prompt's completions together, "
            "so that a shared prompt is computed once); off by default here: the digit prompts "
            "are too short to share, and 64 completions of 64 prompts per minibatch learned "
            "more than 8 of 8 (the tutorial); the multi-turn example turns it on"
        },
    )
    logger: str = field(
        default="csv",
        metadata={
            "choices": ["csv", "tensorboard", "wandb", "none"],
            "help": "torchrl logger of the metrics; tensorboard and wandb need their extras: "
            "pip install -e '.[tensorboard]'",
        },
    )
    model: str = field(
        default="",
        metadata={
            "help": "start from this saved model folder (a run's model/, or any Hugging Face "
            "causal LM folder) instead of a new tiny Qwen2; its tokenizer from --tokenizer"
        },
    )
    tokenizer: str = field(
        default="",
        metadata={
            "help": "the tokenizer folder of --model (default: a tokenizer/ folder beside it, as "
            "runs save it, else the model folder itself)"
        },
    )
    eval_only: bool = field(
        default=False,
        metadata={"help": "evaluate the model (greedy, held-out prompts), print RESULT, stop"},
    )
    resume: str = field(
        default="",
        metadata={
            "help": "continue the run saved in this run folder (its checkpoint/, written when "
            "a run stops): the policy and reference, optimizer, schedule and its progress, "
            "loss, buffer, prompt stream, random state, curves and logger step; --steps and "
            "--time-limit count what ran before (raise them to train on)"
        },
    )
    checkpoint_every: int = field(
        default=0,
        metadata={
            "help": "also save checkpoint/ every this many GRPO steps, so that a killed run "
            "resumes from the last one (0: only when the run stops); each save replaces the "
            "last in one swap, never leaving a torn one"
        },
    )
    stop_at_step: int = field(
        default=0,
        metadata={
            "help": "stop after this GRPO step, its checkpoint saved, while the schedule still "
            "spans --steps: --resume goes on along the same curve (0: run to --steps)"
        },
    )
    lora_rank: int = field(
        default=0,
        metadata={
            "help": "train LoRA adapters of this rank (peft, every linear layer but the output "
            "one) instead of every weight, after the warm start; with the lean wrapper the "
            "reference is the same model with its adapters disabled (no copy). 0: every weight"
        },
    )
    min_shared_length: int = field(
        default=32,
        metadata={
            "help": "the lean wrapper's min_shared_length: a token prefix that rows share (a "
            "prompt's completions) is computed once from this length on (the digit prompts are "
            "shorter than the default 32)"
        },
    )
    task: str = field(
        default="digit-sum",
        metadata={
            "help": "the task: digit-sum (the answer is the digits' sum, two or three tokens) "
            "or running-sum (every partial sum, up to 10 tokens: running_sum_task)",
            "choices": ("digit-sum", "running-sum"),  # TASKS' names
        },
    )
    digits: int = field(
        default=4, metadata={"help": "digits per prompt (the answer is their sum, or sums)"}
    )
    eval_prompts: int = field(
        default=500,
        metadata={"help": "held-out prompts of the greedy accuracy (fixed, never trained on)"},
    )
    n_layer: int = field(default=2, metadata={"help": "tiny Qwen2: decoder layers"})
    n_embd: int = field(default=64, metadata={"help": "tiny Qwen2: hidden size"})
    n_head: int = field(default=4, metadata={"help": "tiny Qwen2: attention heads"})
    sft_lr: float = field(default=1e-3, metadata={"help": "warm start: AdamW learning rate"})
    sft_batch: int = field(default=64, metadata={"help": "warm start: prompts per step"})
    sft_target: float = field(
        default=0.30,
        metadata={
            "help": "warm start: stop when the greedy accuracy on validation prompts "
            "reaches this (GRPO needs groups whose completions differ)"
        },
    )
    sft_max_steps: int = field(
        default=3000, metadata={"help": "warm start: at most this many steps"}
    )
    sft_check_every: int = field(
        default=2,
        metadata={"help": "warm start: steps between two checks (the tiny model moves fast)"},
    )
    steps: int = field(
        default=150,
        metadata={"help": "GRPO steps (each: collect, score, extend the buffer, optimize)"},
    )
    prompts_per_step: int = field(default=64, metadata={"help": "fresh prompts per GRPO step"})
    group_size: int = field(default=8, metadata={"help": "G: completions per prompt"})
    max_new_tokens: int | None = field(
        default=None,
        metadata={
            "type": int,
            "help": "tokens a completion may take (default: the task's longest answer and "
            "end-of-sequence)",
        },
    )
    epochs: int = field(default=2, metadata={"help": "passes over each GRPO step's data"})
    minibatch: int = field(default=64, metadata={"help": "completions per optimizer step"})
    lr: float = field(
        default=5e-4,
        metadata={
            "help": "Adam learning rate: linear warm-up, then cosine decay to 0 at --steps "
            "or at --time-limit, whichever comes first (both shrink together)"
        },
    )
    warmup_steps: int = field(
        default=10,
        metadata={
            "help": "warm-up length in GRPO steps (a shorter share when --time-limit "
            "allows fewer steps)"
        },
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata={"help": "drop groups whose completions all score the same (DAPO)"},
    )
    clip_epsilon: float = field(
        default=0.2,
        metadata={"help": "the ratio is clipped to [1 - this, 1 + --clip-epsilon-high]"},
    )
    clip_epsilon_high: float = field(
        default=0.28, metadata={"help": "DAPO's clip-higher: rare right answers can gain faster"}
    )
    kl_coeff: float = field(
        default=0.02,
        metadata={"help": "beta of the KL to the reference (0: no reference is kept or scored)"},
    )
    entropy_coeff: float = field(default=0.0, metadata={"help": "entropy bonus"})
    eval_every: int = field(default=10, metadata={"help": "GRPO steps between two evaluations"})
    time_limit: float = field(
        default=190.0,
        metadata={
            "help": "stop GRPO once the run (imports included) has taken this long, in "
            "seconds; the learning-rate schedule ends there too. A resumed run counts the "
            "seconds of GRPO before its checkpoint (not its own start-up)"
        },
    )


def parse_args(
    argv=None,
    task: "Task | None" = None,
    settings_cls: type = Settings,
    checkpoints: bool | None = None,
) -> Settings:
    """The settings of the run; ``--help`` documents each, with its default.

    ``--max-new-tokens`` defaults to what ``task`` needs (by default the digit sum's, for
    ``--digits``): its longest answer and end-of-sequence. ``settings_cls``: ``Settings`` or a
    dataclass extending it (another example's settings, each field a flag); ``checkpoints``:
    whether the example saves checkpoints and resumes (default: ``settings_cls is Settings``).
    """
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(settings_cls):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            action = argparse.BooleanOptionalAction
            parser.add_argument(flag, action=action, default=f.default, help=f.metadata["help"])
        else:
            kind = f.metadata.get("type", type(f.default))
            choices = f.metadata.get("choices")
            parser.add_argument(
                flag, type=kind, default=f.default, choices=choices, help=f.metadata["help"]
            )
    cfg = settings_cls(**vars(parser.parse_args(argv)))
    if cfg.steps < 1 or cfg.group_size < 2:
        parser.error("--steps must be at least 1 and --group-size at least 2")
    if cfg.lora_rank < 0:
        parser.error("--lora-rank: a positive rank (0: every weight trains)")
    single_turn = (cfg.lora_rank, cfg.model, cfg.tokenizer, cfg.eval_only, cfg.logger != "csv")
    if settings_cls is not Settings and any(single_turn):
        parser.error(
            "--lora-rank, --model, --tokenizer, --eval-only and --logger: "
            "examples/llm_grpo.py only (this example logs to CSV)"
        )
    checkpoints = settings_cls is Settings if checkpoints is None else checkpoints
    if not checkpoints and any((cfg.resume, cfg.checkpoint_every, cfg.stop_at_step)):
        parser.error(
            "--resume, --checkpoint-every and --stop-at-step: examples/llm_grpo.py and "
            "llm_grpo_async.py only"
        )
    if cfg.checkpoint_every < 0 or cfg.stop_at_step < 0:
        parser.error("--checkpoint-every and --stop-at-step: 0 (off) or a number of steps")
    if cfg.max_new_tokens is None:
        task = task or make_task(cfg)
        cfg.max_new_tokens = task.answer_length + 1
    return cfg


# --------------------------------------------------------------------------------------------
# The task: digits in, their sum out; a programmatic reward
# --------------------------------------------------------------------------------------------

EOS, PAD = "<eos>", "<pad>"


@dataclass(frozen=True)
class Task:
    """A verifiable task: random problems with their answers, and a reward.

    ``main(task=...)`` trains on any such task; :func:`digit_sum_task` builds the default one.

    Attributes:
        name: names the run's folder.
        alphabet: every character of the prompts and answers (the default tokenizer has one
            token per character, plus end-of-sequence and padding).
        prompt_length: characters of the longest prompt.
        answer_length: characters of the longest right answer (a completion may take this many
            tokens and end-of-sequence, unless ``--max-new-tokens`` says otherwise).
        draw: ``draw(gen, n)``: ``n`` random problems under the generator ``gen``, as a list of
            ``(prompt, answer)`` strings. Training never sees the ``--eval-prompts`` held-out
            prompts, so the task needs many more distinct prompts than that (drawing stops with
            a ``ValueError`` when it finds none outside them).
        reward: ``reward(completion, answer)``: the score of a completion, the decoded response
            up to its first end-of-sequence token, followed by ``EOS`` if it has one.
        metric: what the mean greedy reward on the held-out prompts is called in the output
            and the plot: ``"mean reward"`` unless the task names it (the digit sum's reward
            is 1 for the exact answer, 0 otherwise: its mean is the ``"accuracy"``). The
            ``RESULT`` line's ``acc_before`` / ``acc_after`` are this number.
    """

    name: str
    alphabet: str
    prompt_length: int
    answer_length: int
    draw: Callable[[torch.Generator, int], list[tuple[str, str]]]
    reward: Callable[[str, str], float]
    metric: str = "mean reward"


def digit_sum_task(digits: int = 4) -> Task:
    """Read ``digits`` digits and write their sum: ``"3 9 1 4=" -> "17"``; reward 1 for exactly
    the sum followed by end-of-sequence, else 0."""

    def draw(gen: torch.Generator, n: int) -> list[tuple[str, str]]:
        rows = torch.randint(0, 10, (n, digits), generator=gen).tolist()
        return [(prompt_text(row), str(sum(row))) for row in rows]

    return Task(
        name="digit_sum",
        alphabet="0123456789 =",
        prompt_length=2 * digits,
        answer_length=len(str(9 * digits)),
        draw=draw,
        reward=reward,
        metric="accuracy",  # the reward is 1 for the exact sum, else 0
    )


def running_sum_task(digits: int = 4) -> Task:
    """Read ``digits`` digits and write each partial sum: ``"3 9 1 4=" -> "3 12 13 17"``; reward
    1 for exactly those sums followed by end-of-sequence, else 0 (``--task running-sum``).

    The same prompts as :func:`digit_sum_task` with an answer of up to 10 tokens (four digits)
    instead of two: one reward per completion says less about which token was wrong, where a
    teacher's per-token signal says it token by token (docs/tutorial_distill.rst).
    """

    def draw(gen: torch.Generator, n: int) -> list[tuple[str, str]]:
        rows = torch.randint(0, 10, (n, digits), generator=gen).tolist()
        return [(prompt_text(row), " ".join(map(str, accumulate(row)))) for row in rows]

    return Task(
        name="running_sum",
        alphabet="0123456789 =",
        prompt_length=2 * digits,
        answer_length=len(" ".join(str(9 * k) for k in range(1, digits + 1))),
        draw=draw,
        reward=reward,
        metric="accuracy",  # the reward is 1 for every sum right, else 0
    )


#: ``--task``'s choices: each builds its task from ``--digits``.
TASKS = {"digit-sum": digit_sum_task, "running-sum": running_sum_task}


def make_task(cfg: Settings) -> Task:
    """The task that ``--task`` and ``--digits`` name."""
    return TASKS[cfg.task](cfg.digits)


def prompt_text(digits: list[int]) -> str:
    return " ".join(map(str, digits)) + "="


def reward(completion: str, answer: str) -> float:
    """1 for exactly the answer, in decimal, followed by end-of-sequence; 0 otherwise.

    ``completion`` is the decoded response; anything after the first end-of-sequence token
    (padding) is ignored.
    """
    return float(completion.startswith(answer + EOS))


def make_tokenizer(chars: str = "0123456789 =") -> PreTrainedTokenizerFast:
    """One token per character of ``chars``, plus end-of-sequence and padding.

    Built with the ``tokenizers`` library (a word-level model over single characters) and
    wrapped as a ``transformers`` tokenizer, which is what torchrl's wrappers and envs expect.
    Its chat template writes the user's message as is: a prompt is its own text.
    """
    vocab = {c: i for i, c in enumerate(chars)} | {EOS: len(chars), PAD: len(chars) + 1}
    backend = CharLevelTokenizer(models.WordLevel(vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()  # "1", "7" -> "17", not "1 7"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=PAD)
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    return tokenizer


def draw_problems(
    task: Task, gen: torch.Generator, n: int, exclude: set[str], distinct: bool = False
) -> TensorDict:
    """``n`` problems of ``task`` whose prompts are not in ``exclude``, as the env's data: the
    prompt (``"query"``) and the expected answer; ``distinct``: no prompt twice (a GRPO step's
    prompts, each one group: a prompt drawn twice would make two groups of one id)."""
    rows: list[tuple[str, str]] = []
    seen: set[str] = set()
    for _ in range(100):
        for row in task.draw(gen, 2 * (n - len(rows))):
            if row[0] not in exclude and not (distinct and row[0] in seen):
                rows.append(row)
                seen.add(row[0])
        if len(rows) >= n:
            break
    else:
        raise ValueError(
            f"task {task.name!r}: drew only {len(rows)} of {n} {'distinct ' * distinct}"
            f"problems outside the {len(exclude)} held-out prompts in 100 tries: the task has "
            "too few distinct prompts for this --eval-prompts and --prompts-per-step "
            "(training never sees an evaluation prompt)."
        )
    queries, answers = zip(*rows[:n])
    return TensorDict(query=list(queries), answer=list(answers), batch_size=[n])


class Problems(IterableDataset):
    """Endless batches of ``batch`` fresh problems of ``task``, none of them in ``exclude``."""

    def __init__(self, task: Task, gen: torch.Generator, batch: int, exclude: set[str]):
        self.task, self.gen, self.batch, self.exclude = task, gen, batch, exclude

    def __iter__(self):
        while True:
            yield draw_problems(self.task, self.gen, self.batch, self.exclude, distinct=True)


class TaskReward(Transform):
    """The env's reward: decodes the sampled responses and scores them against ``"answer"``
    with ``task.reward``.

    Each response is decoded up to its first end-of-sequence token, followed by ``EOS`` if it
    has one, whatever the tokenizer writes for it. Writes ``("next", "reward")`` with torchrl's
    LLM shape ``[B, 1, 1]``.
    """

    def __init__(self, tokenizer, task: Task):
        super().__init__(in_keys=[("tokens", "response"), "answer"], out_keys=["reward"])
        self.tokenizer, self.task = tokenizer, task

    def completions(self, responses: list[torch.Tensor]) -> list[str]:
        eos = self.tokenizer.eos_token_id
        texts = []
        for tokens in responses:
            ends = (tokens == eos).nonzero()
            cut = tokens[: int(ends[0])] if len(ends) else tokens
            texts.append(self.tokenizer.decode(cut) + (EOS if len(ends) else ""))
        return texts

    def _step(self, tensordict, next_tensordict):
        completions = self.completions(tensordict.get(("tokens", "response"), as_list=True))
        answers = next_tensordict["answer"]
        rewards = [self.task.reward(c, a) for c, a in zip(completions, answers, strict=True)]
        next_tensordict.set("reward", torch.tensor(rewards).view(-1, 1, 1))
        return next_tensordict

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        reward_spec["reward"] = Unbounded(reward_spec.shape + (1, 1))
        return reward_spec


class Contiguous(Transform):
    """Turns torchrl's lazily stacked LLM data into one ``TensorDict``.

    torchrl's LLM env and wrappers stack one ``TensorDict`` per completion (``to_lazystack``),
    the layout for ragged text. Where every row has the same shapes (the wrappers pad,
    ``pad_output=True``; prompts of one length) the lazy layout only costs time: each copy,
    clone, key lookup and write walks the 512 rows. Rows of different shapes (a task whose
    prompts differ in length) stay lazily stacked. Used on the env's output, on the collected
    batch before it is scored, and on the minibatches sampled from the buffer (see the
    tutorial's profile).
    """

    @staticmethod
    def _contiguous(tensordict):
        try:
            return tensordict.contiguous()
        except RuntimeError as error:  # rows of different shapes: nothing to stack
            if "Failed to stack" not in str(error):
                raise
            return tensordict

    def forward(self, tensordict):
        return self._contiguous(tensordict)

    def _reset(self, tensordict, tensordict_reset):
        return self._contiguous(tensordict_reset)

    def _step(self, tensordict, next_tensordict):
        return self._contiguous(next_tensordict)


def make_env(
    tokenizer, task: Task, dataloader, batch: int, repeats: int | None = None
) -> DatasetChatEnv:
    """The task as a torchrl LLM env: one step per episode, prompts as tokens, the reward above.

    ``DatasetChatEnv`` builds a ``ChatEnv`` behind a ``DataLoadingPrimer``: every reset pulls
    ``batch`` rows from ``dataloader``, each prompt ``repeats`` times in a row (the group).
    """
    env = DatasetChatEnv.from_dataloader(
        dataloader,
        batch_size=(batch,),
        repeats=repeats,
        tokenizer=tokenizer,
        input_mode="tokens",
        template_kwargs={"chat_template": tokenizer.chat_template},
    )
    ragged_prompts(env)  # prompts of different token lengths (torchrl 0.14.1 cannot stack them)
    env.append_transform(Contiguous())
    env.append_transform(StepCounter(max_steps=1))
    env.append_transform(TaskReward(tokenizer, task))
    return env


class GreedyAccuracy:
    """The share of a fixed set of problems that ``policy`` answers right, through the task's env.

    The env is reset once: its prompts never change, and a reset (the chat template, applied one
    prompt at a time) is most of the cost of a rollout. Each call steps the env from that state
    with the policy's completions and returns the mean reward.
    """

    def __init__(self, tokenizer, task: Task, problems: TensorDict, policy):
        loader = DataLoader([problems], batch_size=None, collate_fn=lambda td: td)
        self.env = make_env(tokenizer, task, loader, batch=len(problems))
        self.prompts = self.env.reset()
        self.policy = policy

    @torch.no_grad()
    def __call__(self) -> float:
        # a deep copy: the sampler writes into the nested entries (tokens, masks) of its input
        return self.env.step(self.policy(self.prompts.clone()))["next", "reward"].mean().item()


# --------------------------------------------------------------------------------------------
# The model and its torchrl wrappers
# --------------------------------------------------------------------------------------------


def tiny_qwen2(cfg: Settings, task: Task) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """The default model and tokenizer of ``main``: a character-level tokenizer over the task's
    alphabet and a Qwen2 of ``--n-layer`` layers of width ``--n-embd``, created here (nothing is
    downloaded). Pass another function of ``(cfg, task)`` to ``main(model_and_tokenizer=...)``
    to train another model (its tokenizer needs a chat template; the prompt is the user's
    message)."""
    tokenizer = make_tokenizer(task.alphabet)
    return make_model(cfg, tokenizer, task.prompt_length + cfg.max_new_tokens), tokenizer


def from_folder(cfg: Settings, task: Task):
    """The model of ``--model`` and its tokenizer (``--tokenizer``, else ``tokenizer/`` beside
    the model folder, as this example saves a run, else the model folder)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(cfg.model)
    tokenizer = Path(cfg.tokenizer) if cfg.tokenizer else folder.parent / "tokenizer"
    tokenizer = tokenizer if tokenizer.is_dir() else folder
    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(tokenizer)


def check_special_ids(model, tokenizer) -> None:
    """Refuse a model whose end-of-sequence or padding id is not the tokenizer's: generation
    stops at the model's (a real token of the tokenizer, otherwise), and the rewards and the
    masks read the tokenizer's.

    Raises:
        ValueError: the ids disagree; both are named.
    """
    for name in ("eos_token_id", "pad_token_id"):
        wanted = getattr(tokenizer, name)
        for where in ("config", "generation_config"):
            ids = getattr(getattr(model, where, None), name, None)
            ids = ids if isinstance(ids, (list, tuple)) else [ids]
            if wanted is not None and ids != [None] and wanted not in ids:
                raise ValueError(
                    f"model.{where}.{name}={ids if len(ids) > 1 else ids[0]} but the "
                    f"tokenizer's is {wanted} ({tokenizer.convert_ids_to_tokens(wanted)!r}): "
                    f"set model.{where}.{name} = tokenizer.{name}."
                )


def make_model(cfg: Settings, tokenizer, max_length: int) -> Qwen2ForCausalLM:
    """A Qwen2 with a tiny config over ``tokenizer``'s vocabulary, for sequences of at most
    ``max_length`` tokens."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.n_embd,
        intermediate_size=2 * cfg.n_embd,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head,
        max_position_embeddings=max_length,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config).eval()  # no dropout: the sampler and the loss agree
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _device(cfg_device: str | None):
    """The wrappers' ``device``: ``None`` on the CPU (torchrl's default path, no copies)."""
    return None if cfg_device in (None, "cpu") else torch.device(cfg_device)


def make_sampler(
    model,
    tokenizer,
    cfg: Settings,
    greedy: bool = False,
    cls: type = TransformersWrapper,
    return_log_probs: bool = False,
) -> TransformersWrapper:
    """Completions of the prompt tokens: sampled from ``softmax(logits)``, or greedy.

    ``bad_words_ids`` keeps the model from emitting padding, which the wrapper would strip (the
    wrapper silently drops generation arguments it does not list, ``suppress_tokens`` among them).
    Here the loss's log-probs come from the scoring wrapper; the asynchronous example passes
    ``cls=ExactLogProbsTransformersWrapper, return_log_probs=True`` (the behaviour policy's).
    A model with fewer token rows than the tokenizer has ids is refused here, both sizes named
    (torchrl's wrapper would fail inside the embedding: "index out of range in self").
    """
    check_vocabulary(model, tokenizer)
    return cls(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=True,
        return_log_probs=return_log_probs,
        pad_output=True,
        device=_device(cfg.device),
        generate_kwargs={
            "max_new_tokens": cfg.max_new_tokens,
            "do_sample": not greedy,
            "bad_words_ids": [[tokenizer.pad_token_id]],
        },
    )


def make_scorer(
    model,
    tokenizer,
    cfg: Settings,
    log_probs_key: str = "log_probs",
    pad_output: bool = True,
    response_only: bool = False,
    disable_adapters: bool = False,
) -> TransformersWrapper:
    """Teacher-forced log-probs of ``("tokens", "full")``: written at ``(log_probs_key, "full")``.

    ``LeanTransformersWrapper`` (``cfg.lean``) is torchrl's wrapper computing them from the
    model's hidden states chunk by chunk: the same numbers, without the ``[B, T, V]`` logits,
    each shared prompt once (``--min-shared-length``); ``response_only`` computes the log-probs it
    writes on the response only (the prompt's are ``0``: the loss reads the response only).
    """
    lean = {}
    if cfg.lean:
        lean = {"min_shared_length": cfg.min_shared_length}
        lean["log_probs_at"] = "response" if response_only else "all"
        lean["disable_adapters"] = disable_adapters
    cls = LeanTransformersWrapper if cfg.lean else TransformersWrapper
    return cls(
        model,
        **lean,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=False,
        return_log_probs=True,
        pad_output=pad_output,
        log_probs_key=log_probs_key,
        device=_device(cfg.device),
    )


def with_lora(model, rank: int):
    """``model`` as a ``peft`` LoRA model: adapters of ``rank`` (alpha ``2 * rank``) on every
    linear layer but the output one, the other weights frozen."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    return peft.get_peft_model(model, config)


def make_collector(cfg: Settings, task: Task, model, ref_model, tokenizer, gen, exclude: set[str]):
    """The LLM collector and the replay buffer it fills, one GRPO step's batch at a time.

    Each batch: ``prompts_per_step`` fresh prompts of ``task`` (drawn with ``gen``, none in
    ``exclude``),
    each ``group_size`` times; the sampled completions and their rewards from the env; the
    log-probs of the sampled tokens under the sampling policy (the "old" policy of the ratio) and
    under the frozen reference (where ``--kl-coeff`` weighs it), added by torchrl's
    ``RetrieveLogProb`` at ``("next", "log_probs", "full")`` and
    ``("next", "ref_log_probs", "full")`` (:func:`log_prob_scorers`); then
    ``MCAdvantage`` writes ``"advantage"`` per completion, grouped by prompt, on the way into
    the buffer.
    """
    rows = cfg.prompts_per_step * cfg.group_size
    loader = DataLoader(
        Problems(task, gen, cfg.prompts_per_step, exclude),
        batch_size=None,
        collate_fn=lambda td: td,
    )
    env = make_env(tokenizer, task, loader, batch=rows, repeats=cfg.group_size)
    # torchrl's collectors want an "is_init" entry for any policy module (a FutureWarning
    # without it in torchrl 0.14; from 0.15 they append InitTracker themselves); not stored
    env.append_transform(InitTracker())
    rb = ReplayBuffer(
        storage=LazyStackStorage(rows),
        sampler=(  # a prompt's completions in one minibatch, or spread over the epoch
            GroupSampler(("tokens", "prompt"))
            if cfg.group_minibatches
            else SamplerWithoutReplacement()
        ),
        batch_size=cfg.minibatch,
    )
    # extend() runs the inverse passes of the transforms last-appended first: MCAdvantage reads
    # the prompt strings, then ExcludeTransform drops them; sample() runs the forward passes in
    # order: Contiguous turns each minibatch into one TensorDict
    rb.append_transform(Contiguous())
    rb.append_transform(ExcludeTransform("query", inverse=True))
    rb.append_transform(
        MCAdvantage(
            grpo_size=cfg.group_size,
            prompt_key="query",
            trajectory_return="sum",
            keep_return_bounds=(0.0, 1.0) if cfg.dynamic_sampling else None,
        )
    )
    unread = ("answer", "step_count", "terminated", "truncated", "is_init")  # the loss reads none
    score = Compose(
        Contiguous(),
        ExcludeTransform(*unread, *[("next", key) for key in (*unread, "query", "tokens")]),
        *log_prob_scorers(cfg, model, ref_model, tokenizer),
    )
    collector = LLMCollector(
        env,
        policy=make_sampler(model, tokenizer, cfg),
        dialog_turns_per_batch=rows,
        total_dialog_turns=cfg.steps * rows,
        replay_buffer=rb,
        postproc=torch.no_grad()(score),  # RetrieveLogProb would record a graph otherwise
    )
    return collector, rb


def log_prob_scorers(
    cfg: Settings, model, ref_model, tokenizer, pad_output: bool = True
) -> list[RetrieveLogProb]:
    """torchrl's ``RetrieveLogProb`` for the batch's sampled tokens: their log-probs under the
    sampling policy (the ratio's "old" policy, ``("next", "log_probs", "full")``) and, where the
    loss weighs the KL to the reference (``--kl-coeff`` above 0), under the frozen reference
    (``("next", "ref_log_probs", "full")``; ``ref_model`` None: the LoRA policy with its adapters
    disabled). At ``--kl-coeff 0`` the reference is not scored: one forward pass less a step
    (TRL's ``beta=0.0`` loads no reference either). ``pad_output``: :func:`make_scorer`'s."""
    old = make_scorer(model, tokenizer, cfg, response_only=True, pad_output=pad_output)
    scorers = [RetrieveLogProb(old, assistant_only=False)]
    if cfg.kl_coeff:
        ref = make_scorer(
            model if ref_model is None else ref_model,
            tokenizer,
            cfg,
            "ref_log_probs",
            response_only=True,
            disable_adapters=ref_model is None,
            pad_output=pad_output,
        )
        scorers.append(RetrieveLogProb(ref, assistant_only=False))
    return scorers


def make_loss(scorer, cfg: Settings) -> GRPOLoss:
    """GRPO's clipped objective over the response tokens, with the KL to the reference (none at
    ``--kl-coeff 0``: the loss reads no reference log-probs then)."""
    loss_fn = GRPOLoss(
        actor_network=scorer,
        masking_strategy="sft",  # the response tokens: full sequence minus the prompt
        clip_epsilon=(cfg.clip_epsilon, cfg.clip_epsilon_high),
        kl_to_ref_coeff=cfg.kl_coeff or None,
        entropy_coeff=cfg.entropy_coeff,
    )
    loss_fn.set_keys(sample_log_prob=("next", "log_probs", "full"))
    return loss_fn


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


class GRPOProgress:
    """How far GRPO has gone, from 0 to 1: the larger of the share of ``--steps`` done and the
    share of the time limit's seconds of GRPO spent; what the learning-rate schedule follows.

    The seconds of GRPO count from this object's creation on ``clock``; ``deadline`` (the end of
    the time limit on ``clock``) sets how many the time limit leaves (``budget_s``). A checkpoint
    saves :meth:`state_dict` (the seconds spent and the budget): a resumed run goes on from them
    (:meth:`load_state_dict`), so its rate continues the curve, and it stops where the run would
    have. A ``--time-limit`` raised on the resume adds its difference to the budget, as a raised
    ``--steps`` adds steps: both stretch what is left of the curve.
    """

    def __init__(self, cfg: Settings, deadline: float, clock=time.perf_counter):
        self.steps, self.time_limit, self.clock = cfg.steps, cfg.time_limit, clock
        self.start = clock()
        self.budget_s = deadline - self.start  # seconds of GRPO the time limit leaves
        self.before_s = 0.0  # seconds of GRPO before this process (a resumed run's)

    def seconds(self) -> float:
        """Seconds of GRPO so far, those before the checkpoint included."""
        return self.before_s + self.clock() - self.start

    def __call__(self, step: int) -> float:
        by_time = self.seconds() / self.budget_s if self.budget_s > 0 else 1.0
        return min(1.0, max(step / self.steps, by_time))

    def out_of_time(self) -> bool:
        """Whether the time limit is spent (the schedule's end by time: the run stops)."""
        return self.seconds() >= self.budget_s

    def state_dict(self) -> dict:
        return {"seconds": self.seconds(), "budget_s": self.budget_s, "time_limit": self.time_limit}

    def load_state_dict(self, state: dict) -> None:
        """Go on from a checkpoint's progress: its seconds spent, its budget (plus what a
        raised ``--time-limit`` adds); this process's clock counts from now."""
        self.before_s = state["seconds"]
        self.budget_s = state["budget_s"] + self.time_limit - state["time_limit"]
        self.start = self.clock()


def lr_schedule(
    optim, cfg: Settings, deadline: float, clock=time.perf_counter
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then a cosine decay to 0, over GRPO's progress: the larger of the share
    of ``--steps`` done and the share of the time to ``deadline`` spent (:class:`GRPOProgress`,
    :func:`schedule_progress`, saved with checkpoints).

    ``deadline`` is the end of the time budget on ``clock`` (``time.perf_counter``). With time to
    spare the schedule follows the steps (a warm-up of ``warmup_steps``, the cosine reaching 0
    at the last step); when the time limit allows fewer steps (a smaller ``--time-limit``, a
    slower machine), warm-up and decay shrink together, so the run still warms up for the same
    share of its steps and ends at a small learning rate instead of in mid-schedule.
    """
    warmup = min(cfg.warmup_steps, cfg.steps - 1) / cfg.steps  # a share of the progress
    progress = GRPOProgress(cfg, deadline, clock)

    def factor(step: int) -> float:
        done = progress(step)
        if done < warmup:
            return 0.05 + 0.95 * done / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (done - warmup) / (1.0 - warmup)))

    factor.progress = progress  # a function's attributes stay out of the schedule's state_dict
    return torch.optim.lr_scheduler.LambdaLR(optim, factor)


def schedule_progress(schedule: torch.optim.lr_scheduler.LambdaLR) -> GRPOProgress:
    """The :class:`GRPOProgress` that the schedule of :func:`lr_schedule` follows."""
    return schedule.lr_lambdas[0].progress


def warm_start(model, tokenizer, cfg: Settings, task: Task, gen, exclude, val_accuracy) -> int:
    """Supervised next-token training on ``prompt -> answer <eos>`` until partly right.

    The loss is the mean negative log-prob of the answer tokens, read from the scoring wrapper
    (``generate=False``) on the ragged ``prompt + answer`` sequences. Stops at the first check
    where ``val_accuracy()`` (greedy, on validation prompts, not the held-out evaluation set)
    reaches ``cfg.sft_target``. Returns the number of steps taken.
    """
    scorer = make_scorer(model, tokenizer, cfg, pad_output=False)  # ragged: read right-padded
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr)
    eos = tokenizer.eos_token
    for step in range(1, cfg.sft_max_steps + 1):
        data = draw_problems(task, gen, cfg.sft_batch, exclude)
        prompts = tokenizer(list(data["query"]))["input_ids"]
        texts = [q + a + eos for q, a in zip(data["query"], data["answer"], strict=True)]
        ids = tokenizer(texts)["input_ids"]  # ragged: answers of different lengths
        batch = lazy_stack([TensorDict({("tokens", "full"): torch.tensor(i)}) for i in ids])
        # ragged log-probs (the scorer pads nothing), read right-padded with 0
        log_probs = scorer(batch).get(("log_probs", "full"), as_padded_tensor=True)  # (B, W)
        start = torch.tensor([len(p) for p in prompts])  # (B,) each answer's first position
        answer = torch.arange(log_probs.shape[1]) >= start[:, None]  # (B, W); padding is 0
        loss = -log_probs[answer].sum() / sum(len(i) - len(p) for i, p in zip(ids, prompts))
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % cfg.sft_check_every == 0 and val_accuracy() >= cfg.sft_target:
            return step
    return cfg.sft_max_steps


def plot_progress(
    ax, history: dict, acc_before: float, title: str, metric: str = "accuracy"
) -> None:
    """The samples' mean reward and the greedy ``metric`` (the task's name for its mean greedy
    reward) per GRPO step, on ``ax`` (the asynchronous example draws the same panel above its
    lags)."""
    ax.plot(
        history["step"],
        history["reward"],
        color="tab:blue",
        alpha=0.6,
        lw=1,
        label="mean reward of the samples",
    )
    ax.plot(
        history["eval_step"],
        history["accuracy"],
        "o-",
        color="tab:red",
        ms=3,
        label=f"greedy {metric}, held-out prompts",
    )
    ax.axhline(acc_before, color="gray", ls="--", lw=1, label="after the warm start")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title, fontsize=10)


def evaluate_only(eval_accuracy, cfg: Settings, start: float, metric: str) -> dict:
    """``--eval-only``: the greedy accuracy on the held-out prompts, as a RESULT line whose
    before and after are the same number."""
    acc = eval_accuracy()
    wall_s = time.perf_counter() - start
    print(f"greedy {metric} {acc:.3f} on {cfg.eval_prompts} held-out prompts")
    print(f"RESULT acc_before={acc:.4f} acc_after={acc:.4f} wall_s={wall_s:.1f}")
    return {"acc_before": acc, "acc_after": acc, "wall_s": wall_s, "run_dir": None}


CHECKPOINT = "checkpoint"  # the folder of a run that --resume continues
#: Settings a resumed run must share with its checkpoint: they shape the model or the data.
SAME_ON_RESUME = ("seed", "digits", "n_layer", "n_embd", "n_head", "lora_rank", "lean", "model")
SAME_ON_RESUME += ("tokenizer", "group_size", "prompts_per_step", "eval_prompts")


def save_checkpoint(folder: Path, cfg: Settings, parts: dict, progress: dict) -> None:
    """What a stopped run needs to go on: the replay buffer with its transform's pending groups
    (``rb.dumps``; ``LazyStackStorage`` through the package's checkpointer), the warm-started
    weights (the reference policy, and where a resumed run starts before its trained weights
    are loaded), the policy's weights, the optimizer, the schedule and its progress (steps and
    seconds of GRPO), the loss's own state, the prompt generator, torch's random state and the
    run's progress.

    :func:`torchrl_grpo.checkpoint.save_checkpoint` writes them into a new folder and swaps it
    into place, each piece stamped with the GRPO steps done: a kill leaves the previous
    checkpoint or this one, whole."""
    actor = "actor_network"  # the policy's weights are saved once, as "policy"
    state = {
        "settings": dataclasses.asdict(cfg),
        "policy": parts["model"].state_dict(),
        "optimizer": parts["optim"].state_dict(),
        "schedule": parts["schedule"].state_dict(),
        "schedule_progress": schedule_progress(parts["schedule"]).state_dict(),
        "loss": {k: v for k, v in parts["loss"].state_dict().items() if not k.startswith(actor)},
        "prompts": parts["gen"].get_state(),
        "rng": torch.get_rng_state(),  # the sampler's (numpy and random are not used)
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "progress": progress,
    }
    pieces = {"buffer": parts["rb"], "reference": parts["reference"], "state": state}
    checkpoint.save_checkpoint(folder, pieces, stamp=progress["seen"]["step"])


def load_checkpoint(cfg: Settings, same: tuple[str, ...] = SAME_ON_RESUME) -> dict:
    """The state :func:`save_checkpoint` wrote in the run folder ``cfg.resume`` (or the
    checkpoint folder itself), with its ``"reference"`` weights and its ``"buffer"`` folder.
    ``same``: the settings that must be the checkpoint's (another example's adds its own; one
    that a checkpoint lacks, saved before it existed, counts as its default).

    Raises:
        SystemExit: no complete checkpoint there, one that is torn, truncated or changed
            (:func:`torchrl_grpo.checkpoint.load_checkpoint`), or settings that change the
            model or the data.
    """
    folder = Path(cfg.resume)
    folder = folder if folder.name.startswith(CHECKPOINT) else folder / CHECKPOINT
    try:
        saved = checkpoint.load_checkpoint(folder, weights_only=False)
    except checkpoint.CheckpointError as error:
        raise SystemExit(f"--resume {cfg.resume}: {error}") from error
    state = saved.values["state"]
    settings = state["settings"]
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    changed = [k for k in same if settings.get(k, defaults[k]) != getattr(cfg, k)]
    if changed:
        raise SystemExit(
            "--resume: the checkpoint was made with "
            + ", ".join(f"--{k.replace('_', '-')} {settings[k]!r}" for k in changed)
            + "; pass the same (they shape the model or the data)."
        )
    return {**state, "reference": saved.values["reference"], "buffer": saved.values["buffer"]}


def restore(parts: dict, state: dict) -> None:
    """Load a checkpoint's training state into freshly built ``parts`` (before training); the
    schedule goes on from its saved progress (the rate continues the curve)."""
    parts["model"].load_state_dict(state["policy"])
    parts["optim"].load_state_dict(state["optimizer"])
    parts["schedule"].load_state_dict(state["schedule"])
    schedule_progress(parts["schedule"]).load_state_dict(state["schedule_progress"])
    missing, unexpected = parts["loss"].load_state_dict(state["loss"], strict=False)
    differ = unexpected + [k for k in missing if not k.startswith("actor_network")]
    if "kl_to_ref_coeff" in differ:  # a KL term in one run only: --kl-coeff 0 has none
        raise SystemExit(
            "--resume: --kl-coeff is 0 in one of the two runs (the checkpoint's, this one) and "
            "not in the other; the KL to the reference cannot be added or dropped on a resume"
        )
    if differ:
        raise SystemExit(f"--resume: the loss's state does not match: {differ}")
    parts["rb"].loads(state["buffer"])
    torch.set_rng_state(state["rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])


def plot(history: dict, path: str, acc_before: float, title: str, metric: str) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    plot_progress(ax, history, acc_before, title, metric)
    ax.set_xlabel("GRPO step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None, *, task: Task | None = None, model_and_tokenizer=None) -> dict:
    """Warm start, then GRPO, on ``task`` (default: :func:`make_task`, from ``--task`` and
    ``--digits``) with the model and tokenizer of ``model_and_tokenizer(cfg, task)`` (default:
    :func:`tiny_qwen2`).

    Returns the accuracies before and after GRPO, the wall time and the run's folder.
    """
    start = T0 if main.first_call else time.perf_counter()  # a second call: its own clock
    main.first_call = False
    cfg = parse_args(argv, task)
    task = task or make_task(cfg)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar
    if model_and_tokenizer is None:
        model_and_tokenizer = from_folder if cfg.model else tiny_qwen2
    model, tokenizer = model_and_tokenizer(cfg, task)
    check_special_ids(model, tokenizer)
    model = model.to(cfg.device)
    state = load_checkpoint(cfg) if cfg.resume else None  # refused before any work

    # held-out evaluation set: the same prompts for every seed, excluded from all training
    eval_problems = draw_problems(
        task, torch.Generator().manual_seed(1234), cfg.eval_prompts, set()
    )
    held_out = set(eval_problems["query"])
    train_gen = torch.Generator().manual_seed(cfg.seed)
    val_problems = draw_problems(task, train_gen, 200, held_out)  # stops the warm start

    greedy = make_sampler(model, tokenizer, cfg, greedy=True)
    val_accuracy = GreedyAccuracy(tokenizer, task, val_problems, greedy)
    eval_accuracy = GreedyAccuracy(tokenizer, task, eval_problems, greedy)
    if cfg.eval_only:
        return evaluate_only(eval_accuracy, cfg, start, task.metric)
    logger, run_dir = make_logger(cfg, task)
    if state is None:
        sft_steps = warm_start(model, tokenizer, cfg, task, train_gen, held_out, val_accuracy)
        acc_before = eval_accuracy()
        print(
            f"warm start: {sft_steps} supervised steps, greedy {task.metric} {acc_before:.3f} "
            f"on {cfg.eval_prompts} held-out prompts ({time.perf_counter() - start:.0f} s)"
        )
    else:  # the warm start's weights: the reference, and where the policy's are loaded
        model.load_state_dict(state["reference"])
        acc_before = state["progress"]["acc_before"]
    reference = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    ref_model = None  # LoRA on the lean wrapper: the policy itself, its adapters disabled
    if cfg.kl_coeff and not (cfg.lora_rank and cfg.lean):
        ref_model = copy.deepcopy(model).requires_grad_(False)  # the frozen reference policy
    if cfg.lora_rank:
        model = with_lora(model, cfg.lora_rank)  # adapters injected in place: the samplers see them

    rows = cfg.prompts_per_step * cfg.group_size
    if state is not None:  # the prompt stream goes on (the collector draws at its start)
        train_gen.set_state(state["prompts"])
    collector, rb = make_collector(cfg, task, model, ref_model, tokenizer, train_gen, held_out)
    loss_fn = make_loss(make_scorer(model, tokenizer, cfg), cfg)
    trained = [p for p in model.parameters() if p.requires_grad]  # the adapters, with LoRA
    optim = torch.optim.Adam(trained, lr=cfg.lr)
    schedule = lr_schedule(optim, cfg, deadline=start + cfg.time_limit)
    grpo = schedule_progress(schedule)  # steps and seconds of GRPO: the schedule's, the stop's
    parts = dict(model=model, optim=optim, schedule=schedule, loss=loss_fn, rb=rb, gen=train_gen)
    parts["reference"] = reference  # saved with every checkpoint
    if state is not None:  # the buffer's write count carries the trainer's frames and steps on
        restore(parts, state)
        print(
            f"resumed {cfg.resume} after {state['progress']['seen']['step']} GRPO steps and "
            f"{grpo.seconds():.0f} s of GRPO; learning rate "
            f"{optim.param_groups[0]['lr']:.3g}"
        )

    trainer = GRPOTrainer(
        collector=collector,
        total_frames=cfg.steps * rows,
        loss_module=loss_fn,
        optimizer=optim,
        replay_buffer=rb,
        empty_replay_buffer_on_weight_update=True,  # on-policy: each batch is used, then dropped
        num_epochs=cfg.epochs,
        clip_norm=1.0,
        logger=logger,
        log_interval=0,  # every collected batch
        log_rewards=False,  # logged below over the whole batch, not the first minibatch
    )
    history = {"step": [], "reward": [], "eval_step": [0], "accuracy": [acc_before]}
    advantage = next(t for t in rb.transform if isinstance(t, MCAdvantage))  # counts completions
    seen = {"step": 0, "completions": 0, "reward_sum": 0.0}
    if state is not None:
        history, seen = state["progress"]["history"], state["progress"]["seen"]

    def batch_reward(_batch) -> dict:
        """Once per collected batch: the mean reward of its completions, and the share stored
        (below 1 only with --dynamic-sampling, which drops groups whose rewards are all equal)."""
        stats = advantage.get_stats()
        n = stats["completed_trajectories"] - seen["completions"]
        value = (stats["trajectory_return_sum"] - seen["reward_sum"]) / n
        seen.update(
            step=seen["step"] + 1,
            completions=stats["completed_trajectories"],
            reward_sum=stats["trajectory_return_sum"],
        )
        history["step"].append(seen["step"])
        history["reward"].append(value)
        return {"reward": value, "kept": len(rb) / n, "log_pbar": True}

    def evaluate(_batch) -> dict:
        step = seen["step"]
        out_of_time = grpo.out_of_time()  # its seconds of GRPO, a resumed run's too
        if out_of_time:
            trainer.request_stop()
            tqdm.write(f"time limit {cfg.time_limit:.0f} s reached after {step} GRPO steps")
        if step % cfg.eval_every and step != cfg.steps and not out_of_time:
            return {}
        acc = eval_accuracy()
        history["eval_step"].append(step)
        history["accuracy"].append(acc)
        tqdm.write(
            f"step {step:4d}  greedy {task.metric} {acc:.3f}  ({time.perf_counter() - start:.0f} s)"
        )
        return {"accuracy": acc, "log_pbar": True}

    def pause_or_save(_batch) -> None:
        """After the step's evaluation: --stop-at-step, and --checkpoint-every's save."""
        if cfg.stop_at_step and seen["step"] >= cfg.stop_at_step:
            trainer.request_stop()
        if cfg.checkpoint_every and seen["step"] % cfg.checkpoint_every == 0:
            progress = {"history": history, "seen": seen, "acc_before": acc_before}
            save_checkpoint(run_dir / CHECKPOINT, cfg, parts, progress)

    trainer.register_op("pre_steps_log", batch_reward)
    trainer.register_op("post_steps", schedule.step)
    trainer.register_op("post_steps_log", evaluate)
    trainer.register_op("post_steps_log", pause_or_save)
    gc.freeze()  # the model and the pipeline live all run: keep them out of the GC's scans
    if state is not None and grpo.out_of_time():
        print(f"the time limit ({cfg.time_limit:.0f} s) was spent before the checkpoint: raise it")
    elif seen["step"] < min(cfg.steps, cfg.stop_at_step or cfg.steps):  # else: nothing to train
        trainer.train()
    step = history["eval_step"][-1]
    progress = {"history": history, "seen": seen, "acc_before": acc_before}
    save_checkpoint(run_dir / CHECKPOINT, cfg, parts, progress)

    acc_after = history["accuracy"][-1]
    name = type(model.get_base_model() if cfg.lora_rank else model).__name__
    title = f"GRPO on {task.name}: {name}, {cfg.device}"
    plot(history, run_dir / "llm_grpo.png", acc_before, title, task.metric)
    model.save_pretrained(run_dir / "model")
    # Apart: transformers 5 loads the tokenizer of a Qwen2 model's folder as Qwen2Tokenizer,
    # whatever tokenizer_config.json says, and that one drops this tokenizer's spaces.
    tokenizer.save_pretrained(run_dir / "tokenizer")
    remove_empty_folders(run_dir)  # CSVLogger makes videos/ and texts/ whether used or not
    wall_s = time.perf_counter() - start
    print(
        f"greedy {task.metric} {acc_before:.3f} -> {acc_after:.3f} after {step} GRPO steps; "
        f"in {run_dir}: metrics (scalars/), plot (llm_grpo.png), model (model/), "
        "tokenizer (tokenizer/)"
    )
    print(f"RESULT acc_before={acc_before:.4f} acc_after={acc_after:.4f} wall_s={wall_s:.1f}")
    return {"acc_before": acc_before, "acc_after": acc_after, "wall_s": wall_s, "run_dir": run_dir}


def make_logger(cfg: Settings, task: Task):
    """``(torchrl logger or None, run folder)``: ``--logger`` writing under ``--out/<run>``, where
    the plot, the model and the tokenizer go too."""
    exp_name = generate_exp_name(task.name, f"seed{cfg.seed}")
    run_dir = Path(cfg.out) / exp_name
    try:
        logger = get_logger(
            None if cfg.logger == "none" else cfg.logger,
            logger_name=cfg.out,
            experiment_name=exp_name,
        )
    except ImportError as error:  # tensorboard / wandb missing: say what to install
        raise SystemExit(
            f"--logger {cfg.logger} needs the {cfg.logger} package: "
            f"pip install -e '.[{cfg.logger}]' (or --logger csv). ({error})"
        ) from error
    run_dir.mkdir(parents=True, exist_ok=True)
    return logger, run_dir


def remove_empty_folders(root: Path) -> None:
    """Remove the folders under ``root`` that hold nothing (deepest first)."""
    for folder in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()


main.first_call = True  # the first call's clock starts at import (the budget counts imports)


if __name__ == "__main__":
    main()
