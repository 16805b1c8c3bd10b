"""examples/llm_grpo_multiturn.py: its task, its env's turns, the warm start, a tiny run."""

import csv
import dataclasses
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

try:
    import transformers  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs the `llm` extra (make test): without it this is a failure, not a skip
    pytest.skip("needs the llm extra: pip install -e '.[llm]'", allow_module_level=True)

import tensordict
from helpers.examples import load_example
from tensordict import lazy_stack
from torch.utils.data import DataLoader
from torchrl.modules.llm.policies.common import Tokens

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llm_grpo_multiturn.py"
RESULT = re.compile(
    r"RESULT success_before=(\S+) success_after=(\S+) turns_mean=(\S+) wall_s=(\S+) "
    r"first_minibatch_ess_min=(\S+)"
)
TINY = ["--prompts-per-step", "4", "--group-size", "4", "--minibatch", "8", "--eval-prompts", "40"]


@pytest.fixture(scope="module")
def ex():
    return load_example(EXAMPLE, "llm_grpo_multiturn")


@pytest.fixture(autouse=True)
def _list_to_stack():
    with tensordict.set_list_to_stack(True):
        yield


@pytest.fixture(scope="module")
def tokenizer(ex):
    return ex.llm_grpo.make_tokenizer("0123456789 =" + ex.HIDDEN + ex.REPLY)


class TestTask:
    def test_one_digit_hidden_and_revealed(self, ex):
        for p in ex.draw(torch.Generator().manual_seed(0), 50):
            shown, revealed = p.prompt[:-1].split(), p.reveal[1:-1].split()
            assert p.reveal.startswith(ex.REPLY) and p.prompt.endswith("=")
            assert shown.count(ex.HIDDEN) == 1 and len(shown) == len(revealed) == 4
            assert all(s in (ex.HIDDEN, r) for s, r in zip(shown, revealed))
            assert p.answer == str(sum(int(r) for r in revealed))

    def test_warm_start_dialogs(self, ex):
        p = ex.Problem("3 ? 1 4=", "|3 5 1 4=", "13")
        text, spans = ex.sft_dialog(p, guess=2, ask=False)  # visible 8, plus the guess
        assert text == "3 ? 1 4=10<eos>" and [text[a:b] for a, b in spans] == ["10<eos>"]
        text, spans = ex.sft_dialog(p, guess=2, ask=True)
        assert text == "3 ? 1 4=?<eos>|3 5 1 4=13<eos>"
        assert [text[a:b] for a, b in spans] == ["?<eos>", "13<eos>"]
        (asked,) = ex.asked([p])
        assert asked.prompt == "3 ? 1 4=?<eos>|3 5 1 4=" and asked.answer == "13"


class TestTurns:
    """The env of the example, answered by hand: a tool call gets the reveal appended to the
    dialog, an answer ends it with its reward."""

    def answer(self, td, tokenizer, texts):
        rows = []
        for row, text in zip(td.unbind(0), texts, strict=True):
            prompt = row["tokens", "prompt"]
            response = torch.tensor(tokenizer(text)["input_ids"])
            row.set(
                "tokens",
                Tokens(prompt=prompt, response=response, full=torch.cat([prompt, response])),
            )
            rows.append(row)
        return lazy_stack(rows)

    def test_ask_then_answer(self, ex, tokenizer):
        problems = [
            ex.Problem("3 ? 1 4=", "|3 5 1 4=", "13"),
            ex.Problem("? 0 0 1=", "|9 0 0 1=", "10"),
        ]
        cfg = ex.llm_grpo.parse_args([], None, ex.Settings)
        loader = DataLoader(
            [ex.as_tensordict(problems, 0)], batch_size=None, collate_fn=lambda t: t
        )
        env = ex.make_env(tokenizer, loader, 2, cfg)
        td = env.reset()
        td = env.step(self.answer(td, tokenizer, ["?<eos>", "12<eos>"]))
        assert td["next", "reward"].reshape(-1).tolist() == [0.0, 0.0]
        assert td["next", "done"].reshape(-1).tolist() == [False, True]
        nxt = td["next"]
        prompt = tokenizer.decode(nxt.get(("tokens", "prompt"), as_list=True)[0])
        assert prompt == "3 ? 1 4=?<eos>|3 5 1 4="
        td = env.step(self.answer(ex.step_mdp(td), tokenizer, ["13<eos>", "?<eos>"]))
        assert td["next", "reward"].reshape(-1).tolist()[0] == 1.0
        assert td["next", "done"].reshape(-1).tolist() == [True, True]  # max turns: 2


class TestCollector:
    def test_no_torchrl_future_warning(self, ex, tokenizer):
        """torchrl 0.14's collectors warn (``FutureWarning``: "missing transforms required by
        the policy (InitTracker)") on an env without ``"is_init"``, whatever the policy; the
        example's env has torchrl's ``InitTracker``, so a run prints none."""
        cfg = ex.parse_args(["--prompts-per-step", "2", "--group-size", "2"])
        model = ex.llm_grpo.make_model(cfg, tokenizer, ex.context(cfg))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            collector, rb, _ = ex.make_collector(
                cfg, model, tokenizer, torch.Generator().manual_seed(0), set()
            )
            for i, _ in enumerate(collector):  # two batches: every dialog's two turns
                if i == 1:
                    break
            collector.shutdown()
        assert len(rb) > 0
        future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        assert not future, future


class TestSettings:
    @pytest.mark.parametrize(
        "flags, named",
        [
            (["--max-turns", "0"], "--max-turns 0: at least 1"),
            (["--minibatch", "0", "--epochs", "0"], "--minibatch 0: at least 1; --epochs 0"),
            (["--sft-ask", "1.5"], "--sft-ask 1.5: between 0 and 1"),
            (["--eval-every", "0"], "--eval-every 0: at least 1"),
            (["--time-limit", "0"], "--time-limit 0.0: seconds, more than 0"),
            (["--task", "running-sum"], "--task running-sum: the single-turn examples only"),
        ],
    )
    def test_nonsense_is_refused_naming_the_flag(self, ex, capsys, flags, named):
        with pytest.raises(SystemExit) as stop:
            ex.parse_args(flags)
        assert stop.value.code == 2 and named in capsys.readouterr().err

    def test_an_unknown_estimator_is_refused(self, ex, capsys):
        with pytest.raises(SystemExit):
            ex.parse_args(["--estimator", "per-step"])
        assert "invalid choice: 'per-step'" in capsys.readouterr().err


class TestRun:
    def test_help_documents_every_setting(self, ex):
        out = subprocess.run(
            [sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0
        for f in dataclasses.fields(ex.Settings):
            assert "--" + f.name.replace("_", "-") in out.stdout

    @pytest.mark.parametrize("turns", [2, 1])
    def test_tiny_run(self, ex, tmp_path, turns):
        """End to end on a tiny budget: one RESULT line; the first minibatch of every step is
        scored by the weights that train on it, so its ESS is 1 (nothing misaligned); the turns
        stored are the turns sampled (asserted inside); logs, plot and model written. Prefixes
        of 4 tokens or more are computed once (a task's prompt, a dialog's earlier turns), in the
        old log-probs and in the loss: ESS 1 says both agree."""
        args = [*TINY, "--steps", "4", "--eval-every", "2", "--sft-max-steps", "20"]
        args += ["--max-turns", str(turns), "--out", str(tmp_path), "--min-shared-length", "4"]
        proc = subprocess.run(
            [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Shared-prefix scoring is off" not in proc.stderr
        lines = proc.stdout.strip().splitlines()
        assert sum(line.startswith("RESULT") for line in lines) == 1
        before, after, turns_mean, wall_s, ess_min = map(
            float, RESULT.fullmatch(lines[-1]).groups()
        )
        assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0 and 1.0 <= turns_mean <= turns
        assert ess_min == pytest.approx(1.0, abs=1e-3) and wall_s > 0
        (run_dir,) = tmp_path.iterdir()
        assert (run_dir / "llm_grpo_multiturn.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (run_dir / "model" / "config.json").is_file()
        with open(run_dir / "scalars" / "ess_first.csv") as f:
            ess = [float(v) for _, v in csv.reader(f)]
        assert ess and all(abs(v - 1.0) < 1e-3 for v in ess)
