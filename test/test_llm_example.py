"""examples/llm_grpo.py: its reward, its log-prob plumbing, and a whole run on a tiny budget."""

import csv
import importlib.util
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

try:
    import transformers  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs the `llm` extra (make test): without it this is a failure, not a skip
    pytest.skip("needs the llm extra: pip install -e '.[llm]'", allow_module_level=True)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llm_grpo.py"
RESULT = re.compile(r"RESULT acc_before=(\d+\.\d+) acc_after=(\d+\.\d+) wall_s=(\d+\.\d+)")


@pytest.fixture(scope="module")
def ex():
    spec = importlib.util.spec_from_file_location("llm_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TestTask:
    def test_reward_is_exact_match(self, ex):
        assert ex.reward("17", [3, 9, 1, 4]) == 1.0
        assert ex.reward("7", [3, 9, 1, 4]) == 0.0
        assert ex.reward("017", [3, 9, 1, 4]) == 0.0
        assert ex.reward("0", [0, 0, 0, 0]) == 1.0

    def test_only_ended_completions_score(self, ex):
        tok = ex.CharTokenizer()
        digits = torch.tensor([[3, 9, 1, 4], [3, 9, 1, 4], [1, 1, 1, 1]])
        tokens = torch.tensor(
            [
                tok.encode("17") + [tok.eos_id, tok.pad_id],
                tok.encode("17") + [tok.pad_id] * 2,  # right answer, never ended
                tok.encode("4") + [tok.eos_id] + tok.encode("99"),  # tokens after EOS ignored
            ]
        )
        assert ex.completion_rewards(tok, tokens, digits).tolist() == [1.0, 0.0, 1.0]

    def test_training_prompts_never_hit_the_evaluation_set(self, ex):
        gen = torch.Generator().manual_seed(0)
        held_out = ex.draw_problems(gen, 500, 4, torch.tensor([-1]))
        train = ex.draw_problems(gen, 5000, 4, ex.problem_code(held_out))
        assert train.shape == (5000, 4)
        assert not torch.isin(ex.problem_code(train), ex.problem_code(held_out)).any()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_log_probs_are_the_trained_policy_log_probs(ex, temperature):
    """Before any update the ratio is 1 everywhere: the sampler's per-token log-probs (KV cache,
    temperature) equal the log-probs GRPOLoss recomputes by teacher forcing, and the KL to the
    reference (a copy of the policy) is 0."""
    cfg = ex.parse_args(["--temperature", str(temperature)])
    torch.manual_seed(0)
    tok = ex.CharTokenizer()
    model = ex.make_model(cfg, tok)
    loss_fn = ex.make_loss(model, cfg)
    digits = ex.draw_problems(torch.Generator().manual_seed(0), 16, cfg.digits, torch.tensor([-1]))
    batch = ex.sample_batch(model, model, tok, cfg, digits)
    assert batch["mask"].any(-1).all() and not batch["mask"].all()  # ragged responses
    batch["advantage"] = torch.randn(batch.shape[0], 1)
    out = loss_fn(batch)
    torch.testing.assert_close(out.ESS, torch.tensor(1.0))
    assert out.clip_fraction.item() == 0.0
    assert abs(out.kl_approx.item()) < 1e-5
    assert abs(out.kl_to_ref.item()) < 1e-5
    assert 0.0 < out.entropy.item() < math.log(len(tok))


def test_tiny_run_prints_a_result_line(tmp_path):
    """The script end to end on a tiny budget: one RESULT line, consistent with its own logs."""
    args = ["--steps", "4", "--eval-every", "2", "--prompts-per-step", "8", "--group-size", "4"]
    args += ["--minibatch", "16", "--eval-prompts", "200", "--out", str(tmp_path)]
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert sum(line.startswith("RESULT") for line in lines) == 1
    match = RESULT.fullmatch(lines[-1])
    assert match, lines[-1]
    acc_before, acc_after, wall_s = map(float, match.groups())
    # the warm start stops at 30% on its validation prompts; chance is about 1 in 37
    assert 0.15 <= acc_before <= 1.0 and 0.0 <= acc_after <= 1.0
    assert 0.0 < wall_s <= elapsed

    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / "llm_grpo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logged = {}
    for name in ("reward", "ESS", "clip_fraction", "kl_to_ref", "entropy", "accuracy"):
        with open(run_dir / "scalars" / f"{name}.csv") as f:
            logged[name] = [(int(s), float(v)) for s, v in csv.reader(f)]
    assert [s for s, _ in logged["reward"]] == [1, 2, 3, 4]
    assert [s for s, _ in logged["accuracy"]] == [2, 4]
    assert logged["accuracy"][-1][1] == pytest.approx(acc_after, abs=1e-4)
    assert all(0.0 < v <= 1.0 + 1e-6 for _, v in logged["ESS"])
    assert all(0.0 <= v <= 1.0 for _, v in logged["clip_fraction"] + logged["reward"])
    assert all(math.isfinite(v) for _, v in logged["kl_to_ref"] + logged["entropy"])
