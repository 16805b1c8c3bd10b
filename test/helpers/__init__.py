"""Helpers shared by the test files: ``from helpers import trajectory`` (the transform's
trajectories and streams), ``helpers.writers`` (shared mode's writer processes), ``helpers.llm``
(a tiny local language model), ``helpers.checkpoints`` (checkpoints of earlier versions) and
``helpers.examples`` (the example scripts loaded as modules).
Fixtures are in ``conftest.py``."""

from helpers.trajectories import (
    GDPO_KEYS,
    agent_episodes,
    assert_same_releases,
    bad_inputs,
    collector_stream,
    flat_items,
    halves,
    next_uid,
    random_chunks,
    random_stream,
    reference_discounted_returns,
    released,
    same_output,
    stream_outputs,
    streaming,
    trajectory,
)
from helpers.writers import wait_for_file

__all__ = [
    "GDPO_KEYS",
    "agent_episodes",
    "assert_same_releases",
    "bad_inputs",
    "collector_stream",
    "flat_items",
    "halves",
    "next_uid",
    "random_chunks",
    "random_stream",
    "reference_discounted_returns",
    "released",
    "same_output",
    "stream_outputs",
    "streaming",
    "trajectory",
    "wait_for_file",
]
