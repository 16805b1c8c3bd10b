"""Tests of torchrl_grpo/llm/replies.py: the environment's reply and reward from Python
functions."""

import os
import string
import warnings

import pytest
import torch

try:
    import transformers  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs the `llm` extra (make test): without it this is a failure, not a skip
    pytest.skip("needs the llm extra: pip install -e '.[llm]'", allow_module_level=True)

import tensordict
from helpers.llm import (
    LLM_CHARS,
    answered,
    dialog_env,
    dialog_sampler,
    tiny_qwen2,
    tiny_tokenizer,
)

from torchrl_grpo.llm import ToolReply, TurnReward

QUERIES = ["3 9 1 4=", "1 2 0 5=", "5 5 5 1=", "7 0 0 2="]
#: The characters of Python's error messages, but no accents: "é" is what it cannot encode.
TEXT_CHARS = LLM_CHARS + string.ascii_letters + ":'()_.,"


@pytest.fixture(autouse=True)
def _list_to_stack():
    with tensordict.set_list_to_stack(True):
        yield


@pytest.fixture
def text_llm():
    """A tiny model whose tokenizer encodes Python's error messages (not "é")."""
    tokenizer = tiny_tokenizer(TEXT_CHARS, strict=True)
    return tiny_qwen2(tokenizer), tokenizer


def first_step(env, model, tokenizer):
    """One collector step of ``env`` (reset, sampled turn): ``(stored, next input)``."""
    return env.step_and_maybe_reset(dialog_sampler(model, tokenizer)(env.reset()))


def replies_of(env) -> ToolReply:
    return next(t for t in env.transform if isinstance(t, ToolReply))


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class TestToolReply:
    def test_replies_are_appended_and_a_raising_tool_is_an_answer(self, text_llm):
        """Each row's reply is the function's text, appended to the dialog by ExactTurns; the
        row whose tool raises gets the error as its reply, is flagged, and goes on."""
        model, tokenizer = text_llm
        seen = []

        def tool(text, row):
            seen.append((text, row["query"]))
            if row["query"] == QUERIES[1]:
                raise ValueError("no 0 here")
            return None if row["query"] == QUERIES[2] else "7="

        env = dialog_env(tokenizer, QUERIES, tool=tool, reply="")
        replies = replies_of(env)
        stored, td = first_step(env, model, tokenizer)
        assert replies.calls == 4 and replies.errors == 1
        assert stored["next", "tool_error"].reshape(-1).tolist() == [False, True, False, False]
        assert [q for _, q in seen] == QUERIES
        prompts = td.get(("tokens", "prompt"), as_list=True)
        fulls = stored.get(("tokens", "full"), as_list=True)
        assert prompts[0].tolist() == fulls[0].tolist() + ids(tokenizer, "7=")
        error = ids(tokenizer, "error: ValueError: no 0 here")
        assert prompts[1].tolist() == fulls[1].tolist() + error
        assert prompts[2].tolist() == fulls[2].tolist()  # no reply

    def test_answers_are_cut_at_the_end_of_sequence(self, tiny_llm):
        _, tokenizer = tiny_llm
        replies = ToolReply(lambda text, row: None, tokenizer)
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        answer = tokenizer("17")["input_ids"]
        texts = replies.answers([torch.tensor([*answer, eos, pad]), torch.tensor([*answer, pad])])
        assert texts == ["17" + tokenizer.eos_token, "17"]


class TestErrorReply:
    """The reply to an error is one the tokenizer encodes, whatever the error says."""

    def test_cut_to_max_error_tokens(self, text_llm):
        _, tokenizer = text_llm
        long = ValueError("x" * 100)
        text = "error: ValueError: " + "x" * 100
        assert ToolReply(None, tokenizer).error_tokens(long) == ids(tokenizer, text)[:32]
        assert ToolReply(None, tokenizer, max_error_tokens=5).error_tokens(long) == ids(
            tokenizer, "error"
        )
        whole = ToolReply(None, tokenizer, max_error_tokens=None).error_tokens(long)
        assert whole == ids(tokenizer, text)

    def test_error_reply_a_text_or_a_function_of_the_error(self, text_llm):
        _, tokenizer = text_llm
        fixed = ToolReply(None, tokenizer, error_reply="0=")
        assert fixed.error_tokens(KeyError("a")) == ids(tokenizer, "0=")
        named = ToolReply(None, tokenizer, error_reply=lambda err: type(err).__name__)
        assert named.error_tokens(KeyError("a")) == ids(tokenizer, "KeyError")
        broken = ToolReply(None, tokenizer, error_reply=lambda err: err.missing)
        with pytest.warns(UserWarning, match="error_reply raised AttributeError"):
            assert broken.error_tokens(KeyError("a")) == ids(tokenizer, "error: KeyError: 'a'")

    @pytest.mark.parametrize("strict", [True, False], ids=["raises", "unknown-as-pad"])
    def test_an_error_it_cannot_encode_gives_no_reply_and_one_warning(self, strict):
        """A tokenizer of digits cannot write "error": a raising tool's row gets no reply
        (not the tokenizer's exception, which used to end the run; not pad ids inside the
        dialog), is flagged and counted, and the first such row warns, naming the characters."""
        tokenizer = tiny_tokenizer(strict=strict)
        model = tiny_qwen2(tokenizer)

        def tool(text, row):
            raise RuntimeError("délai dépassé")

        env = dialog_env(tokenizer, QUERIES, tool=tool, reply="", turns=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stored, td = first_step(env, model, tokenizer)
            stored, td = env.step_and_maybe_reset(dialog_sampler(model, tokenizer)(td))
        mine = [w for w in caught if "ToolReply" in str(w.message)]
        assert len(mine) == 1 and "'é'" in str(mine[0].message)
        assert "error_reply" in str(mine[0].message)
        assert replies_of(env).errors == 8 and bool(stored["next", "tool_error"].all())
        prompts = td.get(("tokens", "prompt"), as_list=True)
        fulls = stored.get(("tokens", "full"), as_list=True)
        assert [p.tolist() for p in prompts] == [f.tolist() for f in fulls]  # no reply

    def test_a_reply_it_cannot_encode_is_the_tools_error(self, text_llm):
        model, tokenizer = text_llm
        env = dialog_env(tokenizer, QUERIES, reply="", tool=lambda text, row: "café")
        replies = replies_of(env)
        replies.error_reply = "0="
        with pytest.warns(UserWarning, match=r"cannot encode the reply 'café' \('é'\)"):
            stored, td = first_step(env, model, tokenizer)
        assert replies.errors == 4 and bool(stored["next", "tool_error"].all())
        for prompt, full in zip(
            td.get(("tokens", "prompt"), as_list=True),
            stored.get(("tokens", "full"), as_list=True),
            strict=True,
        ):
            assert prompt.tolist() == full.tolist() + ids(tokenizer, "0=")

    def test_an_error_reply_it_cannot_encode_is_refused_at_construction(self):
        tokenizer = tiny_tokenizer(strict=True)
        with pytest.raises(ValueError, match=r"cannot encode error_reply='error 1'.*'e', 'o'"):
            ToolReply(None, tokenizer, error_reply="error 1")

    @pytest.mark.parametrize("bad", [0, -1, 2.5, True])
    def test_max_error_tokens_is_a_positive_integer(self, bad):
        with pytest.raises(ValueError, match=f"max_error_tokens must be .* got {bad!r}"):
            ToolReply(None, None, max_error_tokens=bad)


class TestTurnReward:
    def right(self, text, row):
        return float(text == "13" + "<eos>")

    def test_rewards_and_the_dialogs_it_ends(self, tiny_llm):
        """``("next", "reward")`` ``[B, 1, 1]`` float32 from ``score``; the rows ``ends``
        says are terminated and done, the others go on."""
        _, tokenizer = tiny_llm
        turn_reward = TurnReward(self.right, tokenizer, ends=lambda text, row: text.startswith("1"))
        env = dialog_env(tokenizer, QUERIES, extra=[turn_reward])
        assert env.full_reward_spec["reward"].shape == (4, 1, 1)
        td = env.step(answered(env.reset(), tokenizer, ["13<eos>", "12<eos>", "2<eos>", "13"]))
        assert td["next", "reward"].dtype == torch.float32
        assert td["next", "reward"].shape == (4, 1, 1)
        assert td["next", "reward"].reshape(-1).tolist() == [1.0, 0.0, 0.0, 0.0]
        assert td["next", "terminated"].reshape(-1).tolist() == [True, True, False, True]
        assert td["next", "done"].reshape(-1).tolist() == [True, True, False, True]

    def test_no_ends_leaves_the_dialogs_going(self, tiny_llm):
        _, tokenizer = tiny_llm
        env = dialog_env(tokenizer, QUERIES, extra=[TurnReward(self.right, tokenizer)])
        td = env.step(answered(env.reset(), tokenizer, ["13<eos>"] * 4))
        assert td["next", "reward"].reshape(-1).tolist() == [1.0] * 4
        assert not bool(td["next", "done"].any())

    def test_a_raising_score_names_the_row(self, tiny_llm):
        _, tokenizer = tiny_llm

        def score(text, row):
            if row["query"] == QUERIES[2]:
                raise KeyError("answer")
            return 0.0

        env = dialog_env(tokenizer, QUERIES, extra=[TurnReward(score, tokenizer)])
        with pytest.raises(RuntimeError, match=r"scoring row 2 raised \(answer '7<eos>'\)"):
            env.step(answered(env.reset(), tokenizer, ["7<eos>"] * 4))
