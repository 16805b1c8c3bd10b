"""Tests of torchrl_grpo/checkpoint.py: checkpoint folders are swapped into place, found after a
killed swap, and refused when torn, truncated or changed (the kills themselves:
test/faults/test_checkpoints.py); the storages torchrl cannot save: test/test_storages.py."""

import json
import shutil

import pytest
import torch
from helpers import halves
from helpers.buffers import make_buffer

from torchrl_grpo.checkpoint import (
    MANIFEST,
    CheckpointError,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

# --- checkpoint folders: save_checkpoint, find_checkpoint, load_checkpoint ---------------------


def folder_pieces(stamp: int):
    """A buffer with pending groups and a state dict, as a run saves them at batch ``stamp``."""
    first, _ = halves()
    rb, _ = make_buffer()
    rb.extend(first.clone())
    return rb, {"buffer": rb, "state": {"batch": stamp, "weights": torch.full((3,), stamp)}}


class TestCheckpointFolder:
    def test_round_trip_and_what_is_left_on_disk(self, tmp_path):
        rb, pieces = folder_pieces(4)
        save_checkpoint(tmp_path / "checkpoint", pieces, stamp=4)
        rb, pieces = folder_pieces(5)
        save_checkpoint(tmp_path / "checkpoint", pieces, stamp=5)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]  # no .old, no .tmp
        manifest = json.loads((tmp_path / "checkpoint" / MANIFEST).read_text())
        assert manifest["stamp"] == 5 and set(manifest["pieces"]) == {"buffer", "state"}
        assert "buffer/transform.t" in manifest["pieces"]["buffer"]["files"]
        saved = load_checkpoint(tmp_path / "checkpoint")
        assert saved.stamp == 5 and saved.folder == tmp_path / "checkpoint"
        assert saved.values["state"]["batch"] == 5
        restored, transform = make_buffer()
        restored.loads(saved.values["buffer"])
        assert transform.get_stats() == rb.transform[0].get_stats()

    def test_bad_arguments_write_nothing(self, tmp_path):
        for name in ("a/b", ".hidden", MANIFEST, ""):
            with pytest.raises(ValueError, match="plain file name"):
                save_checkpoint(tmp_path / "c", {name: 1}, stamp=1)
        for stamp in (-1, 1.5, True):
            with pytest.raises(ValueError, match="integer >= 0"):
                save_checkpoint(tmp_path / "c", {"state": 1}, stamp=stamp)
        assert not any(tmp_path.iterdir())

    def test_a_folder_that_is_not_a_checkpoint_is_never_replaced(self, tmp_path):
        run = tmp_path / "run"
        run.mkdir()
        (run / "notes.txt").write_text("mine")
        with pytest.raises(CheckpointError, match="not a checkpoint written by save_checkpoint"):
            save_checkpoint(run, {"state": 1}, stamp=1)
        assert [p.name for p in tmp_path.iterdir()] == ["run"]
        assert (run / "notes.txt").read_text() == "mine"

    def test_a_kill_between_the_renames_finds_the_complete_one(self, tmp_path):
        """The states a killed swap leaves, and the next save cleans them up."""
        folder = tmp_path / "checkpoint"
        save_checkpoint(folder, {"state": {"batch": 1}}, stamp=1)
        save_checkpoint(tmp_path / "new", {"state": {"batch": 2}}, stamp=2)
        folder.rename(tmp_path / "checkpoint.old")  # moved aside, then killed
        (tmp_path / "new").rename(tmp_path / "checkpoint.tmp-1-ab")
        assert find_checkpoint(folder) == tmp_path / "checkpoint.tmp-1-ab"  # the newer one
        assert load_checkpoint(folder).values["state"] == {"batch": 2}
        shutil.rmtree(tmp_path / "checkpoint.tmp-1-ab")  # killed before the manifest
        (tmp_path / "checkpoint.tmp-1-ab").mkdir()
        (tmp_path / "checkpoint.tmp-1-ab" / "state.pt").write_bytes(b"half")
        assert load_checkpoint(folder).values["state"] == {"batch": 1}  # the previous one
        save_checkpoint(folder, {"state": {"batch": 3}}, stamp=3)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
        assert find_checkpoint(tmp_path / "elsewhere") is None
        with pytest.raises(CheckpointError, match="no complete checkpoint at"):
            load_checkpoint(tmp_path / "elsewhere")

    def test_pieces_of_different_saves_are_refused_naming_them(self, tmp_path):
        """The issue's torn checkpoint: the buffer of batch 6 beside the state of batch 4."""
        _, pieces = folder_pieces(4)
        save_checkpoint(tmp_path / "a", pieces, stamp=4)
        _, pieces = folder_pieces(6)
        save_checkpoint(tmp_path / "b", pieces, stamp=6)
        shutil.rmtree(tmp_path / "a" / "buffer")
        shutil.copytree(tmp_path / "b" / "buffer", tmp_path / "a" / "buffer")
        with pytest.raises(CheckpointError, match=r"'buffer' 6, while \['state'\] carry 4"):
            load_checkpoint(tmp_path / "a")

    def test_a_truncated_or_changed_file_is_refused(self, tmp_path):
        _, pieces = folder_pieces(2)
        folder = save_checkpoint(tmp_path / "c", pieces, stamp=2)
        state = (folder / "state.pt").read_bytes()
        (folder / "state.pt").write_bytes(state[: len(state) // 2])
        with pytest.raises(CheckpointError, match=r"piece 'state' cannot be read .*state.pt: "):
            load_checkpoint(folder)
        (folder / "state.pt").write_bytes(state)
        transform = folder / "buffer" / "transform.t"
        data = bytearray(transform.read_bytes())
        data[-1] ^= 1
        transform.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=r"buffer/transform.t \(piece 'buffer'\) has"):
            load_checkpoint(folder)
        (folder / MANIFEST).write_text('{"stamp": 2, "pie')  # truncated: not complete
        with pytest.raises(CheckpointError, match="no complete checkpoint"):
            load_checkpoint(folder)

    def test_a_checkpoint_written_in_place_is_not_loaded(self, tmp_path):
        (tmp_path / "checkpoint").mkdir()
        torch.save({"progress": 1}, tmp_path / "checkpoint" / "state.pt")
        with pytest.raises(CheckpointError, match="written in place by an earlier version"):
            load_checkpoint(tmp_path / "checkpoint")


def test_scheduled_values_go_on_after_a_load(tmp_path):
    """A scheduled clip range and the adaptive entropy coefficient (the loss's buffers, with
    their controller's window) and a learning-rate schedule: saved mid-run, loaded into fresh
    objects, the next values are the uninterrupted run's."""
    from helpers.loss import token_batch, token_policy

    from torchrl_grpo import GRPOLoss

    def build():
        loss = GRPOLoss(token_policy(), entropy_coeff=0.02, entropy_target=1.8)
        optim = torch.optim.SGD(loss.parameters(), lr=1.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 0.9**step)
        return loss, optim, schedule

    def step(loss, optim, schedule, k):
        loss.clip_epsilon = 0.2 + 0.01 * k  # a scheduler of the clip range
        loss(token_batch(b=4, seed=k)).loss_entropy.backward()
        loss.update_entropy_coeff()
        optim.step()
        schedule.step()
        return float(loss.entropy_coeff), float(loss.clip_epsilon), schedule.get_last_lr()[0]

    whole = build()
    values = [step(*whole, k) for k in range(4)]
    first = build()
    for k in range(2):
        step(*first, k)
    loss, optim, schedule = first
    pieces = {"loss": loss.state_dict(), "optim": optim.state_dict()}
    save_checkpoint(tmp_path / "c", {**pieces, "schedule": schedule.state_dict()}, stamp=2)
    saved = load_checkpoint(tmp_path / "c").values
    resumed = build()
    for obj, name in zip(resumed, ("loss", "optim", "schedule")):
        obj.load_state_dict(saved[name])
    assert [step(*resumed, k) for k in (2, 3)] == values[2:]  # exactly


def test_the_storages_names_are_importable_from_here():
    from torchrl_grpo import checkpoint, storages

    for name in storages.__all__:
        assert getattr(checkpoint, name) is getattr(storages, name) and name in checkpoint.__all__
