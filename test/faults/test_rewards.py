"""Fault: a NaN reward in the middle of a multi-turn run (torchrl's ``LLMCollector``,
``MCAdvantage`` on a replay buffer).

A NaN on a dialog's first turn used to be held unread with the unfinished dialog and refused
later, by the good insertion that completed it, and again by every one that brought the rest of
the dialog. Now it is refused by the insertion that brings it (``ValueError`` naming the reward
key, the step and the value), before anything changes: the buffer and what ``MCAdvantage``
holds are as they were. A refused batch cuts its dialogs: a new collector (its first batch
starts new dialogs) goes on, and ``max_pending_age`` gives up the earlier turns of the cut
dialogs, counted. The loss refuses a non-finite advantage the same way
(``test/loss/test_inputs.py``, ``test_non_finite_stored_entry_on_a_real_token``).
"""

import math
import os
import warnings

import pytest

try:
    import transformers  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs the `llm` extra (make test): without it this is a failure, not a skip
    pytest.skip("needs the llm extra: pip install -e '.[llm]'", allow_module_level=True)

import tensordict
import torch
from helpers.llm import GROUPED_QUERIES, assert_exact_turns, dialog_collector, dialog_env

from torchrl_grpo.llm import TurnReward


@pytest.fixture(autouse=True)
def _list_to_stack():
    with tensordict.set_list_to_stack(True):
        yield


@pytest.mark.parametrize("turn", [1, 2])
def test_a_nan_reward_is_refused_as_it_arrives_and_the_run_goes_on(tiny_llm, turn):
    """Two-turn dialogs, two batches of good turns (8 released), then NaN rewards on the
    next dialogs' first turn (held until their dialog ends, before) or on their second (which
    ends them): refused, nothing changed; a new collector's dialogs are released with their
    groups; the first turns a refused second turn leaves held are given up after
    ``max_pending_age`` insertions, counted."""
    model, tokenizer = tiny_llm
    torch.manual_seed(0)
    nan = {"on": False}

    def score(text, row):
        return math.nan if nan["on"] else 1.0

    env = dialog_env(tokenizer, GROUPED_QUERIES, extra=[TurnReward(score, tokenizer)])
    collector, rb, advantage = dialog_collector(env, model, tokenizer, max_pending_age=2)
    batches = iter(collector)
    for _ in range(2 + turn - 1):
        next(batches)
    stored, stats = len(rb), advantage.get_stats()
    assert stored == 8 and stats["held_steps"] == 4 * (turn - 1)
    nan["on"] = True
    with pytest.raises(
        ValueError,
        match=r"4 non-finite reward value\(s\) under \('next', 'reward'\), the first at step 0 "
        r"\(value nan\)",
    ):
        next(batches)
    assert len(rb) == stored and advantage.get_stats() == stats  # nothing changed
    nan["on"] = False
    collector.shutdown()
    collector, _, _ = dialog_collector(env, model, tokenizer, rb=rb)  # new dialogs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, _ in enumerate(collector):
            if i == 3:
                break
    collector.shutdown()
    after = advantage.get_stats()
    assert len(rb) == stored + 16  # the new dialogs, released with their groups
    cut = 4 * (turn - 1)  # the first turns of the dialogs whose second turns were refused
    assert after["evicted_trajectories"] == after["evicted_steps"] == cut
    evicted = [w for w in caught if "unfinished trajectories exceed" in str(w.message)]
    assert len(evicted) == (turn - 1)
    batch = rb[stored:]
    assert_exact_turns(batch, tokenizer.pad_token_id)
    assert bool(torch.isfinite(batch["advantage"]).all())
