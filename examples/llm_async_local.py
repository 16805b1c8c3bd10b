"""The single-machine backend of ``llm_grpo_async.py``: one sampler process, bounded staleness.

The trainer (the example's process) and one sampler process share the machine's cores, one torch
thread each. The sampler runs torchrl's ``LLMCollector`` on the task's env with its own copy of
the model and sends each batch (a GRPO step's rows, every prompt ``group_size`` times) through a
``multiprocessing`` queue; the trainer feeds it to its ``ReplayBuffer`` (``MCAdvantage``) and
trains. The weights go the other way through shared memory: one ``TensorDict`` of the sampler's
parameters (``share_memory_()``), which the trainer overwrites in place after each step and the
sampler copies before each batch, with a version counter beside it.

**Backpressure.** Batch ``i`` (the ``i``-th the sampler generates, the one GRPO step ``i + 1``
trains on) starts only once the trainer holds version ``i - max_policy_lag`` or later, so that
no row is generated that would be more than ``max_policy_lag`` versions old when trained on:
the sampler waits instead of generating what would be dropped. With ``max_policy_lag=1`` the
sampler generates step ``i + 1``'s batch while the trainer trains on step ``i``'s: one-step
off-policy, and both cores busy. Every generated row is consumed once: nothing is overwritten
and nothing is stale by construction (``MCAdvantage(staleness=Staleness(max_lag=...))`` stays
as the check).

**Failures.** An exception in the sampler goes back through the queue with its traceback and is
raised in the trainer (``RuntimeError``); a sampler that dies without a word (killed, out of
memory) is noticed within a second by the trainer, which raises with its exit code; what the
trainer's buffer holds is untouched either way (the example then saves its checkpoint).

**A resumed run.** ``first_version`` (the trainer's version at its checkpoint) is the first
version published, and ``first_batch`` (the batches the trainer had taken) the sampler's first
batch number, so that backpressure and the rows' versions go on where they were.
"""

from __future__ import annotations

import pickle
import queue
import time
import traceback

import torch
from tensordict import TensorDict

#: How often the trainer checks that the sampler is alive while it waits for a batch (seconds).
POLL_S = 0.5


class SharedWeights:
    """A model's parameters in shared memory, with the version they hold.

    ``publish`` (the trainer) copies new weights in and moves the version on; ``load`` (the
    sampler) copies them into its model when they are newer than what it holds.
    """

    def __init__(self, module: torch.nn.Module, context):
        self.weights = TensorDict.from_module(module).data.clone().share_memory_()
        # -1: nothing published yet (the sampler waits for version 0); carries its own lock
        self.version = context.Value("i", -1)
        self.loaded = -1  # the version the sampler's model holds: none yet (its own process)

    def publish(self, module: torch.nn.Module, alive=None) -> int:
        """Copy ``module``'s weights in; the new version. ``alive`` (a callable: whether the
        sampler still runs) is asked while the lock is held elsewhere: a sampler killed in
        ``load`` leaves it held for good, and the weights are then written without it (no one
        reads them any more; the trainer's next wait for a batch reports the dead sampler)."""
        lock = self.version.get_lock()
        while not lock.acquire(timeout=POLL_S):
            if alive is not None and not alive():
                return self._write(module)
        try:
            return self._write(module)
        finally:
            lock.release()

    def _write(self, module: torch.nn.Module) -> int:
        self.weights.update_(TensorDict.from_module(module).data)
        version = self.version.get_obj()  # the value itself: its wrapper takes the lock
        version.value += 1
        return version.value

    def load(self, module: torch.nn.Module) -> int:
        """The version now in ``module`` (copied from shared memory if newer)."""
        with self.version.get_lock():
            if self.version.value != self.loaded:
                TensorDict.from_module(module).data.update_(self.weights)
                self.loaded = self.version.value
        return self.loaded

    def wait_for(self, version: int, stop) -> float:
        """Block until the trainer holds ``version`` or later (or ``stop`` is set); the seconds
        waited."""
        start = time.perf_counter()
        while self.version.value < version and not stop.is_set():
            time.sleep(0.005)
        return time.perf_counter() - start


def sampler_main(
    make_sampling, weights: SharedWeights, out, stop, drained, max_lag: int, first_batch: int = 0
):
    """The sampler process: ``make_sampling()`` gives ``(policy module, batches iterator)``; each
    batch is generated once the trainer is close enough (see the module's docstring), stamped
    with the version of the weights that sampled it and sent. Ends with its timings, and stays
    until the trainer has drained the queue (the batches' tensors live in this process's shared
    memory until read); an exception is sent with its traceback instead."""
    timing = {"batches": 0, "rows": 0, "generate_s": 0.0, "wait_s": 0.0, "load_s": 0.0}
    try:
        torch.set_num_threads(1)
        module, batches = make_sampling()
        for i in range(first_batch, 1 << 62):
            timing["wait_s"] += weights.wait_for(max(i - max_lag, 0), stop)
            if stop.is_set():
                break
            start = time.perf_counter()
            version = weights.load(module)
            timing["load_s"] += time.perf_counter() - start
            start = time.perf_counter()
            batch = next(batches)
            batch["policy_version"] = torch.full(batch.shape, version, dtype=torch.int64)
            timing["generate_s"] += time.perf_counter() - start
            timing["batches"] += 1
            timing["rows"] += batch.numel()
            # by value, one buffer: a ragged batch is thousands of small tensors, which the
            # queue would otherwise pass one shared-memory file each
            out.put(("batch", pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)))
        out.put(("timing", timing))
    except BaseException:  # noqa: BLE001 - everything goes back to the trainer
        out.put(("error", traceback.format_exc()))
    drained.wait(timeout=60)


class LocalSampler:
    """The trainer's end: starts the sampler process, hands out its batches, stops it.

    Args:
        make_sampling (callable): picklable; run in the sampler process, returns ``(module,
            iterator of batches)``, ``module`` holding the parameters of ``weights_of``.
        weights_of (torch.nn.Module): the trainer's module whose parameters the sampler's
            mirrors (the same class and structure as the sampler's module).
        max_lag (int): the staleness bound, ``>= 0``.
        first_version (int): the version of the first weights published (a resumed run's).
        first_batch (int): the number of the sampler's first batch (a resumed run's).
    """

    def __init__(
        self,
        make_sampling,
        weights_of: torch.nn.Module,
        max_lag: int,
        first_version: int = 0,
        first_batch: int = 0,
    ):
        if max_lag < 0:
            raise ValueError(f"max_policy_lag must be at least 0, got {max_lag}.")
        context = torch.multiprocessing.get_context("spawn")
        self.weights = SharedWeights(weights_of, context)
        self.weights.version.value = first_version - 1  # the first publish is first_version
        self.queue, self.stop_event, self.drained = (
            context.Queue(),
            context.Event(),
            context.Event(),
        )
        self.timing: dict | None = None
        self.process = context.Process(
            target=sampler_main,
            args=(
                make_sampling,
                self.weights,
                self.queue,
                self.stop_event,
                self.drained,
                max_lag,
                first_batch,
            ),
            daemon=True,
            name="grpo-sampler",
        )
        self.process.start()

    def next_batch(self) -> TensorDict:
        """The next batch, waiting for it; raises if the sampler failed or died."""
        while True:
            try:
                kind, value = self.queue.get(timeout=POLL_S)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(
                        "the sampler process died without a word (exit code "
                        f"{self.process.exitcode}); the trainer's buffer is as it was."
                    ) from None
                continue
            if kind == "error":
                raise RuntimeError(f"the sampler process failed:\n{value}")
            if kind == "batch":
                return pickle.loads(value)
            self.timing = value  # a late "timing" message

    def publish(self, module: torch.nn.Module) -> int:
        """The trainer's new weights, for the sampler's next batch; returns their version (0
        for the first: the sampler starts generating then)."""
        return self.weights.publish(module, alive=self.process.is_alive)

    def close(self, timeout: float = 10.0) -> dict | None:
        """Stop the sampler (its current batch finishes) and return its timings."""
        self.stop_event.set()
        deadline = time.perf_counter() + timeout
        while self.timing is None and time.perf_counter() < deadline:
            try:
                kind, value = self.queue.get(timeout=0.2)
            except queue.Empty:
                if not self.process.is_alive():
                    break
                continue
            if kind == "timing":  # batches still queued were generated, never trained on
                self.timing = value
        self.drained.set()
        self.process.join(timeout=max(0.0, deadline - time.perf_counter()))
        if self.process.is_alive():
            self.process.kill()
        return self.timing
