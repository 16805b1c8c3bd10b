"""Time and peak memory of a GRPO scoring step: the head on what is read, each prompt once.

Run (about 20 minutes on this 2-core CPU; the first shape is the target's)::

    .venv/bin/python benchmarks/llm_scoring.py    # P=1024 R=256, P=256 R=64, 8 groups P=144..256
    .venv/bin/python benchmarks/llm_scoring.py --shapes 64x16 --vocab 4096 --layers 1  # quick
    .venv/bin/python benchmarks/llm_scoring.py --device cuda --dtype bfloat16  # on a GPU
    .venv/bin/python benchmarks/llm_scoring.py --profile ...   # operators and kernels launched

One GRPO group (a shape ``PxR``), or ``N`` groups whose prompts have ``N`` lengths from ``P`` down
by ``P/16`` (a shape ``PxRxN``): ``G`` completions of ``R`` tokens sampled from each prompt, as a
ragged lazy stack (``("tokens", "prompt")``, ``("tokens", "full")``, stored log-probs, one
advantage per completion). The model is a ``Qwen2ForCausalLM`` built locally at Qwen2.5-0.5B's
widths (``H=896``, MLP 4,864, 14 heads, 2 key/value heads, tied embeddings, ``V=151,936``) with
``--layers`` layers. Each path runs one forward and backward of ``GRPOLoss``
(``masking_strategy="sft"``, entropy bonus on) in a fresh process:

* ``torchrl``: torchrl's ``GRPOLoss`` on torchrl's ``TransformersWrapper`` (full logits);
* ``lean, head everywhere``: this package's ``GRPOLoss`` on ``LeanTransformersWrapper`` as it was
  before the head ran on the read positions only (the chunked head at every position, every row
  from scratch: ``share_prefix=False`` and the distribution's selection of its mask positions
  replaced by every position, which is that earlier code's computation);
* ``lean, response only``: ``share_prefix=False``: the head on the loss's positions only;
* ``lean, shared prefix`` (the default): the prompts and the completions after them packed into
  one pass of the body (each prompt once), and the head on the loss's positions only.

Memory as ``llm_loss_memory.py`` measures it: on the CPU the process's peak resident set beyond
what it held before the step (``ru_maxrss``), each process capped at ``--memory-gib`` of address
space (a path that does not fit prints so); on a GPU the allocator's peak beyond what was
allocated. Time: the median of ``--repeats`` passes after the first, and its ratio to the lean
path with the head everywhere ("today's lean path") and to the response-only path. Values
(``loss_objective``, ``loss_entropy``, ``ESS``) and a sample of the gradient are compared
with the head-everywhere path.
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
from llm_loss_memory import max_rss_bytes, rss_bytes, sync, word_tokenizer  # this folder's

PATHS = ("torchrl", "everywhere", "response", "shared")
NAMES = {
    "torchrl": "torchrl GRPOLoss + TransformersWrapper",
    "everywhere": "lean, head everywhere (before)",
    "response": "lean, response only",
    "shared": "lean, shared prefix (default)",
}
VALUE_KEYS = ("loss_objective", "loss_entropy", "ESS")
MIB = 2**20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["1024x256", "256x64", "256x64x8"],
        help="PxR each (one group of G), or PxRxN (N groups, prompts of N lengths from P down)",
    )
    parser.add_argument("--group", type=int, default=8, help="G, completions of the prompt")
    parser.add_argument("--vocab", type=int, default=151936, help="V")
    parser.add_argument("--hidden", type=int, default=896, help="H (Qwen2.5-0.5B's)")
    parser.add_argument("--mlp", type=int, default=4864, help="MLP width (Qwen2.5-0.5B's)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=1, help="timed passes after the first")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--memory-gib", type=float, default=20.0, help="address space per path")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more pass under torch.profiler: operators and device kernels launched, and "
        "each path's costliest operators (on stderr)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # "path:PxR"
    return parser.parse_args(argv)


def make_model(args):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = word_tokenizer(args.vocab)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.mlp,
        num_hidden_layers=args.layers,
        num_attention_heads=14 if args.hidden % 14 == 0 else 2,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=args.vocab - 1,
        tie_word_embeddings=True,
    )
    with torch.device(args.device):  # initialised where it runs (24 layers take a while on a CPU)
        model = Qwen2ForCausalLM(config)
    model = model.to(args.device, getattr(torch, args.dtype)).eval()
    return model, tokenizer


def prompt_lengths(prompt: int, groups: int) -> list[int]:
    """The prompt length of each group: ``P``, then ``P/16`` shorter for each further group."""
    return [prompt - k * max(1, prompt // 16) for k in range(groups)]


def make_batch(group: int, prompt: int, response: int, vocab: int, seed: int = 0, groups=1):
    from tensordict import TensorDict, lazy_stack
    from torchrl.modules.llm.policies.common import Tokens

    g = torch.Generator().manual_seed(seed)
    steps = []
    for length in prompt_lengths(prompt, groups):
        shared = torch.randint(vocab - 1, (length,), generator=g)
        for _ in range(group):
            full = torch.cat([shared, torch.randint(vocab - 1, (response,), generator=g)])
            steps.append(
                TensorDict(
                    {
                        "tokens": Tokens(full=full, prompt=shared.clone()),
                        "log_probs": TensorDict(full=-12.0 + torch.randn(len(full), generator=g)),
                        "advantage": torch.randn(1, 1, generator=g),
                    }
                )
            )
    return lazy_stack(steps)


def make_loss(path: str, model, tokenizer):
    from torchrl.modules.llm import TransformersWrapper

    from torchrl_grpo import GRPOLoss, LeanTransformersWrapper

    kwargs = dict(
        tokenizer=tokenizer,
        input_mode="tokens",
        input_key=("tokens", "full"),
        generate=False,
        return_log_probs=True,
        pad_output=False,
    )
    if path == "torchrl":
        from torchrl.objectives.llm import GRPOLoss as TorchrlGRPOLoss

        return TorchrlGRPOLoss(TransformersWrapper(model, **kwargs), entropy_coeff=0.01)
    if path == "everywhere":
        head_everywhere()
    wrapper = LeanTransformersWrapper(model, share_prefix=path == "shared", **kwargs)
    return GRPOLoss(wrapper, masking_strategy="sft", entropy_coeff=0.01)


def head_everywhere() -> None:
    """The lean distribution as it was: the chunked head at every position, then masked."""
    from torchrl_grpo.llm import lean_wrapper

    selective = lean_wrapper._at_positions

    def every_position(hidden, where, weight, tokens, bias=None, chunk_size=None, index=None):
        if index is None:
            index = where.reshape(-1).nonzero()[:, 0]
        keep = torch.zeros(tokens.numel(), dtype=torch.bool, device=tokens.device)
        keep = keep.index_fill(0, index, True).view(tokens.shape)
        everywhere = torch.arange(tokens.numel(), device=tokens.device)
        log_prob, entropy = selective(hidden, None, weight, tokens, bias, chunk_size, everywhere)
        return log_prob * keep, entropy * keep

    lean_wrapper._at_positions = every_position


def worker(args) -> None:
    import tensordict

    path, shape = args.worker.split(":")
    prompt, response, groups = parse_shape(shape)
    device = torch.device(args.device)
    accelerator = device.type != "cpu"
    if not accelerator:
        limit = int(args.memory_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    with tensordict.set_list_to_stack(True):
        model, tokenizer = make_model(args)
        loss = make_loss(path, model, tokenizer)

        def step(batch):
            out = loss(batch.copy())
            (out.loss_objective + out.loss_entropy).backward()
            return {k: float(out.get(k).detach()) for k in VALUE_KEYS}

        step(make_batch(2, 40, 4, args.vocab, seed=1).to(device))  # warm-up at a tiny size
        model.zero_grad(set_to_none=True)
        batch = make_batch(args.group, prompt, response, args.vocab, groups=groups).to(device)
        if accelerator:
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if accelerator else rss_bytes()
        start = time.perf_counter()
        try:
            values = step(batch)
        except (RuntimeError, MemoryError) as err:
            tried = re.search(r"allocate (\d+) bytes", str(err))
            what = f"{int(tried[1]) / 2**30:.1f} GiB" if tried else str(err)[:100]
            print(json.dumps({"error": f"out of memory: could not allocate {what} more"}))
            return
        sync(device)
        times = [time.perf_counter() - start]
        peak = torch.cuda.max_memory_allocated(device) if accelerator else max_rss_bytes()
        grads = [p.grad.flatten()[::997] for p in model.parameters() if p.grad is not None]
        grads = torch.cat(grads).float().tolist()
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step(batch)
            sync(device)
            times.append(time.perf_counter() - start)
        launched = profiled(step, batch, model, device, path) if args.profile else {}
    median = statistics.median(times[1:] if len(times) > 1 else times)
    sharing = getattr(loss.actor_network, "sharing", None)
    shared = bool(sharing and sharing.checked and sharing.off_reason is None)
    result = {"extra": peak - before, "s": median, "values": values, "grads": grads}
    result |= launched
    print(json.dumps(result | {"shared": shared}))


def profiled(step, batch, model, device, path: str) -> dict:
    """One more pass under ``torch.profiler``: the operators dispatched (``aten::`` calls, each
    a kernel launch or more on a GPU) and the device kernels run; the costliest operators go to
    stderr. Where a GPU waits on the host, the launches are the time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    accelerator = device.type != "cpu"
    if accelerator:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=activities) as prof:
        step(batch)
        sync(device)
    events = prof.events()
    ops = sum(1 for e in events if e.name.startswith("aten::"))
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    sort = "self_cuda_time_total" if accelerator else "self_cpu_time_total"
    print(f"profile of {path}:", file=sys.stderr)
    print(prof.key_averages().table(sort_by=sort, row_limit=12), file=sys.stderr)
    return {"ops": ops, "kernels": kernels}


def run_path(path: str, shape: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", f"{path}:{shape}"]
    for name in ("group", "vocab", "hidden", "mlp", "layers", "dtype", "repeats", "threads"):
        cmd += [f"--{name}", str(getattr(args, name))]
    cmd += ["--device", args.device, "--memory-gib", str(args.memory_gib)]
    cmd += ["--profile"] if args.profile else []
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if args.profile:
        sys.stderr.write(proc.stderr)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(lines[-1])


def parse_shape(shape: str) -> tuple[int, int, int]:
    """``PxR`` (one group) or ``PxRxN`` (``N`` groups, prompts of ``N`` lengths from ``P``)."""
    parts = [int(x) for x in shape.split("x")]
    return parts[0], parts[1], parts[2] if len(parts) > 2 else 1


def table(shape: str, results: dict, args) -> None:
    prompt, response, groups = parse_shape(shape)
    lengths = prompt_lengths(prompt, groups)
    prompts = f"P={prompt}" if groups == 1 else f"{groups} groups, P={lengths[-1]}..{prompt}"
    print(
        f"\n{prompts} R={response} G={args.group}: Qwen2 {args.layers} layers H={args.hidden} "
        f"V={args.vocab}, {args.dtype}, {args.device}, {args.threads} thread(s), forward+backward"
    )
    header = (
        f"{'path':<40} {'time s':>7} {'vs before':>9} {'vs resp.':>8} {'extra MiB':>9} "
        f"{'vs before':>9}"
    )
    print(header + "\n" + "-" * len(header))
    before, resp = results.get("everywhere", {}), results.get("response", {})
    for path, r in results.items():
        if "error" in r:
            print(f"{NAMES[path]:<40} did not run: {r['error']}")
            continue

        def ratio(ref, key, r=r):
            return f"{r[key] / ref[key]:.2f}" if key in ref else "-"

        print(
            f"{NAMES[path]:<40} {r['s']:>7.2f} {ratio(before, 's'):>9} {ratio(resp, 's'):>8} "
            f"{r['extra'] / MIB:>9.0f} {ratio(before, 'extra'):>9}"
            + ("  (prompt computed once)" if r.get("shared") else "")
        )
    launches = [(NAMES[p], r) for p, r in results.items() if "ops" in r]
    for name, r in launches:
        print(f"  {name}: {r['ops']} operators dispatched, {r['kernels']} device kernels")
    if "values" not in before:
        return
    for path, r in results.items():
        if path == "everywhere" or "values" not in r:
            continue
        gaps = ", ".join(f"{k} {abs(r['values'][k] - before['values'][k]):.1e}" for k in VALUE_KEYS)
        a, b = torch.tensor(r["grads"]), torch.tensor(before["grads"])
        grad = float((a - b).norm() / b.norm().clamp_min(1e-30))
        print(f"  |{path} - before|: {gaps}, gradient sample (relative norm) {grad:.1e}")


def main(args) -> None:
    for shape in args.shapes:
        results = {}
        for path in args.paths:
            print(f"running {NAMES[path]} at {shape} ...", file=sys.stderr, flush=True)
            results[path] = run_path(path, shape, args)
        table(shape, results, args)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments)
    else:
        main(arguments)
