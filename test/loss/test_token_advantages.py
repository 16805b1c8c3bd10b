"""GRPOLoss on a per-token advantage ``[B, T]`` (on-policy distillation's), and beside it
torchrl's supervised ``DistillationLoss``.

1. Every objective (clip, GSPO's sequence ratio, CISPO, SAPO, VESPO) under every aggregation
   gives, on a per-token advantage, the value and the gradient of the reference written out
   here (per-token surrogate, then the aggregation, from their definitions).
2. On an LLM batch, the per-token advantage ``MCAdvantage(distillation=...)`` writes is read on
   each row's own tokens.
3. torchrl's ``DistillationLoss`` (``kl_direction="reverse"``, k3 per token): GRPOLoss's
   ``KLToReference`` with the teacher's log-probs as the reference gives its value and gradient
   exactly (``seq_mean_token_mean`` for ``normalize_by_seq_length=True``, ``token_sum`` for
   ``False`` with ``reduction="sum"``); the advantage form differs, and the gradients of both are
   checked against their written-out forms: per response token, ``(log pi - log pi_T) grad log
   pi`` here, ``(1 - pi_T / pi) grad log pi`` there (equal to first order in the log-ratio).
"""

import math
import os

import pytest
import torch

try:
    import transformers  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs the `llm` extra (make test): without it this is a failure, not a skip
    pytest.skip("needs the llm extra: pip install -e '.[llm]'", allow_module_level=True)

import tensordict
from helpers.llm import llm_scorer, tiny_qwen2, tiny_tokenizer
from helpers.loss import response_mask, token_batch, token_policy
from tensordict import TensorDict, lazy_stack
from torchrl.objectives.llm import DistillationLoss

from torchrl_grpo import GRPOLoss, MCAdvantage
from torchrl_grpo.loss.variants import (
    TIS,
    Clip,
    Decoupled,
    InferenceCorrection,
    InferenceVeto,
    KLMask,
    KLToInference,
    KLToReference,
    OffPolicyMask,
    Rejection,
    TopEntropy,
    TrustRegion,
)
from torchrl_grpo.loss_terms import kl_k3
from torchrl_grpo.mcadvantage import Distillation

EPS, MAX_LENGTH = 0.2, 8
TEACHER = ("next", "teacher_log_probs", "full")


def per_token_batch(policy, seed=4):
    """A ragged token batch (an empty-free mask), its policy log-probs with grad, and an
    advantage of its own at every token, of both signs."""
    batch = token_batch(b=6, t=6, seed=seed, drift=0.3)
    logits = policy.module[0](batch.copy())["logits"]
    log_prob = torch.distributions.Categorical(logits=logits).log_prob(batch["tokens"])
    g = torch.Generator().manual_seed(seed)
    batch["tokens_log_prob"] = log_prob.detach() + 0.3 * torch.randn(log_prob.shape, generator=g)
    batch["advantage"] = torch.randn(log_prob.shape, generator=g)
    return batch, log_prob


def log_ratio(log_prob, old, mask, level):
    """Per token, or the sequence's (GSPO's mean, VESPO's sum) on each of its tokens."""
    lr = log_prob - old
    if level == "token":
        return lr
    total = torch.where(mask, lr, 0.0).sum(-1, keepdim=True)
    if level == "sequence":  # GSPO: the mean, its gradient to every token of the sequence
        return (total / mask.sum(-1, keepdim=True).clamp_min(1)).expand_as(lr)
    return total.expand_as(lr)


def surrogate(name, lr, adv, log_prob):
    """The per-token losses, from the papers' definitions."""
    ratio = lr.exp()
    if name == "clip":
        clipped = lr.clamp(math.log(1 - EPS), math.log(1 + EPS)).exp()
        return -torch.minimum(ratio * adv, clipped * adv)
    if name == "cispo":
        weight = ratio.detach().clamp(1 - EPS, 1 + EPS)
        return -weight * adv * log_prob
    if name == "sapo":
        tau = torch.where(adv > 0, 1.0, 1.05)
        return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv
    # VESPO: phi(W) = W^k e^{lambda (1 - W)}, (k, lambda) by the sign of each token's A
    w = lr.detach().clamp(math.log(1e-8), 20.0).exp()
    k = torch.where(adv >= 0, 2.0, 3.0)
    lam = torch.where(adv >= 0, 3.0, 2.0)
    return -(w**k * torch.exp(lam * (1 - w))) * adv * log_prob


def aggregate(name, loss, mask):
    """The aggregations, from their definitions (rows without a token left out)."""
    rows = mask.any(-1)
    seq_sum = torch.where(mask, loss, 0.0).sum(-1)
    if name == "token_mean":
        return seq_sum.sum() / mask.sum()
    if name == "seq_mean_token_mean":
        return (seq_sum[rows] / mask.sum(-1)[rows]).mean()
    if name == "seq_mean_token_sum":
        return seq_sum[rows].mean()
    if name == "seq_mean_token_sum_norm":
        return seq_sum[rows].mean() / MAX_LENGTH
    return seq_sum.sum()  # token_sum


OBJECTIVES = [
    ("clip", "token"),
    ("clip", "sequence"),
    ("cispo", "token"),
    ("sapo", "token"),
    ("vespo", "sequence_sum"),
]
AGGREGATIONS = [
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "token_sum",
]


@pytest.mark.parametrize("objective, level", OBJECTIVES)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_every_objective_and_aggregation_on_a_per_token_advantage(objective, level, aggregation):
    policy = token_policy()
    batch, log_prob = per_token_batch(policy)
    kw = {"max_length": MAX_LENGTH} if aggregation == "seq_mean_token_sum_norm" else {}
    loss = GRPOLoss(
        policy,
        clip_epsilon=EPS,
        objective=objective,
        ratio_level=level,
        aggregation=aggregation,
        **kw,
    )
    mask = batch["mask"]
    lr = log_ratio(log_prob, batch["tokens_log_prob"], mask, level)
    want = aggregate(aggregation, surrogate(objective, lr, batch["advantage"], log_prob), mask)
    got = loss(batch).loss_objective
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    params = list(policy.parameters())
    for a, b in zip(
        torch.autograd.grad(got, params, retain_graph=True),
        torch.autograd.grad(want, params),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def check_against(loss, batch, log_prob, want, key="loss_objective"):
    got = loss(batch)[key]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    params = list(loss.actor_network.parameters())
    for a, b in zip(
        torch.autograd.grad(got, params, retain_graph=True),
        torch.autograd.grad(want, params),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["dual_clip", "off_policy_mask", "dppo_tv"])
def test_the_variants_that_read_the_advantage_read_it_per_token(variant):
    """The dual clip, OPSM and DPPO's trust region take each token's advantage's sign."""
    policy = token_policy()
    batch, log_prob = per_token_batch(policy, seed=6)
    adv, mask, old = batch["advantage"], batch["mask"], batch["tokens_log_prob"]
    lr = log_prob - old
    loss = surrogate("clip", lr, adv, log_prob)  # (B, T)
    if variant == "dual_clip":
        grpo = GRPOLoss(policy, clip_epsilon=EPS, objective=Clip(clip_ratio_c=1.1))
        loss = torch.where(adv < 0, torch.minimum(loss, -1.1 * adv), loss)
    elif variant == "off_policy_mask":
        grpo = GRPOLoss(policy, clip_epsilon=EPS, corrections=[OffPolicyMask(0.05)])
        drift = torch.where(mask, batch["inference_log_prob"] - log_prob.detach(), 0.0)
        seq_kl = drift.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
        loss = torch.where((adv >= 0) | (seq_kl <= 0.05), loss, 0.0)
    else:
        grpo = GRPOLoss(policy, clip_epsilon=EPS, corrections=[TrustRegion("dppo_tv", 0.05)])
        moved = (log_prob.exp() - old.exp()).detach()
        loss = torch.where(torch.where(adv > 0, moved <= 0.05, moved >= -0.05), loss, 0.0)
    check_against(grpo, batch, log_prob, aggregate("token_mean", loss, mask))


@pytest.mark.parametrize(
    "variant",
    [
        Clip(clip_ratio_c=3.0),
        Clip(delta=4.0),
        KLMask(0.05),
        InferenceVeto(1.0),
        Rejection("token_k1,seq_max_k2", "0.4_1.8,3.0"),
        Decoupled(behaviour_weight_cap=5.0),
        InferenceCorrection("token_mask", (0.5, 5.0)),
        TIS(2.0),
        OffPolicyMask(0.5),
        TrustRegion("dppo_kl"),
        TopEntropy(0.5),
        KLToReference(0.1),
        KLToInference(0.1),
    ],
    ids=lambda v: type(v).__name__,
)
def test_every_variant_takes_a_per_token_advantage(variant):
    """A sequence's advantage given on each of its tokens: the same terms as given once."""
    policy = token_policy()
    batch, _ = per_token_batch(policy, seed=7)
    batch["proximal_log_prob"] = batch["inference_log_prob"]
    batch["advantage"] = batch["advantage"][:, :1]  # (B, 1)
    where = (
        "objective"
        if isinstance(variant, Clip)
        else ("penalties" if isinstance(variant, (KLToReference, KLToInference)) else "corrections")
    )
    loss = GRPOLoss(policy, **{where: variant if where == "objective" else [variant]})
    per_token = batch.clone()
    per_token["advantage"] = batch["advantage"].expand(-1, 6).clone()
    want, got = loss(batch), loss(per_token)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, msg=name)


def test_a_per_token_advantage_is_not_a_sequence_advantage():
    """The tokens of a row with different advantages: not the row's mean broadcast."""
    policy = token_policy()
    batch, _ = per_token_batch(policy)
    loss = GRPOLoss(policy, aggregation="seq_mean_token_mean")
    mean = batch.clone()
    mean["advantage"] = (
        torch.where(batch["mask"], batch["advantage"], 0.0).sum(-1)
        / batch["mask"].sum(-1).clamp_min(1)
    )[:, None].expand(-1, 6)
    assert not torch.allclose(loss(batch).loss_objective, loss(mean).loss_objective)


@pytest.fixture
def distilled():
    """Four rows of torchrl's LLM layout, seven tokens each (torchrl's ``DistillationLoss``
    stacks them) after prompts of 2 to 4, scored by the policy itself (``("next", "log_probs",
    "full")``: every ratio is 1) and by a teacher (those log-probs plus noise), with the
    advantages ``MCAdvantage(distillation=Distillation(alpha=0))`` writes."""
    with tensordict.set_list_to_stack(True):
        tokenizer = tiny_tokenizer()
        model = tiny_qwen2(tokenizer)
        scorer = llm_scorer(model, tokenizer)
        g = torch.Generator().manual_seed(3)
        rows = []
        for i, prompt in enumerate((2, 3, 4, 3)):
            full = torch.randint(0, 12, (7,), generator=g)
            rows.append(
                TensorDict(
                    query=f"q{i}",
                    tokens=TensorDict(full=full, prompt=full[:prompt]),
                    masks=TensorDict(
                        all_attention_mask=torch.ones(7, dtype=torch.bool),
                        all_assistant_mask=torch.arange(7) >= prompt,
                    ),
                    next=TensorDict(done=torch.tensor([True])),
                )
            )
        batch = lazy_stack(rows)
        with torch.no_grad():
            scored = scorer(batch.copy()).get(("log_probs", "full"), as_list=True)
        for row, lp in zip(batch.tensordicts, scored, strict=True):
            teacher = lp + 0.4 * torch.randn(lp.shape, generator=g)
            teacher[: row["tokens", "prompt"].numel()] = 0.0
            row.set(("next", "log_probs", "full"), lp)
            row.set(TEACHER, teacher)
        distillation = Distillation(alpha=0.0, beta=1.0)
        batch = MCAdvantage(1, rewards_key=None, distillation=distillation).inv(batch)
        yield batch, scorer, model


def response_log_probs(batch, scorer):
    """Each row's response log-probs under the scorer (with grad), the stored ones, the
    teacher's."""
    lps = scorer(batch.copy()).get(("log_probs", "full"), as_list=True)
    out = []
    for lp, row in zip(lps, batch.tensordicts, strict=True):
        start = row["tokens", "prompt"].numel()
        out.append((lp[start:], row["next", "log_probs", "full"][start:], row[TEACHER][start:]))
    return out


def grads(value, model):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(value, params, allow_unused=True, retain_graph=True)


def assert_same_grads(a, b):
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            assert x is None and y is None or torch.count_nonzero(x if y is None else y) == 0
            continue
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-7)


def test_the_written_advantage_is_read_on_each_rows_tokens(distilled):
    """The loss on the LLM batch: the clipped surrogate at ratio 1 is ``-A``, so its token mean
    is the mean reverse KL of the response tokens, and its gradient ``-A grad log pi``."""
    batch, scorer, model = distilled
    with tensordict.set_list_to_stack(True):
        loss = GRPOLoss(scorer, entropy_coeff=0.0)
        loss.set_keys(sample_log_prob=("next", "log_probs", "full"))
        got = loss(batch).loss_objective
        rows = response_log_probs(batch, scorer)
    n = sum(lp.numel() for lp, _, _ in rows)
    kl = sum((old - teacher).sum() for _, old, teacher in rows) / n
    torch.testing.assert_close(got, kl, rtol=1e-5, atol=1e-6)
    want = sum(((old - teacher) * lp).sum() for lp, old, teacher in rows) / n
    assert_same_grads(grads(got, model), grads(want, model))
    assert response_mask(batch).sum() == n


@pytest.mark.parametrize(
    "normalize, reduction, aggregation",
    [(True, "mean", "seq_mean_token_mean"), (False, "sum", "token_sum")],
)
def test_kl_to_the_teacher_as_a_penalty_is_torchrls_distillation_loss(
    distilled, normalize, reduction, aggregation
):
    batch, scorer, model = distilled
    with tensordict.set_list_to_stack(True):
        theirs = DistillationLoss(scorer, normalize_by_seq_length=normalize, reduction=reduction)
        theirs.set_keys(history=("tokens", "full"))  # its actor reads tokens, masks are stored
        want = theirs(batch).loss_distill
        ours = GRPOLoss(
            scorer,
            entropy_coeff=0.0,
            aggregation=aggregation,
            penalties=[KLToReference(1.0, estimator=lambda lp, ref: kl_k3(lp, ref, clamp=None))],
        )
        ours.set_keys(sample_log_prob=("next", "log_probs", "full"), ref_log_prob=TEACHER)
        got = ours(batch).loss_kl_to_ref
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads(got, model), grads(want, model))


def test_the_advantage_form_and_torchrls_gradients_differ_as_written(distilled):
    """Per response token: ``(log pi - log pi_T) grad log pi`` (the advantage form, at ratio
    1), ``(1 - pi_T / pi) grad log pi`` (torchrl's k3 loss, whose expected gradient is the
    forward KL's); both under ``seq_mean_token_mean``."""
    batch, scorer, model = distilled
    with tensordict.set_list_to_stack(True):
        ours = GRPOLoss(scorer, entropy_coeff=0.0, aggregation="seq_mean_token_mean")
        ours.set_keys(sample_log_prob=("next", "log_probs", "full"))
        got = ours(batch).loss_objective
        theirs = DistillationLoss(scorer)
        theirs.set_keys(history=("tokens", "full"))
        torchrl = theirs(batch).loss_distill
        rows = response_log_probs(batch, scorer)
    b = len(rows)
    form = sum(((lp.detach() - t) * lp).sum() / lp.numel() for lp, _, t in rows) / b
    k3 = sum(((1 - (t - lp).exp()).detach() * lp).sum() / lp.numel() for lp, _, t in rows) / b
    g_ours, g_theirs = grads(got, model), grads(torchrl, model)
    assert_same_grads(g_ours, grads(form, model))
    assert_same_grads(g_theirs, grads(k3, model))
    assert not all(
        torch.allclose(a, c) for a, c in zip(g_ours, g_theirs, strict=True) if a is not None
    )
