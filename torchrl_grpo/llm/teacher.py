"""The teacher of on-policy distillation: a scorer of the student's own tokens, one per task.

:class:`TeacherLogProbs` runs torchrl's ``RetrieveLogProb`` on a teacher wrapper
(:class:`~torchrl_grpo.LeanTransformersWrapper` with ``generate=False``: no logits, each shared
prompt once) and writes the log-probs of every token of ``("tokens", "full")`` under their own
key, ``("next", "teacher_log_probs", "full")``, which ``MCAdvantage(estimator=Distillation(...))``
and torchrl's ``DistillationLoss`` read. With a mapping from a task to a teacher (multi-teacher
on-policy distillation, MOPD), each row is scored by its task's teacher.

A teacher must read the student's tokens as the student does: its tokenizer must have the
student's vocabulary and special tokens, and its model an output for every token id. Another
tokenizer is refused, naming both: cross-tokenizer distillation (aligning two tokenizations) is
out of scope.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from tensordict import LazyStackedTensorDict, NestedKey, TensorDictBase, lazy_stack
from torchrl.envs.transforms import Transform

__all__ = [
    "TEACHER_LOG_PROBS",
    "TEACHER_TOP_IDS",
    "TEACHER_TOP_LOG_PROBS",
    "TeacherLogProbs",
    "check_same_tokenizer",
]

#: Where :class:`TeacherLogProbs` writes, under ``"next"`` (torchrl's ``DistillationLoss`` and
#: :class:`~torchrl_grpo.mcadvantage.Distillation` read ``("next", *TEACHER_LOG_PROBS)``).
TEACHER_LOG_PROBS = ("teacher_log_probs", "full")
#: Where ``TeacherLogProbs(top_k=K)`` writes, under ``"next"``: the teacher's ``K`` most likely
#: tokens at each position and their log-probs (:class:`~torchrl_grpo.TopKDistillationLoss`).
TEACHER_TOP_LOG_PROBS = ("teacher_top_log_probs", "full")
TEACHER_TOP_IDS = ("teacher_top_ids", "full")


class TeacherLogProbs(Transform):
    """Score a batch's tokens with a teacher, or with each row's task's teacher.

    Use it where the reference policy is scored: in the collector's post-processing (or the
    sampler's side of an asynchronous run), after the rewards and before the replay buffer's
    ``MCAdvantage(estimator=Distillation(...))``, under ``torch.no_grad`` (it sets it itself).

    Args:
        teacher: an LLM wrapper with ``generate=False`` and ``return_log_probs=True`` (a
            :class:`~torchrl_grpo.LeanTransformersWrapper` or torchrl's
            ``TransformersWrapper``, ``input_mode="tokens"``), or a mapping ``{task: wrapper}``.

    Keyword Args:
        tokenizer: the student's tokenizer; every teacher's must have its vocabulary and special
            tokens (:func:`check_same_tokenizer`).
        task_key: with a mapping, the key of each row's task (a string, or a tensor of one
            value); rows whose task has no teacher are refused before any is scored.
        log_probs_key: written under ``"next"``. Defaults to :data:`TEACHER_LOG_PROBS`.
        top_k (int, optional): also write the teacher's ``top_k`` most likely tokens at each
            position and their log-probs, under ``"next"``: :data:`TEACHER_TOP_LOG_PROBS` and
            :data:`TEACHER_TOP_IDS` (``[B, T, top_k]``, or one ``[L_i, top_k]`` per row, in the
            layout of the log-probs), what :class:`~torchrl_grpo.TopKDistillationLoss` reads.
            Needs :class:`~torchrl_grpo.LeanTransformersWrapper` teachers (chunk by chunk, no
            logits). Defaults to ``None``: the sampled tokens' log-probs only.
        **kwargs: passed to each ``RetrieveLogProb`` (``assistant_only`` defaults to
            ``False``: every token of ``("tokens", "full")`` is scored).

    Raises:
        ValueError: a teacher whose tokenizer or vocabulary is not the student's (both named),
            a mapping without ``task_key`` or a ``task_key`` without a mapping, no teacher,
            ``top_k`` not a positive integer or with a teacher that is not a
            ``LeanTransformersWrapper``.
        KeyError: on a call, a row whose task has no teacher (the task and the row named).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> from torchrl_grpo import LeanTransformersWrapper
        >>> from torchrl_grpo.llm import TeacherLogProbs
        >>> from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
        >>> from tokenizers import Tokenizer, models
        >>> vocab = {c: i for i, c in enumerate("abc")} | {"<eos>": 3, "<pad>": 4}
        >>> tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        ...     vocab, unk_token="<pad>")), eos_token="<eos>", pad_token="<pad>")
        >>> _ = torch.manual_seed(0)
        >>> def teacher():
        ...     model = GPT2LMHeadModel(GPT2Config(vocab_size=5, n_embd=8, n_layer=1, n_head=1))
        ...     return LeanTransformersWrapper(model.eval(), tokenizer=tok, input_mode="tokens",
        ...         generate=False, return_log_probs=True, log_probs_key="teacher_log_probs")
        >>> scorer = TeacherLogProbs({"math": teacher(), "code": teacher()}, tokenizer=tok,
        ...                          task_key="task")
        >>> rows = lazy_stack([TensorDict(task=t, tokens=TensorDict(full=torch.tensor(ids)),
        ...     next=TensorDict(done=torch.tensor([True])))
        ...     for t, ids in (("math", [0, 1, 2]), ("code", [2, 1]))])
        >>> [tuple(v.shape) for v in scorer(rows).get(
        ...     ("next", "teacher_log_probs", "full"), as_list=True)]
        [(3,), (2,)]
    """

    def __init__(
        self,
        teacher,
        *,
        tokenizer,
        task_key: NestedKey | None = None,
        log_probs_key: NestedKey = TEACHER_LOG_PROBS,
        top_k: int | None = None,
        **kwargs,
    ):
        several = isinstance(teacher, Mapping)
        if several != (task_key is not None):
            raise ValueError(
                "TeacherLogProbs: a mapping {task: teacher} needs task_key (the key of each "
                "row's task), and task_key needs a mapping."
            )
        teachers = dict(teacher) if several else {None: teacher}
        if not teachers:
            raise ValueError("TeacherLogProbs: the mapping holds no teacher.")
        for task, wrapper in teachers.items():
            check_same_tokenizer(wrapper, tokenizer, "the teacher" if task is None else repr(task))
        kwargs.setdefault("assistant_only", False)
        _check_top_k(top_k, teachers, kwargs)
        # imported here: importing the package leaves torchrl's LLM envs (and their imports) out
        from torchrl.envs.llm import RetrieveLogProb

        key = (log_probs_key,) if isinstance(log_probs_key, str) else tuple(log_probs_key)
        scorers = {
            task: RetrieveLogProb(wrapper, log_probs_full_key=key, **kwargs)
            for task, wrapper in teachers.items()
        }
        super().__init__(in_keys=list(scorers[next(iter(scorers))].in_keys), out_keys=[key])
        self.scorers = torch.nn.ModuleList(scorers.values())
        self.tasks = list(scorers)
        self.task_key = task_key
        self.written = ("next", *key)
        self.top_k = top_k
        if top_k is not None:
            self.out_keys += [TEACHER_TOP_LOG_PROBS, TEACHER_TOP_IDS]

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        with torch.no_grad():
            if self.task_key is None:
                return self._score(self.scorers[0], tensordict)
            return self._by_task(tensordict)

    def _score(self, scorer, tensordict: TensorDictBase) -> TensorDictBase:
        """One teacher's scores: ``RetrieveLogProb``'s, or with ``top_k`` the token log-probs
        and the top tokens from one pass of the lean wrapper, written where ``RetrieveLogProb``
        writes (under ``"next"`` where the batch has it)."""
        if self.top_k is None:
            return scorer(tensordict)
        found = scorer.model.top_log_probs(tensordict, self.top_k)
        root = ("next",) if "next" in tensordict.keys() else ()
        keys = (self.written[1:], TEACHER_TOP_LOG_PROBS, TEACHER_TOP_IDS)
        for key, value in zip(keys, found, strict=True):
            if isinstance(value, list):
                _write_rows(tensordict, (*root, *key), value)
            else:
                tensordict.set((*root, *key), value)
        return tensordict

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self.forward(tensordict)  # appended to a buffer: scored on the way in

    def _by_task(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Each task's rows scored by its teacher, written back in the rows' order."""
        tasks = _tasks(tensordict, self.task_key)
        index = {task: i for i, task in enumerate(self.tasks)}
        missing = [(row, task) for row, task in enumerate(tasks) if task not in index]
        if missing:
            row, task = missing[0]
            raise KeyError(
                f"TeacherLogProbs: row {row} has task {task!r} under {self.task_key!r}, which has "
                f"no teacher (teachers: {self.tasks}); {len(missing)} row(s) without one. "
                "Nothing was scored."
            )
        rows = list(tensordict.unbind(0)) if tensordict.batch_dims else [tensordict]
        # RetrieveLogProb writes under "next" where the batch has it, at the root otherwise
        written = self.written if "next" in tensordict.keys() else self.written[1:]
        by_task: dict = {}  # each task's rows, the tasks in order of first appearance
        for row, task in enumerate(tasks):
            by_task.setdefault(task, []).append(row)
        entries = [written]
        if self.top_k is not None:  # where _score writes them
            root = ("next",) if "next" in tensordict.keys() else ()
            entries += [(*root, *TEACHER_TOP_LOG_PROBS), (*root, *TEACHER_TOP_IDS)]
        scored = {entry: [None] * len(rows) for entry in entries}
        for task, members in by_task.items():  # each teacher once
            part = lazy_stack([rows[row].copy() for row in members])
            part = self._score(self.scorers[index[task]], part)
            for entry in entries:
                for row, value in zip(members, part.get(entry, as_list=True), strict=True):
                    scored[entry][row] = value
        for entry in entries:
            tensordict = _write_rows(tensordict, entry, scored[entry])
        return tensordict


def _check_top_k(top_k, teachers: dict, kwargs: dict) -> None:
    if top_k is None:
        return
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"TeacherLogProbs: top_k must be a positive integer, got {top_k!r}.")
    if kwargs != {"assistant_only": False}:
        raise ValueError(
            f"TeacherLogProbs: top_k={top_k} scores every token of ('tokens', 'full') in one "
            f"pass of the lean wrapper, without RetrieveLogProb's options; got {kwargs}."
        )
    for task, wrapper in teachers.items():
        if not callable(getattr(wrapper, "top_log_probs", None)):
            name = "the teacher" if task is None else f"the teacher of {task!r}"
            raise ValueError(
                f"TeacherLogProbs: top_k={top_k} needs a LeanTransformersWrapper teacher (its "
                f"top tokens chunk by chunk, without the logits); {name} is a "
                f"{type(wrapper).__name__}."
            )


def _tasks(tensordict: TensorDictBase, key) -> list:
    """Each row's task, as a hashable value (a string, a number, or a tuple of numbers)."""
    value = tensordict.get(key, None)
    if value is None:
        raise KeyError(f"TeacherLogProbs: the task key {key!r} is missing from the batch.")
    if isinstance(value, torch.Tensor):
        rows = value.reshape(value.shape[0], -1).tolist() if tensordict.batch_dims else [value]
        return [row[0] if len(row) == 1 else tuple(row) for row in rows]
    values = value.tolist() if hasattr(value, "tolist") else value
    return values if isinstance(values, list) else [values] * max(tensordict.numel(), 1)


def _write_rows(tensordict: TensorDictBase, key, rows: list) -> TensorDictBase:
    """Set ``key`` of each row to its value: row by row in a lazy stack (rows may differ in
    length), as one stacked tensor otherwise."""
    if isinstance(tensordict, LazyStackedTensorDict) and tensordict.stack_dim == 0:
        for row, value in zip(tensordict.tensordicts, rows, strict=True):
            row.set(key, value)
        return tensordict
    if not tensordict.batch_dims:
        return tensordict.set(key, rows[0])
    return tensordict.set(key, torch.stack(rows))


def check_same_tokenizer(teacher, tokenizer, name: str = "the teacher") -> None:
    """Refuse a teacher wrapper that would not read the student's tokens as the student does.

    Its tokenizer must have the student's vocabulary (every token and id) and end-of-sequence
    and padding ids, and its model (where it says) an output for every id.

    Raises:
        ValueError: naming both tokenizers and the first difference.

    Examples:
        >>> from types import SimpleNamespace
        >>> from transformers import PreTrainedTokenizerFast
        >>> from tokenizers import Tokenizer, models
        >>> from torchrl_grpo.llm.teacher import check_same_tokenizer
        >>> def tok(chars):
        ...     return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        ...         {c: i for i, c in enumerate(chars)}, unk_token=chars[0])))
        >>> check_same_tokenizer(SimpleNamespace(tokenizer=tok("ab"), model=None), tok("abc"))
        Traceback (most recent call last):
        ...
        ValueError: the teacher's tokenizer '' (2 tokens) differs from the student's '' (3 \
tokens): token 'c' (id 2) is the student's only. Cross-tokenizer distillation is out of scope: \
the teacher must share the student's tokenizer.
    """
    theirs = getattr(teacher, "tokenizer", None)
    if theirs is None:
        raise ValueError(f"{name} has no tokenizer to compare with the student's.")
    difference = _difference(theirs, tokenizer)
    if difference is None:
        size = getattr(getattr(getattr(teacher, "model", None), "config", None), "vocab_size", None)
        if isinstance(size, int) and size < len(tokenizer):
            difference = f"its model has {size} outputs for {len(tokenizer)} token ids"
    if difference is not None:
        raise ValueError(
            f"{name}'s tokenizer {_describe(theirs)} differs from the student's "
            f"{_describe(tokenizer)}: {difference}. Cross-tokenizer distillation is out of "
            "scope: the teacher must share the student's tokenizer."
        )


def _difference(theirs, ours) -> str | None:
    """The first difference between two tokenizers' vocabularies and special ids, or ``None``."""
    if theirs is ours:
        return None
    mine, other = ours.get_vocab(), theirs.get_vocab()
    for token, i in sorted(mine.items(), key=lambda item: item[1]):
        if other.get(token) != i:
            where = "the student's only" if token not in other else f"id {other[token]} there"
            return f"token {token!r} (id {i}) is {where}"
    extra = sorted(set(other) - set(mine), key=other.get)
    if extra:
        return f"token {extra[0]!r} (id {other[extra[0]]}) is the teacher's only"
    for special in ("eos_token_id", "pad_token_id"):
        if getattr(theirs, special, None) != getattr(ours, special, None):
            return f"{special} {getattr(theirs, special, None)} against the student's " + str(
                getattr(ours, special, None)
            )
    return None


def _describe(tokenizer) -> str:
    return f"{getattr(tokenizer, 'name_or_path', '')!r} ({len(tokenizer)} tokens)"
