"""A save killed at each of its writes, and checkpoints torn, truncated or changed on disk.

The save of batch 3 of :func:`helpers.faults.run` is killed (``SIGKILL``) halfway through
writing a file and after each of its writes; the process that resumes finds the previous
checkpoint (batch 2) or the new one (batch 3), whole, and trains the groups the uninterrupted
run trains, each once. A torn, truncated or changed checkpoint is refused, naming the pieces,
stamps, files or seeds.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from helpers.fault_runs import check_same_groups, drive
from helpers.faults import SAVE_WRITES, _build

from torchrl_grpo.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

#: Where the resume finds a checkpoint after a kill at each write of batch 3's save, and its
#: stamp: the previous one until the swap moves it aside, the new one from then on.
EXPECTED = {
    "half": ("checkpoint", 2),
    "piece buffer": ("checkpoint", 2),
    "piece state": ("checkpoint", 2),
    "manifest": ("checkpoint", 2),  # complete aside, not yet swapped in
    "moved aside": ("checkpoint.tmp-", 3),  # between the renames: the complete new one
    "in place": ("checkpoint", 3),
    "removed": ("checkpoint", 3),
}


def test_a_save_killed_at_every_write_leaves_one_whole_checkpoint(tmp_path):
    plans = [None] + [{"at": "save", "batch": 3, "write": w} for w in ("half", *SAVE_WRITES)]
    plans.append({"at": "save", "batch": 1, "write": "piece state"})  # the first save
    whole, *killed, first = drive(tmp_path, plans)
    assert whole["killed"] == 0 and len(killed) == len(EXPECTED)
    for result in killed:
        write = result["plan"]["write"]
        assert result["killed"] == -9, result  # SIGKILL, at that write
        folder, stamp = EXPECTED[write]
        assert result["found"].startswith(folder) and result["stamp"] == stamp, result
        check_same_groups(result, whole["ledger"])
    assert first["killed"] == -9 and first["found"] is None  # none yet: it starts again
    check_same_groups(first, whole["ledger"])


def saves(tmp_path, batches: int):
    """The loop's pieces after each of ``batches`` collector batches: ``[(rb, state)]``."""
    from torchrl.collectors import Collector

    env, advantage, rb, policy = _build()
    collector = Collector(
        env, policy, frames_per_batch=48, total_frames=-1, auto_register_policy_transforms=False
    )
    out = []
    for _, data in zip(range(batches), collector):
        rb.extend(data)
        save_checkpoint(tmp_path / f"b{len(out) + 1}", {"buffer": rb, "state": {}}, len(out) + 1)
        out.append(copy.deepcopy(env.transform.state_dict()))
    collector.shutdown()
    return out


def test_the_issues_torn_checkpoint_is_refused(tmp_path):
    """The buffer of batch 6 beside the state of batch 4, what a kill between two in-place
    writes left (5 groups trained twice and 4 lost, resumed without a word): the stamps
    differ. A loop that loads such pieces by hand, without reading the stamps, is stopped by
    ``SameStartGroups.resume`` when the buffer holds episodes of seeds the state never
    started (here the buffer of batch 5 beside the state of batch 1), naming them."""
    states = saves(tmp_path, 6)
    torn = tmp_path / "b4"
    shutil.rmtree(torn / "buffer")
    shutil.copytree(tmp_path / "b6" / "buffer", torn / "buffer")
    with pytest.raises(CheckpointError, match=r"'buffer' 6, while \['state'\] carry 4"):
        load_checkpoint(torn)
    env, advantage, rb, _ = _build()
    rb.loads(tmp_path / "b5" / "buffer")
    env.transform.load_state_dict(states[0])
    held = advantage.get_stats()
    with pytest.raises(ValueError, match=r"never started \(seed 2: 1 held, 0 started"):
        env.transform.resume(advantage)
    assert advantage.get_stats() == held and env.transform.replays == []  # nothing changed


@pytest.mark.parametrize("damage", ["truncated", "changed", "missing", "manifest"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage):
    saves(tmp_path, 2)
    folder = tmp_path / "b2"
    target = folder / "buffer" / "transform.t"
    data = target.read_bytes()
    if damage == "truncated":
        target.write_bytes(data[: len(data) // 3])
        match = r"transform.t \(piece 'buffer'\) has \d+ bytes .* where the save wrote"
    elif damage == "changed":
        target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        match = r"transform.t \(piece 'buffer'\) has .* SHA-256"
    elif damage == "missing":
        target.unlink()
        match = r"transform.t \(piece 'buffer'\) is missing"
    else:
        (folder / "checkpoint.json").write_text("{")
        match = "no complete checkpoint at"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(folder)
    assert not target.exists() or target.read_bytes() != data or damage == "manifest"
    assert torch.load(folder / "state.pt")["stamp"] == 2  # nothing else touched
