"""Peak memory and time of GRPOLoss forward+backward: from logits, and from hidden states.

Run (a few minutes on one CPU thread, ~3 GB of RAM for the plain path)::

    .venv/bin/python benchmarks/loss_memory.py
    .venv/bin/python benchmarks/loss_memory.py --batch 2 --length 128 --vocab 8192  # quick
    .venv/bin/python benchmarks/loss_memory.py --device cuda --dtype bfloat16 \
        --batch 8 --length 1024 --vocab 151936 --paths plain compiled eager  # on a GPU

From logits: three paths run :class:`torchrl_grpo.GRPOLoss` (entropy bonus on, so the entropy's
gradient flows too) on the same ``[B, T, V]`` float32 logits, a leaf tensor standing for the
output of an LLM head. The actor's ``distribution_class`` is ``torch.distributions.Categorical``
(plain) or :class:`torchrl_grpo.token_dist.TokenCategorical` (lean); the third path is the lean
one with the loss variants that add per-token work switched on at once (SAPO's objective, the
``sequence_mask`` inference correction, off-policy sequence masking, decoupled PPO with a
behaviour cap, top-20% entropy tokens, masking of truncated completions), to check that these
terms stay within the memory budget. Two more lean paths switch on the 2026 terms at once: with
PPO's surrogate ("recent": the two-sided clip ``delta``, DPPO's binary-KL trust region, the
unbiased KL to the reference, the adaptive entropy coefficient, the veto and the mismatch
statistics, IcePop's token mask, token-sum aggregation) and with VESPO's objective ("vespo":
the sequence weight, DPPO's total-variation trust region, the unbiased KL, the adaptive entropy,
the veto). Every loss term is backpropagated (``total_loss()``). Two more lean paths, not run
by default, fix how the chunk math runs (:mod:`torchrl_grpo.token_chunk`): "eager" as written,
"compiled" through ``torch.compile`` (which "lean" does by default on CUDA with Triton, and not
on the CPU); their values and gradients are compared. On an accelerator every path first runs
two steps of 16 and 24 positions at the full vocabulary, so that a compiled path has compiled
(and recompiled for a new number of positions) before it is measured; on the CPU one tiny step
(a larger one would raise the high-water mark the measurement starts from), so that a compiled
path's measured pass there includes compiling (a dry run).

From hidden states: two paths start from the last hidden states ``[B, T, H]`` (a leaf) and an
output layer ``W`` ``[V, H]`` (no bias). "head" applies the layer (``[B, T, V]`` logits) and then
:class:`~torchrl_grpo.token_dist.TokenCategorical`; "hidden" uses
:class:`~torchrl_grpo.token_dist.HiddenTokenCategorical`, which never builds the logits. Their
values and their gradients with respect to the hidden states and ``W`` are compared.

How memory is measured. PyTorch keeps no allocator statistics on CPU and tracemalloc does not
see its buffers, so each path runs in a fresh subprocess and reads its peak resident set size
(``getrusage(RUSAGE_SELF).ru_maxrss``, a high-water mark):

1. warm up at a tiny size (library initialisation, thread pools);
2. build the inputs (logits, or hidden states and ``W``, and the ``[B, T]`` tensors), allocate
   a buffer the size of the differentiable inputs, write to every page, free it: the high-water
   mark now covers the inputs plus their gradients;
3. read the mark (the baseline), run one forward+backward, read the mark again.

The difference is the *extra* peak memory beyond the inputs and their gradients (0 if the run
never goes above the baseline; large buffers are ``mmap``-ed and returned to the system when
freed, so step 2 does not leave a pool behind to hide later allocations). It is reported in MiB
and as a multiple of the logits' size (``B x T x V`` float32, built or not). A second,
allocator-independent column sums the distinct storages autograd saves for backward
(``torch.autograd.graph.saved_tensors_hooks``), the inputs themselves excluded. Time is the
median of ``--repeats`` forward+backward passes after the measured one, as a ratio to the first
path of its group (plain, or head) measured in the same run. Values are compared across the
processes: the loss terms, and the gradients on a strided subsample of each input.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from torchrl_grpo.loss.variants import (
    SAPO,
    VESPO,
    Clip,
    Decoupled,
    EntropyTarget,
    InferenceCorrection,
    InferenceVeto,
    KLToReference,
    OffPolicyMask,
    TopEntropy,
    TruncatedCompletions,
    TrustRegion,
)

#: Paths in two groups, each compared with its first path.
GROUPS = {
    "logits": ("plain", "lean", "eager", "compiled", "variants", "recent", "vespo"),
    "hidden states": ("head", "hidden"),
}
PATHS = tuple(path for group in GROUPS.values() for path in group)
#: What runs without ``--paths``: the chunk math's two modes are run when asked for.
DEFAULT_PATHS = tuple(path for path in PATHS if path not in ("eager", "compiled"))
#: The lean paths whose chunk math is fixed, and the ``compile`` keyword each passes.
COMPILE = {"eager": False, "compiled": True}
NAMES = {
    "plain": "Categorical (plain)",
    "lean": "TokenCategorical (lean)",
    "eager": "lean, eager chunk math",
    "compiled": "lean, compiled chunk math",
    "variants": "lean + per-token variants",
    "recent": "lean + 2026 terms (clip)",
    "vespo": "lean + 2026 terms (VESPO)",
    "head": "Linear + TokenCategorical",
    "hidden": "HiddenTokenCategorical",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: Pairs whose values and gradients must agree.
SAME = (("plain", "lean"), ("eager", "compiled"), ("head", "hidden"))
VALUE_KEYS = ("loss_objective", "loss_entropy", "entropy", "ESS", "clip_fraction", "kl_approx")
GRAD_STRIDE = 101
#: The variants that add per-token work, at once: SAPO, inference correction, OPSM, decoupled PPO,
#: high-entropy tokens, truncated completions.
VARIANTS = {
    "objective": SAPO(),
    "corrections": [
        TruncatedCompletions(),
        Decoupled(behaviour_weight_cap=5.0),
        InferenceCorrection("sequence_mask"),
        OffPolicyMask(0.05),
        TopEntropy(0.2),
    ],
}
#: The 2026 terms at once, with PPO's surrogate.
RECENT = {
    "objective": Clip(delta=4.0),
    "corrections": [
        InferenceVeto(0.5),
        InferenceCorrection("token_mask"),
        TrustRegion("dppo_kl"),
    ],
    "penalties": [KLToReference(0.01, unbiased=True), EntropyTarget(0.5)],
    "aggregation": "token_sum",
}
#: The 2026 terms with VESPO's objective (the two-sided clip is PPO's only).
VESPO_PATH = {
    "objective": VESPO(),
    "ratio_level": "sequence_sum",
    "corrections": [InferenceVeto(0.5), TrustRegion("dppo_tv")],
    "penalties": [KLToReference(0.01, unbiased=True), EntropyTarget(0.5)],
}
#: The loss keywords of each path (none: GRPOLoss's defaults).
PATH_VARIANTS = {"variants": VARIANTS, "recent": RECENT, "vespo": VESPO_PATH}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="B, sequences")
    parser.add_argument("--length", type=int, default=512, help="T, tokens per sequence")
    parser.add_argument("--vocab", type=int, default=32768, help="V, vocabulary size")
    parser.add_argument("--hidden", type=int, default=1024, help="H, hidden size")
    parser.add_argument(
        "--chunk-size", type=int, default=None, help="positions per chunk (default: 2**20 // V)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per path")
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=PATHS,
        default=list(DEFAULT_PATHS),
        help="paths to run (all but eager and compiled)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: memory from its allocator")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="of the inputs")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print torch.profiler's top operators of one pass of each path",
    )
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def make_case(
    path: str,
    b: int,
    t: int,
    v: int,
    h: int,
    chunk_size=None,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
):
    """``(loss, batch, leaves)``: the loss of a path, its batch, its differentiable inputs (of
    ``dtype``, on ``device``; the same numbers in every process on one device: the small
    tensors are drawn on the CPU, the logits on ``device`` by a generator seeded there, since
    drawing ``B x T x V`` numbers on one CPU thread costs more than the step on a GPU)."""
    from tensordict import TensorDict
    from tensordict.nn import (
        ProbabilisticTensorDictModule,
        ProbabilisticTensorDictSequential,
        TensorDictModule,
    )

    from torchrl_grpo.loss import GRPOLoss
    from torchrl_grpo.token_dist import (
        HiddenTokenCategorical,
        TokenCategorical,
        token_log_prob_entropy,
        token_log_prob_entropy_from_hidden,
    )

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(v, (b, t), generator=g)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    data = {
        "tokens": tokens,
        "advantage": torch.randn(b, generator=g),
        "mask": torch.arange(t) < lengths[:, None],
    }
    data = {k: x.to(device) for k, x in data.items()}
    tokens = data["tokens"]
    if path in GROUPS["logits"]:
        big = torch.Generator(device).manual_seed(seed)
        logits = torch.randn(b, t, v, generator=big, device=device).mul_(2.0)
        logits = logits.to(dtype).requires_grad_()
        with torch.no_grad():
            log_prob, _ = token_log_prob_entropy(logits, tokens)
        data["logits"] = logits
        leaves = {"logits": logits}
        dist = torch.distributions.Categorical if path == "plain" else TokenCategorical
        kwargs = {"compile": COMPILE[path]} if path in COMPILE else {}
        actor = ProbabilisticTensorDictModule(
            in_keys=["logits"],
            out_keys=["tokens"],
            distribution_class=dist,
            distribution_kwargs=kwargs,
        )
    else:
        hidden = torch.randn(b, t, h, generator=g).to(device, dtype).requires_grad_()
        head = torch.nn.Linear(h, v, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            head.weight.copy_(torch.randn(v, h, generator=g).mul_(2.0 / h**0.5))
            log_prob, _ = token_log_prob_entropy_from_hidden(hidden, head.weight, tokens)
        data["hidden"] = hidden
        leaves = {"hidden": hidden, "weight": head.weight}
        kwargs = {"chunk_size": chunk_size}
        if path == "head":
            actor = ProbabilisticTensorDictSequential(
                TensorDictModule(head, ["hidden"], ["logits"]),
                ProbabilisticTensorDictModule(
                    in_keys=["logits"],
                    out_keys=["tokens"],
                    distribution_class=TokenCategorical,
                    distribution_kwargs=kwargs,
                ),
            )
        else:
            actor = ProbabilisticTensorDictModule(
                in_keys=["hidden"],
                out_keys=["tokens"],
                distribution_class=HiddenTokenCategorical,
                distribution_kwargs={"head": head, **kwargs},
            )
    log_prob = log_prob.float()

    def noise(*shape):  # drawn on the CPU, then moved: the same numbers on every device
        return torch.randn(*shape, generator=g).to(device)

    data["old_log_prob"] = log_prob + 0.2 * noise(b, t)
    variants = PATH_VARIANTS.get(path, {})
    if variants:
        data["inference_log_prob"] = data["old_log_prob"] + 0.01 * noise(b, t)
        data["proximal_log_prob"] = data["old_log_prob"] + 0.1 * noise(b, t)
        data["ref_log_prob"] = log_prob + 0.3 * noise(b, t)
        data["truncated"] = (torch.rand(b, generator=g) < 0.25).to(device)
    loss = GRPOLoss(
        actor, clip_epsilon=(0.2, 0.28), entropy_coeff=0.01, functional=False, **variants
    )
    loss.set_keys(sample_log_prob="old_log_prob")
    return loss.to(device), TensorDict(data, [b]), leaves


def step(loss, batch, leaves):
    for leaf in leaves.values():
        leaf.grad = None
    out = loss(batch)
    out.total_loss().backward()
    return out


def worker(args) -> None:
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    accelerator = device.type != "cpu"
    # warm-up; on an accelerator at the full vocabulary, 16 then 24 positions: a compiled path
    # compiles, then recompiles once for a new number of positions (not again after that)
    shapes = ((2, 8, args.vocab), (2, 12, args.vocab)) if accelerator else ((2, 8, 64),)
    for b, t, v in shapes:
        step(*make_case(args.worker, b, t, v, args.hidden, device=device, dtype=dtype))

    loss, batch, leaves = make_case(
        args.worker,
        args.batch,
        args.length,
        args.vocab,
        args.hidden,
        args.chunk_size,
        device=device,
        dtype=dtype,
    )
    numel = sum(leaf.numel() for leaf in leaves.values())
    if accelerator:  # the allocator's own counters; the gradients are counted as inputs
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device) + numel * dtype.itemsize
    else:
        grad_sized = torch.empty(numel).fill_(1.0)  # touch every page, then give it back
        del grad_sized
        baseline = max_rss_bytes()

    saved = {}
    inputs = {leaf.untyped_storage().data_ptr() for leaf in leaves.values()}

    def pack(x):
        storage = x.untyped_storage()
        if storage.data_ptr() not in inputs:
            saved[storage.data_ptr()] = storage.nbytes()
        return x

    def clock() -> float:
        if accelerator:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        start = clock()
        out = step(loss, batch, leaves)
        first = clock() - start
    peak = torch.cuda.max_memory_allocated(device) if accelerator else max_rss_bytes()

    times = []
    for _ in range(args.repeats):
        start = clock()
        step(loss, batch, leaves)
        times.append(clock() - start)

    if args.profile:  # one more pass under the profiler; its table goes to stderr
        activities = [torch.profiler.ProfilerActivity.CPU]
        if accelerator:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            step(loss, batch, leaves)
            clock()
        sort = "self_cuda_time_total" if accelerator else "self_cpu_time_total"
        print(f"profile of {args.worker}:", file=sys.stderr)
        print(prof.key_averages().table(sort_by=sort, row_limit=20), file=sys.stderr)

    grads = {
        k: leaf.grad.detach().flatten()[::GRAD_STRIDE].float().cpu() for k, leaf in leaves.items()
    }
    torch.save(grads, args.out)
    result = {
        "device_name": torch.cuda.get_device_name(device) if accelerator else "CPU",
        "logits_bytes": args.batch * args.length * args.vocab * dtype.itemsize,
        "extra_peak_bytes": max(0, peak - baseline),
        "saved_bytes": sum(saved.values()),
        "first_s": first,
        "median_s": statistics.median(times) if times else first,
        "values": {k: float(out.get(k).detach()) for k in VALUE_KEYS},
    }
    print(json.dumps(result))


def run_path(path: str, args, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", path, "--out", str(out)]
    for name in ("batch", "length", "vocab", "hidden", "repeats", "threads", "device", "dtype"):
        cmd += [f"--{name}", str(getattr(args, name))]
    if args.chunk_size is not None:
        cmd += ["--chunk-size", str(args.chunk_size)]
    if args.profile:
        cmd.append("--profile")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{path} worker failed:\n{proc.stderr}")
    if args.profile:
        sys.stderr.write(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(args) -> None:
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        paths = [path for path in PATHS if path in args.paths]
        results = {path: run_path(path, args, Path(tmp) / f"{path}.pt") for path in paths}
        grads = {path: torch.load(Path(tmp) / f"{path}.pt") for path in paths}

    logits_bytes = args.batch * args.length * args.vocab * DTYPES[args.dtype].itemsize
    where = next(iter(results.values()))["device_name"]
    print(
        f"GRPOLoss forward+backward, B={args.batch} T={args.length} V={args.vocab} "
        f"H={args.hidden} {args.dtype}, logits {logits_bytes / mib:.0f} MiB, on {where} "
        f"({args.device}), {args.threads} thread(s), median of {args.repeats}"
    )
    header = (
        f"{'path':<28} {'extra peak MiB':>15} {'x logits':>9} {'saved MiB':>10} "
        f"{'time s':>8} {'time ratio':>11}"
    )
    from torchrl_grpo.token_dist import _chunk_rows

    positions = args.batch * args.length
    rows = _chunk_rows(args.chunk_size, args.vocab, positions, torch.device(args.device))
    print(f"TokenCategorical / HiddenTokenCategorical chunks: {rows} positions")
    for group, paths in GROUPS.items():
        paths = [path for path in paths if path in results]
        if not paths:
            continue
        inputs = "logits" if group == "logits" else "hidden states and W"
        print(f"\nfrom {group} (extra peak beyond the {inputs} and their gradients)")
        print(header)
        print("-" * len(header))
        reference = results[paths[0]]["median_s"]
        for path in paths:
            r = results[path]
            print(
                f"{NAMES[path]:<28} {r['extra_peak_bytes'] / mib:>15.1f} "
                f"{r['extra_peak_bytes'] / logits_bytes:>9.3f} {r['saved_bytes'] / mib:>10.2f} "
                f"{r['median_s']:>8.2f} {r['median_s'] / reference:>11.2f}"
            )
    print()
    for a, b in SAME:
        if a not in results or b not in results:
            continue
        diffs = {k: abs(results[a]["values"][k] - results[b]["values"][k]) for k in VALUE_KEYS}
        print(f"max |{a} - {b}|: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
        for name in grads[a]:
            diff = (grads[a][name] - grads[b][name]).abs().max().item()
            scale = grads[a][name].abs().max().item()
            print(
                f"max |{a} - {b}| on the gradient of the {name} (every {GRAD_STRIDE}th entry): "
                f"{diff:.1e} (largest entry {scale:.1e})"
            )


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments)
    else:
        main(arguments)
