"""Tests of torchrl_grpo/llm/replies.py: the environment's reply from a Python function."""

import os

import pytest
import torch

try:
    import transformers  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs the `llm` extra (make test): without it this is a failure, not a skip
    pytest.skip("needs the llm extra: pip install -e '.[llm]'", allow_module_level=True)

import tensordict
from helpers.llm import dialog_env, dialog_sampler

from torchrl_grpo.llm import ToolReply

QUERIES = ["3 9 1 4=", "1 2 0 5=", "5 5 5 1=", "7 0 0 2="]


@pytest.fixture(autouse=True)
def _list_to_stack():
    with tensordict.set_list_to_stack(True):
        yield


class TestToolReply:
    def test_replies_are_appended_and_a_raising_tool_is_an_answer(self, tiny_llm):
        """Each row's reply is the function's text, appended to the dialog by ExactTurns; the
        row whose tool raises gets the error as its reply, is flagged, and goes on."""
        model, tokenizer = tiny_llm
        seen = []

        def tool(text, row):
            seen.append((text, row["query"]))
            if row["query"] == QUERIES[1]:
                raise ValueError("no 0 here")
            return None if row["query"] == QUERIES[2] else "7="

        env = dialog_env(tokenizer, QUERIES, tool=tool, reply="")
        replies = next(t for t in env.transform if isinstance(t, ToolReply))
        td = env.reset()
        sampled = dialog_sampler(model, tokenizer)(td)
        stored, td = env.step_and_maybe_reset(sampled)
        assert replies.calls == 4 and replies.errors == 1
        assert stored["next", "tool_error"].reshape(-1).tolist() == [False, True, False, False]
        assert [q for _, q in seen] == QUERIES
        prompts = td.get(("tokens", "prompt"), as_list=True)
        fulls = stored.get(("tokens", "full"), as_list=True)
        error = torch.tensor(
            tokenizer("error: ValueError: no 0 here", add_special_tokens=False)["input_ids"]
        )
        assert prompts[0].tolist() == fulls[0].tolist() + tokenizer("7=")["input_ids"]
        assert prompts[1].tolist() == fulls[1].tolist() + error.tolist()
        assert prompts[2].tolist() == fulls[2].tolist()  # no reply

    def test_answers_are_cut_at_the_end_of_sequence(self, tiny_llm):
        _, tokenizer = tiny_llm
        replies = ToolReply(lambda text, row: None, tokenizer)
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        ids = tokenizer("17")["input_ids"]
        texts = replies.answers([torch.tensor([*ids, eos, pad]), torch.tensor([*ids, pad])])
        assert texts == ["17" + tokenizer.eos_token, "17"]
