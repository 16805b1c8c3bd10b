"""Tests of torchrl_grpo/mcadvantage/records.py: the records are data, replaced, never changed."""

import pytest
import torch

from torchrl_grpo.mcadvantage.records import Pending, State, Tails
from torchrl_grpo.mcadvantage.replica import fresh_state


class TestRecords:
    def test_the_fresh_state_holds_nothing(self):
        state = fresh_state()
        assert state.pending.num_pending == 0 and state.tails.num_tails == 0
        assert state.insertions == 0 and state.pending.ids is None

    def test_replaces_fields_and_keeps_the_old_state(self):
        state = fresh_state()
        new = state._replace(insertions=3, stats={"a": 2})
        assert (new.insertions, new.stats, state.insertions) == (3, {"a": 2}, 0)
        assert state.stats != {"a": 2}

    def test_a_misspelled_field_is_an_error(self):
        with pytest.raises(ValueError, match="unexpected field names: \\['insertion'\\]"):
            fresh_state()._replace(insertion=3)
        with pytest.raises(TypeError, match="unexpected keyword argument 'keys'"):
            Pending(keys=[])

    def test_counts_read_the_tables(self):
        pending = Pending(spans=torch.zeros(3, 4, dtype=torch.long))
        tails = Tails(meta=torch.zeros(2, 3, dtype=torch.long))
        assert pending.num_pending == 3 and tails.num_tails == 2
        assert State(pending, tails, {}, 0).pending is pending
