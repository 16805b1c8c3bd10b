"""Peak memory and time of a top-k distillation step at an LLM's vocabulary, with and without the
logits.

Run (a few minutes on one CPU thread, ~6 GB of RAM at Qwen's vocabulary)::

    .venv/bin/python benchmarks/llm_distill_memory.py --batch 4 --length 256 --vocab 151936
    .venv/bin/python benchmarks/llm_distill_memory.py --batch 2 --length 64 --vocab 4096  # quick

Both paths take the same ragged lazy stack of ``B`` sequences of ``T/2`` to ``T`` tokens (prompt
of 32 tokens), a one-layer ``Qwen2`` student and another as the teacher, ``V`` tokens each
(``benchmarks/llm_loss_memory.py``'s model and batch), and run one step: the teacher's ``K`` most
likely tokens at every position written into the batch, then ``TopKDistillationLoss`` forward
and backward on the response:

* ``logits``: the teacher's top tokens read from its ``[T, V]`` logits (``model(...).logits``,
  ``log_softmax``, ``topk``: what one writes without this package), the student on torchrl's
  ``TransformersWrapper`` (its masked distribution's logits);
* ``lean``: ``TeacherLogProbs(LeanTransformersWrapper(teacher), top_k=K)`` and the student on
  ``LeanTransformersWrapper``: neither builds a ``[T, V]`` tensor.

Memory as ``llm_loss_memory.py`` measures it: each path in a fresh process, capped at
``--memory-gib`` of address space, the step's peak resident set size beyond the models and the
batch ("extra MiB"), and its ratio to the logits path. The loss's values and the student's
gradient are compared between the two paths.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llm_loss_memory as base  # noqa: E402  (the model, the batch and the memory readings)

PATHS = ("logits", "lean")
NAMES = {
    "logits": "top-k from the logits + TransformersWrapper",
    "lean": "TeacherLogProbs(top_k) + LeanTransformersWrapper",
}
VALUE_KEYS = ("loss_distill", "teacher_top_mass", "student_top_mass")
TOP = ("next", "teacher_top_log_probs", "full")
IDS = ("next", "teacher_top_ids", "full")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--batch", type=int, default=4, help="B, sequences")
    parser.add_argument("--length", type=int, default=256, help="T, most tokens per sequence")
    parser.add_argument("--vocab", type=int, default=151936, help="V, vocabulary size")
    parser.add_argument("--hidden", type=int, default=64, help="H, the models' hidden size")
    parser.add_argument("--top-k", type=int, default=16, help="K, the teacher's tokens")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--memory-gib", type=float, default=20.0, help="address space per path")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.device, args.dtype = "cpu", "float32"  # what base.make_model reads
    return args


def models(args):
    """The student (``base.make_model``'s, seed 0) and a teacher of another seed."""
    student, tokenizer = base.make_model(args)
    torch.manual_seed(1)
    teacher = type(student)(student.config).eval()
    return student, teacher.requires_grad_(False), tokenizer


def with_next(batch):
    """The batch with an empty ``"next"`` per row, where the teacher's entries go."""
    from tensordict import TensorDict, lazy_stack

    rows = [row.set("next", TensorDict()) for row in batch.unbind(0)]
    return lazy_stack(rows)


def make_step(path: str, student, teacher, tokenizer, k: int):
    """One step: the teacher's top tokens into the batch, the loss forward and backward."""
    from torchrl.modules.llm import TransformersWrapper

    from torchrl_grpo import LeanTransformersWrapper, TopKDistillationLoss
    from torchrl_grpo.llm import TeacherLogProbs

    kwargs = dict(tokenizer=tokenizer, input_mode="tokens", input_key=("tokens", "full"))
    kwargs |= dict(generate=False, return_log_probs=True, pad_output=False)
    lean = path == "lean"
    wrapper = (LeanTransformersWrapper if lean else TransformersWrapper)(student, **kwargs)
    loss = TopKDistillationLoss(wrapper)
    if lean:
        scorer = TeacherLogProbs(
            LeanTransformersWrapper(teacher, log_probs_key="teacher_log_probs", **kwargs),
            tokenizer=tokenizer,
            top_k=k,
        )
    else:
        scorer = TopFromLogits(teacher, k)

    def step(batch):
        batch = scorer(with_next(batch))
        out = loss(batch)
        out.loss_distill.backward()
        return {key: float(out.get(key)) for key in VALUE_KEYS}

    return step


class TopFromLogits:
    """The teacher's ``k`` most likely tokens at each position from its full logits."""

    def __init__(self, teacher, k: int):
        self.teacher, self.k = teacher, k

    @torch.no_grad()
    def __call__(self, batch):
        for row in batch.tensordicts:
            full = row.get(("tokens", "full"))
            logits = self.teacher(full[None]).logits[0, :-1]  # (T - 1, V): predicts 1..T-1
            top = logits.float().log_softmax(-1).topk(self.k, -1)
            pad = torch.zeros(1, self.k)
            row.set(TOP, torch.cat([pad, top.values]))  # position 0: no prediction
            row.set(IDS, torch.cat([pad.long(), top.indices]))
        return batch


def worker(args) -> None:
    import tensordict

    limit = int(args.memory_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    with tensordict.set_list_to_stack(True):
        student, teacher, tokenizer = models(args)
        step = make_step(args.worker, student, teacher, tokenizer, args.top_k)
        step(base.make_batch(2, 40, args.vocab, seed=1))  # warm-up at a tiny size
        student.zero_grad(set_to_none=True)
        batch = base.make_batch(args.batch, args.length, args.vocab)
        tokens = sum(t.numel() for t in batch.get(("tokens", "full"), as_list=True))
        before = base.rss_bytes()
        start = time.perf_counter()
        try:
            values = step(batch)
        except (RuntimeError, MemoryError) as err:  # the address-space cap: out of memory
            print(json.dumps(base.out_of_memory(err)))
            return
        seconds = time.perf_counter() - start
        peak = base.max_rss_bytes()
    result = {
        "extra_bytes": peak - before,
        "peak_bytes": peak,
        "tokens": tokens,
        "seconds": seconds,
        "values": values,
        "grads": base.gradient_sample(student),
    }
    print(json.dumps(result))


def run_path(path: str, args) -> dict:
    flags = []
    for name in ("batch", "length", "vocab", "hidden", "top_k", "threads", "memory_gib"):
        flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return base.run_worker(__file__, path, flags)


def main(args) -> None:
    results, tokens = base.run_paths(args.paths, NAMES, lambda path: run_path(path, args))
    logits = args.batch * args.length * args.vocab * 4
    print(
        f"Top-k distillation step (1-layer Qwen2 student and teacher, H={args.hidden}, float32), "
        f"K={args.top_k}, B={args.batch} ragged T<={args.length} ({tokens} tokens) "
        f"V={args.vocab}, padded logits {logits / base.MIB:.0f} MiB float32 per model, "
        f"{args.threads} thread(s), cap {args.memory_gib:g} GiB per path"
    )
    header = f"{'path':<50} {'extra MiB':>9} {'vs logits':>9} {'peak MiB':>9} {'time s':>7}"
    print(header)
    print("-" * len(header))
    ref = results.get("logits", {})
    for path, r in results.items():
        if "error" in r:
            print(f"{NAMES[path]:<50} did not fit in {args.memory_gib:g} GiB: {r['error']}")
            continue
        ratio = r["extra_bytes"] / ref["extra_bytes"] if "extra_bytes" in ref else float("nan")
        print(
            f"{NAMES[path]:<50} {r['extra_bytes'] / base.MIB:>9.0f} {ratio:>9.3f} "
            f"{r['peak_bytes'] / base.MIB:>9.0f} {r['seconds']:>7.2f}"
        )
    lean = results.get("lean", {})
    if "values" in ref and "values" in lean:
        gaps = ", ".join(f"{k} {abs(lean['values'][k] - ref['values'][k]):.1e}" for k in VALUE_KEYS)
        grad = base.relative_gap(lean["grads"], ref["grads"])
        print(f"\n|lean - logits|: {gaps}, gradient (relative, max) {grad:.1e}")


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments)
    else:
        main(arguments)
