"""GRPO on Acrobot-v1 with a torchrl collector: the recipe of docs/your_own_task.rst.

Acrobot pays -1 a step until the tip swings above the bar (at most 500 steps), so a return is
minus the episode's length; gymnasium counts it solved at -100. Each decision below is one line
marked DECISION, explained on the docs page. Run::

    python examples/acrobot_grpo.py                  # seed 0, stops at a mean return of -100
    python examples/acrobot_grpo.py --seed 1 --time-budget 300

Then the greedy policy plays 100 fresh episodes, each to its own end (torchrl_grpo.evaluate).
The last line printed is ``RESULT solved=<true|false> wall_s=<float> env_steps=<int>
return=<float> eval_return=<float>``: the mean return of the last training batch's episodes
(sampled actions), and of the greedy episodes.
"""

import argparse
import logging
import time

import gymnasium as gym
import torch
from tensordict.nn import TensorDictModule
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement
from torchrl.envs import ExplorationType, GymWrapper, TransformedEnv
from torchrl.modules import MLP, ProbabilisticActor
from tqdm import tqdm

from torchrl_grpo import GRPOLoss, MCAdvantage, SameStartGroups, evaluate
from torchrl_grpo.mcadvantage import RewardToGo

GROUP_SIZE = 4  # DECISION group size: episodes per reset seed
NUM_ENVS = 32  # sub-environments stepped together
EPISODES_PER_BATCH = 64  # DECISION when to train: once 64 episodes (16 groups) are released
MAX_STEPS = 500  # Acrobot-v1's time limit
EVAL_EPISODES = 100  # greedy episodes after training, from seeds no training episode used


def make_env(seeds: range, group_size: int = GROUP_SIZE) -> TransformedEnv:
    """Sub-envs that torchrl resets (DISABLED auto-reset), each reset seeded by SameStartGroups."""
    vector_env = gym.make_vec(
        "Acrobot-v1",
        num_envs=NUM_ENVS,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.DISABLED},
    )
    env = GymWrapper(vector_env, categorical_action_encoding=True)
    return TransformedEnv(env, SameStartGroups(group_size, seeds=seeds))  # writes "reset_seed"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of torch and the reset seeds")
    parser.add_argument("--target", type=float, default=-100.0, help="mean return that solves")
    parser.add_argument("--time-budget", type=float, default=180.0, help="seconds, at most")
    parser.add_argument("--max-env-steps", type=int, default=None, help="env steps, at most")
    parser.add_argument(
        "--reward-to-go",
        type=float,
        default=None,
        metavar="GAMMA",
        help="compare each step's discounted reward-to-go instead of each episode's return",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # tiny matrices: more threads cost more than they save
    logging.getLogger("torchrl").setLevel(logging.WARNING)  # torchrl's INFO lines

    net = MLP(in_features=6, out_features=3, num_cells=[64, 64], activation_class=torch.nn.Tanh)
    actor = ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["logits"]),
        in_keys=["logits"],
        distribution_class=torch.distributions.Categorical,
        return_log_prob=True,  # the sampling policy's log-probs: the loss's ratio needs them
    )
    # DECISION return mode: each episode's return, minus its group's mean, over its group's std
    mode = dict(trajectory_return="sum")
    if args.reward_to_go is not None:  # or each step's discounted reward-to-go
        mode = dict(estimator=RewardToGo(args.reward_to_go))
    advantage = MCAdvantage(GROUP_SIZE, prompt_key="reset_seed", **mode)
    # DECISION storage size: one extend can release the training batch plus the pending groups'
    # ended episodes (at most G - 1 per pending group, one pending group per running sub-env)
    capacity = (EPISODES_PER_BATCH + (GROUP_SIZE - 1) * (NUM_ENVS + 1)) * MAX_STEPS
    buffer = ReplayBuffer(
        storage=LazyTensorStorage(capacity),
        sampler=SamplerWithoutReplacement(),
        batch_size=2048,
    )
    buffer.append_transform(advantage)  # extend() writes advantages, stores complete groups
    seeds = range(args.seed * 1_000_000, (args.seed + 1) * 1_000_000)  # never another run's
    collector = Collector(
        make_env(seeds),
        actor,
        frames_per_batch=NUM_ENVS * 32,  # cut anywhere: MCAdvantage joins the pieces
        total_frames=-1,
        exploration_type=ExplorationType.RANDOM,
        auto_register_policy_transforms=False,
    )
    loss_fn = GRPOLoss(actor)
    optimizer = torch.optim.Adam(loss_fn.parameters(), lr=3e-3)

    env_steps, mean_return, solved = 0, float("nan"), False
    bar = tqdm(unit=" steps", unit_scale=True)
    for batch in collector:
        env_steps += batch.numel()
        buffer.extend(batch)
        ready = buffer[:] if len(buffer) else None
        episodes = 0 if ready is None else int(ready["next", "done"].sum())
        if episodes >= EPISODES_PER_BATCH:  # train on the released groups, then forget them
            mean_return = float(ready["next", "reward"].sum()) / episodes
            for _ in range(4):  # epochs
                for minibatch in buffer:
                    loss = loss_fn(minibatch).loss_objective
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            buffer.empty()
            solved = mean_return >= args.target
        bar.update(batch.numel())
        bar.set_postfix(ret=f"{mean_return:.1f}")
        out_of_budget = time.perf_counter() - start > args.time_budget
        if solved or out_of_budget or env_steps >= (args.max_env_steps or float("inf")):
            break
    bar.close()
    collector.shutdown()
    # the greedy policy, each episode played to its own end: env.rollout would stop all 32
    # sub-envs at the first episode that reaches the goal
    eval_env = make_env(range(2**30 + seeds.start, 2**30 + seeds.stop), group_size=1)
    greedy = evaluate(eval_env, actor, EVAL_EPISODES)  # ExplorationType.DETERMINISTIC
    eval_env.close()
    wall_s = time.perf_counter() - start
    print(
        f"RESULT solved={str(solved).lower()} wall_s={wall_s:.2f} env_steps={env_steps} "
        f"return={mean_return:.1f} eval_return={greedy.mean_return:.1f}"
    )
    return {
        "solved": solved,
        "wall_s": wall_s,
        "env_steps": env_steps,
        "return": mean_return,
        "eval_return": greedy.mean_return,
    }


if __name__ == "__main__":
    main()
