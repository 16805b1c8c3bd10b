"""Policies and batches shared by the loss tests (``test/loss/``): a CartPole-style actor, a
token policy over padded ``[B, T]`` responses, a batch whose every loss value is computed by hand,
and the LLM-wrapper batches' extra entries. Fixtures (the tiny LLM) are in ``conftest.py``."""

from __future__ import annotations

import contextlib
import math

import torch
from tensordict import TensorDict, lazy_stack
from tensordict.nn import CompositeDistribution, ProbabilisticTensorDictModule, TensorDictModule
from torchrl.modules import ProbabilisticActor

from torchrl_grpo.loss import CISPOLoss, DAPOLoss, DrGRPOLoss, GRPOLoss, GSPOLoss
from torchrl_grpo.loss_terms import aggregate_token_sum


def cartpole_actor(seed: int = 0) -> ProbabilisticActor:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    module = TensorDictModule(net, ["observation"], ["logits"])
    return ProbabilisticActor(
        module,
        in_keys=["logits"],
        distribution_class=torch.distributions.Categorical,
        return_log_prob=True,
    )


def cartpole_batch(actor, n: int = 32, seed: int = 1, drift: float = 0.5) -> TensorDict:
    """A sampled batch whose stored log-probs are perturbed, so ratios leave the clip band."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        td = actor(TensorDict({"observation": torch.randn(n, 4, generator=g)}, [n]))
    td["action_log_prob"] = td["action_log_prob"] + drift * torch.randn(n, generator=g)
    td["advantage"] = torch.randn(n, 1, generator=g)
    return td


class _TwoHeads(torch.nn.Module):
    """Observations -> a categorical head's logits (3) and a normal head's loc and scale (2)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 7)

    def forward(self, observation):
        out = self.linear(observation)
        return out[..., :3], out[..., 3:5], torch.nn.functional.softplus(out[..., 5:]) + 0.1


def two_head_actor(seed: int = 0) -> ProbabilisticActor:
    """A multi-head (``CompositeDistribution``) actor: ``("action", "cat")`` and
    ``("action", "norm")`` (two dimensions), ClipPPOLoss's multi-head layout."""
    torch.manual_seed(seed)
    params = [("params", "cat", "logits"), ("params", "norm", "loc"), ("params", "norm", "scale")]
    module = TensorDictModule(_TwoHeads(), ["observation"], params)
    heads = {"cat": torch.distributions.Categorical, "norm": torch.distributions.Normal}
    return ProbabilisticActor(
        module,
        in_keys=["params"],
        distribution_class=CompositeDistribution,
        distribution_kwargs={
            "distribution_map": heads,
            "name_map": {name: ("action", name) for name in heads},
        },
        return_log_prob=True,
    )


def two_head_batch(actor, n: int = 32, seed: int = 1, drift: float = 0.5) -> TensorDict:
    """A sampled batch whose stored per-head log-probs are perturbed (ratios leave the band)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        td = actor(TensorDict({"observation": torch.randn(n, 4, generator=g)}, [n]))
    for key in actor.log_prob_keys:
        td[key] = td[key] + drift * torch.randn(td[key].shape, generator=g)
    td["advantage"] = torch.randn(n, 1, generator=g)
    return td


def check_equals_clip_ppo(ppo, grpo, batch: TensorDict, params: list, grad_atol=1e-8) -> tuple:
    """``(ref, out)``: ClipPPOLoss's and GRPOLoss's outputs on copies of ``batch``, checked
    equal on the terms, the metrics they share and the gradient of ``loss_objective +
    loss_entropy`` with respect to ``params``, on a batch whose ratios leave the clip band."""
    ref = ppo(batch.clone())
    ref_grads = torch.autograd.grad(ref["loss_objective"] + ref["loss_entropy"], params)
    out = grpo(batch.clone())
    out_grads = torch.autograd.grad(out.loss_objective + out.loss_entropy, params)
    assert ref["clip_fraction"] > 0  # the comparison exercises clipping
    for key in ("loss_objective", "loss_entropy", "entropy", "clip_fraction", "kl_approx"):
        torch.testing.assert_close(out.get(key), ref[key], rtol=0, atol=1e-7, msg=key)
    torch.testing.assert_close(out.ESS, ref["ESS"], rtol=1e-6, atol=0)
    for a, b in zip(out_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=grad_atol)
    return ref, out


def token_policy(vocab: int = 7, hidden: int = 5, seed: int = 0) -> ProbabilisticActor:
    torch.manual_seed(seed)
    module = TensorDictModule(torch.nn.Linear(hidden, vocab), ["hidden"], ["logits"])
    return ProbabilisticActor(
        module,
        in_keys=["logits"],
        out_keys=["tokens"],
        distribution_class=torch.distributions.Categorical,
    )


def token_batch(b=3, t=6, vocab=7, hidden=5, seed=2, drift=0.3) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([t, t - 2, 1, t - 1, 2, t][:b])
    mask = torch.arange(t) < lengths[:, None]
    return TensorDict(
        {
            "hidden": torch.randn(b, t, hidden, generator=g),
            "tokens": torch.randint(vocab, (b, t), generator=g),
            "tokens_log_prob": -2.0 + drift * torch.randn(b, t, generator=g),
            "ref_log_prob": -2.0 + drift * torch.randn(b, t, generator=g),
            "inference_log_prob": -2.0 + drift * torch.randn(b, t, generator=g),
            "advantage": torch.randn(b, generator=g),
            "mask": mask,
        },
        [b],
    )


# Two sequences over a two-token vocabulary, always sampling token 0 with probability p:
#   row 0, A = +1: p = 0.5, 0.55, 0.75  vs p_old = 0.5, 0.5, 0.5  -> ratios 1.0, 1.1, 1.5
#   row 1, A = -1: p = 0.25, 0.4, (pad) vs p_old = 0.5, 0.1, nan  -> ratios 0.5, 4.0
# PPO per-token losses with clip 0.2: row 0 -1.0, -1.1, -1.2 (sum -3.3); row 1 0.8, 4.0 (sum 4.8)

P = [[0.5, 0.55, 0.75], [0.25, 0.4, 0.9]]
P_OLD = [[0.5, 0.5, 0.5], [0.5, 0.1, float("nan")]]
REAL_P = [0.5, 0.55, 0.75, 0.25, 0.4]
REAL_RATIOS = [1.0, 1.1, 1.5, 0.5, 4.0]


def known_policy():
    return ProbabilisticTensorDictModule(
        in_keys=["logits"], out_keys=["tokens"], distribution_class=torch.distributions.Categorical
    )


def known_batch(dtype=torch.float32) -> TensorDict:
    p = torch.tensor(P, dtype=dtype)
    return TensorDict(
        {
            "logits": torch.stack([p.log(), (1 - p).log()], -1),
            "tokens": torch.zeros(2, 3, dtype=torch.long),
            "tokens_log_prob": torch.tensor(P_OLD, dtype=dtype).log(),
            "ref_log_prob": torch.tensor(P_OLD, dtype=dtype).log(),
            "inference_log_prob": torch.tensor(
                [[0.25, 0.5, 0.5], [0.5, 0.2, 0.3]], dtype=dtype
            ).log(),
            # decoupled PPO: ratios p / p_prox 1, 1, 1.25 | 1, 2; weights p_prox / p_old
            # 1, 1.1, 1.2 | 0.5, 2
            "proximal_log_prob": torch.tensor(
                [[0.5, 0.55, 0.6], [0.25, 0.2, float("nan")]], dtype=dtype
            ).log(),
            "truncated": torch.tensor([False, True]),
            "advantage": torch.tensor([1.0, -1.0], dtype=dtype),
            "mask": torch.tensor([[True, True, True], [True, True, False]]),
        },
        [2],
    )


def bernoulli_entropy(p):
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


#: Losses whose values and gradients must not depend on padding.
VARIANTS = [
    ("grpo", GRPOLoss, {}),
    (
        "grpo_kl_tis_dual",
        GRPOLoss,
        {
            "kl_to_ref_coeff": 0.1,
            "kl_to_inference_coeff": 0.2,
            "kl_to_inference_estimator": "k2",
            "tis_cap": 2.0,
            "clip_ratio_c": 3.0,
            "aggregation": "seq_mean_token_sum",
        },
    ),
    ("seq_mean_token_mean", GRPOLoss, {"aggregation": "seq_mean_token_mean"}),
    ("dapo", DAPOLoss, {"entropy_coeff": 0.05}),
    ("drgrpo", DrGRPOLoss, {"max_length": 8}),
    ("gspo", GSPOLoss, {"clip_epsilon": 0.05}),
    ("cispo", CISPOLoss, {"kl_to_ref_coeff": 0.1, "kl_to_ref_estimator": "k1"}),
]


def pad(batch: TensorDict, extra_tokens: int = 3, extra_rows: int = 1, seed: int = 9) -> TensorDict:
    """The same batch with garbage pad columns (nan log-probs) and all-padding rows appended."""
    g = torch.Generator().manual_seed(seed)
    b, t = batch["mask"].shape
    out = {}
    for key, value in batch.items():
        if key == "advantage":
            out[key] = torch.cat([value, torch.randn(extra_rows, generator=g)])
            continue
        if key == "truncated":  # per sequence
            out[key] = torch.cat([value, torch.rand(extra_rows, generator=g) > 0.5])
            continue
        if key == "mask":
            filler = torch.zeros(b + extra_rows, t + extra_tokens, dtype=torch.bool)
        elif key == "tokens":
            filler = torch.randint(7, (b + extra_rows, t + extra_tokens), generator=g)
        elif key == "hidden":
            filler = torch.randn(b + extra_rows, t + extra_tokens, value.shape[-1], generator=g)
        else:  # log-probs: padding holds nan
            filler = torch.full((b + extra_rows, t + extra_tokens), float("nan"))
        filler[:b, :t] = value
        out[key] = filler
    return TensorDict(out, [b + extra_rows])


def outputs_and_grads(loss, batch):
    out = loss(batch)
    total = sum(v for k, v in out.items() if k.startswith("loss_"))
    grads = torch.autograd.grad(total, list(loss.actor_network.parameters()))
    return out, grads


def flat_grads(module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])


def run_loss(loss, batch, module):
    """The loss on a copy of ``batch`` and the gradient of its loss terms."""
    module.zero_grad()
    out = loss(batch.copy())
    sum(value for key, value in out.items() if key.startswith("loss_")).backward()
    return out, flat_grads(module)


def neutral_batch(batch: TensorDict) -> TensorDict:
    """The token batch with the entries each variant's neutral setting needs."""
    batch = batch.clone()
    batch["inference_log_prob"] = batch["tokens_log_prob"].clone()  # sampler = trainer
    batch["proximal_log_prob"] = batch["tokens_log_prob"].clone()  # proximal = behaviour
    batch["truncated"] = torch.zeros(batch.shape[0], dtype=torch.bool)
    return batch


#: Every variant at its neutral setting, where it is plain GRPO.
NEUTRAL = [
    ("token_truncate", {"inference_correction": "token_truncate"}),
    (
        "token_mask",
        {"inference_correction": "token_mask", "inference_correction_bounds": (0.5, 5.0)},
    ),
    ("sequence_truncate", {"inference_correction": "sequence_truncate"}),
    ("sequence_mask", {"inference_correction": "sequence_mask"}),
    ("opsm, delta = inf", {"off_policy_mask_threshold": math.inf}),
    ("decoupled, proximal = behaviour", {"decoupled": True, "behaviour_weight_cap": 2.0}),
    ("top_entropy_quantile 1", {"top_entropy_quantile": 1.0}),
    ("no truncated completion", {"mask_truncated_completions": True}),
    ("dppo_tv, bounds 1", {"trust_region": "dppo_tv", "trust_region_bounds": 1.0}),
    ("dppo_kl, bounds inf", {"trust_region": "dppo_kl", "trust_region_bounds": math.inf}),
    ("two-sided clip, delta = inf", {"delta": math.inf}),
    ("veto, tau = inf", {"inference_veto_threshold": math.inf}),
    (
        "adaptive entropy held at entropy_coeff",
        {"entropy_target": math.inf, "entropy_coeff_bounds": (0.01, 0.01)},
    ),
]


def llm_extras(batch, *, seed=5, drift=0.3, truncated=None):
    """The LLM batch with per-token sampler and proximal log-probs (ragged, like torchrl's
    ("log_probs", "full")) and, optionally, a per-sequence ``truncated`` flag."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for i, step in enumerate(batch.unbind(0)):
        log_prob = step.get(("log_probs", "full"))
        step.set("inference_log_prob", log_prob + drift * torch.randn(log_prob.shape, generator=g))
        step.set("proximal_log_prob", log_prob + drift * torch.randn(log_prob.shape, generator=g))
        if truncated is not None:
            step.set("truncated", torch.tensor([truncated[i]]))
        steps.append(step)
    return lazy_stack(steps)


def response_values(batch, scorer, key):
    """Per response: (trainer log-probs, stored ``key`` values) over the response tokens."""
    scored = scorer(batch.copy())
    prompts = batch.get(("tokens", "prompt"), as_list=True)
    return [
        (lp[p.numel() :], other[p.numel() :])
        for lp, other, p in zip(
            scored.get(("log_probs", "full"), as_list=True), batch.get(key, as_list=True), prompts
        )
    ]


def response_mask(batch) -> torch.Tensor:
    """``[B, T]``, True on the response tokens of an LLM batch, left-padded as the loss reads it."""
    full = batch.get(("tokens", "full"), as_list=True)
    width = max(t.numel() for t in full)
    response = torch.zeros(len(full), width, dtype=torch.bool)
    for row, (t, p) in enumerate(zip(full, batch.get(("tokens", "prompt"), as_list=True))):
        response[row, width - t.numel() + p.numel() :] = True
    return response


def ragged_token_batch(b=16, t=7, vocab=7, hidden=5, seed=3) -> TensorDict:
    """``b`` token sequences of random lengths 0 to ``t`` (an empty row included)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0], lengths[1] = 0, t
    batch = token_batch(b=1, t=t, vocab=vocab, hidden=hidden, seed=seed)  # for the keys
    return TensorDict(
        {
            "hidden": torch.randn(b, t, hidden, generator=g),
            "tokens": torch.randint(vocab, (b, t), generator=g),
            **{
                key: -2.0 + 0.3 * torch.randn(b, t, generator=g)
                for key in ("tokens_log_prob", "ref_log_prob")
                if key in batch.keys()
            },
            "advantage": torch.randn(b, generator=g),
            "mask": torch.arange(t) < lengths[:, None],
        },
        [b],
    )


def accumulated_grads(loss, policy, micro_batches, ranks=1, all_reduce=None):
    """The gradients of ``micro_batches`` through ``loss.summed()``, normalized by their count
    (``all_reduce``d when given): what one rank holds after accumulation. With
    ``aggregation="token_sum"`` (a sum already) the plain calls, and a count of 1."""
    policy.zero_grad()
    count = torch.zeros((), dtype=torch.long)
    is_sum = loss._aggregate is aggregate_token_sum
    with contextlib.nullcontext() if is_sum else loss.summed():
        for micro_batch in micro_batches:
            out = loss(micro_batch)
            out.total_loss().backward()
            count += 1 if is_sum else out.normalization_count
    if is_sum:
        count.fill_(1)
    elif all_reduce is not None:
        all_reduce(count)
    loss.normalize_gradients(policy.parameters(), count, ranks=ranks)
    return [p.grad.clone() for p in policy.parameters()]


def ddp_accumulation_worker(rank, world, init_method, out_dir, kwargs):
    """One rank of the DDP test: its half of the batch, two micro-batches, DDP on gloo."""
    import os

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: no interface guessed
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        _ddp_rank(rank, world, out_dir, kwargs)
        dist.barrier()
    finally:
        # after the DDP module is gone: its reducer freed once the group is destroyed hangs
        dist.destroy_process_group()


def _ddp_rank(rank, world, out_dir, kwargs):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    policy = token_policy()
    linear = policy.module[0].module
    policy.module[0].module = DistributedDataParallel(linear)
    loss = GRPOLoss(policy, functional=False, **kwargs)
    mine = ragged_token_batch()[rank::world]
    grads = accumulated_grads(
        loss, policy, mine.split([3, len(mine) - 3]), ranks=world, all_reduce=dist.all_reduce
    )
    torch.save(grads, f"{out_dir}/rank{rank}.pt")


def every_entry_batch(b=6, t=6, seed=2, drift=0.5) -> TensorDict:
    """A token batch with every entry a variant reads: the sampler's, the reference's and the
    proximal policy's log-probs, and the truncated flags (two rows of six)."""
    batch = token_batch(b=b, t=t, seed=seed, drift=drift)
    g = torch.Generator().manual_seed(seed + 1)
    batch["proximal_log_prob"] = batch["tokens_log_prob"] + 0.2 * torch.randn(b, t, generator=g)
    batch["truncated"] = torch.arange(b) % 3 == 0
    return batch
