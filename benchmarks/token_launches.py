"""Operators and host syncs of the token loss, forward and backward, at the GPU benchmark's shape.

    .venv/bin/python benchmarks/token_launches.py                 # B=8 T=1024 V=151,936 H=1024
    .venv/bin/python benchmarks/token_launches.py --chunk-size 64 # the chunks of the earlier rule

One forward and backward of a distribution's ``log_prob`` and ``entropy`` (both weighted into a
loss, as :class:`~torchrl_grpo.GRPOLoss` with an entropy bonus uses them), counted at torch's
dispatcher with :func:`torchrl_grpo.launches.count_launches`: ``torch.distributions.Categorical``
over the logits ("plain"), :class:`~torchrl_grpo.TokenCategorical` ("lean") and, from hidden
states and an output layer, ``Linear`` then ``TokenCategorical`` ("head") and
:class:`~torchrl_grpo.HiddenTokenCategorical` ("hidden"). The tensors live on the ``meta``
device by default: no memory and no arithmetic, every operator dispatched as on a GPU, and the
chunk rule is the accelerator's (``_chunk_rows`` treats every device but the CPU as one).

What is counted is the eager chunk math: ``torch.compile`` declines to run under a dispatch mode,
and its fused kernels are not operators. "kernels" leaves out the views (``slice``,
``unsqueeze``...), which launch nothing; one operator may still launch several kernels on a GPU
(``logsumexp`` five on CUDA), which only a profile there shows (``loss_memory.py --profile``).
"""

from __future__ import annotations

import argparse

import torch

from torchrl_grpo.launches import count_launches
from torchrl_grpo.token_dist import HiddenTokenCategorical, TokenCategorical, _chunk_rows

#: Operators that only make a view: no kernel on a GPU.
VIEWS = frozenset(
    {"slice", "select", "unsqueeze", "squeeze", "view", "t", "expand", "detach", "alias"}
    | {"transpose", "permute", "as_strided", "_reshape_alias", "reshape"}
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=None, help="positions per chunk")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--device", default="meta", help="meta (no memory), or cuda")
    return parser.parse_args(argv)


def distributions(args):
    """``{path: (make_distribution, leaves)}`` on ``args.device``."""
    b, t, v, h = args.batch, args.length, args.vocab, args.hidden
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    logits = torch.randn(b, t, v, device=device, dtype=dtype).requires_grad_()
    hidden = torch.randn(b, t, h, device=device, dtype=dtype).requires_grad_()
    head = torch.nn.Linear(h, v, bias=False, device=device, dtype=dtype)
    chunk = {"chunk_size": args.chunk_size, "compile": False}
    return {
        "plain": lambda: torch.distributions.Categorical(logits=logits, validate_args=False),
        "lean": lambda: TokenCategorical(logits, **chunk),
        "head": lambda: TokenCategorical(head(hidden), **chunk),
        "hidden": lambda: HiddenTokenCategorical(hidden, head, **chunk),
    }


def count(make, tokens, weight):
    with count_launches() as launches:
        dist = make()
        log_prob, entropy = dist.log_prob(tokens), dist.entropy()
        (weight * log_prob + 0.01 * weight * entropy).sum().backward()
    views = sum(n for op, n in launches.by_op.items() if op.split(".")[1] in VIEWS)
    return launches, launches.ops - views


def main(args) -> None:
    device = torch.device(args.device)
    positions = args.batch * args.length
    tokens = torch.randint(args.vocab, (args.batch, args.length), device=device)
    weight = torch.randn(args.batch, args.length, device=device)
    rows = _chunk_rows(args.chunk_size, args.vocab, positions, device)
    print(
        f"log_prob + entropy, forward and backward, B={args.batch} T={args.length} "
        f"V={args.vocab} H={args.hidden} {args.dtype} on {args.device}: "
        f"{-(-positions // rows)} chunks of {rows} positions (eager chunk math)"
    )
    print(f"{'path':<8} {'operators':>10} {'kernels':>8} {'syncs':>6}")
    for path, make in distributions(args).items():
        launches, kernels = count(make, tokens, weight)
        print(f"{path:<8} {launches.ops:>10,} {kernels:>8,} {launches.syncs:>6}")


if __name__ == "__main__":
    main(parse_args())
