"""GRPO solves CartPole-v1 without a critic, built from torchrl parts and torchrl_grpo.

GRPO compares trajectories that share a starting point. Here a group is ``G`` episodes reset with
the same seed, so they start from the same initial state; the reset seed is stamped on every step
as ``"seed"``, and :class:`torchrl_grpo.MCAdvantage`, appended to a torchrl ``ReplayBuffer``,
groups the episodes by it and writes group-relative advantages when a group is complete.
:class:`torchrl_grpo.GRPOLoss` (a ClipPPOLoss without critic) then optimizes a torchrl
``ProbabilisticActor`` on the released steps for a few epochs; the buffer is emptied after each
batch (on-policy). Every batch plays ``--groups`` x ``--group-size`` episodes on ``--num-envs``
gymnasium sub-environments stepped together behind one torchrl ``GymWrapper``.

After every batch the greedy policy plays ``--eval-episodes`` fresh episodes; training stops when
their mean return reaches ``--target-return``, or when ``--time-budget`` seconds have passed since
the script started. The last line printed is parseable::

    RESULT solved=<true|false> wall_s=<float> env_steps=<int> eval_return=<float>

Run::

    python examples/cartpole_grpo.py                     # defaults: seed 0, CSV logs, PNG
    python examples/cartpole_grpo.py --seed 1 --logger tensorboard
    python examples/cartpole_grpo.py --help

Each run writes a fresh folder ``<output-dir>/seed<seed>-<date>-<time>/``: the logger's files,
``returns.png`` (return against environment steps and wall time) and ``policy.pt`` (the actor's
``state_dict``). See ``docs/tutorial_cartpole.rst`` for the design choices and measurements.
"""

from __future__ import annotations

import time

START = time.perf_counter()  # the time budget and wall_s count from here, imports included

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

import gymnasium as gym  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement  # noqa: E402
from torchrl.envs import ExplorationType, GymWrapper, set_exploration_type  # noqa: E402
from torchrl.envs.utils import step_mdp  # noqa: E402
from torchrl.modules import MLP, ProbabilisticActor  # noqa: E402
from torchrl.objectives.value.functional import reward2go  # noqa: E402
from torchrl.record.loggers import get_logger  # noqa: E402
from tqdm import tqdm  # noqa: E402

from torchrl_grpo import GRPOLoss, MCAdvantage  # noqa: E402

MAX_EPISODE_STEPS = 500  # CartPole-v1 truncates here
EVAL_SEED_OFFSET = 2**30  # evaluation seeds never collide with training seeds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The settings of the run; ``--help`` documents each."""
    p = argparse.ArgumentParser(
        description="GRPO (no critic) on gymnasium's CartPole-v1 with torchrl and torchrl_grpo.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--seed", type=int, default=0, help="seed of torch and of the reset seeds")
    p.add_argument(
        "--group-size", type=int, default=4, help="G: episodes per group, all reset with one seed"
    )
    p.add_argument("--groups", type=int, default=16, help="groups (distinct reset seeds) per batch")
    p.add_argument(
        "--num-envs", type=int, default=64, help="gymnasium sub-environments stepped together"
    )
    p.add_argument("--epochs", type=int, default=4, help="passes of GRPOLoss over each batch")
    p.add_argument("--minibatch-size", type=int, default=1024, help="steps per gradient step")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    p.add_argument("--clip-epsilon", type=float, default=0.2, help="PPO clip range of GRPOLoss")
    p.add_argument("--entropy-coeff", type=float, default=0.0, help="entropy bonus of GRPOLoss")
    p.add_argument(
        "--advantage",
        choices=["reward-to-go", "return"],
        default="reward-to-go",
        help="what is compared within a group: each step's discounted reward-to-go, or each "
        "episode's return (broadcast to its steps)",
    )
    p.add_argument("--gamma", type=float, default=0.99, help="discount of the reward-to-go")
    p.add_argument("--hidden", type=int, default=64, help="width of the policy's 2 hidden layers")
    p.add_argument(
        "--eval-episodes", type=int, default=20, help="fresh episodes per greedy evaluation"
    )
    p.add_argument("--target-return", type=float, default=475.0, help="greedy return that solves")
    p.add_argument(
        "--time-budget",
        type=float,
        default=60.0,
        help="start no new batch after this many seconds since the script started (imports "
        "included)",
    )
    p.add_argument(
        "--max-env-steps", type=int, default=None, help="also stop after this many env steps"
    )
    p.add_argument("--output-dir", default="runs/cartpole", help="logs and plot go here")
    p.add_argument(
        "--logger",
        choices=["csv", "tensorboard", "wandb", "none"],
        default="csv",
        help="torchrl logger; tensorboard and wandb need their extras: pip install -e '.[tensorboard]'",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the tqdm progress bar")
    return p.parse_args(argv)


def make_env(num_envs: int) -> GymWrapper:
    """``num_envs`` CartPole-v1 in one gymnasium ``SyncVectorEnv``, behind one torchrl wrapper.

    One torchrl step then steps every sub-env, so torchrl's per-step cost is paid once for all of
    them. Auto-reset is disabled: finished sub-envs are reset explicitly, with a chosen seed.
    """
    vector_env = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1")] * num_envs,
        autoreset_mode=gym.vector.AutoresetMode.DISABLED,
    )
    return GymWrapper(vector_env, categorical_action_encoding=True)


def make_actor(hidden: int) -> ProbabilisticActor:
    """A categorical policy over CartPole's 2 actions; it writes ``action_log_prob`` for the loss."""
    net = MLP(
        in_features=4, out_features=2, num_cells=[hidden, hidden], activation_class=torch.nn.Tanh
    )
    return ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["logits"]),
        in_keys=["logits"],
        distribution_class=torch.distributions.Categorical,
        return_log_prob=True,
    )


@torch.no_grad()
def play_episodes(env: GymWrapper, policy, seeds: list[int]) -> TensorDict:
    """Play one episode from each reset seed; return their steps, flat, episode after episode.

    The seeds form a queue over the env's sub-envs: a sub-env that finishes an episode is reset
    with the next seed, so no sub-env idles while seeds remain. Every step carries the seed of
    its episode under ``"seed"``. An episode ends at termination or at truncation (step 500);
    both set ``("next", "done")``, which is where :class:`~torchrl_grpo.MCAdvantage` splits.

    Args:
        env: a batched env from :func:`make_env`, with ``N`` sub-envs.
        policy: writes ``"action"`` into the tensordict of the ``N`` current steps.
        seeds: one reset seed per episode to play.

    Returns:
        A TensorDict of shape ``[S]``: all steps of all episodes, each episode contiguous and
        ending with ``("next", "done")`` set.
    """
    n = env.batch_size[0]
    queue = list(seeds)
    first, queue = queue[:n], queue[n:]
    slot_seed = torch.full((n,), -1, dtype=torch.long)  # seed of each sub-env's episode, -1: idle
    slot_seed[: len(first)] = torch.tensor(first, dtype=torch.long)
    td = env.reset(seed=first + [None] * (n - len(first)))
    steps, playing = [], []
    while (slot_seed >= 0).any():
        td["seed"] = slot_seed.clone()
        td = env.step(policy(td))
        steps.append(td)
        playing.append(slot_seed >= 0)
        done = td["next", "done"].squeeze(-1)  # (N,)
        td = step_mdp(td)
        if done.any():
            new_seeds = [None] * n
            for i in done.nonzero().squeeze(-1).tolist():
                new_seeds[i] = queue.pop(0) if queue else None
                slot_seed[i] = -1 if new_seeds[i] is None else new_seeds[i]
            # idle sub-envs are reset too (a finished gymnasium env cannot be stepped) and ignored
            td["_reset"] = done.unsqueeze(-1)
            td = env.reset(td, seed=new_seeds)
    steps = torch.stack(steps, dim=1)  # (N, T): each row holds its sub-env's episodes in order
    return steps[torch.stack(playing, dim=1)]  # (S,), row after row


def evaluate(env: GymWrapper, actor: ProbabilisticActor, seeds: list[int]) -> float:
    """Mean return of the greedy (argmax) policy over one episode per seed."""
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        steps = play_episodes(env, actor, seeds)
    return float(steps["next", "reward"].sum()) / len(seeds)


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


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(argv)
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
            f"--logger {cfg.logger} needs the {cfg.logger} package: pip install -e '.[{cfg.logger}]' "
            f"(or --logger csv). ({error})"
        ) from error
    run_dir.mkdir(parents=True, exist_ok=True)
    if logger is not None:
        logger.log_hparams(vars(cfg))

    env = make_env(cfg.num_envs)
    eval_env = make_env(cfg.eval_episodes)
    actor = make_actor(cfg.hidden)
    loss_module = GRPOLoss(actor, clip_epsilon=cfg.clip_epsilon, entropy_coeff=cfg.entropy_coeff)
    optimizer = torch.optim.Adam(loss_module.parameters(), lr=cfg.lr)

    # The group id is the reset seed; MCAdvantage releases a group once its G episodes arrived.
    if cfg.advantage == "reward-to-go":
        # every step is a sample: A = (reward-to-go - group mean) / group std, over the group's steps
        advantage = MCAdvantage(
            grpo_size=cfg.group_size, prompt_key="seed", rewards_key=("next", "reward_to_go")
        )
    else:
        # every episode is a sample: A = (return - group mean) / group std, on all its steps
        advantage = MCAdvantage(
            grpo_size=cfg.group_size, prompt_key="seed", trajectory_return="sum"
        )
    episodes_per_batch = cfg.groups * cfg.group_size
    buffer = ReplayBuffer(
        storage=LazyTensorStorage(episodes_per_batch * MAX_EPISODE_STEPS),
        sampler=SamplerWithoutReplacement(),
        batch_size=cfg.minibatch_size,
    )
    buffer.append_transform(advantage)

    def fresh_eval_seeds() -> list[int]:  # never used for training, never used twice
        first = EVAL_SEED_OFFSET + cfg.seed * 1_000_000 + len(evals) * cfg.eval_episodes
        return list(range(first, first + cfg.eval_episodes))

    env_steps, batch_index, history, evals = 0, 0, [], []
    eval_return = float("nan")
    seconds = {"setup": time.perf_counter() - START, "play": 0.0, "optimize": 0.0, "evaluate": 0.0}
    bar = tqdm(unit=" steps", unit_scale=True, disable=cfg.no_progress, dynamic_ncols=True)
    while eval_return < cfg.target_return or not evals:
        if time.perf_counter() - START >= cfg.time_budget or (
            cfg.max_env_steps is not None and env_steps >= cfg.max_env_steps
        ):
            break
        # 1. play the batch: each of `groups` consecutive seeds is played `group_size` times
        tick = time.perf_counter()
        first_seed = cfg.seed * 1_000_000 + batch_index * cfg.groups
        seeds = [first_seed + g for g in range(cfg.groups) for _ in range(cfg.group_size)]
        with set_exploration_type(ExplorationType.RANDOM):
            steps = play_episodes(env, actor, seeds)
        if cfg.advantage == "reward-to-go":
            steps["next", "reward_to_go"] = reward2go(
                steps["next", "reward"], steps["next", "done"], cfg.gamma, time_dim=-2
            )
        env_steps += steps.shape[0]
        batch_index += 1
        train_return = float(steps["next", "reward"].sum()) / episodes_per_batch

        # 2. the transform writes the advantages and releases the complete groups to storage
        tock = time.perf_counter()
        seconds["play"] += tock - tick
        buffer.extend(steps)
        # 3. a few epochs of minibatches over the released steps, then forget them (on-policy)
        for _ in range(cfg.epochs):
            for batch in buffer:
                out = loss_module(batch)
                loss = out.loss_objective + out.loss_entropy
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        buffer.empty()

        # 4. greedy evaluation on fresh seeds
        tick = time.perf_counter()
        seconds["optimize"] += tick - tock
        eval_return = evaluate(eval_env, actor, fresh_eval_seeds())
        seconds["evaluate"] += time.perf_counter() - tick
        wall = time.perf_counter() - START
        history.append({"env_steps": env_steps, "wall_s": wall, "return": train_return})
        evals.append({"env_steps": env_steps, "wall_s": wall, "return": eval_return})
        if logger is not None:
            out = out.detach()
            metrics = {
                "train/return": train_return,
                "eval/return": eval_return,
                "train/loss_objective": out.loss_objective,
                "train/entropy": out.entropy,
                "train/kl_approx": out.kl_approx,
                "train/clip_fraction": out.clip_fraction,
                "train/ESS": out.ESS,
                "time/wall_s": wall,
                **{f"time/{phase}_s": value for phase, value in seconds.items()},
            }
            for name, value in metrics.items():
                logger.log_scalar(name, float(value), step=env_steps)
        bar.update(steps.shape[0])
        bar.set_postfix(ret=f"{train_return:.1f}", eval=f"{eval_return:.1f}")
    bar.close()
    if not evals:  # the budget ran out before the first batch: report the untrained policy
        eval_return = evaluate(eval_env, actor, fresh_eval_seeds())
        evals.append({"env_steps": 0, "wall_s": time.perf_counter() - START, "return": eval_return})

    tick = time.perf_counter()
    torch.save(actor.state_dict(), run_dir / "policy.pt")
    save_plot(history, evals, cfg.target_return, run_dir / "returns.png")
    env.close()
    eval_env.close()
    solved = eval_return >= cfg.target_return
    seconds["outputs"] = time.perf_counter() - tick
    wall = time.perf_counter() - START
    print(f"outputs: {run_dir}", flush=True)
    print("seconds: " + ", ".join(f"{phase} {value:.1f}" for phase, value in seconds.items()))
    print(
        f"RESULT solved={str(solved).lower()} wall_s={wall:.2f} env_steps={env_steps} "
        f"eval_return={eval_return:.1f}",
        flush=True,
    )
    return {"solved": solved, "wall_s": wall, "env_steps": env_steps, "eval_return": eval_return}


if __name__ == "__main__":
    main()
