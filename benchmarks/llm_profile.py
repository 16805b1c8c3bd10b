"""Where a GRPO step of examples/llm_grpo.py spends its time, phase by phase; prints two tables.

    .venv/bin/python benchmarks/llm_profile.py             # 12 steps at the example's defaults
    .venv/bin/python benchmarks/llm_profile.py --steps 4   # a quick run
    .venv/bin/python benchmarks/llm_profile.py -- --minibatch 64   # after --: example settings

The pipeline is the example's own (built by its ``make_collector``, ``make_loss``...), on a model
fresh from its config: the cost of a step does not depend on what the model has learnt. One GRPO
step is timed in the phases below, by wrapping the pipeline's own calls with a clock (wall time,
``time.perf_counter``, one torch thread, the garbage collector frozen as in the example):

* sampling: the env's reset (a batch of prompts), the sampling ``TransformersWrapper`` and the
  env's step (the reward), plus what the ``LLMCollector`` does around them; each of the four is
  also shown on its own (the env's ``reset`` and ``step`` and the collector's policy, wrapped);
* scoring: the two ``RetrieveLogProb`` passes (sampling policy and reference), the collector's
  ``postproc``;
* buffer: ``rb.extend`` (``MCAdvantage``, storage) and drawing the minibatches;
* loss: ``GRPOLoss`` forward, backward and the optimizer step, every minibatch of the step;
* evaluation: one greedy pass over the 500 held-out prompts (run every ``eval_every`` steps).

Each phase's row is the median over the steps (the first step is a warm-up and is dropped). The
second table puts torchrl's wrappers beside the model's own calls on the same batch: one sampling
call (``TransformersWrapper`` against ``model.generate``), one scoring call
(``TransformersWrapper(generate=False)`` against a forward pass and a ``log_softmax``), and one
loss forward and backward on a minibatch (``GRPOLoss`` on the scoring wrapper against the same
token-level surrogate computed on the model's logits). The
first table is printed twice: for the pipeline as the example builds it, and with its
``Contiguous`` transforms removed (torchrl's lazily stacked layout all the way), to show what
that one option buys. Run it alone on the machine (``flock /tmp/heavy.lock`` here): other jobs
inflate wall times.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import statistics
import time
import warnings
from pathlib import Path

import torch
from torchrl.envs import Transform

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llm_grpo.py"
PHASES = ("sampling", "scoring", "buffer", "loss", "evaluation")
# the sampling phase, part by part: the env's reset, the sampler, the env's step, the rest
SAMPLING_PARTS = ("env reset", "sampler", "env step", "collector, rest")


def load_example():
    spec = importlib.util.spec_from_file_location("llm_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Clock:
    """Wall time accumulated per name, by wrapping callables."""

    def __init__(self):
        self.times: dict[str, float] = {}

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start

        return timed


def profile_pipeline(ex, cfg, steps: int, contiguous: bool) -> dict[str, float]:
    """Median milliseconds per GRPO step of each phase (evaluation: per evaluation)."""
    if not contiguous:  # torchrl's layout all the way: the example's Contiguous does nothing

        class Identity(Transform):
            def forward(self, tensordict):
                return tensordict

        real_contiguous, ex.Contiguous = ex.Contiguous, Identity
    try:
        torch.manual_seed(0)
        task = ex.make_task(cfg)
        model, tokenizer = ex.tiny_qwen2(cfg, task)
        ref_model = copy.deepcopy(model).requires_grad_(False)
        gen = torch.Generator().manual_seed(0)
        eval_problems = ex.draw_problems(task, gen, cfg.eval_prompts, set())
        held_out = set(eval_problems["query"])
        collector, rb = ex.make_collector(cfg, task, model, ref_model, tokenizer, gen, held_out)
    finally:
        if not contiguous:
            ex.Contiguous = real_contiguous
    loss_fn = ex.make_loss(ex.make_scorer(model, tokenizer, cfg), cfg)
    eval_accuracy = ex.GreedyAccuracy(
        tokenizer, task, eval_problems, ex.make_sampler(model, tokenizer, cfg, greedy=True)
    )
    optim = torch.optim.Adam(model.parameters(), lr=cfg.lr)

    clock = Clock()
    collector.postproc = clock.wrap("scoring", collector.postproc)
    rb.extend = clock.wrap("extend", rb.extend)
    collector.env.reset = clock.wrap("env reset", collector.env.reset)
    collector.env.step = clock.wrap("env step", collector.env.step)  # the reset is not in it
    collector.policy = clock.wrap("sampler", collector.policy)
    batches = iter(collector)
    gc.collect()
    gc.freeze()  # as the example does before training
    rows = []
    for _ in range(steps + 1):
        clock.times.clear()
        start = time.perf_counter()
        next(batches)  # sampling, scoring, rb.extend
        collect = time.perf_counter() - start
        draw = update = 0.0
        for _ in range(cfg.epochs):  # as GRPOTrainer: each epoch draws every minibatch once
            minibatches = iter(rb)
            while True:
                start = time.perf_counter()
                batch = next(minibatches, None)
                draw += time.perf_counter() - start
                if batch is None:
                    break
                start = time.perf_counter()
                loss = loss_fn(batch).total_loss()
                optim.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optim.step()
                update += time.perf_counter() - start
        rb.empty()
        start = time.perf_counter()
        eval_accuracy()
        evaluation = time.perf_counter() - start
        scoring, extend = clock.times["scoring"], clock.times["extend"]
        sampling = collect - scoring - extend
        parts = {name: clock.times.get(name, 0.0) for name in SAMPLING_PARTS[:-1]}
        rows.append(
            {
                "sampling": sampling,
                **parts,
                "collector, rest": sampling - sum(parts.values()),
                "scoring": scoring,
                "buffer": extend + draw,
                "loss": update,
                "evaluation": evaluation,
            }
        )
    gc.unfreeze()
    names = (*PHASES, *SAMPLING_PARTS)
    return {name: 1000 * statistics.median(r[name] for r in rows[1:]) for name in names}


def best_ms(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def per_call(ex, cfg) -> list[tuple[str, float, float]]:
    """(call, through torchrl's wrappers ms, on the model itself ms) on one step's batch."""
    from tensordict import TensorDict

    task = ex.make_task(cfg)
    model, tokenizer = ex.tiny_qwen2(cfg, task)
    rows = cfg.prompts_per_step * cfg.group_size
    problems = ex.draw_problems(task, torch.Generator().manual_seed(0), rows, set())
    prompts = torch.tensor(tokenizer(list(problems["query"]))["input_ids"])
    sampler = ex.make_sampler(model, tokenizer, cfg)
    scorer = ex.make_scorer(model, tokenizer, cfg)

    def sample_wrapper():
        return sampler(TensorDict({("tokens", "prompt"): prompts}, batch_size=[rows]))

    def sample_model():
        return model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=cfg.max_new_tokens,
            do_sample=True,
            bad_words_ids=[[tokenizer.pad_token_id]],
        )

    full = sample_wrapper()
    tokens = full["tokens", "full"]
    mask = full["masks", "all_attention_mask"]

    @torch.no_grad()
    def score_wrapper():
        return scorer(full.select(("tokens", "full"), ("masks", "all_attention_mask")).copy())

    @torch.no_grad()
    def score_model():
        logits = model(tokens, attention_mask=mask).logits
        return logits.log_softmax(-1).gather(-1, tokens[..., None])

    # one minibatch as the loss reads it: the sampled tokens, stored log-probs, an advantage
    n = cfg.minibatch
    batch = full[:n].select(
        ("tokens", "full"), ("tokens", "prompt"), ("masks", "all_attention_mask")
    )
    with torch.no_grad():
        stored = score_wrapper()[:n]["log_probs", "full"]
    batch["next", "log_probs", "full"] = stored
    batch["next", "ref_log_probs", "full"] = stored
    batch["advantage"] = torch.randn(n, 1, 1, generator=torch.Generator().manual_seed(0))
    loss_fn = ex.make_loss(scorer, cfg)
    response = mask[:n].clone()
    response[:, : prompts.shape[-1]] = False

    def loss_wrapper():
        loss_fn(batch).total_loss().backward()

    def loss_model():  # the same token-level surrogate at ratio 1, on the model directly
        logits = model(tokens[:n], attention_mask=mask[:n]).logits[:, :-1]
        log_prob = logits.log_softmax(-1).gather(-1, tokens[:n, 1:, None])[..., 0]
        surrogate = -(log_prob - log_prob.detach()).exp() * batch["advantage"][:, :, 0]
        (surrogate * response[:, 1:]).sum().div(response.sum()).backward()

    with torch.no_grad():
        rows_ = [
            (f"sample {rows} completions", best_ms(sample_wrapper), best_ms(sample_model)),
            (f"score {rows} sequences", best_ms(score_wrapper), best_ms(score_model)),
        ]
    rows_.append((f"loss, {n} sequences, +backward", best_ms(loss_wrapper), best_ms(loss_model)))
    return rows_


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="timed GRPO steps per layout")
    parser.add_argument("example_args", nargs="*", help="example settings (after --)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    ex = load_example()
    cfg = ex.parse_args(args.example_args)
    torch.set_num_threads(cfg.threads)
    rows = cfg.prompts_per_step * cfg.group_size
    batches = -(-rows // cfg.minibatch) * cfg.epochs
    print(
        f"one GRPO step of examples/llm_grpo.py: {cfg.prompts_per_step} prompts x "
        f"{cfg.group_size} completions, {batches} minibatches of {cfg.minibatch}; "
        f"median of {args.steps} steps, ms"
    )
    profiles = {
        "as built": profile_pipeline(ex, cfg, args.steps, contiguous=True),
        "lazy stacks": profile_pipeline(ex, cfg, args.steps, contiguous=False),
    }
    header = f"{'phase':<22}" + "".join(f"{name:>14}" for name in profiles)
    print(header)
    print("-" * len(header))
    for phase in PHASES:
        label = phase if phase != "evaluation" else "evaluation (each)"
        print(f"{label:<22}" + "".join(f"{p[phase]:>14.0f}" for p in profiles.values()))
        if phase == "sampling":
            for part in SAMPLING_PARTS:
                print(f"  {part:<20}" + "".join(f"{p[part]:>14.0f}" for p in profiles.values()))
    step_ms = {name: sum(p[k] for k in PHASES[:-1]) for name, p in profiles.items()}
    print(f"{'step (w/o evaluation)':<22}" + "".join(f"{v:>14.0f}" for v in step_ms.values()))
    print()
    header = f"{'one call, ms':<32}{'torchrl wrapper':>16}{'model itself':>14}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    for name, wrapper_ms, model_ms in per_call(ex, cfg):
        print(f"{name:<32}{wrapper_ms:>16.0f}{model_ms:>14.0f}{wrapper_ms / model_ms:>7.1f}x")


if __name__ == "__main__":
    main()
