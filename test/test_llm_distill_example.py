"""examples/llm_distill.py: the teacher's check, per-token advantages, the KL, a tiny run."""

import copy
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.distillation import centred_per_position
from helpers.examples import load_example
from tensordict import TensorDict

from torchrl_grpo.llm.head import head_tensors

try:
    import transformers  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs the `llm` extra (make test): without it this is a failure, not a skip
    pytest.skip("needs the llm extra: pip install -e '.[llm]'", allow_module_level=True)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llm_distill.py"
FLOAT = r"(\d+\.\d+|inf)"
RESULT = re.compile(
    rf"RESULT acc_grpo={FLOAT} acc_distill={FLOAT} acc_both={FLOAT} t_distill_to_grpo={FLOAT} "
    rf"budget_s={FLOAT} wall_s={FLOAT} kl_start={FLOAT} kl_end={FLOAT}"
)
TINY = ["--prompts-per-step", "4", "--group-size", "4", "--minibatch", "8", "--eval-prompts", "40"]


@pytest.fixture(scope="module")
def ex():
    return load_example(EXAMPLE, "llm_distill")


@pytest.fixture(scope="module")
def parts(ex):
    """A tiny student and a teacher (another random model) over the example's tokenizer."""
    cfg = ex.llm_grpo.parse_args(TINY, settings_cls=ex.Settings)
    task = ex.llm_grpo.digit_sum_task(cfg.digits)
    tokenizer = ex.llm_grpo.make_tokenizer(task.alphabet)
    length = task.prompt_length + cfg.max_new_tokens
    torch.manual_seed(0)
    student = ex.llm_grpo.make_model(cfg, tokenizer, length)
    teacher = ex.llm_grpo.make_model(cfg, tokenizer, length).requires_grad_(False)
    return cfg, task, tokenizer, student, teacher


def save(model, tokenizer, folder: Path) -> Path:
    """A run folder as examples/llm_grpo.py writes it: model/ and tokenizer/."""
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "tokenizer")
    return folder


class TestTeacher:
    def test_another_tokenizer_is_refused_before_any_training(self, ex, parts, tmp_path, capsys):
        """``--teacher`` whose tokenizer has another alphabet: ``TeacherLogProbs``' check names
        both and says cross-tokenizer distillation is out of scope; nothing trained."""
        cfg, _, _, student, _ = parts
        other = ex.llm_grpo.make_tokenizer("0123456789 =+")
        folder = save(ex.llm_grpo.make_model(cfg, other, 12), other, tmp_path / "run")
        with pytest.raises(ValueError, match="Cross-tokenizer distillation is out of scope"):
            ex.main(["--teacher", str(folder), *TINY, "--out", str(tmp_path / "out")])
        assert "warm-start" not in capsys.readouterr().out
        assert not (tmp_path / "out").exists()

    def test_a_run_folder_or_its_model_folder(self, ex, parts, tmp_path):
        cfg, task, tokenizer, student, _ = parts
        folder = save(student, tokenizer, tmp_path / "run")
        for given in (folder, folder / "model"):
            settings = ex.llm_grpo.parse_args(
                [*TINY, "--teacher", str(given)], settings_cls=ex.Settings
            )
            assert ex.teacher_folder(settings) == folder / "model"
            model, scorer = ex.load_teacher(settings, task, tokenizer)
            assert isinstance(scorer, ex.TeacherLogProbs)
            assert not any(p.requires_grad for p in model.parameters())

    def test_the_teacher_trained_here_learns_the_students_task(self, ex, tmp_path, monkeypatch):
        """Without ``--teacher``, ``llm_grpo.py`` trains one on ``--task`` and ``--digits``."""
        given = []

        def train(argv):
            given.append(argv)
            return {"acc_before": 0.1, "acc_after": 0.9, "wall_s": 1.0, "run_dir": str(tmp_path)}

        monkeypatch.setattr(ex.llm_grpo, "main", train)
        flags = ["--task", "running-sum", "--digits", "3", "--out", str(tmp_path / "out")]
        settings = ex.llm_grpo.parse_args(flags, settings_cls=ex.Settings)
        assert ex.teacher_folder(settings) == tmp_path / "model"
        [argv] = given
        assert argv[argv.index("--task") + 1] == "running-sum"
        assert argv[argv.index("--digits") + 1] == "3"


def test_distillation_writes_a_per_token_advantage(ex, parts):
    """The distillation run's batch: an advantage per token of ``("tokens", "full")``, 0 on the
    prompt, ``-beta * (log pi_old - log pi_T)`` on the response (gamma 0, alpha 0)."""
    cfg, task, tokenizer, student, teacher_model = parts
    wrapper = ex.llm_grpo.make_scorer(teacher_model, tokenizer, cfg, "teacher_log_probs")
    teacher = ex.TeacherLogProbs(wrapper, tokenizer=tokenizer)
    run = ex.three_runs(cfg)[1]
    assert run.name == "distill" and run.distillation.alpha == 0.0
    gen = torch.Generator().manual_seed(0)
    collector, rb = ex.make_collector(
        cfg, task, student, student, tokenizer, gen, set(), teacher, run
    )
    next(iter(collector))
    collector.shutdown()
    batch = rb[:]
    tokens, adv = batch["tokens", "full"], batch["advantage"]
    assert adv.shape == tokens.shape and len(batch) == 16
    prompt = batch["tokens", "prompt"].shape[-1]
    assert (adv[:, :prompt] == 0).all()
    old = batch["next", "log_probs", "full"]
    taught = batch["next", "teacher_log_probs", "full"]
    real = batch["masks", "all_attention_mask"][:, prompt:]
    d = (old - taught)[:, prompt:].double()
    assert run.distillation.baseline == "position"  # less its group's mean at its position
    d = centred_per_position(d, real, batch["tokens", "prompt"])
    expected = (-run.distillation.beta * d * real).to(adv.dtype)
    torch.testing.assert_close(adv[:, prompt:], expected)
    assert (adv[:, prompt:].std(-1) > 0).any()  # not one value per sequence


def test_padding_has_no_mass_where_the_samplers_cannot_emit_it(ex, parts):
    """``suppress_padding``: the head's fixed offset takes the padding out of the softmax the
    scorer reads (the samplers never emit it), leaves every other logit as it was, and is not
    trained."""
    cfg, task, tokenizer, student, _ = parts
    model = ex.llm_grpo.make_model(cfg, tokenizer, task.prompt_length + cfg.max_new_tokens)
    tokens = torch.tensor([[1, 10, 2, 11, 3, 12]])
    before = model(tokens).logits
    ex.suppress_padding(model, tokenizer)
    after = model(tokens).logits
    pad = tokenizer.pad_token_id
    assert (after.softmax(-1)[..., pad] < 1e-12).all()
    others = torch.arange(before.shape[-1]) != pad
    torch.testing.assert_close(after[..., others], before[..., others])
    assert not model.get_output_embeddings().bias.requires_grad
    _, bias = head_tensors(model.get_output_embeddings())  # what the lean scorer reads
    assert bias[pad] == ex.PAD_LOGIT and (bias[others] == 0).all()


def test_the_runs(ex, parts):
    cfg = parts[0]
    runs = ex.three_runs(cfg)
    assert [r.name for r in runs] == list(ex.RUN_NAMES)
    assert runs[0].distillation is None
    assert (runs[2].distillation.alpha, runs[2].distillation.beta) == (1.0, cfg.both_beta)
    assert runs[0].settings == runs[2].settings == cfg
    # --distill-flags' default
    assert runs[1].settings == dataclasses.replace(cfg, kl_coeff=0.0, epochs=8)
    assert runs[1].distillation.baseline == runs[2].distillation.baseline == "position"
    for flag, baseline in (("none", False), ("group", "group")):
        cfg = ex.llm_grpo.parse_args([*TINY, "--baseline", flag], settings_cls=ex.Settings)
        assert ex.three_runs(cfg)[1].distillation.baseline == baseline


def test_distill_flags_set_the_distillation_run_apart(ex):
    """``--distill-flags``: the distillation-alone run's own training settings; GRPO and GRPO
    with the teacher keep the command line's."""
    flags = "--group-size 2 --prompts-per-step 32 --kl-coeff 0 --lr 1e-3"
    cfg = ex.llm_grpo.parse_args([*TINY, "--distill-flags", flags], settings_cls=ex.Settings)
    grpo, alone, both = (run.settings for run in ex.three_runs(cfg))
    assert grpo == both == cfg and (cfg.group_size, cfg.kl_coeff, cfg.lr) == (4, 0.02, 5e-4)
    changed = alone.group_size, alone.prompts_per_step, alone.kl_coeff, alone.lr
    assert changed == (2, 32, 0.0, 1e-3)
    assert alone.minibatch == cfg.minibatch and alone.n_layer == cfg.n_layer  # the rest: shared


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ("--n-layer 1", "--n-layer 1 is not one of"),  # the student is the three runs'
        ("--budget 10", "--budget 10 is not one of"),
        ("--group 4", "--group 4 is not one of"),  # no abbreviations
        ("--group-size 1", "--group-size must be at least 2"),
        ("--lr fast", "invalid float value: 'fast'"),
    ],
)
def test_distill_flags_refused_before_any_training(ex, flags, named, tmp_path):
    argv = ["--distill-flags", flags, "--teacher", str(tmp_path), "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit, match=named):
        ex.main(argv)
    assert not (tmp_path / "o").exists()


def test_a_negative_top_k_is_refused_before_any_training(ex, tmp_path):
    with pytest.raises(SystemExit, match="--top-k must be 0"):
        ex.main(["--top-k", "-1", "--teacher", str(tmp_path), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_reverse_kl_on_held_out_completions(ex, parts):
    """Exact KL(student || teacher) per response token: 0 against itself, positive otherwise,
    read on the completions up to their end-of-sequence."""
    cfg, task, tokenizer, student, teacher = parts
    problems = ex.llm_grpo.draw_problems(task, torch.Generator().manual_seed(0), 8, set())
    held_out = ex.HeldOut(tokenizer, task, problems, teacher, cfg)
    acc, kl = held_out(student)
    assert 0.0 <= acc <= 1.0 and kl > 0.0
    assert held_out.__class__(tokenizer, task, problems, student, cfg)(student)[1] == 0.0
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    tokens, response = held_out.sequences(
        [torch.tensor([1, 2]), torch.tensor([3, 4])],
        [torch.tensor([5, eos, pad]), torch.tensor([6, 7, 8])],
    )
    assert tokens.tolist() == [[1, 2, 5, eos, pad], [3, 4, 6, 7, 8]]
    assert response.tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    # the same number as a tensor with the student's gradient only (benchmarks/llm_distill_step.py)
    value = ex.exact_reverse_kl(student, teacher, tokens, response)
    assert value.item() == pytest.approx(ex.reverse_kl(student, teacher, tokens, response))
    value.backward()
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)
    assert all(p.grad is None for p in teacher.parameters())
    student.zero_grad(set_to_none=True)


def test_the_exact_objective_is_the_reverse_kl_of_the_response(ex, parts):
    """``ExactReverseKL``: the batch's exact reverse KL on the completions' tokens (not the
    prompt's, not the padding), with the student's gradient."""
    cfg, _, tokenizer, student, teacher = parts
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    full = torch.tensor([[1, 10, 2, 11, 3, eos, pad], [4, 10, 5, 11, 6, 7, eos]])
    batch = TensorDict(
        tokens=TensorDict(full=full, prompt=full[:, :4], batch_size=[2]),
        masks=TensorDict(all_attention_mask=full != pad, batch_size=[2]),
        batch_size=[2],
    )
    loss = ex.ExactReverseKL(teacher)(student, cfg)(batch).total_loss()
    response = torch.tensor([[0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert loss.item() == pytest.approx(ex.reverse_kl(student, teacher, full, response))
    loss.backward()
    assert student.model.embed_tokens.weight.grad is not None
    student.zero_grad(set_to_none=True)


def test_the_few_tokens_objective(ex, parts):
    """``ExactReverseKL(top=(teacher_k, student_k))``: over every token it is the exact reverse
    KL; over the teacher's top token and the student's, a KL of those outcomes and the rest of
    the vocabulary as one, transcribed; with the student's gradient."""
    cfg, _, tokenizer, student, teacher = parts
    full = torch.tensor([[1, 10, 2, 11, 3, 4, 5], [4, 10, 5, 11, 6, 7, 8]])
    batch = TensorDict(
        tokens=TensorDict(full=full, prompt=full[:, :4], batch_size=[2]),
        masks=TensorDict(
            all_attention_mask=torch.ones_like(full, dtype=torch.bool), batch_size=[2]
        ),
        batch_size=[2],
    )
    vocab = student.get_output_embeddings().out_features
    everything = ex.ExactReverseKL(teacher, top=(vocab, 0))(student, cfg)(batch).total_loss()
    exact = ex.ExactReverseKL(teacher)(student, cfg)(batch).total_loss()
    torch.testing.assert_close(everything, exact, rtol=1e-5, atol=1e-6)
    loss = ex.ExactReverseKL(teacher, top=(1, 1))(student, cfg)(batch).total_loss()
    with torch.no_grad():
        p = student(full).logits.softmax(-1)[:, 3:-1].double()  # predicting the response
        q = teacher(full).logits.softmax(-1)[:, 3:-1].double()
    expected = []
    for pi, qi in zip(p.reshape(-1, vocab), q.reshape(-1, vocab), strict=True):
        chosen = sorted({int(qi.argmax()), int(pi.argmax())})
        ps, qs = [float(pi[v]) for v in chosen], [float(qi[v]) for v in chosen]
        ps, qs = [*ps, 1 - sum(ps)], [*qs, 1 - sum(qs)]
        expected.append(sum(a * math.log(a / b) for a, b in zip(ps, qs, strict=True)))
    assert loss.item() == pytest.approx(sum(expected) / len(expected), rel=1e-4)
    assert 0 < loss.item() < exact.item()  # a lower bound of the full KL
    loss.backward()
    assert student.model.embed_tokens.weight.grad is not None
    student.zero_grad(set_to_none=True)


def test_top_k_objective_is_the_few_tokens_kl_of_the_yardstick(ex, parts):
    """``--top-k K``: the distillation-alone run trains on ``TopKDistillationLoss`` over the
    teacher's top tokens that ``TeacherLogProbs(top_k=K)`` wrote (lean, no logits), which is the
    dense yardstick's ``ExactReverseKL(teacher, top=(K, 0))`` on the same batch."""
    cfg, task, tokenizer, student, teacher_model = parts
    cfg = dataclasses.replace(cfg, top_k=3)
    runs = ex.three_runs(cfg)
    setup = ex.Setup(*[None] * len(ex.Setup._fields))._replace(tokenizer=tokenizer)
    assert [type(ex.run_objective(run, setup)).__name__ for run in runs] == [
        "NoneType",
        "TopKObjective",
        "NoneType",
    ]
    plain = ex.three_runs(dataclasses.replace(cfg, top_k=0))[1]
    assert ex.run_objective(plain, setup) is None
    wrapper = ex.llm_grpo.make_scorer(
        teacher_model, tokenizer, cfg, "teacher_log_probs", response_only=True
    )
    teacher = ex.TeacherLogProbs(wrapper, tokenizer=tokenizer, top_k=3)
    gen = torch.Generator().manual_seed(0)
    collector, rb = ex.make_collector(
        cfg, task, student, student, tokenizer, gen, set(), teacher, runs[1]
    )
    next(iter(collector))
    collector.shutdown()
    batch = rb[:]
    prompt = batch["tokens", "prompt"].shape[-1]
    ids = batch["next", "teacher_top_ids", "full"]
    assert ids.shape == (*batch["tokens", "full"].shape, 3) and not ids[:, :prompt].any()
    out = ex.run_objective(runs[1], setup)(student, cfg)(batch)
    dense = ex.ExactReverseKL(teacher_model, top=(3, 0)).loss(student, batch)
    torch.testing.assert_close(out.total_loss(), dense, rtol=1e-4, atol=1e-6)


def test_a_run_minimizes_the_objective_it_is_given(ex, parts):
    """``train(..., objective=...)``: each minibatch's loss is the objective's, not GRPO's."""
    cfg, task, tokenizer, student, teacher_model = parts
    cfg = dataclasses.replace(cfg, steps=1, epochs=1, eval_every=1, budget=60.0)
    wrapper = ex.llm_grpo.make_scorer(teacher_model, tokenizer, cfg, "teacher_log_probs")
    problems = ex.llm_grpo.draw_problems(task, torch.Generator().manual_seed(0), 8, set())
    setup = ex.Setup(
        task,
        tokenizer,
        teacher_model,
        ex.TeacherLogProbs(wrapper, tokenizer=tokenizer),
        ex.suppress_padding(copy.deepcopy(student), tokenizer).state_dict(),
        set(problems["query"]),
        ex.HeldOut(tokenizer, task, problems, teacher_model, cfg),
        teacher_acc=0.0,
        acc_start=0.0,
        kl_start=0.0,
    )
    seen = []

    def objective(model, settings):
        assert settings is cfg
        exact = ex.ExactReverseKL(teacher_model)(model, settings)
        return lambda batch: seen.append(len(batch)) or exact(batch)

    run = ex.Run("exact", "exact reverse KL", None, cfg)
    curves = ex.train(run, setup, objective=objective)
    assert seen == [8, 8] and curves["step"] == [0, 1]  # 16 completions, minibatches of 8


@pytest.mark.parametrize("flag", ["--dynamic-sampling", "--group-minibatches", "--lora-rank=4"])
def test_flags_of_llm_grpo_only_are_refused(ex, flag, tmp_path):
    """llm_grpo.py's flags that this example's pipeline does not read: refused, not ignored."""
    with pytest.raises(SystemExit):
        ex.main([flag, "--teacher", str(tmp_path), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_stopwatch_and_time_to_reach(ex):
    clock = ex.Stopwatch()
    assert clock() == 0.0
    clock.start()
    with clock.paused():
        paused_at = clock()
        time.sleep(0.05)
        assert clock() == paused_at  # the evaluations do not count
    curves = {"time": [0.0, 2.0, 4.0], "accuracy": [0.2, 0.5, 0.7]}
    assert ex.time_to_reach(curves, 0.5) == 2.0
    assert ex.time_to_reach(curves, 0.8) == float("inf")


@pytest.mark.parametrize("task", ["digit-sum", "running-sum"])
def test_tiny_run_prints_a_result_line(tmp_path, task):
    """The script end to end, training its own tiny teacher on the student's task: one RESULT
    line, the plot, and the distillation run's advantage per token."""
    target = "0.05" if task == "digit-sum" else "0"  # 0: stop at the first check, for time
    teacher = f"--steps 2 --sft-target {target} " + " ".join(TINY)
    args = [*TINY, "--task", task, "--budget", "1", "--eval-every", "4", "--sft-target", target]
    args += ["--distill-flags", "--group-size 2 --minibatch 4"]  # 8 completions a batch
    args += ["--teacher-flags", teacher, "--out", str(tmp_path)]
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert sum(line.startswith("RESULT") for line in lines) == 1  # the teacher's is in its log
    match = RESULT.fullmatch(lines[-1])
    assert match, lines[-1]
    acc_grpo, acc_distill, acc_both, t_reach, budget_s, wall_s, kl_start, kl_end = map(
        float, match.groups()
    )
    assert all(0.0 <= a <= 1.0 for a in (acc_grpo, acc_distill, acc_both))
    assert budget_s == 1.0 and 0.0 < wall_s <= elapsed and kl_start > 0.0 and kl_end > 0.0
    assert t_reach == float("inf") or 0.0 <= t_reach <= 10.0

    (run_dir,) = [p for p in tmp_path.iterdir() if p.name.startswith(task.replace("-", "_"))]
    assert (run_dir / "llm_distill.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "RESULT acc_before=" in (tmp_path / "teacher" / "teacher.log").read_text()
    assert list((tmp_path / "teacher").glob(f"{task.replace('-', '_')}_seed0_*/model"))
    curves = json.loads((run_dir / "curves.json").read_text())["runs"]
    assert curves["distill"]["advantage_shape"] == curves["distill"]["tokens_shape"]
    assert curves["grpo"]["advantage_shape"] == [16, 1, 1]  # one per completion, as the reward
    assert curves["distill"]["tokens_shape"][0] == 8  # its own --distill-flags: groups of 2
    assert curves["distill"]["kl"][-1] == pytest.approx(kl_end, abs=1e-4)  # 4 decimals printed
    assert curves["distill"]["kl"][0] == pytest.approx(kl_start, abs=1e-4)
