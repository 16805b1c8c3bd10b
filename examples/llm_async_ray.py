"""The several-machine backend of ``llm_grpo_async.py``: torchrl's Ray collectors and buffer.

``--collectors`` torchrl ``RayLLMCollector`` actors (one CPU each, a collection thread inside,
started with ``.start()``) sample with their copy of the model, stamp each row with the policy
version they hold (``track_policy_version=True``) and write into a torchrl ``RayReplayBuffer``
(its own actor) whose transform is ``MCAdvantage``; the trainer samples a step's rows from it and
sends the weights with torchrl's ``RayWeightSyncScheme`` (gloo). Nothing pauses the collectors:
``MCAdvantage(staleness=Staleness(max_lag=...))`` drops what is too old, and the ring of
``--buffer-steps`` steps' rows overwrites what the trainer did not read in time.
"""

from __future__ import annotations

import contextlib
import os
import time
from functools import partial

import ray
from torchrl.collectors.llm import RayLLMCollector
from torchrl.data import LazyStackStorage, ReplayBuffer
from torchrl.data.replay_buffers.ray_buffer import RayReplayBuffer
from torchrl.weight_update import RayWeightSyncScheme

from torchrl_grpo import MCAdvantage
from torchrl_grpo.llm import ExactLogProbsTransformersWrapper


class AdvantageBuffer(ReplayBuffer):
    """torchrl's ``ReplayBuffer`` with two calls into its ``MCAdvantage``, for the trainer to
    make on the buffer's Ray actor (a ``RayReplayBuffer`` client forwards public methods)."""

    def advantage(self) -> MCAdvantage:
        return next(t for t in self.transform if isinstance(t, MCAdvantage))

    def advantage_stats(self) -> dict:
        return self.advantage().get_stats()

    def set_consumer_version(self, version: int) -> None:
        self.advantage().consumer_version = version


def start_ray(cfg, examples: str) -> None:
    """Ray on this machine; the actors import this folder's modules (cloudpickle ships the
    task, env factory and postproc by reference to them)."""
    path = os.pathsep.join(p for p in (examples, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=cfg.collectors + 1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )


def start_collectors(cfg, env_factory, sampler, postproc, rb) -> list[RayLLMCollector]:
    """``--collectors`` actors, each with a copy of ``sampler``; workarounds for torchrl
    0.14.1: the buffer's picklable client (a ``RayReplayBuffer`` does not pickle) and
    ``remote_config`` always a dict (``None`` with other options crashes)."""
    rows = cfg.prompts_per_step * cfg.group_size
    return [
        RayLLMCollector(
            env=env_factory(1000 * (cfg.seed + 1) + i),
            policy=sampler,
            dialog_turns_per_batch=rows,
            total_dialog_turns=-1,
            replay_buffer=rb.client(),
            track_policy_version=True,
            postproc=postproc(),
            remote_config={"num_cpus": 1},
        )
        for i in range(cfg.collectors)
    ]


def connect_weights(collectors, weights) -> RayWeightSyncScheme:
    """torchrl's ``RayWeightSyncScheme`` (gloo) from the trainer to every collector, wired by
    hand as ``RayCollector`` does inside (``RayLLMCollector`` takes no scheme in torchrl
    0.14.1); ``connect`` sends the first weights."""
    actors = [c._collector for c in collectors]  # the Ray actor handles
    scheme = RayWeightSyncScheme(backend="gloo")
    scheme.init_on_sender(model_id="policy", remote_collectors=actors, num_workers=len(actors))
    ray.get(
        [
            a.register_scheme_receiver.remote({"policy": scheme}, synchronize_weights=False)
            for a in actors
        ]
    )
    futures = [
        a.cascade_execute.remote("_receiver_schemes['policy'].connect", worker_idx=i)
        for i, a in enumerate(actors)
    ]
    scheme.connect(weights=weights)
    ray.get(futures)
    return scheme


class RayLink:
    """The trainer's end of the Ray backend: the rows of a step, the weights out, the counts.

    Args:
        cfg: the example's settings.
        examples (str): the examples' folder (the actors import its modules).
        transform_factory (callable): the buffer's transform (``MCAdvantage`` last).
        env_factory (callable): ``seed -> (() -> env)``, a collector's env.
        sampler: the sampling policy (copied into each actor).
        postproc (type): the collectors' postproc class.
    """

    def __init__(self, cfg, examples, transform_factory, env_factory, sampler, postproc):
        self.cfg, self.collectors, self.scheme, self.rb = cfg, [], None, None
        self.final = None  # what report() reads, kept when the link closes
        self.rows = cfg.prompts_per_step * cfg.group_size
        self.read = 0
        start_ray(cfg, examples)
        self.rb = RayReplayBuffer(
            storage=partial(LazyStackStorage, cfg.buffer_steps * self.rows),
            replay_buffer_cls=AdvantageBuffer,
            transform_factory=transform_factory,
            remote_config={"num_cpus": 0},
        )
        self.client = self.rb.client()  # forwards AdvantageBuffer's methods to its actor
        self._start = (env_factory, sampler, postproc)

    def start(self, weights) -> int:
        """Collectors up, first weights sent; the version the trainer starts from."""
        env_factory, sampler, postproc = self._start
        self.collectors = start_collectors(self.cfg, env_factory, sampler, postproc, self.rb)
        self.scheme = connect_weights(self.collectors, weights)
        version = self.collectors[0].policy_version
        self.client.set_consumer_version(version)
        for c in self.collectors:
            c.start()  # a collection thread in each actor (iterating would collect in lockstep)
        return version

    def next_rows(self):
        """A step's rows, once that many new ones were written since the last step."""
        if not all(c.is_running() for c in self.collectors):  # a dead thread is silent
            raise RuntimeError("a Ray collector stopped; the buffer's rows are kept")
        while self.rb.write_count < self.read + self.rows:
            time.sleep(0.02)
        self.read = self.rb.write_count
        return self.rb.sample(self.rows).contiguous()

    def publish(self, weights, version: int) -> None:
        self.scheme.send(weights=weights)
        self.client.set_consumer_version(version)

    def advantage_stats(self) -> dict:
        return self.final["stats"] if self.final else self.client.advantage_stats()

    def sampler_timings(self) -> list[dict]:
        if self.final:
            return self.final["timings"]
        get = "postproc.timing"
        return [ray.get(c._collector.get_distant_attr.remote(get)) for c in self.collectors]

    def rows_written(self) -> int:
        return self.final["written"] if self.final else self.rb.write_count

    def close(self) -> None:
        """Collectors, weight sync, buffer, Ray: each stopped even if one before it fails; what
        the report reads is kept first."""
        with contextlib.suppress(Exception):  # a run that failed early has less to keep
            stats, written = self.advantage_stats(), self.rows_written()
            self.final = {"timings": self.sampler_timings(), "stats": stats, "written": written}
        with contextlib.ExitStack() as stack:
            stack.callback(ray.shutdown)
            if self.rb is not None:
                stack.callback(self.rb.close)
            if self.scheme is not None:
                stack.callback(self.scheme.shutdown)
            for c in self.collectors:
                stack.callback(c.async_shutdown, timeout=10)


# ExactLogProbsTransformersWrapper is the samplers' class: imported here so that an actor
# unpickling the policy finds it
__all__ = ["AdvantageBuffer", "ExactLogProbsTransformersWrapper", "RayLink"]
