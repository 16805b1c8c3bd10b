"""GRPO makes a tiny language model better at a verifiable task, on a CPU, with torchrl's LLM stack.

The task: read four digits and write their sum (``"3 9 1 4=" -> "17"``); the reward is 1 for the
exact answer followed by the end-of-sequence token, else 0. Everything runs on torchrl's LLM
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
every metric with torchrl's ``CSVLogger`` under ``--out`` (through the trainer), saves
``llm_grpo.png`` there, and ends with one line::

    RESULT acc_before=<float> acc_after=<float> wall_s=<float>
"""

# ruff: noqa: E402  (the clock starts before the imports: wall_s covers the whole run)
import time

T0 = time.perf_counter()

import argparse
import copy
import dataclasses
import gc
import math
import os
from dataclasses import dataclass

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
from torchrl.envs import Compose, ExcludeTransform, StepCounter, Transform
from torchrl.envs.llm import DatasetChatEnv, RetrieveLogProb
from torchrl.modules.llm import TransformersWrapper
from torchrl.record.loggers import CSVLogger, generate_exp_name
from torchrl.trainers.algorithms.grpo import GRPOTrainer
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from torchrl_grpo import GRPOLoss, LeanTransformersWrapper, MCAdvantage

set_list_to_stack(True).set()  # torchrl's LLM envs keep lists of strings as stacks


@dataclass
class Settings:
    """Every setting of the run; each is a command-line flag (``--group-size 8``)."""

    seed: int = 0
    out: str = "runs/llm_grpo"  # each run writes its CSV metrics and PNG in a new folder here
    threads: int = 1  # torch threads; 1 is fastest on a 2-core machine shared with other jobs
    device: str = "cpu"  # where the model and its wrappers compute (cpu, cuda, ...)
    lean: bool = True  # score with LeanTransformersWrapper (no logits); --no-lean: torchrl's
    # task
    digits: int = 4  # digits per prompt; the answer is their sum
    eval_prompts: int = 500  # held-out prompts for the greedy accuracy (fixed, never trained on)
    # model: Qwen2 architecture, tiny
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    # warm start: supervised, stopped as soon as it is partly right
    sft_lr: float = 1e-3
    sft_batch: int = 64
    sft_target: float = 0.30  # stop when greedy accuracy on a validation set reaches this
    sft_max_steps: int = 3000
    sft_check_every: int = 2  # the tiny Qwen2 moves fast: every 5 steps can overshoot the target
    # GRPO
    steps: int = 150  # GRPO steps (each: collect, score, extend the buffer, optimize)
    prompts_per_step: int = 64
    group_size: int = 8  # completions per prompt, the G of GRPO
    max_new_tokens: int = 3  # the longest right answer: two digits and end-of-sequence
    epochs: int = 2  # passes over each step's data
    minibatch: int = 64  # 8 minibatches per pass: 16 optimizer steps per GRPO step
    lr: float = 5e-4  # Adam: linear warm-up, then cosine decay to 0 at `steps` or `time_limit`
    warmup_steps: int = 10
    dynamic_sampling: bool = False  # drop groups whose completions all score the same (DAPO)
    clip_epsilon: float = 0.2  # the ratio is clipped to [1 - clip_epsilon, 1 + clip_epsilon_high]
    clip_epsilon_high: float = 0.28  # DAPO's clip-higher: rare right answers can gain faster
    kl_coeff: float = 0.02  # beta of the KL to the reference, in the loss
    entropy_coeff: float = 0.0
    eval_every: int = 10
    time_limit: float = 190.0  # stop GRPO once the run has taken this long (seconds)


def parse_args(argv=None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for field in dataclasses.fields(Settings):
        flag = "--" + field.name.replace("_", "-")
        if isinstance(field.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    cfg = Settings(**vars(parser.parse_args(argv)))
    if cfg.steps < 1 or cfg.group_size < 2:
        parser.error("--steps must be at least 1 and --group-size at least 2")
    return cfg


# --------------------------------------------------------------------------------------------
# The task: digits in, their sum out; a programmatic reward
# --------------------------------------------------------------------------------------------

EOS, PAD = "<eos>", "<pad>"


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


def prompt_text(digits: list[int]) -> str:
    return " ".join(map(str, digits)) + "="


def draw_problems(gen: torch.Generator, n: int, k: int, exclude: torch.Tensor) -> torch.Tensor:
    """``n`` rows of ``k`` random digits whose prompts are not in ``exclude`` (codes, see below)."""
    rows = []
    while sum(len(r) for r in rows) < n:
        digits = torch.randint(0, 10, (2 * n, k), generator=gen)  # (2n, k)
        rows.append(digits[~torch.isin(problem_code(digits), exclude)])
    return torch.cat(rows)[:n]


def problem_code(digits: torch.Tensor) -> torch.Tensor:
    """The digits of each row read as one base-10 integer: a problem's identity."""
    powers = 10 ** torch.arange(digits.shape[-1] - 1, -1, -1)
    return (digits * powers).sum(-1)


def as_queries(digits: torch.Tensor) -> TensorDict:
    """Problems as the env's data: the prompt (``"query"``) and the expected answer."""
    rows = digits.tolist()
    return TensorDict(
        query=[prompt_text(d) for d in rows],
        answer=[str(sum(d)) for d in rows],
        batch_size=[len(rows)],
    )


class DigitSumProblems(IterableDataset):
    """Endless batches of ``batch`` fresh problems, none of them in ``exclude``."""

    def __init__(self, gen: torch.Generator, batch: int, digits: int, exclude: torch.Tensor):
        self.gen, self.batch, self.digits, self.exclude = gen, batch, digits, exclude

    def __iter__(self):
        while True:
            yield as_queries(draw_problems(self.gen, self.batch, self.digits, self.exclude))


def reward(completion: str, answer: str) -> float:
    """1 for exactly the answer, in decimal, followed by end-of-sequence; 0 otherwise.

    ``completion`` is the decoded response; anything after the first end-of-sequence token
    (padding) is ignored.
    """
    return float(completion.startswith(answer + EOS))


class DigitSumReward(Transform):
    """The env's reward: decodes the sampled response and scores it against ``"answer"``.

    Writes ``("next", "reward")`` with torchrl's LLM shape ``[B, 1, 1]``.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast):
        super().__init__(in_keys=[("tokens", "response"), "answer"], out_keys=["reward"])
        self.tokenizer = tokenizer

    def _step(self, tensordict, next_tensordict):
        responses = tensordict.get(("tokens", "response"), as_list=True)
        completions = self.tokenizer.batch_decode(responses)
        answers = next_tensordict["answer"]
        rewards = [reward(c, a) for c, a in zip(completions, answers, strict=True)]
        next_tensordict.set("reward", torch.tensor(rewards).view(-1, 1, 1))
        return next_tensordict

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        reward_spec["reward"] = Unbounded(reward_spec.shape + (1, 1))
        return reward_spec


class Contiguous(Transform):
    """Turns torchrl's lazily stacked LLM data into one ``TensorDict``.

    torchrl's LLM env and wrappers stack one ``TensorDict`` per completion (``to_lazystack``),
    the layout for ragged text. Here every row has the same shapes (the wrappers pad,
    ``pad_output=True``), and the lazy layout only costs time: each copy, clone, key lookup and
    write walks the 512 rows. Used on the env's output, on the collected batch before it is
    scored, and on the minibatches sampled from the buffer (see the tutorial's profile).
    """

    def forward(self, tensordict):
        return tensordict.contiguous()

    def _reset(self, tensordict, tensordict_reset):
        return tensordict_reset.contiguous()

    def _step(self, tensordict, next_tensordict):
        return next_tensordict.contiguous()


def make_env(tokenizer, dataloader, batch: int, repeats: int | None = None) -> DatasetChatEnv:
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
    env.append_transform(Contiguous())
    env.append_transform(StepCounter(max_steps=1))
    env.append_transform(DigitSumReward(tokenizer))
    return env


class GreedyAccuracy:
    """The share of a fixed set of problems that ``policy`` answers right, through the task's env.

    The env is reset once: its prompts never change, and a reset (the chat template, applied one
    prompt at a time) is most of the cost of a rollout. Each call steps the env from that state
    with the policy's completions and returns the mean reward.
    """

    def __init__(self, tokenizer, digits: torch.Tensor, policy):
        loader = DataLoader([as_queries(digits)], batch_size=None, collate_fn=lambda td: td)
        self.env = make_env(tokenizer, loader, batch=len(digits))
        self.prompts = self.env.reset()
        self.policy = policy

    @torch.no_grad()
    def __call__(self) -> float:
        return self.env.step(self.policy(self.prompts.copy()))["next", "reward"].mean().item()


# --------------------------------------------------------------------------------------------
# The model and its torchrl wrappers
# --------------------------------------------------------------------------------------------


def make_model(cfg: Settings, tokenizer) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.n_embd,
        intermediate_size=2 * cfg.n_embd,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head,
        max_position_embeddings=2 * cfg.digits + cfg.max_new_tokens,
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


def make_sampler(model, tokenizer, cfg: Settings, greedy: bool = False) -> TransformersWrapper:
    """Completions of the prompt tokens: sampled from ``softmax(logits)``, or greedy.

    ``bad_words_ids`` keeps the model from emitting padding, which the wrapper would strip (the
    wrapper silently drops generation arguments it does not list, ``suppress_tokens`` among them).
    """
    return TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=True,
        return_log_probs=False,  # the loss's log-probs come from the scoring wrapper
        pad_output=True,
        device=_device(cfg.device),
        generate_kwargs={
            "max_new_tokens": cfg.max_new_tokens,
            "do_sample": not greedy,
            "bad_words_ids": [[tokenizer.pad_token_id]],
        },
    )


def make_scorer(
    model, tokenizer, cfg: Settings, log_probs_key: str = "log_probs", pad_output: bool = True
) -> TransformersWrapper:
    """Teacher-forced log-probs of ``("tokens", "full")``: written at ``(log_probs_key, "full")``.

    ``LeanTransformersWrapper`` (``cfg.lean``) is torchrl's wrapper computing them from the
    model's hidden states chunk by chunk: the same numbers, without the ``[B, T, V]`` logits.
    """
    cls = LeanTransformersWrapper if cfg.lean else TransformersWrapper
    return cls(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=False,
        return_log_probs=True,
        pad_output=pad_output,
        log_probs_key=log_probs_key,
        device=_device(cfg.device),
    )


def make_collector(cfg: Settings, model, ref_model, tokenizer, gen, exclude):
    """The LLM collector and the replay buffer it fills, one GRPO step's batch at a time.

    Each batch: ``prompts_per_step`` fresh prompts (drawn with ``gen``, none in ``exclude``),
    each ``group_size`` times; the sampled completions and their rewards from the env; the
    log-probs of the sampled tokens under the sampling policy (the "old" policy of the ratio) and
    under the frozen reference, added by torchrl's ``RetrieveLogProb`` at
    ``("next", "log_probs", "full")`` and ``("next", "ref_log_probs", "full")``; then
    ``MCAdvantage`` writes ``"advantage"`` per completion, grouped by prompt, on the way into
    the buffer.
    """
    rows = cfg.prompts_per_step * cfg.group_size
    loader = DataLoader(
        DigitSumProblems(gen, cfg.prompts_per_step, cfg.digits, exclude),
        batch_size=None,
        collate_fn=lambda td: td,
    )
    env = make_env(tokenizer, loader, batch=rows, repeats=cfg.group_size)
    rb = ReplayBuffer(
        storage=LazyStackStorage(rows),
        sampler=SamplerWithoutReplacement(),
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
    unread = ("answer", "step_count", "terminated", "truncated")  # the loss reads none of them
    ref_scorer = make_scorer(ref_model, tokenizer, cfg, "ref_log_probs")
    score = Compose(
        Contiguous(),
        ExcludeTransform(*unread, *[("next", key) for key in (*unread, "query", "tokens")]),
        RetrieveLogProb(make_scorer(model, tokenizer, cfg), assistant_only=False),
        RetrieveLogProb(ref_scorer, assistant_only=False),
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


def make_loss(scorer, cfg: Settings) -> GRPOLoss:
    """GRPO's clipped objective over the response tokens, with the KL to the reference."""
    loss_fn = GRPOLoss(
        actor_network=scorer,
        masking_strategy="sft",  # the response tokens: full sequence minus the prompt
        clip_epsilon=(cfg.clip_epsilon, cfg.clip_epsilon_high),
        kl_to_ref_coeff=cfg.kl_coeff,
        entropy_coeff=cfg.entropy_coeff,
    )
    loss_fn.set_keys(sample_log_prob=("next", "log_probs", "full"))
    return loss_fn


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def lr_schedule(optim, cfg: Settings, deadline: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps``, then a cosine decay that reaches 0 at the last GRPO
    step or at the time limit, whichever comes first.

    ``deadline`` is the end of the time budget on ``time.perf_counter``'s clock: a run that the
    time limit cuts short (a slower machine, a smaller ``--time-limit``) still ends at a small
    learning rate instead of stopping in mid-schedule. With time to spare, the decay follows
    the steps alone.
    """
    warmup = min(cfg.warmup_steps, cfg.steps - 1)
    start = time.perf_counter()

    def factor(step: int) -> float:
        if step < warmup:
            return 0.05 + 0.95 * step / warmup
        by_steps = (step - warmup) / (cfg.steps - warmup)
        by_time = (time.perf_counter() - start) / max(deadline - start, 1e-9)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(by_steps, by_time))))

    return torch.optim.lr_scheduler.LambdaLR(optim, factor)


def warm_start(model, tokenizer, cfg: Settings, gen, exclude, val_accuracy) -> int:
    """Supervised next-token training on ``prompt -> answer <eos>`` until partly right.

    The loss is the mean negative log-prob of the answer tokens, read from the scoring wrapper
    (``generate=False``) on the ragged ``prompt + answer`` sequences. Stops at the first check
    where ``val_accuracy()`` (greedy, on validation prompts, not the held-out evaluation set)
    reaches ``cfg.sft_target``. Returns the number of steps taken.
    """
    scorer = make_scorer(model, tokenizer, cfg, pad_output=False)  # ragged: read right-padded
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr)
    p = 2 * cfg.digits  # prompt length in tokens, the same for every prompt
    for step in range(1, cfg.sft_max_steps + 1):
        data = as_queries(draw_problems(gen, cfg.sft_batch, cfg.digits, exclude))
        texts = [q + a + EOS for q, a in zip(data["query"], data["answer"], strict=True)]
        ids = tokenizer(texts)["input_ids"]  # ragged: 1- and 2-digit answers
        batch = lazy_stack([TensorDict({("tokens", "full"): torch.tensor(i)}) for i in ids])
        # ragged log-probs (the scorer pads nothing), read right-padded with 0
        log_probs = scorer(batch).get(("log_probs", "full"), as_padded_tensor=True)  # (B, W)
        loss = -log_probs[:, p:].sum() / sum(len(i) - p for i in ids)  # answer tokens only
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % cfg.sft_check_every == 0 and val_accuracy() >= cfg.sft_target:
            return step
    return cfg.sft_max_steps


def plot(history: dict, path: str, acc_before: float) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
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
        label="greedy accuracy, held-out prompts",
    )
    ax.axhline(acc_before, color="gray", ls="--", lw=1, label="after the warm start")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("GRPO on digit sums: tiny Qwen2, torchrl's LLM stack, CPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    hf_logging.set_verbosity_error()
    tokenizer = make_tokenizer()

    # held-out evaluation set: the same 500 prompts for every seed, excluded from all training
    eval_digits = draw_problems(
        torch.Generator().manual_seed(1234), cfg.eval_prompts, cfg.digits, torch.tensor([-1])
    )
    eval_codes = problem_code(eval_digits)
    train_gen = torch.Generator().manual_seed(cfg.seed)
    val_digits = draw_problems(train_gen, 200, cfg.digits, eval_codes)  # stops the warm start

    model = make_model(cfg, tokenizer).to(cfg.device)
    greedy = make_sampler(model, tokenizer, cfg, greedy=True)
    val_accuracy = GreedyAccuracy(tokenizer, val_digits, greedy)
    eval_accuracy = GreedyAccuracy(tokenizer, eval_digits, greedy)
    sft_steps = warm_start(model, tokenizer, cfg, train_gen, eval_codes, val_accuracy)
    acc_before = eval_accuracy()
    print(
        f"warm start: {sft_steps} supervised steps, greedy accuracy {acc_before:.3f} "
        f"on {cfg.eval_prompts} held-out prompts ({time.perf_counter() - T0:.0f} s)"
    )
    ref_model = copy.deepcopy(model).requires_grad_(False)  # the frozen reference policy

    rows = cfg.prompts_per_step * cfg.group_size
    collector, rb = make_collector(cfg, model, ref_model, tokenizer, train_gen, eval_codes)
    loss_fn = make_loss(make_scorer(model, tokenizer, cfg), cfg)
    optim = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    schedule = lr_schedule(optim, cfg, deadline=T0 + cfg.time_limit)

    logger = CSVLogger(generate_exp_name("llm_grpo", f"seed{cfg.seed}"), log_dir=cfg.out)
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
        out_of_time = time.perf_counter() - T0 > cfg.time_limit
        if out_of_time:
            trainer.request_stop()
            tqdm.write(f"time limit {cfg.time_limit:.0f} s reached after {step} GRPO steps")
        if step % cfg.eval_every and step != cfg.steps and not out_of_time:
            return {}
        acc = eval_accuracy()
        history["eval_step"].append(step)
        history["accuracy"].append(acc)
        tqdm.write(f"step {step:4d}  greedy accuracy {acc:.3f}  ({time.perf_counter() - T0:.0f} s)")
        return {"accuracy": acc, "log_pbar": True}

    trainer.register_op("pre_steps_log", batch_reward)
    trainer.register_op("post_steps", schedule.step)
    trainer.register_op("post_steps_log", evaluate)
    gc.freeze()  # the model and the pipeline live all run: keep them out of the GC's scans
    trainer.train()
    step = history["eval_step"][-1]

    acc_after = history["accuracy"][-1]
    run_dir = os.path.join(logger.log_dir, logger.exp_name)
    png = os.path.join(run_dir, "llm_grpo.png")
    plot(history, png, acc_before)
    wall_s = time.perf_counter() - T0
    print(
        f"greedy accuracy {acc_before:.3f} -> {acc_after:.3f} after {step} GRPO steps; "
        f"metrics in {run_dir}/scalars, plot in {png}"
    )
    print(f"RESULT acc_before={acc_before:.4f} acc_after={acc_after:.4f} wall_s={wall_s:.1f}")
    return {"acc_before": acc_before, "acc_after": acc_after, "wall_s": wall_s}


if __name__ == "__main__":
    main()
