"""Tests of torchrl_grpo/llm/ragged_chat.py: torchrl's ChatEnv in tokens mode resetting with
prompts of different token lengths (the private name it overrides: test/test_compat.py)."""

import pytest
import torch
from tensordict import TensorDict

from torchrl_grpo.llm import ragged_prompts


def _chat_env():
    """A torchrl ``ChatEnv`` in tokens mode over a word-level tokenizer (a, b, c)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from torchrl.envs.llm import ChatEnv
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "a", "b", "c"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    template = {"chat_template": tokenizer.chat_template}
    return ChatEnv(
        batch_size=(3,),
        tokenizer=tokenizer,
        input_mode="tokens",
        system_prompt=None,
        template_kwargs=template,
    )


class TestRaggedPrompts:
    """torchrl's ChatEnv (tokens mode) cannot reset prompts of different lengths; the instance
    patch can. If the first test fails, torchrl reads them itself now: drop the patch."""

    def test_torchrl_alone_fails_on_prompts_of_different_lengths(self):
        with pytest.raises(RuntimeError, match="stack"):
            _chat_env().reset(TensorDict(query=["a b", "a b c", "c"], batch_size=[3]))

    def test_ragged_prompts_reset(self):
        env = ragged_prompts(_chat_env())
        td = env.reset(TensorDict(query=["a b", "a b c", "c"], batch_size=[3]))
        prompts = td.get(("tokens", "prompt"), as_list=True)
        assert [p.tolist() for p in prompts] == [[1, 2], [1, 2, 3], [3]]

    def test_equal_lengths_as_torchrl(self):
        query = TensorDict(query=["a b", "b c", "c a"], batch_size=[3])
        ours = ragged_prompts(_chat_env()).reset(query.clone())
        theirs = _chat_env().reset(query.clone())
        assert torch.equal(ours["tokens", "prompt"], theirs["tokens", "prompt"])

    def test_repeated_queries_templated_once_each(self):
        """A group's query repeated (as DatasetChatEnv repeats it): the chat template runs
        once per distinct query, and every row gets torchrl's tokens."""
        env = ragged_prompts(_chat_env())
        calls = []
        template = env.tokenizer.apply_chat_template

        def counting(conversation, **kwargs):
            calls.append(conversation)
            return template(conversation, **kwargs)

        env.tokenizer.apply_chat_template = counting
        query = TensorDict(query=["a b", "b c", "a b"], batch_size=[3])
        ours = env.reset(query.clone())
        assert len(calls) == 2
        theirs = _chat_env().reset(query.clone())
        assert torch.equal(ours["tokens", "prompt"], theirs["tokens", "prompt"])

    def test_a_copy_of_the_env_keeps_reading_its_own(self):
        import copy
        import pickle

        env = ragged_prompts(_chat_env())
        for twin in (copy.deepcopy(env), pickle.loads(pickle.dumps(env))):
            td = twin.reset(TensorDict(query=["a b", "a b c", "c"], batch_size=[3]))
            assert [len(p) for p in td.get(("tokens", "prompt"), as_list=True)] == [2, 3, 1]

    def test_a_pickle_loads_in_a_fresh_process(self, tmp_path):
        import pickle
        import subprocess
        import sys

        path = tmp_path / "env.pkl"
        path.write_bytes(pickle.dumps(ragged_prompts(_chat_env())))
        code = (
            "import pickle, sys; env = pickle.load(open(sys.argv[1], 'rb')); "
            "print(type(env).__name__)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == "RaggedChatEnv"

    def test_importing_the_package_imports_no_llm_env(self):
        import subprocess
        import sys

        code = "import sys, torchrl_grpo; print('torchrl.envs.llm' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.stdout.strip() == "False", out.stderr[-2000:]

    def test_other_envs(self):
        from torchrl.envs import GymEnv

        with pytest.raises(TypeError, match="no torchrl ChatEnv"):
            ragged_prompts(GymEnv("CartPole-v1"))
