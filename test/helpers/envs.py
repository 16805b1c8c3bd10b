"""Small deterministic control envs whose episodes end at chosen steps (``test_evaluation.py``).

:class:`Countdown` is MountainCar reduced to its bookkeeping: an episode lasts a known number of
steps and ends at a goal (terminated) with a bonus, so that every episode's return and length
are known by hand. The builders put it behind torchrl the ways a user would: a gymnasium vector
env without auto-reset (the recipe of ``docs/your_own_task.rst``), one with auto-reset
(torchrl's ``VecGymEnvTransform``), and torchrl's ``SerialEnv`` and ``ParallelEnv``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import gymnasium as gym
import numpy as np
import torch
from tensordict.nn import TensorDictModule
from torchrl.envs import GymWrapper, ParallelEnv, SerialEnv
from torchrl.modules import ProbabilisticActor

GOAL_BONUS = 10.0  # paid on the step that reaches the goal, as MountainCar's 100


class Countdown(gym.Env):
    """An episode of ``lengths[k]`` steps, ``k`` its number: each step pays ``1 + action``,
    the last one ``GOAL_BONUS`` more and is terminated (the goal).

    ``reset(seed=s)`` plays episode ``s``; an unseeded reset plays the episode after the last
    (the first unseeded reset plays episode 0). The observation is the steps left.
    """

    observation_space = gym.spaces.Box(0.0, np.inf, (1,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def __init__(self, lengths: Sequence[int]):
        self.lengths = list(lengths)
        self.episode, self.length, self.t = -1, 0, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode = self.episode + 1 if seed is None else seed
        self.length, self.t = self.lengths[self.episode % len(self.lengths)], 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        terminated = self.t >= self.length
        reward = 1.0 + float(np.asarray(action).reshape(-1)[0]) + GOAL_BONUS * terminated
        return self._obs(), reward, terminated, False, {}

    def _obs(self):
        return np.array([self.length - self.t], dtype=np.float32)


def countdown_return(length: int, action: float) -> float:
    """The return of an episode of ``length`` steps that plays ``action`` throughout."""
    return length * (1.0 + action) + GOAL_BONUS


def vector_countdown(lengths: Sequence[Sequence[int]], autoreset: bool = False) -> GymWrapper:
    """Sub-env ``b`` plays ``lengths[b]``, in a gymnasium vector env behind one ``GymWrapper``:
    without auto-reset (torchrl resets finished sub-envs) or with ``SAME_STEP`` auto-reset."""
    mode = gym.vector.AutoresetMode.SAME_STEP if autoreset else gym.vector.AutoresetMode.DISABLED
    vector = gym.vector.SyncVectorEnv(
        [lambda row=row: Countdown(row) for row in lengths], autoreset_mode=mode
    )
    return GymWrapper(vector)


def countdown_env(lengths: Sequence[int]) -> GymWrapper:
    """One :class:`Countdown` behind torchrl's ``GymWrapper`` (a worker of a batched env)."""
    return GymWrapper(Countdown(lengths))


def batched_countdown(lengths: Sequence[Sequence[int]], parallel: bool = False) -> SerialEnv:
    """Sub-env ``b`` plays ``lengths[b]``, in a torchrl ``SerialEnv`` (or ``ParallelEnv``: one
    process a sub-env)."""
    batched = ParallelEnv if parallel else SerialEnv
    return batched(len(lengths), [partial(countdown_env, row) for row in lengths])


def gaussian_actor(loc: float = 0.5, scale: float = 0.3) -> ProbabilisticActor:
    """A Gaussian policy of mean ``loc`` whatever the observation: greedy, it plays ``loc``."""

    def params(observation: torch.Tensor):
        shape = (*observation.shape[:-1], 1)
        return torch.full(shape, loc), torch.full(shape, scale)

    return ProbabilisticActor(
        TensorDictModule(params, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        distribution_class=torch.distributions.Normal,
    )
