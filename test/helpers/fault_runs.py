"""Running :mod:`helpers.faults` from a test: one driver process, its plans, their results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.faults import GROUP, SEEDS_TRAINED, merged

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).resolve().parent / "faults.py"


def drive(tmp_path: Path, plans: list[dict | None], timeout: float = 240) -> list[dict]:
    """The results of :func:`helpers.faults.drive` for ``plans``, run in a fresh process."""
    (tmp_path / "plans.json").write_text(json.dumps(plans))
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(DRIVER), str(tmp_path), str(tmp_path / "plans.json")],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_same_groups(result: dict, reference: list[dict]) -> None:
    """The resumed run trained every seed below ``SEEDS_TRAINED`` once, with its ``G``
    episodes, as the uninterrupted run did; no group twice, none lost."""
    assert result["resumed_exit"] == 0, result
    got, want = merged(result["ledger"]), merged(reference)
    covered = set(range(SEEDS_TRAINED))
    assert {s: n for s, n in got.items() if s in covered} == {s: GROUP for s in covered}
    assert {s: n for s, n in want.items() if s in covered} == {s: GROUP for s in covered}
    assert set(got.values()) == {GROUP}, got  # beyond them too: no group trained twice
