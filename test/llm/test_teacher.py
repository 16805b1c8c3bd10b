"""Tests of torchrl_grpo/llm/teacher.py: the teacher scored by torchrl's ``RetrieveLogProb`` on a
lean wrapper, one teacher or one per task (each row scored by its own), a teacher of another
tokenizer refused; and the path into ``MCAdvantage(distillation=...)``."""

import os

import pytest
import torch

try:
    import transformers  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs the `llm` extra (make test): without it this is a failure, not a skip
    pytest.skip("needs the llm extra: pip install -e '.[llm]'", allow_module_level=True)

from helpers.llm import llm_batch, llm_scorer, tiny_causal_lm, tiny_tokenizer
from tensordict import TensorDict, lazy_stack
from torchrl.envs.llm import RetrieveLogProb

from torchrl_grpo import MCAdvantage
from torchrl_grpo.llm import TeacherLogProbs
from torchrl_grpo.mcadvantage import Distillation

KEY = ("next", "teacher_log_probs", "full")


pytestmark = pytest.mark.usefixtures("list_to_stack")


@pytest.fixture(scope="module")
def tok(char_tokenizer):
    return char_tokenizer


def teacher(tok, seed):
    return llm_scorer(
        tiny_causal_lm(tok, seed=seed), tok, lean=True, log_probs_key="teacher_log_probs"
    )


def batch(tasks):
    """Ragged rows of token ids, each with its task and an empty ``next``."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, task in enumerate(tasks):
        full = torch.randint(0, 12, (3 + i % 3,), generator=g)
        rows.append(
            TensorDict(
                task=task,
                tokens=TensorDict(full=full, prompt=full[:2]),
                next=TensorDict(done=torch.tensor([True])),
            )
        )
    return lazy_stack(rows)


def scored(transform, data):
    with torch.no_grad():
        return transform(data.copy()).get(KEY, as_list=True)


class TestOneTeacher:
    def test_is_retrieve_log_prob_under_its_own_key(self, tok):
        wrapper, data = teacher(tok, 1), batch(["a"] * 4)
        got = scored(TeacherLogProbs(wrapper, tokenizer=tok), data)
        want = scored(
            RetrieveLogProb(wrapper, log_probs_full_key=KEY[1:], assistant_only=False), data
        )
        assert [g.shape for g in got] == [(3,), (4,), (5,), (3,)]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)

    def test_no_graph(self, tok):
        got = TeacherLogProbs(teacher(tok, 1), tokenizer=tok)(batch(["a"] * 2))
        assert not any(v.requires_grad for v in got.get(KEY, as_list=True))


class TestOneTeacherPerTask:
    @pytest.mark.parametrize("kind", ["strings", "tensors"])
    def test_each_row_by_its_tasks_teacher(self, tok, kind):
        tasks = ["math", "code", "code", "math", "code"]
        if kind == "tensors":
            tasks = [torch.tensor(0 if t == "math" else 7) for t in tasks]
        names = {"math": 0, "code": 7} if kind == "tensors" else {"math": "math", "code": "code"}
        math_teacher, code_teacher = teacher(tok, 1), teacher(tok, 2)
        transform = TeacherLogProbs(
            {names["math"]: math_teacher, names["code"]: code_teacher},
            tokenizer=tok,
            task_key="task",
        )
        data = batch(tasks)
        got = scored(transform, data)
        alone = {
            name: scored(TeacherLogProbs(w, tokenizer=tok), data)
            for name, w in (("math", math_teacher), ("code", code_teacher))
        }
        for row, task in enumerate(["math", "code", "code", "math", "code"]):
            torch.testing.assert_close(got[row], alone[task][row])
        assert not torch.equal(alone["math"][0], alone["code"][0])  # the teachers differ

    def test_a_dense_batch(self, tok):
        """Rows of one length in one ``TensorDict`` (a padded sampler's): written back as one
        stacked entry, each row its task's teacher's."""
        g = torch.Generator().manual_seed(1)
        full = torch.randint(0, 12, (4, 5), generator=g)
        data = TensorDict(
            task=torch.tensor([0, 1, 1, 0]),
            tokens=TensorDict(full=full, prompt=full[:, :2], batch_size=[4]),
            next=TensorDict(done=torch.ones(4, 1, dtype=torch.bool), batch_size=[4]),
            batch_size=[4],
        )
        teachers = {0: teacher(tok, 1), 1: teacher(tok, 2)}
        got = TeacherLogProbs(teachers, tokenizer=tok, task_key="task")(data.clone())[KEY]
        for task, wrapper in teachers.items():
            alone = TeacherLogProbs(wrapper, tokenizer=tok)(data.clone())[KEY]
            rows = data["task"] == task
            torch.testing.assert_close(got[rows], alone[rows])

    def test_a_task_without_a_teacher_is_refused_before_any_scoring(self, tok):
        transform = TeacherLogProbs({"math": teacher(tok, 1)}, tokenizer=tok, task_key="task")
        data = batch(["math", "poetry", "math"])
        with pytest.raises(KeyError, match=r"row 1 has task 'poetry'.*teachers: \['math'\]"):
            transform(data)
        assert KEY not in data.keys(True, True)

    def test_mapping_and_task_key_go_together(self, tok):
        with pytest.raises(ValueError, match="needs task_key"):
            TeacherLogProbs({"a": teacher(tok, 1)}, tokenizer=tok)
        with pytest.raises(ValueError, match="needs task_key"):
            TeacherLogProbs(teacher(tok, 1), tokenizer=tok, task_key="task")
        with pytest.raises(ValueError, match="holds no teacher"):
            TeacherLogProbs({}, tokenizer=tok, task_key="task")


class TestTokenizer:
    def test_another_vocabulary_is_refused_naming_both(self, tok):
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        vocab = {c: i for i, c in enumerate("0123456789 =x")}
        other = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="x")),
            name_or_path="teacher-tokenizer",
        )
        wrapper = teacher(tok, 1)
        wrapper.tokenizer = other
        with pytest.raises(
            ValueError,
            match=r"'math''s tokenizer 'teacher-tokenizer' \(13 tokens\) "
            r"differs from the student's '' \(14 tokens\).*'<eos>'.*out of scope",
        ):
            TeacherLogProbs({"math": wrapper}, tokenizer=tok, task_key="task")

    def test_another_special_token_is_refused(self, tok):
        other = tiny_tokenizer()
        other.eos_token = "="
        with pytest.raises(ValueError, match="eos_token_id"):
            TeacherLogProbs(teacher(tok, 1), tokenizer=other)

    def test_a_model_without_every_token_is_refused(self, tok):
        wrapper = teacher(tok, 1)
        wrapper.model.config.vocab_size = 5
        with pytest.raises(ValueError, match="its model has 5 outputs for 14 token ids"):
            TeacherLogProbs(wrapper, tokenizer=tok)


def test_into_the_transform(tok):
    """Scored rows of torchrl's sampler go through ``MCAdvantage(distillation=...)``: each
    response token's advantage is ``-beta (log pi_old - log pi_T)``."""
    student = tiny_causal_lm(tok, seed=3)
    data = llm_batch(student, tok, ["1 2=", "3 4 5=", "6="], seed=1)
    data = TeacherLogProbs(teacher(tok, 4), tokenizer=tok)(data)
    for row, query in zip(data.tensordicts, ("a", "b", "c"), strict=True):
        row.set("query", query)
        row.set(("next", "done"), torch.tensor([True]))
    distillation = Distillation(alpha=0.0, beta=0.5, log_prob_key=("log_probs", "full"))
    out = MCAdvantage(1, rewards_key=None, distillation=distillation).inv(data)
    rows = zip(
        out.get("advantage", as_list=True),
        out.get(("log_probs", "full"), as_list=True),
        out.get(KEY, as_list=True),
        out.get(("tokens", "prompt"), as_list=True),
        strict=True,
    )
    for adv, old, taught, prompt in rows:
        start = prompt.numel()
        torch.testing.assert_close(adv[start:], -0.5 * (old[start:] - taught[start:]))
        assert (adv[:start] == 0).all()
