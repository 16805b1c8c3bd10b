"""The asynchronous example's sampler process killed (``SIGKILL``) in the middle of a run: the
trainer notices, keeps its checkpoint whole (its state is saved: nothing of the step it waited
for had changed), and ``--resume`` goes on from it to the end, the versions and the rows'
counts continuing."""

from __future__ import annotations

import os
import signal

import pytest
from helpers.async_example import TINY, async_example

from torchrl_grpo.checkpoint import load_checkpoint

ARGS = [*TINY, "--steps", "4", "--eval-every", "2", "--sft-max-steps", "2", "--time-limit", "1e6"]


@pytest.fixture
def ex():
    with async_example() as module:
        yield module


def test_a_dead_sampler_leaves_a_whole_checkpoint_to_resume(ex, tmp_path, monkeypatch):
    step = ex.Trainer.step

    def step_then_kill(self):  # the sampler dies once the trainer holds version 2
        out = step(self)
        if self.version == 2:
            os.kill(self.link.sampler.process.pid, signal.SIGKILL)
        return out

    monkeypatch.setattr(ex.Trainer, "step", step_then_kill)
    with pytest.raises(ex.SamplerLost, match=r"(?s)died without a word.*--resume"):
        ex.main([*ARGS, "--checkpoint-every", "1", "--out", str(tmp_path / "a")])
    monkeypatch.undo()
    (run_dir,) = (tmp_path / "a").iterdir()
    assert sorted(p.name for p in run_dir.iterdir() if "checkpoint" in p.name) == ["checkpoint"]
    saved = load_checkpoint(run_dir / "checkpoint", weights_only=False)
    state = saved.values["state"]
    # the step the sampler had already sent (one ahead, at most) may have been trained
    assert saved.stamp in (2, 3) and state["version"] == saved.stamp
    assert state["progress"]["history"]["step"] == list(range(1, saved.stamp + 1))

    result = ex.main([*ARGS, "--resume", str(run_dir), "--out", str(tmp_path / "b")])
    assert result["steps"] == 4 and sum(result["lags"].values()) == 4 * 16  # every step's rows
    assert set(result["lags"]) <= {0, 1}  # the versions went on: no row older than the bound
    assert result["rows"]["trained"] == (4 - saved.stamp) * 16  # this process's own
    resumed = load_checkpoint(result["run_dir"] / "checkpoint", weights_only=False)
    assert resumed.stamp == resumed.values["state"]["version"] == 4
    assert resumed.values["state"]["progress"]["history"]["step"] == [1, 2, 3, 4]
