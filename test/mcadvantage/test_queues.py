"""Tests of torchrl_grpo/mcadvantage/queues.py: ``MCAdvantage.queues``, the pending groups."""

import pytest
import torch
from helpers import (
    random_chunks,
    random_stream,
    trajectory,
)
from torchrl.objectives.llm import MCAdvantage as TorchRLMCAdvantage

from torchrl_grpo import MCAdvantage


class TestPendingGroupsView:
    """``queues`` is a live view: what torchrl users do with it changes the transform."""

    def filled(self, **kw):
        t = MCAdvantage(3, prompt_key="seed", trajectory_return="sum", **kw)
        t.inv(torch.cat([trajectory(g, [float(g), 1.0]) for g in (4, 2, 4, 7)]))
        return t

    def test_clear_drops_every_pending_trajectory(self):
        t = self.filled()
        stats = t.get_stats()
        t.queues.clear()
        assert t.queued_trajectories == 0 and t.queued_groups == 0 and len(t.queues) == 0
        stats.update(queued_groups=0, queued_trajectories=0, max_queued_trajectories_per_group=0)
        assert t.get_stats() == stats  # statistics are kept, as in torchrl
        assert t.inv(trajectory(4, [1.0])) is None  # group 4 starts over

    def test_same_view_as_torchrl_queues(self):
        chunks = random_chunks(random_stream(6, 5, 3), 3)
        ours, ref = MCAdvantage(4, prompt_key="seed"), TorchRLMCAdvantage(4, prompt_key="seed")
        for chunk in chunks:
            ours.inv(chunk)
            ref.inv(chunk)
        assert sorted(ours.queues) == sorted(ref.queues)
        for group in ref.queues:
            mine, theirs = ours.queues[group], list(ref.queues[group])
            assert len(mine) == len(theirs)
            for a, b in zip(mine, theirs):
                assert torch.equal(a["uid"], b["uid"])

    def test_delete_and_pop_one_group(self):
        t = self.filled()
        assert list(t.queues) == [4, 2, 7] and 4 in t.queues and 5 not in t.queues
        assert [len(t.queues[g]) for g in t.queues] == [2, 1, 1]
        del t.queues[2]
        assert list(t.queues) == [4, 7] and t.queued_trajectories == 3
        popped = t.queues.pop(7)
        assert len(popped) == 1 and int(popped[0]["seed"][0]) == 7
        assert t.queues.pop(7, None) is None and list(t.queues) == [4]
        out = t.inv(trajectory(4, [3.0]))  # group 4 completes as if nothing else was there
        want = MCAdvantage(3, prompt_key="seed", trajectory_return="sum")
        want.inv(torch.cat([trajectory(4, [4.0, 1.0]), trajectory(4, [4.0, 1.0])]))
        expected = want.inv(trajectory(4, [3.0]))
        torch.testing.assert_close(out["advantage"], expected["advantage"])

    def test_missing_groups_and_writes_raise(self):
        t = self.filled()
        with pytest.raises(KeyError, match="5"):
            t.queues[5]
        with pytest.raises(KeyError, match="5"):
            del t.queues[5]
        with pytest.raises(KeyError, match="5"):
            t.queues.pop(5)
        with pytest.raises(TypeError, match="filled by inserting trajectories"):
            t.queues[4] = []
        with pytest.raises(TypeError, match="filled by inserting trajectories"):
            t.queues.update({9: []})
        with pytest.raises(AttributeError, match="append"):
            t.queues[4].append(trajectory(4, [1.0]))  # a tuple: not a silent no-op
        assert t.queued_trajectories == 4

    def test_string_prompts_and_shared_state(self):
        t = MCAdvantage(2)
        t.inv(trajectory("a prompt", [1.0], key="query"))
        t.share_memory_()
        t.inv(trajectory("another", [1.0], key="query"))
        assert list(t.queues) == ["a prompt", "another"]
        del t.queues["a prompt"]
        assert list(t.queues) == ["another"] and t.queued_trajectories == 1
        assert repr(t.queues) == "PendingGroups({'another': 1})"
