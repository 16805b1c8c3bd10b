"""torchrl's own PPO on CartPole-v1: the reference the GRPO demo is compared with.

What a torchrl user would pick instead of GRPO: ``ClipPPOLoss`` with a critic, advantages from
``GAE``, data from the same torchrl ``Collector`` over the same layout (the demo's ``--num-envs``
numpy-vectorized CartPoles behind one ``GymWrapper``), the same policy network (two tanh
layers of ``--hidden``, from ``examples/cartpole_grpo.py``) and a critic of the same size. The
budget rules are the demo's: the clock starts at the first line (imports included); after every
batch the greedy policy plays ``--eval-episodes`` fresh episodes and, if they reach
``--target-return``, ``--confirm-episodes`` more (the demo's ``greedy_return``, the same seeds);
training stops at the first evaluation confirmed at the target,
after ``--time-budget`` seconds or ``--max-env-steps`` steps. PPO needs no groups and no whole
episodes: the collector yields ``--frames-per-batch`` steps, GAE bootstraps the cut episodes
from the critic, and the sub-envs are plain (seeded once, unseeded resets, no
``SameStartGroups``). Hyper-parameters: the usual CartPole PPO set (cleanrl's ``ppo.py``:
gamma 0.99, lambda 0.95, clip 0.2, 4 epochs, advantage normalization, gradient norm 0.5), with
the batch and learning rate chosen for 64 sub-envs (``docs/benchmarks.rst`` says how).

It ends like the demo, so ``benchmarks/cartpole_seeds.py`` runs both the same way::

    outputs: <run folder, with policy.pt (the actor's state_dict) and returns.png>
    seconds: setup ..., play ..., optimize ..., evaluate ..., outputs ...
    RESULT solved=<true|false> wall_s=<float> env_steps=<int> eval_return=<float>

Run::

    python benchmarks/cartpole_ppo.py --seed 0
"""

# ruff: noqa: E402  (the clock starts before the imports: wall_s covers the whole run)
import time

START = time.perf_counter()

import argparse
import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement
from torchrl.envs import ExplorationType, GymWrapper, RewardSum, TransformedEnv
from torchrl.modules import MLP, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cartpole_grpo.py"


def load_demo():
    """``examples/cartpole_grpo.py`` as a module: its actor, evaluation and plot."""
    spec = importlib.util.spec_from_file_location("cartpole_grpo", EXAMPLE)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


demo = load_demo()


@dataclass
class Settings:
    """Every setting of the run; each is a command-line flag (``--frames-per-batch 2048``)."""

    seed: int = 0
    num_envs: int = 64  # the demo's layout
    frames_per_batch: int = 1024  # 16 steps of the 64 sub-envs per batch
    epochs: int = 4
    minibatch_size: int = 256
    lr: float = 2.5e-3
    gamma: float = 0.99
    lmbda: float = 0.95
    clip_epsilon: float = 0.2
    entropy_coeff: float = 0.0
    critic_coeff: float = 0.5
    max_grad_norm: float = 0.5
    hidden: int = 64
    eval_episodes: int = 20
    confirm_episodes: int = 100
    target_return: float = 475.0
    time_budget: float = 60.0
    max_env_steps: int = 0  # 0: no limit
    output_dir: str = "runs/cartpole_ppo"
    no_progress: bool = False  # accepted for the benchmark's command line; nothing to hide


def parse_args(argv=None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=f.type, default=f.default)
    return Settings(**vars(parser.parse_args(argv)))


def make_env(num_envs: int, seed: int) -> TransformedEnv:
    """The demo's vector env without SameStartGroups (PPO needs no groups), with RewardSum."""
    env = GymWrapper(demo.CartPoles(num_envs), categorical_action_encoding=True)
    env.set_seed(seed)
    return TransformedEnv(env, RewardSum())


def make_critic(hidden: int) -> ValueOperator:
    net = MLP(
        in_features=4, out_features=1, num_cells=[hidden, hidden], activation_class=torch.nn.Tanh
    )
    return ValueOperator(net, in_keys=["observation"])


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)
    run_dir = Path(cfg.output_dir) / f"seed{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    while run_dir.exists():
        run_dir = run_dir.with_name(run_dir.name + "+")
    run_dir.mkdir(parents=True)

    actor, critic = demo.make_actor(cfg.hidden), make_critic(cfg.hidden)  # before the envs
    first_seed = cfg.seed * demo.SEEDS_PER_RUN
    env = make_env(cfg.num_envs, first_seed)
    # the demo's evaluation, on the demo's evaluation seeds
    eval_env = demo.EvalEpisodes(
        cfg.eval_episodes,
        range(demo.EVAL_SEED_OFFSET + first_seed, demo.CONFIRM_SEED_OFFSET + first_seed),
    )
    confirm_env = demo.EvalEpisodes(
        cfg.confirm_episodes,
        range(
            demo.CONFIRM_SEED_OFFSET + first_seed,
            demo.EVAL_SEED_OFFSET + first_seed + demo.SEEDS_PER_RUN,
        ),
    )
    loss_module = ClipPPOLoss(
        actor,
        critic,
        clip_epsilon=cfg.clip_epsilon,
        entropy_coeff=cfg.entropy_coeff,
        critic_coeff=cfg.critic_coeff,
        loss_critic_type="l2",
        normalize_advantage=True,
    )
    gae = GAE(gamma=cfg.gamma, lmbda=cfg.lmbda, value_network=critic, average_gae=False)
    optimizer = torch.optim.Adam(loss_module.parameters(), lr=cfg.lr)
    buffer = ReplayBuffer(
        storage=LazyTensorStorage(cfg.frames_per_batch),
        sampler=SamplerWithoutReplacement(),
        batch_size=cfg.minibatch_size,
    )
    collector = Collector(
        env,
        actor,
        frames_per_batch=cfg.frames_per_batch,
        total_frames=-1,
        exploration_type=ExplorationType.RANDOM,
        auto_register_policy_transforms=False,  # an MLP policy: no InitTracker, no primer
    )
    batches = iter(collector)

    env_steps, history, evals = 0, [], []
    eval_return = float("nan")
    seconds = {"setup": time.perf_counter() - START, "play": 0.0, "optimize": 0.0, "evaluate": 0.0}
    solved = False
    while not solved:
        if time.perf_counter() - START >= cfg.time_budget or (
            cfg.max_env_steps and env_steps >= cfg.max_env_steps
        ):
            break
        tick = time.perf_counter()
        steps = next(batches)  # (num_envs, frames_per_batch / num_envs), episodes cut anywhere
        env_steps += steps.numel()
        done = steps["next", "done"]  # RewardSum: the return of each episode that ended here
        train_return = float(steps["next", "episode_reward"][done].mean())
        tock = time.perf_counter()
        seconds["play"] += tock - tick
        for _ in range(cfg.epochs):
            with torch.no_grad():
                gae(steps)  # advantage and value target with the current critic
            buffer.extend(steps.reshape(-1))
            for batch in buffer:
                out = loss_module(batch)
                loss = out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(loss_module.parameters(), cfg.max_grad_norm)
                optimizer.step()
            buffer.empty()
        tick = time.perf_counter()
        seconds["optimize"] += tick - tock
        eval_return, solved = demo.greedy_return(actor, eval_env, confirm_env, cfg.target_return)
        seconds["evaluate"] += time.perf_counter() - tick
        wall = time.perf_counter() - START
        history.append({"env_steps": env_steps, "wall_s": wall, "return": train_return})
        evals.append({"env_steps": env_steps, "wall_s": wall, "return": eval_return})
    collector.shutdown()
    if not evals:
        eval_return, solved = demo.greedy_return(actor, eval_env, confirm_env, cfg.target_return)
        evals.append({"env_steps": 0, "wall_s": time.perf_counter() - START, "return": eval_return})

    return demo.finish_run(
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
