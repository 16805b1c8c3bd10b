"""Tests of torchrl_grpo/mcadvantage/read.py: one insertion read and checked, whatever its shape."""

import random
import re
import warnings

import pytest
import torch
from helpers import (
    bad_inputs,
    trajectory,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict, lazy_stack
from torchrl.collectors import Collector
from torchrl.envs import Compose, GymEnv, StepCounter, TransformedEnv

from torchrl_grpo import MCAdvantage, SameStartGroups
from torchrl_grpo.mcadvantage.ids import PromptIds, TensorIds
from torchrl_grpo.mcadvantage.options import Keys
from torchrl_grpo.mcadvantage.read import drop_padding, read_insertion, trajectory_bounds
from torchrl_grpo.mcadvantage.records import Pending

KEYS = Keys(group="seed", reward=("next", "reward"), done=("next", "done"), advantage="advantage")
EMPTY = Pending()


def pending_with(keys, ragged=False):
    """A store holding one trajectory per group id in ``keys`` (only the ids matter here)."""
    n = len(keys)
    ids = PromptIds(keys) if isinstance(keys, list) else TensorIds(keys)
    return Pending(spans=torch.zeros(n, 4, dtype=torch.long), ids=ids, ragged=ragged)


class TestTrajectoryBounds:
    def test_one_trajectory(self):
        starts, lengths, width = trajectory_bounds(torch.tensor([False, False, True]))
        assert starts.tolist() == [0] and lengths.tolist() == [3] and width == 3

    def test_several(self):
        done = torch.tensor([True, False, True, False, False, True])
        starts, lengths, width = trajectory_bounds(done)
        assert starts.tolist() == [0, 1, 3] and lengths.tolist() == [1, 2, 3] and width == 0
        starts, lengths, width = trajectory_bounds(torch.tensor([False, True] * 3))
        assert starts.tolist() == [0, 2, 4] and lengths.tolist() == [2, 2, 2] and width == 2

    @settings(max_examples=50, deadline=None)
    @given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=20))
    def test_matches_a_loop(self, lengths):
        done = torch.cat([torch.arange(n) == n - 1 for n in lengths])
        starts, got, width = trajectory_bounds(done)
        assert got.tolist() == lengths
        assert starts.tolist() == [sum(lengths[:i]) for i in range(len(lengths))]
        assert width == (lengths[0] if len(set(lengths)) == 1 else 0)


class TestReadInsertion:
    def test_flat_steps(self):
        td = torch.cat([trajectory(3, [1.0, 2.0]), trajectory(5, [4.0]), trajectory(3, [0.5, 0.5])])
        batch = read_insertion(td, KEYS, EMPTY)
        assert batch.steps.data is td and batch.num_steps == 5 and batch.num_trajectories == 3
        assert batch.starts.tolist() == [0, 2, 3] and batch.lengths.tolist() == [2, 1, 2]
        assert batch.width == 0 and batch.group_ids.values.tolist() == [[3], [5], [3]]
        assert batch.rewards.tolist() == [1.0, 2.0, 4.0, 0.5, 0.5]
        assert batch.reward_lengths.tolist() == [2, 1, 2] and not batch.steps.ragged

    def test_every_shape_reads_the_same(self):
        """``[B, T]`` rows, ``[N]`` steps, a dense lazy stack and a lone step: one reading."""
        rows = torch.stack(
            [torch.cat([trajectory(g, [1.0, float(g)]), trajectory(g + 1, [2.0])]) for g in (1, 7)]
        )
        flat = rows.reshape(-1)
        expected = read_insertion(flat, KEYS, EMPTY)
        for td in (rows, lazy_stack(list(flat.unbind(0)))):
            batch = read_insertion(td, KEYS, EMPTY)
            for name in ("starts", "lengths", "rewards", "reward_lengths"):
                assert torch.equal(getattr(batch, name), getattr(expected, name)), name
            assert torch.equal(batch.group_ids.values, expected.group_ids.values)
            assert (batch.width, batch.num_steps) == (expected.width, expected.num_steps)
            assert (batch.steps.data == flat).all()
        step = read_insertion(trajectory(2, [3.0])[0], KEYS, EMPTY)  # no batch dimension
        assert step.lengths.tolist() == [1] and step.group_ids.values.tolist() == [[2]]

    def test_nothing_to_read(self):
        assert read_insertion(trajectory(0, [1.0])[:0], KEYS, EMPTY) is None

    def test_several_reward_elements_per_step(self):
        td = torch.cat([trajectory(0, [[1.0, 2.0], [3.0, 4.0]]), trajectory(0, [[5.0, 6.0]])])
        batch = read_insertion(td, KEYS, EMPTY)
        assert batch.reward_lengths.tolist() == [4, 2] and batch.reward_width == 0
        assert batch.rewards.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]

    def test_string_and_multi_value_ids(self):
        keys = KEYS._replace(group="query")
        stacked = torch.cat(
            [trajectory("a", [1.0], key="query"), trajectory("b", [1.0], key="query")]
        )
        assert isinstance(stacked.get("query"), NonTensorStack)
        assert read_insertion(stacked, keys, EMPTY).group_ids.values == ["a", "b"]
        one = trajectory("c", [1.0, 2.0], key="query")
        assert isinstance(one.get("query"), NonTensorData)
        assert read_insertion(one, keys, EMPTY).group_ids.values == ["c"]
        wide = torch.cat([trajectory(4, [1.0], width=2), trajectory(6, [1.0, 1.0], width=2)])
        assert read_insertion(wide, KEYS, EMPTY).group_ids.values.tolist() == [[4, 4], [6, 6]]

    def test_ragged_steps(self):
        steps = [
            TensorDict(
                query=NonTensorData("p"),
                tokens=torch.arange(n),
                next=TensorDict(reward=torch.full((n, 1), float(n)), done=torch.tensor([d])),
            )
            for n, d in ((2, False), (3, True), (1, True))
        ]
        batch = read_insertion(lazy_stack(steps), KEYS._replace(group="query"), EMPTY)
        assert batch.steps.ragged and len(batch.steps) == 3
        assert batch.lengths.tolist() == [2, 1] and batch.reward_lengths.tolist() == [5, 1]
        assert batch.reward_width is None and batch.group_ids.values == ["p", "p"]
        assert batch.rewards.tolist() == [2.0, 2.0, 3.0, 3.0, 3.0, 1.0]

    def test_dense_steps_are_read_as_steps_once_the_store_is_ragged(self):
        batch = read_insertion(trajectory(0, [1.0, 2.0]), KEYS, Pending(ragged=True))
        assert batch.steps.ragged and [int(step["seed"]) for step in batch.steps.data] == [0, 0]

    def test_the_input_is_not_modified(self):
        td = torch.cat([trajectory(1, [1.0]), trajectory(1, [2.0])])
        before = td.clone()
        read_insertion(td, KEYS, EMPTY)
        assert (td == before).all() and set(td.keys(True)) == set(before.keys(True))


class TestBadInput:
    @pytest.mark.parametrize("case", bad_inputs(), ids=lambda c: c[0])
    def test_raises_with_a_clear_message(self, case):
        _, batch, error, words = case
        state = pending_with(torch.tensor([[1]]))  # tensor ids pending, as in the cases
        with pytest.raises(error, match=re.escape(words[0])) as info:
            read_insertion(batch, KEYS, state)
        assert all(word in str(info.value) for word in words)

    def test_ids_of_another_kind_or_width_than_the_pending_ones(self):
        with pytest.raises(TypeError, match="pending groups are keyed by strings"):
            read_insertion(trajectory(1, [1.0]), KEYS, pending_with(["a"]))
        with pytest.raises(
            ValueError, match="have 2 values per trajectory, but the pending ones have 1"
        ):
            read_insertion(trajectory(1, [1.0], width=2), KEYS, pending_with(torch.tensor([[1]])))
        # with nothing pending, any kind is fine
        assert read_insertion(trajectory(1, [1.0], width=2), KEYS, EMPTY) is not None

    def test_rewards_of_the_wrong_shape(self):
        td = trajectory(1, [1.0, 2.0])
        td["next", "reward"] = torch.ones(3)[:2].reshape(2)  # fine: one entry per step
        assert read_insertion(td, KEYS, EMPTY).rewards.tolist() == [1.0, 1.0]
        bad = TensorDict(
            seed=torch.ones(2, dtype=torch.long),
            next=TensorDict(done=torch.tensor([False, True]), batch_size=[2]),
            batch_size=[2],
        )
        bad["next", "reward"] = NonTensorStack("x", "y")
        with pytest.raises(ValueError, match="must be a tensor with one entry per step"):
            read_insertion(bad, KEYS, EMPTY)

    def test_a_row_without_done(self):
        rows = torch.stack([trajectory(1, [1.0, 2.0]), trajectory(2, [1.0, 2.0])])
        rows["next", "done"][1, -1] = False
        with pytest.raises(RuntimeError, match=re.escape("(row 1 of batch (2, 2))")):
            read_insertion(rows, KEYS, EMPTY)

    @settings(max_examples=30, deadline=None)
    @given(seed=st.integers(0, 10**6))
    def test_a_bad_step_anywhere_is_reported_where_it_is(self, seed):
        rng = random.Random(seed)
        trajs = [
            trajectory(rng.randint(0, 3), [rng.random()] * rng.randint(1, 4)) for _ in range(5)
        ]
        td = torch.cat(trajs)
        step = rng.randrange(td.shape[0])
        td["next", "reward"][step] = float("nan")
        with pytest.raises(ValueError, match=f"the first at step {step} "):
            read_insertion(td, KEYS, EMPTY)


class TestSeveralRewardsAndAnchors:
    """The inputs of GDPO (several reward keys) and GiGPO (an anchor state per step)."""

    GDPO = KEYS._replace(reward_weights=((("next", "reward"), 1.0), (("next", "format"), 0.5)))

    def test_the_weighted_sum_is_the_reward(self):
        td = torch.cat([trajectory(0, [1.0, 2.0], next_format=[[4.0], [0.0]])])
        batch = read_insertion(td, self.GDPO, EMPTY)
        assert batch.rewards.dtype == torch.float64
        assert batch.rewards.tolist() == [1.0 + 2.0, 2.0 + 0.0]

    def test_rewards_must_agree_and_stay_finite(self):
        td = trajectory(0, [1.0, 2.0], next_format=[[4.0, 1.0], [0.0, 1.0]])
        with pytest.raises(ValueError, match="as many elements at every step"):
            read_insertion(td, self.GDPO, EMPTY)
        td = trajectory(0, [1.0, 2.0], next_format=[[float("nan")], [0.0]])
        with pytest.raises(
            ValueError, match=r"non-finite reward value\(s\) under \('next', 'format'\)"
        ):
            read_insertion(td, self.GDPO, EMPTY)
        td = trajectory(0, [1.0, 2.0])
        td["next", "reward"] = td["next", "format"] = torch.tensor(
            [[1e308], [0.0]], dtype=torch.float64
        )
        both = ((("next", "reward"), 1.0), (("next", "format"), 1.0))
        with pytest.raises(ValueError, match="overflows"):
            read_insertion(td, KEYS._replace(reward_weights=both), EMPTY)
        with pytest.raises(KeyError, match="format"):
            read_insertion(trajectory(0, [1.0]), self.GDPO, EMPTY)

    def test_anchors_are_checked(self):
        keys = KEYS._replace(anchor="obs")
        assert (
            read_insertion(trajectory(0, [1.0, 2.0], obs=[[0, 1], [1, 1]]), keys, EMPTY) is not None
        )
        assert read_insertion(trajectory(0, [1.0, 2.0], obs=["a", "b"]), keys, EMPTY) is not None
        with pytest.raises(KeyError, match="anchor key .*obs"):
            read_insertion(trajectory(0, [1.0, 2.0]), keys, EMPTY)
        with pytest.raises(TypeError, match="tensor or a string, got int"):
            read_insertion(trajectory(0, [1.0, 2.0]).set_non_tensor("obs", 3), keys, EMPTY)
        bad = trajectory(0, [1.0, 2.0])
        bad.set("obs", NonTensorStack(*[{"a": 1}] * 2))
        with pytest.raises(TypeError, match="tensor or a string"):
            read_insertion(bad, keys, EMPTY)
        steps = [s.clone() for s in trajectory(0, [1.0, 2.0], obs=["a", "b"]).unbind(0)]
        steps[0]["next", "reward"] = torch.ones(3)  # ragged
        assert read_insertion(lazy_stack(steps), keys, EMPTY).steps.ragged


class TestDevices:
    def test_values_read_onto_the_cpu(self, device):
        """The bookkeeping is on the CPU whatever the data's device; the steps stay there."""
        data = torch.cat([trajectory(1, [1.0, 2.0]), trajectory(2, [3.0])]).to(device)
        batch = read_insertion(data, KEYS, Pending())
        assert batch.steps.data["next", "reward"].device.type == device.type
        for value in (batch.starts, batch.lengths, batch.group_ids.values, batch.rewards):
            assert value.device.type == "cpu"
        assert batch.rewards.tolist() == [1.0, 2.0, 3.0]


class TestGroupIdsCompareByExactValue:
    def test_another_kind_of_number_than_the_pending_ids(self):
        pending = pending_with(torch.tensor([[0]]))  # an int64 id held
        floats = trajectory(0, [1.0])
        floats["seed"] = torch.tensor([0.5])
        with pytest.raises(TypeError, match="are torch.float32, but the pending ones are"):
            read_insertion(floats, KEYS, pending)
        narrow = trajectory(0, [1.0])
        narrow["seed"] = torch.tensor([0], dtype=torch.int32)  # an integer too: compared as one
        assert read_insertion(narrow, KEYS, pending).group_ids.values.tolist() == [[0]]

    def test_the_issue_stream(self):
        """int64 id 0 pending, then floats 0.5, 0.5, 0: the floats never join group 0."""
        t = MCAdvantage(2, prompt_key="seed")
        t.inv(trajectory(0, [1.0]))
        floats = torch.cat([trajectory(0, [2.0]), trajectory(0, [3.0])])
        floats["seed"] = torch.tensor([0.5, 0.5])
        with pytest.raises(TypeError, match="use one kind of number"):
            t.inv(floats)
        assert t.queued_trajectories == 1 and t.written_groups == 0

    def test_nan_ids(self):
        td = torch.cat([trajectory(0, [1.0]), trajectory(0, [1.0])])
        td["seed"] = torch.tensor([1.0, float("nan")])
        with pytest.raises(ValueError, match="trajectory 1 of this insertion is NaN"):
            read_insertion(td, KEYS, EMPTY)


class TestDropPadding:
    def test_split_trajs_rows(self):
        rows = torch.stack([trajectory(3, [1.0, 2.0, 0.0]), trajectory(4, [5.0, 0.0, 0.0])])
        rows["collector", "mask"] = torch.tensor([[True, True, False], [True, False, False]])
        rows["next", "done"][0, 1] = rows["next", "done"][1, 0] = True
        flat = drop_padding(rows)
        assert flat.batch_size == (3,) and flat["next", "reward"].flatten().tolist() == [1, 2, 5]
        batch = read_insertion(flat, KEYS, EMPTY)
        assert batch.lengths.tolist() == [2, 1] and batch.group_ids.values.tolist() == [[3], [4]]
        assert drop_padding(trajectory(1, [1.0])).batch_size == (1,)  # no mask: as it is

    def test_a_collector_with_split_trajs(self):
        env = TransformedEnv(GymEnv("CartPole-v1"), Compose(SameStartGroups(2), StepCounter()))
        collector = Collector(env, None, frames_per_batch=40, total_frames=-1, split_trajs=True)
        t = MCAdvantage(2, prompt_key="reset_seed", trajectory_return="sum")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torchrl's advice against split_trajs
            for _, batch in zip(range(5), collector):
                t.inv(batch)
        collector.shutdown()
        assert t.written_groups > 0 and t.evicted_steps == 0
