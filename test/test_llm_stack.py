"""torchrl's GRPOTrainer driving this package's GRPOLoss and MCAdvantage on torchrl's LLM stack.

A tiny Qwen2 (``tiny_llm``), torchrl's env, wrappers, collector, log-prob transforms and trainer,
as a torchrl LLM user wires them; only the loss and the advantage transform are this package's,
and, in one of the two runs of each test, the wrappers (``LeanTransformersWrapper``).
"""

import copy
import csv
import math
import os

import pytest
import torch

try:
    import transformers  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs the `llm` extra (make test): without it this is a failure, not a skip
    pytest.skip("needs the llm extra: pip install -e '.[llm]'", allow_module_level=True)

from tensordict import TensorDict, set_list_to_stack
from torch.utils.data import DataLoader
from torchrl.collectors.llm import LLMCollector
from torchrl.data import (
    Composite,
    LazyStackStorage,
    ReplayBuffer,
    SamplerWithoutReplacement,
    Unbounded,
)
from torchrl.envs import Compose, StepCounter, Transform
from torchrl.envs.llm import DatasetChatEnv, RetrieveLogProb
from torchrl.modules.llm import TransformersWrapper
from torchrl.record.loggers import CSVLogger
from torchrl.trainers.algorithms.grpo import GRPOTrainer

from torchrl_grpo import GRPOLoss, LeanTransformersWrapper, MCAdvantage

PROMPTS = ["3 9 1 4=", "1 2 3 4=", "5 5 5 5=", "7 0 0 1="]
GROUP = 4  # completions per prompt
ROWS = len(PROMPTS) * GROUP
STEPS = 3


class EvenFirstDigit(Transform):
    """A reward a random model earns about half the time: 1 if the response starts with an even
    digit. Written as torchrl's LLM rewards are, ``[B, 1, 1]``."""

    def __init__(self, tokenizer):
        super().__init__(in_keys=[("tokens", "response")], out_keys=["reward"])
        self.even = torch.tensor([tokenizer.convert_tokens_to_ids(str(d)) for d in (0, 2, 4, 6, 8)])

    def _step(self, tensordict, next_tensordict):
        first = tensordict.get(("tokens", "response"), as_padded_tensor=True)[:, 0]
        next_tensordict.set("reward", torch.isin(first, self.even).float().view(-1, 1, 1))
        return next_tensordict

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        reward_spec["reward"] = Unbounded(reward_spec.shape + (1, 1))
        return reward_spec


@pytest.fixture(params=[TransformersWrapper, LeanTransformersWrapper])
def pipeline(tiny_llm, request):
    """The collector (env, sampler, log-prob transforms), buffer and loss of a GRPO run, with
    torchrl's wrapper or this package's lean one for sampling, scoring and the reference."""
    model, tokenizer = tiny_llm

    def wrapper(model, tokenizer, **kwargs):
        return request.param(
            model, tokenizer=tokenizer, input_mode="tokens", pad_output=True, **kwargs
        )

    loader = DataLoader(
        [TensorDict(query=PROMPTS, batch_size=[len(PROMPTS)])],
        batch_size=None,
        collate_fn=lambda td: td,
    )
    with set_list_to_stack(True):
        env = DatasetChatEnv.from_dataloader(
            loader,
            batch_size=(ROWS,),
            repeats=GROUP,  # each prompt GROUP times in a row: one group
            tokenizer=tokenizer,
            input_mode="tokens",
            template_kwargs={
                "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"
            },
        )
    env.append_transform(StepCounter(max_steps=1))
    env.append_transform(EvenFirstDigit(tokenizer))
    sampler = wrapper(
        model,
        tokenizer,
        generate=True,
        return_log_probs=False,
        generate_kwargs={
            "max_new_tokens": 3,
            "do_sample": True,
            "bad_words_ids": [[tokenizer.pad_token_id]],
        },
    )
    scorer = wrapper(model, tokenizer, generate=False, return_log_probs=True)
    ref_model = copy.deepcopy(model).requires_grad_(False)
    ref_scorer = wrapper(
        ref_model, tokenizer, generate=False, return_log_probs=True, log_probs_key="ref_log_probs"
    )
    rb = ReplayBuffer(
        storage=LazyStackStorage(ROWS), sampler=SamplerWithoutReplacement(), batch_size=ROWS // 2
    )
    advantage = MCAdvantage(grpo_size=GROUP, prompt_key="query", trajectory_return="sum")
    rb.append_transform(advantage)
    score = Compose(
        RetrieveLogProb(scorer, assistant_only=False),
        RetrieveLogProb(ref_scorer, assistant_only=False),
    )
    collector = LLMCollector(
        env,
        policy=sampler,
        dialog_turns_per_batch=ROWS,
        total_dialog_turns=STEPS * ROWS,
        replay_buffer=rb,
        postproc=torch.no_grad()(score),
    )
    loss = GRPOLoss(
        actor_network=scorer, masking_strategy="sft", kl_to_ref_coeff=0.1, entropy_coeff=0.0
    )
    loss.set_keys(sample_log_prob=("next", "log_probs", "full"))
    return {
        "model": model,
        "ref_model": ref_model,
        "collector": collector,
        "rb": rb,
        "advantage": advantage,
        "loss": loss,
    }


def test_grpo_trainer_steps_with_this_package_loss_and_transform(pipeline, tmp_path):
    model, rb, loss = pipeline["model"], pipeline["rb"], pipeline["loss"]
    torch.manual_seed(0)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    trainer = GRPOTrainer(
        collector=pipeline["collector"],
        total_frames=STEPS * ROWS,
        loss_module=loss,
        optimizer=optim,
        replay_buffer=rb,
        empty_replay_buffer_on_weight_update=True,
        logger=CSVLogger("run", log_dir=str(tmp_path)),
        log_interval=0,
        progress_bar=False,
    )
    batches = []

    def keep_batch(_batch) -> dict:
        batches.append(rb[:])  # what the optimization steps of this GRPO step will sample
        return {}

    trainer.register_op("pre_steps_log", keep_batch)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()

    # every completion reached the buffer once, grouped by prompt, with GRPO's advantage
    assert [len(b) for b in batches] == [ROWS] * STEPS
    rewards = torch.cat([b["next", "reward"].reshape(-1) for b in batches])
    assert 0.0 < rewards.mean() < 1.0  # groups differ: the advantages are not all zero
    assert pipeline["advantage"].get_stats()["written_groups"] == STEPS * len(PROMPTS)
    for batch in batches:
        queries = batch["query"]
        reward = batch["next", "reward"].reshape(-1)
        advantage = batch["advantage"].reshape(-1)
        for prompt in PROMPTS:
            rows = torch.tensor([q == prompt for q in queries])
            assert rows.sum() == GROUP
            r = reward[rows]
            expected = (r - r.mean()) / r.std().clamp_min(1e-6)
            torch.testing.assert_close(advantage[rows], expected)
        assert batch["next", "log_probs", "full"].isfinite().all()

    # two minibatches per GRPO step, each an optimizer step, on the policy only
    assert all(state["step"].item() == 2 * STEPS for state in optim.state.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    ref = pipeline["ref_model"].parameters()
    assert all(torch.equal(a, b) for a, b in zip(before, ref))

    # the trainer logged this package's loss output, once per collected batch
    (run_dir,) = tmp_path.iterdir()
    logged = {}
    for name in ("loss_objective", "loss_kl_to_ref", "ESS", "clip_fraction", "kl_to_ref"):
        with open(run_dir / "scalars" / f"{name}.csv") as f:
            logged[name] = [(int(s), float(v)) for s, v in csv.reader(f)]
    assert [s for s, _ in logged["ESS"]] == [ROWS * (i + 1) for i in range(STEPS)]
    assert all(0.0 < v <= 1.0 + 1e-6 for _, v in logged["ESS"])
    assert all(0.0 <= v <= 1.0 for _, v in logged["clip_fraction"])
    assert all(v >= 0.0 and math.isfinite(v) for _, v in logged["kl_to_ref"])
    # the reference is the initial policy: the KL grows from 0 as the policy moves
    assert logged["kl_to_ref"][-1][1] > 0.0


def test_first_minibatch_is_on_policy(pipeline):
    """Before any update the ratio is 1 and the KL to the reference (a copy) is 0: the stored
    log-probs of ``RetrieveLogProb`` are the ones GRPOLoss recomputes."""
    torch.manual_seed(0)
    next(iter(pipeline["collector"]))
    batch = pipeline["rb"][:]
    out = pipeline["loss"](batch)
    torch.testing.assert_close(out.ESS, torch.tensor(1.0))
    assert out.clip_fraction.item() == 0.0
    assert abs(out.kl_approx.item()) < 1e-6
    assert abs(out.kl_to_ref.item()) < 1e-6
    assert out.loss_objective.requires_grad
