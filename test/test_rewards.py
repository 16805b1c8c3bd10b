"""Tests of torchrl_grpo.rewards: DAPO's overlong penalty, by hand, in a buffer and in an env."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from torchrl_grpo import MCAdvantage, OverlongPenalty
from torchrl_grpo.rewards import overlong_penalty


class TestOverlongPenalty:
    def test_hand_values(self):
        # L_max = 20, L_cache = 4: no penalty up to 16, then -(|y| - 16) / 4, -1 beyond 20
        lengths = torch.tensor([0, 16, 17, 18, 19, 20, 21, 100])
        expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
        torch.testing.assert_close(overlong_penalty(lengths, 20, 4), expected)
        torch.testing.assert_close(overlong_penalty(lengths, 20, 4, 0.5), 0.5 * expected)

    def test_dapo_settings(self):
        # the paper: L_max = 20480, L_cache = 4096, so 16384 tokens are free
        penalty = overlong_penalty(torch.tensor([16384, 16385, 18432, 20480]), 20480, 4096)
        torch.testing.assert_close(penalty, torch.tensor([0.0, -1 / 4096, -0.5, -1.0]))

    def test_bad_lengths(self):
        for cache in (0, 21):
            with pytest.raises(ValueError, match=r"cache_length must be in \(0, max_length=20\]"):
                overlong_penalty(torch.tensor([1]), 20, cache)
        with pytest.raises(ValueError, match="cache_length"):
            OverlongPenalty(max_length=8, cache_length=9)


def llm_steps(lengths, rewards=None, prompt=0):
    """One-step LLM trajectories as torchrl writes them: ragged ("tokens", "response")."""
    rewards = [1.0] * len(lengths) if rewards is None else rewards
    return lazy_stack(
        [
            TensorDict(
                prompt=torch.tensor(prompt),
                tokens=TensorDict(response=torch.zeros(n, dtype=torch.long)),
                next=TensorDict(
                    reward=torch.full((1, 1), r), done=torch.ones(1, 1, dtype=torch.bool)
                ),
            )
            for n, r in zip(lengths, rewards, strict=True)
        ]
    )


class TestOverlongPenaltyTransform:
    def test_replay_buffer_before_the_advantage(self):
        from torchrl.data import LazyStackStorage, ReplayBuffer

        data = llm_steps([4, 9, 10, 12], rewards=[1.0, 1.0, 0.0, 1.0])
        before = data.get(("next", "reward"), as_list=True)
        rb = ReplayBuffer(storage=LazyStackStorage(8))
        rb.append_transform(MCAdvantage(grpo_size=4, prompt_key="prompt"))
        rb.append_transform(OverlongPenalty(max_length=12, cache_length=4))  # runs first
        rb.extend(data)
        # free up to 8 tokens: penalties 0, -0.25, -0.5, -1
        rewards = rb[:]["next", "reward"].flatten()
        torch.testing.assert_close(rewards, torch.tensor([1.0, 0.75, -0.5, 0.0]))
        shaped = rewards - rewards.mean()
        torch.testing.assert_close(rb[:]["advantage"].flatten(), shaped / shaped.std())
        # the caller's batch is left as it was
        for a, b in zip(before, data.get(("next", "reward"), as_list=True), strict=True):
            torch.testing.assert_close(a, b)

    def test_short_responses_are_not_touched(self):
        data = llm_steps([3, 8, 1])
        out = OverlongPenalty(max_length=12, cache_length=4).inv(data)
        assert (out["next", "reward"] == 1.0).all()

    def test_dense_responses_and_length_key(self):
        t = OverlongPenalty(max_length=12, cache_length=4, penalty_factor=2.0)
        dense = TensorDict(
            tokens=TensorDict(response=torch.zeros(2, 10, dtype=torch.long), batch_size=[2]),
            next=TensorDict(reward=torch.zeros(2, 1), batch_size=[2]),
            batch_size=[2],
        )
        torch.testing.assert_close(t.inv(dense)["next", "reward"], torch.full((2, 1), -1.0))
        dense["length"] = torch.tensor([7, 11])
        t = OverlongPenalty(max_length=12, cache_length=4, length_key="length")
        torch.testing.assert_close(t.inv(dense)["next", "reward"], torch.tensor([[0.0], [-0.75]]))

    def test_sampling_is_the_identity(self):
        data = llm_steps([12])
        t = OverlongPenalty(max_length=12, cache_length=4)
        assert t(data) is data and (data["next", "reward"] == 1.0).all()

    def test_env_transform_on_a_torchrl_llm_env(self, tiny_llm):
        """On torchrl's ChatEnv (tokens mode), after a reward transform: the penalty of the
        generated response is added to the step's reward."""
        import tensordict
        from torchrl.envs import Compose, Transform, TransformedEnv
        from torchrl.envs.llm import ChatEnv
        from torchrl.modules.llm import TransformersWrapper

        model, tokenizer = tiny_llm

        class ConstantReward(Transform):
            def _step(self, tensordict, next_tensordict):
                next_tensordict.set("reward", torch.ones(*next_tensordict.batch_size, 1, 1))
                return next_tensordict

        env = TransformedEnv(
            ChatEnv(batch_size=(1,), input_mode="tokens", tokenizer=tokenizer),
            Compose(ConstantReward(), OverlongPenalty(max_length=6, cache_length=4)),
        )
        policy = TransformersWrapper(
            model,
            tokenizer=tokenizer,
            input_mode="tokens",
            generate=True,
            pad_output=False,
            generate_kwargs={
                "max_new_tokens": 5,
                "do_sample": False,
                "suppress_tokens": [tokenizer.eos_token_id],
            },
        )
        with tensordict.set_list_to_stack(True):
            td = policy(env.reset(TensorDict(query=["1 2="], batch_size=[1])))
            out = env.step(td)
        length = td["tokens", "response"].shape[-1]
        assert length == 5  # no EOS: the whole budget
        # free up to 6 - 4 = 2 tokens: 1 - (5 - 2) / 4
        torch.testing.assert_close(out["next", "reward"], torch.full((1, 1, 1), 0.25))
