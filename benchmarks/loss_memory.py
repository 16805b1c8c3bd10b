"""Peak memory and time of GRPOLoss forward+backward: TokenCategorical vs torch's Categorical.

Run (about a minute on one CPU thread, ~3 GB of RAM for the plain path)::

    .venv/bin/python benchmarks/loss_memory.py
    .venv/bin/python benchmarks/loss_memory.py --batch 2 --length 128 --vocab 8192  # quick

Both paths run the same :class:`torchrl_grpo.GRPOLoss` (entropy bonus on, so the entropy's
gradient flows too) on the same ``[B, T, V]`` float32 logits, a leaf tensor standing for the
output of an LLM head. Only the actor's ``distribution_class`` differs:
``torch.distributions.Categorical`` (plain) or :class:`torchrl_grpo.token_dist.TokenCategorical`
(lean).

How memory is measured. PyTorch keeps no allocator statistics on CPU and tracemalloc does not
see its buffers, so each path runs in a fresh subprocess and reads its peak resident set size
(``getrusage(RUSAGE_SELF).ru_maxrss``, a high-water mark):

1. warm up at a tiny size (library initialisation, thread pools);
2. build the inputs (logits and the ``[B, T]`` tensors), allocate a buffer the size of the
   logits, write to every page, free it: the high-water mark now covers the logits plus their
   gradient;
3. read the mark (the baseline), run one forward+backward, read the mark again.

The difference is the *extra* peak memory beyond the logits and their gradient (0 if the run
never goes above the baseline; large buffers are ``mmap``-ed and returned to the system when
freed, so step 2 does not leave a pool behind to hide later allocations). It is reported in MiB
and as a multiple of the logits' size. A second, allocator-independent column sums the distinct
storages autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``), the logits
themselves excluded. Time is the median of ``--repeats`` forward+backward passes after the
measured one, and is reported as a ratio to the plain path measured in the same run. Values are
compared across the two processes: the loss terms, and the gradient on a strided subsample of
the logits.
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

PATHS = ("plain", "lean")
VALUE_KEYS = ("loss_objective", "loss_entropy", "entropy", "ESS", "clip_fraction", "kl_approx")
GRAD_STRIDE = 101


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="B, sequences")
    parser.add_argument("--length", type=int, default=512, help="T, tokens per sequence")
    parser.add_argument("--vocab", type=int, default=32768, help="V, vocabulary size")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per path")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def make_loss(path: str):
    from tensordict.nn import ProbabilisticTensorDictModule

    from torchrl_grpo.loss import GRPOLoss
    from torchrl_grpo.token_dist import TokenCategorical

    dist = {"plain": torch.distributions.Categorical, "lean": TokenCategorical}[path]
    actor = ProbabilisticTensorDictModule(
        in_keys=["logits"], out_keys=["tokens"], distribution_class=dist
    )
    loss = GRPOLoss(actor, clip_epsilon=(0.2, 0.28), entropy_coeff=0.01, functional=False)
    loss.set_keys(sample_log_prob="old_log_prob")
    return loss


def make_batch(b: int, t: int, v: int, seed: int = 0):
    from tensordict import TensorDict

    from torchrl_grpo.token_dist import token_log_prob_entropy

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g).mul_(2.0).requires_grad_()
    tokens = torch.randint(v, (b, t), generator=g)
    with torch.no_grad():
        log_prob, _ = token_log_prob_entropy(logits, tokens)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    batch = TensorDict(
        {
            "logits": logits,
            "tokens": tokens,
            "old_log_prob": log_prob + 0.2 * torch.randn(b, t, generator=g),
            "advantage": torch.randn(b, generator=g),
            "mask": torch.arange(t) < lengths[:, None],
        },
        [b],
    )
    return batch, logits


def step(loss, batch, logits):
    logits.grad = None
    out = loss(batch)
    (out.loss_objective + out.loss_entropy).backward()
    return out


def worker(args) -> None:
    torch.set_num_threads(args.threads)
    loss = make_loss(args.worker)
    step(loss, *make_batch(2, 8, 64))  # warm-up at a tiny size

    batch, logits = make_batch(args.batch, args.length, args.vocab)
    grad_sized = torch.empty_like(logits).fill_(1.0)  # touch every page, then give it back
    del grad_sized
    baseline = max_rss_bytes()

    saved = {}

    def pack(x):
        storage = x.untyped_storage()
        if storage.data_ptr() != logits.untyped_storage().data_ptr():
            saved[storage.data_ptr()] = storage.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        start = time.perf_counter()
        out = step(loss, batch, logits)
        first = time.perf_counter() - start
    peak = max_rss_bytes()

    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step(loss, batch, logits)
        times.append(time.perf_counter() - start)

    torch.save(logits.grad.detach().flatten()[::GRAD_STRIDE].clone(), args.out)
    result = {
        "logits_bytes": logits.numel() * logits.element_size(),
        "extra_peak_bytes": max(0, peak - baseline),
        "saved_bytes": sum(saved.values()),
        "first_s": first,
        "median_s": statistics.median(times) if times else first,
        "values": {k: float(out.get(k).detach()) for k in VALUE_KEYS},
    }
    print(json.dumps(result))


def run_path(path: str, args, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", path, "--out", str(out)]
    for name in ("batch", "length", "vocab", "repeats", "threads"):
        cmd += [f"--{name}", str(getattr(args, name))]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{path} worker failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(args) -> None:
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        results = {path: run_path(path, args, Path(tmp) / f"{path}.pt") for path in PATHS}
        grads = {path: torch.load(Path(tmp) / f"{path}.pt") for path in PATHS}

    logits_bytes = results["plain"]["logits_bytes"]
    plain_time = results["plain"]["median_s"]
    print(
        f"GRPOLoss forward+backward, B={args.batch} T={args.length} V={args.vocab} float32, "
        f"logits {logits_bytes / mib:.0f} MiB, {args.threads} thread(s), "
        f"median of {args.repeats}"
    )
    header = (
        f"{'path':<28} {'extra peak MiB':>15} {'x logits':>9} {'saved MiB':>10} "
        f"{'time s':>8} {'time ratio':>11}"
    )
    print(header)
    print("-" * len(header))
    names = {"plain": "Categorical (plain)", "lean": "TokenCategorical (lean)"}
    for path in PATHS:
        r = results[path]
        print(
            f"{names[path]:<28} {r['extra_peak_bytes'] / mib:>15.1f} "
            f"{r['extra_peak_bytes'] / logits_bytes:>9.3f} {r['saved_bytes'] / mib:>10.2f} "
            f"{r['median_s']:>8.2f} {r['median_s'] / plain_time:>11.2f}"
        )
    diffs = {
        k: abs(results["plain"]["values"][k] - results["lean"]["values"][k]) for k in VALUE_KEYS
    }
    grad_diff = (grads["plain"] - grads["lean"]).abs().max().item()
    print()
    print("max |plain - lean|: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    print(
        f"max |plain - lean| on the logits' gradient (every {GRAD_STRIDE}th entry): {grad_diff:.1e}"
    )


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments)
    else:
        main(arguments)
