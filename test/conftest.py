"""Fixtures shared by the test files. Helper functions live in the ``helpers`` package
(``from helpers import trajectory``); nothing is imported from this file."""

from __future__ import annotations

import pytest
import torch
from helpers.llm import llm_batch, llm_scorer, tiny_causal_lm, tiny_qwen2, tiny_tokenizer
from helpers.writers import extend_from_process


@pytest.fixture
def shared_buffer():
    """``shared_buffer(size)``: a ``ReplayBuffer`` of a ``LazyTensorStorage(size,
    shared_init=True)``, ``shared=True``; the folder torchrl's ``shared_init`` leaves behind is
    removed at the end of the test."""
    import shutil

    from torchrl.data import LazyTensorStorage, ReplayBuffer

    storages = []

    def make(size):
        storages.append(LazyTensorStorage(size, shared_init=True))
        return ReplayBuffer(storage=storages[-1], shared=True)

    yield make
    for storage in storages:
        folder = getattr(storage, "scratch_dir", None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def spawn():
    """``spawn(target, *args) -> process``: a started spawned process (daemonic); any still alive
    at the end of the test is killed (a failed test leaves no process behind)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    processes = []

    def start(target, *args):
        process = ctx.Process(target=target, args=args, daemon=True)
        process.start()
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(30)


@pytest.fixture
def spawn_writer(spawn):
    """``spawn_writer(rb, batches, pause=None) -> (process, go)``: a spawned writer process of
    :func:`helpers.writers.extend_from_process`, waiting for ``go.set()``."""
    import multiprocessing as mp

    def writer(rb, batches, pause=None):
        go = mp.get_context("spawn").Event()
        return spawn(extend_from_process, rb, batches, go, pause), go

    return writer


# --- the loss side ------------------------------------------------------------------------------

#: Every device tests run on: the CPU, and CUDA whenever a GPU is present (CI has none, so its
#: suite is the CPU one, complete; the device machine runs both).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Each available device in turn."""
    return torch.device(request.param)


# --------------------------------------------------------------------------------------------
# a tiny language model for torchrl's LLM stack, built locally (nothing is downloaded)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def make_causal_lm():
    """:func:`tiny_causal_lm`, as a fixture."""
    return tiny_causal_lm


@pytest.fixture
def tiny_llm():
    """``(model, tokenizer)``: a fresh tiny Qwen2 and its character tokenizer."""
    tokenizer = tiny_tokenizer()
    return tiny_qwen2(tokenizer), tokenizer


@pytest.fixture
def list_to_stack():
    """tensordict's list-to-stack mode (torchrl's LLM stack builds lazy stacks of rows)."""
    import tensordict

    with tensordict.set_list_to_stack(True):
        yield


@pytest.fixture(scope="module")
def char_tokenizer():
    """:func:`tiny_tokenizer`, once per module."""
    return tiny_tokenizer()


@pytest.fixture
def make_llm_scorer():
    """:func:`llm_scorer`, as a fixture."""
    return llm_scorer


@pytest.fixture
def make_llm_batch():
    """:func:`llm_batch`, as a fixture; prompts default to five digit sums of ragged length."""

    def make(model, tokenizer, prompts=("3 9 1 4=", "1 2=", "5 5 5=", "7=", "2 0 8="), **kw):
        return llm_batch(model, tokenizer, list(prompts), **kw)

    return make
