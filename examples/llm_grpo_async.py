"""Asynchronous GRPO: the task, model, warm start and evaluation of ``llm_grpo.py``, with the
sampling moved out of the trainer's loop so that generation overlaps with learning.

Two backends (``--backend``), one trainer loop:

* ``local`` (default, one machine): one sampler process (``llm_async_local.py``) runs torchrl's
  ``LLMCollector`` with its own copy of the model, one torch thread, and sends each batch through
  a ``multiprocessing`` queue; the weights come back through shared memory. **Backpressure**: the
  sampler starts a batch only once the trainer is at most ``--max-policy-lag`` versions behind
  the batch's step (1 by default: it generates step ``i + 1``'s rows while the trainer trains on
  step ``i``'s), so no row is generated to be dropped, and none is overwritten.
* ``ray`` (several machines; the ``dist`` extra): ``--collectors`` torchrl ``RayLLMCollector``
  actors keep generating into a torchrl ``RayReplayBuffer`` (a ring of ``--buffer-steps`` steps'
  rows, in its own actor) and receive the weights through torchrl's ``RayWeightSyncScheme``
  (gloo); nothing pauses them: ``MCAdvantage(staleness=Staleness(max_lag=...))`` drops what is
  too old.

Either way the samplers use :class:`torchrl_grpo.llm.ExactLogProbsTransformersWrapper` (its
generation log-probs are the behaviour policy's), stamp each row with the version of the weights
that sampled it, and ``torchrl_grpo.MCAdvantage`` computes group-relative advantages on the way
into the trainer's buffer. The trainer scores a step's rows under its current model (the
proximal policy) and the frozen reference, runs ``GRPOLoss`` for ``--epochs`` passes, and
publishes the new weights.

The correction for the lag (``--correction``): ``decoupled`` (default) is decoupled PPO (AReaL,
Fu et al., 2025): the ratio and its clip are taken against the proximal policy (the trainer's
model before this step's update), and each token is weighted by ``pi_prox / pi_behaviour``,
the sampler's log-probs. The clip then bounds how far one update moves the policy, whatever
the data's age, and the weight corrects for the age: the trust region of PPO survives a lag of
several versions (``corrections=[Decoupled()]``). ``tis`` (truncated importance sampling,
``corrections=[TIS(2.0)]``) takes the ratio against the proximal policy too but only
multiplies each token by ``min(pi_prox / pi_behaviour, 2)``, a correction designed for small
train/inference mismatches, not for stale policies.

**On-policy distillation** (``--teacher <run folder>``, local backend): a teacher that
``examples/llm_grpo.py`` trained (its ``model/`` and ``tokenizer/``, loaded by
``llm_distill.py``'s ``load_teacher``; it must share the student's tokenizer) scores each batch
in the sampler process, after the reference (``TeacherLogProbs``: ``("next",
"teacher_log_probs", "full")``), and ``MCAdvantage(estimator=Distillation(...))`` writes each
response token's advantage ``alpha * A_group - beta * (log pi_old - log pi_T)`` on insertion
(``--distill-alpha``, ``--distill-beta``, ``--distill-gamma``; ``log pi_old`` the sampler's own
log-probs; ``--distill-alpha 0``: distillation alone, no reward read). The trainer is unchanged:
the loss reads the ``[B, T]`` advantages, and the reverse KL to the teacher is logged
(``distill_kl_token_mean``...).

Run (needs the ``llm`` and ``examples`` extras; ``--backend ray`` the ``dist`` one too)::

    .venv/bin/python examples/llm_grpo_async.py                    # defaults: about 3 minutes
    .venv/bin/python examples/llm_grpo_async.py --backend ray --collectors 2 --correction tis
    .venv/bin/python examples/llm_grpo.py --out runs/teacher       # a teacher, then with it:
    .venv/bin/python examples/llm_grpo_async.py --teacher runs/teacher/<run> --distill-alpha 0
    .venv/bin/python examples/llm_grpo_async.py --help             # every setting

It logs every metric (policy lags, the staleness of the trained rows, ESS, accuracy...) with
torchrl's ``CSVLogger`` under ``--out``, saves ``llm_grpo_async.png`` and the trained model
there, prints where the time of each process went and what became of every generated row, and
ends with one line::

    RESULT acc_before=<float> acc_after=<float> wall_s=<float> max_lag=<int>

With the local backend, the run's folder also gets ``checkpoint/`` when it stops, every
``--checkpoint-every`` steps, and when the sampler process dies (the trainer's state is whole
then): ``--resume <run folder>`` goes on from it as ``llm_grpo.py`` does (the weights, the
reference, the optimizer, the schedule and its progress, the loss, the buffer, the version, the
curves; the sampler starts again where its prompts and versions were; a run with a teacher
goes on with the same ``--teacher`` and weights only). The Ray backend keeps none: its
collectors' prompt streams and its Ray buffer are not saved.
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
import dataclasses
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import llm_async_local as local  # the single-machine backend, in this folder
import llm_distill as distill  # the on-policy distillation example: its teacher's loader
import llm_grpo as sync  # the synchronous example, in this folder
import matplotlib.pyplot as plt
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader
from torchrl.collectors.llm import LLMCollector
from torchrl.data import LazyStackStorage, ReplayBuffer
from torchrl.envs import Compose, ExcludeTransform, InitTracker, Transform
from torchrl.envs.llm import RetrieveLogProb
from torchrl.record.loggers import CSVLogger, generate_exp_name
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from torchrl_grpo import GRPOLoss, MCAdvantage, checkpoint
from torchrl_grpo.llm import ExactLogProbsTransformersWrapper
from torchrl_grpo.loss.variants import TIS, Decoupled
from torchrl_grpo.mcadvantage import Distillation, Staleness
from torchrl_grpo.mcadvantage.distillation import STATS_PREFIX

EXAMPLES = str(Path(__file__).resolve().parent)


@dataclass
class AsyncSettings(sync.Settings):
    """``llm_grpo.py``'s settings, and those of the asynchronous loop."""

    out: str = field(
        default="runs/llm_grpo_async",
        metadata={"help": "each run writes its metrics, plot and trained model in a new folder"},
    )
    backend: str = field(
        default="local",
        metadata={
            "help": "local (one sampler process, backpressure) or ray (several machines)",
            "choices": ("local", "ray"),
        },
    )
    collectors: int = field(
        default=1, metadata={"help": "with --backend ray: collector actors (1 CPU each)"}
    )
    max_policy_lag: int | None = field(
        default=None,
        metadata={
            "help": "staleness bound in versions: local, the sampler waits so that no row is "
            "older (default 1); ray, MCAdvantage drops older rows (default 4)",
            "type": int,
        },
    )
    correction: str = field(
        default="decoupled",
        metadata={
            "help": "off-policy correction: decoupled (PPO, AReaL) or tis (TIS(2.0))",
            "choices": ("decoupled", "tis"),
        },
    )
    buffer_steps: int = field(
        default=2, metadata={"help": "with --backend ray: the replay ring holds this many steps"}
    )
    teacher: str = field(
        default="",
        metadata={
            "help": "on-policy distillation (local backend): the teacher, a run folder of "
            "examples/llm_grpo.py (its model/ and tokenizer/) or a model folder with "
            "tokenizer/ beside it, sharing the student's tokenizer; the sampler process scores "
            "each batch with it after the reference, and each response token's advantage is "
            "alpha * A_group - beta * (log pi_old - log pi_teacher)"
        },
    )
    distill_alpha: float = field(
        default=1.0,
        metadata={
            "help": "with --teacher: alpha, the weight of the group's advantage of the reward "
            "(0: distillation alone, no reward read)"
        },
    )
    distill_beta: float = field(
        default=1.0, metadata={"help": "with --teacher: beta, the reverse KL's weight"}
    )
    distill_gamma: float = field(
        default=0.0,
        metadata={
            "help": "with --teacher: discount of the future reverse KL (Tinker's "
            "kl_discount_factor; 0: each token's own)"
        },
    )
    distill_baseline: str = field(
        default="position",
        metadata={
            "choices": distill.BASELINES,
            "help": "with --teacher: each token's reverse KL less its group's mean at its "
            "position in the response (Distillation(baseline='position')), over all the "
            "group's response tokens (group), or not centred (none: the peers' form); "
            "llm_distill.py's --baseline",
        },
    )


#: The staleness bound of each backend when ``--max-policy-lag`` is not given.
DEFAULT_LAG = {"local": 1, "ray": 4}
#: Settings a resumed run must share with its checkpoint: ``llm_grpo.py``'s, and the teacher's
#: (the pending groups in the checkpoint's buffer were scored by it, with or without rewards).
#: The teacher's weights and baseline: read with --teacher only.
DISTILL_SETTINGS = ("distill_alpha", "distill_beta", "distill_gamma", "distill_baseline")
SAME_ON_RESUME = (*sync.SAME_ON_RESUME, "teacher", *DISTILL_SETTINGS)


def check_settings(cfg: AsyncSettings) -> AsyncSettings:
    """The asynchronous settings checked before anything starts; the lag bound resolved."""
    if cfg.backend not in DEFAULT_LAG:
        raise ValueError(f"--backend must be one of {sorted(DEFAULT_LAG)}, got {cfg.backend!r}.")
    if cfg.max_policy_lag is None:
        cfg.max_policy_lag = DEFAULT_LAG[cfg.backend]
    if cfg.max_policy_lag < 0:
        raise ValueError(f"--max-policy-lag must be at least 0, got {cfg.max_policy_lag}.")
    if cfg.correction not in ("decoupled", "tis"):
        raise ValueError(f"--correction must be decoupled or tis, got {cfg.correction!r}.")
    if cfg.backend == "ray" and (cfg.resume or cfg.checkpoint_every or cfg.stop_at_step):
        raise ValueError(
            "--resume, --checkpoint-every and --stop-at-step: the local backend only (the Ray "
            "collectors' prompt streams and the Ray buffer are not saved)."
        )
    if cfg.backend == "local" and cfg.collectors != 1:
        raise ValueError(
            f"--collectors {cfg.collectors}: the local backend runs one sampler process (the "
            "two cores are the sampler's and the trainer's); use --backend ray for several."
        )
    check_teacher_settings(cfg)
    return cfg


def check_teacher_settings(cfg: AsyncSettings) -> None:
    """``--teacher`` and its weights checked before anything starts (the teacher's tokenizer
    is checked in ``main``, once the student's is built)."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    if not cfg.teacher:
        if any(getattr(cfg, name) != defaults[name] for name in DISTILL_SETTINGS):
            raise ValueError(
                "--distill-alpha, --distill-beta, --distill-gamma and --distill-baseline weigh "
                "a teacher's reverse KL: give the teacher, --teacher <run folder of "
                "examples/llm_grpo.py>."
            )
        return
    if cfg.backend != "local":
        raise ValueError(
            "--teacher: the local backend only (its sampler process scores the teacher as it "
            "scores the reference; the Ray collectors score neither)."
        )
    if cfg.dynamic_sampling and cfg.distill_alpha == 0.0:
        raise ValueError(
            "--dynamic-sampling drops groups by their reward, which --distill-alpha 0 does not "
            "read (distillation alone): give a positive --distill-alpha, or drop the flag."
        )
    try:
        buffer_transform(cfg)
    except ValueError as error:  # the weights: MCAdvantage's own checks
        raise ValueError(f"--distill-alpha/--distill-beta/--distill-gamma: {error}") from None
    if not (distill.teacher_folder(cfg) / "config.json").is_file():  # not a hub name to fetch
        raise ValueError(
            f"--teacher {cfg.teacher}: no saved model there (a run folder of "
            "examples/llm_grpo.py holds model/ and tokenizer/)."
        )


def buffer_transform(cfg: AsyncSettings) -> Compose:
    """What the buffer runs on each write, last first: advantages, then the prompt strings
    dropped and the rows made one ``TensorDict`` (as in ``llm_grpo.py``).

    With ``--teacher``, the advantages are per token (``Distillation``): ``log pi_old`` is the
    sampler's own log-probs, ``("log_probs", "full")`` (``BehaviourLogProbs``; NaN over the
    prompt, which is not read), the teacher's those the sampler wrote under ``"next"``;
    ``--distill-alpha 0`` reads no reward (``rewards_key=None``), as ``llm_distill.py``."""
    distillation = None
    if cfg.teacher:
        distillation = Distillation(
            cfg.distill_alpha,
            cfg.distill_beta,
            cfg.distill_gamma,
            log_prob_key=("log_probs", "full"),
            baseline=distill.baseline_option(cfg.distill_baseline),
        )
    alone = distillation is not None and distillation.alpha == 0.0
    advantage = MCAdvantage(
        grpo_size=cfg.group_size,
        prompt_key="query",
        trajectory_return=None if alone else "sum",
        staleness=Staleness(max_lag=cfg.max_policy_lag),
        keep_return_bounds=(0.0, 1.0) if cfg.dynamic_sampling else None,
        estimator=distillation,
        **({"rewards_key": None} if alone else {}),
    )
    return Compose(sync.Contiguous(), ExcludeTransform("query", inverse=True), advantage)


UNREAD = ("answer", "step_count", "terminated", "truncated", "is_init")  # the loss reads none


class BehaviourLogProbs(Transform):
    """The samplers' postproc: the sampler's log-probs as ``("log_probs", "full")`` (NaN over
    the prompt, which the loss leaves out), unread entries dropped, one ``TensorDict``.

    It also times its process: ``timing["rollout_s"]`` is the time between two batches spent
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


def collector_env(tokenizer, task, cfg: AsyncSettings, seed: int, exclude: set[str], skip=0):
    """One sampler's env (built in its process): ``llm_grpo.py``'s, fed by its own prompts;
    ``skip``: the batches of prompts a resumed run's trainer had already taken, drawn and left
    (the prompt stream goes on as if the run had not stopped)."""
    problems = sync.Problems(
        task, torch.Generator().manual_seed(seed), cfg.prompts_per_step, exclude
    )
    for _ in range(skip):
        sync.draw_problems(task, problems.gen, cfg.prompts_per_step, exclude, distinct=True)
    loader = DataLoader(problems, batch_size=None, collate_fn=lambda td: td)
    rows = cfg.prompts_per_step * cfg.group_size
    env = sync.make_env(tokenizer, task, loader, batch=rows, repeats=cfg.group_size)
    env.append_transform(InitTracker())  # what torchrl's collectors ask for (as llm_grpo.py)
    return env


def local_sampling(cfg: AsyncSettings, exclude: set[str], resumed: dict | None = None):
    """Run in the local backend's sampler process: its model (the weights come from the
    trainer), its sampler and torchrl's ``LLMCollector`` over its env; ``(sampler, batches)``.

    The sampler also scores each batch under the frozen reference (``("next", "ref_log_probs",
    "full")``, torchrl's ``RetrieveLogProb``): the reference is the warm-started model, the
    weights of version 0, copied when the first batch is generated; the sampler has the time
    (it waits for the trainer otherwise), and the trainer then scores the proximal policy only.
    With ``--teacher``, the teacher scores each batch after the reference (``("next",
    "teacher_log_probs", "full")``, ``llm_distill.py``'s ``TeacherLogProbs``), so that the
    trainer's ``MCAdvantage`` writes per-token advantages on insertion.
    ``resumed``: a resumed run's ``{"batches": taken, "reference": weights}``: the prompts of
    the batches taken are skipped, and the reference is the checkpoint's.
    """
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # from_pretrained's "Loading weights" bar (the teacher)
    task = sync.make_task(cfg)
    model, tokenizer = sync.tiny_qwen2(cfg, task)
    teacher = None
    if cfg.teacher:  # the padding out of the softmax, as the trainer's (llm_distill.py's reason)
        distill.suppress_padding(model, tokenizer)
        teacher = distill.load_teacher(cfg, task, tokenizer)[1]
    sampler = sync.make_sampler(
        model, tokenizer, cfg, cls=ExactLogProbsTransformersWrapper, return_log_probs=True
    )
    skip = resumed["batches"] if resumed else 0
    env = collector_env(tokenizer, task, cfg, 1000 * (cfg.seed + 1), exclude, skip)
    rows = cfg.prompts_per_step * cfg.group_size
    collector = LLMCollector(
        env,
        policy=sampler,
        dialog_turns_per_batch=rows,
        total_dialog_turns=-1,
        postproc=BehaviourLogProbs(),
    )

    def batches():
        reference = None
        for batch in collector:
            if reference is None:  # version 0 is loaded: the warm-started model
                ref_model = copy.deepcopy(model).requires_grad_(False)
                if resumed:  # a later version is loaded: the checkpoint's reference
                    ref_model.load_state_dict(resumed["reference"])
                ref = sync.make_scorer(
                    ref_model, tokenizer, cfg, "ref_log_probs", response_only=True
                )
                reference = RetrieveLogProb(ref, assistant_only=False)
            with torch.no_grad():
                batch = reference(batch)
            yield batch if teacher is None else teacher(batch)

    return sampler, batches()


class LocalLink:
    """The trainer's end of the local backend: its buffer (``MCAdvantage``), fed by the
    sampler process one batch at a time, emptied once a step's rows are read."""

    def __init__(self, cfg: AsyncSettings, exclude: set[str], view, resumed: dict | None = None):
        self.cfg, self.view = cfg, view
        self.rb = ReplayBuffer(storage=LazyStackStorage(cfg.prompts_per_step * cfg.group_size))
        transform = buffer_transform(cfg)
        self.rb.append_transform(transform)
        self.advantage = transform[-1]
        self.batches = resumed["batches"] if resumed else 0  # taken from the sampler, in all
        version = resumed["version"] if resumed else 0
        sampling = partial(local_sampling, cfg, exclude, resumed)
        self.sampler = local.LocalSampler(
            sampling, view, cfg.max_policy_lag, first_version=version, first_batch=self.batches
        )
        self.timing, self.written = None, 0

    def start(self, weights) -> int:
        """The warm-started weights out, version 0 (a resumed run's: its version): the
        sampler (started before the warm start, its imports and model built meanwhile) begins
        generating."""
        version = self.sampler.publish(self.view)
        self.advantage.consumer_version = version
        return version

    def next_rows(self) -> TensorDict:
        """The rows of the sampler's next batch that the transform releases (all of them
        unless dynamic sampling or the staleness bound drops groups)."""
        while True:
            batch = self.sampler.next_batch()
            self.written += batch.numel()
            self.rb.extend(batch)
            self.batches += 1
            if len(self.rb):
                rows = self.rb[:]
                self.rb.empty()
                return rows

    def publish(self, weights, version: int) -> None:
        self.sampler.publish(self.view)
        self.advantage.consumer_version = version

    def advantage_stats(self) -> dict:
        return self.advantage.get_stats()

    def sampler_timings(self) -> list[dict]:
        return [self.timing] if self.timing else []

    def rows_written(self) -> int:
        return self.written

    def close(self) -> None:
        self.timing = self.sampler.close()


def start_link(cfg: AsyncSettings, exclude: set[str], view, tokenizer, task, resumed=None):
    """The backend: ``LocalLink`` or the Ray one (``llm_async_ray.py``, imported only then);
    ``resumed``: what a resumed local sampler needs (:func:`sampler_resume`)."""
    if cfg.backend == "local":
        return LocalLink(cfg, exclude, view, resumed)
    try:
        import llm_async_ray
    except ImportError as err:
        raise ImportError(
            f"--backend ray needs Ray ({err}): install the dist extra, "
            "pip install -e '.[dist]', or use --backend local on one machine."
        ) from err
    sampler = sync.make_sampler(
        view.model, tokenizer, cfg, cls=ExactLogProbsTransformersWrapper, return_log_probs=True
    )

    def env_factory(seed):
        return partial(collector_env, tokenizer, task, cfg, seed, exclude)

    return llm_async_ray.RayLink(
        cfg, EXAMPLES, partial(buffer_transform, cfg), env_factory, sampler, BehaviourLogProbs
    )


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


class SamplerLost(RuntimeError):
    """The backend gave no rows (the sampler failed or died): the trainer's state is whole."""


class Trainer:
    """The trainer's side of the loop: one GRPO step = the backend's next rows, scored, then
    ``--epochs`` passes of minibatch updates, the weights published."""

    def __init__(self, cfg, model, ref_model, tokenizer, view):
        self.cfg, self.model, self.link = cfg, model, None
        proximal = sync.make_scorer(model, tokenizer, cfg, "proximal_log_probs", response_only=True)
        ref = sync.make_scorer(ref_model, tokenizer, cfg, "ref_log_probs", response_only=True)
        # on the response only: the loss ("sft") reads nothing else; the local sampler scores
        # the reference itself
        scorers = [RetrieveLogProb(proximal, assistant_only=False)]
        if cfg.backend != "local":
            scorers.append(RetrieveLogProb(ref, assistant_only=False))
        self.score = Compose(*scorers)
        self.loss_fn = make_loss(sync.make_scorer(model, tokenizer, cfg), cfg)
        self.optim = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        self.schedule = sync.lr_schedule(self.optim, cfg, deadline=CLOCK["start"] + cfg.time_limit)
        self.view = view  # the weights the samplers receive: the model as their class sees it
        self.version, self.trained = 0, 0
        self.trained_before = 0  # a resumed run's rows trained before its checkpoint
        self.lags = collections.Counter()  # the lag of every trained row
        self.profile = Profile()

    def weights(self) -> TensorDict:
        return TensorDict.from_module(self.view).data

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the trainer: the weights, the optimizer, the schedule and
        its progress, the loss's own state, the version and the counts of trained rows."""
        actor = "actor_network"  # the policy's weights are saved once, as "policy"
        return {
            "policy": self.model.state_dict(),
            "optimizer": self.optim.state_dict(),
            "schedule": self.schedule.state_dict(),
            "schedule_progress": sync.schedule_progress(self.schedule).state_dict(),
            "loss": {k: v for k, v in self.loss_fn.state_dict().items() if not k.startswith(actor)},
            "version": self.version,
            "trained": self.trained,
            "lags": dict(self.lags),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["policy"])
        self.optim.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        sync.schedule_progress(self.schedule).load_state_dict(state["schedule_progress"])
        self.loss_fn.load_state_dict(state["loss"], strict=False)
        self.version, self.trained = state["version"], state["trained"]
        self.trained_before = state["trained"]
        self.lags = collections.Counter(state["lags"])

    def step(self) -> dict:
        with self.profile("wait for the sampler's rows"):
            try:
                batch = self.link.next_rows()
            except RuntimeError as error:  # nothing of this step has changed yet
                raise SamplerLost(str(error)) from error
        with self.profile("score"), torch.no_grad():
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
        lag = self.version - batch["policy_version"].reshape(len(batch), -1)[:, 0]
        with self.profile("publish weights"):
            self.version += 1
            self.link.publish(self.weights(), self.version)
        self.lags.update(lag.tolist())
        self.trained += len(batch)
        return {
            **{name: sum(v) / len(v) for name, v in metrics.items()},
            "reward": float(batch["next", "reward"].mean()),
            "sample_lag_mean": float(lag.float().mean()),
            "sample_lag_max": int(lag.max()),
        }


def plot(history: dict, lags: collections.Counter, path: Path, acc_before, backend) -> None:
    fig, (ax, lag, hist) = plt.subplots(3, 1, figsize=(6.4, 7.6), dpi=100)
    title = f"Asynchronous GRPO on digit sums: tiny Qwen2, {backend} backend, CPU"
    sync.plot_progress(ax, history, acc_before, title)
    for name, color, label in (
        ("policy_lag_max", "tab:purple", "policy lag at insertion, max"),
        ("sample_lag_mean", "tab:green", "policy lag of the trained rows, mean"),
    ):
        lag.plot(history["step"], history[name], color=color, lw=1, label=label)
    lag.set_xlabel("GRPO step (weight publications)")
    lag.set_ylabel("versions")
    lag.legend(loc="upper right", fontsize=8)
    lag.grid(alpha=0.3)
    values = sorted(lags)
    hist.bar([str(v) for v in values], [lags[v] for v in values], color="tab:green")
    hist.set_xlabel("policy lag of a trained row (versions)")
    hist.set_ylabel("rows")
    hist.set_title("staleness of every trained row", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def log_step(logger, history, metrics: dict, step: int, lags: dict) -> None:
    for name, value in metrics.items():
        logger.log_scalar(name, value, step=step)
    history["step"].append(step)
    for name in ("reward", "sample_lag_mean"):
        history[name].append(metrics[name])
    history["policy_lag_max"].append(lags.get("policy_lag_max", float("nan")))


def train(cfg, trainer: Trainer, eval_accuracy, logger, history, save=None) -> None:
    """GRPO steps until ``--steps`` or ``--time-limit`` (a resumed run's count what ran before)
    or ``--stop-at-step``, logging every metric and the staleness of the trained rows
    (``trained_rows_lag_<k>``, cumulative); ``save()`` every ``--checkpoint-every`` steps."""
    done = history["step"][-1] if history["step"] else 0  # a resumed run's steps
    progress = sync.schedule_progress(trainer.schedule)
    if progress.out_of_time():
        print(f"the time limit ({cfg.time_limit:.0f} s) was spent before the checkpoint: raise it")
        return
    last = min(cfg.steps, cfg.stop_at_step or cfg.steps)
    bar = tqdm(range(done + 1, last + 1), desc="GRPO steps")
    for step in bar:
        metrics = trainer.step()
        stats = trainer.link.advantage_stats()
        lags = {k: stats[k] for k in ("policy_lag_max", "policy_lag_mean") if k in stats}
        metrics.update(lags, stale_trajectories=stats["stale_trajectories"])
        # with --teacher: the reverse KL to it of the rows released last (distill_kl_token_mean...)
        metrics.update({k: float(v) for k, v in stats.items() if k.startswith(STATS_PREFIX)})
        metrics.update({f"trained_rows_lag_{k}": n for k, n in trainer.lags.items()})
        out_of_time = progress.out_of_time()  # its seconds of GRPO, a resumed run's too
        if step % cfg.eval_every == 0 or step == cfg.steps or out_of_time:
            with trainer.profile("evaluate"):
                metrics["accuracy"] = eval_accuracy()
            history["eval_step"].append(step)
            history["accuracy"].append(metrics["accuracy"])
        log_step(logger, history, metrics, step, lags)
        bar.set_postfix(reward=f"{metrics['reward']:.2f}", lag=metrics["sample_lag_max"])
        if save is not None and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            save()
        if out_of_time:
            tqdm.write(f"time limit {cfg.time_limit:.0f} s reached after {step} GRPO steps")
            break


def report(trainer: Trainer, loop_s: float) -> dict:
    """Where each process's time went, and what became of every row generated (in this
    process: a resumed run's rows before its checkpoint are not counted)."""
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in trainer.profile.seconds.items())
    print(f"profile, trainer ({loop_s:.1f} s of GRPO): {parts}")
    generated = 0
    for i, t in enumerate(trainer.link.sampler_timings()):
        generated += t["rows"]
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in t.items() if k.endswith("_s"))
        print(f"profile, sampler {i}: {t['batches']} batches, {t['rows']} completions; {parts}")
    stats = trainer.link.advantage_stats()
    written = trainer.link.rows_written()
    stale = stats["stale_trajectories"]
    filtered = stats.get("dropped_trajectories", 0)
    trained = trainer.trained - trainer.trained_before
    counts = {
        "generated": generated,
        "trained": trained,
        "stale": stale,
        "filtered": filtered,
        "overwritten_or_unread": max(0, written - trained - stale - filtered),
        "unused_at_the_stop": max(0, generated - written),
    }
    print("rows: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in counts.items()))
    lags = ", ".join(f"lag {k}: {n}" for k, n in sorted(trainer.lags.items()))
    print(f"staleness of the {trainer.trained} trained rows: {lags}")
    return counts


def eval_problems(cfg, task):
    """``llm_grpo.py``'s held-out prompts (the samplers never draw them)."""
    return sync.draw_problems(task, torch.Generator().manual_seed(1234), cfg.eval_prompts, set())


def warm_started(cfg, task, model, tokenizer, warm: bool = True):
    """``llm_grpo.py``'s warm start and evaluation: accuracies compare (``warm=False``: the
    evaluation only, for a resumed run)."""
    eval_problems_ = eval_problems(cfg, task)
    held_out = set(eval_problems_["query"])
    train_gen = torch.Generator().manual_seed(cfg.seed)
    val_problems = sync.draw_problems(task, train_gen, 200, held_out)
    greedy = sync.make_sampler(model, tokenizer, cfg, greedy=True)
    val_accuracy = sync.GreedyAccuracy(tokenizer, task, val_problems, greedy)
    eval_accuracy = sync.GreedyAccuracy(tokenizer, task, eval_problems_, greedy)
    if not warm:
        return eval_accuracy, 0
    sft_steps = sync.warm_start(model, tokenizer, cfg, task, train_gen, held_out, val_accuracy)
    return eval_accuracy, sft_steps


def save_checkpoint(folder: Path, cfg, trainer: Trainer, history, acc_before, reference) -> None:
    """What a stopped run needs to go on, as ``llm_grpo.py`` saves it (one swap, each piece
    stamped with the GRPO steps done): the buffer (``MCAdvantage``'s pending groups), the
    warm-started weights, the trainer's state (:meth:`Trainer.state_dict`), the curves, and
    the batches taken from the sampler (where a resumed sampler's prompts go on)."""
    steps = history["step"][-1] if history["step"] else 0
    progress = {"history": dict(history), "acc_before": acc_before, "step": steps}
    progress["batches"] = trainer.link.batches
    state = {"settings": dataclasses.asdict(cfg), **trainer.state_dict(), "progress": progress}
    state["rng"] = torch.get_rng_state()
    pieces = {"buffer": trainer.link.rb, "reference": reference, "state": state}
    checkpoint.save_checkpoint(folder, pieces, stamp=steps)


def sampler_resume(state: dict | None) -> dict | None:
    """What a resumed run's sampler needs of the checkpoint: the batches taken (their prompts
    are skipped), the version to publish first, the reference weights."""
    if state is None:
        return None
    batches, version = state["progress"]["batches"], state["version"]
    return {"batches": batches, "version": version, "reference": state["reference"]}


def main(argv=None) -> dict:
    """Warm start (or a checkpoint, ``--resume``), then asynchronous GRPO; returns the
    accuracies, wall time, largest policy lag, the run's folder, how far the weights moved
    during GRPO and the rows' counts."""
    CLOCK["start"] = T0 if CLOCK["first_call"] else time.perf_counter()
    CLOCK["first_call"] = False
    cfg = check_settings(sync.parse_args(argv, settings_cls=AsyncSettings, checkpoints=True))
    state = sync.load_checkpoint(cfg, SAME_ON_RESUME) if cfg.resume else None  # before any work
    task = sync.make_task(cfg)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    link = None
    try:
        model, tokenizer = sync.tiny_qwen2(cfg, task)
        if cfg.teacher:  # a teacher that cannot score the student's tokens: refused here
            distill.load_teacher(cfg, task, tokenizer)  # (the sampler process loads its own)
            distill.suppress_padding(model, tokenizer)  # no mass where no sample can go
        held_out = set(eval_problems(cfg, task)["query"])
        view = sync.make_sampler(model, tokenizer, cfg, cls=ExactLogProbsTransformersWrapper)
        # the backend first: the local sampler process imports and builds its model meanwhile
        link = start_link(cfg, held_out, view, tokenizer, task, sampler_resume(state))
        eval_accuracy, sft_steps = warm_started(cfg, task, model, tokenizer, state is None)
        if state is None:
            acc_before = eval_accuracy()
            print(
                f"warm start: {sft_steps} supervised steps, greedy {task.metric} "
                f"{acc_before:.3f} on {cfg.eval_prompts} held-out prompts "
                f"({time.perf_counter() - CLOCK['start']:.0f} s)"
            )
        else:  # the warm start's weights: the reference, and where the policy's are loaded
            model.load_state_dict(state["reference"])
            acc_before = state["progress"]["acc_before"]
        reference = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        ref_model = copy.deepcopy(model).requires_grad_(False)
        start = [p.detach().clone() for p in model.parameters()]
        trainer = Trainer(cfg, model, ref_model, tokenizer, view)
        trainer.link = link
        history = collections.defaultdict(list, eval_step=[0], accuracy=[acc_before])
        if state is not None:
            trainer.load_state_dict(state)
            link.rb.loads(state["buffer"])
            torch.set_rng_state(state["rng"])
            history.update(state["progress"]["history"])
            print(f"resumed {cfg.resume} after {state['progress']['step']} GRPO steps")
        trainer.version = link.start(trainer.weights())
        logger = CSVLogger(
            generate_exp_name(task.name + "_async", f"seed{cfg.seed}"), log_dir=cfg.out
        )
        folder = Path(logger.log_dir) / logger.exp_name / sync.CHECKPOINT
        save = None
        if cfg.backend == "local":  # the Ray backend's collectors and buffer are not saved
            save = partial(save_checkpoint, folder, cfg, trainer, history, acc_before, reference)
        loop_start = time.perf_counter()
        try:
            train(cfg, trainer, eval_accuracy, logger, history, save)
        except SamplerLost as error:  # the trainer's state is whole: keep it
            if save is not None:
                save()
            raise SamplerLost(f"{error}\nits state is saved: --resume {folder.parent}") from error
        loop_s = time.perf_counter() - loop_start
        if save is not None:
            save()
    finally:
        if link is not None:
            link.close()
    counts = report(trainer, loop_s)
    return finish(cfg, trainer, tokenizer, logger, history, start, counts)


def finish(cfg, trainer, tokenizer, logger, history, start, counts) -> dict:
    """Plot, save the model and tokenizer, print the RESULT line."""
    model = trainer.model
    run_dir = Path(logger.log_dir) / logger.exp_name
    acc_before, acc_after = history["accuracy"][0], history["accuracy"][-1]
    plot(history, trainer.lags, run_dir / "llm_grpo_async.png", acc_before, cfg.backend)
    model.save_pretrained(run_dir / "model")
    tokenizer.save_pretrained(run_dir / "tokenizer")
    sync.remove_empty_folders(run_dir)
    max_lag = max(trainer.lags) if trainer.lags else -1
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
        "rows": counts,
        "lags": dict(trainer.lags),
    }


if __name__ == "__main__":
    main()
