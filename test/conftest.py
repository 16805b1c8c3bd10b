"""Helpers shared by the test files (import them with ``from conftest import ...``).

Transform side: trajectories of one group id, random interleaved streams of them, and the
comparison of every release with torchrl's ``MCAdvantage``. Loss side: the devices to test on,
and a tiny local Qwen2 with a character tokenizer for torchrl's LLM wrappers.
"""

from __future__ import annotations

import random

import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict
from torchrl.objectives.llm import MCAdvantage as TorchRLMCAdvantage

from torchrl_grpo import MCAdvantage

_uid = iter(range(10**9))


def next_uid() -> int:
    """A number no other step of the test session has (steps are told apart by it)."""
    return next(_uid)


def trajectory(group, rewards, key="seed", width=1, **extra):
    """One trajectory: ``len(rewards)`` steps, the last one done; every step has a unique uid.

    ``extra``: more per-step entries, ``name=values`` (a tensor with one row per step, or a list
    of strings); a name starting with ``next_`` goes under ``"next"``.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(len(rewards), -1)
    steps = rewards.shape[0]
    done = torch.zeros(steps, 1, dtype=torch.bool)
    done[-1] = True
    if isinstance(group, str):
        gid = NonTensorData(group, batch_size=[steps])
    else:
        gid = torch.full((steps, width), group, dtype=torch.long).squeeze(-1)
    td = TensorDict(
        uid=torch.tensor([next_uid() for _ in range(steps)]),
        next=TensorDict(reward=rewards, done=done, batch_size=[steps]),
        batch_size=[steps],
    )
    td.set(key, gid)
    for name, values in extra.items():
        where = ("next", name[len("next_") :]) if name.startswith("next_") else name
        if isinstance(values, list) and isinstance(values[0], str):
            td.set(where, NonTensorStack(*values, batch_size=[steps]))
        else:
            td.set(where, torch.as_tensor(values))
    return td


def reference_discounted_returns(rewards, lengths, gamma):
    """``y_t = r_t + gamma * y_{t+1}`` within each run of ``lengths``, one step at a time (a
    backward loop per trajectory, as verl-agent's ``compute_step_discounted_returns``)."""
    out, start = [], 0
    for n in lengths:
        running, returns = 0.0, [0.0] * n
        for t in reversed(range(n)):
            running = rewards[start + t] + gamma * running
            returns[t] = running
        out += returns
        start += n
    return torch.tensor(out, dtype=torch.float64)


def random_stream(num_groups, size, seed, *, max_len=5, binary=False, strings=False, key="seed"):
    """``num_groups * size`` trajectories of random lengths, interleaved at random."""
    rng = random.Random(seed)
    trajs = []
    for g in range(num_groups):
        gid = f"prompt {g}" if strings else g
        for _ in range(size):
            length = rng.randint(1, max_len)
            if binary:
                rewards = [0.0] * (length - 1) + [float(rng.random() < 0.5)]
            else:
                rewards = [rng.gauss(0, 1) for _ in range(length)]
            trajs.append(trajectory(gid, rewards, key=key))
    rng.shuffle(trajs)
    return trajs


def random_chunks(trajs, seed):
    """Cut a stream of trajectories into flat ``extend`` batches of random sizes."""
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(trajs):
        j = min(len(trajs), i + rng.randint(1, 12))
        chunks.append(torch.cat(trajs[i:j]))
        i = j
    return chunks


def released(out):
    """uid -> advantage row, for one output (or {} for None)."""
    if out is None:
        return {}
    if isinstance(out, LazyStackedTensorDict):
        return {int(step["uid"]): step["advantage"] for step in out.unbind(0)}
    return dict(zip(out["uid"].tolist(), out["advantage"].unbind(0)))


def assert_same_releases(chunks, kwargs):
    """Feed both implementations; each call must release the same steps, same advantages."""
    ours, ref = MCAdvantage(**kwargs), TorchRLMCAdvantage(**kwargs)
    for chunk in chunks:
        got, want = released(ours.inv(chunk)), released(ref.inv(chunk))
        assert got.keys() == want.keys()
        for uid, adv in want.items():
            torch.testing.assert_close(got[uid], adv, atol=1e-6, rtol=1e-6)
    for name, value in ref.get_stats().items():
        assert ours.get_stats()[name] == pytest.approx(value, rel=1e-5), name
    return ours


def bad_inputs():
    """(description, batch, exception, words the message must contain, the first a pattern)."""
    good = trajectory(0, [1.0, 2.0])
    not_done = good.clone()
    not_done["next", "done"][-1] = False
    nan = good.clone()
    nan["next", "reward"][0] = float("nan")
    inf = good.clone()
    inf["next", "reward"][1] = float("inf")
    two_flags = good.clone()
    two_flags["next", "done"] = torch.ones(2, 2, dtype=torch.bool)
    empty_reward = good.clone()
    empty_reward["next", "reward"] = torch.zeros(2, 0)
    unhashable = good.clone()
    unhashable["seed"] = NonTensorData({"a": 1}, batch_size=[2])
    stringy = trajectory("a prompt", [1.0], key="seed")
    return [
        ("no done at the end", not_done, RuntimeError, ["expected complete", "done"]),
        ("missing group id", good.exclude("seed"), KeyError, ["group id key", "seed"]),
        ("missing reward", good.exclude(("next", "reward")), KeyError, ["reward key", "reward"]),
        ("missing done", good.exclude(("next", "done")), KeyError, ["done key", "done"]),
        ("nan reward", nan, ValueError, ["non-finite", "reward", "nan", "step 0"]),
        ("inf reward", inf, ValueError, ["non-finite", "reward", "inf", "step 1"]),
        ("two done flags per step", two_flags, ValueError, ["one flag per step", "(2, 2)"]),
        ("empty reward", empty_reward, ValueError, ["is empty at step 0", "reward"]),
        ("unhashable group id", unhashable, TypeError, ["string or a tensor", "seed", "dict"]),
        ("string id among tensor ids", stringy, TypeError, ["are strings", "seed"]),
    ]


# --- streams of a collector: trajectories that cross insertions --------------------------------


def collector_stream(num_envs, num_groups, size, seed, *, max_len=7, steps_per_batch=5):
    """What a torchrl collector yields: ``[num_envs, T]`` batches cut every ``T`` steps.

    Each environment plays trajectories one after the other; trajectory ids are handed out in
    the order trajectories start (as torchrl's trajectory pool does); every step has a unique
    ``uid``, a ``("collector", "traj_ids")`` entry and a ``"step_count"``. Every environment's
    timeline is cut to a multiple of ``T`` by shortening its last trajectory, so that nothing is
    left unfinished at the end. Groups (``"seed"``) of ``size`` trajectories each.

    Returns:
        ``(batches, completed)``: the ``[num_envs, T]`` batches, and for each batch the
        trajectories (flat TensorDicts) that end in it, in the order of their last step in the
        row-major flattened batch: what inserting whole trajectories would insert.
    """
    rng = random.Random(seed)
    seeds = [g for g in range(num_groups) for _ in range(size)]
    rng.shuffle(seeds)
    per_env = [[] for _ in range(num_envs)]  # (seed, length) per env
    for i, s in enumerate(seeds):
        per_env[i % num_envs].append([s, rng.randint(1, max_len)])
    horizon = max(sum(n for _, n in trajs) for trajs in per_env)
    horizon = -(-horizon // steps_per_batch) * steps_per_batch
    for trajs in per_env:  # pad every timeline to the horizon with its last trajectory
        trajs[-1][1] += horizon - sum(n for _, n in trajs)
    # ids in the order trajectories start (ties by env), as torchrl's pool hands them out
    starts = sorted(
        (sum(n for _, n in trajs[:k]), env, k)
        for env, trajs in enumerate(per_env)
        for k in range(len(trajs))
    )
    ids = {(env, k): i for i, (_, env, k) in enumerate(starts)}
    rows = []
    for env, trajs in enumerate(per_env):
        steps = []
        for k, (s, n) in enumerate(trajs):
            rewards = torch.tensor([[rng.gauss(0, 1)] for _ in range(n)])
            done = torch.zeros(n, 1, dtype=torch.bool)
            done[-1] = True
            steps.append(
                TensorDict(
                    seed=torch.full((n,), s),
                    uid=torch.tensor([next_uid() for _ in range(n)]),
                    step_count=torch.arange(n).unsqueeze(-1),
                    collector=TensorDict(traj_ids=torch.full((n,), ids[env, k]), batch_size=[n]),
                    next=TensorDict(reward=rewards, done=done, batch_size=[n]),
                    batch_size=[n],
                )
            )
        rows.append(torch.cat(steps))
    timeline = torch.stack(rows)  # (num_envs, horizon)
    batches, completed = [], []
    for t in range(0, horizon, steps_per_batch):
        batch = timeline[:, t : t + steps_per_batch]
        batches.append(batch)
        flat = batch.reshape(-1)
        ends = flat["next", "done"].squeeze(-1).nonzero().squeeze(-1).tolist()
        whole = []
        for end in ends:  # the trajectory ending here, from its first step in the timeline
            env, col = divmod(end, steps_per_batch)
            traj = int(flat["collector", "traj_ids"][end])
            row = timeline[env]
            mask = row["collector", "traj_ids"] == traj
            whole.append(row[mask])
        completed.append(whole)
    return batches, completed


# --- shared mode: writer processes ---------------------------------------------------------------


def extend_from_process(rb, batches, go=None, pause=None) -> None:
    """A writer process (a spawn target): waits for ``go`` (an event), then ``rb.extend`` each
    batch; with ``pause`` (``"<where>:<file>"``, see ``torchrl_grpo/_shared.py``), the last batch
    is inserted under the test hook that pauses it there."""
    import os

    torch.set_num_threads(1)
    if go is not None and not go.wait(120):
        raise TimeoutError("never told to go")
    for i, batch in enumerate(batches):
        if pause is not None and i == len(batches) - 1:
            os.environ["TORCHRL_GRPO_SHARED_TEST_PAUSE"] = pause
        rb.extend(batch)


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
def spawn_writer():
    """``spawn_writer(rb, batches, pause=None) -> (process, go)``: a spawned writer process of
    :func:`extend_from_process`, waiting for ``go.set()``; any still alive at the end of the test
    is killed (a failed test leaves no writer paused for ever)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    processes = []

    def spawn(rb, batches, pause=None):
        go = ctx.Event()
        process = ctx.Process(
            target=extend_from_process, args=(rb, batches, go, pause), daemon=True
        )
        process.start()
        processes.append(process)
        return process, go

    yield spawn
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(30)


def wait_for_file(path, process, timeout=120.0) -> None:
    """Wait until ``path`` exists (a paused writer made it); fail if ``process`` ended first."""
    import os
    import time

    end = time.monotonic() + timeout
    while not os.path.exists(path):
        assert process.is_alive(), f"the writer ended (exit code {process.exitcode}) before pausing"
        assert time.monotonic() < end, f"the writer did not pause within {timeout} s"
        time.sleep(0.02)


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

LLM_CHARS = "0123456789 ="


def tiny_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` over ``LLM_CHARS`` plus EOS and PAD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(LLM_CHARS)}
    vocab["<eos>"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")


def tiny_qwen2(tokenizer, seed: int = 0):
    """A one-layer ``Qwen2ForCausalLM`` (the family torchrl's recipe uses), in eval mode."""
    return tiny_causal_lm(tokenizer, "qwen2", seed=seed)


def tiny_causal_lm(
    tokenizer,
    family: str = "qwen2",
    *,
    tied: bool = False,
    head_bias: bool = False,
    seed: int = 1,
):
    """A one-layer causal LM of the ``family`` (``"qwen2"`` or ``"llama"``), in eval mode.

    ``tied`` shares the embedding with the output layer; ``head_bias`` gives the output layer a
    (random) bias, as a few model families have.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[family]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if head_bias:
        head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        head.weight = model.lm_head.weight
        model.lm_head = head
    return model


@pytest.fixture
def make_causal_lm():
    """:func:`tiny_causal_lm`, as a fixture."""
    return tiny_causal_lm


@pytest.fixture
def tiny_llm():
    """``(model, tokenizer)``: a fresh tiny Qwen2 and its character tokenizer."""
    tokenizer = tiny_tokenizer()
    return tiny_qwen2(tokenizer), tokenizer


def llm_scorer(model, tokenizer, *, pad_output: bool = False, lean: bool = False, **kwargs):
    """torchrl's training-side wrapper: scores ``("tokens", "full")`` (``generate=False``).

    ``lean=True`` builds this package's ``LeanTransformersWrapper`` with the same arguments.
    """
    from torchrl.modules.llm import TransformersWrapper

    from torchrl_grpo import LeanTransformersWrapper

    return (LeanTransformersWrapper if lean else TransformersWrapper)(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        input_key=("tokens", "full"),
        generate=False,
        return_log_probs=True,
        pad_output=pad_output,
        **kwargs,
    )


def llm_batch(model, tokenizer, prompts, *, seed: int = 0, drift: float = 0.3):
    """A ragged lazy stack as torchrl's LLM stack writes it, ready for a GRPO loss.

    ``TransformersWrapper`` samples one completion per prompt (tokens input); the stored
    ``("log_probs", "full")`` are the scorer's, shifted by ``drift`` noise so that ratios leave
    the clip band; ``("next", "ref_log_probs", "full")`` likewise; ``advantage`` is per
    sequence, ``[B, 1, 1]`` as torchrl's LLM rewards; ``("masks", "all_assistant_mask")``
    marks the response tokens.
    """
    import tensordict
    from tensordict import TensorDict, lazy_stack
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.modules.llm.policies.common import Tokens

    sampler = TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=True,
        return_log_probs=True,
        pad_output=False,
        generate_kwargs={
            "max_new_tokens": 4,
            "do_sample": True,
            "suppress_tokens": [tokenizer.pad_token_id],
        },
    )
    prompt_ids = [torch.tensor(tokenizer(p)["input_ids"]) for p in prompts]
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    with tensordict.set_list_to_stack(True), torch.no_grad():
        data = sampler(lazy_stack([TensorDict({"tokens": Tokens(prompt=p)}) for p in prompt_ids]))
        scored = llm_scorer(model, tokenizer)(data.copy())
        steps = []
        for step, log_prob, prompt in zip(
            data.unbind(0), scored.get(("log_probs", "full"), as_list=True), prompt_ids
        ):
            assistant = torch.arange(log_prob.numel()) >= prompt.numel()
            step.set(("log_probs", "full"), log_prob + drift * torch.randn(log_prob.shape, generator=g))  # fmt: skip
            step.set(("next", "ref_log_probs", "full"), log_prob + drift * torch.randn(log_prob.shape, generator=g))  # fmt: skip
            step.set(("masks", "all_assistant_mask"), assistant)
            step.set("advantage", torch.randn(1, 1, generator=g))
            steps.append(step)
    return lazy_stack(steps)


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
