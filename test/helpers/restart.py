"""A torchrl collector writing through ``MCAdvantage`` in one process, then started again in
another: the trajectory ids start from 0 again, as after a restart."""

from __future__ import annotations

import torch
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import Compose, GymEnv, StepCounter, TransformedEnv

from torchrl_grpo import MCAdvantage, SameStartGroups


def buffer_and_collector(counter: bool, seed: int):
    """A CartPole collector of random actions (groups of 2 episodes per reset seed, with or
    without torchrl's ``StepCounter``) and a buffer whose transform groups them."""
    torch.manual_seed(seed)
    transforms = [SameStartGroups(2, seeds=range(seed * 10_000, 2**31))]
    if counter:
        transforms.append(StepCounter())
    env = TransformedEnv(GymEnv("CartPole-v1"), Compose(*transforms))
    collector = Collector(env, None, frames_per_batch=40, total_frames=-1)
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000))
    rb.append_transform(MCAdvantage(2, prompt_key="reset_seed", trajectory_return="sum"))
    return rb, collector


def collect(rb, collector, batches: int) -> None:
    for _, batch in zip(range(batches), collector):
        rb.extend(batch)


def first_run(path: str, counter: bool) -> None:
    """A spawn target: collect a few batches, save the transform's state, end the process."""
    torch.set_num_threads(1)
    rb, collector = buffer_and_collector(counter, seed=0)
    collect(rb, collector, 4)
    collector.shutdown()
    torch.save(rb.transform[0].state_dict(), path)
