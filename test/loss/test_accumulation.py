"""Exact normalization (GRPOLoss.summed): the gradients of K micro-batches, and of R
data-parallel ranks (DistributedDataParallel on gloo), equal the whole batch's, for every
aggregation."""

import functools
import time

import pytest
import torch
import torch.multiprocessing as mp
from helpers.loss import (
    accumulated_grads,
    ddp_accumulation_worker,
    ragged_token_batch,
    token_batch,
    token_policy,
)

from torchrl_grpo import GRPOLoss
from torchrl_grpo.loss_terms import AGGREGATIONS, aggregation_sum

AGGREGATION_KWARGS = [
    dict(aggregation="token_mean"),
    dict(aggregation="seq_mean_token_mean"),
    dict(aggregation="seq_mean_token_sum"),
    dict(aggregation="seq_mean_token_sum_norm", max_length=7),
    dict(aggregation="token_sum"),
]
IDS = [kwargs["aggregation"] for kwargs in AGGREGATION_KWARGS]
# the regularisers aggregate as the objective: on, so that they are summed too
TERMS = dict(entropy_coeff=0.01, kl_to_ref_coeff=0.1, clip_epsilon=(0.2, 0.28))


def whole_batch_grads(kwargs):
    policy = token_policy()
    GRPOLoss(policy, **TERMS, **kwargs)(ragged_token_batch()).total_loss().backward()
    return [p.grad.clone() for p in policy.parameters()]


@pytest.mark.parametrize("kwargs", AGGREGATION_KWARGS, ids=IDS)
def test_four_micro_batches_give_the_whole_batch_gradient(kwargs):
    want = whole_batch_grads(kwargs)
    policy = token_policy()
    loss = GRPOLoss(policy, **TERMS, **kwargs)
    micro_batches = ragged_token_batch().split([2, 6, 3, 5])  # unequal, an empty row in one
    got = accumulated_grads(loss, policy, micro_batches)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def test_averaging_micro_batch_means_is_the_pitfall():
    """What it fixes: the mean of the micro-batches' token means is not the batch's mean."""
    want = whole_batch_grads(dict(aggregation="token_mean"))
    policy = token_policy()
    loss = GRPOLoss(policy, **TERMS)
    micro_batches = ragged_token_batch().split([2, 6, 3, 5])
    for micro_batch in micro_batches:
        (loss(micro_batch).total_loss() / len(micro_batches)).backward()
    assert not torch.allclose(policy.module[0].module.weight.grad, want[0], atol=1e-4)


@pytest.mark.parametrize("kwargs", AGGREGATION_KWARGS[:-1], ids=IDS[:-1])
def test_the_sum_over_its_count_is_the_loss(kwargs):
    batch = ragged_token_batch()
    loss = GRPOLoss(token_policy(), **TERMS, **kwargs)
    plain = loss(batch)
    with loss.summed():
        summed = loss(batch)
    assert plain.normalization_count is None
    count = summed.normalization_count
    for key in ("loss_objective", "loss_entropy", "loss_kl_to_ref"):
        torch.testing.assert_close(summed[key] / count, plain[key], rtol=1e-6, atol=1e-7)
    for key in ("clip_fraction", "ESS", "kl_to_ref"):  # the metrics are unchanged
        torch.testing.assert_close(summed[key], plain[key])
    assert not loss._summed  # the context is left


def test_aggregation_sum_of_every_aggregation():
    g = torch.Generator().manual_seed(0)
    per_token = torch.randn(5, 6, generator=g)
    mask = torch.rand(5, 6, generator=g) > 0.4
    mask[0] = False
    for name, fn in AGGREGATIONS.items():
        if name == "token_sum":  # a sum already: refused, below
            continue
        fn = functools.partial(fn, max_length=6) if name == "seq_mean_token_sum_norm" else fn
        total, count = aggregation_sum(fn, per_token, mask)
        torch.testing.assert_close(total / count, fn(per_token, mask), msg=name)
    assert aggregation_sum(AGGREGATIONS["token_mean"], per_token, mask)[1] == mask.sum()
    # token_sum: the sum of the parts is the whole's, with no count
    parts = sum(AGGREGATIONS["token_sum"](p, m) for p, m in zip(per_token, mask))
    torch.testing.assert_close(parts, AGGREGATIONS["token_sum"](per_token, mask))


def test_what_cannot_be_summed_is_refused():
    custom = GRPOLoss(token_policy(), aggregation=lambda loss, mask: loss[mask].mean())
    with pytest.raises(ValueError, match="no registered sum and count.*register_aggregation"):
        with custom.summed():
            pass
    per_token = GRPOLoss(token_policy(), reduction="none")
    with pytest.raises(ValueError, match="reduction='none'"):
        with per_token.summed():
            pass
    token_sum = GRPOLoss(token_policy(), aggregation="token_sum")
    with pytest.raises(ValueError, match="'token_sum' is a sum already"):
        with token_sum.summed():
            pass
    with pytest.raises(ValueError, match="count must be positive"):
        GRPOLoss.normalize_gradients(token_policy().parameters(), 0)
    out = GRPOLoss(token_policy())(token_batch())
    assert out.normalization_count is None


def test_a_registered_aggregation_is_summed_exactly():
    """The registry is the whole contract: an aggregation added with its sum and count works in
    the loss and in summed(), and micro-batches add up to the whole batch's gradient."""
    from torchrl_grpo.loss_terms import AGGREGATION_SUMS, register_aggregation

    def sum_and_count(loss, mask):  # each row's token sum over its length + 1
        per_row = torch.where(mask, loss, 0.0).sum(-1) / (mask.sum(-1) + 1)
        return per_row.sum(), mask.any(-1).sum()

    def padded_mean(loss, mask):
        total, count = sum_and_count(loss, mask)
        return total / count

    register_aggregation("seq_mean_token_mean_plus_one", padded_mean, sum_and_count)
    try:
        with pytest.raises(ValueError, match="registered already"):
            register_aggregation("seq_mean_token_mean_plus_one", padded_mean, sum_and_count)
        policy = token_policy()
        loss = GRPOLoss(policy, aggregation="seq_mean_token_mean_plus_one")
        batch = token_batch()
        loss(batch).total_loss().backward()
        whole = [p.grad.clone() for p in policy.parameters()]
        policy.zero_grad()
        count = 0
        with loss.summed():
            for part in batch.split(3):
                out = loss(part)
                out.total_loss().backward()
                count += out.normalization_count
        GRPOLoss.normalize_gradients(policy.parameters(), count)
        for a, b in zip(whole, (p.grad for p in policy.parameters())):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    finally:
        del AGGREGATIONS["seq_mean_token_mean_plus_one"], AGGREGATION_SUMS[padded_mean]


DDP_CASES = [0, 1, 4]  # token_mean, seq_mean_token_mean, token_sum (no count: ranks only)


@pytest.mark.parametrize(
    "kwargs", [AGGREGATION_KWARGS[i] for i in DDP_CASES], ids=[IDS[i] for i in DDP_CASES]
)
def test_two_ddp_ranks_give_the_whole_batch_gradient(kwargs, tmp_path):
    """Two processes, DistributedDataParallel on gloo, each rank half the batch in two
    micro-batches: every rank holds the whole batch's gradient."""
    want = whole_batch_grads(kwargs)
    kwargs = {**TERMS, **kwargs}
    ranks = mp.spawn(
        ddp_accumulation_worker,
        args=(2, f"file://{tmp_path / 'init'}", str(tmp_path), kwargs),
        nprocs=2,
        join=False,
    )
    deadline = time.monotonic() + 120
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the two DDP ranks did not finish within 120 s")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def test_verl_0_9_1_denominator_by_the_rows_of_the_mini_batch():
    """verl 0.9.1 divides ``seq-mean-token-mean`` by the mini-batch's rows
    (``ppo_mini_batch_size * n``), an empty or vetoed row counted; this package by the rows
    holding a token. ``summed()`` with ``normalize_gradients(params, rows)`` is verl's: its
    gradient is the default's times ``nonempty / rows``."""
    batch = token_batch(b=4, seed=5)
    batch["mask"][2] = False  # an empty row
    rows, nonempty = 4, 3
    policy = token_policy()
    loss = GRPOLoss(policy, aggregation="seq_mean_token_mean", entropy_coeff=0.0)
    loss(batch).total_loss().backward()
    default = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    with loss.summed():
        for part in batch.split(2):
            loss(part).total_loss().backward()
    GRPOLoss.normalize_gradients(policy.parameters(), rows)
    for want, p in zip(default, policy.parameters()):
        torch.testing.assert_close(p.grad, want * nonempty / rows, atol=1e-7, rtol=1e-5)
