"""Tests of torchrl_grpo/mcadvantage/filters.py: dynamic sampling and the std threshold."""

import pytest
import torch
from helpers import (
    assert_same_releases,
    trajectory,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torchrl.objectives.llm import MCAdvantage as TorchRLMCAdvantage

from torchrl_grpo import MCAdvantage, MCAdvantageSelector
from torchrl_grpo.mcadvantage.filters import filter_groups, keeps_selected, selects
from torchrl_grpo.mcadvantage.options import GroupFilter


def torchrl_decision(returns, bounds):
    """torchrl 0.14.1, ``MCAdvantage._trajectory_advantage``: selected, then kept."""
    candidates = TensorDict({"return": returns}, [returns.shape[0]])
    selected = MCAdvantageSelector().select(
        candidates, group_size=returns.shape[0], keep_return_bounds=bounds
    )
    low, high = bounds
    return selected is not None, selected is not None and low < float(returns.mean()) < high


class TestGroupFilter:
    @settings(max_examples=200, deadline=None)
    @given(
        values=st.lists(
            st.sampled_from([0.0, 0.1, 0.2, 0.3, -0.1, 1 / 3, 0.7]), min_size=2, max_size=5
        ),
        thirds=st.booleans(),
        bounds=st.sampled_from([(0.1, 2.5), (-1.0, 0.1), (0.05, 0.3), (0.2, 0.9)]),
    )
    def test_as_torchrl_decides(self, values, thirds, bounds):
        rewards = [torch.full((3,), v / 3) if thirds else torch.tensor([v]) for v in values]
        returns = torch.stack([r.sum() for r in rewards])  # float32, as torchrl's
        selected, kept = filter_groups(
            GroupFilter(bounds, None),
            returns.double(),
            torch.zeros(len(values), dtype=torch.long),
            1,
            torchrl_returns=returns[None],
        )
        assert (bool(selected), bool(kept)) == torchrl_decision(returns, bounds)
        one = GroupFilter(bounds, None)
        assert selects(one, returns.double(), returns) == bool(selected)
        assert (selects(one, returns.double(), returns) and keeps_selected(one, returns)) == bool(
            kept
        )

    def test_std_threshold_is_part_of_selection(self):
        flat, spread = torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0])
        x = torch.cat([flat, spread]).double()
        index = torch.tensor([0, 0, 1, 1])
        selected, kept = filter_groups(GroupFilter(None, 0.0), x, index, 2)
        assert selected.tolist() == kept.tolist() == [False, True]
        returns = torch.stack([flat, spread])
        bounded = GroupFilter((0.6, 2.0), 0.0)
        selected, kept = filter_groups(bounded, x, index, 2, torchrl_returns=returns)
        assert selected.tolist() == [False, False] and kept.tolist() == [False, False]


class TestDynamicSamplingBounds:
    """``keep_return_bounds`` keeps and drops exactly the groups torchrl keeps and drops."""

    @staticmethod
    def group(rewards, steps):
        """Two trajectories of group 0: each return split evenly over ``steps`` steps."""
        return [trajectory(0, [r / steps] * steps) for r in rewards]

    @pytest.mark.parametrize(
        "rewards, steps, bounds, kept",
        [
            # float32 sums of 0.1 three times (0.3f) put the mean just above 0.1, as torchrl sees it
            ((0.3, -0.1), 3, (0.1, 2.5), True),
            ((0.3, -0.1), 3, (-1.0, 0.1), False),
            ((0.25, 0.75), 1, (0.5, 2.0), False),  # a mean on a bound: exclusive bounds
        ],
    )
    def test_float32_returns_on_a_bound(self, rewards, steps, bounds, kept):
        kw = dict(grpo_size=2, prompt_key="seed", trajectory_return="sum")
        ours = MCAdvantage(**kw, keep_return_bounds=bounds)
        ref = TorchRLMCAdvantage(**kw, keep_return_bounds=bounds)
        trajs = self.group(rewards, steps)
        outs = [(ours.inv(t.clone()), ref.inv(t.clone())) for t in trajs]
        assert (outs[-1][1] is not None) == kept  # torchrl's decision, as the case says
        assert (outs[-1][0] is not None) == kept
        assert ours.get_stats()["dropped_groups"] == ref.get_stats()["dropped_groups"]

    @pytest.mark.parametrize("mode", ["sum", "mean", "max"])
    def test_same_decisions_as_torchrl_on_a_grid(self, mode):
        values = [0.0, 0.1, 0.2, 0.3, 0.05, 0.15, 0.7, 1.1, -0.1]
        bounds_list = [(0.1, 2.5), (0.05, 2.5), (0.15, 2.5), (-1.0, 0.1), (-1.0, 0.2)]
        for steps in (1, 3):
            for bounds in bounds_list:
                chunks = []
                for g, (a, b) in enumerate((a, b) for a in values for b in values):
                    for r in (a, b):
                        chunks.append(trajectory(g, [r / steps] * steps))
                kw = dict(
                    grpo_size=2,
                    prompt_key="seed",
                    trajectory_return=mode,
                    keep_return_bounds=bounds,
                )
                assert_same_releases(chunks, kw)
                assert_same_releases([torch.cat(chunks)], kw)  # all groups in one call
