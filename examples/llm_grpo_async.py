"""Asynchronous GRPO: the task, model, warm start and evaluation of ``llm_grpo.py``, with the
sampling moved to Ray actors that keep generating while the trainer learns.

* ``--collectors`` torchrl ``RayLLMCollector`` actors sample ``group_size`` completions per
  prompt with :class:`torchrl_grpo.llm.ExactLogProbsTransformersWrapper` (torchrl's sampler,
  whose generation log-probs keep the first token's value: they are the behaviour policy's) and
  stamp each row with its ``policy_version`` (``track_policy_version=True``);
* they write into a torchrl ``RayReplayBuffer`` (a ring of ``--buffer-steps`` steps' rows, in
  its own actor) whose transform is ``torchrl_grpo.MCAdvantage``: group-relative advantages,
  trajectories lagging more than ``--max-policy-lag`` versions behind the trainer dropped;
* the trainer (this process) samples a step's rows, scores them under its current model (the
  proximal policy) and the frozen reference, runs ``GRPOLoss`` for ``--epochs`` passes, and
  pushes the new weights to every collector with torchrl's ``RayWeightSyncScheme`` (gloo).

The correction for the lag (``--correction``): ``decoupled`` (default) is decoupled PPO (AReaL,
Fu et al., 2025): the ratio and its clip are taken against the proximal policy (the trainer's
model before this step's update), and each token is weighted by ``pi_prox / pi_behaviour``,
the sampler's log-probs. The clip then bounds how far one update moves the policy, whatever
the data's age, and the weight corrects for the age: the trust region of PPO survives a lag of
several versions (``corrections=[Decoupled()]``). ``tis`` (truncated importance sampling,
``corrections=[TIS(2.0)]``) takes the ratio against the proximal policy too but only
multiplies each token by ``min(pi_prox / pi_behaviour, 2)``, a correction designed for small
train/inference mismatches, not for stale policies.

Run (needs the ``llm``, ``examples`` and ``dist`` extras)::

    .venv/bin/python examples/llm_grpo_async.py                    # defaults: about 3 minutes
    .venv/bin/python examples/llm_grpo_async.py --collectors 2 --correction tis
    .venv/bin/python examples/llm_grpo_async.py --help             # every setting

It logs every metric (policy lags, ESS, accuracy...) with torchrl's ``CSVLogger`` under
``--out``, saves ``llm_grpo_async.png`` and the trained model there, prints where the time of
each process went, and ends with one line::

    RESULT acc_before=<float> acc_after=<float> wall_s=<float> max_lag=<int>
"""

# ruff: noqa: E402  (the clock starts before the imports: wall_s covers the whole run)
import time

T0 = time.perf_counter()
#: The run's clock: the first main() call's starts at import (the budget counts imports), a
#: later call's at the call.
CLOCK = {"start": T0, "first_call": True}

import collections
import contextlib
import copy
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import llm_grpo as sync  # the synchronous example, in this folder
import matplotlib.pyplot as plt
import ray
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader
from torchrl.collectors.llm import RayLLMCollector
from torchrl.data import LazyStackStorage, ReplayBuffer
from torchrl.data.replay_buffers.ray_buffer import RayReplayBuffer
from torchrl.envs import Compose, ExcludeTransform, Transform
from torchrl.envs.llm import RetrieveLogProb
from torchrl.record.loggers import CSVLogger, generate_exp_name
from torchrl.weight_update import RayWeightSyncScheme
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from torchrl_grpo import GRPOLoss, MCAdvantage
from torchrl_grpo.llm import ExactLogProbsTransformersWrapper
from torchrl_grpo.loss.variants import TIS, Decoupled

EXAMPLES = str(Path(__file__).resolve().parent)


@dataclass
class AsyncSettings(sync.Settings):
    """``llm_grpo.py``'s settings, and those of the asynchronous loop."""

    out: str = field(
        default="runs/llm_grpo_async",
        metadata={"help": "each run writes its metrics, plot and trained model in a new folder"},
    )
    collectors: int = field(default=1, metadata={"help": "Ray collector actors (1 CPU each)"})
    max_policy_lag: int = field(
        default=4,
        metadata={"help": "MCAdvantage drops trajectories this many versions behind the trainer"},
    )
    correction: str = field(
        default="decoupled",
        metadata={"help": "off-policy correction: decoupled (PPO, AReaL) or tis (TIS(2.0))"},
    )
    buffer_steps: int = field(
        default=2, metadata={"help": "the replay ring holds this many steps' rows"}
    )


class AdvantageBuffer(ReplayBuffer):
    """torchrl's ``ReplayBuffer`` with two calls into its ``MCAdvantage``, for the trainer to
    make on the buffer's Ray actor (a ``RayReplayBuffer`` client forwards public methods)."""

    def advantage(self) -> MCAdvantage:
        return next(t for t in self.transform if isinstance(t, MCAdvantage))

    def advantage_stats(self) -> dict:
        return self.advantage().get_stats()

    def set_consumer_version(self, version: int) -> None:
        self.advantage().consumer_version = version


def buffer_transform(cfg: AsyncSettings) -> Compose:
    """What the buffer's actor runs on each write, last first: advantages, then the prompt
    strings dropped and the rows made one ``TensorDict`` (as in ``llm_grpo.py``)."""
    advantage = MCAdvantage(
        grpo_size=cfg.group_size,
        prompt_key="query",
        trajectory_return="sum",
        max_policy_lag=cfg.max_policy_lag,
        keep_return_bounds=(0.0, 1.0) if cfg.dynamic_sampling else None,
    )
    return Compose(sync.Contiguous(), ExcludeTransform("query", inverse=True), advantage)


UNREAD = ("answer", "step_count", "terminated", "truncated")  # the loss reads none of them


class BehaviourLogProbs(Transform):
    """The collectors' postproc: the sampler's log-probs as ``("log_probs", "full")`` (NaN over
    the prompt, which the loss leaves out), unread entries dropped, one ``TensorDict``.

    It also times its actor: ``timing["rollout_s"]`` is the time between two batches spent
    outside it (env reset, generation, reward, the buffer write, weight updates).
    """

    def __init__(self):
        super().__init__()
        self.timing = {"batches": 0, "rows": 0, "rollout_s": 0.0, "postproc_s": 0.0}
        self.last = None

    def forward(self, tensordict):
        start = time.perf_counter()
        td = tensordict.contiguous().exclude(
            *UNREAD, *[("next", k) for k in (*UNREAD, "query", "tokens")]
        )
        prompt = td.get(("tokens", "prompt"))  # (B, P)
        response = td.get(("log_probs", "response"))  # (B, R)
        nan = torch.full(prompt.shape, float("nan"), dtype=response.dtype)
        td.set(("log_probs", "full"), torch.cat([nan, response], -1))  # (B, P + R)
        if self.last is not None:
            self.timing["rollout_s"] += start - self.last
        self.last = time.perf_counter()
        self.timing["batches"] += 1
        self.timing["rows"] += td.numel()
        self.timing["postproc_s"] += self.last - start
        return td


def collector_env(tokenizer, task, cfg: AsyncSettings, seed: int, exclude: set[str]):
    """One collector's env (built in its actor): ``llm_grpo.py``'s, fed by its own prompts."""
    problems = sync.Problems(
        task, torch.Generator().manual_seed(seed), cfg.prompts_per_step, exclude
    )
    loader = DataLoader(problems, batch_size=None, collate_fn=lambda td: td)
    rows = cfg.prompts_per_step * cfg.group_size
    return sync.make_env(tokenizer, task, loader, batch=rows, repeats=cfg.group_size)


def start_collectors(cfg, task, model, tokenizer, rb, held_out) -> list[RayLLMCollector]:
    """``--collectors`` actors, each with a copy of ``model``; workarounds for torchrl 0.14.1:
    the buffer's picklable client (a ``RayReplayBuffer`` does not pickle) and ``remote_config``
    always a dict (``None`` with other options crashes)."""
    rows = cfg.prompts_per_step * cfg.group_size
    sampler = sync.make_sampler(
        model, tokenizer, cfg, cls=ExactLogProbsTransformersWrapper, return_log_probs=True
    )
    return [
        RayLLMCollector(
            env=partial(collector_env, tokenizer, task, cfg, 1000 * (cfg.seed + 1) + i, held_out),
            policy=sampler,
            dialog_turns_per_batch=rows,
            total_dialog_turns=-1,
            replay_buffer=rb.client(),
            track_policy_version=True,
            postproc=BehaviourLogProbs(),
            remote_config={"num_cpus": 1},
        )
        for i in range(cfg.collectors)
    ]


def connect_weights(collectors, weights) -> RayWeightSyncScheme:
    """torchrl's ``RayWeightSyncScheme`` (gloo) from the trainer to every collector, wired by
    hand as ``RayCollector`` does inside (``RayLLMCollector`` takes no scheme in torchrl
    0.14.1); ``connect`` sends the first weights."""
    actors = [c._collector for c in collectors]  # the Ray actor handles
    scheme = RayWeightSyncScheme(backend="gloo")
    scheme.init_on_sender(model_id="policy", remote_collectors=actors, num_workers=len(actors))
    ray.get(
        [
            a.register_scheme_receiver.remote({"policy": scheme}, synchronize_weights=False)
            for a in actors
        ]
    )
    futures = [
        a.cascade_execute.remote("_receiver_schemes['policy'].connect", worker_idx=i)
        for i, a in enumerate(actors)
    ]
    scheme.connect(weights=weights)
    ray.get(futures)
    return scheme


def make_loss(scorer, cfg: AsyncSettings) -> GRPOLoss:
    """GRPO's clipped objective with the KL to the reference, corrected for the lag.

    ``("log_probs", "full")``: the sampler's; ``("next", "proximal_log_probs", "full")``: the
    trainer's model before the step's update. ``decoupled``: ratio against the proximal,
    behaviour weight against the sampler (``Decoupled()``); ``tis``: the same ratio, weight capped
    at 2 (``TIS(2.0)``).
    """
    decoupled = cfg.correction == "decoupled"
    loss_fn = GRPOLoss(
        actor_network=scorer,
        masking_strategy="sft",
        clip_epsilon=(cfg.clip_epsilon, cfg.clip_epsilon_high),
        kl_to_ref_coeff=cfg.kl_coeff,
        entropy_coeff=cfg.entropy_coeff,
        corrections=[Decoupled() if decoupled else TIS(2.0)],
    )
    sampler, proximal = ("log_probs", "full"), ("next", "proximal_log_probs", "full")
    if decoupled:
        loss_fn.set_keys(sample_log_prob=sampler, proximal_log_prob=proximal)
    else:
        loss_fn.set_keys(sample_log_prob=proximal, inference_log_prob=sampler)
    return loss_fn


class Profile:
    """Seconds spent per named part of the trainer's loop: ``with profile("optimize"): ...``."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] += time.perf_counter() - start


class Trainer:
    """The trainer's side of the loop: one GRPO step = wait for a step's fresh rows, sample
    them, score them, ``--epochs`` passes of minibatch updates, push the weights."""

    def __init__(self, cfg, model, ref_model, tokenizer, rb, scheme, version: int):
        self.cfg, self.model, self.rb, self.scheme = cfg, model, rb, scheme
        self.client = rb.client()  # forwards AdvantageBuffer's methods to the buffer's actor
        self.rows = cfg.prompts_per_step * cfg.group_size
        proximal = sync.make_scorer(model, tokenizer, cfg, "proximal_log_probs", response_only=True)
        ref = sync.make_scorer(ref_model, tokenizer, cfg, "ref_log_probs", response_only=True)
        self.score = Compose(  # on the response only: the loss ("sft") reads nothing else
            RetrieveLogProb(proximal, assistant_only=False),
            RetrieveLogProb(ref, assistant_only=False),
        )
        self.loss_fn = make_loss(sync.make_scorer(model, tokenizer, cfg), cfg)
        self.optim = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        self.schedule = sync.lr_schedule(self.optim, cfg, deadline=CLOCK["start"] + cfg.time_limit)
        # the weights the collectors receive: the model seen through the samplers' class
        self.view = sync.make_sampler(model, tokenizer, cfg, cls=ExactLogProbsTransformersWrapper)
        self.version, self.read = version, 0
        self.profile = Profile()

    def weights(self) -> TensorDict:
        return TensorDict.from_module(self.view).data

    def sample(self) -> TensorDict:
        """A step's rows, once that many new ones were written since the last step."""
        with self.profile("wait for the buffer, sample"):
            while self.rb.write_count < self.read + self.rows:
                time.sleep(0.02)
            self.read = self.rb.write_count
            return self.rb.sample(self.rows).contiguous()

    def step(self) -> dict:
        batch = self.sample()
        with self.profile("score (proximal, reference)"), torch.no_grad():
            batch = self.score(batch)
        metrics = collections.defaultdict(list)
        with self.profile("optimize"):
            for _ in range(self.cfg.epochs):
                for minibatch in batch[torch.randperm(len(batch))].split(self.cfg.minibatch):
                    out = self.loss_fn(minibatch)
                    loss = out.loss_objective + out.loss_kl_to_ref
                    if out.loss_entropy is not None:
                        loss = loss + out.loss_entropy
                    self.optim.zero_grad()
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                    self.optim.step()
                    for name in ("loss_objective", "ESS", "clip_fraction", "kl_to_ref", "entropy"):
                        metrics[name].append(float(out[name].detach()))
            self.schedule.step()
        with self.profile("push weights"):
            self.scheme.send(weights=self.weights())
            self.version += 1
            self.client.set_consumer_version(self.version)
        lag = self.version - 1 - batch["policy_version"].reshape(len(batch), -1)[:, 0]
        return {
            **{name: sum(v) / len(v) for name, v in metrics.items()},
            "reward": float(batch["next", "reward"].mean()),
            "sample_lag_mean": float(lag.float().mean()),
            "sample_lag_max": int(lag.max()),
        }


def plot(history: dict, path: Path, acc_before: float) -> None:
    fig, (ax, lag) = plt.subplots(2, 1, figsize=(6.4, 5.4), dpi=100, sharex=True)
    title = "Asynchronous GRPO on digit sums: tiny Qwen2, Ray collectors, CPU"
    sync.plot_progress(ax, history, acc_before, title)
    for name, color, label in (
        ("policy_lag_max", "tab:purple", "policy lag at insertion, max"),
        ("sample_lag_mean", "tab:green", "policy lag at sampling, mean"),
    ):
        lag.plot(history["step"], history[name], color=color, lw=1, label=label)
    lag.set_xlabel("GRPO step (weight pushes)")
    lag.set_ylabel("versions")
    lag.legend(loc="upper right", fontsize=8)
    lag.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def start_ray(cfg: AsyncSettings) -> None:
    """Ray on this machine; the actors import this folder's modules (cloudpickle ships the
    task, env factory and postproc by reference to them)."""
    path = os.pathsep.join(p for p in (EXAMPLES, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=cfg.collectors + 1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )


def train(cfg, trainer: Trainer, collectors, eval_accuracy, logger, history) -> None:
    """GRPO steps until ``--steps`` or ``--time-limit``, logging every metric."""
    for c in collectors:
        c.start()  # a collection thread in each actor (iterating would collect in lockstep)
    bar = tqdm(range(1, cfg.steps + 1), desc="GRPO steps")
    for step in bar:
        if not all(c.is_running() for c in collectors):  # a dead collection thread is silent
            raise RuntimeError(f"a collector stopped before GRPO step {step}")
        metrics = trainer.step()
        stats = trainer.client.advantage_stats()
        lags = {k: stats[k] for k in ("policy_lag_max", "policy_lag_mean") if k in stats}
        metrics.update(lags, stale_trajectories=stats["stale_trajectories"])
        out_of_time = time.perf_counter() - CLOCK["start"] > cfg.time_limit
        if step % cfg.eval_every == 0 or step == cfg.steps or out_of_time:
            with trainer.profile("evaluate"):
                metrics["accuracy"] = eval_accuracy()
            history["eval_step"].append(step)
            history["accuracy"].append(metrics["accuracy"])
        for name, value in metrics.items():
            logger.log_scalar(name, value, step=step)
        history["step"].append(step)
        for name in ("reward", "sample_lag_mean"):
            history[name].append(metrics[name])
        history["policy_lag_max"].append(lags.get("policy_lag_max", float("nan")))
        bar.set_postfix(reward=f"{metrics['reward']:.2f}", lag=metrics["sample_lag_max"])
        if out_of_time:
            tqdm.write(f"time limit {cfg.time_limit:.0f} s reached after {step} GRPO steps")
            break


def print_profile(trainer: Trainer, collectors, loop_s: float) -> None:
    """Where each process's time went: the trainer's parts, the collectors' rollouts."""
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in trainer.profile.seconds.items())
    print(f"profile, trainer ({loop_s:.1f} s of GRPO): {parts}")
    for i, c in enumerate(collectors):
        t = ray.get(c._collector.get_distant_attr.remote("postproc.timing"))
        print(
            f"profile, collector {i}: {t['batches']} batches, {t['rows']} completions; rollouts "
            f"(env reset, generation, reward, buffer write) {t['rollout_s']:.1f} s, "
            f"postproc {t['postproc_s']:.1f} s"
        )


def shutdown(collectors, scheme, rb) -> None:
    """Collectors, weight sync, buffer, Ray: each stopped even if one before it fails."""
    with contextlib.ExitStack() as stack:
        stack.callback(ray.shutdown)
        if rb is not None:
            stack.callback(rb.close)
        if scheme is not None:
            stack.callback(scheme.shutdown)
        for c in collectors:
            stack.callback(c.async_shutdown, timeout=10)


def warm_started(cfg, task):
    """``llm_grpo.py``'s model, tokenizer, warm start and evaluation: accuracies compare."""
    model, tokenizer = sync.tiny_qwen2(cfg, task)
    eval_problems = sync.draw_problems(
        task, torch.Generator().manual_seed(1234), cfg.eval_prompts, set()
    )
    held_out = set(eval_problems["query"])
    train_gen = torch.Generator().manual_seed(cfg.seed)
    val_problems = sync.draw_problems(task, train_gen, 200, held_out)
    greedy = sync.make_sampler(model, tokenizer, cfg, greedy=True)
    val_accuracy = sync.GreedyAccuracy(tokenizer, task, val_problems, greedy)
    eval_accuracy = sync.GreedyAccuracy(tokenizer, task, eval_problems, greedy)
    sft_steps = sync.warm_start(model, tokenizer, cfg, task, train_gen, held_out, val_accuracy)
    return model, tokenizer, held_out, eval_accuracy, sft_steps


def main(argv=None) -> dict:
    """Warm start, then asynchronous GRPO; returns the accuracies, wall time, largest policy
    lag, the run's folder and how far the weights moved during GRPO."""
    CLOCK["start"] = T0 if CLOCK["first_call"] else time.perf_counter()
    CLOCK["first_call"] = False
    cfg = sync.parse_args(argv, settings_cls=AsyncSettings)
    task = sync.digit_sum_task(cfg.digits)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    collectors, scheme, rb = [], None, None
    try:
        start_ray(cfg)
        rb = RayReplayBuffer(
            storage=partial(
                LazyStackStorage, cfg.buffer_steps * cfg.prompts_per_step * cfg.group_size
            ),
            replay_buffer_cls=AdvantageBuffer,
            transform_factory=partial(buffer_transform, cfg),
            remote_config={"num_cpus": 0},
        )
        model, tokenizer, held_out, eval_accuracy, sft_steps = warm_started(cfg, task)
        acc_before = eval_accuracy()
        print(
            f"warm start: {sft_steps} supervised steps, greedy {task.metric} {acc_before:.3f} on "
            f"{cfg.eval_prompts} held-out prompts ({time.perf_counter() - CLOCK['start']:.0f} s)"
        )
        ref_model = copy.deepcopy(model).requires_grad_(False)
        start = [p.detach().clone() for p in model.parameters()]
        collectors = start_collectors(cfg, task, model, tokenizer, rb, held_out)
        trainer = Trainer(cfg, model, ref_model, tokenizer, rb, None, 0)
        trainer.scheme = scheme = connect_weights(collectors, trainer.weights())
        trainer.version = collectors[0].policy_version
        trainer.client.set_consumer_version(trainer.version)
        logger = CSVLogger(
            generate_exp_name(task.name + "_async", f"seed{cfg.seed}"), log_dir=cfg.out
        )
        history = collections.defaultdict(list, eval_step=[0], accuracy=[acc_before])
        loop_start = time.perf_counter()
        train(cfg, trainer, collectors, eval_accuracy, logger, history)
        print_profile(trainer, collectors, time.perf_counter() - loop_start)
    finally:
        shutdown(collectors, scheme, rb)
    return finish(cfg, model, tokenizer, logger, history, start)


def finish(cfg, model, tokenizer, logger, history, start) -> dict:
    """Plot, save the model and tokenizer, print the RESULT line."""
    run_dir = Path(logger.log_dir) / logger.exp_name
    acc_before, acc_after = history["accuracy"][0], history["accuracy"][-1]
    plot(history, run_dir / "llm_grpo_async.png", acc_before)
    model.save_pretrained(run_dir / "model")
    tokenizer.save_pretrained(run_dir / "tokenizer")
    sync.remove_empty_folders(run_dir)
    lags = [lag for lag in history["policy_lag_max"] if lag == lag]  # not NaN
    max_lag = int(max(lags)) if lags else -1
    moved = sum(float((p.detach() - s).norm() ** 2) for p, s in zip(model.parameters(), start))
    wall_s = time.perf_counter() - CLOCK["start"]
    print(
        f"greedy accuracy {acc_before:.3f} -> {acc_after:.3f} after {history['step'][-1]} "
        f"GRPO steps; in {run_dir}: metrics (scalars/), plot, model, tokenizer"
    )
    print(
        f"RESULT acc_before={acc_before:.4f} acc_after={acc_after:.4f} wall_s={wall_s:.1f} "
        f"max_lag={max_lag}"
    )
    return {
        "acc_before": acc_before,
        "acc_after": acc_after,
        "wall_s": wall_s,
        "max_lag": max_lag,
        "run_dir": run_dir,
        "weights_moved": moved**0.5,
        "steps": history["step"][-1],
    }


if __name__ == "__main__":
    main()
