"""examples/llm_grpo_async.py: asynchronous GRPO, end to end on a tiny budget, on its two
backends (one local sampler process with backpressure; Ray collectors); the local backend's
failures (examples/llm_async_local.py) and the settings refused."""

import csv
import os
import re
import sys
import time

import pytest
from helpers.async_example import TINY, async_example

RESULT = re.compile(
    r"RESULT acc_before=(\d+\.\d+) acc_after=(\d+\.\d+) wall_s=(\d+\.\d+) max_lag=(-?\d+)"
)


@pytest.fixture(scope="module")
def ex():
    with async_example() as module:
        yield module


def test_settings_extend_the_synchronous_example(ex):
    import llm_grpo

    cfg = llm_grpo.parse_args(
        [*TINY, "--collectors", "2", "--correction", "tis"], settings_cls=ex.AsyncSettings
    )
    assert isinstance(cfg, llm_grpo.Settings) and isinstance(cfg, ex.AsyncSettings)
    assert (cfg.collectors, cfg.correction, cfg.max_policy_lag) == (2, "tis", None)
    cfg.backend = "ray"
    assert ex.check_settings(cfg).max_policy_lag == 4  # Ray's, which drops instead of waiting
    cfg = llm_grpo.parse_args(TINY, settings_cls=ex.AsyncSettings)
    assert (cfg.backend, ex.check_settings(cfg).max_policy_lag) == ("local", 1)  # it waits
    assert cfg.max_new_tokens == 3  # the digit sum's answer and end-of-sequence, as in llm_grpo
    assert ex.sync is llm_grpo  # the task, model, warm start and evaluation are reused


def tiny_run(ex, tmp_path, capsys, *backend):
    args = ["--steps", "3", "--eval-every", "3", *TINY, "--sft-max-steps", "40"]
    args += ["--prompts-per-step", "8"]  # more groups: one with a reward spread, near surely
    args += ["--time-limit", "1e6", "--out", str(tmp_path), *backend]
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
    assert any(line.startswith("profile, sampler 0") for line in lines)
    assert any(line.startswith("rows: generated") for line in lines)
    assert sum(result["lags"].values()) == result["rows"]["trained"] == 3 * 8 * 4

    run_dir = result["run_dir"]
    assert (run_dir / "llm_grpo_async.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("reward", "ESS", "kl_to_ref", "sample_lag_max", "accuracy", "trained_rows_lag_0"):
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
    return result


def test_tiny_run_local(ex, tmp_path, capsys):
    """The default backend: one sampler process, at most one version ahead of the trainer;
    nothing generated is stale or overwritten, the first step's rows are on-policy."""
    result = tiny_run(ex, tmp_path, capsys)
    assert set(result["lags"]) <= {0, 1} and result["lags"].get(0, 0) >= 32
    rows = result["rows"]
    assert rows["stale"] == rows["overwritten_or_unread"] == rows["filtered"] == 0
    assert rows["generated"] == rows["trained"] + rows["unused_at_the_stop"]
    # backpressure: at most max_policy_lag + 1 batches beyond those trained
    assert rows["unused_at_the_stop"] <= 2 * 8 * 4


def test_tiny_run_ray(ex, tmp_path, capsys):
    """Several machines' backend, on this one: a Ray collector, torchrl's Ray buffer."""
    pytest.importorskip("ray")
    tiny_run(ex, tmp_path, capsys, "--backend", "ray")


def test_bad_settings(ex, capsys):
    with pytest.raises(ValueError, match="--max-policy-lag must be at least 0, got -1"):
        ex.main([*TINY, "--max-policy-lag", "-1"])
    with pytest.raises(ValueError, match="the local backend runs one sampler process"):
        ex.main([*TINY, "--collectors", "2"])
    for flag, value in (("--backend", "slurm"), ("--correction", "vtrace")):
        with pytest.raises(SystemExit):
            ex.main([*TINY, flag, value])
        assert f"argument {flag}: invalid choice: '{value}'" in capsys.readouterr().err


def test_ray_not_installed(ex, monkeypatch):
    import llm_grpo

    monkeypatch.setitem(sys.modules, "ray", None)  # "import ray" raises ImportError
    monkeypatch.delitem(sys.modules, "llm_async_ray", raising=False)
    cfg = ex.check_settings(
        llm_grpo.parse_args([*TINY, "--backend", "ray"], settings_cls=ex.AsyncSettings)
    )
    with pytest.raises(ImportError, match=r"install the dist extra"):
        ex.start_link(cfg, set(), None, None, None)


# --- the local sampler process: what the trainer sees when it fails --------------------------


def _raising_sampling():
    raise ValueError("no env for you")


def _dying_sampling():
    os._exit(3)


@pytest.mark.parametrize(
    "make_sampling, match",
    [
        (_raising_sampling, r"(?s)the sampler process failed:.*ValueError: no env for you"),
        (_dying_sampling, r"died without a word \(exit code 3\)"),
    ],
)
def test_a_failing_sampler_stops_the_trainer(ex, make_sampling, match):
    import llm_async_local
    import torch

    sampler = llm_async_local.LocalSampler(make_sampling, torch.nn.Linear(2, 2), max_lag=1)
    sampler.publish(torch.nn.Linear(2, 2))
    start = time.perf_counter()
    try:
        with pytest.raises(RuntimeError, match=match):
            sampler.next_batch()
    finally:
        sampler.close(timeout=5)
    assert time.perf_counter() - start < 30  # raised, not hung


def test_the_lag_bound_is_checked_by_the_sampler_too(ex):
    import llm_async_local
    import torch

    with pytest.raises(ValueError, match="max_policy_lag must be at least 0"):
        llm_async_local.LocalSampler(_raising_sampling, torch.nn.Linear(2, 2), max_lag=-1)


def _endless_sampling():
    import torch
    from tensordict import TensorDict

    batches = (TensorDict(x=torch.zeros(1), batch_size=[1]) for _ in iter(int, 1))
    return torch.nn.Linear(2, 2), batches


def test_a_resumed_sampler_goes_on_from_its_version_and_batch(ex):
    """A resumed run's sampler: the first version published is the checkpoint's, and its batch
    numbers go on, so that backpressure lets it generate at once."""
    import llm_async_local
    import torch

    sampler = llm_async_local.LocalSampler(
        _endless_sampling, torch.nn.Linear(2, 2), max_lag=1, first_version=5, first_batch=5
    )
    try:
        assert sampler.publish(torch.nn.Linear(2, 2)) == 5
        versions = [sampler.next_batch()["policy_version"].tolist() for _ in range(2)]
        assert versions == [[5], [5]]  # batches 5 and 6 wait for versions 4 and 5
    finally:
        sampler.close(timeout=5)


def test_a_resumed_sampler_skips_the_prompts_taken(ex):
    """The prompts of the batches a checkpoint's trainer had taken are not drawn again: the
    env with ``skip=2`` starts with the third batch of the stream."""
    import llm_grpo

    cfg = llm_grpo.parse_args(TINY, settings_cls=ex.AsyncSettings)
    task, tokenizer = llm_grpo.digit_sum_task(), llm_grpo.make_tokenizer()
    fresh = ex.collector_env(tokenizer, task, cfg, seed=7, exclude=set())
    queries = [fresh.reset()["query"] for _ in range(3)]
    resumed = ex.collector_env(tokenizer, task, cfg, seed=7, exclude=set(), skip=2)
    assert resumed.reset()["query"] == queries[2] != queries[0]


def test_checkpoints_are_the_local_backends(ex):
    import llm_grpo

    cfg = llm_grpo.parse_args(
        [*TINY, "--backend", "ray", "--checkpoint-every", "2"],
        settings_cls=ex.AsyncSettings,
        checkpoints=True,
    )
    with pytest.raises(ValueError, match="the local backend only"):
        ex.check_settings(cfg)


def test_no_torchrl_future_warning(ex):
    """The sampler's env has torchrl's ``InitTracker`` (the collector's ``FutureWarning`` on an
    env without ``"is_init"`` stays away), and the sampler's postproc drops its entry."""
    import warnings

    import llm_grpo
    import torch
    from torchrl.collectors.llm import LLMCollector

    cfg = llm_grpo.parse_args(TINY, settings_cls=ex.AsyncSettings)
    task, tokenizer = llm_grpo.digit_sum_task(), llm_grpo.make_tokenizer()
    model = llm_grpo.make_model(cfg, tokenizer, task.prompt_length + cfg.max_new_tokens)
    sampler = llm_grpo.make_sampler(
        model, tokenizer, cfg, cls=ex.ExactLogProbsTransformersWrapper, return_log_probs=True
    )
    env = ex.collector_env(tokenizer, task, cfg, seed=7, exclude=set())
    rows = cfg.prompts_per_step * cfg.group_size
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        collector = LLMCollector(
            env,
            policy=sampler,
            dialog_turns_per_batch=rows,
            total_dialog_turns=-1,
            postproc=ex.BehaviourLogProbs(),
        )
        batch = next(iter(collector))
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert not future, future
    assert "is_init" not in batch.keys() and ("next", "is_init") not in batch.keys(True)


def _hold_forever(lock, held):
    lock.acquire()  # as a sampler killed inside SharedWeights.load
    held.set()
    time.sleep(600)


def test_weights_published_past_a_sampler_killed_holding_their_lock(ex):
    """A sampler killed while it loads the weights leaves their lock held for good; the
    trainer's publish writes them anyway once the sampler is dead, instead of waiting forever
    (the next wait for a batch then reports the dead sampler)."""
    import multiprocessing
    import signal
    import threading

    import torch

    context = multiprocessing.get_context("fork")
    module = torch.nn.Linear(2, 2)
    weights = ex.local.SharedWeights(module, context)
    held = context.Event()
    process = context.Process(target=_hold_forever, args=(weights.version.get_lock(), held))
    process.start()
    assert held.wait(10)
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)
    with torch.no_grad():
        module.weight.fill_(3.0)
    versions = []
    publish = threading.Thread(
        target=lambda: versions.append(weights.publish(module, alive=process.is_alive)),
        daemon=True,
    )
    publish.start()
    publish.join(30)
    assert versions == [0]  # published, not stuck on the dead sampler's lock
    assert bool((weights.weights["weight"] == 3.0).all())
