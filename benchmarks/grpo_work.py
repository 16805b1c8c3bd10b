"""One GRPO step's wall time and work, measured the same way on both sides of a comparison.

Imported by the two runners of benchmarks/trl_side_by_side.py: benchmarks/llm_grpo_steps.py
(examples/llm_grpo.py on torchrl) and benchmarks/trl_grpo_worker.py (TRL's ``GRPOTrainer``),
each in its own virtual environment; it needs torch only. Each runner calls
:meth:`StepClock.start` where a GRPO step begins (training starts, or the previous step's
evaluation is over) and :meth:`StepClock.stop` where its optimization ends, and prints
:meth:`StepClock.report`: two lines the comparison reads::

    STEPS budget_s=190.0 step_s=1.612,1.587,...
    WORK completions=512.0 optimizer_steps=16.0 policy_scoring_rows=512.0 ...

With ``count_work``, the work between ``start`` and ``stop`` is counted, step by step (the
``WORK`` line holds the mean per step):

* ``completions``: sequences sampled (rows of a generation's first forward, the prompt);
* ``optimizer_steps``: calls of the optimizer's ``step``;
* ``loss_rows``: rows scored with gradients (the loss's forward passes);
* ``policy_scoring_rows`` and ``reference_scoring_rows``: rows scored without gradients and
  without a KV cache by the policy (the log-probs of the sampling policy, the ratio's
  denominator) and by any other model (the frozen reference).

The counts come from a forward hook on the decoder body of every Hugging Face model that runs
(``register_module_forward_hook``, a global hook, hence off unless asked for: it costs a Python
call per module call). A call that passes a KV cache is generation, the others are
scoring; the policy is the model whose input embeddings the optimizer trains.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import torch

WORK = (
    "completions",
    "optimizer_steps",
    "loss_rows",
    "policy_scoring_rows",
    "reference_scoring_rows",
)


class StepClock:
    """Wall time of each GRPO step (``perf_counter``), and optionally its work.

    Args:
        optimizer (torch.optim.Optimizer): the policy's optimizer (its steps are counted, its
            parameters tell the policy from the reference).
        budget_s (float): the run's time budget, printed with the step times.
        count_work (bool): count the work of each step (see the module's docstring).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, budget_s: float, count_work: bool):
        self.budget_s = budget_s
        self.step_s: list[float] = []
        self.work: list[Counter] = []
        self._started: float | None = None
        self._counts = Counter()
        self._trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if count_work:
            optimizer.register_step_post_hook(self._count_optimizer_step)
            torch.nn.modules.module.register_module_forward_hook(
                self._count_forward, with_kwargs=True
            )

    def start(self) -> None:
        self._started = time.perf_counter()
        self._counts = Counter()

    def stop(self) -> None:
        if self._started is None:
            return
        self.step_s.append(time.perf_counter() - self._started)
        self.work.append(self._counts)
        self._started = None

    def report(self) -> None:
        """Print the ``STEPS`` and ``WORK`` lines."""
        steps = ",".join(f"{s:.4f}" for s in self.step_s)
        print(f"STEPS budget_s={self.budget_s} step_s={steps}", flush=True)
        if not self.work:
            return
        means = {name: statistics.fmean(c[name] for c in self.work) for name in WORK}
        if any(means.values()):  # counted (count_work)
            print("WORK " + " ".join(f"{k}={v:.1f}" for k, v in means.items()), flush=True)

    def _count_optimizer_step(self, _optimizer, _args, _kwargs) -> None:
        if self._started is not None:
            self._counts["optimizer_steps"] += 1

    def _count_forward(self, module, _args, kwargs: dict, _output) -> None:
        """Global forward hook: one call of a decoder body, counted by kind."""
        if self._started is None or not _is_decoder_body(module):
            return
        ids = kwargs.get("input_ids")
        ids = ids if ids is not None else kwargs.get("inputs_embeds")
        if ids is None:
            return
        cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 4, 5
        if cache is not None:  # generation: its first forward fills the cache with the prompt
            if cache.get_seq_length() == ids.shape[1]:
                self._counts["completions"] += ids.shape[0]
        elif torch.is_grad_enabled():
            self._counts["loss_rows"] += ids.shape[0]
        elif id(module.get_input_embeddings().weight) in self._trained:
            self._counts["policy_scoring_rows"] += ids.shape[0]
        else:
            self._counts["reference_scoring_rows"] += ids.shape[0]


def _is_decoder_body(module) -> bool:
    return hasattr(module, "embed_tokens") and hasattr(module, "layers")
