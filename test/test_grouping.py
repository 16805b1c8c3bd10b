"""Tests of torchrl_grpo/_grouping.py: group codes, complete rounds, selection, eviction."""

import pytest
import torch
from helpers import trajectory
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torchrl.objectives.llm import MCAdvantageSelector

from torchrl_grpo import _pending
from torchrl_grpo._grouping import (
    NOTHING,
    Limits,
    Selection,
    evict,
    find_rounds,
    group_codes,
    select_candidates,
)
from torchrl_grpo._pending import Pending, Returns
from torchrl_grpo._reading import Keys, read_insertion
from torchrl_grpo._release import GroupFilter

KEYS = Keys(group="seed", reward=("next", "reward"), done=("next", "done"), advantage="advantage")


def ids_of(values):
    return values if isinstance(values[0], str) else torch.tensor(values).reshape(len(values), -1)


def store(ids, arrival=None):
    """A store of one-step trajectories with these group ids (and insertion of arrival)."""
    if not ids:
        return Pending()
    n = len(ids)
    arrival = torch.zeros(n, dtype=torch.long) if arrival is None else torch.tensor(arrival)
    spans = _pending.spans_of(0, torch.arange(n), torch.ones(n, dtype=torch.long), arrival)
    insertions = int(arrival.max()) + 1
    return Pending(
        chunks=[TensorDict(step=torch.arange(n), batch_size=[n])],
        chunk_sizes=[n],
        spans=spans,
        keys=ids_of(ids),
        returns=torch.zeros(n, dtype=torch.float64),
        insertions=insertions,
    )


def insertion(ids, rewards=None, key="seed"):
    rewards = rewards or [0.0] * len(ids)
    trajs = [trajectory(g, [r], key=key) for g, r in zip(ids, rewards)]
    return read_insertion(torch.cat(trajs), KEYS._replace(group=key), Pending())


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


class TestGroupCodes:
    @pytest.mark.parametrize(
        "ids",
        [
            [3, 1, 3, 2, 1],  # compact integers: no sort
            [10**12, -5, 10**12, 7],  # far apart: sorted
            [0.5, -1.5, 0.5],  # floats
            [[1, 2], [2, 1], [1, 2]],  # several values per id
            ["b", "a", "b"],  # prompts
        ],
    )
    def test_equal_codes_iff_equal_ids(self, ids):
        pending, incoming = ids[:2], ids[2:]
        codes, order = group_codes(ids_of(pending), ids_of(incoming))
        assert sorted(set(codes.tolist())) == list(range(len({str(i) for i in ids})))
        for a in range(len(ids)):
            for b in range(len(ids)):
                assert (codes[a] == codes[b]) == (ids[a] == ids[b])
        if order is not None:  # by code, arrival order within a code
            assert codes[order].tolist() == sorted(codes.tolist())
            for c in set(codes.tolist()):
                positions = [int(j) for j in order if codes[j] == c]
                assert positions == sorted(positions)

    def test_nothing_pending(self):
        codes, _ = group_codes(None, ids_of([4, 4, 9]))
        assert codes.tolist() == [0, 0, 1]


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


class TestEvict:
    def test_oldest_groups_go_first(self):
        state = store([5, 6, 5, 7], arrival=[0, 1, 2, 3])
        out = evict(state, Limits(max_groups=2, max_age=None, on_overflow="drop_oldest"))
        assert (out.groups, out.trajectories) == (1, 2)
        assert out.state.keys.flatten().tolist() == [6, 7]

    def test_age_in_insertions(self):
        # 4 insertions so far (0 to 3): group 5 waited 3, group 6 waited 1, group 7 none
        state = store([5, 6, 7], arrival=[0, 2, 3])
        out = evict(state, Limits(max_groups=None, max_age=2, on_overflow="drop_oldest"))
        assert out.state.keys.flatten().tolist() == [6, 7] and out.groups == 1

    def test_raise_names_the_limits(self):
        state = store([5, 6], arrival=[0, 1])
        with pytest.raises(RuntimeError, match="max_pending_groups=1 / max_pending_age=None"):
            evict(state, Limits(max_groups=1, max_age=None, on_overflow="raise"))

    def test_within_limits_or_empty(self):
        state = store([5, 6], arrival=[0, 1])
        limits = Limits(max_groups=2, max_age=5, on_overflow="raise")
        assert evict(state, limits).state is state
        assert evict(Pending(), limits).groups == 0
