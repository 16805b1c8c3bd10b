"""GRPO makes a tiny transformer better at a verifiable task, on a CPU, in minutes.

The task: read four digits and write their sum (``"3 9 1 4=" -> "17"``); the reward is 1 for the
exact answer followed by the end-of-sequence token, else 0. The policy is a Hugging Face
``transformers`` GPT-2 with a tiny config, created locally (nothing is downloaded), over a
character-level tokenizer defined below. A short supervised warm start makes the policy partly
right; GRPO then samples ``group_size`` completions per prompt (ragged: padded, with a mask),
scores them, writes them to a torchrl ``ReplayBuffer`` whose ``torchrl_grpo.MCAdvantage``
transform turns rewards into group-relative advantages keyed by the prompt string, and optimizes
``torchrl_grpo.GRPOLoss`` over the response tokens, with a KL penalty to the frozen warm-start
policy.

Run (needs the ``llm`` and ``examples`` extras: ``pip install -e ".[llm,examples]"``)::

    .venv/bin/python examples/llm_grpo.py                      # defaults: about 3 minutes
    .venv/bin/python examples/llm_grpo.py --seed 1 --out runs/llm_grpo/seed1
    .venv/bin/python examples/llm_grpo.py --help               # every setting

It prints the greedy accuracy on 500 held-out prompts after the warm start and during GRPO, logs
the loss metrics (ESS, clip fraction, KL to the reference, entropy, reward) with torchrl's
``CSVLogger`` under ``--out``, saves ``llm_grpo.png`` there, and ends with one line::

    RESULT acc_before=<float> acc_after=<float> wall_s=<float>
"""

# ruff: noqa: E402  (the clock starts before the imports: wall_s covers the whole run)
import time

T0 = time.perf_counter()

import argparse
import copy
import dataclasses
import os
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement
from torchrl.envs.transforms import ExcludeTransform
from torchrl.modules import ProbabilisticActor
from torchrl.record.loggers import CSVLogger, generate_exp_name
from tqdm import tqdm
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

from torchrl_grpo import GRPOLoss, MCAdvantage, TokenCategorical


@dataclass
class Settings:
    """Every setting of the run; each is a command-line flag (``--group-size 8``)."""

    seed: int = 0
    out: str = "runs/llm_grpo"  # each run writes its CSV metrics and PNG in a new folder here
    threads: int = 1  # torch threads; 1 is fastest on a 2-core machine shared with other jobs
    # task
    digits: int = 4  # digits per prompt; the answer is their sum
    eval_prompts: int = 500  # held-out prompts for the greedy accuracy (fixed, never trained on)
    # model: GPT-2 architecture, tiny
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    # warm start: supervised, stopped as soon as it is partly right
    sft_lr: float = 1e-3
    sft_batch: int = 64
    sft_target: float = 0.30  # stop when greedy accuracy on a validation set reaches this
    sft_max_steps: int = 3000
    sft_check_every: int = 5
    # GRPO
    steps: int = 600  # GRPO steps (each: sample, score, extend the buffer, optimize)
    prompts_per_step: int = 64
    group_size: int = 8  # completions per prompt, the G of GRPO
    temperature: float = 1.0  # sampling temperature; the trained policy uses the same one
    max_new_tokens: int = 4
    epochs: int = 1  # passes over each step's data
    minibatch: int = 128
    lr: float = 3e-4  # Adam: linear warm-up, then cosine decay to 0 at `steps`
    warmup_steps: int = 20
    dynamic_sampling: bool = False  # drop groups whose completions all score the same (DAPO)
    clip_epsilon: float = 0.2
    kl_coeff: float = 0.02  # beta of the KL to the reference (k3 estimator)
    entropy_coeff: float = 0.0
    eval_every: int = 10
    time_limit: float = 540.0  # stop GRPO once the run has taken this long (seconds)


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


class CharTokenizer:
    """One token per character of ``"0123456789 ="``, plus end-of-sequence and padding."""

    def __init__(self, chars: str = "0123456789 ="):
        self.itos = list(chars) + ["<eos>", "<pad>"]
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.eos_id = self.stoi["<eos>"]
        self.pad_id = self.stoi["<pad>"]

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        return [self.stoi[c] for c in text]

    def decode(self, ids) -> str:
        """The text up to the first end-of-sequence token (padding is skipped)."""
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            if i != self.pad_id:
                out.append(self.itos[i])
        return "".join(out)


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


def reward(completion: str, digits: list[int]) -> float:
    """1 for exactly the sum, in decimal, followed by end-of-sequence; 0 otherwise."""
    return float(completion == str(sum(digits)))


def completion_rewards(tok: CharTokenizer, tokens: torch.Tensor, digits: torch.Tensor):
    """Rewards of a batch of completions; only a completion that ended (EOS) can score."""
    ended = (tokens == tok.eos_id).any(-1).tolist()
    return torch.tensor(
        [
            reward(tok.decode(row), d) if done else 0.0
            for row, d, done in zip(tokens.tolist(), digits.tolist(), ended)
        ]
    )


# --------------------------------------------------------------------------------------------
# The model, generation and evaluation
# --------------------------------------------------------------------------------------------


def make_model(cfg: Settings, tok: CharTokenizer) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=2 * cfg.digits + cfg.max_new_tokens,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        activation_function="gelu",  # torch's fused GELU, faster on CPU than GPT-2's "gelu_new"
        bos_token_id=tok.eos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    return GPT2LMHeadModel(config)


@torch.no_grad()
def generate(model, prompt_ids, tok: CharTokenizer, max_new_tokens: int, temperature=None):
    """Decode after same-length prompts with a KV cache: greedy, or sampled at a temperature.

    Args:
        prompt_ids: ``[N, P]`` prompt tokens (every prompt has the same length: no padding).
        temperature: ``None`` for greedy decoding.

    Returns:
        ``tokens [N, T]`` (padded after end-of-sequence with ``pad_id``), ``log_prob [N, T]``
        (of the sampled token under ``softmax(logits / temperature)``; 0 on padding) and
        ``mask [N, T]`` (True on real tokens, the end-of-sequence token included), with
        ``T = max_new_tokens``.
    """
    n = prompt_ids.shape[0]
    tokens = torch.full((n, max_new_tokens), tok.pad_id)
    log_prob = torch.zeros(n, max_new_tokens)
    mask = torch.zeros(n, max_new_tokens, dtype=torch.bool)
    finished = torch.zeros(n, dtype=torch.bool)
    out = model(prompt_ids, use_cache=True)
    for t in range(max_new_tokens):
        logits = out.logits[:, -1]  # (N, V)
        if temperature is None:
            nxt = logits.argmax(-1)  # (N,)
            lp = torch.zeros(n)
        else:
            logp = torch.log_softmax(logits / temperature, -1)  # (N, V)
            nxt = torch.multinomial(logp.exp(), 1).squeeze(-1)  # (N,)
            lp = logp.gather(-1, nxt[:, None]).squeeze(-1)
        mask[:, t] = ~finished
        tokens[:, t] = torch.where(finished, tok.pad_id, nxt)
        log_prob[:, t] = torch.where(finished, 0.0, lp)
        finished |= nxt == tok.eos_id
        if finished.all() or t == max_new_tokens - 1:
            break
        out = model(tokens[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
    return tokens, log_prob, mask


def encode_prompts(tok: CharTokenizer, digits: torch.Tensor) -> torch.Tensor:
    return torch.tensor([tok.encode(prompt_text(d)) for d in digits.tolist()])


@torch.no_grad()
def greedy_accuracy(model, tok: CharTokenizer, digits: torch.Tensor, cfg: Settings) -> float:
    tokens, _, _ = generate(model, encode_prompts(tok, digits), tok, cfg.max_new_tokens)
    return completion_rewards(tok, tokens, digits).mean().item()


class ResponseLogits(torch.nn.Module):
    """Teacher-forced logits of the response tokens, ``[B, T, V]``, divided by the temperature.

    The policy GRPO trains is the sampling policy ``softmax(logits / temperature)``, so the
    log-probs recorded while sampling are the "old" log-probs of the importance ratio.
    """

    def __init__(self, model: GPT2LMHeadModel, temperature: float):
        super().__init__()
        self.model = model
        self.temperature = temperature

    def forward(self, prompt_ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        ids = torch.cat([prompt_ids, tokens], -1)  # (B, P + T); padding only after the end
        logits = self.model(ids).logits[:, prompt_ids.shape[-1] - 1 : -1]  # (B, T, V)
        return logits / self.temperature


def make_loss(model: GPT2LMHeadModel, cfg: Settings) -> GRPOLoss:
    """GRPOLoss over the response tokens, with KL to the reference, for the policy ``model``.

    The policy is a torchrl actor: ``(prompt_ids, tokens) -> logits [B, T, V]`` and a
    :class:`~torchrl_grpo.TokenCategorical` over ``"tokens"``. The batch carries the sampler's
    log-probs (``"tokens_log_prob"``), the mask of real tokens, the reference log-probs and the
    advantage written by MCAdvantage.
    """
    policy = ProbabilisticActor(
        TensorDictModule(
            ResponseLogits(model, cfg.temperature), ["prompt_ids", "tokens"], ["logits"]
        ),
        in_keys=["logits"],
        out_keys=["tokens"],
        distribution_class=TokenCategorical,
    )
    loss_fn = GRPOLoss(
        policy,
        clip_epsilon=cfg.clip_epsilon,
        entropy_coeff=cfg.entropy_coeff,
        kl_to_ref_coeff=cfg.kl_coeff,
        kl_to_ref_estimator="k3",
    )
    loss_fn.set_keys(sample_log_prob="tokens_log_prob", mask="mask", ref_log_prob="ref_log_prob")
    return loss_fn


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def warm_start(model, tok, cfg: Settings, gen: torch.Generator, val_digits, exclude) -> int:
    """Supervised next-token training on ``prompt -> answer <eos>`` until partly right.

    Stops at the first check where the greedy accuracy on ``val_digits`` (not the held-out
    evaluation set) reaches ``cfg.sft_target``. Returns the number of steps taken.
    """
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr)
    p = 2 * cfg.digits  # prompt length
    for step in range(1, cfg.sft_max_steps + 1):
        digits = draw_problems(gen, cfg.sft_batch, cfg.digits, exclude)
        answers = [tok.encode(str(s)) + [tok.eos_id] for s in digits.sum(-1).tolist()]
        width = max(map(len, answers))
        targets = torch.tensor([a + [-100] * (width - len(a)) for a in answers])  # (B, W)
        ids = torch.cat([encode_prompts(tok, digits), targets.clamp_min(0)], -1)
        logits = model(ids).logits[:, p - 1 : -1]  # (B, W, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % cfg.sft_check_every == 0:
            if greedy_accuracy(model, tok, val_digits, cfg) >= cfg.sft_target:
                return step
    return cfg.sft_max_steps


def sample_batch(policy_model, ref_model, tok, cfg: Settings, digits: torch.Tensor) -> TensorDict:
    """Sample ``group_size`` completions per prompt and score them: one row per completion.

    Each completion is a trajectory of one step (``("next", "done")`` all True): the response
    tokens padded to ``max_new_tokens`` with a mask, the sampler's per-token log-probs, the
    reference policy's log-probs, and the reward.
    """
    digits = digits.repeat_interleave(cfg.group_size, 0)  # (N, k), N = prompts x G
    prompt_ids = encode_prompts(tok, digits)  # (N, P)
    tokens, log_prob, mask = generate(
        policy_model, prompt_ids, tok, cfg.max_new_tokens, cfg.temperature
    )
    with torch.no_grad():
        ref_logits = ResponseLogits(ref_model, cfg.temperature)(prompt_ids, tokens)
        ref_log_prob = torch.log_softmax(ref_logits, -1).gather(-1, tokens[..., None])[..., 0]
    n = digits.shape[0]
    rewards = completion_rewards(tok, tokens, digits)  # (N,)
    return TensorDict(
        {
            "query": [prompt_text(d) for d in digits.tolist()],  # the group id of MCAdvantage
            "prompt_ids": prompt_ids,
            "tokens": tokens,
            "tokens_log_prob": log_prob,
            "ref_log_prob": torch.where(mask, ref_log_prob, 0.0),
            "mask": mask,
            "next": {
                "reward": rewards[:, None],  # (N, 1)
                "done": torch.ones(n, 1, dtype=torch.bool),
            },
        },
        batch_size=[n],
    )


METRICS = ("ESS", "clip_fraction", "kl_to_ref", "entropy", "kl_approx")


def plot(history: dict, path: str, acc_before: float) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    ax.plot(history["step"], history["reward"], color="tab:blue", alpha=0.6, lw=1,
            label="mean reward of the samples")  # fmt: skip
    ax.plot(history["eval_step"], history["accuracy"], "o-", color="tab:red", ms=3,
            label="greedy accuracy, held-out prompts")  # fmt: skip
    ax.axhline(acc_before, color="gray", ls="--", lw=1, label="after the warm start")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("GRPO on digit sums: tiny GPT-2, CPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    hf_logging.set_verbosity_error()
    tok = CharTokenizer()

    # held-out evaluation set: the same 500 prompts for every seed, excluded from all training
    eval_digits = draw_problems(
        torch.Generator().manual_seed(1234), cfg.eval_prompts, cfg.digits, torch.tensor([-1])
    )
    eval_codes = problem_code(eval_digits)
    train_gen = torch.Generator().manual_seed(cfg.seed)
    val_digits = draw_problems(train_gen, 200, cfg.digits, eval_codes)  # stops the warm start

    model = make_model(cfg, tok)
    sft_steps = warm_start(model, tok, cfg, train_gen, val_digits, eval_codes)
    acc_before = greedy_accuracy(model, tok, eval_digits, cfg)
    print(f"warm start: {sft_steps} supervised steps, greedy accuracy {acc_before:.3f} "
          f"on {cfg.eval_prompts} held-out prompts ({time.perf_counter() - T0:.0f} s)")  # fmt: skip
    ref_model = copy.deepcopy(model).requires_grad_(False)  # the frozen reference policy

    loss_fn = make_loss(model, cfg)
    optim = torch.optim.Adam(loss_fn.parameters(), lr=cfg.lr)

    rows = cfg.prompts_per_step * cfg.group_size
    rb = ReplayBuffer(
        storage=LazyTensorStorage(rows),
        sampler=SamplerWithoutReplacement(),
        batch_size=cfg.minibatch,
    )
    # extend() runs the transforms' inverse passes last-appended first: MCAdvantage reads the
    # prompt strings, then ExcludeTransform drops them (the storage does not need them)
    rb.append_transform(ExcludeTransform("query", inverse=True))
    rb.append_transform(
        MCAdvantage(
            grpo_size=cfg.group_size,
            prompt_key="query",
            trajectory_return="sum",
            keep_return_bounds=(0.0, 1.0) if cfg.dynamic_sampling else None,
        )
    )
    warmup = min(cfg.warmup_steps, cfg.steps - 1)
    schedule = torch.optim.lr_scheduler.SequentialLR(
        optim,
        [
            torch.optim.lr_scheduler.LinearLR(optim, 0.05, total_iters=warmup),
            torch.optim.lr_scheduler.CosineAnnealingLR(optim, cfg.steps - warmup),
        ],
        milestones=[warmup],
    )

    logger = CSVLogger(generate_exp_name("llm_grpo", f"seed{cfg.seed}"), log_dir=cfg.out)
    history = {"step": [], "reward": [], "eval_step": [0], "accuracy": [acc_before]}
    acc = acc_before
    pbar = tqdm(range(1, cfg.steps + 1), desc="GRPO", mininterval=2.0)
    for step in pbar:
        digits = draw_problems(train_gen, cfg.prompts_per_step, cfg.digits, eval_codes)
        batch = sample_batch(model, ref_model, tok, cfg, digits)
        rb.empty()
        rb.extend(batch)  # MCAdvantage writes "advantage" per completion, group by prompt

        metrics = []  # one row of METRICS per minibatch
        for _ in range(cfg.epochs * -(-len(rb) // cfg.minibatch)):  # none if all were dropped
            out = loss_fn(rb.sample())
            loss = out.loss_objective + out.loss_kl_to_ref + out.loss_entropy
            optim.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(loss_fn.parameters(), 1.0)
            optim.step()
            metrics.append([getattr(out, k).item() for k in METRICS])
        schedule.step()
        # "kept": the share of completions stored (below 1 only with --dynamic-sampling)
        logs = {"reward": batch["next", "reward"].mean().item(), "kept": len(rb) / rows}
        if metrics:
            logs.update(zip(METRICS, torch.tensor(metrics).mean(0).tolist()))

        history["step"].append(step)
        history["reward"].append(logs["reward"])
        out_of_time = time.perf_counter() - T0 > cfg.time_limit
        if step % cfg.eval_every == 0 or step == cfg.steps or out_of_time:
            acc = greedy_accuracy(model, tok, eval_digits, cfg)
            logs["accuracy"] = acc
            history["eval_step"].append(step)
            history["accuracy"].append(acc)
            pbar.write(f"step {step:4d}  reward {logs['reward']:.3f}  greedy accuracy {acc:.3f}  "
                       f"({time.perf_counter() - T0:.0f} s)")  # fmt: skip
        for name, value in logs.items():
            logger.log_scalar(name, value, step=step)
        pbar.set_postfix(reward=f"{logs['reward']:.2f}", acc=f"{acc:.2f}",
                         ESS=f"{logs.get('ESS', 1):.3f}", refresh=False)  # fmt: skip
        if out_of_time:
            print(f"time limit {cfg.time_limit:.0f} s reached after {step} GRPO steps")
            break
    pbar.close()

    acc_after = history["accuracy"][-1]
    run_dir = os.path.join(logger.log_dir, logger.exp_name)
    png = os.path.join(run_dir, "llm_grpo.png")
    plot(history, png, acc_before)
    wall_s = time.perf_counter() - T0
    print(f"greedy accuracy {acc_before:.3f} -> {acc_after:.3f} after {step} GRPO steps; "
          f"metrics in {run_dir}/scalars, plot in {png}")  # fmt: skip
    print(f"RESULT acc_before={acc_before:.4f} acc_after={acc_after:.4f} wall_s={wall_s:.1f}")
    return {"acc_before": acc_before, "acc_after": acc_after, "wall_s": wall_s}


if __name__ == "__main__":
    main()
