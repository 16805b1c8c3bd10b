"""One distillation batch looked at closely: are the stored log-probs the models' own, does the
loss's gradient point along the exact reverse KL's, and what one epoch at each learning rate does
to the exact reverse KL on the batch's own tokens.

    .venv/bin/python benchmarks/llm_distill_step.py --teacher runs/teacher/<run>
    .venv/bin/python benchmarks/llm_distill_step.py --lrs 5e-4 1e-4 2e-5 -- \\
        --task running-sum --teacher runs/rs_teacher/<run> --seed 3

Everything after ``--`` is ``examples/llm_distill.py``'s flags (``--teacher`` is needed). The
student gets the example's warm start (``--seed``), then one batch is collected and scored as in
the example's distillation run, its ``--distill-flags`` applied (``TeacherLogProbs``, then
``MCAdvantage(estimator=Distillation(0, --beta, baseline=--baseline))``). Printed:

* the largest difference, on the response tokens, between the log-probs stored in the batch
  (student and teacher) and those of a plain forward pass of each model on the same tokens;
* the cosine between the loss's gradient on the whole batch and the gradient of the exact
  reverse KL (``KL(student || teacher)`` over the vocabulary, at every response position of the
  batch): near 1 when the sampled estimate points where the objective goes down;
* for each ``--lrs`` learning rate, the exact reverse KL on the batch after one epoch of the
  example's optimization (Adam, ``--minibatch`` rows a step, gradients clipped at 1), from the
  same weights. Where it rises, a step of that size overshoots this teacher's objective.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import llm_distill  # noqa: E402  (examples/ is not a package)

llm_grpo = llm_distill.llm_grpo


def one_batch(run):
    """The warm-started student, the teacher, and one scored batch of ``run`` (the example's
    distillation-alone run) with its advantages."""
    cfg = run.settings
    task = llm_grpo.make_task(cfg)
    tokenizer = llm_grpo.make_tokenizer(task.alphabet)
    teacher_model, teacher = llm_distill.load_teacher(cfg, task, tokenizer)
    torch.manual_seed(cfg.seed)
    length = task.prompt_length + cfg.max_new_tokens
    student = llm_distill.suppress_padding(llm_grpo.make_model(cfg, tokenizer, length), tokenizer)
    gen = torch.Generator().manual_seed(cfg.seed)
    evaluation = torch.Generator().manual_seed(1234)  # the example's held-out prompts
    held_out = set(llm_grpo.draw_problems(task, evaluation, cfg.eval_prompts, set())["query"])
    validation = llm_grpo.draw_problems(task, gen, 200, held_out)
    greedy = llm_grpo.make_sampler(student, tokenizer, cfg, greedy=True)
    val_accuracy = llm_grpo.GreedyAccuracy(tokenizer, task, validation, greedy)
    llm_grpo.warm_start(student, tokenizer, cfg, task, gen, held_out, val_accuracy)
    ref = copy.deepcopy(student).requires_grad_(False) if cfg.kl_coeff else None
    collector, rb = llm_distill.make_collector(
        cfg, task, student, ref, tokenizer, gen, held_out, teacher, run
    )
    for _ in collector:
        if len(rb):
            break
    batch = rb[:]
    collector.shutdown()
    return student, teacher_model, tokenizer, batch


def taken_log_probs(model, tokens, mask):
    """The log-prob of each token given the ones before it (0 at the first), ``(B, T)``."""
    logits = model(input_ids=tokens, attention_mask=mask.long()).logits.float()
    taken = torch.zeros(tokens.shape)
    taken[:, 1:] = logits.log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    return taken


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[5e-4, 1e-4, 2e-5])
    parser.add_argument("example", nargs="*", help="examples/llm_distill.py's flags (after --)")
    args = parser.parse_args(argv)
    cfg = llm_grpo.parse_args(args.example, settings_cls=llm_distill.Settings)
    if not cfg.teacher:
        parser.error("--teacher <examples/llm_grpo.py run folder> after --")
    run = llm_distill.three_runs(cfg)[1]  # distillation alone, its --distill-flags applied
    cfg = run.settings
    torch.set_num_threads(cfg.threads)
    hf_logging.set_verbosity_error()
    student, teacher, tokenizer, batch = one_batch(run)
    tokens, mask = batch["tokens", "full"], batch["masks", "all_attention_mask"]
    response = llm_distill.response_mask(batch)
    stored = ("next", "log_probs", "full"), ("next", "teacher_log_probs", "full")
    for name, key, model in zip(("student", "teacher"), stored, (student, teacher)):
        with torch.no_grad():
            own = taken_log_probs(model, tokens, mask)
        gap = (batch[key] - own)[response].abs().max().item()
        print(f"stored {name} log-probs vs a forward pass, largest gap on the response: {gap:.1e}")
    print(one_line_gradients(cfg, student, teacher, tokenizer, batch, response))
    weights = copy.deepcopy(student.state_dict())
    before = llm_distill.reverse_kl(student, teacher, tokens, response)
    print(f"\n{tuple(tokens.shape)} tokens; exact reverse KL on the batch before: {before:.4f}")
    print(f"{'learning rate':>13}  {'after one epoch':>15}")
    for lr in args.lrs:
        student.load_state_dict(weights)
        one_epoch(cfg, student, tokenizer, batch, lr)
        after = llm_distill.reverse_kl(student, teacher, tokens, response)
        print(f"{lr:>13.1e}  {after:>15.4f}")


def one_line_gradients(cfg, student, teacher, tokenizer, batch, response):
    """The cosine of the loss's gradient on the whole batch and the exact reverse KL's."""
    params = [p for p in student.parameters() if p.requires_grad]
    kl = llm_distill.exact_reverse_kl(student, teacher, batch["tokens", "full"], response)
    loss_fn = llm_grpo.make_loss(llm_grpo.make_scorer(student, tokenizer, cfg), cfg)
    exact, sampled = (
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(value, params)])
        for value in (kl, loss_fn(batch).total_loss())
    )
    cosine = torch.nn.functional.cosine_similarity(exact, sampled, dim=0).item()
    return f"cosine of the loss's gradient and the exact reverse KL's, whole batch: {cosine:.3f}"


def one_epoch(cfg, student, tokenizer, batch, lr: float) -> None:
    """The example's optimization of one batch, once over it, from a fresh Adam."""
    loss_fn = llm_grpo.make_loss(llm_grpo.make_scorer(student, tokenizer, cfg), cfg)
    optim = torch.optim.Adam(student.parameters(), lr=lr)
    torch.manual_seed(0)  # the same minibatches at every learning rate
    for rows in torch.randperm(len(batch)).split(cfg.minibatch):
        loss = loss_fn(batch[rows]).total_loss()
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optim.step()


if __name__ == "__main__":
    main()
