"""Multi-turn GRPO: a tiny language model learns to use what the environment tells it, on a CPU.

The task: four digits, one of them hidden (``"3 ? 1 4="``); the answer is their sum. At each
turn the model either answers (a number and end-of-sequence: the dialog ends, with reward 1 if
it is the sum) or calls a tool (``"?"`` and end-of-sequence: reward 0, and the environment
replies with the digits, none hidden, ``"|3 5 1 4="``). One turn can only guess the hidden
digit; two can ask first and then compute the sum: the first turn has to learn to ask, the
second to use the reply.

Step-wise GRPO: each turn is a step of a trajectory (the dialog), the group is the task (the
same digits, ``--group-size`` dialogs), and the group-relative advantage of the dialog's final
reward is given to every one of its turns (``MCAdvantage(trajectory_return="last")``). Built
from torchrl's LLM stack, as ``examples/llm_grpo.py``, nothing downloaded:

* a ``DatasetChatEnv`` in tokens mode whose transforms score each turn and write the tool's
  reply (``torchrl_grpo.llm.TurnReward`` and ``ToolReply`` on three small functions), end
  dialogs after ``--max-turns`` (``StepCounter``), and keep each dialog's tokens exact across
  turns and give it an id (``torchrl_grpo.llm.ExactTurns``), with torchrl's ``InitTracker``
  (its collectors ask for it);
* an ``LLMCollector`` sampling with torchrl's ``TransformersWrapper``, writing each batch of
  turns into a ``ReplayBuffer`` whose ``torchrl_grpo.MCAdvantage`` joins the turns of a dialog
  cut by a batch (``traj_key="dialog_id"``), groups the dialogs by task (``task_id``) and
  releases a group when its dialogs are all done;
* the released turns scored once per GRPO step by torchrl's ``RetrieveLogProb`` on
  ``torchrl_grpo.LeanTransformersWrapper`` (the policy's and the frozen reference's
  log-probs), then ``torchrl_grpo.GRPOLoss`` over each turn's own answer
  (``masking_strategy="sft"``: the dialog before it is its prompt).

The old log-probs are those of the weights that start the GRPO step, so the first minibatch's
ratio is exactly 1: its ESS (``first_minibatch_ess_min``, the smallest over the steps) checks
that no log-prob, mask or advantage is shifted against its token. Each stored turn's tokens are
asserted equal to the sampled ones (prompt and answer, no re-tokenization).

``--max-turns 1`` is the single-turn policy: the same run with one answer per task (a tool
call is then a wrong answer). Run (needs the ``llm`` and ``examples`` extras)::

    .venv/bin/python examples/llm_grpo_multiturn.py                  # about 4 minutes
    .venv/bin/python examples/llm_grpo_multiturn.py --max-turns 1    # the single-turn policy
    .venv/bin/python examples/llm_grpo_multiturn.py --help           # every setting

It prints the success before and after GRPO (greedy, on held-out tasks) per turn, logs every
metric with torchrl's ``CSVLogger`` under ``--out``, saves ``llm_grpo_multiturn.png`` and the
model and tokenizer there, and ends with one line (wrapped here)::

    RESULT success_before=<f> success_after=<f> turns_mean=<f> wall_s=<f>
        first_minibatch_ess_min=<f>
"""

# ruff: noqa: E402  (the clock starts before the imports: wall_s covers the whole run)
import time

T0 = time.perf_counter()

import copy
import gc
import sys
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from tensordict import TensorDict, lazy_stack, set_list_to_stack
from torch.utils.data import DataLoader, IterableDataset
from torchrl.collectors.llm import LLMCollector
from torchrl.data import LazyStackStorage, ReplayBuffer
from torchrl.envs import InitTracker, StepCounter
from torchrl.envs.llm import DatasetChatEnv
from torchrl.envs.utils import step_mdp
from torchrl.record.loggers import CSVLogger, generate_exp_name
from tqdm import tqdm
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llm_grpo  # noqa: E402  (the single-turn example: tokenizer, model, wrappers, schedule)

from torchrl_grpo import GRPOLoss, MCAdvantage
from torchrl_grpo.llm import ExactTurns, ToolReply, TurnReward
from torchrl_grpo.mcadvantage import RewardToGo, TrajectoryIds
from torchrl_grpo.sampler import group_minibatches

set_list_to_stack(True).set()

EOS = llm_grpo.EOS
HIDDEN = "?"
REPLY = "|"  # starts the environment's reply: an answer cut short cannot run into it


@dataclass
class Settings(llm_grpo.Settings):
    """Every setting of the run; each is a command-line flag (``--max-turns 1``)."""

    out: str = field(
        default="runs/llm_grpo_multiturn",
        metadata={"help": "each run writes its metrics, plot and model in a new folder here"},
    )
    max_turns: int = field(
        default=2,
        metadata={
            "help": "turns a dialog may take, at least 1 (1: the single-turn policy, which "
            "can only guess); a turn '?' calls the tool, which reveals the hidden digit, and "
            "the dialog goes on; an answer ends it"
        },
    )
    sft_ask: float = field(
        default=0.3,
        metadata={"help": "warm start: the share of dialogs that ask the tool (the others guess)"},
    )
    estimator: str = field(
        default="broadcast",
        metadata={
            "choices": ("broadcast", "per_step"),
            "help": "broadcast: the dialog's final reward, group-relative, on every turn "
            "(Trinity-RFT's step_wise_grpo, rLLM's broadcast); per_step: each turn's "
            "discounted return compared with the same turn of the task's other dialogs "
            "(rLLM's per_step)",
        },
    )
    turn_gamma: float = field(
        default=0.0, metadata={"help": "per_step: the discount of later turns' rewards"}
    )
    prompts_per_step: int = field(
        default=32, metadata={"help": "tasks whose dialogs start in one collector batch"}
    )
    minibatch: int = field(default=64, metadata={"help": "turns per optimizer step"})
    group_minibatches: bool = field(
        default=True,
        metadata={
            "help": "minibatches of whole tasks (a task's dialogs share its prompt, a dialog's "
            "turns their history: computed once from --min-shared-length tokens); "
            "--no-group-minibatches: turns drawn one by one"
        },
    )
    steps: int = field(default=150, metadata={"help": "GRPO steps (one collector batch each)"})
    sft_target: float = field(
        default=0.45,
        metadata={
            "help": "warm start: stop once the answer after the tool's is right this often "
            "(greedy, on validation tasks)"
        },
    )
    # lower than the single-turn example's 5e-4, which first unlearns the answer after the
    # tool's while the model learns to ask (docs/tutorial_multiturn.rst)
    lr: float = field(default=2e-4, metadata=llm_grpo.Settings.__dataclass_fields__["lr"].metadata)
    time_limit: float = field(
        default=220.0,
        metadata={"help": "stop GRPO once the run (imports included) has taken this long, in s"},
    )


# --------------------------------------------------------------------------------------------
# The task: a hidden digit, and a tool that reveals it
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    prompt: str  # "3 ? 1 4="
    reveal: str  # "|3 5 1 4=": what the tool answers
    answer: str  # "13"


def draw(gen: torch.Generator, n: int, digits: int = 4) -> list[Problem]:
    """``n`` random problems: ``digits`` digits, one of them hidden, and their sum."""
    rows = torch.randint(0, 10, (n, digits), generator=gen).tolist()
    hidden = torch.randint(0, digits, (n,), generator=gen).tolist()
    problems = []
    for row, h in zip(rows, hidden, strict=True):
        shown = [HIDDEN if i == h else str(d) for i, d in enumerate(row)]
        problems.append(
            Problem(" ".join(shown) + "=", REPLY + llm_grpo.prompt_text(row), str(sum(row)))
        )
    return problems


def as_tensordict(problems: list[Problem], first_id: int) -> TensorDict:
    """Problems as the env's data: the prompt (``"query"``), the tool's answer, the sum and a
    task id (the group key of ``MCAdvantage``: the dialogs of one task form a group)."""
    n = len(problems)
    return TensorDict(
        query=[p.prompt for p in problems],
        reveal=[p.reveal for p in problems],
        answer=[p.answer for p in problems],
        task_id=torch.arange(first_id, first_id + n),
        batch_size=[n],
    )


class Tasks(IterableDataset):
    """Endless batches of ``batch`` fresh problems, none of whose prompts is in ``exclude``;
    task ids count up from ``first_id``."""

    def __init__(self, gen, batch: int, exclude: set[str], digits: int, first_id: int = 0):
        self.gen, self.batch, self.exclude, self.digits = gen, batch, exclude, digits
        self.next_id = first_id

    def __iter__(self):
        while True:
            problems = draw(self.gen, 2 * self.batch, self.digits)
            problems = [p for p in problems if p.prompt not in self.exclude][: self.batch]
            yield as_tensordict(problems, self.next_id)
            self.next_id += len(problems)


# The environment's side of a turn: a tool call, or an answer. A turn that is "?" and
# end-of-sequence calls the tool: reward 0, and the reply "reveal" (the digits, none hidden),
# which ExactTurns appends to the dialog. Any other turn is an answer: reward 1 if it is exactly
# the sum followed by end-of-sequence, else 0, and the dialog ends (terminated). StepCounter
# ends a dialog that keeps asking. TurnReward and ToolReply call these once per row.


def right(text: str, row) -> float:
    """The turn's reward: 1 for exactly the sum and end-of-sequence."""
    return llm_grpo.reward(text, row["answer"])


def answers(text: str, row) -> bool:
    """Whether the turn answers (and ends the dialog): any turn but the tool call."""
    return text != HIDDEN + EOS


def reveal(text: str, row) -> str:
    """The tool's reply: the digits, none hidden (read by the next turn after a tool call)."""
    return row["reveal"]


def make_env(
    tokenizer,
    loader,
    batch: int,
    cfg: Settings,
    repeats: int | None = None,
    max_turns: int | None = None,
):
    """The task as a torchrl LLM env: ``batch`` dialogs, each prompt ``repeats`` times in a row,
    each of at most ``max_turns`` turns (default ``--max-turns``)."""
    env = DatasetChatEnv.from_dataloader(
        loader,
        batch_size=(batch,),
        repeats=repeats,
        tokenizer=tokenizer,
        input_mode="tokens",
        template_kwargs={"chat_template": tokenizer.chat_template},
    )
    env.append_transform(TurnReward(right, tokenizer, ends=answers))
    env.append_transform(ToolReply(reveal, tokenizer))
    env.append_transform(StepCounter(max_steps=max_turns or cfg.max_turns))  # ends dialogs...
    # ... before ExactTurns builds the next prompts: an ended dialog's is not checked, and one
    # that would go on past the model's context ends there, truncated and counted (context()
    # leaves room: none does)
    max_length = context(cfg) - cfg.max_new_tokens
    turns = ExactTurns(tokenizer.pad_token_id, tokenizer.eos_token_id, max_length=max_length)
    env.append_transform(turns)
    # torchrl's collectors want an "is_init" entry for any policy module (a FutureWarning
    # without it in torchrl 0.14; from 0.15 they append this transform themselves)
    env.append_transform(InitTracker())
    return env


def context(cfg: Settings) -> int:
    """The model's context: room for ``--max-turns`` turns of a prompt, an answer and a reply
    (twice what a dialog needs: ``prompt + (turns - 1) * (answer + reply) + answer``)."""
    return 2 * cfg.max_turns * (2 * cfg.digits + cfg.max_new_tokens)


def parse_args(argv=None) -> Settings:
    """The settings of the run (``--help``); values that make no sense are refused, the flag
    and the value named, before anything is built."""
    cfg = llm_grpo.parse_args(argv, None, Settings)  # the answer: a sum of --digits digits
    at_least_one = (
        "max_turns",
        "prompts_per_step",
        "minibatch",
        "epochs",
        "digits",
        "eval_prompts",
        "eval_every",
        "sft_batch",
        "sft_max_steps",
        "sft_check_every",
    )
    shares = ("sft_ask", "sft_target", "turn_gamma")
    wrong = [
        f"--{name.replace('_', '-')} {getattr(cfg, name)}: at least 1"
        for name in at_least_one
        if getattr(cfg, name) < 1
    ]
    wrong += [
        f"--{name.replace('_', '-')} {getattr(cfg, name)}: between 0 and 1"
        for name in shares
        if not 0 <= getattr(cfg, name) <= 1
    ]
    if not cfg.time_limit > 0:
        wrong.append(f"--time-limit {cfg.time_limit}: seconds, more than 0")
    if cfg.task != "digit-sum":  # this example's dialogs ask for the sum, turn by turn
        wrong.append(f"--task {cfg.task}: the single-turn examples only (llm_grpo.py...)")
    if wrong:
        print(f"{Path(sys.argv[0]).name}: error: " + "; ".join(wrong), file=sys.stderr)
        sys.exit(2)
    return cfg


class GreedySuccess:
    """Greedy dialogs on a fixed set of tasks: how they went, turn by turn.

    The env is reset once (its prompts never change); each call runs ``--max-turns`` turns from
    there. Returns the share of the tasks solved (``success``), solved at the first turn
    (``turn1``: a guess), whose first turn asked the tool (``asked``), solved at the second turn
    among those (``turn2_after_ask``), and the turns a dialog took (``turns_mean``).
    """

    def __init__(self, tokenizer, problems: list[Problem], policy, cfg: Settings, max_turns=None):
        data = as_tensordict(problems, 0)
        loader = DataLoader([data], batch_size=None, collate_fn=lambda td: td)
        self.max_turns = max_turns or cfg.max_turns
        self.env = make_env(tokenizer, loader, len(problems), cfg, max_turns=self.max_turns)
        self.start = self.env.reset()
        self.policy = policy
        self.completions = llm_grpo.TaskReward(tokenizer, None).completions

    @torch.no_grad()
    def __call__(self) -> dict:
        td = self.start.clone()  # the sampler writes into the nested entries: not a shallow copy
        n = td.shape[0]
        solved_at = torch.zeros(n, dtype=torch.long)  # 0: never
        ended_at = torch.zeros(n, dtype=torch.long)
        asks = []  # (n,) per turn: the turn called the tool
        for turn in range(1, self.max_turns + 1):
            td = self.env.step(self.policy(td))
            going = ended_at == 0
            solved_at[td["next", "reward"].view(n).bool() & going] = turn
            ended_at[td["next", "done"].view(n) & going] = turn
            texts = self.completions(td.get(("tokens", "response"), as_list=True))
            asks.append(torch.tensor([t == HIDDEN + EOS for t in texts]))
            td = step_mdp(td)
        asked = ended_at != 1
        out = {
            "success": float((solved_at > 0).float().mean()),
            "turn1": float((solved_at == 1).float().mean()),
            "asked": float(asked.float().mean()),
            "turns_mean": float(ended_at.float().mean()),
        }
        if self.max_turns > 1 and bool(asked.any()):
            out["turn2_after_ask"] = float((solved_at[asked] == 2).float().mean())
            out["asked_again"] = float(asks[1][asked].float().mean())
        return out


# --------------------------------------------------------------------------------------------
# Warm start: a few supervised dialogs
# --------------------------------------------------------------------------------------------


def sft_dialog(problem: Problem, guess: int, ask: bool) -> tuple[str, list[tuple[int, int]]]:
    """A dialog's text and the character spans of the turns to learn: a guess (the visible
    digits' sum plus ``guess`` for the hidden one), or, with ``ask``, the tool call, the
    tool's answer and the sum."""
    text = problem.prompt
    if not ask:
        first = str(sum(int(c) for c in text if c.isdigit()) + guess) + EOS
        return text + first, [(len(text), len(text) + len(first))]
    spans = [(len(text), len(text) + len(HIDDEN + EOS))]
    text += HIDDEN + EOS + problem.reveal
    spans.append((len(text), len(text) + len(problem.answer + EOS)))
    return text + problem.answer + EOS, spans


def warm_start(model, tokenizer, cfg: Settings, gen, exclude, skill) -> int:
    """Supervised next-token training on dialogs until the answer after the tool's (``skill``:
    greedy, on validation tasks whose dialogs already asked) is right ``--sft-target`` of the
    time; returns the steps taken.

    ``--sft-ask`` of the dialogs ask the tool first, the others guess at once: the warm start
    leaves the model guessing more often than asking, and GRPO has to find out that the tool
    pays. The same warm start serves ``--max-turns 1`` (the single-turn policy, for which a
    tool call is a wrong answer). The loss is the mean negative log-prob of the learned turns'
    tokens, read from the scoring wrapper on the ragged dialogs.
    """
    scorer = llm_grpo.make_scorer(model, tokenizer, cfg, pad_output=False)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr)
    for step in range(1, cfg.sft_max_steps + 1):
        problems = [p for p in draw(gen, 2 * cfg.sft_batch, cfg.digits) if p.prompt not in exclude]
        problems = problems[: cfg.sft_batch]
        guesses = torch.randint(0, 10, (len(problems),), generator=gen).tolist()
        asks = (torch.rand(len(problems), generator=gen) < cfg.sft_ask).tolist()
        ids, targets = [], []
        for problem, guess, ask in zip(problems, guesses, asks, strict=True):
            text, spans = sft_dialog(problem, guess, ask)
            enc = tokenizer(text, return_offsets_mapping=True)
            ids.append(torch.tensor(enc["input_ids"]))
            starts = [o[0] for o in enc["offset_mapping"]]
            targets.append(torch.tensor([any(a <= o < b for a, b in spans) for o in starts]))
        batch = lazy_stack([TensorDict({("tokens", "full"): i}) for i in ids])
        log_probs = scorer(batch).get(("log_probs", "full"), as_padded_tensor=True)  # (B, W)
        mask = torch.nn.utils.rnn.pad_sequence(targets, batch_first=True)  # (B, W)
        loss = -log_probs[mask].sum() / mask.sum()
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % cfg.sft_check_every == 0 and skill()["success"] >= cfg.sft_target:
            return step
    return cfg.sft_max_steps


def asked(problems: list[Problem]) -> list[Problem]:
    """The same problems, their dialogs already past the tool call: what the answer after the
    tool's is measured on."""
    return [Problem(p.prompt + HIDDEN + EOS + p.reveal, p.reveal, p.answer) for p in problems]


# --------------------------------------------------------------------------------------------
# GRPO
# --------------------------------------------------------------------------------------------


def make_collector(cfg: Settings, model, tokenizer, gen, exclude):
    """The collector and the buffer it fills: each batch is one turn of every dialog in the env
    (``prompts_per_step * group_size`` of them); ``MCAdvantage`` holds the turns of unfinished
    dialogs and incomplete groups and releases whole groups."""
    rows = cfg.prompts_per_step * cfg.group_size
    loader = DataLoader(
        Tasks(gen, cfg.prompts_per_step, exclude, cfg.digits),
        batch_size=None,
        collate_fn=lambda td: td,
    )
    env = make_env(tokenizer, loader, rows, cfg, repeats=cfg.group_size)
    if cfg.estimator == "broadcast":  # step-wise GRPO: the dialog's final reward on each turn
        estimator = {"trajectory_return": "last"}
    else:  # each turn against the same turn of the other dialogs of its task
        estimator = {"estimator": RewardToGo(cfg.turn_gamma, baseline="step_group")}
    advantage = MCAdvantage(
        grpo_size=cfg.group_size,
        prompt_key="task_id",
        traj_key=TrajectoryIds("dialog_id", step_count_key="step_count"),
        **estimator,
    )
    rb = ReplayBuffer(storage=LazyStackStorage(100 * rows), transform=advantage)
    collector = LLMCollector(
        env,
        policy=llm_grpo.make_sampler(model, tokenizer, cfg),
        dialog_turns_per_batch=rows,
        total_dialog_turns=-1,
        replay_buffer=rb,
    )
    return collector, rb, advantage


def check_exact(batch, pad_id: int) -> None:
    """Each stored turn is what was sampled: its full sequence is its prompt then its answer,
    with no padding inside (the tokens trained on are the tokens sampled)."""
    prompts = batch.get(("tokens", "prompt"), as_list=True)
    responses = batch.get(("tokens", "response"), as_list=True)
    for full, prompt, response in zip(
        batch.get(("tokens", "full"), as_list=True), prompts, responses, strict=True
    ):
        assert torch.equal(full, torch.cat([prompt, response])), "a turn is not prompt + answer"
        assert not bool((full == pad_id).any()), "padding inside a stored turn"


def plot(history: dict, path, before: dict, title: str) -> None:
    """Success per GRPO step: the sampled dialogs', and the greedy one on held-out tasks with
    how it is reached (a right guess at the first turn, or the tool's answer first)."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    ax.plot(
        history["step"],
        history["reward"],
        color="tab:blue",
        alpha=0.6,
        lw=1,
        label="sampled dialogs solved",
    )
    curves = [  # (entry, style, colour, label), one point per evaluation
        ("success", "o-", "tab:red", "greedy success, held-out tasks"),
        ("turn1", "s--", "tab:orange", "... solved by a first-turn guess"),
        ("asked", "^:", "tab:green", "greedy first turn asks the tool"),
    ]
    for key, style, colour, label in curves:
        ax.plot(history["eval_step"], history[key], style, color=colour, ms=3, label=label)
    ax.axhline(before["success"], color="gray", ls="--", lw=1, label="after the warm start")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_xlabel("GRPO step")
    ax.legend(loc="center right", fontsize=7)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> dict:
    """Warm start, then step-wise GRPO over dialogs of ``--max-turns`` turns."""
    start = T0 if main.first_call else time.perf_counter()
    main.first_call = False
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tokenizer = llm_grpo.make_tokenizer("0123456789 =" + HIDDEN + REPLY)
    model = llm_grpo.make_model(cfg, tokenizer, context(cfg)).to(cfg.device)

    eval_problems = draw(torch.Generator().manual_seed(1234), cfg.eval_prompts, cfg.digits)
    held_out = {p.prompt for p in eval_problems}
    gen = torch.Generator().manual_seed(cfg.seed)
    val_problems = [p for p in draw(gen, 400, cfg.digits) if p.prompt not in held_out][:200]
    greedy = llm_grpo.make_sampler(model, tokenizer, cfg, greedy=True)
    # the warm start stops on the answer after the tool's: one turn of dialogs that asked
    skill = GreedySuccess(tokenizer, asked(val_problems), greedy, cfg, max_turns=1)
    eval_success = GreedySuccess(tokenizer, eval_problems, greedy, cfg)
    sft_steps = warm_start(model, tokenizer, cfg, gen, held_out, skill)
    before = eval_success()
    print(
        f"warm start: {sft_steps} supervised steps; greedy {describe(before)} "
        f"({time.perf_counter() - start:.0f} s)"
    )
    ref_model = copy.deepcopy(model).requires_grad_(False) if cfg.kl_coeff else None

    collector, rb, advantage = make_collector(cfg, model, tokenizer, gen, held_out)
    # the old and reference log-probs on each turn's answer only (the loss reads nothing else;
    # no reference at --kl-coeff 0)
    score = llm_grpo.log_prob_scorers(cfg, model, ref_model, tokenizer, pad_output=False)
    loss_fn = GRPOLoss(
        llm_grpo.make_scorer(model, tokenizer, cfg, pad_output=False, response_only=True),
        masking_strategy="sft",
        clip_epsilon=(cfg.clip_epsilon, cfg.clip_epsilon_high),
        kl_to_ref_coeff=cfg.kl_coeff or None,
        entropy_coeff=cfg.entropy_coeff,
    )
    loss_fn.set_keys(sample_log_prob=("next", "log_probs", "full"))
    optim = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    schedule = llm_grpo.lr_schedule(optim, cfg, deadline=start + cfg.time_limit)
    logger = CSVLogger(generate_exp_name("multiturn", f"seed{cfg.seed}"), log_dir=cfg.out)

    history = {"step": [], "reward": [], "eval_step": [0]}
    history |= {key: [before[key]] for key in ("success", "turn1", "asked")}
    ess_min, step, last = 1.0, 0, before
    gc.freeze()
    bar = tqdm(total=cfg.steps, desc="GRPO", mininterval=2.0)
    for _ in collector:  # each batch: one turn of every dialog, into rb through MCAdvantage
        if len(rb) == 0:
            continue
        step += 1
        batch = rb[:]
        rb.empty()
        check_exact(batch, tokenizer.pad_token_id)
        with torch.no_grad():  # the old and reference log-probs, by the weights of this step
            for transform in score:
                batch = transform(batch)
        metrics = {"turns": len(batch)}
        tasks = batch["task_id"].reshape(len(batch), -1).tolist()
        for epoch in range(cfg.epochs):  # a task's dialogs in one minibatch: its prompt shared
            if cfg.group_minibatches:
                minibatches = group_minibatches(tasks, cfg.minibatch)
            else:
                minibatches = torch.randperm(len(batch)).split(cfg.minibatch)
            for first, rows in enumerate(minibatches):
                out = loss_fn(batch[rows])
                if epoch == 0 and first == 0:
                    ess_min = min(ess_min, float(out.ESS))
                    metrics.update(ess_first=float(out.ESS), clip_first=float(out.clip_fraction))
                optim.zero_grad()
                out.total_loss().backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optim.step()
        schedule.step()
        collector.update_policy_weights_()
        last_turns = batch["next", "done"].reshape(len(batch), -1).any(-1)  # (N,) each dialog's
        rewards = batch["next", "reward"].reshape(len(batch), -1).sum(-1)  # (N,)
        reward = float(rewards[last_turns].mean())
        turn = batch["step_count"].reshape(len(batch))
        for k in range(cfg.max_turns):  # the sampled turns' success, turn by turn
            if bool((turn == k).any()):
                metrics[f"turn{k + 1}_reward"] = float(rewards[turn == k].mean())
        history["step"].append(step)
        history["reward"].append(reward)
        metrics.update(reward=reward, loss=float(out.loss_objective), lr=schedule.get_last_lr()[0])
        out_of_time = time.perf_counter() - start > cfg.time_limit
        if step % cfg.eval_every == 0 or step == cfg.steps or out_of_time:
            now = last = eval_success()
            history["eval_step"].append(step)
            for key in ("success", "turn1", "asked"):
                history[key].append(now[key])
            metrics.update({f"eval_{k}": v for k, v in now.items()})
            tqdm.write(
                f"step {step:4d}  greedy {describe(now)}  ({time.perf_counter() - start:.0f} s)"
            )
        for name, value in metrics.items():
            logger.log_scalar(name, value, step=step)
        bar.update(1)
        bar.set_postfix(reward=f"{reward:.2f}", ess=f"{metrics['ess_first']:.4f}")
        if step >= cfg.steps or out_of_time:
            break
    bar.close()
    collector.shutdown()
    after = last if history["eval_step"][-1] == step else eval_success()

    run_dir = Path(logger.log_dir) / logger.exp_name
    title = f"Step-wise GRPO, {cfg.max_turns} turn(s): hidden-digit sums, tiny Qwen2, CPU"
    plot(history, run_dir / "llm_grpo_multiturn.png", before, title)
    model.save_pretrained(run_dir / "model")
    tokenizer.save_pretrained(run_dir / "tokenizer")
    llm_grpo.remove_empty_folders(run_dir)
    wall_s = time.perf_counter() - start
    print(f"greedy before: {describe(before)}")
    print(f"greedy after {step} GRPO steps: {describe(after)}; in {run_dir}")
    print(
        f"RESULT success_before={before['success']:.4f} success_after={after['success']:.4f} "
        f"turns_mean={after['turns_mean']:.4f} wall_s={wall_s:.1f} "
        f"first_minibatch_ess_min={ess_min:.6f}"
    )
    return {
        "before": before,
        "after": after,
        "wall_s": wall_s,
        "ess_min": ess_min,
        "run_dir": run_dir,
        "steps": step,
    }


main.first_call = True


def describe(result: dict) -> str:
    parts = [f"success {result['success']:.3f}", f"solved at turn 1 {result['turn1']:.3f}"]
    parts.append(f"asked the tool {result['asked']:.3f}")
    if "turn2_after_ask" in result:
        parts.append(f"solved at turn 2 after asking {result['turn2_after_ask']:.3f}")
        parts.append(f"asked again {result['asked_again']:.3f}")
    parts.append(f"turns {result['turns_mean']:.2f}")
    return ", ".join(parts)


if __name__ == "__main__":
    main()
