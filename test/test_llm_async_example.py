"""examples/llm_grpo_async.py: asynchronous GRPO on Ray, end to end on a tiny budget."""

import csv
import importlib.util
import re
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RESULT = re.compile(
    r"RESULT acc_before=(\d+\.\d+) acc_after=(\d+\.\d+) wall_s=(\d+\.\d+) max_lag=(-?\d+)"
)
TINY = ["--prompts-per-step", "4", "--group-size", "4", "--minibatch", "8", "--eval-prompts", "50"]


@pytest.fixture(scope="module")
def ex():
    sys.path.insert(0, str(EXAMPLES))  # as when run as a script: it imports llm_grpo
    try:
        spec = importlib.util.spec_from_file_location(
            "llm_grpo_async", EXAMPLES / "llm_grpo_async.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(EXAMPLES))


def test_settings_extend_the_synchronous_example(ex):
    import llm_grpo

    cfg = llm_grpo.parse_args(
        [*TINY, "--collectors", "2", "--correction", "tis"], settings_cls=ex.AsyncSettings
    )
    assert isinstance(cfg, llm_grpo.Settings) and isinstance(cfg, ex.AsyncSettings)
    assert (cfg.collectors, cfg.correction, cfg.max_policy_lag) == (2, "tis", 4)
    assert cfg.max_new_tokens == 3  # the digit sum's answer and end-of-sequence, as in llm_grpo
    assert ex.sync is llm_grpo  # the task, model, warm start and evaluation are reused


def test_tiny_run(ex, tmp_path, capsys):
    """Three GRPO steps with one Ray collector: one RESULT line matching what main returns,
    batches stamped with policy versions, weights moved, every metric logged."""
    args = ["--steps", "3", "--eval-every", "3", *TINY, "--sft-max-steps", "40"]
    args += ["--prompts-per-step", "8"]  # more groups: one with a reward spread, near surely
    args += ["--time-limit", "1e6", "--out", str(tmp_path)]
    start = time.perf_counter()
    result = ex.main(args)
    elapsed = time.perf_counter() - start
    lines = capsys.readouterr().out.strip().splitlines()
    assert sum(line.startswith("RESULT") for line in lines) == 1
    match = RESULT.fullmatch(lines[-1])
    assert match, lines[-1]
    acc_before, acc_after, wall_s, max_lag = match.groups()
    assert float(acc_before) == pytest.approx(result["acc_before"], abs=1e-4)
    assert float(acc_after) == pytest.approx(result["acc_after"], abs=1e-4)
    assert 0.0 <= result["acc_after"] <= 1.0
    assert int(max_lag) == result["max_lag"] >= 0  # the rows carried policy versions
    assert result["steps"] == 3
    assert elapsed < 90
    assert any(line.startswith("profile, trainer") for line in lines)
    assert any(line.startswith("profile, collector 0") for line in lines)

    run_dir = result["run_dir"]
    assert (run_dir / "llm_grpo_async.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("reward", "ESS", "kl_to_ref", "policy_lag_max", "sample_lag_max", "accuracy"):
        with open(run_dir / "scalars" / f"{name}.csv") as f:
            logged = [(int(s), float(v)) for s, v in csv.reader(f)]
        assert [s for s, _ in logged] == ([3] if name == "accuracy" else [1, 2, 3]), name
    with open(run_dir / "scalars" / "sample_lag_max.csv") as f:
        assert all(float(v) >= 0 for _, v in csv.reader(f))
    with open(run_dir / "scalars" / "reward.csv") as f:
        rewards = [float(v) for _, v in csv.reader(f)]
    # the weights move unless every completion failed (no group with a spread: no gradient,
    # which the weak 40-step warm start makes possible)
    assert result["weights_moved"] > 0.0 or not any(rewards), rewards
