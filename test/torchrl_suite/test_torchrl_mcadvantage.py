# Copyright (c) Meta Platforms, Inc. and affiliates.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in the root directory of this source tree.
#
# torchrl's own TestMCAdvantage, copied unchanged from pytorch/rl (its tests of the LLM
# objectives at commit ae9719f17, the 0.14 line: the imports, fixture, helpers and the class),
# run here against torchrl_grpo.MCAdvantage: conftest.py puts this package's transform where
# torchrl's is imported from. The one test that reads a private attribute of torchrl's class
# (``_queue_list``) is marked there as an expected failure.
from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp

import numpy as np
import pytest
import tensordict
import torch

from tensordict import lazy_stack, MetaData, TensorDict
from tensordict.nn import TensorDictModule
from torchrl._utils import logger
from torchrl.data import History, LazyStackStorage, ReplayBuffer
from torchrl.data.llm.history import _CHAT_TEMPLATES
from torchrl.envs.llm.transforms.kl import RetrieveLogProb
from torchrl.modules.llm import TransformersWrapper, vLLMWrapper
from torchrl.modules.llm.policies.common import ChatHistory, Masks, Text, Tokens
from torchrl.objectives.llm.distillation import (
    _distillation_loss,
    DistillationLoss,
    DistillationLossOutput,
    k3_kl_token_estimate,
)
from torchrl.objectives.llm.grpo import (
    CISPOLoss,
    CISPOLossOutput,
    GRPOLoss,
    GRPOLossOutput,
    MCAdvantage,
    MCAdvantageSelector,
    RayMCAdvantage,
)
from torchrl.objectives.llm.sft import SFTLoss

_has_transformers = importlib.util.find_spec("transformers") is not None
_has_vllm = importlib.util.find_spec("vllm") is not None
_has_ray = importlib.util.find_spec("ray") is not None
prompts = [
    "Lorem ipsum dolor sit amet,",
    "consectetur adipiscing elit,",
    "sed do eiusmod tempor incididunt ut labore et dolore magna aliqua.",
    "Ut enim ad minim veniam, quis nostrud exercitation",
    "ullamco laboris nisi ut aliquip ex ea commodo consequat.",
    "Duis aute irure dolor in reprehenderit in voluptate velit esse cillum dolore",
    "eu fugiat nulla pariatur.",
]


@pytest.fixture(autouse=True, scope="module")
def set_list_to_stack():
    with tensordict.set_list_to_stack(True):
        yield


def _make_group_traj(group_id, rewards, group_key="group_id"):
    n_steps = len(rewards)
    return TensorDict(
        {
            group_key: torch.full((n_steps,), group_id),
            ("next", "reward"): torch.tensor(rewards).reshape(n_steps, 1),
            ("next", "done"): torch.tensor([False] * (n_steps - 1) + [True]).reshape(
                n_steps, 1
            ),
        },
        batch_size=[n_steps],
    )


def _mc_advantage_shared_worker(advantage, group_id, rewards, queue):
    out = advantage.inv(_make_group_traj(group_id, rewards))
    if out is None:
        queue.put(None)
    else:
        queue.put(out["advantage"].squeeze(-1).tolist())


class TestMCAdvantage:
    @pytest.mark.parametrize("ndim", [1, 2])
    def test_mc_advantage(self, ndim):
        # make trajectories
        def make_silly_trajectory(n_steps=None):
            while True:
                if n_steps is None:
                    n_steps = torch.randint(low=2, high=100, size=(1,)).item()
                tds = []
                for _ in range(n_steps):
                    n_tokens = torch.randint(low=1, high=100, size=(1,)).item()
                    rewards = [torch.randn(n_tokens, 1)]
                    prompt = np.random.choice(prompts)
                    td = TensorDict(
                        query=prompt,  # MCAdvantage expects "query" key, not "text"
                        next=TensorDict(
                            reward=rewards, done=torch.zeros(1, dtype=torch.bool)
                        ),
                    )
                    tds.append(td)
                tds[-1]["next", "done"] = torch.ones(1, dtype=torch.bool)
                yield lazy_stack(tds)

        rb = ReplayBuffer(storage=LazyStackStorage(100))
        rb.append_transform(MCAdvantage(grpo_size=4))
        if ndim == 1:
            gen = make_silly_trajectory()
            for _ in range(100):
                trajectory = next(gen)
                rb.extend(trajectory)
            assert len(rb)
            s = rb.sample(1)
            assert "advantage" in s.keys()
        else:
            gen = make_silly_trajectory(n_steps=5)
            for _ in range(100):
                trajectory = lazy_stack([next(gen) for _ in range(3)])
                trajectory = trajectory.view(-1)
                rb.extend(trajectory)
            assert len(rb)
            s = rb.sample(1)
            assert "advantage" in s.keys()

    @pytest.mark.parametrize("agg", ["sum", "max", "mean"])
    def test_mc_advantage_trajectory_return(self, agg):
        # trajectory-level semantics: returns normalized across the group,
        # advantage broadcast to every step of each trajectory
        adv_t = MCAdvantage(grpo_size=3, prompt_key="group_id", trajectory_return=agg)
        trajs = [
            _make_group_traj(0, [0.0, 0.0]),
            _make_group_traj(0, [0.0, 1.0, 1.0]),
            _make_group_traj(0, [1.0, 0.0]),
        ]
        assert adv_t.inv(trajs[0]) is None
        assert adv_t.inv(trajs[1]) is None
        out = adv_t.inv(trajs[2])
        reduce = {"sum": torch.sum, "max": torch.max, "mean": torch.mean}[agg]
        returns = torch.stack([reduce(traj["next", "reward"]) for traj in trajs])
        expected = (returns - returns.mean()) / returns.std().clamp_min(1e-6)
        assert out["advantage"].shape == out["next", "reward"].shape
        for chunk, exp in zip(out["advantage"].squeeze(-1).split([2, 3, 2]), expected):
            torch.testing.assert_close(chunk, exp.expand_as(chunk))

    def test_mc_advantage_string_prompt_survives_contiguous(self):
        # String prompts are stored as NonTensorData in lazy-stacked
        # trajectories. TensorDict.contiguous() can silently turn those stacks
        # into empty TensorDicts, so the group id must be read from the lazy
        # input rather than the materialized trajectory (regression test).
        from tensordict import NonTensorData

        def traj(prompt, reward, n_steps=2, n_tokens=4):
            # tokens are uniform within a trajectory (contiguous() succeeds on
            # the single trajectory) but ragged across trajectories, like real
            # variable-length generations
            steps = [
                TensorDict(
                    {
                        "query": NonTensorData(prompt),
                        "tokens": torch.zeros(n_tokens, dtype=torch.long),
                        ("next", "reward"): torch.tensor([reward]),
                        ("next", "done"): torch.tensor([i == n_steps - 1]),
                    }
                )
                for i in range(n_steps)
            ]
            return lazy_stack(steps)

        adv_t = MCAdvantage(grpo_size=2, prompt_key="query")
        # uniform tensor shapes within a trajectory: contiguous() succeeds
        assert traj("p", 0.0).contiguous() is not None
        assert adv_t.inv(traj("prompt-a", 0.0, n_steps=2, n_tokens=4)) is None
        out = adv_t.inv(traj("prompt-a", 1.0, n_steps=3, n_tokens=6))
        assert out is not None
        assert "advantage" in out.keys()
        # the stored trajectories keep their prompt strings intact
        assert out[0]["query"] in ("prompt-a",)

    @pytest.mark.parametrize("group_key", ["group_id", ("meta", "group_id")])
    def test_mc_advantage_tensor_group_key(self, group_key):
        # tensor group identifiers (under a flat or nested key) are grouped by
        # value; interleaved groups complete independently
        adv_t = MCAdvantage(grpo_size=2, prompt_key=group_key, trajectory_return="sum")
        assert adv_t.inv(_make_group_traj(0, [1.0, 0.0], group_key=group_key)) is None
        assert adv_t.inv(_make_group_traj(1, [0.0, 0.0], group_key=group_key)) is None
        out0 = adv_t.inv(_make_group_traj(0, [0.0, 0.0], group_key=group_key))
        assert out0 is not None
        assert (out0[group_key] == 0).all()
        out1 = adv_t.inv(_make_group_traj(1, [0.0, 1.0], group_key=group_key))
        assert out1 is not None
        assert (out1[group_key] == 1).all()

    def test_mc_advantage_dynamic_sampling(self):
        adv_t = MCAdvantage(
            grpo_size=2,
            prompt_key="group_id",
            trajectory_return="sum",
            keep_return_bounds=(0.1, 0.9),
        )
        # all-failed group: dropped
        assert adv_t.inv(_make_group_traj(0, [0.0])) is None
        assert adv_t.inv(_make_group_traj(0, [0.0])) is None
        # all-succeeded group: dropped
        assert adv_t.inv(_make_group_traj(1, [1.0])) is None
        assert adv_t.inv(_make_group_traj(1, [1.0])) is None
        # mixed group: kept
        assert adv_t.inv(_make_group_traj(2, [0.0])) is None
        out = adv_t.inv(_make_group_traj(2, [1.0]))
        assert out is not None
        # processed groups (kept or dropped) do not linger in memory
        assert not adv_t.queues
        assert adv_t.completed_trajectories == 6
        assert adv_t.completed_decisions == 6
        assert adv_t.successful_trajectories == 3
        assert adv_t.trajectory_return_sum == 3.0
        assert adv_t.trajectory_return_max == 1.0
        assert adv_t.completed_groups == 3
        assert adv_t.written_groups == 1
        assert adv_t.dropped_groups == 2
        assert adv_t.queued_groups == 0
        assert adv_t.queued_trajectories == 0
        assert adv_t.max_queued_trajectories_per_group == 0
        adv_t.reset_stats()
        assert adv_t.completed_groups == 0
        assert adv_t.written_groups == 0
        assert adv_t.dropped_groups == 0
        assert adv_t.rescued_groups == 0
        assert adv_t.selected_trajectories == 0
        assert adv_t.unselected_trajectories == 0
        assert adv_t.completed_trajectories == 0
        assert adv_t.completed_decisions == 0

    def test_mc_advantage_clear_queues_preserves_stats(self):
        adv_t = MCAdvantage(
            grpo_size=2,
            prompt_key="group_id",
            trajectory_return="sum",
        )
        assert adv_t.inv(_make_group_traj(0, [1.0])) is None
        assert adv_t.queued_groups == 1
        assert adv_t.queued_trajectories == 1
        assert adv_t.completed_trajectories == 1
        stats = adv_t.get_stats()
        assert stats["queued_groups"] == 1
        assert stats["queued_trajectories"] == 1
        assert stats["completed_trajectories"] == 1
        adv_t.clear_queues()
        assert adv_t.queued_groups == 0
        assert adv_t.queued_trajectories == 0
        assert adv_t.completed_trajectories == 1

    def test_mc_advantage_candidate_selection_rescues_dynamic_sampling_group(self):
        selector = MCAdvantageSelector()
        assert selector.select(
            TensorDict({"return": torch.tensor([0.0, 0.0, 0.0, 1.0])}, [4]),
            group_size=2,
            keep_return_bounds=(0.1, 0.9),
        ) == [0, 3]
        adv_t = MCAdvantage(
            grpo_size=2,
            prompt_key="group_id",
            trajectory_return="sum",
            keep_return_bounds=(0.1, 0.9),
            candidate_group_size=4,
            candidate_selector=selector,
        )
        for _ in range(3):
            assert adv_t.inv(_make_group_traj(0, [0.0])) is None
        out = adv_t.inv(_make_group_traj(0, [1.0]))
        assert out is not None
        assert out.shape == (2,)
        assert out["advantage"].shape == out["next", "reward"].shape
        assert adv_t.completed_groups == 1
        assert adv_t.written_groups == 1
        assert adv_t.dropped_groups == 0
        assert adv_t.rescued_groups == 1
        assert adv_t.selected_trajectories == 2
        assert adv_t.unselected_trajectories == 2

    def test_mc_advantage_candidate_selector_reads_tensordict(self):
        class ScoreSelector(MCAdvantageSelector):
            def __init__(self):
                super().__init__(in_keys=[("trajectories", "selector_score")])

            def select(self, candidates, *, group_size, keep_return_bounds=None):
                trajectories = candidates.select(*self.in_keys, strict=True).get(
                    "trajectories"
                )
                scores = torch.stack(
                    [
                        trajectory.get("selector_score")[0]
                        for trajectory in trajectories.unbind(0)
                    ]
                )
                return scores.topk(group_size).indices.tolist()

        def make_scored_traj(score, rewards):
            traj = _make_group_traj(0, rewards)
            traj.set("selector_score", torch.full((len(rewards),), float(score)))
            return traj

        adv_t = MCAdvantage(
            grpo_size=2,
            prompt_key="group_id",
            trajectory_return="sum",
            candidate_group_size=3,
            candidate_selection_min_size=3,
            candidate_selector=ScoreSelector(),
        )
        assert adv_t.inv(make_scored_traj(0, [0.0])) is None
        assert adv_t.inv(make_scored_traj(2, [1.0])) is None
        out = adv_t.inv(make_scored_traj(1, [0.0]))
        assert out is not None
        assert out["selector_score"].tolist() == [2.0, 1.0]

    def test_mc_advantage_candidate_selection_writes_as_soon_as_useful(self):
        adv_t = MCAdvantage(
            grpo_size=2,
            prompt_key="group_id",
            trajectory_return="sum",
            keep_return_bounds=(0.1, 0.9),
            candidate_group_size=4,
        )
        assert adv_t.inv(_make_group_traj(0, [0.0])) is None
        out = adv_t.inv(_make_group_traj(0, [1.0]))
        assert out is not None
        assert out.shape == (2,)
        assert adv_t.completed_groups == 1
        assert adv_t.written_groups == 1
        assert adv_t.dropped_groups == 0
        assert adv_t.queued_groups == 0
        assert adv_t.selected_trajectories == 2
        assert adv_t.unselected_trajectories == 0

    def test_mc_advantage_candidate_selection_rescues_before_max_candidates(self):
        adv_t = MCAdvantage(
            grpo_size=2,
            prompt_key="group_id",
            trajectory_return="sum",
            keep_return_bounds=(0.1, 0.9),
            candidate_group_size=4,
        )
        assert adv_t.inv(_make_group_traj(0, [0.0])) is None
        assert adv_t.inv(_make_group_traj(0, [0.0])) is None
        out = adv_t.inv(_make_group_traj(0, [1.0]))
        assert out is not None
        assert out.shape == (2,)
        assert adv_t.completed_groups == 1
        assert adv_t.written_groups == 1
        assert adv_t.rescued_groups == 1
        assert adv_t.selected_trajectories == 2
        assert adv_t.unselected_trajectories == 1

    def test_mc_advantage_candidate_selection_drops_without_valid_subset(self):
        adv_t = MCAdvantage(
            grpo_size=2,
            prompt_key="group_id",
            trajectory_return="sum",
            keep_return_bounds=(0.1, 0.9),
            candidate_group_size=4,
        )
        assert adv_t.inv(_make_group_traj(0, [0.0])) is None
        assert adv_t.inv(_make_group_traj(0, [0.0])) is None
        assert adv_t.completed_groups == 0
        assert adv_t.queued_trajectories == 2
        assert adv_t.inv(_make_group_traj(0, [0.0])) is None
        assert adv_t.completed_groups == 0
        assert adv_t.queued_trajectories == 3
        assert adv_t.inv(_make_group_traj(0, [0.0])) is None
        assert adv_t.completed_groups == 1
        assert adv_t.written_groups == 0
        assert adv_t.dropped_groups == 1

    def test_mc_advantage_trajectory_return_rb(self):
        # write path through a replay buffer: complete mixed groups are written,
        # degenerate groups are filtered out
        rb = ReplayBuffer(storage=LazyStackStorage(100))
        rb.append_transform(
            MCAdvantage(
                grpo_size=2,
                prompt_key="group_id",
                trajectory_return="sum",
                keep_return_bounds=(0.1, 0.9),
            )
        )
        rb.extend(_make_group_traj(0, [0.0, 0.0]))
        assert len(rb) == 0
        rb.extend(_make_group_traj(0, [0.0, 1.0]))
        assert len(rb) == 4
        rb.extend(_make_group_traj(1, [0.0, 0.0]))
        rb.extend(_make_group_traj(1, [0.0, 0.0]))
        assert len(rb) == 4
        sample = rb.sample(4)
        assert "advantage" in sample.keys()

    def test_mc_advantage_multi_done_flat_batch(self):
        # a single inv call carrying several concatenated trajectories (the
        # layout a collector yields with trajs_per_batch + traj_format="cat") is
        # split on the done flags and processed per trajectory
        adv_t = MCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum")
        flat = torch.cat(
            [
                _make_group_traj(0, [1.0, 0.0]),
                _make_group_traj(0, [0.0, 0.0, 0.0]),
                _make_group_traj(1, [0.0]),
            ],
            0,
        )
        out = adv_t.inv(flat)
        # group 0 completed (both trajectories come out), group 1 stays queued
        assert out.shape == (5,)
        returns = torch.tensor([1.0, 0.0])
        expected = (returns - returns.mean()) / returns.std().clamp_min(1e-6)
        torch.testing.assert_close(
            out["advantage"].squeeze(-1),
            torch.cat([expected[0].expand(2), expected[1].expand(3)]),
        )
        assert sum(len(q) for q in adv_t.queues.values()) == 1
        assert adv_t.max_queued_trajectories_per_group == 1

    def test_mc_advantage_mixed_lazy_plain_trajectories_return_plain_tensordict(self):
        # Collector/replay paths can hand MCAdvantage a mix of lazy/view
        # trajectories and plain TensorDicts. MCAdvantage should normalize its
        # queued trajectories and return a consistent concrete TensorDict.
        adv_t = MCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum")
        assert adv_t.inv(_make_group_traj(0, [1.0])) is None
        lazy_traj = lazy_stack([_make_group_traj(1, [0.0])], 0).unbind(0)[0]
        assert adv_t.inv(lazy_traj) is None
        assert isinstance(adv_t._queue_list(0)[0], TensorDict)
        assert isinstance(adv_t._queue_list(1)[0], TensorDict)

        flat = torch.cat(
            [
                _make_group_traj(0, [0.0]),
                _make_group_traj(1, [1.0]),
            ],
            0,
        )
        out = adv_t.inv(flat)

        assert isinstance(out, TensorDict)
        assert out.shape == (4,)
        assert out["advantage"].shape == out["next", "reward"].shape
        assert adv_t.queued_groups == 0
        assert adv_t.max_queued_trajectories_per_group == 0

    def test_mc_advantage_share_memory(self):
        adv_t = MCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum")
        assert not adv_t.is_shared
        assert adv_t.inv(_make_group_traj(0, [0.0])) is None
        adv_t.share_memory_()
        assert adv_t.is_shared
        assert adv_t.queued_groups == 1
        assert adv_t.queued_trajectories == 1
        out = adv_t.inv(_make_group_traj(0, [1.0]))
        assert out is not None
        assert adv_t.queued_groups == 0
        assert adv_t.completed_groups == 1
        assert adv_t.written_groups == 1
        adv_t.reset_stats()
        assert adv_t.completed_groups == 0
        assert adv_t.written_groups == 0
        assert adv_t.inv(_make_group_traj(1, [0.0])) is None
        assert adv_t.queued_groups == 1
        adv_t.queues.clear()
        assert adv_t.queued_groups == 0

    def test_mc_advantage_local_queues(self, monkeypatch):
        monkeypatch.setenv("TORCHRL_MC_ADVANTAGE_LOCAL_QUEUES", "1")
        adv_t = MCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum")
        assert adv_t.share_memory_() is adv_t
        assert not adv_t.is_shared

    def test_mc_advantage_share_memory_multiprocessing(self):
        start_method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        ctx = mp.get_context(start_method)
        adv_t = MCAdvantage(
            grpo_size=2, prompt_key="group_id", trajectory_return="sum"
        ).share_memory_()
        queue = ctx.Queue()
        processes = [
            ctx.Process(
                target=_mc_advantage_shared_worker,
                args=(adv_t, 0, [0.0], queue),
            ),
            ctx.Process(
                target=_mc_advantage_shared_worker,
                args=(adv_t, 0, [1.0], queue),
            ),
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=20)
        for process in processes:
            assert process.exitcode == 0
        results = [queue.get(timeout=5) for _ in processes]
        assert sum(result is None for result in results) == 1
        advantage = next(result for result in results if result is not None)
        torch.testing.assert_close(
            torch.tensor(advantage).abs(),
            torch.full((2,), 2.0**-0.5),
        )
        assert adv_t.queued_groups == 0
        assert adv_t.completed_groups == 1
        assert adv_t.written_groups == 1
        assert adv_t.completed_trajectories == 2

    @pytest.mark.skipif(not _has_ray, reason="ray library required")
    def test_ray_mc_advantage(self):
        ray = pytest.importorskip("ray")
        was_initialized = ray.is_initialized()
        adv_t = RayMCAdvantage(
            grpo_size=2,
            prompt_key="group_id",
            trajectory_return="sum",
            ray_init_config={
                "ignore_reinit_error": True,
                "include_dashboard": False,
                "num_cpus": 1,
            },
            remote_config={"num_cpus": 0},
        )
        try:
            assert adv_t.is_shared
            assert adv_t.inv(_make_group_traj(0, [0.0])) is None
            out = adv_t.inv(_make_group_traj(0, [1.0]))
            assert out is not None
            assert adv_t.queued_groups == 0
            assert adv_t.completed_groups == 1
            assert adv_t.written_groups == 1
            adv_t.reset_stats()
            assert adv_t.completed_groups == 0
            assert adv_t.inv(_make_group_traj(1, [0.0])) is None
            assert adv_t.queued_groups == 1
            adv_t.queues.clear()
            assert adv_t.queued_groups == 0
        finally:
            adv_t.close()
            if not was_initialized:
                ray.shutdown()

    def test_mc_advantage_validation(self):
        with pytest.raises(ValueError, match="trajectory_return must be one of"):
            MCAdvantage(grpo_size=2, trajectory_return="prod")
        with pytest.raises(ValueError, match="dynamic sampling"):
            MCAdvantage(grpo_size=2, keep_return_bounds=(0.1, 0.9))
        with pytest.raises(ValueError, match="increasing"):
            MCAdvantage(
                grpo_size=2, trajectory_return="sum", keep_return_bounds=(0.9, 0.1)
            )
        # group-relative normalization over a single trajectory would silently
        # produce NaN advantages (std of one element)
        with pytest.raises(ValueError, match="grpo_size >= 2"):
            MCAdvantage(grpo_size=1, trajectory_return="sum")
        with pytest.raises(ValueError, match="candidate_group_size"):
            MCAdvantage(grpo_size=2, trajectory_return="sum", candidate_group_size=1)
        with pytest.raises(ValueError, match="candidate_group_size > grpo_size"):
            MCAdvantage(grpo_size=2, candidate_group_size=4)
        with pytest.raises(ValueError, match="candidate_selection_min_size"):
            MCAdvantage(
                grpo_size=2,
                trajectory_return="sum",
                candidate_group_size=4,
                candidate_selection_min_size=1,
            )
        with pytest.raises(ValueError, match="candidate_selection_min_size"):
            MCAdvantage(
                grpo_size=2,
                trajectory_return="sum",
                candidate_group_size=4,
                candidate_selection_min_size=5,
            )
        with pytest.raises(ValueError, match="strategy must be one of"):
            MCAdvantageSelector("unknown")


# Mock infrastructure moved to conftest.py


