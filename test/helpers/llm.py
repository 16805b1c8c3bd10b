"""A tiny language model for torchrl's LLM stack, built locally (nothing is downloaded): a
character tokenizer, a one-layer causal LM, torchrl's scoring wrapper and a GRPO batch."""

from __future__ import annotations

import torch

LLM_CHARS = "0123456789 ="


def tiny_tokenizer(chars: str = LLM_CHARS, *, strict: bool = False):
    """A character-level ``PreTrainedTokenizerFast`` over ``chars`` plus EOS and PAD.

    A character it does not have is encoded as PAD, or, ``strict``, raises (``WordLevel error:
    Missing [UNK] token``), as the examples' tokenizer (``examples/llm_grpo.py``) does.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(chars)}
    vocab["<eos>"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None if strict else "<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")


def qwen_chat_tokenizer():
    """A character-level tokenizer standing in for the Hub's Qwen one, with torchrl's Qwen chat
    template (``_CHAT_TEMPLATES["qwen"]``, the one torchrl picks for a name with "qwen" in it):
    printable ASCII a token each, Qwen's special tokens whole; nothing is downloaded."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from torchrl.data.llm.history import _CHAT_TEMPLATES
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {c: i for i, c in enumerate(dict.fromkeys(string.printable))}
    vocab.update({token: len(vocab) + i for i, token in enumerate(specials)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
        name_or_path="local/qwen-chars",
    )
    tokenizer.chat_template = _CHAT_TEMPLATES["qwen"]
    return tokenizer


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
            step.set(
                ("log_probs", "full"), log_prob + drift * torch.randn(log_prob.shape, generator=g)
            )
            step.set(
                ("next", "ref_log_probs", "full"),
                log_prob + drift * torch.randn(log_prob.shape, generator=g),
            )
            step.set(("masks", "all_assistant_mask"), assistant)
            step.set("advantage", torch.randn(1, 1, generator=g))
            steps.append(step)
    return lazy_stack(steps)


#: A chat template that writes each message as it is (a prompt is its own text).
PLAIN_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def dialog_env(
    tokenizer,
    queries,
    *,
    turns: int = 2,
    reply: str = "1 2=",
    exact: bool = True,
    early=(),
    tool=None,
    extra=(),
    max_length=None,
    on_overflow="truncate",
):
    """A two-turn agent on torchrl's ``DatasetChatEnv`` in tokens mode, one dialog per query
    (every reset serves ``queries`` again).

        After each answer the environment replies ``reply`` (its tokens at ``"reply_tokens"``) and
        gives reward 0; ``StepCounter`` ends each dialog after ``turns`` answers, and the rows in
    ``early`` end after their first (a collector then resets them alone). ``exact``: with
        :class:`~torchrl_grpo.llm.ExactTurns` (else torchrl's ``ChatEnv`` alone, which makes the
        sampler's whole padded output the next prompt and appends no reply). ``tool``: a reply
    function ``(text, row) -> str | None`` for :class:`~torchrl_grpo.llm.ToolReply`, whose
    replies then replace ``reply``. ``extra``: transforms appended after the helper's own (a
    :class:`~torchrl_grpo.llm.TurnReward`, ...). ``turns=None``: no ``StepCounter``.
    ``max_length``, ``on_overflow``: :class:`~torchrl_grpo.llm.ExactTurns`'.
    """
    from tensordict import TensorDict
    from torchrl.data import Unbounded
    from torchrl.envs import StepCounter, Transform
    from torchrl.envs.llm import DatasetChatEnv

    from torchrl_grpo.llm import ExactTurns
    from torchrl_grpo.llm.turns import REPLY_KEY

    class Reply(Transform):
        def _step(self, tensordict, next_tensordict):
            n = next_tensordict.shape[0]
            next_tensordict.set("reward", torch.zeros(n, 1, 1))
            count = tensordict.get("step_count", None)  # none: no StepCounter
            first = torch.ones(n, dtype=torch.bool) if count is None else count.reshape(n) == 0
            ends = torch.zeros(n, 1, dtype=torch.bool)
            ends[list(early)] = True
            ends &= first.unsqueeze(-1)
            next_tensordict.set("terminated", ends | next_tensordict.get("terminated"))
            next_tensordict.set("done", ends | next_tensordict.get("done"))
            next_tensordict = next_tensordict.to_lazystack(0)
            ids = torch.tensor(tokenizer(reply)["input_ids"])
            for row in next_tensordict.tensordicts:
                row.set(REPLY_KEY, ids)
            return next_tensordict

        def transform_reward_spec(self, reward_spec):
            reward_spec["reward"] = Unbounded(reward_spec.shape + (1, 1))
            return reward_spec

    class Queries(torch.utils.data.IterableDataset):
        def __iter__(self):
            while True:
                yield TensorDict(query=list(queries), batch_size=[len(queries)])

    tokenizer.chat_template = PLAIN_TEMPLATE
    loader = torch.utils.data.DataLoader(Queries(), batch_size=None, collate_fn=lambda td: td)
    env = DatasetChatEnv.from_dataloader(
        loader,
        batch_size=(len(queries),),
        tokenizer=tokenizer,
        input_mode="tokens",
        template_kwargs={"chat_template": PLAIN_TEMPLATE},
    )
    env.append_transform(Reply())
    for transform in extra:
        env.append_transform(transform)
    if tool is not None:
        from torchrl_grpo.llm import ToolReply

        env.append_transform(ToolReply(tool, tokenizer))
    if turns is not None:
        env.append_transform(StepCounter(max_steps=turns))
    if exact:
        env.append_transform(
            ExactTurns(
                tokenizer.pad_token_id,
                tokenizer.eos_token_id,
                max_length=max_length,
                on_overflow=on_overflow,
            )
        )
    return env


def answered(td, tokenizer, texts):
    """The env's step input ``td`` answered by hand: each row's response is the tokens of its
    text (``"13<eos>"``), after its prompt's real tokens (a lazy stack of rows)."""
    from tensordict import lazy_stack
    from torchrl.modules.llm.policies.common import Tokens

    rows = []
    for row, text in zip(td.unbind(0), texts, strict=True):
        prompt = row["tokens", "prompt"]
        prompt = prompt[prompt != tokenizer.pad_token_id]
        response = torch.tensor(tokenizer(text)["input_ids"])
        row.set(
            "tokens", Tokens(prompt=prompt, response=response, full=torch.cat([prompt, response]))
        )
        rows.append(row)
    return lazy_stack(rows)


def dialog_sampler(model, tokenizer, *, pad_output: bool = True, max_new_tokens: int = 3):
    """torchrl's sampler for :func:`dialog_env`: tokens in, ``max_new_tokens`` sampled tokens
    out (never the pad token), padded or not."""
    from torchrl.modules.llm import TransformersWrapper

    return TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate=True,
        pad_output=pad_output,
        generate_kwargs={
            "max_new_tokens": max_new_tokens,
            "do_sample": True,
            "bad_words_ids": [[tokenizer.pad_token_id]],
        },
    )


#: Two groups of two dialogs (one task each): the queries of :func:`dialog_env` in the fault
#: tests' collection loops.
GROUPED_QUERIES = ["3 9 1 4=", "3 9 1 4=", "1 2 0 5=", "1 2 0 5="]


def dialog_collector(env, model, tokenizer, *, max_pending_age=None, rb=None):
    """A multi-turn collection loop as the example's: torchrl's ``LLMCollector`` over ``env``
    (one turn of every dialog per batch; its first batch resets ``env``) writing into a
    ``ReplayBuffer`` whose :class:`~torchrl_grpo.MCAdvantage` joins a dialog's turns
    (``dialog_id``), groups dialogs by ``query`` (groups of 2) and gives each turn the dialog's
    last reward. ``rb``: such a buffer already built (a second collector on it).

    Returns:
        ``(collector, rb, advantage)``.
    """
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.envs import InitTracker

    from torchrl_grpo import MCAdvantage
    from torchrl_grpo.mcadvantage import Limits, TrajectoryIds

    if "is_init" not in env.observation_spec.keys():  # torchrl's collectors ask for it
        env.append_transform(InitTracker())
    if rb is None:
        advantage = MCAdvantage(
            grpo_size=2,
            prompt_key="query",
            traj_key=TrajectoryIds("dialog_id", step_count_key="step_count"),
            trajectory_return="last",
            limits=Limits(max_age=max_pending_age),
        )
        rb = ReplayBuffer(storage=LazyStackStorage(1000), transform=advantage)
    collector = LLMCollector(
        env,
        policy=dialog_sampler(model, tokenizer),
        dialog_turns_per_batch=env.batch_size[0],
        total_dialog_turns=-1,
        replay_buffer=rb,
    )
    return collector, rb, rb.transform[0]


def assert_exact_turns(batch, pad_id: int) -> None:
    """Each stored turn is its prompt then its answer, with no padding inside."""
    for full, prompt, response in zip(
        batch.get(("tokens", "full"), as_list=True),
        batch.get(("tokens", "prompt"), as_list=True),
        batch.get(("tokens", "response"), as_list=True),
        strict=True,
    ):
        assert full.tolist() == torch.cat([prompt, response]).tolist()
        assert not bool((full == pad_id).any())
