"""Tests of torchrl_grpo/mcadvantage/groups.py: complete rounds and candidate selection."""

import torch
from helpers import (
    assert_same_releases,
    random_chunks,
    random_stream,
)
from helpers.states import insertion, store  # noqa: E402
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrl.objectives.llm import MCAdvantageSelector

from torchrl_grpo.mcadvantage.groups import NOTHING, find_rounds, select_candidates
from torchrl_grpo.mcadvantage.options import GroupFilter, Selection
from torchrl_grpo.mcadvantage.records import Pending, Returns


def reference_rounds(ids, size):
    """Rounds by definition: each group's trajectories in arrival order, cut in rounds of size."""
    queues, rounds = {}, []
    for j, g in enumerate(ids):
        queues.setdefault(g, []).append(j)
    for members in queues.values():
        full = len(members) // size * size
        rounds += [members[i : i + size] for i in range(0, full, size)]
    return sorted(sorted(r) for r in rounds)


def rounds_of(result):
    by_round = {}
    for m, r in zip(result.members.tolist(), result.member_round.tolist()):
        by_round.setdefault(r, []).append(m)
    return sorted(sorted(r) for r in by_round.values())


class TestFindRounds:
    @settings(max_examples=60, deadline=None)
    @given(
        ids=st.lists(st.integers(0, 5), min_size=1, max_size=30),
        split=st.integers(0, 30),
        size=st.integers(1, 4),
    )
    def test_rounds_by_definition(self, ids, split, size):
        """Pending groups hold fewer than ``size`` (what the transform leaves behind)."""
        held, counts = [], {}
        for g in ids[:split]:
            if counts.get(g, 0) + 1 < size:
                held.append(g)
                counts[g] = counts.get(g, 0) + 1
        incoming = ids[split:] or ids[:1]
        result = find_rounds(store(held), insertion(incoming), size)
        everything = held + incoming
        assert rounds_of(result) == reference_rounds(everything, size)
        assert result.num_rounds == len(reference_rounds(everything, size))
        members = result.members.tolist()
        assert members == sorted(members)  # released in arrival order
        consumed = [] if result.consumed is None else result.consumed.nonzero().flatten().tolist()
        assert consumed == members

    def test_one_newcomer_completes_its_group_or_waits(self):
        held = store([1, 2, 1])
        assert find_rounds(held, insertion([2]), 3) is NOTHING
        result = find_rounds(held, insertion([1]), 3)
        assert result.members.tolist() == [0, 2, 3] and result.num_rounds == 1
        assert result.consumed.tolist() == [True, False, True, True]
        prompts = find_rounds(store(["x", "y"]), insertion(["x"], key="query"), 2)
        assert prompts.members.tolist() == [0, 2]

    def test_a_group_of_one_and_an_empty_store(self):
        assert find_rounds(Pending(), insertion([5]), 2) is NOTHING
        alone = find_rounds(Pending(), insertion([5]), 1)
        assert alone.members.tolist() == [0] and alone.num_rounds == 1


class TestSelectCandidates:
    def returns_of(self, values):
        value = torch.tensor(values, dtype=torch.float64)
        return Returns(value, value.float())

    def test_first_accepted_pick_and_given_up_groups(self):
        # group 0: candidates 0, 0, 1 -> "balanced" picks a 0 and the 1 (mean 0.5 in bounds);
        # group 1: 0, 0, 0 -> no subset in bounds, given up when the third arrives.
        ids, values = [0, 1, 0, 1, 0, 1], [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        batch = insertion(ids, values)
        selection = Selection(candidate_group_size=3, min_size=2, selector=MCAdvantageSelector())
        result = select_candidates(
            Pending(), batch, selection, 2, self.returns_of(values), GroupFilter((0.1, 0.9), None)
        )
        assert result.num_rounds == 1 and result.given_up == 1 and result.filtered
        assert sorted(result.members.tolist()) in ([0, 4], [2, 4])
        assert result.consumed.tolist() == [True] * 6
        assert (result.selected, result.rescued, result.unselected) == (1, 1, 1)

    def test_waits_for_the_minimum(self):
        values = [0.0, 1.0]
        selection = Selection(candidate_group_size=4, min_size=3, selector=MCAdvantageSelector())
        result = select_candidates(
            Pending(),
            insertion([7, 7], values),
            selection,
            2,
            self.returns_of(values),
            GroupFilter((0.1, 0.9), None),
        )
        assert result.num_rounds == 0 and not result.consumed.any()


class TestSelectorInPerStepMode:
    def test_ignored_as_in_torchrl(self):
        """torchrl consults the selector only with a trajectory return."""

        class Never(MCAdvantageSelector):
            def select(self, candidates, *, group_size, keep_return_bounds=None):
                return None

        chunks = random_chunks(random_stream(5, 3, 4), 4)
        ours = assert_same_releases(
            chunks, dict(grpo_size=3, prompt_key="seed", candidate_selector=Never())
        )
        assert ours.get_stats()["written_groups"] == 5
