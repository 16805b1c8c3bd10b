"""Per-call overhead of GRPOLoss on small batches: where the loss's own Python, not the math,
is the cost.

Run (about a minute on one CPU thread)::

    .venv/bin/python benchmarks/loss_overhead.py
    PYTHONPATH=/path/to/other/checkout .venv/bin/python benchmarks/loss_overhead.py  # compare

Each path is a case of ``benchmarks/loss_memory.py`` (the lean token path from ``[B, T, V]``
logits; "variants", "recent" and "vespo" switch on the loss variants that add per-token work, as
there) at a small size, ``B = 8`` sequences of ``T = 32`` tokens over ``V = 64`` logits, where a
call takes about a millisecond. The table gives the median time of one forward+backward
(``total_loss().backward()``) over ``--calls`` calls, after a warm-up, and the time to build a
case: its data, actor and loss (median of 20). Compare two versions of the package by running
the script twice in the same session, one with ``PYTHONPATH`` pointing at the other checkout.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from loss_memory import make_case, step

import torchrl_grpo

PATHS = ("lean", "variants", "recent", "vespo")


def timed(fn, repeats: int) -> float:
    """The median wall time of ``fn()`` in milliseconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="timed calls per path")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu, dtype = torch.device("cpu"), torch.float32
    print(f"torchrl_grpo from {torchrl_grpo.__file__}")
    print(f"{'path':<10} {'call (ms)':>10} {'build (ms)':>11}")
    for path in PATHS:
        case = make_case(path, 8, 32, 64, 16, device=cpu, dtype=dtype)
        for _ in range(20):  # warm-up
            step(*case)
        call = timed(lambda case=case: step(*case), args.calls)
        build = timed(lambda p=path: make_case(p, 8, 32, 64, 16, device=cpu, dtype=dtype), 20)
        print(f"{path:<10} {call:>10.3f} {build:>11.2f}")


if __name__ == "__main__":
    main()
