"""Tests of torchrl_grpo/loss/positions.py: every stored entry read on its own token.

A batch scored by the policy that sampled it has ratio 1 at every token: ESS 1, clip fraction 0,
KL 0. That holds here in every scoring mode torchrl's LLM stack offers (the scorer's and the
loss's ``pad_output``, padded or ragged storage, one turn or a dialog of several), with the lean
wrapper and torchrl's; where an entry cannot be lined up with its tokens the loss raises and
says why. What torchrl's own ``GRPOLoss`` does on the same batches is recorded beside it.
"""

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
from helpers.llm import dialog_env, dialog_sampler, llm_scorer
from tensordict import TensorDict, lazy_stack
from torchrl.envs.llm import RetrieveLogProb
from torchrl.modules.llm import TransformersWrapper
from torchrl.objectives.llm import GRPOLoss as TorchrlGRPOLoss

from torchrl_grpo import GRPOLoss, LeanTransformersWrapper
from torchrl_grpo.loss.inputs import _get_input

QUERIES = ["3 9 1 4=", "1 2 0 5=", "5 5 5 1=", "7 0 0 2=", "8 8 1 3=", "2 4 6 8="]


@pytest.fixture(autouse=True)
def _list_to_stack():
    with tensordict.set_list_to_stack(True):
        yield


def collect(model, tokenizer, *, turns: int, exact: bool, seed: int = 0):
    """Every turn of one batch of dialogs as stored by a collector's step, one lazy stack: the
    sampler pads (``pad_output=True``); ``exact``: through ``ExactTurns`` (each turn cut to its
    tokens), else torchrl's ``ChatEnv`` alone (the padded output stored as it is)."""
    env = dialog_env(tokenizer, QUERIES, turns=turns, exact=exact)
    policy = dialog_sampler(model, tokenizer, max_new_tokens=4)
    torch.manual_seed(seed)
    td, stored = env.reset(), []
    for _ in range(turns):
        out, td = env.step_and_maybe_reset(policy(td))
        stored.append(out)
    return lazy_stack([row for turn in stored for row in turn.unbind(0)])


def scored(batch, model, tokenizer, pad_output: bool, lean: bool):
    """``batch`` with the sampling and reference log-probs of the same weights, and advantages."""
    batch = batch.copy()
    for key in ("log_probs", "ref_log_probs"):
        scorer = llm_scorer(model, tokenizer, pad_output=pad_output, lean=lean, log_probs_key=key)
        with torch.no_grad():
            batch = RetrieveLogProb(scorer, assistant_only=False)(batch)
    batch.set(
        "advantage", torch.randn(len(batch), 1, 1, generator=torch.Generator().manual_seed(1))
    )
    return batch


def on_policy(loss_cls, batch, model, tokenizer, pad_output: bool, lean: bool) -> dict:
    loss = loss_cls(
        llm_scorer(model, tokenizer, pad_output=pad_output, lean=lean),
        masking_strategy="sft",
        kl_to_ref_coeff=0.1,
    )
    loss.set_keys(sample_log_prob=("next", "log_probs", "full"))
    out = loss(batch.copy())
    keys = ("ESS", "clip_fraction", "kl_approx", "kl_to_ref")
    return {key: float(out.get(key)) for key in keys if out.get(key, None) is not None}


MODES = [(s, o, lean) for s in (True, False) for o in (True, False) for lean in (True, False)]
IDS = [
    f"score_pad{int(s)}-loss_pad{int(o)}-{'lean' if lean else 'torchrl'}" for s, o, lean in MODES
]


class TestOnPolicy:
    @pytest.mark.parametrize(("turns", "exact"), [(1, False), (1, True), (2, True)])
    @pytest.mark.parametrize(("score_pad", "loss_pad", "lean"), MODES, ids=IDS)
    def test_ratio_one_in_every_mode(self, tiny_llm, turns, exact, score_pad, loss_pad, lean):
        """One turn stored padded (the sampler's output as is) or exact, and two-turn dialogs
        through ExactTurns: scored by the weights that sampled them, in any scoring mode, the
        loss reads ESS 1, no clipping and no KL."""
        model, tokenizer = tiny_llm
        batch = scored(
            collect(model, tokenizer, turns=turns, exact=exact), model, tokenizer, score_pad, lean
        )
        got = on_policy(GRPOLoss, batch, model, tokenizer, loss_pad, lean)
        assert got["ESS"] == pytest.approx(1.0, abs=1e-5), got
        assert got["clip_fraction"] == 0.0, got
        assert abs(got["kl_approx"]) < 1e-5 and abs(got["kl_to_ref"]) < 1e-5, got

    def test_torchrl_grpo_loss_on_the_same_batches(self, tiny_llm):
        """What torchrl's own GRPOLoss reads on the same batches: right where every entry is
        as long as its tokens, shifted where the scorer dropped the pads of padded storage
        (it reads every ragged entry left-padded)."""
        model, tokenizer = tiny_llm
        padded = collect(model, tokenizer, turns=1, exact=False)
        assert any(
            bool((t == tokenizer.pad_token_id).any())
            for t in padded.get(("tokens", "full"), as_list=True)
        )
        same = scored(padded, model, tokenizer, pad_output=True, lean=False)
        dropped = scored(padded, model, tokenizer, pad_output=False, lean=False)
        ok = on_policy(TorchrlGRPOLoss, same, model, tokenizer, True, False)
        assert ok["ESS"] == pytest.approx(1.0, abs=1e-5)
        shifted = on_policy(TorchrlGRPOLoss, dropped, model, tokenizer, True, False)
        assert shifted["ESS"] < 1 - 1e-4  # torchrl: misaligned without a word
        ours = on_policy(GRPOLoss, dropped, model, tokenizer, True, False)
        assert ours["ESS"] == pytest.approx(1.0, abs=1e-5)


class TestRowsOnTokens:
    """Entries whose rows differ in length from their tokens: lined up exactly, or refused."""

    @pytest.fixture
    def read(self, tiny_llm):
        model, tokenizer = tiny_llm
        plan = GRPOLoss(llm_scorer(model, tokenizer), masking_strategy="sft")._read_plan()
        pad = tokenizer.pad_token_id

        def read(tokens, log_probs):
            rows = [
                TensorDict(
                    {
                        ("tokens", "full"): torch.tensor([pad if x is None else x for x in t]),
                        ("log_probs", "full"): torch.tensor(lp),
                    }
                )
                for t, lp in zip(tokens, log_probs, strict=True)
            ]
            return _get_input(lazy_stack(rows), ("log_probs", "full"), "", plan, per_token=True)

        return read

    def test_rows_are_put_back_on_their_real_tokens(self, read):
        # row 0 was scored without its two trailing pads (None), row 1 is exact
        got = read([[1, 2, 3, None, None], [4, 5]], [[-1.0, -2.0, -3.0], [-4.0, -5.0]])
        assert got.tolist() == [[-1.0, -2.0, -3.0, 0.0, 0.0], [0.0, 0.0, 0.0, -4.0, -5.0]]

    def test_left_padded_rows_keep_their_last_values(self, read):
        got = read([[1, 2], [4, 5, 6]], [[0.0, -1.0, -2.0], [-4.0, -5.0, -6.0]])
        assert got.tolist() == [[0.0, -1.0, -2.0], [-4.0, -5.0, -6.0]]

    def test_other_differences_raise(self, read):
        with pytest.raises(
            ValueError,
            match=r"row 0 of \('log_probs', 'full'\) has 2 values but its tokens "
            r"\('tokens', 'full'\) have 4, 0 of them pad tokens",
        ):
            read([[1, 2, 3, 4], [4, 5]], [[-1.0, -2.0], [-4.0, -5.0]])


class TestInnerPads:
    def test_pads_inside_a_sequence_are_refused(self, tiny_llm):
        """torchrl's ChatEnv alone over two turns: the first answer's padding is inside the
        second prompt. The loss says so rather than train on other numbers than were sampled."""
        model, tokenizer = tiny_llm
        pad = tokenizer.pad_token_id
        full = torch.tensor([[5, 6, 7, pad, pad, 8, 9, 3], [5, 6, 7, 1, 2, 8, 9, 3]])
        batch = TensorDict(
            {
                ("tokens", "full"): full,
                ("tokens", "prompt"): full[:, :6],
                ("masks", "all_attention_mask"): full != pad,
                ("log_probs", "full"): torch.zeros(2, 8),
                "advantage": torch.ones(2, 1, 1),
            },
            batch_size=[2],
        )
        loss = GRPOLoss(llm_scorer(model, tokenizer, pad_output=True), masking_strategy="sft")
        with pytest.raises(ValueError, match=r"row 0 of \('tokens', 'full'\) holds 2 pad tokens"):
            loss(batch)
        loss(TensorDict({k: v[1:] for k, v in batch.items(True, True)}, batch_size=[1]))


#: a chat template with the assistant's turn marked, for history input
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
)


class TestHistoryInput:
    @pytest.mark.parametrize("loss_pad", [True, False])
    @pytest.mark.parametrize("score_pad", [True, False])
    @pytest.mark.parametrize("lean", [True, False], ids=["lean", "torchrl"])
    def test_ratio_one(self, tiny_llm, score_pad, loss_pad, lean):
        """Dialogs as torchrl ``History`` (the wrapper applies the chat template), answers of
        different lengths, the assistant's tokens in the loss (``"rlhf"``): ESS 1, no KL."""
        from torchrl.data.llm import History

        model, tokenizer = tiny_llm
        chats = [("3 9 1 4=", "17"), ("1 2=", "3"), ("5 5 5=", "15"), ("7 1 0 0 0=", "8")]
        rows = [
            TensorDict(
                history=TensorDict(
                    full=History.from_chats(
                        [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]]
                    )[0]
                )
            )
            for q, a in chats
        ]
        batch = lazy_stack(rows)

        def wrapper(pad_output, **kw):
            cls = LeanTransformersWrapper if lean else TransformersWrapper
            return cls(
                model,
                tokenizer=tokenizer,
                input_mode="history",
                generate=False,
                return_log_probs=True,
                pad_output=pad_output,
                chat_template=TEMPLATE,
                **kw,
            )

        with torch.no_grad():
            for key in ("log_probs", "ref_log_probs"):
                scorer = wrapper(score_pad, log_probs_key=key)
                batch = RetrieveLogProb(
                    scorer,
                    assistant_only=True,
                    tokenizer=tokenizer,
                    tokenizer_kwargs={"chat_template": TEMPLATE},
                )(batch)
        batch.set("advantage", torch.randn(len(batch), 1, 1))
        loss = GRPOLoss(
            wrapper(loss_pad),
            masking_strategy="rlhf",
            kl_to_ref_coeff=0.1,
        )
        loss.set_keys(sample_log_prob=("log_probs", "full"), ref_log_prob=("ref_log_probs", "full"))
        out = loss(batch.copy())
        assert float(out.ESS) == pytest.approx(1.0, abs=1e-5)
        assert float(out.clip_fraction) == 0.0
        assert abs(float(out.kl_approx)) < 1e-5 and abs(float(out.kl_to_ref)) < 1e-5
