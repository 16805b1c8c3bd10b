"""Tests of torchrl_grpo/_release.py: returns, the group filters, advantages written, counters."""

import random

import pytest
import torch
from helpers import trajectory
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torchrl.objectives.llm import MCAdvantageSelector

from torchrl_grpo import _grouping
from torchrl_grpo._pending import Pending, Returns
from torchrl_grpo._reading import Keys, read_insertion
from torchrl_grpo._release import (
    Estimator,
    GroupFilter,
    Released,
    StepGroups,
    _released_anchors,
    count,
    fresh_stats,
    release,
    torchrl_returns,
    trajectory_returns,
)
from torchrl_grpo.advantages import (
    gigpo_advantage,
    group_relative_advantage,
    multi_reward_advantage,
    reinforce_pp_baseline_advantage,
)

KEYS = Keys(group="seed", reward=("next", "reward"), done=("next", "done"), advantage="advantage")
GRPO = Estimator(None, "mean", "group", 1e-6, False)
NO_FILTER = GroupFilter(None, None)


def torchrl_decision(returns, bounds):
    """torchrl 0.14.1, ``MCAdvantage._trajectory_advantage``: selected, then kept."""
    candidates = TensorDict({"return": returns}, [returns.shape[0]])
    selected = MCAdvantageSelector().select(
        candidates, group_size=returns.shape[0], keep_return_bounds=bounds
    )
    low, high = bounds
    return selected is not None, selected is not None and low < float(returns.mean()) < high


class TestTorchRLReturns:
    @pytest.mark.parametrize("mode", ["sum", "mean", "max", "last"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_each_rounds_as_torchrl_reduces_one_trajectory(self, mode, dtype):
        gen = torch.Generator().manual_seed(0)
        for lengths in ([3] * 5, [1, 7, 3, 7, 2, 1, 30]):
            rewards = [torch.randn(n, 1, generator=gen).to(dtype) / 7 for n in lengths]
            got = torchrl_returns(torch.cat(rewards).reshape(-1), torch.tensor(lengths), mode)
            reduce = {
                "sum": lambda r: r.sum(),
                "mean": lambda r: r.mean(),
                "max": lambda r: r.max(),
                "last": lambda r: r.reshape(-1)[-1],
            }[mode]
            want = torch.stack([reduce(r) for r in rewards])
            assert got.dtype == dtype and torch.equal(got, want)

    def test_float64_returns_for_the_advantage(self):
        batch = read_insertion(
            torch.cat([trajectory(0, [0.1] * 3), trajectory(0, [2.0])]), KEYS, Pending()
        )
        got = trajectory_returns(batch, "sum")
        assert got.dtype == torch.float64
        assert got.tolist() == [3 * float(torch.tensor(0.1)), 2.0]
        assert trajectory_returns(batch, None).tolist() == [0.0, 0.0]


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
        selected, kept = GroupFilter(bounds, None).apply(
            returns.double(),
            torch.zeros(len(values), dtype=torch.long),
            1,
            torchrl_returns=returns[None],
        )
        assert (bool(selected), bool(kept)) == torchrl_decision(returns, bounds)
        one = GroupFilter(bounds, None)
        assert one.selects(returns.double(), returns) == bool(selected)
        assert (one.selects(returns.double(), returns) and one.keeps_selected(returns)) == bool(
            kept
        )

    def test_std_threshold_is_part_of_selection(self):
        flat, spread = torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0])
        x = torch.cat([flat, spread]).double()
        index = torch.tensor([0, 0, 1, 1])
        selected, kept = GroupFilter(None, 0.0).apply(x, index, 2)
        assert selected.tolist() == kept.tolist() == [False, True]
        returns = torch.stack([flat, spread])
        selected, kept = GroupFilter((0.6, 2.0), 0.0).apply(x, index, 2, torchrl_returns=returns)
        assert selected.tolist() == [False, False] and kept.tolist() == [False, False]


class TestRelease:
    def released(self, trajs, estimator=GRPO, group_filter=NO_FILTER, size=None, keys=KEYS):
        batch = read_insertion(torch.cat(trajs), keys, Pending())
        rounds = _grouping.find_rounds(Pending(), batch, size or len(trajs))
        mode = estimator.trajectory_return
        value = trajectory_returns(batch, mode)
        exact = None if mode is None else torchrl_returns(batch.rewards, batch.reward_lengths, mode)
        out = release(
            Pending(),
            batch,
            rounds,
            Returns(value, exact),
            estimator=estimator,
            group_filter=group_filter,
            keys=keys,
        )
        return out, batch, rounds

    def test_per_step_advantages(self):
        trajs = [
            trajectory(0, [1.0, 2.0]),
            trajectory(1, [5.0]),
            trajectory(0, [3.0]),
            trajectory(1, [1.0]),
        ]
        out, batch, _ = self.released(trajs, size=2)
        want = group_relative_advantage(batch.rewards, torch.tensor([0, 0, 1, 0, 1]), 2).float()
        assert out.out is batch.data  # everything released: the insertion, as it came
        assert torch.equal(out.out["advantage"].reshape(-1), want)
        assert (out.written, out.selected) == (2, 2)

    def test_trajectory_advantages_on_every_step(self):
        trajs = [trajectory(0, [1.0, 2.0]), trajectory(0, [0.0]), trajectory(0, [4.0, 4.0, 4.0])]
        out, _, _ = self.released(trajs, estimator=GRPO._replace(trajectory_return="sum"))
        per_trajectory = group_relative_advantage(
            torch.tensor([3.0, 0.0, 12.0]), torch.zeros(3, dtype=torch.long), 1
        ).float()
        want = per_trajectory.repeat_interleave(torch.tensor([2, 1, 3]))
        assert torch.equal(out.out["advantage"].reshape(-1), want)

    def test_a_filtered_group_is_not_written(self):
        trajs = [
            trajectory(0, [1.0]),
            trajectory(0, [1.0]),
            trajectory(1, [0.0]),
            trajectory(1, [1.0]),
        ]
        out, _, _ = self.released(
            trajs,
            estimator=GRPO._replace(trajectory_return="sum"),
            group_filter=GroupFilter((0.1, 0.9), None),
            size=2,
        )
        assert out.out["seed"].tolist() == [1, 1] and (out.written, out.selected) == (1, 1)


class TestBeyondTorchRL:
    """The released groups' advantages with whitening, several rewards and step groups."""

    released = TestRelease.released

    def test_whitened_per_step_samples(self):
        trajs = [
            trajectory(0, [1.0, 2.0]),
            trajectory(0, [6.0]),
            trajectory(1, [0.0]),
            trajectory(1, [3.0]),
        ]
        estimator = GRPO._replace(scale_rewards="none", whiten=True)
        out, batch, _ = self.released(trajs, estimator=estimator, size=2)
        want = reinforce_pp_baseline_advantage(batch.rewards, torch.tensor([0, 0, 0, 1, 1]))
        torch.testing.assert_close(
            out.out["advantage"].reshape(-1).double(), want, rtol=1e-6, atol=1e-6
        )

    def test_several_rewards(self):
        trajs = [
            trajectory(0, [1.0], next_format=[[0.0]]),
            trajectory(0, [0.0], next_format=[[2.0]]),
        ]
        trajs += [trajectory(0, [1.0], next_format=[[1.0]])]
        keys = KEYS._replace(reward_weights=((("next", "reward"), 1.0), (("next", "format"), 2.0)))
        out, _, _ = self.released(trajs, estimator=GRPO._replace(whiten=True), keys=keys)
        x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
        want = multi_reward_advantage(
            x, torch.zeros(3, dtype=torch.long), weights=torch.tensor([1.0, 2.0])
        )
        torch.testing.assert_close(
            out.out["advantage"].reshape(-1).double(), want, rtol=1e-6, atol=1e-6
        )

    def test_step_groups(self):
        trajs = [
            trajectory(0, [0.0, 1.0], obs=["start", "won"]),
            trajectory(0, [0.0, 0.0], obs=["start", "lost"]),
        ]
        estimator = GRPO._replace(trajectory_return="sum", step_groups=StepGroups(1.0, 2.0, 0.5))
        out, _, _ = self.released(trajs, estimator=estimator, keys=KEYS._replace(anchor="obs"))
        want = gigpo_advantage(
            torch.tensor([1.0, 0.0]), torch.zeros(2, dtype=torch.long), torch.tensor([0.0, 1.0, 0.0, 0.0]),
            torch.tensor([2, 2]), torch.tensor([0, 1, 0, 2]), gamma=0.5, step_weight=2.0,
        )  # fmt: skip
        torch.testing.assert_close(
            out.out["advantage"].reshape(-1).double(), want, rtol=1e-6, atol=1e-6
        )

    def test_reward_to_go_samples(self):
        """Each element's discounted sum to its trajectory's end is the sample: by hand, with
        the groups released in another order than they arrived."""
        trajs = [
            trajectory(0, [1.0, 2.0, 4.0]),
            trajectory(1, [5.0, 1.0]),
            trajectory(0, [8.0]),
            trajectory(1, [2.0]),
        ]
        out, _, _ = self.released(trajs, estimator=GRPO._replace(reward_to_go_gamma=0.5), size=2)
        samples = torch.tensor([1 + 1 + 1, 2 + 2, 4, 5 + 0.5, 1, 8, 2], dtype=torch.float64)
        want = group_relative_advantage(samples, torch.tensor([0, 0, 0, 1, 1, 0, 1]), 2).float()
        assert torch.equal(out.out["advantage"].reshape(-1), want)

    def test_reward_to_go_element_by_element(self):
        """Two reward elements per step: each discounted along the steps on its own."""
        out, _, _ = self.released(
            [trajectory(0, [[1.0, 3.0], [1.0, 1.0]]), trajectory(0, [[2.0, 0.0]])],
            estimator=GRPO._replace(reward_to_go_gamma=0.5),
        )
        samples = torch.tensor([1.5, 3.5, 1.0, 1.0, 2.0, 0.0], dtype=torch.float64)
        want = group_relative_advantage(samples, torch.zeros(6, dtype=torch.long), 1).float()
        assert torch.equal(out.out["advantage"].reshape(-1), want)
        assert out.out["advantage"].shape == (3, 2)


class TestReleasedAnchors:
    def test_tensors_as_they_are(self):
        td = trajectory(0, [1.0, 2.0], obs=[[1, 2], [3, 4]])
        assert torch.equal(_released_anchors(td, "obs"), torch.tensor([[1, 2], [3, 4]]))

    def test_strings_and_ragged_tensors_by_dictionary(self):
        codes = _released_anchors(trajectory(0, [1.0] * 4, obs=["a", "b", "a", "c"]), "obs")
        assert codes.tolist() == [0, 1, 0, 2]
        steps = [
            TensorDict(obs=torch.tensor(v), batch_size=[])
            for v in ([1, 2], [1, 2, 3], [1, 2], [1.0, 2.0])
        ]
        assert _released_anchors(steps, "obs").tolist() == [0, 1, 0, 2]  # the dtype counts too


class TestCount:
    def test_counters(self):
        trajs = [trajectory(0, [1.0, 2.0]), trajectory(0, [-3.0]), trajectory(1, [0.5])]
        batch = read_insertion(torch.cat(trajs), KEYS, Pending())
        rounds = _grouping.Rounds(
            torch.tensor([0, 1]), torch.tensor([0, 0]), 1, None, given_up=2, rescued=1, unselected=3
        )
        released = Released(out=None, written=1, selected=1)
        stats = count(
            fresh_stats(),
            batch,
            trajectory_returns(batch, "max"),
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
        rng = random.Random(0)
        trajs = [trajectory(0, [rng.gauss(0, 1) for _ in range(3)]) for _ in range(4)]
        one_by_one = fresh_stats()
        for t in trajs:
            batch = read_insertion(t, KEYS, Pending())
            one_by_one = count(
                one_by_one,
                batch,
                trajectory_returns(batch, "sum"),
                _grouping.NOTHING,
                Released(out=None, written=0, selected=0),
                trajectory_return="sum",
                group_size=4,
            )
        batch = read_insertion(torch.cat(trajs), KEYS, Pending())
        together = count(
            fresh_stats(),
            batch,
            trajectory_returns(batch, "sum"),
            _grouping.NOTHING,
            Released(out=None, written=0, selected=0),
            trajectory_return="sum",
            group_size=4,
        )
        assert together.keys() == one_by_one.keys()
        for name, value in together.items():
            assert one_by_one[name] == pytest.approx(value), name
