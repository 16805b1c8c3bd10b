"""Tests of torchrl_grpo/_compat.py: one test per reliance on torch/torchrl/tensordict internals.

Each failure message names the reliance that an upgrade broke, and what depends on it.
"""

import inspect
import json

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorStorageCheckpointer
from torchrl.envs.transforms import Transform

from torchrl_grpo import _compat


class _Probe(Transform):
    """Records the buffer :func:`_compat.calling_replay_buffer` finds at each hook."""

    def __init__(self):
        super().__init__()
        self.found = {}

    def set_container(self, container):
        super().set_container(container)
        self.found["append_transform"] = _compat.calling_replay_buffer(self)

    def _inv_call(self, tensordict):
        self.found.setdefault("insertions", []).append(_compat.calling_replay_buffer(self))
        self.found.setdefault("methods", []).append(_compat.buffer_call(self)[1])
        return tensordict


class TestCallingReplayBuffer:
    MESSAGE = (
        "torchrl_grpo._compat.calling_replay_buffer: torchrl no longer calls a buffer's "
        "transforms from inside the buffer's own methods ({}), so MCAdvantage cannot find the "
        "storage to let it be saved while empty (torchrl_grpo.checkpoint)."
    )

    def test_found_from_append_extend_and_add(self):
        probe = _Probe()
        rb = ReplayBuffer(storage=LazyTensorStorage(10))
        rb.append_transform(probe)
        assert probe.found["append_transform"] is rb, self.MESSAGE.format("append_transform")
        rb.extend(TensorDict(x=torch.zeros(2), batch_size=[2]))
        rb.add(TensorDict(x=torch.zeros(())))
        assert probe.found["insertions"] == [rb, rb], self.MESSAGE.format("extend, add")
        # MCAdvantage refuses a release through add() by this name (mcadvantage/buffer.py)
        assert probe.found["methods"] == ["extend", "add"], self.MESSAGE.format("the method")

    def test_only_the_buffer_holding_the_transform(self):
        probe = _Probe()
        assert _compat.calling_replay_buffer(probe) is None  # no buffer on the stack
        other = ReplayBuffer(storage=LazyTensorStorage(10))
        other.append_transform(_Probe())

        def extend_through(rb, transform):  # a buffer on the stack that does not hold it
            return _compat.calling_replay_buffer(transform)

        assert extend_through(other, probe) is None
        probe.inv(TensorDict(x=torch.zeros(2), batch_size=[2]))  # called directly
        assert probe.found["insertions"] == [None]


class TestEmptyTensorStorageRecord:
    MESSAGE = (
        "torchrl_grpo._compat.write_empty_tensor_storage: torchrl's TensorStorageCheckpointer no "
        "longer reads {record} as an empty storage, so checkpoints of a buffer whose groups are "
        "all pending (torchrl_grpo.checkpoint) no longer load."
    )

    def test_torchrl_loads_it_as_empty(self, tmp_path):
        _compat.write_empty_tensor_storage(tmp_path / "storage")
        record = json.loads((tmp_path / "storage" / "storage_metadata.json").read_text())
        message = self.MESSAGE.format(record=record)
        fresh = LazyTensorStorage(10)
        TensorStorageCheckpointer().loads(fresh, tmp_path / "storage")
        assert len(fresh) == 0, message
        filled = LazyTensorStorage(10)
        filled.set(range(3), TensorDict(x=torch.ones(3), batch_size=[3]))
        TensorStorageCheckpointer().loads(filled, tmp_path / "storage")
        assert len(filled) == 0, message
        filled.set(range(2), TensorDict(x=torch.full((2,), 2.0), batch_size=[2]))  # usable
        assert len(filled) == 2 and filled[:2]["x"].tolist() == [2.0, 2.0], message

    def test_a_storage_loads_it_through_its_own_checkpointer(self, tmp_path):
        _compat.write_empty_tensor_storage(tmp_path)
        rb = ReplayBuffer(storage=LazyTensorStorage(10))
        rb.extend(TensorDict(x=torch.ones(4), batch_size=[4]))
        rb.storage.loads(tmp_path)  # Storage.loads: its default checkpointer, then its revision
        assert len(rb) == 0, self.MESSAGE.format(record=_compat.EMPTY_TENSOR_STORAGE_METADATA)


class TestLLMMaskedDist:
    @pytest.mark.parametrize("wrapper", ["TransformersWrapper", "vLLMWrapper", "LLMWrapperBase"])
    @pytest.mark.parametrize("strategy, method", sorted(_compat.LLM_MASKED_DIST_METHODS.items()))
    def test_wrappers_have_the_masking_methods(self, wrapper, strategy, method):
        import torchrl.modules.llm as llm

        cls = getattr(llm, wrapper)
        assert callable(getattr(cls, method, None)), (
            f"torchrl's {wrapper} no longer has {method}(), which _compat.llm_masked_dist "
            f"uses for masking_strategy={strategy!r}"
        )

    @pytest.mark.parametrize("strategy", sorted(_compat.LLM_MASKED_DIST_METHODS))
    def test_returns_logits_and_a_position_mask(
        self, strategy, tiny_llm, make_llm_batch, make_llm_scorer
    ):
        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        dist = _compat.llm_masked_dist(make_llm_scorer(model, tokenizer), batch.copy(), strategy)
        tokens = batch.get(("tokens", "full"), as_padded_tensor=True, padding_side="left")
        assert dist.logits.shape == tokens.shape + (len(tokenizer),), (
            f"{_compat.LLM_MASKED_DIST_METHODS[strategy]}() no longer returns left-padded "
            "[B, T, V] logits aligned with ('tokens', 'full')"
        )
        assert dist.mask.shape == tokens.shape and dist.mask.dtype == torch.bool, (
            f"{_compat.LLM_MASKED_DIST_METHODS[strategy]}() no longer returns a [B, T] "
            "position mask"
        )

    def test_missing_method_is_a_clear_error(self):
        with pytest.raises(NotImplementedError, match="has no _get_sft_dist"):
            _compat.llm_masked_dist(object(), None, "sft")


class TestTransformersWrapperScoring:
    MESSAGE = (
        "torchrl_grpo._compat.check_transformers_wrapper_scoring: torchrl's TransformersWrapper "
        "no longer scores tokens through {name}, so LeanTransformersWrapper's override of it "
        "would not run and the logits would be built again."
    )

    @pytest.mark.parametrize("name", sorted(_compat.TRANSFORMERS_WRAPPER_SCORING))
    def test_the_overridden_methods_exist(self, name):
        from torchrl.modules.llm import TransformersWrapper

        assert callable(getattr(TransformersWrapper, name, None)), self.MESSAGE.format(name=name)
        _compat.check_transformers_wrapper_scoring(TransformersWrapper)

    @pytest.mark.parametrize(
        "name", ["_model_forward_with_padded_sequences", "_model_forward_with_packed_sequences"]
    )
    def test_scoring_runs_the_model_through_them(self, name, tiny_llm, make_llm_batch):
        """Every generate=False forward calls one of the two, and reads the logits it returns."""
        from torchrl.modules.llm import TransformersWrapper

        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        calls = []

        class Spy(TransformersWrapper):
            pass

        original = getattr(TransformersWrapper, name)

        def spy(self, *args, **kwargs):
            calls.append(kwargs.get("logits_only", False))
            return original(self, *args, **kwargs)

        setattr(Spy, name, spy)
        wrapper = Spy(
            model,
            tokenizer=tokenizer,
            input_mode="tokens",
            generate=False,
            pad_model_input=name.endswith("padded_sequences"),
        )
        wrapper(batch.copy())
        _compat.llm_masked_dist(wrapper, batch.copy(), "sft")
        assert calls == [False, True], self.MESSAGE.format(name=name)

    @pytest.mark.parametrize("strategy", sorted(_compat.LLM_MASKED_DIST_METHODS))
    def test_masking_strategies_reach_the_overridden_builders(
        self, strategy, tiny_llm, make_llm_batch, make_llm_scorer
    ):
        """torchrl's _get_sft_dist (...) build their distribution through the _get_dist_with_*
        methods: the lean wrapper's overrides of those turn it into a hidden-state one."""
        from torchrl_grpo import HiddenLLMMaskedCategorical

        model, tokenizer = tiny_llm
        batch = make_llm_batch(model, tokenizer)
        lean = make_llm_scorer(model, tokenizer, lean=True)
        dist = _compat.llm_masked_dist(lean, batch.copy(), strategy)
        assert isinstance(dist, HiddenLLMMaskedCategorical), self.MESSAGE.format(
            name=f"{_compat.LLM_MASKED_DIST_METHODS[strategy]} -> _get_dist_with_*"
        )

    def test_a_changed_signature_is_a_clear_error(self):
        from torchrl.modules.llm import TransformersWrapper

        class Renamed(TransformersWrapper):
            def _model_forward_with_padded_sequences(self, tokens, mask, **kwargs):
                raise AssertionError

        with pytest.raises(RuntimeError, match="lost the parameters"):
            _compat.check_transformers_wrapper_scoring(Renamed)


class _ResetProbe(Transform):
    """Records, at each reset, whether :func:`_compat.inside_collector` sees a collector."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def _reset(self, tensordict, tensordict_reset):
        self.seen.append(_compat.inside_collector())
        return tensordict_reset


class TestInsideCollector:
    MESSAGE = (
        "torchrl_grpo._compat.inside_collector: torchrl's collectors no longer reset their env "
        "from code under torchrl/collectors/, so SameStartGroups cannot refuse a self-resetting "
        "vector env before a collector's first partial reset."
    )

    def test_seen_from_a_collector_not_from_a_rollout(self):
        from torchrl.collectors import Collector
        from torchrl.envs import GymEnv, TransformedEnv

        probe = _ResetProbe()
        env = TransformedEnv(GymEnv("CartPole-v1"), probe)
        env.reset()
        collector = Collector(env, None, frames_per_batch=10, total_frames=10)
        for _ in collector:
            pass
        collector.shutdown()
        assert probe.seen[0] is False and probe.seen[1:] and all(probe.seen[1:]), self.MESSAGE


class TestLogProbsGenerate:
    MESSAGE = (
        "torchrl_grpo.llm.ExactLogProbsTransformersWrapper: torchrl's "
        "TransformersWrapper._log_probs_generate {what}, so the override that keeps the first "
        "generated token's log-prob (examples/llm_grpo_async.py's behaviour policy) {then}."
    )

    def test_the_overridden_method_keeps_its_signature(self):
        from torchrl.modules.llm import TransformersWrapper

        method = getattr(TransformersWrapper, "_log_probs_generate", None)
        found = None if method is None else tuple(inspect.signature(method).parameters)
        assert found == _compat.LOG_PROBS_GENERATE_PARAMS, self.MESSAGE.format(
            what=f"is missing or takes {found}", then="would not run"
        )
        _compat.check_log_probs_generate(TransformersWrapper)

    def test_a_changed_signature_is_a_clear_error(self):
        from torchrl.modules.llm import TransformersWrapper

        class Renamed(TransformersWrapper):
            @classmethod
            def _log_probs_generate(cls, tokens, logits):
                raise AssertionError

        with pytest.raises(RuntimeError, match="_log_probs_generate is missing or its param"):
            _compat.check_log_probs_generate(Renamed)


class TestPostStepMdpHook:
    """``ExactTurns`` cuts the turns a collector stores through torchrl's
    ``Transform._post_step_mdp_hooks``; the turns' tests (``test/llm/test_turns.py``) check that
    ``step_and_maybe_reset`` runs it."""

    def test_torchrl_still_has_it(self):
        from torchrl.envs import Transform

        _compat.check_post_step_mdp_hook(Transform)

    def test_a_changed_signature_is_a_clear_error(self):
        from torchrl.envs import Transform

        class Renamed(Transform):
            def _post_step_mdp_hooks(self, tensordict):
                raise AssertionError

        with pytest.raises(RuntimeError, match="_post_step_mdp_hooks is missing or its param"):
            _compat.check_post_step_mdp_hook(Renamed)


class TestTorchDispatchMode:
    def test_sees_forward_and_backward_operators(self):
        seen = []

        class Record(_compat.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(str(func))
                return func(*args, **(kwargs or {}))

        x = torch.randn(3, requires_grad=True)
        with Record():
            x.exp().sum().backward()
        assert "aten.exp.default" in seen and seen.count("aten.mul.Tensor") >= 1, (
            "torchrl_grpo._compat.TorchDispatchMode: torch's dispatcher hook no longer sees "
            f"the operators of the forward and the backward pass (saw {seen}); "
            "torchrl_grpo.launches.count_launches counts them through it."
        )


#: Private names a class gets without writing them (ABCs, tensorclasses, torchrl's losses).
_GENERATED = {"_abc_impl", "_all_schedulable_buffers"}


def private_overrides() -> dict[str, set[str]]:
    """The private methods and attributes of torchrl's classes that the package's classes
    define again: name -> the package's classes that do."""
    import importlib
    import pkgutil

    import torchrl_grpo

    found = {}
    for info in pkgutil.walk_packages(torchrl_grpo.__path__, "torchrl_grpo."):
        module = importlib.import_module(info.name)
        for cls in vars(module).values():
            if not isinstance(cls, type) or cls.__module__ != module.__name__:
                continue
            for name in vars(cls):
                if not name.startswith("_") or name.startswith("__") or name in _GENERATED:
                    continue
                for base in cls.__mro__[1:]:
                    if base.__module__.startswith("torchrl.") and name in vars(base):
                        found.setdefault(name, set()).add(cls.__qualname__)
    return found


class TestPrivateNames:
    """Every private name the package relies on (``_compat.PRIVATE_NAMES``), one test each."""

    @pytest.mark.parametrize("ref", sorted(_compat.PRIVATE_NAMES))
    def test_torchrl_still_has_it(self, ref):
        _compat.check_private_name(ref)

    def test_a_missing_name_or_a_changed_signature_is_a_clear_error(self, monkeypatch):
        hook = "torchrl.envs.transforms:Transform._inv_call"
        monkeypatch.setitem(_compat.PRIVATE_NAMES, hook, (("self", "td"), "a reader"))
        with pytest.raises(RuntimeError, match=r"_inv_call takes \('self', 'tensordict'\).*reader"):
            _compat.check_private_name(hook)
        gone = "torchrl.envs.transforms:Transform._gone"
        monkeypatch.setitem(_compat.PRIVATE_NAMES, gone, (None, "a reader"))
        with pytest.raises(RuntimeError, match="Transform._gone is missing: a reader"):
            _compat.check_private_name(gone)

    def test_every_private_method_the_package_overrides_is_listed(self):
        listed = {ref.rpartition(".")[2] for ref in _compat.PRIVATE_NAMES}
        overridden = private_overrides()
        assert overridden, "the scan finds nothing: it is broken"
        missing = {name: owners for name, owners in overridden.items() if name not in listed}
        assert not missing, (
            f"private names of torchrl overridden but not in PRIVATE_NAMES: {missing}"
        )
