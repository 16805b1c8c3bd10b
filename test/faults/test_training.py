"""A run killed during training, between its checkpoints: resumed from the last one, it trains
the groups the uninterrupted run trains, each once (the work since the checkpoint is redone)."""

from __future__ import annotations

from helpers.fault_runs import check_same_groups, drive


def test_a_run_killed_between_checkpoints_resumes_with_the_same_groups(tmp_path):
    points = ("collected", "extended", "trained")  # batch 3: played, inserted, trained on
    plans = [None] + [{"at": at, "batch": 3} for at in points]
    plans.append({"at": "trained", "batch": 5})
    whole, *killed = drive(tmp_path, plans)
    for result in killed:
        assert result["killed"] == -9, result
        assert result["found"] == "checkpoint", result
        assert result["stamp"] == result["plan"]["batch"] - 1  # the last save before the kill
        check_same_groups(result, whole["ledger"])
