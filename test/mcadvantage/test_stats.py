"""Tests of torchrl_grpo/mcadvantage/stats.py: torchrl's counters and the sizes of what is held."""

import random

import pytest
import torch
from helpers import (
    trajectory,
)
from helpers.states import KEYS

from torchrl_grpo import MCAdvantage
from torchrl_grpo.mcadvantage.groups import NOTHING
from torchrl_grpo.mcadvantage.read import read_insertion
from torchrl_grpo.mcadvantage.records import Pending, Released, Rounds
from torchrl_grpo.mcadvantage.returns import insertion_returns
from torchrl_grpo.mcadvantage.stats import STAT_NAMES, count, fresh_stats


class TestCount:
    def test_counters(self):
        trajs = [trajectory(0, [1.0, 2.0]), trajectory(0, [-3.0]), trajectory(1, [0.5])]
        batch = read_insertion(torch.cat(trajs), KEYS, Pending())
        rounds = Rounds(
            torch.tensor([0, 1]), torch.tensor([0, 0]), 1, None, given_up=2, rescued=1, unselected=3
        )
        released = Released(out=None, written=1, selected=1)
        stats = count(
            fresh_stats(),
            batch,
            insertion_returns(batch, "max", exact=False).value,
            rounds,
            released,
            trajectory_return="max",
            group_size=2,
        )
        assert stats["completed_trajectories"] == 3 and stats["completed_decisions"] == 4
        assert stats["trajectory_return_sum"] == pytest.approx(0.5)  # sums, whatever the mode
        assert stats["trajectory_return_max"] == 3.0 and stats["successful_trajectories"] == 2
        assert (stats["completed_groups"], stats["written_groups"], stats["dropped_groups"]) == (
            3,
            1,
            2,
        )
        assert (stats["rescued_groups"], stats["unselected_trajectories"]) == (1, 3)
        assert stats["selected_trajectories"] == 2

    def test_one_trajectory_counts_as_many(self):
        def counted(stats, td):  # an insertion that completes no group
            batch = read_insertion(td, KEYS, Pending())
            returns = insertion_returns(batch, "sum", exact=False).value
            nothing = Released(out=None, written=0, selected=0)
            return count(
                stats, batch, returns, NOTHING, nothing, trajectory_return="sum", group_size=4
            )

        rng = random.Random(0)
        trajs = [trajectory(0, [rng.gauss(0, 1) for _ in range(3)]) for _ in range(4)]
        one_by_one = fresh_stats()
        for t in trajs:
            one_by_one = counted(one_by_one, t)
        together = counted(fresh_stats(), torch.cat(trajs))
        assert together.keys() == one_by_one.keys()
        for name, value in together.items():
            assert one_by_one[name] == pytest.approx(value), name


class TestSnapshot:
    def test_torchrls_names_and_the_sizes_of_what_is_held(self):
        t = MCAdvantage(3, prompt_key="seed")
        for seed in (4, 5, 4):
            t.inv(trajectory(seed, [1.0, 2.0]))
        stats = t.get_stats()
        assert set(STAT_NAMES) <= set(stats)
        assert (stats["queued_groups"], stats["queued_trajectories"]) == (2, 3)
        assert stats["max_queued_trajectories_per_group"] == 2
        assert (stats["held_trajectories"], stats["held_steps"]) == (0, 0)
        assert fresh_stats()["trajectory_return_max"] == float("-inf")
