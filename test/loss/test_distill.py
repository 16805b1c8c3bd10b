"""Tests of torchrl_grpo/loss/distill.py: ``TopKDistillationLoss``, the student's reverse KL over a
teacher's most likely tokens (``TeacherLogProbs(top_k=K)``), against a transcription from both
models' full logits, on ragged and padded batches, lean and torchrl students; its refusals."""

import os

import pytest
import torch

try:
    import transformers  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs the `llm` extra (make test): without it this is a failure, not a skip
    pytest.skip("needs the llm extra: pip install -e '.[llm]'", allow_module_level=True)

from helpers.llm import llm_scorer, tiny_causal_lm
from tensordict import TensorDict, lazy_stack

from torchrl_grpo import TopKDistillationLoss
from torchrl_grpo.llm import TeacherLogProbs

IDS, TOP = ("next", "teacher_top_ids", "full"), ("next", "teacher_top_log_probs", "full")
PROMPT = 2


pytestmark = pytest.mark.usefixtures("list_to_stack")


@pytest.fixture(scope="module")
def tok(char_tokenizer):
    return char_tokenizer


def token_rows(n=4):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 12, (4 + i % 3,), generator=g) for i in range(n)]


def ragged(rows):
    """A lazy stack of rows, each its prompt (the first two tokens) and completion."""
    return lazy_stack(
        [
            TensorDict(
                tokens=TensorDict(full=full, prompt=full[:PROMPT]),
                next=TensorDict(done=torch.tensor([True])),
                masks=TensorDict(all_attention_mask=torch.ones(len(full), dtype=torch.bool)),
            )
            for full in rows
        ]
    )


def padded(rows, pad):
    """The same rows right-padded into ``[B, T]``, as a sampler with ``pad_output=True``."""
    width = max(len(r) for r in rows)
    full = torch.full((len(rows), width), pad)
    attention = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        full[i, : len(r)], attention[i, : len(r)] = r, True
    return TensorDict(
        tokens=TensorDict(full=full, prompt=full[:, :PROMPT], batch_size=[len(rows)]),
        masks=TensorDict(all_attention_mask=attention, batch_size=[len(rows)]),
        next=TensorDict(done=torch.ones(len(rows), 1, dtype=torch.bool), batch_size=[len(rows)]),
        batch_size=[len(rows)],
    )


def transcribed(student, teacher, rows, k):
    """The mean over the completions' tokens of the KL over the teacher's ``k`` most likely
    tokens and the rest, written out from both models' full logits, position by position."""
    terms = []
    for full in rows:
        p_all = student(full[None]).logits[0].double().log_softmax(-1)
        with torch.no_grad():
            q_all = teacher(full[None]).logits[0].double().log_softmax(-1)
        for t in range(PROMPT, len(full)):  # token t is drawn from the output at t - 1
            top = q_all[t - 1].topk(k).indices
            p, q = p_all[t - 1][top].exp(), q_all[t - 1][top].exp()
            rest_p, rest_q = 1 - p.sum(), 1 - q.sum()
            terms.append((p * (p / q).log()).sum() + rest_p * (rest_p / rest_q).log())
    return torch.stack(terms).mean()


def models(tok):
    return tiny_causal_lm(tok, seed=0), tiny_causal_lm(tok, seed=1)


def scored(tok, teacher_model, batch, k, pad_output):
    teacher = llm_scorer(
        teacher_model, tok, lean=True, pad_output=pad_output, log_probs_key="teacher_log_probs"
    )
    return TeacherLogProbs(teacher, tokenizer=tok, top_k=k)(batch)


@pytest.mark.parametrize("pad_output", [False, True])
@pytest.mark.parametrize("lean", [True, False])
def test_loss_and_gradient_are_the_transcribed_top_k_kl(tok, pad_output, lean):
    student_model, teacher_model = models(tok)
    rows = token_rows()
    batch = ragged(rows) if not pad_output else padded(rows, tok.pad_token_id)
    batch = scored(tok, teacher_model, batch, 3, pad_output)
    student = llm_scorer(student_model, tok, lean=lean, pad_output=pad_output)
    out = TopKDistillationLoss(student)(batch)
    out.loss_distill.backward()
    ours = [p.grad.clone() for p in student_model.parameters()]
    student_model.zero_grad()
    theirs = transcribed(student_model, teacher_model, rows, 3)
    theirs.backward()
    torch.testing.assert_close(out.loss_distill.double(), theirs.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.kl_to_teacher, out.loss_distill.detach())
    for a, p in zip(ours, student_model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad.float(), rtol=1e-3, atol=1e-6)


def test_the_whole_vocabulary_is_the_exact_reverse_kl(tok):
    student_model, teacher_model = models(tok)
    rows = token_rows()
    batch = scored(tok, teacher_model, ragged(rows), len(tok), False)
    out = TopKDistillationLoss(llm_scorer(student_model, tok, lean=True))(batch)
    exact = []
    with torch.no_grad():
        for full in rows:
            p = student_model(full[None]).logits[0].double().log_softmax(-1)
            q = teacher_model(full[None]).logits[0].double().log_softmax(-1)
            exact.append((p.exp() * (p - q)).sum(-1)[PROMPT - 1 : len(full) - 1])
    torch.testing.assert_close(
        out.kl_to_teacher.double(), torch.cat(exact).mean(), atol=1e-6, rtol=1e-4
    )
    torch.testing.assert_close(out.teacher_top_mass, torch.tensor(1.0))


def test_fewer_tokens_bound_the_kl_from_below_and_the_reductions_agree(tok):
    student_model, teacher_model = models(tok)
    rows = token_rows()
    kls = []
    for k in (1, 3, len(tok)):
        batch = scored(tok, teacher_model, ragged(rows), k, False)
        student = llm_scorer(student_model, tok, lean=True)
        kls.append(float(TopKDistillationLoss(student)(batch).kl_to_teacher))
    assert kls[0] <= kls[1] <= kls[2] and kls[0] < kls[2]
    none = TopKDistillationLoss(student, reduction="none", coeff=2.0)(batch).loss_distill
    summed = TopKDistillationLoss(student, reduction="sum", coeff=2.0)(batch).loss_distill
    tokens = sum(len(r) - PROMPT for r in rows)
    torch.testing.assert_close(none.sum(), summed)
    torch.testing.assert_close(summed / tokens / 2, torch.tensor(kls[2]), rtol=1e-5, atol=1e-7)


def test_each_task_has_its_own_teachers_top_tokens(tok):
    rows = token_rows()
    batch = ragged(rows)
    batch.set("task", ["a", "b", "a", "b"])
    models_ = {"a": tiny_causal_lm(tok, seed=1), "b": tiny_causal_lm(tok, seed=2)}
    teachers = {
        task: llm_scorer(m, tok, lean=True, log_probs_key="teacher_log_probs")
        for task, m in models_.items()
    }
    scorer = TeacherLogProbs(
        teachers, tokenizer=tok, task_key="task", top_k=2, log_probs_key="teacher_lp"
    )  # a key of one name: the top tokens still go under "next", as the log-probs
    batch = scorer(batch)
    for row, (task, full) in enumerate(zip("abab", rows, strict=True)):
        with torch.no_grad():
            q = models_[task](full[None]).logits[0].log_softmax(-1)[:-1].topk(2, -1)
        torch.testing.assert_close(batch[row].get(TOP)[1:], q.values)
        assert torch.equal(batch[row].get(IDS)[1:], q.indices)
        assert not batch[row].get(TOP)[0].any()  # the first token: no prediction
    assert batch[0].get(("next", "teacher_lp")).shape == rows[0].shape


@pytest.mark.parametrize("pad_output", [False, True])
def test_one_pass_writes_what_retrieve_log_prob_writes(tok, pad_output):
    """With ``top_k`` the teacher's token log-probs come from the pass that finds its top
    tokens: the entry ``RetrieveLogProb`` writes without ``top_k``, in its layout."""
    _, teacher_model = models(tok)
    rows = token_rows()
    batch = ragged(rows) if not pad_output else padded(rows, tok.pad_token_id)
    key = ("next", "teacher_log_probs", "full")
    with_top = scored(tok, teacher_model, batch.clone(), 2, pad_output)
    teacher = llm_scorer(
        teacher_model, tok, lean=True, pad_output=pad_output, log_probs_key="teacher_log_probs"
    )
    alone = TeacherLogProbs(teacher, tokenizer=tok)(batch.clone())
    for a, b in zip(with_top.get(key, as_list=True), alone.get(key, as_list=True), strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="without RetrieveLogProb's options"):
        TeacherLogProbs(teacher, tokenizer=tok, top_k=2, assistant_only=True)


def test_refusals_name_the_problem(tok):
    student_model, teacher_model = models(tok)
    student = llm_scorer(student_model, tok, lean=True)
    batch = scored(tok, teacher_model, ragged(token_rows()), 3, False)
    with pytest.raises(KeyError, match="teacher_top_ids"):
        TopKDistillationLoss(student)(batch.exclude(IDS))
    broken = batch.clone()
    broken[2].get(TOP)[3, 1] = float("nan")
    with pytest.raises(ValueError, match="not finite .* row 2"):
        TopKDistillationLoss(student)(broken)
    unscored = batch.clone()
    unscored[1].get(TOP)[2:] = 0.0
    with pytest.raises(ValueError, match="not scored .* row 1"):
        TopKDistillationLoss(student)(unscored)
    short = batch.clone()
    for row in short.tensordicts:
        row.set(IDS, row.get(IDS)[:, :2])
    with pytest.raises(ValueError, match="must be \\[B, T, K\\]"):
        TopKDistillationLoss(student)(short)
    for bad in (dict(coeff=-1.0), dict(coeff=float("inf")), dict(reduction="max")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TopKDistillationLoss(student, **bad)
    with pytest.raises(ValueError, match="masking_strategy"):
        TopKDistillationLoss(student, masking_strategy="everything")


def test_set_keys_renames_what_it_reads(tok):
    student_model, teacher_model = models(tok)
    batch = scored(tok, teacher_model, ragged(token_rows()), 3, False)
    loss = TopKDistillationLoss(llm_scorer(student_model, tok, lean=True))
    expected = loss(batch).loss_distill
    renamed = batch.clone()
    for row in renamed.tensordicts:
        row.set("top_ids", row.get(IDS))
    loss.set_keys(teacher_top_ids="top_ids")
    assert "top_ids" in loss.in_keys and IDS not in loss.in_keys
    torch.testing.assert_close(loss(renamed.exclude(IDS)).loss_distill, expected)


def test_teacher_top_k_refusals(tok):
    _, teacher_model = models(tok)
    plain = llm_scorer(teacher_model, tok, log_probs_key="teacher_log_probs")
    with pytest.raises(ValueError, match="LeanTransformersWrapper teacher .* TransformersWrapper"):
        TeacherLogProbs(plain, tokenizer=tok, top_k=2)
    lean = llm_scorer(teacher_model, tok, lean=True, log_probs_key="teacher_log_probs")
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="top_k must be a positive integer"):
            TeacherLogProbs(lean, tokenizer=tok, top_k=bad)
    with pytest.raises(ValueError, match="k must be an integer in \\[1, "):
        TeacherLogProbs(lean, tokenizer=tok, top_k=len(tok) + 1)(ragged(token_rows()))
