"""Peak memory and time of a GRPO loss on torchrl's LLM stack: torchrl's GRPOLoss against ours.

Run (a minute or two on one CPU thread, ~4 GB of RAM)::

    .venv/bin/python benchmarks/llm_loss_memory.py
    .venv/bin/python benchmarks/llm_loss_memory.py --batch 2 --length 64 --vocab 4096  # quick

Both losses take the same ``TransformersWrapper(generate=False)`` around a one-layer ``Qwen2``
with a ``V``-token vocabulary (built locally), with ``masking_strategy="sft"`` and the entropy
bonus on, on the same ragged lazy stack of ``B`` sequences of ``T/2`` to ``T`` tokens (prompt
of 32 tokens). Each path runs one forward+backward in a fresh process; a third process runs only
the wrapper (its logits and a backward through them), the part both losses share.

How memory is measured: PyTorch keeps no allocator statistics on CPU, so each process reads its
peak resident set size (``getrusage(RUSAGE_SELF).ru_maxrss``), reported with its difference to
torchrl's path. The wrapper-only row shows how much of the peak is the wrapper's own (its
forward pads and unpads the ``[B, T, V]`` logits). A second, allocator-independent column sums
the distinct storages autograd saves for backward during the whole step
(``torch.autograd.graph.saved_tensors_hooks``): the model's are the same in every row, so the
differences are the losses'. Time is the median of ``--repeats`` passes after the measured one,
as a ratio to torchrl's path in the same run. Values (``loss_objective``, ``loss_entropy``,
``ESS``) are compared across the processes.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
import warnings

import torch

PATHS = ("wrapper", "torchrl", "ours")
VALUE_KEYS = ("loss_objective", "loss_entropy", "ESS")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="B, sequences")
    parser.add_argument("--length", type=int, default=256, help="T, most tokens per sequence")
    parser.add_argument("--vocab", type=int, default=32768, help="V, vocabulary size")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per path")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def make_wrapper(vocab: int):
    from tokenizers import Tokenizer, models
    from torchrl.modules.llm import TransformersWrapper
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = {f"t{i}": i for i in range(vocab - 1)} | {"<pad>": vocab - 1}
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>")
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=vocab - 1,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).eval()
    wrapper = TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        input_key=("tokens", "full"),
        generate=False,
        return_log_probs=True,
        pad_output=False,
    )
    return wrapper, model


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

    if path == "wrapper":  # the logits the losses start from, and a backward through them

        def step(batch):
            dist = _compat.llm_masked_dist(wrapper, batch.copy(), "sft")
            dist.logits.sum().backward()
            return {}

        return step
    if path == "torchrl":
        from torchrl.objectives.llm import GRPOLoss
    else:
        from torchrl_grpo import GRPOLoss
    loss = GRPOLoss(wrapper, masking_strategy="sft", entropy_coeff=0.01)

    def step(batch):
        out = loss(batch.copy())
        (out.loss_objective + out.loss_entropy).backward()
        return {k: float(out.get(k).detach()) for k in VALUE_KEYS}

    return step


def worker(args) -> None:
    import tensordict

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    with tensordict.set_list_to_stack(True):
        wrapper, model = make_wrapper(args.vocab)
        step = make_step(args.worker, wrapper)
        step(make_batch(2, 8, args.vocab, seed=1))  # warm-up at a tiny size
        model.zero_grad(set_to_none=True)
        batch = make_batch(args.batch, args.length, args.vocab)
        tokens = sum(t.numel() for t in batch.get(("tokens", "full"), as_list=True))
        saved = {}

        def pack(x):
            saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            values = step(batch)
        first = time.perf_counter() - start
        peak = max_rss_bytes()
        times = []
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step(batch)
            times.append(time.perf_counter() - start)
    result = {
        "peak_bytes": peak,
        "saved_bytes": sum(saved.values()),
        "logits_bytes": args.batch * args.length * args.vocab * 4,
        "tokens": tokens,
        "first_s": first,
        "median_s": statistics.median(times) if times else first,
        "values": values,
    }
    print(json.dumps(result))


def run_path(path: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", path]
    for name in ("batch", "length", "vocab", "repeats", "threads"):
        cmd += [f"--{name}", str(getattr(args, name))]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{path} worker failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(args) -> None:
    mib = 2**20
    results = {path: run_path(path, args) for path in PATHS}
    base = results["wrapper"]
    logits = base["logits_bytes"]  # B x T x V float32: the padded logits' size
    print(
        f"GRPOLoss on TransformersWrapper (1-layer Qwen2), masking_strategy='sft', "
        f"B={args.batch} ragged T<={args.length} ({base['tokens']} tokens) V={args.vocab}, "
        f"padded logits {logits / mib:.0f} MiB float32, {args.threads} thread(s), "
        f"median of {args.repeats}"
    )
    header = (
        f"{'path':<34} {'peak MiB':>9} {'vs torchrl':>11} {'x logits':>9} {'saved MiB':>10} "
        f"{'time s':>8} {'time ratio':>11}"
    )
    print(header)
    print("-" * len(header))
    names = {
        "wrapper": "wrapper only (logits, backward)",
        "torchrl": "torchrl.objectives.llm.GRPOLoss",
        "ours": "torchrl_grpo.GRPOLoss",
    }
    ref = results["torchrl"]
    for path in PATHS:
        r = results[path]
        diff = r["peak_bytes"] - ref["peak_bytes"]
        print(
            f"{names[path]:<34} {r['peak_bytes'] / mib:>9.0f} {diff / mib:>+11.0f} "
            f"{diff / logits:>+9.2f} {r['saved_bytes'] / mib:>10.0f} {r['median_s']:>8.2f} "
            f"{r['median_s'] / ref['median_s']:>11.2f}"
        )
    diffs = {
        k: abs(results["torchrl"]["values"][k] - results["ours"]["values"][k]) for k in VALUE_KEYS
    }
    print()
    print("max |torchrl - ours|: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments)
    else:
        main(arguments)
