"""Operators dispatched and host synchronisations of a GRPO step's parts, side by side in one run.

    .venv/bin/python benchmarks/launches.py            # every table (about a minute)
    .venv/bin/python benchmarks/launches.py --only scoring
    .venv/bin/python benchmarks/launches.py --device cuda   # the same counts on a GPU

On an accelerator a small step is launch-bound: each operator is a kernel launch or more, and
each value the host reads back waits for the device. Both are counted at torch's dispatcher
(:func:`torchrl_grpo.launches.count_launches`), forward and backward, so the counts here are
those of the same code on a GPU, measured on a CPU.

Scoring step: one forward and backward of ``GRPOLoss`` (``masking_strategy="sft"``, entropy bonus
on) on a 2-layer ``Qwen2ForCausalLM`` at toy widths (``V=4,096``), completions of 64 tokens, on
three batches: one group of 8 completions of a 256-token prompt; 8 groups of 8 with prompts of
8 lengths (96..236); and 8 dialogs of 3 turns (a 128-token prompt, each turn a 32-token answer
and a 16-token reply, every turn a row whose tokens are the dialog so far). Paths: torchrl's
``GRPOLoss`` on ``TransformersWrapper`` (full logits); this package's ``GRPOLoss`` on
``LeanTransformersWrapper`` scoring each row from scratch (``share_prefix=False``, "response
only"); and the default, each shared prefix once ("shared"). Each is counted on its second call
(the first runs the wrapper's one-time checks).

Insertion: one ``rb.extend`` of 512 and of 4,096 four-step trajectories (groups of 8) into a
``ReplayBuffer`` over a ``LazyTensorStorage``, with ``MCAdvantage`` and without a transform.

Targets (issue 39): the shared path at most 1.2x the response-only path's operators and at
most torchrl's; each of our paths' count at 8 groups at most 1.5x its count at 1 group; an
insertion at most 2 synchronisations.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from tensordict import TensorDict, lazy_stack, set_list_to_stack

from torchrl_grpo.launches import count_launches

PATHS = {
    "torchrl": "torchrl GRPOLoss + TransformersWrapper",
    "response": "lean, response only",
    "shared": "lean, shared prefix (default)",
}
VOCAB = 4096
RESPONSE = 64


def tokenizer_and_model(layers: int = 2, device: str = "cpu"):
    """A word-level tokenizer of ``VOCAB`` ids and a tiny Qwen2 (hidden 64, 2 layers)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = {f"w{i}": i for i in range(VOCAB - 1)} | {"<pad>": VOCAB - 1}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="<pad>")), pad_token="<pad>"
    )
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        pad_token_id=VOCAB - 1,
    )
    return tokenizer, Qwen2ForCausalLM(config).to(device).eval()


def _row(prompt: torch.Tensor, full: torch.Tensor, g: torch.Generator) -> TensorDict:
    from torchrl.modules.llm.policies.common import Tokens

    return TensorDict(
        {
            "tokens": Tokens(full=full, prompt=prompt),
            "log_probs": TensorDict(full=-8.0 + 0.1 * torch.randn(len(full), generator=g)),
            "advantage": torch.randn(1, 1, generator=g),
        }
    )


def groups_batch(prompts: list[int], group: int = 8, seed: int = 0):
    """``len(prompts)`` groups of ``group`` completions of ``RESPONSE`` tokens, a lazy stack."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length in prompts:
        prompt = torch.randint(VOCAB - 1, (length,), generator=g)
        for _ in range(group):
            full = torch.cat([prompt, torch.randint(VOCAB - 1, (RESPONSE,), generator=g)])
            rows.append(_row(prompt, full, g))
    return lazy_stack(rows)


def dialogs_batch(dialogs: int = 8, turns: int = 3, prompt: int = 128, seed: int = 0):
    """``dialogs`` dialogs of one prompt, ``turns`` rows each: turn ``k``'s prompt is the dialog
    so far (answers of 32 tokens, replies of 16), its tokens the prompt and its answer."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(VOCAB - 1, (prompt,), generator=g)
    rows = []
    for _ in range(dialogs):
        history = start
        for _ in range(turns):
            full = torch.cat([history, torch.randint(VOCAB - 1, (32,), generator=g)])
            rows.append(_row(history, full, g))
            history = torch.cat([full, torch.randint(VOCAB - 1, (16,), generator=g)])
    return lazy_stack(rows)


BATCHES = {
    "1 group of 8, prompt 256": lambda: groups_batch([256]),
    "8 groups of 8, prompts 96..236": lambda: groups_batch(list(range(96, 237, 20))),
    "8 dialogs of 3 turns": lambda: dialogs_batch(),
}


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
    wrapper = LeanTransformersWrapper(model, share_prefix=path == "shared", **kwargs)
    return GRPOLoss(wrapper, masking_strategy="sft", entropy_coeff=0.01)


def scoring_counts(path: str, batch, model, tokenizer):
    """The launches of one forward and backward (the second call), and whether it shared."""
    loss = make_loss(path, model, tokenizer)

    def step():
        out = loss(batch.copy())
        (out.loss_objective + out.loss_entropy).backward()

    step()  # the wrapper's first-call checks
    model.zero_grad(set_to_none=True)
    with count_launches() as launches:
        step()
    sharing = getattr(loss.actor_network, "sharing", None)
    shared = bool(sharing and sharing.checked and sharing.off_reason is None)
    return launches, shared


def scoring_table(device: str) -> dict:
    tokenizer, model = tokenizer_and_model(device=device)
    results = {}
    with set_list_to_stack(True):
        for name, make in BATCHES.items():
            batch = make().to(device)
            results[name] = {p: scoring_counts(p, batch, model, tokenizer) for p in PATHS}
    print(f"\nScoring step (GRPOLoss forward + backward, 2-layer Qwen2, V={VOCAB}), {device}")
    header = f"{'batch':<32} {'path':<40} {'operators':>9} {'syncs':>6} {'vs resp.':>8}"
    print(header + "\n" + "-" * len(header))
    for name, row in results.items():
        response = row["response"][0].ops
        for path, (launches, shared) in row.items():
            note = "  (prefixes shared)" if shared else ""
            print(
                f"{name:<32} {PATHS[path]:<40} {launches.ops:>9} {launches.syncs:>6} "
                f"{launches.ops / response:>8.2f}{note}"
            )
    first, many = list(results.values())[:2]
    growth = ", ".join(f"{p} {many[p][0].ops / first[p][0].ops:.2f}x" for p in PATHS)
    print(f"8 groups against 1, operators: {growth}")
    return results


def insertion_counts(trajectories: int, device: str, transform: bool):
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    from torchrl_grpo import MCAdvantage

    steps = 4
    n = trajectories * steps
    g = torch.Generator().manual_seed(0)
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[steps - 1 :: steps] = True
    seeds = torch.arange(trajectories).div(8, rounding_mode="floor").repeat_interleave(steps)
    data = TensorDict(
        {
            "observation": torch.randn(n, 4, generator=g),
            "action": torch.randint(2, (n,), generator=g),
            "seed": seeds,
            "next": {"reward": torch.randn(n, 1, generator=g), "done": done, "terminated": done},
        },
        batch_size=[n],
        device=device,
    )
    rb = ReplayBuffer(storage=LazyTensorStorage(10 * n, device=device))
    if transform:
        rb.append_transform(MCAdvantage(grpo_size=8, prompt_key="seed"))
    rb.extend(data.clone())  # storage initialised, first-call work done
    with count_launches() as launches:
        rb.extend(data.clone())
    return launches


def insertion_table(device: str) -> None:
    print(f"\nOne insertion (rb.extend, LazyTensorStorage, 4-step trajectories, G=8), {device}")
    header = f"{'trajectories':>12} {'path':<24} {'operators':>9} {'syncs':>6}  sync causes"
    print(header + "\n" + "-" * len(header))
    for trajectories in (512, 4096):
        for name, transform in (("plain extend", False), ("MCAdvantage", True)):
            launches = insertion_counts(trajectories, device, transform)
            causes = ", ".join(f"{k} {v}" for k, v in sorted(launches.by_sync.items()))
            print(f"{trajectories:>12} {name:<24} {launches.ops:>9} {launches.syncs:>6}  {causes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", nargs="+", choices=("scoring", "insertion"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    only = set(args.only or ("scoring", "insertion"))
    if "scoring" in only:
        scoring_table(args.device)
    if "insertion" in only:
        insertion_table(args.device)


if __name__ == "__main__":
    main()
