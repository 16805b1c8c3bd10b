"""GRPO on Pendulum-v1 with a torchrl collector: a dense reward and a continuous action.

Pendulum pays -(angle^2 + 0.1 speed^2 + 0.001 torque^2) at every one of its 200 steps (no
episode ends earlier) for a torque in [-2, 2]; a random policy scores about -1,200, a good one
about -150. Each decision below is one line marked DECISION, explained in
docs/your_own_task.rst (section "Dense rewards and continuous actions: Pendulum"). Run::

    python examples/pendulum_grpo.py                  # seed 0, stops at a mean return of -300
    python examples/pendulum_grpo.py --seed 1 --time-budget 300
    python examples/pendulum_grpo.py --baseline episode --dist tanh --state-std  # for comparison

When a training batch's episodes (sampled actions) reach ``--target``, the greedy policy (the
Gaussian's mean) plays 100 fresh start states, the same ones at every evaluation, none used in
training; the run is solved when their mean return reaches it too. The last line printed is
``RESULT solved=<true|false> wall_s=<float> env_steps=<int> return=<float>``: ``return`` is
that greedy mean (evaluated once more at the end if no batch reached the target), ``wall_s``
counts from before the imports.
"""

# ruff: noqa: E402  (the clock starts before the imports: wall_s covers the whole run)
import time

START = time.perf_counter()

import argparse
import logging
import math

import gymnasium as gym
import torch
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement
from torchrl.envs import ExplorationType, GymWrapper, TransformedEnv
from torchrl.modules import MLP, IndependentNormal, ProbabilisticActor, TanhNormal
from tqdm import tqdm

import torchrl_grpo
from torchrl_grpo import GRPOLoss, MCAdvantage, SameStartGroups
from torchrl_grpo.mcadvantage import RewardToGo

GROUP_SIZE = 8  # DECISION group size: episodes per reset seed
NUM_ENVS = 64  # sub-environments stepped together: 64 episodes (8 groups) every 200 steps
EPISODES_PER_BATCH = 64  # DECISION when to train: once 64 episodes (8 groups) are released
MAX_STEPS = 200  # Pendulum-v1's time limit: every episode is cut there, none ends earlier
EPOCHS, MINIBATCH, LR = 4, 1024, 1e-3  # 4 passes of 12.5 minibatches over each training batch
CLIP_EPSILON = 0.2  # DECISION clip: a step's ratio pulls no further than 1 +- 0.2
INITIAL_STD = 1.0  # the torque's std before training: half the action range, plenty of swing
OBS_SCALE = (1.0, 1.0, 1.0 / 8.0)  # cos, sin, angular speed in [-8, 8]: all in [-1, 1]
EVAL_EPISODES = 100  # greedy episodes per evaluation, played all at once
TRAIN_SEEDS = 1_000_000  # run `seed` trains on [seed * 1e6, (seed + 1) * 1e6): no overlap
EVAL_SEEDS = 2**30  # evaluation starts from seeds 2**30 + seed * 1e6 + i: never trained on


def make_env(first_seed: int, group_size: int, num_envs: int) -> TransformedEnv:
    """Sub-envs that torchrl resets (DISABLED auto-reset), each reset seeded by SameStartGroups."""
    vector_env = gym.make_vec(
        "Pendulum-v1",
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.DISABLED},
    )
    seeds = range(first_seed, first_seed + TRAIN_SEEDS)
    return TransformedEnv(GymWrapper(vector_env), SameStartGroups(group_size, seeds=seeds))


class GaussianHead(torch.nn.Module):
    """The observation scaled to [-1, 1], an MLP, then the Gaussian's (loc, scale): one learned
    std for every state, or (``state_std``) an MLP output per state, through
    ``NormalParamExtractor``."""

    def __init__(self, state_std: bool):
        super().__init__()
        outputs = 2 if state_std else 1
        self.net = MLP(3, outputs, num_cells=[64, 64], activation_class=torch.nn.Tanh)
        self.register_buffer("obs_scale", torch.tensor(OBS_SCALE))
        self.split = NormalParamExtractor() if state_std else None
        # DECISION std: one learned log-std for every state, as PPO's Gaussian policies
        self.log_std = torch.nn.Parameter(torch.tensor([math.log(INITIAL_STD)]))

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(observation * self.obs_scale)
        if self.split is not None:
            return self.split(out)
        return out, self.log_std.exp().expand_as(out)


def make_actor(dist: str, state_std: bool) -> ProbabilisticActor:
    """A Gaussian over the torque: IndependentNormal, which the env clips to [-2, 2] (Pendulum
    clips its input), or TanhNormal, squashed into [-2, 2] by the distribution itself."""
    # DECISION distribution: a Normal; the loss scores the stored (unclipped) sample exactly
    distribution = {"normal": (IndependentNormal, {})}
    distribution["tanh"] = (TanhNormal, {"low": -2.0, "high": 2.0})
    distribution_class, distribution_kwargs = distribution[dist]
    return ProbabilisticActor(
        TensorDictModule(
            GaussianHead(state_std), in_keys=["observation"], out_keys=["loc", "scale"]
        ),
        in_keys=["loc", "scale"],
        distribution_class=distribution_class,
        distribution_kwargs=distribution_kwargs,
        return_log_prob=True,  # the sampling policy's log-probs: the loss's ratio needs them
    )


def evaluate(actor: ProbabilisticActor, seed: int) -> float:
    """Mean return of the greedy policy (the Gaussian's mean) from EVAL_EPISODES fresh starts,
    each episode played to its own end by torchrl_grpo.evaluate (here all end at step 200)."""
    env = make_env(EVAL_SEEDS + seed * TRAIN_SEEDS, 1, EVAL_EPISODES)
    played = torchrl_grpo.evaluate(env, actor, EVAL_EPISODES)  # greedy: DETERMINISTIC
    env.close()
    return played.mean_return


def parse(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of torch and the reset seeds")
    parser.add_argument("--target", type=float, default=-300.0, help="mean return that solves")
    parser.add_argument("--time-budget", type=float, default=300.0, help="seconds, at most")
    parser.add_argument("--max-env-steps", type=int, default=None, help="env steps, at most")
    parser.add_argument("--gamma", type=float, default=0.95, help="reward-to-go's discount")
    parser.add_argument(
        "--baseline",
        choices=["time_step", "group", "episode"],
        default="time_step",
        help="what a step's reward-to-go is compared with (episode: one return per episode)",
    )
    parser.add_argument("--dist", choices=["normal", "tanh"], default="normal")
    parser.add_argument("--state-std", action="store_true", help="a std per state (MLP output)")
    parser.add_argument("--entropy-coeff", type=float, default=0.0, help="entropy bonus")
    return parser.parse_args(argv)


def make_buffer(args: argparse.Namespace) -> ReplayBuffer:
    """The replay buffer that groups the episodes by seed and writes their advantages."""
    # DECISION return mode: a dense reward credits each step with its discounted reward-to-go,
    # compared with the mean of its group's episodes at the same time step (same start, same
    # steps left); --baseline episode is one return per episode, as for Acrobot
    mode = dict(estimator=RewardToGo(args.gamma, baseline=args.baseline))
    if args.baseline == "episode":
        mode = dict(trajectory_return="sum")
    advantage = MCAdvantage(GROUP_SIZE, prompt_key="reset_seed", **mode)
    # DECISION storage size: the training batch plus the pending groups' ended episodes
    capacity = (EPISODES_PER_BATCH + (GROUP_SIZE - 1) * (NUM_ENVS + 1)) * MAX_STEPS
    buffer = ReplayBuffer(
        storage=LazyTensorStorage(capacity),
        sampler=SamplerWithoutReplacement(),
        batch_size=MINIBATCH,
    )
    buffer.append_transform(advantage)  # extend() writes advantages, stores complete groups
    return buffer


def train(buffer: ReplayBuffer, loss_fn: GRPOLoss, optimizer: torch.optim.Optimizer) -> None:
    """EPOCHS passes over the released groups, in minibatches."""
    for _ in range(EPOCHS):
        for minibatch in buffer:
            out = loss_fn(minibatch)
            loss = out.loss_objective + out.loss_entropy  # -entropy_coeff x entropy
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def main(argv=None, start: float | None = None) -> dict:
    """Train until the target or the budget; ``start``: the clock's origin (default: now)."""
    args = parse(argv)
    start = time.perf_counter() if start is None else start
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # tiny matrices: more threads cost more than they save
    logging.getLogger("torchrl").setLevel(logging.WARNING)  # torchrl's INFO lines
    actor = make_actor(args.dist, args.state_std)
    buffer = make_buffer(args)
    collector = Collector(
        make_env(args.seed * TRAIN_SEEDS, GROUP_SIZE, NUM_ENVS),
        actor,
        frames_per_batch=NUM_ENVS * 50,  # cut anywhere: MCAdvantage joins the pieces
        total_frames=-1,
        exploration_type=ExplorationType.RANDOM,
        auto_register_policy_transforms=False,
    )
    loss_fn = GRPOLoss(actor, clip_epsilon=CLIP_EPSILON, entropy_coeff=args.entropy_coeff)
    optimizer = torch.optim.Adam(loss_fn.parameters(), lr=LR)

    env_steps, train_return, eval_return, solved = 0, float("nan"), None, False
    bar = tqdm(unit=" steps", unit_scale=True)
    for batch in collector:
        env_steps += batch.numel()
        buffer.extend(batch)
        ready = buffer[:] if len(buffer) else None
        episodes = 0 if ready is None else int(ready["next", "done"].sum())
        if episodes >= EPISODES_PER_BATCH:  # train on the released groups, then forget them
            train_return = float(ready["next", "reward"].sum()) / episodes
            train(buffer, loss_fn, optimizer)
            buffer.empty()
            if train_return >= args.target:
                eval_return = evaluate(actor, args.seed)
                solved = eval_return >= args.target
                bar.write(f"{env_steps} steps: train {train_return:.1f}, greedy {eval_return:.1f}")
        bar.update(batch.numel())
        bar.set_postfix(ret=f"{train_return:.1f}")
        out_of_budget = time.perf_counter() - start > args.time_budget
        if solved or out_of_budget or env_steps >= (args.max_env_steps or float("inf")):
            break
    bar.close()
    collector.shutdown()
    eval_return = eval_return if solved else evaluate(actor, args.seed)  # the final policy
    wall_s = time.perf_counter() - start
    print(
        f"RESULT solved={str(solved).lower()} wall_s={wall_s:.2f} env_steps={env_steps} "
        f"return={eval_return:.1f}"
    )
    return {
        "solved": solved,
        "wall_s": wall_s,
        "env_steps": env_steps,
        "return": eval_return,
        "train_return": train_return,
    }


if __name__ == "__main__":
    main(start=START)
