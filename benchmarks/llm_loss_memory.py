"""Peak memory and time of a GRPO step on torchrl's LLM stack, with and without the logits.

Run (a few minutes on one CPU thread, ~10 GB of RAM at Qwen's vocabulary)::

    .venv/bin/python benchmarks/llm_loss_memory.py --batch 4 --length 512 --vocab 151936
    .venv/bin/python benchmarks/llm_loss_memory.py --batch 2 --length 64 --vocab 4096  # quick
    .venv/bin/python benchmarks/llm_loss_memory.py --device cuda --dtype bfloat16 \
        --batch 8 --length 1024 --vocab 151936 --hidden 896 --paths torchrl ours lean  # a GPU

Every path takes the same ragged lazy stack of ``B`` sequences of ``T/2`` to ``T`` tokens
(prompt of 32 tokens) and a one-layer ``Qwen2`` with a ``V``-token vocabulary (built locally),
with ``masking_strategy="sft"`` and the entropy bonus on, and runs one forward+backward:

* ``wrapper only``: torchrl's ``TransformersWrapper(generate=False)`` building its masked
  distribution, and a backward through the logits (what every loss on that wrapper starts from);
* ``torchrl``: ``torchrl.objectives.llm.GRPOLoss`` on that wrapper (the reference: torchrl's path);
* ``ours``: ``torchrl_grpo.GRPOLoss`` on that wrapper;
* ``lean``: ``torchrl_grpo.GRPOLoss`` on ``torchrl_grpo.LeanTransformersWrapper``, which never
  builds the logits;
* ``torchrl on lean``: torchrl's own ``GRPOLoss`` on the lean wrapper (it only sees a
  distribution's ``log_prob`` and ``entropy``).

How memory is measured: each path runs in a fresh process (PyTorch keeps no allocator
statistics on CPU). After building the model and the batch and a warm-up at a tiny size, the
process reads its resident set size; it runs the step and reads its peak resident set size
(``getrusage(RUSAGE_SELF).ru_maxrss``, a high-water mark). The difference, "extra MiB", is the
step's peak beyond the model and the batch (activations, logits or chunks, gradients); the
"vs torchrl" column is its ratio to torchrl's path. Each process is capped at ``--memory-gib``
of address space, so that a path that does not fit fails with an allocation error instead of
swapping the machine; its row then says so. A second, allocator-independent column sums the
distinct storages autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``).
With ``--device cuda`` the model and the batch are on the GPU, memory is the allocator's peak
(``torch.cuda.max_memory_allocated``) beyond what is allocated before the step, no address-space
cap is set, and each pass is timed after a synchronization. Time is the median of ``--repeats``
passes after the measured one, as a ratio to torchrl's path in the same run. Values
(``loss_objective``, ``loss_entropy``, ``ESS``) and the gradient of the model's parameters are
compared with torchrl's path.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import subprocess
import sys
import time
import warnings

import torch

PATHS = ("wrapper", "torchrl", "ours", "lean", "torchrl_on_lean")
NAMES = {
    "wrapper": "wrapper only (logits, backward)",
    "torchrl": "torchrl GRPOLoss + TransformersWrapper",
    "ours": "GRPOLoss + TransformersWrapper",
    "lean": "GRPOLoss + LeanTransformersWrapper",
    "torchrl_on_lean": "torchrl GRPOLoss + LeanTransformersWrapper",
}
VALUE_KEYS = ("loss_objective", "loss_entropy", "ESS")
MIB = 2**20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--batch", type=int, default=8, help="B, sequences")
    parser.add_argument("--length", type=int, default=256, help="T, most tokens per sequence")
    parser.add_argument("--vocab", type=int, default=32768, help="V, vocabulary size")
    parser.add_argument("--hidden", type=int, default=64, help="H, the model's hidden size")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per path")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: memory from its allocator")
    parser.add_argument("--memory-gib", type=float, default=20.0, help="address space per path")
    parser.add_argument("--chunk-size", type=int, help="the lean wrapper's chunk_size")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def word_tokenizer(vocab: int):
    """A word-level tokenizer of ``vocab`` tokens ``t0 ...``, the last one ``<pad>`` (built here:
    nothing is downloaded)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab - 1)} | {"<pad>": vocab - 1}
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>")


def make_model(args):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = args.vocab
    tokenizer = word_tokenizer(vocab)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=vocab - 1,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).to(args.device, getattr(torch, args.dtype)).eval()
    return model, tokenizer


def make_wrapper(path: str, model, tokenizer, chunk_size=None):
    from torchrl.modules.llm import TransformersWrapper

    from torchrl_grpo import LeanTransformersWrapper

    lean = path in ("lean", "torchrl_on_lean")
    cls = LeanTransformersWrapper if lean else TransformersWrapper
    return cls(
        model,
        **({"chunk_size": chunk_size} if lean else {}),
        tokenizer=tokenizer,
        input_mode="tokens",
        input_key=("tokens", "full"),
        generate=False,
        return_log_probs=True,
        pad_output=False,
    )


def make_batch(b: int, t: int, v: int, seed: int = 0):
    from tensordict import TensorDict, lazy_stack
    from torchrl.modules.llm.policies.common import Tokens

    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(b):
        n = int(torch.randint(t // 2, t + 1, (1,), generator=g))
        full = torch.randint(v - 1, (n,), generator=g)
        steps.append(
            TensorDict(
                {
                    "tokens": Tokens(full=full, prompt=full[: min(32, n - 1)]),
                    "log_probs": TensorDict(full=-10.0 + torch.randn(n, generator=g)),
                    "advantage": torch.randn(1, 1, generator=g),
                }
            )
        )
    return lazy_stack(steps)


def make_step(path: str, wrapper):
    from torchrl_grpo import _compat

    if path == "wrapper":

        def step(batch):
            dist = _compat.llm_masked_dist(wrapper, batch.copy(), "sft")
            dist.logits.sum().backward()
            return {}

        return step
    if path in ("torchrl", "torchrl_on_lean"):
        from torchrl.objectives.llm import GRPOLoss
    else:
        from torchrl_grpo import GRPOLoss
    loss = GRPOLoss(wrapper, masking_strategy="sft", entropy_coeff=0.01)

    def step(batch):
        out = loss(batch.copy())
        (out.loss_objective + out.loss_entropy).backward()
        return {k: float(out.get(k).detach()) for k in VALUE_KEYS}

    return step


def gradient_sample(model) -> list[float]:
    """Every 101st entry of the parameters' gradients, to compare across processes."""
    grads = [p.grad.flatten()[::101] for p in model.parameters() if p.grad is not None]
    return torch.cat(grads).float().tolist() if grads else []


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def worker(args) -> None:
    import tensordict

    device = torch.device(args.device)
    accelerator = device.type != "cpu"
    if not accelerator:  # CUDA reserves far more address space than it uses: no cap there
        limit = int(args.memory_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    with tensordict.set_list_to_stack(True):
        model, tokenizer = make_model(args)
        wrapper = make_wrapper(args.worker, model, tokenizer, args.chunk_size)
        step = make_step(args.worker, wrapper)
        step(make_batch(2, 8, args.vocab, seed=1).to(device))  # warm-up at a tiny size
        model.zero_grad(set_to_none=True)
        batch = make_batch(args.batch, args.length, args.vocab).to(device)
        tokens = sum(t.numel() for t in batch.get(("tokens", "full"), as_list=True))
        saved = {}

        def pack(x):
            saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        if accelerator:
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if accelerator else rss_bytes()
        start = time.perf_counter()
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                values = step(batch)
        except (RuntimeError, MemoryError) as err:  # the address-space cap: out of memory
            print(json.dumps(out_of_memory(err)))
            return
        sync(device)
        first = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) if accelerator else max_rss_bytes()
        grads = gradient_sample(model)
        times = []
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step(batch)
            sync(device)
            times.append(time.perf_counter() - start)
    result = {
        "extra_bytes": peak - before,
        "peak_bytes": peak,
        "saved_bytes": sum(saved.values()),
        "tokens": tokens,
        "first_s": first,
        "median_s": statistics.median(times) if times else first,
        "values": values,
        "grads": grads,
    }
    print(json.dumps(result))


def out_of_memory(err: BaseException) -> dict:
    """A worker's result when its step hit the address-space cap: what it tried to allocate."""
    tried = re.search(r"allocate (\d+) bytes", str(err))
    what = f"{int(tried[1]) / 2**30:.1f} GiB" if tried else str(err)[:100]
    return {"error": f"out of memory: could not allocate {what} more"}


def run_worker(script: str, path: str, flags: list[str]) -> dict:
    """``script --worker path flags`` in a fresh process: its last line of JSON, or the error."""
    cmd = [sys.executable, script, "--worker", path, *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(lines[-1])


def run_paths(paths, names: dict, run_path) -> tuple[dict, object]:
    """Each path's result (``run_path(path)``), in order, and the tokens of the batch."""
    results = {}
    for path in paths:
        print(f"running {names[path]} ...", file=sys.stderr, flush=True)
        results[path] = run_path(path)
    done = [r for r in results.values() if "error" not in r]
    return results, done[0]["tokens"] if done else "?"


def run_path(path: str, args) -> dict:
    flags = []
    for name in ("batch", "length", "vocab", "hidden", "dtype", "repeats", "threads", "device"):
        flags += [f"--{name}", str(getattr(args, name))]
    flags += ["--memory-gib", str(args.memory_gib)]
    if args.chunk_size is not None:
        flags += ["--chunk-size", str(args.chunk_size)]
    return run_worker(__file__, path, flags)


def relative_gap(grads: list[float], ref: list[float]) -> float:
    a, b = torch.tensor(grads), torch.tensor(ref)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main(args) -> None:
    results, tokens = run_paths(args.paths, NAMES, lambda path: run_path(path, args))
    logits = args.batch * args.length * args.vocab * 4
    print(
        f"GRPO step on torchrl's LLM stack (1-layer Qwen2, H={args.hidden}, {args.dtype}), "
        f"masking_strategy='sft', B={args.batch} ragged T<={args.length} ({tokens} tokens) "
        f"V={args.vocab}, padded logits {logits / MIB:.0f} MiB float32, {args.threads} "
        f"thread(s), median of {args.repeats}, "
        + (
            f"on {torch.cuda.get_device_name(args.device)} (allocator peak)"
            if args.device != "cpu"
            else f"cap {args.memory_gib:g} GiB per path"
        )
        + (f", lean chunk_size={args.chunk_size}" if args.chunk_size else "")
    )
    header = (
        f"{'path':<43} {'extra MiB':>9} {'vs torchrl':>10} {'x logits':>8} {'peak MiB':>9} "
        f"{'saved MiB':>9} {'time s':>7} {'time ratio':>10}"
    )
    print(header)
    print("-" * len(header))
    ref = results.get("torchrl", {})
    for path, r in results.items():
        if "error" in r:
            print(f"{NAMES[path]:<43} did not fit in {args.memory_gib:g} GiB: {r['error']}")
            continue
        ratio = r["extra_bytes"] / ref["extra_bytes"] if "extra_bytes" in ref else float("nan")
        time_ratio = r["median_s"] / ref["median_s"] if "median_s" in ref else float("nan")
        print(
            f"{NAMES[path]:<43} {r['extra_bytes'] / MIB:>9.0f} {ratio:>10.3f} "
            f"{r['extra_bytes'] / logits:>8.2f} {r['peak_bytes'] / MIB:>9.0f} "
            f"{r['saved_bytes'] / MIB:>9.0f} {r['median_s']:>7.2f} {time_ratio:>10.2f}"
        )
    if "values" not in ref:
        return
    print()
    for path, r in results.items():
        if path in ("torchrl", "wrapper") or "values" not in r:
            continue
        gaps = ", ".join(f"{k} {abs(r['values'][k] - ref['values'][k]):.1e}" for k in VALUE_KEYS)
        grad = relative_gap(r["grads"], ref["grads"])
        print(f"|{path} - torchrl|: {gaps}, gradient (relative, max) {grad:.1e}")


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments)
    else:
        main(arguments)
