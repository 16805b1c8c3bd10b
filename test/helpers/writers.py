"""Writer processes of shared mode: what a spawned writer runs, and how a test waits for it."""

from __future__ import annotations

import os
import time

import torch


def extend_from_process(rb, batches, go=None, pause=None) -> None:
    """A writer process (a spawn target): waits for ``go`` (an event), then ``rb.extend`` each
    batch; with ``pause`` (``"<where>:<file>"``, see ``torchrl_grpo/mcadvantage/shared.py``),
    the last batch is inserted under the test hook that pauses it there."""

    torch.set_num_threads(1)
    if go is not None and not go.wait(120):
        raise TimeoutError("never told to go")
    for i, batch in enumerate(batches):
        if pause is not None and i == len(batches) - 1:
            os.environ["TORCHRL_GRPO_SHARED_TEST_PAUSE"] = pause
        rb.extend(batch)


def wait_for_file(path, process, timeout=120.0) -> None:
    """Wait until ``path`` exists (a paused writer made it); fail if ``process`` ended first."""

    end = time.monotonic() + timeout
    while not os.path.exists(path):
        assert process.is_alive(), f"the writer ended (exit code {process.exitcode}) before pausing"
        assert time.monotonic() < end, f"the writer did not pause within {timeout} s"
        time.sleep(0.02)
