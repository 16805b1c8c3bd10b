"""examples/llm_grpo_async.py with ``--teacher``: on-policy distillation in the asynchronous
loop. The sampler process scores each batch with the teacher (as it scores the reference), the
trainer's ``MCAdvantage`` writes per-token advantages on insertion, and the loss trains on them;
the settings that cannot work are refused, and a resumed run keeps its teacher."""

import contextlib
import csv
import io
import time

import pytest
import torch
from helpers.async_example import TINY, async_example
from helpers.distillation import centred_per_position

ARGS = [*TINY, "--eval-every", "2", "--sft-max-steps", "2", "--time-limit", "1e6"]


@pytest.fixture(scope="module")
def ex():
    with async_example() as module:
        yield module


@pytest.fixture(scope="module")
def teacher(ex, tmp_path_factory):
    """A teacher as examples/llm_grpo.py saves it (a run folder: model/ and tokenizer/), trained
    for one GRPO step from another seed than the student's: another model, the same tokenizer."""
    import llm_grpo

    out = tmp_path_factory.mktemp("teacher")
    args = [*TINY, "--steps", "1", "--sft-max-steps", "2", "--eval-prompts", "20", "--seed", "1"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        result = llm_grpo.main([*args, "--time-limit", "1e6", "--out", str(out)])
    return result["run_dir"]


def released_rows(ex, monkeypatch) -> list:
    """Every batch of rows the trainer takes from its buffer (``MCAdvantage``'s release), with
    the transform that wrote their advantages."""
    taken, next_rows = [], ex.LocalLink.next_rows

    def keep(self):
        rows = next_rows(self)
        taken.append((rows.clone(), self.advantage))
        return rows

    monkeypatch.setattr(ex.LocalLink, "next_rows", keep)
    return taken


def logged(run_dir, name: str) -> list[tuple[int, float]]:
    with open(run_dir / "scalars" / f"{name}.csv") as f:
        return [(int(s), float(v)) for s, v in csv.reader(f)]


def check_token_advantages(rows, beta: float) -> torch.Tensor:
    """Distillation alone (``alpha = 0``, ``gamma = 0``, centred per position, the default):
    each token's advantage is ``-beta * (d_t - mean of its group's d at its position)``,
    ``d_t = log pi_old - log pi_T`` on the response, ``log pi_old`` the sampler's, and 0
    elsewhere.
    Returns the reverse KL of the real response tokens."""
    tokens, adv = rows["tokens", "full"], rows["advantage"]
    assert adv.shape == tokens.shape and adv.dim() == 2  # [B, T]: per token, not per row
    prompt = rows["tokens", "prompt"].shape[-1]
    assert (adv[:, :prompt] == 0).all()
    old = rows["log_probs", "full"][:, prompt:]  # the sampler's (NaN over the prompt)
    taught = rows["next", "teacher_log_probs", "full"][:, prompt:]
    real = rows["masks", "all_attention_mask"][:, prompt:].bool()
    d = centred_per_position((old - taught).double(), real, rows["tokens", "prompt"])
    expected = torch.where(real, -beta * d, torch.zeros_like(d)).to(adv.dtype)
    torch.testing.assert_close(adv[:, prompt:], expected)
    assert (adv[:, prompt:].std(-1) > 0).any()  # the teacher's, token by token
    return (old - taught)[real]


def test_distillation_alone_then_resumed(ex, teacher, tmp_path, monkeypatch, capsys):
    """``--teacher --distill-alpha 0``: the batches the trainer trains on carry the teacher's
    log-probs (scored in the sampler process) and per-token advantages, no reward read; the
    reverse KL is logged; the checkpoint resumes with the same teacher only."""
    taken = released_rows(ex, monkeypatch)
    flags = ["--teacher", str(teacher), "--distill-alpha", "0", "--distill-beta", "0.5"]
    start = time.perf_counter()
    result = ex.main([*ARGS, *flags, "--steps", "2", "--out", str(tmp_path / "a")])
    assert time.perf_counter() - start < 90  # about 12 s on 2 idle cores
    assert result["steps"] == 2 and result["rows"]["trained"] == 2 * 16
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("RESULT acc_before=")
    assert len(taken) == 2
    for rows, advantage in taken:
        assert advantage.rewards_key is None and advantage.distillation.alpha == 0.0
        kl = check_token_advantages(rows, beta=0.5)
    mean = logged(result["run_dir"], "distill_kl_token_mean")
    assert [s for s, _ in mean] == [1, 2]
    assert mean[-1][1] == pytest.approx(float(kl.double().mean()), rel=1e-4)  # step 2's rows
    assert result["weights_moved"] > 0.0  # trained on the teacher's advantages (no reward)

    with pytest.raises(SystemExit, match=r"--distill-beta 0\.5"):
        ex.main(
            [*ARGS, "--teacher", str(teacher), "--distill-alpha", "0", "--steps", "3"]
            + ["--resume", str(result["run_dir"])]
        )
    with pytest.raises(SystemExit, match="--teacher"):
        ex.main([*ARGS, "--steps", "3", "--resume", str(result["run_dir"])])
    taken.clear()
    again = ex.main([*ARGS, *flags, "--steps", "3", "--resume", str(result["run_dir"])])
    assert again["steps"] == 3 and len(taken) == 1
    check_token_advantages(taken[0][0], beta=0.5)


def test_grpo_with_the_teacher_reads_the_reward(ex, teacher):
    import llm_grpo

    cfg = llm_grpo.parse_args([*TINY, "--teacher", str(teacher)], settings_cls=ex.AsyncSettings)
    advantage = ex.buffer_transform(ex.check_settings(cfg))[-1]
    assert advantage.rewards_key == ("next", "reward") and advantage.trajectory_return == "sum"
    assert advantage.distillation == ex.Distillation(
        1.0, 1.0, 0.0, log_prob_key=("log_probs", "full"), baseline="position"
    )
    plain = ex.buffer_transform(
        ex.check_settings(llm_grpo.parse_args(TINY, settings_cls=ex.AsyncSettings))
    )[-1]
    assert plain.distillation is None  # no teacher: GRPO as before


def test_distill_baseline_is_llm_distill_baseline(ex, teacher, capsys):
    """``--distill-baseline``: ``llm_distill.py``'s ``--baseline`` choices, the same
    ``Distillation(baseline=...)`` (``none``: ``False``); another value is refused."""
    import llm_grpo

    for choice, baseline in [("none", False), ("group", "group"), ("position", "position")]:
        flags = [*TINY, "--teacher", str(teacher), "--distill-baseline", choice]
        cfg = ex.check_settings(llm_grpo.parse_args(flags, settings_cls=ex.AsyncSettings))
        given = ex.buffer_transform(cfg)[-1].distillation.baseline
        assert (given, type(given)) == (baseline, type(baseline))
    with pytest.raises(SystemExit):
        llm_grpo.parse_args([*TINY, "--distill-baseline", "yes"], settings_cls=ex.AsyncSettings)
    assert "invalid choice: 'yes'" in capsys.readouterr().err


def test_another_tokenizer_is_refused_before_anything_starts(ex, tmp_path, capsys):
    import llm_grpo

    other = llm_grpo.make_tokenizer("0123456789 =+")
    cfg = llm_grpo.parse_args(TINY, settings_cls=ex.AsyncSettings)
    llm_grpo.make_model(cfg, other, 12).save_pretrained(tmp_path / "run" / "model")
    other.save_pretrained(tmp_path / "run" / "tokenizer")
    with pytest.raises(ValueError, match="Cross-tokenizer distillation is out of scope"):
        ex.main([*TINY, "--teacher", str(tmp_path / "run"), "--out", str(tmp_path / "out")])
    assert "warm start" not in capsys.readouterr().out  # no sampler, no warm start
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--distill-beta", "2"], "give the teacher, --teacher"),
        (["--distill-baseline", "none"], "give the teacher, --teacher"),
        (["--teacher", "t", "--backend", "ray"], "--teacher: the local backend only"),
        (["--teacher", "t", "--distill-beta", "-1"], "--distill-beta.*beta must be finite"),
        (["--teacher", "t", "--distill-alpha", "0", "--distill-beta", "0"], "neither the reward"),
        (["--teacher", "t", "--distill-gamma", "2"], "gamma must be a number in"),
        (["--teacher", "t", "--distill-alpha", "0", "--dynamic-sampling"], "does not read"),
        (["--teacher", "no/such/run"], "--teacher no/such/run: no saved model there"),
    ],
)
def test_settings_that_cannot_work_are_refused(ex, flags, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        ex.main([*TINY, *flags, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
