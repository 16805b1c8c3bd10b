"""On-policy distillation as a loss over a teacher's most likely tokens (TopKDistillationLoss).

The distillation advantage (:class:`~torchrl_grpo.mcadvantage.Distillation`) reads one number
of the teacher per response token, its log-prob of the sampled token: a one-sample estimate of
the student's reverse KL at that position. This loss reads ``K`` numbers per token, the
teacher's ``K`` most likely tokens and their log-probs
(:class:`~torchrl_grpo.llm.TeacherLogProbs` with ``top_k``), and minimises the reverse KL over
those tokens and the rest of the vocabulary as one outcome
(:func:`~torchrl_grpo.loss_terms.top_k_reverse_kl`) on the student's own samples: no sampling
noise over the tokens the teacher ranks first. With a :class:`~torchrl_grpo.LeanTransformersWrapper`
student the ``K`` log-probs come from the hidden states
(:meth:`~torchrl_grpo.HiddenLLMMaskedCategorical.log_probs_at`): no ``[B, T, V]`` tensor on
either side.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from tensordict import NestedKey, TensorClass, TensorDictBase
from torchrl.objectives import LossModule

from torchrl_grpo import ragged
from torchrl_grpo.loss.inputs import MASKING_STRATEGIES, llm_masked_dist
from torchrl_grpo.loss_terms import top_k_reverse_kl

__all__ = ["TopKDistillationLoss", "TopKDistillationLossOutput"]

#: Above this sum of a position's teacher probabilities, its top-k was not scored there.
_MASS_SLACK = 1e-3


class TopKDistillationLossOutput(TensorClass["nocast"]):
    """What :class:`TopKDistillationLoss` returns: ``loss_distill`` (the term to minimise:
    ``coeff`` times the reduced KL) and, detached, ``kl_to_teacher`` (the mean per-token KL over
    the ``K + 1`` outcomes), ``teacher_top_mass`` and ``student_top_mass`` (the mean mass each
    puts on the teacher's ``K`` tokens)."""

    loss_distill: torch.Tensor
    kl_to_teacher: torch.Tensor
    teacher_top_mass: torch.Tensor
    student_top_mass: torch.Tensor

    def total_loss(self) -> torch.Tensor:
        """``loss_distill``, the one differentiable entry."""
        return self.loss_distill


class TopKDistillationLoss(LossModule):
    """The student's reverse KL to a teacher over the teacher's ``K`` most likely tokens at each
    response position, on the student's own samples (on-policy distillation as a loss, GKD's
    form with the teacher's top tokens, as verl's top-k distillation stores them).

    .. math:: \\mathcal{L} = \\mathrm{coeff} \\cdot \\frac{1}{|M|} \\sum_{(b, t) \\in M}
        \\mathrm{KL}_{K+1}\\big(\\pi_\\theta(\\cdot \\mid y_{<t}) \\,\\|\\,
        \\pi_T(\\cdot \\mid y_{<t})\\big)

    over the positions ``M`` of the masking strategy (the response), the KL over the teacher's
    ``K`` tokens and the rest of the vocabulary as one outcome
    (:func:`~torchrl_grpo.loss_terms.top_k_reverse_kl`: a lower bound of the full KL, equal to
    it at ``K = V``). Its gradient is exact over those ``K + 1`` outcomes, where the distillation
    advantage's is a one-token sample. Used alone (distillation alone) or summed with a
    :class:`~torchrl_grpo.GRPOLoss`'s terms (``loss_objective + loss_distill``: GRPO with the
    teacher; the policy then runs once per loss).

    Args:
        actor_network: the student, an LLM wrapper with ``generate=False`` (a
            :class:`~torchrl_grpo.LeanTransformersWrapper`: the ``K`` log-probs from its hidden
            states; torchrl's ``TransformersWrapper``: from its logits).

    Keyword Args:
        coeff (float): the weight of the KL, ``>= 0``. Defaults to ``1.0``.
        masking_strategy (str): the positions read, as :class:`~torchrl_grpo.GRPOLoss`'s
            (``"sft"``: the response). Defaults to ``"sft"``.
        reduction (str): ``"mean"`` over the masked tokens of the batch, ``"sum"``, or
            ``"none"`` (``[B, T]``, ``0`` off the mask). Defaults to ``"mean"``.

    Reads (``set_keys`` renames them): ``("tokens", "full")`` (``tokens``), the teacher's
    ``("next", "teacher_top_log_probs", "full")`` and ``("next", "teacher_top_ids", "full")``
    (``teacher_top_log_probs``, ``teacher_top_ids``: ``[B, T, K]`` or one ``[L_i, K]`` per row,
    in the layout of the tokens), and what the wrapper's masked distribution reads.

    Raises:
        ValueError: at construction, ``coeff`` negative or not finite, an unknown masking
            strategy or reduction. On a call: the teacher's entries missing (named), of a shape
            other than the policy's positions, or non-finite or unscored (probabilities summing
            above 1) on a position of the mask (the row named).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tokenizers import Tokenizer, models
        >>> from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
        >>> from torchrl_grpo import LeanTransformersWrapper, TopKDistillationLoss
        >>> from torchrl_grpo.llm import TeacherLogProbs
        >>> words = {f"w{i}": i for i in range(9)} | {"<pad>": 9}
        >>> tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        ...     words, unk_token="<pad>")), pad_token="<pad>")
        >>> def lm(seed):
        ...     _ = torch.manual_seed(seed)
        ...     return Qwen2ForCausalLM(Qwen2Config(vocab_size=10, hidden_size=16,
        ...         intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        ...         num_key_value_heads=2, pad_token_id=9))
        >>> kwargs = dict(tokenizer=tok, input_mode="tokens", generate=False, pad_output=True)
        >>> student = LeanTransformersWrapper(lm(0), **kwargs)
        >>> teacher = LeanTransformersWrapper(lm(1).eval(), return_log_probs=True,
        ...     log_probs_key="teacher_log_probs", **kwargs)
        >>> batch = TensorDict(tokens=TensorDict(full=torch.randint(9, (2, 6)),
        ...     prompt=torch.randint(9, (2, 3))), next=TensorDict(done=torch.ones(2, 1,
        ...     dtype=torch.bool), batch_size=[2]), masks=TensorDict(
        ...     all_attention_mask=torch.ones(2, 6, dtype=torch.bool), batch_size=[2]),
        ...     batch_size=[2])
        >>> batch = TeacherLogProbs(teacher, tokenizer=tok, top_k=3)(batch)
        >>> batch["next", "teacher_top_ids", "full"].shape
        torch.Size([2, 6, 3])
        >>> out = TopKDistillationLoss(student)(batch)
        >>> out.loss_distill.backward()
        >>> bool(out.kl_to_teacher > 0), bool(0 < out.teacher_top_mass <= 1)
        (True, True)
    """

    @dataclass
    class _AcceptedKeys:
        """The batch keys read: the tokens, the teacher's top log-probs and their token ids."""

        tokens: NestedKey = ("tokens", "full")
        teacher_top_log_probs: NestedKey = ("next", "teacher_top_log_probs", "full")
        teacher_top_ids: NestedKey = ("next", "teacher_top_ids", "full")

    default_keys = _AcceptedKeys
    tensor_keys: _AcceptedKeys

    def __init__(
        self,
        actor_network,
        *,
        coeff: float = 1.0,
        masking_strategy: str = "sft",
        reduction: str = "mean",
    ):
        if not (isinstance(coeff, int | float) and math.isfinite(coeff) and coeff >= 0):
            raise ValueError(f"coeff must be a finite number >= 0, got {coeff!r}.")
        if masking_strategy not in MASKING_STRATEGIES:
            raise ValueError(
                f"masking_strategy must be one of {MASKING_STRATEGIES}, got {masking_strategy!r}."
            )
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}.")
        super().__init__()
        self.actor_network = actor_network
        self.masking_strategy, self.reduction = masking_strategy, reduction
        self.register_buffer("coeff", torch.tensor(float(coeff)))
        self._set_in_keys()

    def _set_in_keys(self) -> None:
        keys = self.tensor_keys
        self.in_keys = [keys.tokens, keys.teacher_top_log_probs, keys.teacher_top_ids]
        self.out_keys = [f.name for f in dataclasses.fields(TopKDistillationLossOutput)]

    def _forward_value_estimator_keys(self, **kwargs) -> None:
        self._set_in_keys()

    def forward(self, tensordict: TensorDictBase) -> TopKDistillationLossOutput:
        """The loss and its metrics on a batch; see the class docstring for what it reads."""
        keys = self.tensor_keys
        dist = llm_masked_dist(self.actor_network, tensordict, self.masking_strategy)
        mask = dist.mask.bool()  # (B, T)
        teacher = _read(tensordict, keys.teacher_top_log_probs, 0.0).to(mask.device)
        ids = _read(tensordict, keys.teacher_top_ids, 0).to(mask.device)
        if teacher.shape[:2] != mask.shape or ids.shape != teacher.shape:
            raise ValueError(
                f"{keys.teacher_top_log_probs!r} {tuple(teacher.shape)} and "
                f"{keys.teacher_top_ids!r} {tuple(ids.shape)} must be [B, T, K] on the "
                f"policy's positions {tuple(mask.shape)} (masking_strategy="
                f"{self.masking_strategy!r}); score the teacher on the same tokens, in the same "
                "layout (the same pad_output) as the student."
            )
        _check_teacher(teacher, mask, keys.teacher_top_log_probs)
        if hasattr(dist, "log_probs_at"):  # LeanTransformersWrapper: from the hidden states
            student = dist.log_probs_at(ids)
        else:  # torchrl's masked categorical: from its logits
            student = dist.logits.float().log_softmax(-1).gather(-1, ids.long())
        kl = top_k_reverse_kl(student, teacher.to(student.dtype)).masked_fill(~mask, 0.0)
        count = mask.sum().clamp_min(1)
        mean_kl = kl.sum() / count

        def masked_mean(x):
            return (x.detach() * mask).sum() / count

        if self.reduction == "none":
            loss = self.coeff * kl
        else:
            loss = self.coeff * (mean_kl if self.reduction == "mean" else kl.sum())
        return TopKDistillationLossOutput(
            loss_distill=loss,
            kl_to_teacher=mean_kl.detach(),
            teacher_top_mass=masked_mean(teacher.exp().sum(-1)),
            student_top_mass=masked_mean(student.exp().sum(-1)),
            batch_size=[],
        )


def _read(tensordict: TensorDictBase, key: NestedKey, padding) -> torch.Tensor:
    """An entry as one tensor: rows of a lazy stack padded on the left, as the tokens, with a
    fixed number of operators (:func:`~torchrl_grpo.ragged.padded`)."""
    rows = tensordict.get(key, None, as_list=True)
    if rows is None:
        raise KeyError(
            f"TopKDistillationLoss needs {key!r} in the batch (TeacherLogProbs(..., top_k=K) "
            f"writes it); found keys {sorted(map(str, tensordict.keys(True, True)))}."
        )
    return rows if isinstance(rows, torch.Tensor) else ragged.padded(rows, padding, "left")


def _check_teacher(teacher: torch.Tensor, mask: torch.Tensor, key: NestedKey) -> None:
    """Refuse a teacher's top log-probs that are not finite, or not scored (their
    probabilities summing above 1), on a position of the mask: one host read."""
    finite = torch.isfinite(teacher).all(-1)
    mass = teacher.exp().sum(-1)
    bad = mask & (~finite | (mass > 1 + _MASS_SLACK))  # (B, T)
    rows = bad.any(-1).nonzero()[:, 0].tolist()
    if rows:
        row = rows[0]
        what = "not finite" if not bool(finite[row][mask[row]].all()) else "not scored"
        raise ValueError(
            f"{key!r} is {what} on a token the loss reads, in row {row} ({len(rows)} row(s)): "
            "a teacher scored where the loss reads (the response), with finite log-probs, is "
            "needed. Nothing was computed."
        )
