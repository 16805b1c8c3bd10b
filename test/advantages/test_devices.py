"""Tests of :mod:`torchrl_grpo.advantages`: every estimator on each available device, against hand-
computed values and a slow reference."""

import torch

from torchrl_grpo.advantages import (
    discounted_returns,
    gigpo_advantage,
    group_relative_advantage,
    multi_reward_advantage,
    pass_at_k_advantage,
    trajectory_returns,
)


class TestDevices:
    """The public estimators on ``device`` inputs: outputs there, equal to the CPU's."""

    def test_every_estimator(self, device):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(12, generator=gen)
        groups = torch.arange(4).repeat_interleave(3)
        lengths = torch.tensor([2, 1, 3, 2, 2, 1, 1, 3, 2, 1, 2, 2])
        steps = int(lengths.sum())
        step_rewards = torch.rand(steps, generator=gen)
        anchors = torch.randint(0, 3, (steps,), generator=gen)
        two = torch.randn(12, 2, generator=gen)
        calls = {
            "grpo": lambda d: group_relative_advantage(x.to(d), groups.to(d)),
            "whiten": lambda d: group_relative_advantage(x.to(d), groups.to(d), whiten=True),
            "pass_at_k": lambda d: pass_at_k_advantage(x.to(d), groups.to(d)),
            "rloo": lambda d: group_relative_advantage(
                x.to(d), groups.to(d), baseline="leave_one_out"
            ),
            "gdpo": lambda d: multi_reward_advantage(two.to(d), groups.to(d)),
            "returns": lambda d: trajectory_returns(
                step_rewards.to(d), None, reduction="sum", lengths=lengths.to(d)
            ),
            "discounted": lambda d: discounted_returns(step_rewards.to(d), lengths.to(d), 0.9),
            "gigpo": lambda d: gigpo_advantage(
                x.to(d), groups.to(d), step_rewards.to(d), lengths.to(d), anchors.to(d), gamma=0.9
            ),
        }
        for name, call in calls.items():
            want, got = call("cpu"), call(device)
            assert got.device.type == device.type, name
            torch.testing.assert_close(got.cpu(), want, msg=name)
