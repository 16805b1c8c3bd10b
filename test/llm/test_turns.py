"""Tests of torchrl_grpo/llm/turns.py: multi-turn dialogs on torchrl's ChatEnv, tokens exact.

Each test runs a two-turn dialog on torchrl's ``ChatEnv`` in tokens mode with torchrl's own
sampler (``TransformersWrapper(generate=True)``) on a tiny model: the next prompt, its mask, the
dialog ids and the stored turns are checked against the tokens the sampler produced.
"""

import os
import re
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
from helpers.llm import dialog_env, dialog_sampler
from tensordict import TensorDict

from torchrl_grpo.llm import ExactTurns

QUERIES = ["3 9 1 4=", "1 2 0 5=", "5 5 5 1=", "7 0 0 2="]  # one length: see ChatEnv
#: (torchrl 0.14.1's ChatEnv fails to reset in tokens mode on prompts of different lengths)


@pytest.fixture(autouse=True)
def _list_to_stack():
    with tensordict.set_list_to_stack(True):
        yield


def reset(env):
    return env.reset(TensorDict(query=QUERIES, batch_size=[len(QUERIES)]))


def real(tokens, pad):
    return tokens[tokens != pad]


class TestNextPrompt:
    @pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "ragged"])
    def test_the_dialog_so_far_and_the_reply(self, tiny_llm, pad_output):
        """The next prompt is this turn's prompt, its answer and the reply, token for token,
        whatever padding the sampler used; its mask covers exactly it."""
        model, tokenizer = tiny_llm
        pad = tokenizer.pad_token_id
        env, policy = dialog_env(tokenizer, QUERIES), dialog_sampler(model, tokenizer)
        policy.pad_output = pad_output
        reply = torch.tensor(tokenizer("1 2=")["input_ids"])
        td = reset(env)
        torch.manual_seed(0)
        for _ in range(2):
            prompts = [real(p, pad) for p in td.get(("tokens", "prompt"), as_list=True)]
            td = policy(td)
            answers = [real(r, pad) for r in td.get(("tokens", "response"), as_list=True)]
            stored, td = env.step_and_maybe_reset(td)
            if stored["next", "done"].any():
                break
            for prompt, answer, new, mask in zip(
                prompts,
                answers,
                td.get(("tokens", "prompt"), as_list=True),
                td.get(("masks", "all_attention_mask"), as_list=True),
                strict=True,
            ):
                assert new.tolist() == torch.cat([prompt, answer, reply]).tolist()
                assert mask.shape == new.shape and bool(mask.all())

    def test_a_dialog_too_long_for_the_model_raises_when_asked(self, tiny_llm):
        model, tokenizer = tiny_llm
        env = dialog_env(tokenizer, QUERIES, max_length=12, on_overflow="raise")
        turns = next(t for t in env.transform if isinstance(t, ExactTurns))
        sampled = dialog_sampler(model, tokenizer)(reset(env))
        with pytest.raises(ValueError, match=r"row 0 holds \d+ tokens .* max_length=12"):
            env.step(sampled)
        assert turns.overflows == 0

    def test_a_ragged_sampler_output_is_not_changed(self, tiny_llm):
        """ChatEnv is handed a padded copy of a ragged ``("tokens", "full")``: the sampler's
        own output (what a collector stores) keeps its rows."""
        model, tokenizer = tiny_llm
        env = dialog_env(tokenizer, QUERIES)
        policy = dialog_sampler(model, tokenizer, pad_output=False, max_new_tokens=6)
        for seed in range(50):  # sampled answers of different lengths
            torch.manual_seed(seed)
            td = policy(reset(env))
            rows = td.get(("tokens", "full"), as_list=True)
            if len({row.shape for row in rows}) > 1:
                break
        assert len({row.shape for row in rows}) > 1
        before = [row.clone() for row in rows]
        env.step(td)
        after = td.get(("tokens", "full"), as_list=True)
        assert [a.tolist() for a in after] == [b.tolist() for b in before]


class TestOverflow:
    """A dialog that grows past ``max_length`` ends there, truncated, counted, warned once."""

    def test_ended_truncated_counted_and_warned_once(self, tiny_llm):
        """Prompts of 8 tokens, answers of 1 to 3, replies of 4: after the first turn every
        dialog that goes on holds 13 to 15 > 12 tokens. Rows 1 and 3 end at their first turn (not
        checked); rows 0 and 2 end truncated, their reward left as it was (0), and the run
        goes on: a collector's step resets them with new dialogs."""
        model, tokenizer = tiny_llm
        env = dialog_env(tokenizer, QUERIES, early=(1, 3), max_length=12)
        turns = next(t for t in env.transform if isinstance(t, ExactTurns))
        policy = dialog_sampler(model, tokenizer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stored, td = env.step_and_maybe_reset(policy(reset(env)))
            stored_again, _ = env.step_and_maybe_reset(policy(td))
        assert stored["next", "truncated"].reshape(-1).tolist() == [True, False, True, False]
        assert stored["next", "done"].reshape(-1).tolist() == [True] * 4
        assert stored["next", "reward"].reshape(-1).tolist() == [0.0] * 4
        assert td["dialog_id"].tolist() == [4, 5, 6, 7]  # every row reset: new dialogs
        assert turns.overflows == 4  # rows 0 and 2, then rows 0 and 2 of the new dialogs
        mine = [w for w in caught if "ExactTurns" in str(w.message)]
        assert len(mine) == 1
        message = r"row 0 holds 1[3-5] tokens after this turn, more than max_length=12"
        assert re.search(message, str(mine[0].message))
        truncated = stored_again["next", "truncated"].reshape(-1).tolist()
        assert truncated == [True, False, True, False]

    def test_without_step_counter_the_truncated_entry_exists(self, tiny_llm):
        """An env with no ``StepCounter``: ``ExactTurns`` declares ``"truncated"`` itself
        (``False`` at reset) and sets it on an overflow."""
        model, tokenizer = tiny_llm
        env = dialog_env(tokenizer, QUERIES, turns=None, max_length=12)
        assert "truncated" in env.full_done_spec.keys()
        td = reset(env)
        assert td["truncated"].shape == td["done"].shape and not bool(td["truncated"].any())
        with pytest.warns(UserWarning, match="ends here, truncated"):
            td = env.step(dialog_sampler(model, tokenizer)(td))
        assert bool(td["next", "truncated"].all()) and bool(td["next", "done"].all())

    def test_a_dialog_that_fits_is_not_touched(self, tiny_llm):
        model, tokenizer = tiny_llm
        env = dialog_env(tokenizer, QUERIES, max_length=15)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            warnings.filterwarnings("ignore", message="size_average")  # torch, not ours
            td = env.step(dialog_sampler(model, tokenizer)(reset(env)))
        assert not bool(td["next", "done"].any()) and not bool(td["next", "truncated"].any())


class TestStoredTurns:
    def test_each_turn_is_its_prompt_then_its_answer(self, tiny_llm):
        """Inside a collector's step the stored turn is cut to its real tokens: full is prompt
        then answer, nothing padded, masks as long as the tokens."""
        model, tokenizer = tiny_llm
        pad = tokenizer.pad_token_id
        env, policy = dialog_env(tokenizer, QUERIES), dialog_sampler(model, tokenizer)
        td = reset(env)
        torch.manual_seed(1)
        for _ in range(2):
            sampled = policy(td)
            answers = [real(r, pad) for r in sampled.get(("tokens", "response"), as_list=True)]
            stored, td = env.step_and_maybe_reset(sampled)
            full = stored.get(("tokens", "full"), as_list=True)
            prompt = stored.get(("tokens", "prompt"), as_list=True)
            response = stored.get(("tokens", "response"), as_list=True)
            masks = stored.get(("masks", "all_attention_mask"), as_list=True)
            for f, p, r, m, a in zip(full, prompt, response, masks, answers, strict=True):
                assert f.tolist() == torch.cat([p, r]).tolist() and r.tolist() == a.tolist()
                assert not bool((f == pad).any()) and m.shape == f.shape

    def test_exact_turn_leaves_an_unpadded_turn_as_it_is(self):
        turns = ExactTurns(pad_token_id=0)
        td = TensorDict({("tokens", "full"): torch.tensor([[3, 4], [5, 6]])}, batch_size=[2])
        assert turns.exact_turn(td) is td


class TestDialogIds:
    def test_new_at_each_reset_kept_across_turns(self, tiny_llm):
        model, tokenizer = tiny_llm
        env, policy = dialog_env(tokenizer, QUERIES), dialog_sampler(model, tokenizer)
        td = reset(env)
        first = td["dialog_id"].tolist()
        assert first == [0, 1, 2, 3]
        stored, td = env.step_and_maybe_reset(policy(td))
        assert stored["dialog_id"].tolist() == first and td["dialog_id"].tolist() == first
        stored, td = env.step_and_maybe_reset(policy(td))  # the second turn ends every dialog
        assert stored["next", "done"].all()
        assert stored["dialog_id"].tolist() == first
        assert td["dialog_id"].tolist() == [4, 5, 6, 7]  # reset: new dialogs

    def test_a_row_reset_alone_gets_its_new_prompt_mask(self, tiny_llm):
        """A collector resets a finished row while the others go on: the reset row's mask is
        its new prompt's (torchrl keeps the last turn's, and the sampler then attends to the
        padding of the new prompt as if it were text); its dialog id is new."""
        model, tokenizer = tiny_llm
        env = dialog_env(tokenizer, QUERIES, early=(1, 3))
        policy = dialog_sampler(model, tokenizer)
        td = reset(env)
        stored, td = env.step_and_maybe_reset(policy(td))
        assert stored["next", "done"].reshape(-1).tolist() == [False, True, False, True]
        prompts = td.get(("tokens", "prompt"), as_list=True)
        masks = td.get(("masks", "all_attention_mask"), as_list=True)
        assert [len(p) for p in prompts] == [len(m) for m in masks]
        assert len(prompts[1]) == len(prompts[3]) == 8 and len(prompts[0]) > 8
        ids = td["dialog_id"].tolist()
        assert ids[0] == 0 and ids[2] == 2  # going on
        assert min(ids[1], ids[3]) > 3 and ids[1] != ids[3]  # new

    def test_partial_reset_renews_only_the_reset_rows(self):
        turns = ExactTurns(pad_token_id=0)
        before = TensorDict(
            {
                "dialog_id": torch.tensor([7, 8, 9]),
                "_reset": torch.tensor([[False], [True], [False]]),
            },
            batch_size=[3],
        )
        out = turns._reset(before, TensorDict(batch_size=[3]))
        assert out["dialog_id"].tolist() == [7, 0, 9]


class TestErrors:
    def test_a_pad_token_is_needed(self):
        with pytest.raises(ValueError, match="needs the sampler's pad_token_id"):
            ExactTurns(pad_token_id=None)

    def test_a_pad_token_that_ends_sequences_is_refused(self):
        with pytest.raises(ValueError, match=r"pad token id \(2\) is the end-of-sequence id"):
            ExactTurns(pad_token_id=2, eos_token_id=2)

    @pytest.mark.parametrize("bad", [0, -3, 2.0, True])
    def test_max_length_is_a_positive_integer(self, bad):
        with pytest.raises(ValueError, match=f"max_length must be .* got {bad!r}"):
            ExactTurns(pad_token_id=0, max_length=bad)

    def test_on_overflow_is_named(self):
        with pytest.raises(ValueError, match="on_overflow must be one of .* got 'drop'"):
            ExactTurns(pad_token_id=0, on_overflow="drop")


def _padded_turns(rows: int, pad: int = 13, seed: int = 0):
    """A sampler's padded output for ``rows`` dialogs: prompts left-padded, answers right-padded,
    per-token log-probs, and the environment's reply to each."""
    from tensordict import lazy_stack
    from torchrl.modules.llm.policies.common import Tokens

    g = torch.Generator().manual_seed(seed)
    steps, replies = [], []
    for i in range(rows):
        prompt = torch.cat(
            [torch.full((i % 3,), pad), torch.randint(10, (6 - i % 3,), generator=g)]
        )
        answer = torch.cat(
            [torch.randint(10, (2 + i % 2,), generator=g), torch.full((1 - i % 2,), pad)]
        )
        full = torch.cat([prompt, answer])
        steps.append(
            TensorDict(
                tokens=Tokens(prompt=prompt, response=answer, full=full),
                log_probs=TensorDict(full=torch.randn(len(full), generator=g)),
                dialog_id=torch.tensor(i),
            )
        )
        replies.append(TensorDict(reply_tokens=torch.randint(10, (1 + i % 2,), generator=g)))
    return lazy_stack(steps), lazy_stack(replies)


class TestLaunches:
    def test_a_fixed_number_of_operators_whatever_the_rows(self):
        """The stored turn cut to its real tokens and the next prompts built: the same
        operators and host reads for 4 rows as for 32, and the same tokens as row by row."""
        from torchrl_grpo.launches import count_launches

        turns = ExactTurns(pad_token_id=13, eos_token_id=11)
        counts = []
        for rows in (4, 32):
            td, next_td = _padded_turns(rows)
            with count_launches() as launches:
                stored = turns.exact_turn(td.copy())
                prompts = turns._step(td.copy(), next_td.copy()).get(
                    ("tokens", "prompt"), as_list=True
                )
            counts.append(launches)
            fulls = td.get(("tokens", "full"), as_list=True)
            replies = next_td.get("reply_tokens", as_list=True)
            for full, got, reply, prompt in zip(
                fulls, stored.get(("tokens", "full"), as_list=True), replies, prompts
            ):
                assert got.tolist() == full[full != 13].tolist()
                assert prompt.tolist() == full[full != 13].tolist() + reply.tolist()
            for lp, full, got in zip(
                td.get(("log_probs", "full"), as_list=True),
                fulls,
                stored.get(("log_probs", "full"), as_list=True),
            ):
                assert torch.equal(got, lp[full != 13])
        assert counts[0].ops == counts[1].ops and counts[0].syncs == counts[1].syncs <= 2
