"""Tests of torchrl_grpo/mcadvantage/state_io.py: the transform's checkpoints, ``state_dict()``,
and those written by earlier versions."""

import io
from pathlib import Path

import pytest
import torch
from helpers import (
    checkpoints,
    halves,
    released,
    trajectory,
)
from helpers.states import KEYS, hold, read, uids
from tensordict import NonTensorData, TensorDict, lazy_stack

from torchrl_grpo import MCAdvantage
from torchrl_grpo.mcadvantage import state_io
from torchrl_grpo.mcadvantage.pending import gather
from torchrl_grpo.mcadvantage.read import read_insertion
from torchrl_grpo.mcadvantage.records import NO_VERSION, VERSION, Pending, Returns, State, Tails
from torchrl_grpo.mcadvantage.returns import concat
from torchrl_grpo.mcadvantage.stats import fresh_stats

DATA = Path(__file__).parent.parent / "data"


class TestCheckpointForm:
    def test_round_trip_through_weights_only_torch_load(self):
        a, b = trajectory(1, [1.0, 2.0]), trajectory(2, [3.0])
        pending = hold(hold(Pending(), read(a), clock=1), read(b), clock=1)
        exact = Returns(pending.returns.value, pending.returns.value.float())
        pending = pending._replace(returns=exact)
        state = State(pending, Tails(), {**fresh_stats(), "written_groups": 2}, insertions=2)
        buffer = io.BytesIO()
        torch.save(state_io.to_plain(state), buffer)
        buffer.seek(0)
        back = state_io.from_plain(torch.load(buffer, weights_only=True))
        spans = back.pending.spans[:, :4].tolist()
        assert spans == [[0, 0, 2, 1], [0, 2, 1, 1]]  # one chunk, arrivals
        assert (back.pending.spans[:, VERSION] == NO_VERSION).all()  # none was read
        assert torch.equal(back.pending.ids.values, pending.ids.values)
        assert torch.equal(back.pending.returns.value, pending.returns.value)
        assert torch.equal(back.pending.returns.torchrl, pending.returns.torchrl)
        assert (back.stats, back.insertions) == (state.stats, state.insertions)
        everything = torch.arange(2)
        assert uids(gather(back.pending, None, everything)) == a["uid"].tolist() + b["uid"].tolist()

    def test_ragged_steps_and_prompts(self):
        steps = [
            TensorDict(
                query=NonTensorData("p"),
                uid=torch.tensor(n),
                tokens=torch.arange(n),
                next=TensorDict(reward=torch.ones(n, 1), done=torch.tensor([True])),
            )
            for n in (2, 3)
        ]
        batch = read_insertion(lazy_stack(steps), KEYS._replace(group="query"), Pending())
        state = State(hold(Pending(), batch), Tails(), fresh_stats(), 1)
        back = state_io.from_plain(state_io.to_plain(state)).pending
        assert back.ragged and back.ids.values == ["p", "p"]
        assert [s["tokens"].tolist() for s in gather(back, None, torch.arange(2)).data] == [
            [0, 1],
            [0, 1, 2],
        ]

    def test_a_checkpoint_without_torchrl_returns(self):
        """Checkpoints written before the reward-dtype returns were kept load; their float64
        returns stand in for them."""
        state = State(hold(Pending(), read(trajectory(1, [0.5]))), Tails(), fresh_stats(), 1)
        plain = state_io.to_plain(state)
        del plain["torchrl_returns"]
        back = state_io.from_plain(plain).pending
        assert back.returns.torchrl is None
        incoming = Returns(torch.tensor([2.0], dtype=torch.float64), torch.tensor([2.0]))
        both = concat(back.returns, incoming)
        assert both.torchrl.tolist() == [0.0, 2.0] and both.torchrl.dtype == torch.float32


class TestStateDict:
    def test_round_trip_through_weights_only_torch_load(self):
        first, second = halves()
        t = MCAdvantage(4, prompt_key="seed", trajectory_return="sum")
        t.inv(first)
        buffer = io.BytesIO()
        torch.save(t.state_dict(), buffer)
        buffer.seek(0)
        u = MCAdvantage(4, prompt_key="seed", trajectory_return="sum")
        u.load_state_dict(torch.load(buffer, weights_only=True))
        assert u.get_stats() == t.get_stats() and u.queued_trajectories == 8
        a, b = released(t.inv(second.clone())), released(u.inv(second.clone()))
        assert a.keys() == b.keys() and len(a) == second.numel() + first.numel()
        assert all(torch.equal(a[k], b[k]) for k in a)

    def test_string_prompts_and_ragged_steps(self):
        def step(prompt, n, done):
            return TensorDict(
                query=NonTensorData(prompt),
                uid=torch.tensor(n * 10 + int(done)),
                tokens=torch.arange(n),
                next=TensorDict(reward=torch.full((n, 1), float(n)), done=torch.tensor([done])),
            )

        t = MCAdvantage(2)
        t.inv(lazy_stack([step("p", 2, False), step("p", 3, True)]))
        u = MCAdvantage(2)
        u.load_state_dict(t.state_dict())
        assert list(u.queues) == ["p"]
        last = lazy_stack([step("p", 4, True)])
        a, b = released(t.inv(last)), released(u.inv(last))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def test_the_checkpoint_is_torchs_extra_state(self):
        t = MCAdvantage(2, prompt_key="seed")
        t.inv(trajectory(0, [1.0]))
        assert list(t.state_dict()) == ["_extra_state"]
        state = t.state_dict()["_extra_state"]
        assert state["grpo_size"] == 2 and state["pending"]["lengths"].tolist() == [1]

    def test_checkpoints_of_the_earlier_layout_load(self):
        """torchrl_grpo 0.1.0 saved ``pending`` and ``grpo_size`` entries of its own."""
        first, second = halves()
        t = MCAdvantage(4, prompt_key="seed", trajectory_return="sum")
        t.inv(first)
        earlier = {"pending": t.get_extra_state()["pending"], "grpo_size": 4}
        u = MCAdvantage(4, prompt_key="seed", trajectory_return="sum")
        u.load_state_dict(earlier)
        assert u.get_stats() == t.get_stats() and u.queued_trajectories == 8
        a, b = released(t.inv(second.clone())), released(u.inv(second.clone()))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def test_group_size_mismatch_is_an_error(self):
        t = MCAdvantage(4, prompt_key="seed")
        t.inv(trajectory(0, [1.0]))
        with pytest.raises(RuntimeError, match="grpo_size=4"):
            MCAdvantage(3, prompt_key="seed").load_state_dict(t.state_dict())


class TestCheckpointsOfEarlierVersions:
    """``state_dict()`` files written by torchrl_grpo 0.1.0 (``test/data``, see
    ``helpers.checkpoints``) load, and the restored transform goes on as the one that saved them
    would have: same queues, statistics, releases and advantages."""

    @pytest.mark.parametrize("name", sorted(checkpoints.CASES))
    def test_load_and_go_on(self, name):
        kwargs, before = checkpoints.CASES[name]
        whole = MCAdvantage(**kwargs)
        for insertion in checkpoints.stream(name)[:before]:
            whole.inv(insertion)
        restored = MCAdvantage(**kwargs)
        saved = torch.load(checkpoints.path(DATA, name), weights_only=True)
        restored.load_state_dict(saved)
        assert restored.get_stats() == whole.get_stats()
        assert list(restored.queues) == list(whole.queues)
        for group in whole.queues:
            for a, b in zip(restored.queues[group], whole.queues[group], strict=True):
                assert a["uid"].tolist() == b["uid"].tolist()
        rest = zip(checkpoints.stream(name)[before:], checkpoints.stream(name)[before:])
        released_steps = 0
        for mine, theirs in rest:
            a, b = released(restored.inv(mine)), released(whole.inv(theirs))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            released_steps += len(a)
        assert released_steps > 0 and restored.get_stats() == whole.get_stats()
