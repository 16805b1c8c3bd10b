"""Tests of torchrl_grpo/mcadvantage/steps.py: dense and ragged steps, one interface."""

import pytest
import torch
from helpers import trajectory
from tensordict import NonTensorStack, TensorDict

from torchrl_grpo.mcadvantage.steps import (
    DenseSteps,
    RaggedSteps,
    Steps,
    Uniform,
    Varying,
    get_entry,
)


def ragged(*lengths):
    """Steps of ``lengths`` tokens each, a reward per token."""
    return RaggedSteps(
        [
            TensorDict(tokens=torch.arange(n), next=TensorDict(reward=torch.full((n,), float(n))))
            for n in lengths
        ]
    )


class TestDenseSteps:
    def test_take_window_keep(self):
        steps = DenseSteps(trajectory(1, [1.0, 2.0, 3.0, 4.0]))
        uids = steps.data["uid"].tolist()
        assert steps.take(torch.tensor([3, 0])).data["uid"].tolist() == [uids[3], uids[0]]
        assert steps.window(1, 3).data["uid"].tolist() == uids[1:3]
        assert steps.keep(torch.tensor([True, False, False, True])).data["uid"].tolist() == [
            uids[0],
            uids[3],
        ]
        assert steps.keep(torch.zeros(4, dtype=torch.bool)) is None

    def test_take_sorted_is_a_view_or_the_whole(self):
        steps = DenseSteps(trajectory(1, [1.0, 2.0, 3.0]))
        assert steps.take_sorted(torch.arange(3)) is steps
        view = steps.take_sorted(torch.tensor([1, 2]))
        view.data["next", "reward"].add_(10)  # a view: the steps see it
        assert steps.data["next", "reward"].flatten().tolist() == [1.0, 12.0, 13.0]
        copy = steps.take_sorted(torch.tensor([0, 2]))
        copy.data["next", "reward"].add_(100)
        assert steps.data["next", "reward"].flatten().tolist() == [1.0, 12.0, 13.0]

    def test_reward_elements_and_write(self):
        steps = DenseSteps(trajectory(1, [[1.0, 2.0], [3.0, 4.0]]))
        values, elements = steps.reward_elements(("next", "reward"))
        assert values.tolist() == [1.0, 2.0, 3.0, 4.0] and elements.per_step == 2
        steps.write("advantage", torch.arange(4.0), ("next", "reward"))
        assert steps.data["advantage"].tolist() == [[0.0, 1.0], [2.0, 3.0]]
        steps.data["next", "reward"] = NonTensorStack("a", "b")
        with pytest.raises(ValueError, match="one entry per step"):
            steps.reward_elements(("next", "reward"))

    def test_entries(self):
        steps = DenseSteps(trajectory("p", [1.0, 2.0], key="query", obs=[[0, 1], [2, 3]]))
        assert steps.entries("query", "group id") == ["p", "p"]
        assert steps.entries("obs", "anchor", torch.tensor([1])).tolist() == [[2, 3]]
        with pytest.raises(KeyError, match="the anchor key .*state.* is missing"):
            steps.entries("state", "anchor")


class TestRaggedSteps:
    def test_same_operations(self):
        steps = ragged(2, 3, 1)
        assert len(steps) == 3 and steps.ragged
        assert [len(s["tokens"]) for s in steps.take(torch.tensor([2, 0])).data] == [1, 2]
        assert len(steps.window(1, 3)) == 2 and steps.keep(torch.tensor([False] * 3)) is None
        values, elements = steps.reward_elements(("next", "reward"))
        assert elements.counts.tolist() == [2, 3, 1]
        assert values.tolist() == [2.0] * 2 + [3.0] * 3 + [1.0]
        steps.write("advantage", torch.arange(6.0), ("next", "reward"))
        assert [s["advantage"].tolist() for s in steps.data] == [[0.0, 1.0], [2.0, 3.0, 4.0], [5.0]]
        assert steps.output().batch_size == (3,)
        assert [t.tolist() for t in steps.entries("tokens", "anchor", torch.tensor([2]))] == [[0]]


class TestElements:
    """A reward's elements on the steps: as many at each (``Uniform``) or a count each."""

    def test_uniform(self):
        two = Uniform(2)
        assert two.per_run(torch.tensor([3, 1])).tolist() == [6, 2] and two.run_width(3) == 6
        assert two.step_sums(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [3.0, 7.0]
        assert two.spread(torch.tensor([5.0, 6.0])).tolist() == [5.0, 5.0, 6.0, 6.0]
        assert two.step_of(3) == 1 and two.empty_step(4) is None
        assert Uniform(0).empty_step(4) == 0 and two.same(Uniform(2)) and not two.same(Uniform(1))

    def test_varying(self):
        counts = Varying(torch.tensor([2, 1, 3]))
        assert counts.per_run(torch.tensor([2, 1])).tolist() == [3, 3]
        assert counts.run_width(2) is None
        assert counts.step_sums(torch.arange(6.0)).tolist() == [1.0, 2.0, 12.0]
        assert counts.spread(torch.tensor([7.0, 8.0, 9.0])).tolist() == [7, 7, 8, 9, 9, 9]
        assert counts.step_of(2) == 1 and counts.empty_step(3) is None
        assert Varying(torch.tensor([1, 0])).empty_step(2) == 1
        assert counts.same(Varying(torch.tensor([2, 1, 3]))) and not counts.same(Uniform(2))


class TestCat:
    def test_dense_parts_concatenate(self):
        a, b = DenseSteps(trajectory(1, [1.0])), DenseSteps(trajectory(2, [2.0, 3.0]))
        joined = Steps.cat([a, b])
        assert not joined.ragged and len(joined) == 3
        assert Steps.cat([a]) is a  # one dense part: as it is

    def test_parts_of_other_shapes_go_ragged_as_copies(self):
        a, b = DenseSteps(trajectory(1, [1.0])), DenseSteps(trajectory(1, [[2.0, 3.0]]))
        joined = Steps.cat([a, b])
        assert joined.ragged and len(joined) == 2
        joined.data[0]["advantage"] = torch.zeros(1)  # a new TensorDict per step
        assert "advantage" not in a.data.keys()
        alone = ragged(2)
        assert Steps.cat([alone]).data[0] is not alone.data[0]  # ragged: always copies

    def test_pieces_joined_on_the_newest_device(self):
        """Pending steps restored on one device join newer steps on another: moved to the newest
        (``meta`` stands in for an accelerator on a CPU-only machine)."""
        old = DenseSteps(trajectory(1, [1.0]))
        new = DenseSteps(trajectory(1, [2.0]).to("meta"))
        assert Steps.cat([old, new]).device().type == "meta"
        assert Steps.cat([old, DenseSteps(trajectory(2, [2.0]))]).device().type == "cpu"
        moved = Steps.cat([RaggedSteps([old.data[0]]), new])  # ragged steps move step by step
        assert moved.data[0]["next", "reward"].device.type == "meta"


class TestCheckpointForm:
    def test_round_trip(self):
        dense = DenseSteps(trajectory(1, [1.0, 2.0]))
        back = DenseSteps.from_plain(dense.to_plain(), 2)
        assert (back.data == dense.data).all()
        steps = ragged(2, 3)
        back = RaggedSteps.from_plain(steps.to_plain(), 2)
        assert [s["tokens"].tolist() for s in back.data] == [[0, 1], [0, 1, 2]]


def test_get_entry_names_what_is_missing():
    td = TensorDict(a=torch.zeros(2), batch_size=[2])
    assert get_entry(td, "a", "reward") is td["a"]
    with pytest.raises(
        KeyError, match=r"the done key 'b' is missing from the input \(keys: \['a'\]\)"
    ):
        get_entry(td, "b", "done")
