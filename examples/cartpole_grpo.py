"""GRPO solves CartPole-v1 without a critic, built from torchrl parts and torchrl_grpo.

GRPO compares episodes that share a starting point. Here a group is ``G`` episodes reset with the
same seed, so they start from the same state: :class:`torchrl_grpo.SameStartGroups`, a torchrl
env transform, hands each reset seed to ``G`` episodes and stamps it on every step as
``"reset_seed"``. A torchrl ``Collector`` plays the policy on ``--num-envs`` CartPoles stepped
together as numpy arrays (gymnasium's ``CartPoleVectorEnv``, see ``CartPoles``) behind one
``GymWrapper``. ``--layout`` chooses its batches:
``stream`` (the default), ``--frames-per-batch`` steps of every sub-env, episodes cut anywhere,
each batch extended into the buffer as it comes; or ``episodes``, ``--groups`` x ``--group-size``
complete episodes (``trajs_per_batch``).
:class:`torchrl_grpo.MCAdvantage`, appended to a torchrl ``ReplayBuffer``, joins the pieces of
each episode (``stream``), groups the episodes by seed and writes group-relative advantages once
a group is complete (a group whose episodes are still running waits for a later batch); each
step's sample is its discounted reward-to-go, computed by the transform on the whole episode.
:class:`torchrl_grpo.GRPOLoss` (a ClipPPOLoss without critic) then optimizes a torchrl
``ProbabilisticActor`` on the released steps for a few epochs (``stream``: once they hold
``--groups`` x ``--group-size`` episodes); the buffer is then emptied (each step is used for one
training batch's epochs only).

After every training batch, the greedy policy plays ``--eval-episodes`` fresh episodes, all at
once (``EvalEpisodes``); when their mean return reaches ``--target-return``,
``--confirm-episodes`` more fresh episodes decide (gym's criterion is a mean over 100): training
stops if their mean, less two standard errors, reaches it too, or when ``--time-budget`` seconds
have passed since the script started.
The last line printed is parseable::

    RESULT solved=<true|false> wall_s=<float> env_steps=<int> eval_return=<float>

Run::

    python examples/cartpole_grpo.py                     # defaults: seed 0, CSV logs, PNG
    python examples/cartpole_grpo.py --seed 1 --logger tensorboard
    python examples/cartpole_grpo.py --layout episodes   # batches of whole episodes
    python examples/cartpole_grpo.py --help

Each run writes a fresh folder ``<output-dir>/seed<seed>-<date>-<time>/``: the logger's files,
``returns.png`` (return against environment steps and wall time), ``policy.pt`` (the actor's
``state_dict``) and ``checkpoint/``, everything the run needs to go on:
``--resume <that folder>`` continues it in a new folder (``docs/resume.rst``). See
``docs/tutorial_cartpole.rst`` for the design choices and measurements.
"""

# ruff: noqa: E402  (the clock starts before the imports: wall_s covers the whole run)
import time

START = time.perf_counter()  # the time budget and wall_s count from here, imports included

import argparse
import dataclasses
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv
from tensordict.nn import TensorDictModule
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement
from torchrl.envs import ExplorationType, GymWrapper, TransformedEnv
from torchrl.modules import MLP, ProbabilisticActor
from torchrl.record.loggers import get_logger
from tqdm import tqdm

from torchrl_grpo import GRPOLoss, MCAdvantage, SameStartGroups, checkpoint
from torchrl_grpo.mcadvantage import RewardToGo

MAX_EPISODE_STEPS = 500  # CartPole-v1 truncates here
SEEDS_PER_RUN = 1_000_000  # run --seed s trains on reset seeds [s * 1e6, (s + 1) * 1e6)
EVAL_SEED_OFFSET = 2**30  # evaluation seeds never collide with training seeds
CONFIRM_SEED_OFFSET = EVAL_SEED_OFFSET + SEEDS_PER_RUN // 2  # nor with each other
STREAM_FRAMES = 2048  # --frames-per-batch of --layout stream: 32 steps of each of 64 sub-envs
EPISODES_POLL_FRAMES = 512  # ... of --layout episodes: 8 steps of each, between two looks


@dataclass
class Settings:
    """Every setting of the run; each is a command-line flag (``--group-size 8``)."""

    seed: int = field(default=0, metadata={"help": "seed of torch and of the reset seeds"})
    group_size: int = field(default=4, metadata={"help": "G: episodes per group, one reset seed"})
    groups: int = field(
        default=16,
        metadata={
            "help": "episodes per training batch, in groups: a batch is groups x G (stream: at "
            "least, gathered from the collector's batches)"
        },
    )
    num_envs: int = field(
        default=64, metadata={"help": "gymnasium sub-environments stepped together"}
    )
    layout: str = field(
        default="stream",
        metadata={
            "choices": ["stream", "episodes"],
            "help": "the collector's batches: 'stream', --frames-per-batch steps, episodes cut "
            "anywhere and joined by MCAdvantage; 'episodes', --groups x --group-size whole "
            "episodes (trajs_per_batch)",
        },
    )
    frames_per_batch: int | None = field(
        default=None,
        metadata={
            "type": int,
            "help": "env steps (all sub-envs) per collector batch: with --layout stream, what "
            f"each buffer.extend brings (default {STREAM_FRAMES}); with --layout episodes, the "
            f"steps between two looks for finished episodes (default {EPISODES_POLL_FRAMES})",
        },
    )
    epochs: int = field(default=4, metadata={"help": "passes of GRPOLoss over each batch"})
    minibatch_size: int = field(default=1024, metadata={"help": "steps per gradient step"})
    lr: float = field(default=1e-2, metadata={"help": "Adam learning rate"})
    clip_epsilon: float = field(default=0.3, metadata={"help": "PPO clip range of GRPOLoss"})
    entropy_coeff: float = field(default=0.0, metadata={"help": "entropy bonus of GRPOLoss"})
    advantage: str = field(
        default="reward-to-go",
        metadata={
            "choices": ["reward-to-go", "reward-to-go-time-step", "return"],
            "help": "what is compared within a group: each step's discounted reward-to-go with "
            "every step of the group's episodes, or with theirs at the same time step, or each "
            "episode's return (broadcast to its steps)",
        },
    )
    gamma: float = field(default=0.99, metadata={"help": "discount of the reward-to-go"})
    hidden: int = field(default=64, metadata={"help": "width of the policy's 2 hidden layers"})
    eval_episodes: int = field(
        default=20, metadata={"help": "fresh episodes per greedy evaluation"}
    )
    confirm_episodes: int = field(
        default=100,
        metadata={
            "help": "when an evaluation reaches the target, these many more fresh episodes must "
            "too before the run stops (gym's criterion: 100); 0 trusts the evaluation"
        },
    )
    target_return: float = field(default=475.0, metadata={"help": "greedy return that solves"})
    time_budget: float = field(
        default=60.0,
        metadata={
            "help": "start no new batch after this many seconds since the script started "
            "(imports included)"
        },
    )
    max_env_steps: int | None = field(
        default=None, metadata={"help": "also stop after this many env steps", "type": int}
    )
    max_iterations: int | None = field(
        default=None,
        metadata={
            "help": "also stop after this many training batches (a resumed run counts those "
            "before its checkpoint)",
            "type": int,
        },
    )
    resume: str | None = field(
        default=None,
        metadata={
            "help": "continue the run saved in this folder (a run folder, or its checkpoint/): "
            "every run saves one when it stops; the time budget starts again",
            "type": str,
        },
    )
    no_checkpoint: bool = field(
        default=False,
        metadata={
            "help": "save no checkpoint/ when the run stops (up to ~15 MB: the buffer's "
            "storage, when released steps wait there)"
        },
    )
    checkpoint_every: int = field(
        default=0,
        metadata={
            "help": "also save checkpoint/ every this many training batches, so that a killed "
            "run resumes from the last one (0: only when the run stops); each save replaces "
            "the last in one swap, never leaving a torn one"
        },
    )
    output_dir: str = field(default="runs/cartpole", metadata={"help": "logs and plot go here"})
    logger: str = field(
        default="csv",
        metadata={
            "choices": ["csv", "tensorboard", "wandb", "none"],
            "help": "torchrl logger; tensorboard and wandb need their extras: "
            "pip install -e '.[tensorboard]'",
        },
    )
    no_progress: bool = field(default=False, metadata={"help": "hide the tqdm progress bar"})
    verbose: bool = field(
        default=False, metadata={"help": "show torchrl's INFO messages (hidden by default)"}
    )
    device: str = field(
        default="cpu",
        metadata={
            "help": "where the policy, the env's outputs, the replay buffer and the loss live "
            "(cpu, cuda, ...); gymnasium itself steps on the CPU"
        },
    )


def parse_args(argv: list[str] | None = None) -> Settings:
    """The settings of the run; ``--help`` documents each."""
    parser = argparse.ArgumentParser(
        description="GRPO (no critic) on gymnasium's CartPole-v1 with torchrl and torchrl_grpo.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            parser.add_argument(flag, action="store_true", help=f.metadata["help"])
        else:
            kind = f.metadata.get("type", type(f.default))
            parser.add_argument(
                flag,
                type=kind,
                default=f.default,
                choices=f.metadata.get("choices"),
                help=f.metadata["help"],
            )
    return Settings(**vars(parser.parse_args(argv)))


class CartPoles(CartPoleVectorEnv):
    """``num_envs`` CartPole-v1 stepped together as numpy arrays, each reset from its own seed.

    gymnasium's ``CartPoleVectorEnv`` steps every sub-env in one array operation (the physics,
    thresholds, reward and 500-step limit of ``CartPole-v1``), where a ``SyncVectorEnv`` of
    ``gym.make("CartPole-v1")`` loops over them in Python (about 1.2 ms for 64 sub-envs on this
    CPU against 0.03 ms). Two changes make it a seeded ``DISABLED`` auto-reset env, as torchrl's
    ``GymWrapper`` and :class:`~torchrl_grpo.SameStartGroups` expect: a step never restarts an
    ended sub-env (torchrl resets it), and ``reset(seed=[...], options={"reset_mask": ...})``
    starts each selected sub-env where ``gym.make("CartPole-v1").reset(seed=s)`` starts.
    """

    metadata = {**CartPoleVectorEnv.metadata, "autoreset_mode": gym.vector.AutoresetMode.DISABLED}

    def __init__(self, num_envs: int):
        super().__init__(num_envs=num_envs)
        self.autoreset_mode = gym.vector.AutoresetMode.DISABLED

    def reset(self, *, seed=None, options=None):
        if self.state is None:
            super().reset()  # allocates the arrays (the sub-envs are drawn below)
        mask = (options or {}).get("reset_mask")
        mask = np.ones(self.num_envs, dtype=bool) if mask is None else np.asarray(mask, bool)
        if isinstance(seed, int):  # gymnasium's rule: sub-env i gets seed + i; later unseeded
            gym.vector.VectorEnv.reset(self, seed=seed)  # resets draw from a generator of seed
        if seed is None or isinstance(seed, int):
            seed = [None if seed is None else seed + i for i in range(self.num_envs)]
        for i in np.flatnonzero(mask):
            rng = self.np_random if seed[i] is None else gym.utils.seeding.np_random(seed[i])[0]
            self.state[:, i] = rng.uniform(low=-0.05, high=0.05, size=(4,))  # CartPole-v1's
        self.steps[mask] = 0
        self.prev_done[mask] = False
        return self.state.T.astype(np.float32), {}

    def step(self, action):
        self.prev_done[:] = False  # no auto-reset: torchrl resets the sub-envs that ended
        return super().step(action)


def make_env(num_envs: int, seeds: range, group_size: int, device="cpu") -> TransformedEnv:
    """``num_envs`` CartPole-v1 stepped together, each episode reset from a seed G times.

    One :class:`CartPoles` (numpy-vectorized) behind one torchrl ``GymWrapper``: one torchrl
    step steps every sub-env, so torchrl's per-step cost is paid once for all of them.
    torchrl resets finished sub-envs, through :class:`~torchrl_grpo.SameStartGroups`, which
    seeds each reset (``seeds[0]`` G times, then ``seeds[1]``, ...) and writes the seed of every
    step as ``"reset_seed"``. Its outputs are on ``device``.
    """
    env = GymWrapper(CartPoles(num_envs), categorical_action_encoding=True, device=device)
    return TransformedEnv(env, SameStartGroups(group_size, seeds=seeds))


def make_actor(hidden: int) -> ProbabilisticActor:
    """A categorical policy over CartPole's 2 actions, writing ``action_log_prob`` for the loss."""
    net = MLP(
        in_features=4, out_features=2, num_cells=[hidden, hidden], activation_class=torch.nn.Tanh
    )
    return ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["logits"]),
        in_keys=["logits"],
        distribution_class=torch.distributions.Categorical,
        return_log_prob=True,
    )


class EvalEpisodes:
    """``num_episodes`` fresh CartPole-v1 episodes for the greedy policy, all played at once.

    One :class:`CartPoles` steps every episode in one array operation: one policy call and one
    numpy step per time step for all of them, where a torchrl ``env.rollout`` over a
    ``SyncVectorEnv`` pays torchrl's per-step cost (about 1.5 ms) and gymnasium's loop over the
    sub-envs (17x slower for 20 episodes of 500 steps on this CPU). Each
    :func:`episode_returns` starts every episode from the next seed of ``seeds``.
    """

    def __init__(self, num_episodes: int, seeds: range, device="cpu"):
        self.env = CartPoles(num_episodes)
        self.seeds = seeds
        self.used = 0  # seeds taken so far: a checkpoint saves it, so no seed is played twice
        self.device = torch.device(device)

    def next_seeds(self) -> list[int]:
        """The seeds of the next ``num_episodes`` fresh episodes."""
        self.used += self.env.num_envs
        return list(self.seeds[self.used - self.env.num_envs : self.used])

    def close(self) -> None:
        self.env.close()


@torch.no_grad()
def episode_returns(episodes: EvalEpisodes, actor: ProbabilisticActor) -> torch.Tensor:
    """Returns ``(N,)`` of the greedy (argmax) policy, one fresh episode each of ``episodes``.

    Steps every episode until the last one ends (at most 500 steps); an episode's return counts
    its steps up to its ``terminated`` or ``truncated`` (an ended episode is stepped on with the
    others, uncounted).
    """
    env, device = episodes.env, episodes.device
    net = actor.module[0].module  # the MLP of make_actor: observation -> logits
    obs, _ = env.reset(seed=episodes.next_seeds())
    running = torch.ones(env.num_envs, dtype=torch.bool)
    returns = torch.zeros(env.num_envs)
    while running.any():
        # the greedy action, the argmax of the logits, is the mode of the actor's Categorical
        # (what the actor writes under ExplorationType.DETERMINISTIC), at a seventh of the cost
        # of a call through the ProbabilisticActor and a TensorDict (36 us against 258)
        action = net(torch.from_numpy(obs).to(device)).argmax(-1)
        obs, reward, terminated, truncated, _ = env.step(action.cpu().numpy())
        returns += torch.from_numpy(reward) * running
        running &= ~torch.from_numpy(terminated | truncated)
    return returns


def evaluate(episodes: EvalEpisodes, actor: ProbabilisticActor) -> float:
    """Mean return of the greedy policy over the fresh episodes of ``episodes``."""
    return float(episode_returns(episodes, actor).mean())


def greedy_return(
    actor: ProbabilisticActor,
    eval_env: EvalEpisodes,
    confirm_env: EvalEpisodes | None,
    target: float,
) -> tuple[float, bool]:
    """The greedy policy's mean return on fresh episodes, and whether it solves the task.

    The episodes of ``eval_env``; if their mean reaches ``target``, those of ``confirm_env``
    decide (a few lucky episodes can pass; gym's criterion is a mean over 100):
    solved if that mean, less two standard errors, still reaches ``target`` (a one-sided 97.7%
    lower confidence bound): a policy whose true mean is exactly the target passes about once in
    44 tries, where the plain mean would pass every other time.

    Returns:
        ``(mean return of the last evaluation, solved)``.
    """
    returns = episode_returns(eval_env, actor)
    if returns.mean() < target or confirm_env is None:
        return float(returns.mean()), bool(returns.mean() >= target)
    returns = episode_returns(confirm_env, actor)
    lower = returns.mean() - 2 * returns.std() / len(returns) ** 0.5  # std: Bessel's correction
    return float(returns.mean()), bool(lower >= target)


def mean_episode_return(steps) -> float:
    """Mean return of the whole episodes laid flat in ``steps`` (each ends with done)."""
    return float(steps["next", "reward"].sum()) / int(steps["next", "done"].sum())


def save_plot(history: list[dict], evals: list[dict], target: float, path: Path) -> None:
    """Return against environment steps and against wall time, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
    for ax, x in zip(axes, ("env_steps", "wall_s")):
        ax.plot([h[x] for h in history], [h["return"] for h in history], label="training (sampled)")
        ax.plot(
            [e[x] for e in evals], [e["return"] for e in evals], "o-", label="greedy evaluation"
        )
        ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:g}")
        ax.set_xlabel(
            {"env_steps": "environment steps", "wall_s": "wall time, imports included (s)"}[x]
        )
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("episode return")
    axes[0].legend(loc="best", fontsize=8)
    fig.suptitle("GRPO on CartPole-v1 (torchrl + torchrl_grpo)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def finish_run(
    run_dir: Path,
    actor,
    history: list[dict],
    evals: list[dict],
    target: float,
    envs,
    seconds: dict,
    start: float,
    *,
    solved: bool,
    env_steps: int,
    eval_return: float,
) -> dict:
    """Save the policy (on the CPU) and the plot, close ``envs``, remove the empty folders the
    logger made, print the outputs folder, the seconds per phase and the ``RESULT`` line; returns
    the result as a dict. Shared with the PPO
    baseline (``benchmarks/cartpole_ppo.py``), so both end the same way."""
    tick = time.perf_counter()
    torch.save({k: v.cpu() for k, v in actor.state_dict().items()}, run_dir / "policy.pt")
    save_plot(history, evals, target, run_dir / "returns.png")
    for env in envs:
        if env is not None:
            env.close()
    for folder in sorted((p for p in run_dir.rglob("*") if p.is_dir()), reverse=True):
        if not any(folder.iterdir()):  # CSVLogger makes videos/ and texts/ whether used or not
            folder.rmdir()
    seconds["outputs"] = time.perf_counter() - tick
    wall = time.perf_counter() - start
    print(f"outputs: {run_dir}", flush=True)
    print("seconds: " + ", ".join(f"{phase} {value:.1f}" for phase, value in seconds.items()))
    print(
        f"RESULT solved={str(solved).lower()} wall_s={wall:.2f} env_steps={env_steps} "
        f"eval_return={eval_return:.1f}",
        flush=True,
    )
    return {"solved": solved, "wall_s": wall, "env_steps": env_steps, "eval_return": eval_return}


CHECKPOINT = "checkpoint"  # the folder of a run that --resume continues
#: Settings a resumed run must share with its checkpoint: they shape the data or the network.
SAME_ON_RESUME = ("seed", "group_size", "num_envs", "layout", "advantage", "gamma", "hidden")


def save_checkpoint(folder: Path, cfg: Settings, parts: dict, progress: dict) -> None:
    """Everything a stopped run needs to go on, in ``folder``: the replay buffer (its released
    steps and its transform's pending groups and held episode pieces, ``rb.dumps``), the seed
    queue and running episodes of :class:`~torchrl_grpo.SameStartGroups`, the policy, the
    loss's state and the optimizer, the evaluation seeds used, the random number generators and
    the run's progress (env steps, batches, the curves, the logger's step).

    :func:`torchrl_grpo.checkpoint.save_checkpoint` writes them into a new folder and swaps it
    into place, each piece stamped with the batches trained: a kill leaves the previous
    checkpoint or this one, whole."""
    evals = [e.used if e is not None else 0 for e in (parts["eval_env"], parts["confirm_env"])]
    state = {
        "settings": dataclasses.asdict(cfg),
        "loss": parts["loss"].state_dict(),  # the actor's parameters and the loss's own state
        "optimizer": parts["optimizer"].state_dict(),
        "env": parts["env"].transform.state_dict(),
        "eval_seeds_used": evals,
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state()},
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "progress": progress,
    }
    state["rng"]["python"] = random.getstate()
    pieces = {"buffer": parts["buffer"], "state": state}
    checkpoint.save_checkpoint(folder, pieces, stamp=progress["iterations"])


def load_checkpoint(cfg: Settings, parts: dict) -> tuple[dict, dict]:
    """Restore what :func:`save_checkpoint` wrote into freshly built ``parts`` (before the
    collector exists: it resets the env). Returns ``(progress, replays)``: the run's progress
    and the episodes :meth:`~torchrl_grpo.SameStartGroups.resume` plays again, ``{seed: count}``.

    Raises:
        SystemExit: no complete checkpoint there, one that is torn, truncated or changed
            (:func:`torchrl_grpo.checkpoint.load_checkpoint`), a buffer whose episodes the
            env state never started, or settings that change the data or the network.
    """
    folder = Path(cfg.resume)
    folder = folder if folder.name.startswith(CHECKPOINT) else folder / CHECKPOINT
    try:  # our own file: numpy's random state is not a tensor
        saved = checkpoint.load_checkpoint(folder, weights_only=False)
    except checkpoint.CheckpointError as error:
        raise SystemExit(f"--resume {cfg.resume}: {error}") from error
    state = saved.values["state"]
    saved_cfg = state["settings"]
    changed = [k for k in SAME_ON_RESUME if saved_cfg[k] != getattr(cfg, k)]
    if changed:
        raise SystemExit(
            "--resume: the checkpoint was made with "
            + ", ".join(f"--{k.replace('_', '-')} {saved_cfg[k]}" for k in changed)
            + "; pass the same (they shape the data or the network)."
        )
    parts["loss"].load_state_dict(state["loss"])
    parts["optimizer"].load_state_dict(state["optimizer"])
    parts["buffer"].loads(saved.values["buffer"])
    parts["env"].transform.load_state_dict(state["env"])
    for episodes, used in zip((parts["eval_env"], parts["confirm_env"]), state["eval_seeds_used"]):
        if episodes is not None:
            episodes.used = used
    try:  # the episodes running at the checkpoint are lost with the collector: play them again
        replays = parts["env"].transform.resume(parts["advantage"])
    except ValueError as error:  # a buffer holding episodes the env state never started
        raise SystemExit(f"--resume {cfg.resume}: {error}") from error
    torch.set_rng_state(state["rng"]["torch"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    return state["progress"], replays


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(argv)
    if not cfg.verbose:  # torchrl reports specs it infers and storages it allocates at INFO
        logging.getLogger("torchrl").setLevel(logging.WARNING)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)  # tiny matrices: extra threads cost more than they save on 2 cores
    run_name = f"seed{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    while (Path(cfg.output_dir) / run_name).exists():  # two runs in one second: never mix logs
        run_name += "+"
    run_dir = Path(cfg.output_dir) / run_name
    try:
        logger = get_logger(
            None if cfg.logger == "none" else cfg.logger,
            logger_name=cfg.output_dir,
            experiment_name=run_name,
        )
    except ImportError as error:  # tensorboard / wandb missing: say what to install
        raise SystemExit(
            f"--logger {cfg.logger} needs the {cfg.logger} package: "
            f"pip install -e '.[{cfg.logger}]' (or --logger csv). ({error})"
        ) from error
    run_dir.mkdir(parents=True, exist_ok=True)
    if logger is not None:
        logger.log_hparams(dataclasses.asdict(cfg))

    actor = make_actor(cfg.hidden).to(cfg.device)  # first: building envs draws from torch's RNG
    first_seed = cfg.seed * SEEDS_PER_RUN
    seeds = range(first_seed, first_seed + SEEDS_PER_RUN)
    env = make_env(cfg.num_envs, seeds, cfg.group_size, cfg.device)
    eval_seeds = range(EVAL_SEED_OFFSET + first_seed, CONFIRM_SEED_OFFSET + first_seed)
    eval_env = EvalEpisodes(cfg.eval_episodes, eval_seeds, cfg.device)
    confirm_seeds = range(
        CONFIRM_SEED_OFFSET + first_seed, EVAL_SEED_OFFSET + first_seed + SEEDS_PER_RUN
    )
    confirm_env = (
        EvalEpisodes(cfg.confirm_episodes, confirm_seeds, cfg.device)
        if cfg.confirm_episodes
        else None
    )
    loss_module = GRPOLoss(actor, clip_epsilon=cfg.clip_epsilon, entropy_coeff=cfg.entropy_coeff)
    optimizer = torch.optim.Adam(loss_module.parameters(), lr=cfg.lr)

    # The group id is the reset seed; MCAdvantage releases a group once its G episodes ended.
    if cfg.advantage.startswith("reward-to-go"):
        # every step is a sample: A = (G_t - group mean) / group std, over the group's steps, where
        # G_t = r_t + gamma * G_{t+1} is the step's discounted reward-to-go in its whole episode
        # (reward-to-go-time-step: the mean and std of the group's episodes at the same step t);
        # a group of identical episodes gets 0
        advantage = MCAdvantage(
            grpo_size=cfg.group_size,
            prompt_key="reset_seed",
            estimator=RewardToGo(
                cfg.gamma, "time_step" if cfg.advantage.endswith("time-step") else "group"
            ),
        )
    else:
        # every episode is a sample: A = (return - group mean) / group std, on all its steps
        advantage = MCAdvantage(
            grpo_size=cfg.group_size, prompt_key="reset_seed", trajectory_return="sum"
        )
    # The collector plays the policy (sampling actions) on every sub-env without pause: a finished
    # sub-env is reset (by SameStartGroups, with the next seed) and plays on. Every environment
    # step counts, finished or not.
    episodes_per_batch = cfg.groups * cfg.group_size  # a training batch, in whole episodes
    if cfg.layout == "stream":
        # [num_envs, T] batches of `frames_per_batch` steps, episodes cut anywhere, extended as
        # they come: MCAdvantage holds each unfinished episode (by its ("collector", "traj_ids"))
        # and joins it with its continuation in later batches. Training waits until the released
        # groups hold `episodes_per_batch` episodes.
        frames_per_batch = cfg.frames_per_batch or STREAM_FRAMES
        layout = dict(frames_per_batch=frames_per_batch)
        # before the last extend, fewer episodes than a training batch; that extend brings a
        # batch and the held pieces of the episodes it ends (one a sub-env)
        incoming = (episodes_per_batch + cfg.num_envs) * MAX_EPISODE_STEPS + frames_per_batch
    else:
        # batches of `episodes_per_batch` complete episodes, flat, one after the other, assembled
        # from polls of `frames_per_batch` steps; episodes still running wait for a later batch
        layout = dict(
            frames_per_batch=cfg.frames_per_batch or EPISODES_POLL_FRAMES,
            trajs_per_batch=episodes_per_batch,
            traj_format="cat",
        )
        incoming = episodes_per_batch * MAX_EPISODE_STEPS
    # One extend releases at most the episodes that end in this batch and those that ended
    # earlier in groups still pending: a pending group has a member still running on a sub-env
    # (or is the group the seeds are at), and holds at most G - 1 ended episodes.
    held_back = (cfg.group_size - 1) * (cfg.num_envs + 1) * MAX_EPISODE_STEPS
    buffer = ReplayBuffer(
        storage=LazyTensorStorage(incoming + held_back, device=cfg.device),
        sampler=SamplerWithoutReplacement(),
        batch_size=cfg.minibatch_size,
    )
    buffer.append_transform(advantage)
    parts = dict(
        loss=loss_module,
        optimizer=optimizer,
        buffer=buffer,
        env=env,
        advantage=advantage,
        eval_env=eval_env,
        confirm_env=confirm_env,
    )
    progress = dict(env_steps=0, iterations=0, trained=0, history=[], evals=[], wall_s=0.0)
    if cfg.resume:  # before the collector, which resets the env
        progress, replays = load_checkpoint(cfg, parts)
        print(
            f"resumed {cfg.resume}: {progress['iterations']} batches, {progress['env_steps']} env "
            f"steps; {advantage.queued_groups} group(s) pending; episodes played again (they "
            f"were running): {replays}",
            flush=True,
        )
    polled = [progress["env_steps"]]  # env steps of every poll of the sub-envs
    collector = Collector(
        env,
        actor,
        total_frames=-1,
        exploration_type=ExplorationType.RANDOM,
        post_collect_hook=lambda steps: polled.append(steps.numel()),
        auto_register_policy_transforms=False,  # an MLP policy: no InitTracker, no primer
        **layout,
    )
    batches = iter(collector)

    history, evals, out = progress["history"], progress["evals"], None
    trained = progress["trained"]  # episodes trained on so far
    eval_return = evals[-1]["return"] if evals else float("nan")
    seconds = {"setup": time.perf_counter() - START, "play": 0.0, "optimize": 0.0, "evaluate": 0.0}
    bar = tqdm(unit=" steps", unit_scale=True, disable=cfg.no_progress, dynamic_ncols=True)
    solved = False
    while not solved:
        if (
            time.perf_counter() - START >= cfg.time_budget
            or (cfg.max_env_steps is not None and sum(polled) >= cfg.max_env_steps)
            or (cfg.max_iterations is not None and len(history) >= cfg.max_iterations)
        ):
            break
        # 1. play a batch: `frames_per_batch` steps (stream), or until enough episodes ended
        tick = time.perf_counter()
        steps = next(batches)

        # 2. the transform writes the advantages and releases the complete groups to storage
        tock = time.perf_counter()
        seconds["play"] += tock - tick
        buffer.extend(steps)
        ready = advantage.written_groups * cfg.group_size - trained  # released, not trained on
        if not ready or (cfg.layout == "stream" and ready < episodes_per_batch):
            seconds["optimize"] += time.perf_counter() - tock
            continue  # no new group (stream: not a training batch yet): play on
        trained += ready
        # the mean return of the batch's whole episodes (stream: of the episodes released)
        train_return = mean_episode_return(steps if cfg.layout == "episodes" else buffer[:])
        # 3. a few epochs of minibatches over the released steps, then forget them (on-policy)
        for _ in range(cfg.epochs):
            for batch in buffer:
                out = loss_module(batch)
                loss = out.loss_objective + out.loss_entropy
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        buffer.empty()

        # 4. greedy evaluation on fresh seeds (and its confirmation, if it reaches the target)
        tick = time.perf_counter()
        seconds["optimize"] += tick - tock
        eval_return, solved = greedy_return(actor, eval_env, confirm_env, cfg.target_return)
        seconds["evaluate"] += time.perf_counter() - tick
        env_steps, wall = sum(polled), progress["wall_s"] + time.perf_counter() - START
        history.append({"env_steps": env_steps, "wall_s": wall, "return": train_return})
        evals.append({"env_steps": env_steps, "wall_s": wall, "return": eval_return})
        if logger is not None:
            metrics = {
                "train/return": train_return,
                "eval/return": eval_return,
                "time/wall_s": wall,
                **{f"time/{phase}_s": value for phase, value in seconds.items()},
            }
            if out is not None:  # no optimizer step yet (--epochs 0): no loss to log
                out = out.detach()
                metrics.update(
                    {
                        "train/loss_objective": out.loss_objective,
                        "train/entropy": out.entropy,
                        "train/kl_approx": out.kl_approx,
                        "train/clip_fraction": out.clip_fraction,
                        "train/ESS": out.ESS,
                    }
                )
            for name, value in metrics.items():
                logger.log_scalar(name, float(value), step=env_steps)
        bar.update(env_steps - bar.n)
        bar.set_postfix(ret=f"{train_return:.1f}", eval=f"{eval_return:.1f}")
        if (
            cfg.checkpoint_every
            and len(history) % cfg.checkpoint_every == 0
            and not cfg.no_checkpoint
        ):
            now = dict(progress, env_steps=env_steps, iterations=len(history), trained=trained)
            save_checkpoint(run_dir / CHECKPOINT, cfg, parts, dict(now, wall_s=wall))
    bar.close()
    collector.shutdown()
    env_steps = sum(polled)
    if not evals:  # the budget ran out before the first batch: report the untrained policy
        eval_return, solved = greedy_return(actor, eval_env, confirm_env, cfg.target_return)
        evals.append({"env_steps": 0, "wall_s": time.perf_counter() - START, "return": eval_return})
    wall = progress["wall_s"] + time.perf_counter() - START
    progress = dict(progress, env_steps=env_steps, iterations=len(history), trained=trained)
    if not cfg.no_checkpoint:
        save_checkpoint(run_dir / CHECKPOINT, cfg, parts, dict(progress, wall_s=wall))

    return finish_run(
        run_dir,
        actor,
        history,
        evals,
        cfg.target_return,
        (eval_env, confirm_env),
        seconds,
        START,
        solved=solved,
        env_steps=env_steps,
        eval_return=eval_return,
    )


if __name__ == "__main__":
    main()
