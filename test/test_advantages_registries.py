"""Tests of torchrl_grpo/advantages.py's registries as the whole contract: a scale added to
``SCALES`` works wherever a scale is looked up, or is refused by name where it has no form."""

import pytest
import torch

from torchrl_grpo.advantages import SCALES, Scale, group_relative_advantage


@pytest.fixture
def half_group():
    """A scale of its own: half the group's std, per group and pooled over time steps."""
    group, batch = SCALES["group"], SCALES["batch"]
    SCALES["half"] = Scale(
        lambda *args: 0.5 * group(*args), lambda m2, dof: 0.5 * group.pooled(m2, dof)
    )
    SCALES["plain"] = batch.per_group  # a bare function: no form pooled over time steps
    yield
    del SCALES["half"], SCALES["plain"]


def test_a_new_scale_is_used_everywhere(half_group):
    x = torch.tensor([1.0, 2.0, 4.0, 0.0, 3.0, 5.0, 1.0, 2.0])
    steps = {"group_index": torch.tensor([0, 0, 1, 1]), "lengths": torch.tensor([2, 2, 2, 2])}
    per_sample = {"group_index": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])}
    for kw in (per_sample, {**steps, "by_time_step": True}):  # runs of two steps, two a group
        std = group_relative_advantage(x, scale_rewards="group", **kw)
        half = group_relative_advantage(x, scale_rewards="half", **kw)
        torch.testing.assert_close(half, 2 * std)


def test_a_scale_without_a_pooled_form_is_refused_by_the_time_step_baseline(half_group):
    x, g = torch.arange(8.0), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    torch.testing.assert_close(
        group_relative_advantage(x, g, scale_rewards="plain"),
        group_relative_advantage(x, g, scale_rewards="batch"),
    )
    with pytest.raises(ValueError, match="'plain' has no form pooled over time steps"):
        group_relative_advantage(
            x,
            torch.tensor([0, 0, 1, 1]),
            scale_rewards="plain",
            lengths=torch.tensor([2, 2, 2, 2]),
            by_time_step=True,
        )


def test_mcadvantage_refuses_it_at_construction(half_group):
    from torchrl_grpo import MCAdvantage

    with pytest.raises(ValueError, match="'plain' has no form pooled over time steps"):
        MCAdvantage(
            4, scale_rewards="plain", reward_to_go_gamma=1.0, reward_to_go_baseline="time_step"
        )
    MCAdvantage(4, scale_rewards="half", reward_to_go_gamma=1.0, reward_to_go_baseline="time_step")
