"""Reading a batch into aligned ``(B, T)`` tensors with one mask of real tokens.

Two kinds of policy are read. A torchrl probabilistic actor gives its distribution's log-prob
of the stored action, as ClipPPOLoss reads it (:func:`read_actor`). A torchrl LLM wrapper scores
``("tokens", "full")`` under a masking strategy, and the ragged entries of the batch are read
left-padded, as :class:`torchrl.objectives.llm.GRPOLoss` reads them (:func:`read_llm`). Both
end in :func:`_line_up`: every entry checked against the policy's log-prob shape, flattened to
``(B, T)`` sequences and zeroed on padding, so that the math of :mod:`torchrl_grpo.loss_terms`
never sees a padded value.

What a call reads is decided by the loss's settings at call time; the loss passes them as a
:class:`ReadPlan`, and nothing here reaches into the loss module. The entries a variant reads
beyond the built-in ones (``ReadPlan.entries``: any batch key a variant declares in its
``reads``) are read, lined up and zeroed on padding the same way, into ``Inputs.entries``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase, unravel_key
from tensordict.nn import CompositeDistribution, set_composite_lp_aggregate
from tensordict.utils import NestedKey
from torchrl.objectives import AUTO_LOSS_MASK_KEYS

from torchrl_grpo import _compat, ragged
from torchrl_grpo.loss.positions import (
    inner_pads,
    kept_index,
    kept_mask,
    raise_inner_pads,
    relayout,
    response_positions,
    rows_on_tokens,
)
from torchrl_grpo.token_dist import token_log_prob_entropy

#: torchrl's keys for LLM-wrapper batches (those of ``torchrl.objectives.llm.GRPOLoss``).
LLM_KEYS = {
    "action": ("tokens", "full"),
    "sample_log_prob": ("log_probs", "full"),
    "ref_log_prob": ("next", "ref_log_probs", "full"),
}
#: The masking strategies of torchrl's LLM losses (``masking_strategy=...``).
MASKING_STRATEGIES = tuple(_compat.LLM_MASKED_DIST_METHODS)
#: What each masking strategy reads, for error messages.
MASK_SOURCES = {
    "sft": "('tokens', 'prompt') (or ('masks', 'all_assistant_mask')) and the attention mask",
    "rlhf": "('masks', 'all_assistant_mask') (history input builds it)",
    "generic": "('masks', 'all_attention_mask') or the wrapper's attention mask",
}


class Inputs(NamedTuple):
    """One batch read and lined up: every tensor ``(B, T)``, zeros where ``mask`` is False."""

    log_prob: torch.Tensor  # current policy, differentiable
    old_log_prob: torch.Tensor  # sample_log_prob: the ratio's anchor, or the behaviour policy
    advantage: torch.Tensor
    mask: torch.Tensor  # bool, True on real tokens
    entropy: torch.Tensor | None  # differentiable; with entropy_bonus or TopEntropy
    ref_log_prob: torch.Tensor | None  # with KLToReference
    inference_log_prob: torch.Tensor | None  # inference correction, KL to inference, OPSM
    proximal_log_prob: torch.Tensor | None  # with decoupled: the ratio's anchor
    truncated: torch.Tensor | None  # bool, True on the tokens of truncated completions
    shape: torch.Size  # the policy log-prob's own shape (reduction="none" returns it)
    head_entropy: TensorDictBase | None = None  # a multi-head policy's, per head, as computed
    # the entries the variants read beyond the above, by the name in their ``reads``
    entries: Mapping[NestedKey, torch.Tensor] = MappingProxyType({})


class Stored(NamedTuple):
    """The entries of the batch that are data, as stored (read before the policy runs)."""

    advantage: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor | None
    inference: torch.Tensor | None
    proximal: torch.Tensor | None
    entries: tuple[tuple[NestedKey, torch.Tensor], ...] = ()  # (name, as stored)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Stored:
        """Every stored tensor through ``fn`` (a device move, a relayout)."""
        tensors = (None if value is None else fn(value) for value in self[:-1])
        return Stored(*tensors, tuple((name, fn(value)) for name, value in self.entries))


class ReadPlan(NamedTuple):
    """What one call reads from its batch and how: the loss's keys and settings at call time."""

    owner: str  # the loss's class name, for error messages
    keys: Any  # the loss's tensor_keys
    loss_mask_key: Any  # torchrl's loss_mask_key: None, "auto" or a key; and-ed with keys.mask
    padded: bool  # an LLM wrapper's batch: ragged entries are read left-padded
    masking_strategy: str  # an LLM wrapper's: which of its tokens are real
    ref_padding: tuple[str, float]  # side and value of the ragged reference log-probs
    ref: bool  # read ref_log_prob (KLToReference)
    inference: str | None  # why inference_log_prob is read ("for TIS"...); None: not read
    inference_fallback: bool  # sample_log_prob stands in when inference_log_prob is absent
    proximal: bool  # read proximal_log_prob (Decoupled)
    truncated: bool  # read or infer the truncated flags (TruncatedCompletions)
    end_tokens: tuple[int, ...]  # EOS and pad ids: TRL's rule when no flag is stored
    pad_token_id: int | None  # an LLM wrapper's: the pad id of the stored token sequences
    pad_output: bool  # an LLM wrapper's: it keeps every stored position (False: drops the pads)
    entropy: bool  # compute the entropy (entropy_bonus or TopEntropy)
    samples_mc_entropy: int
    # the other entries the variants read: (name, key, why), read per token or per sequence
    entries: tuple[tuple[NestedKey, NestedKey, str], ...] = ()


def read_stored(tensordict: TensorDictBase, plan: ReadPlan) -> Stored:
    """The data entries of the batch, as stored, read before the policy runs."""
    keys = plan.keys
    advantage = _get_input(tensordict, keys.advantage, "the advantage", plan)
    if isinstance(keys.sample_log_prob, list):  # a multi-head policy's: one entry per head
        why = "a head's sampling log-probs"
        heads = [_get_input(tensordict, key, why, plan) for key in keys.sample_log_prob]
        old = _sum_heads(heads, tensordict.batch_dims)
    else:
        why = "the sampling log-probs"
        old = _get_input(tensordict, keys.sample_log_prob, why, plan, per_token=True)
        if plan.padded:
            _warn_two_candidates(tensordict, keys.sample_log_prob, plan.owner)
    ref = inference = proximal = None
    if plan.ref:
        why = "for kl_to_ref_coeff"
        ref = _get_input(tensordict, keys.ref_log_prob, why, plan, per_token=True)
    if plan.inference is not None:
        key = keys.inference_log_prob
        # torchrl's convention: without the sampler's own log-probs, the KL to inference (and
        # OPSM's drift, as TRL) is taken against sample_log_prob
        if plan.inference_fallback and not _has(tensordict, key):
            key = keys.sample_log_prob
        inference = _get_input(tensordict, key, plan.inference, plan, per_token=True)
    if plan.proximal:
        why = "for Decoupled"
        proximal = _get_input(tensordict, keys.proximal_log_prob, why, plan, per_token=True)
    entries = tuple(
        (name, _get_input(tensordict, key, why, plan, per_token=True))
        for name, key, why in plan.entries
    )
    return Stored(advantage, old, ref, inference, proximal, entries)


#: Where torchrl's LLM stack writes a batch's sampling log-probs: the sampler's own (torchrl's
#: default key, whose first generated token torchrl 0.14.1 zeroes) and ``RetrieveLogProb``'s.
_CANDIDATES = (("log_probs", "full"), ("next", "log_probs", "full"))


def _warn_two_candidates(tensordict: TensorDictBase, key, owner: str) -> None:
    """Warn if the batch holds both of torchrl's sampling log-probs, they differ, and the loss
    reads the default one: ``set_keys`` was probably forgotten."""
    key = unravel_key(key)
    if key != _CANDIDATES[0]:  # set on purpose
        return
    other = _CANDIDATES[1]
    found = tensordict.get(other, None, as_list=True)
    if found is None:
        return
    read = tensordict.get(key, None, as_list=True)
    if all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(read, found, strict=True)):
        return
    warnings.warn(
        f"{owner}: the batch holds two different sampling log-probs, {key} (read: the sampler's "
        f"own, whose first generated token torchrl 0.14.1 zeroes) and {other} (RetrieveLogProb's "
        f"under 'next'). To read the latter, loss.set_keys(sample_log_prob={other}); to read the "
        f"former without this warning, drop {other} from the batch.",
        stacklevel=4,
    )


def llm_masked_dist(actor: Any, tensordict: TensorDictBase, masking_strategy: str):
    """An LLM wrapper's masked token distribution over ``("tokens", "full")``; a failure is
    told with what the masking strategy reads."""
    try:
        return _compat.llm_masked_dist(actor, tensordict, masking_strategy)
    except (KeyError, ValueError, AttributeError) as err:
        raise ValueError(
            f"masking_strategy={masking_strategy!r} needs {MASK_SOURCES[masking_strategy]} in "
            f"the batch; the wrapper failed with: {err}"
        ) from err


def read_actor(
    tensordict: TensorDictBase, dist: torch.distributions.Distribution, stored: Stored, plan
) -> Inputs:
    """A torchrl probabilistic actor: its distribution's log-prob of the stored action; for a
    multi-head policy, the sum over its heads (:func:`read_heads`)."""
    heads = None
    if isinstance(dist, CompositeDistribution):
        log_prob, entropy, heads = read_heads(tensordict, dist, plan)
    else:
        if isinstance(plan.keys.action, list):
            raise ValueError(
                f"The action keys {plan.keys.action} are a multi-head policy's, but this policy's "
                f"distribution is a {type(dist).__name__}, not a CompositeDistribution."
            )
        action = _get_input(tensordict, plan.keys.action, "the sampled action", plan)
        log_prob = dist.log_prob(action)
        entropy = _entropy(dist, plan.samples_mc_entropy) if plan.entropy else None
    if not log_prob.shape:
        raise ValueError("The policy's log-prob is a scalar; expected a batch [N] or [B, T].")
    mask = _token_mask(tensordict, log_prob.shape, log_prob.device, plan)
    truncated = _truncated(tensordict, log_prob.shape, plan)
    inputs = _line_up(log_prob, mask, entropy, stored, truncated, plan.keys)
    return inputs if heads is None else inputs._replace(head_entropy=heads)


def read_heads(tensordict: TensorDictBase, dist: CompositeDistribution, plan: ReadPlan):
    """A multi-head policy: ``(log_prob, entropy, entropy per head)``, one per element of the batch.

    As ClipPPOLoss: each head's log-prob and entropy are summed over the head's own dimensions
    beyond the batch's, then over the heads (tensordict's ``composite_lp_aggregate`` sum,
    whichever mode is set). The actions are read where the distribution's heads write them.
    The per-head entropies are reported as ClipPPOLoss's ``composite_entropy``.
    """
    names = list(dist.dists)
    for name in names:
        _get_input(tensordict, name, "a head's sampled action", plan)
    with set_composite_lp_aggregate(True):
        log_prob = dist.log_prob(tensordict.select(*names))
    if not plan.entropy:
        return log_prob, None, None
    ndim = len(dist.batch_shape)
    heads = {
        _entropy_key(name): _entropy(head, plan.samples_mc_entropy)
        for name, head in dist.dists.items()
    }
    entropy = sum(_sum_heads(value, ndim) for value in heads.values())
    return log_prob, entropy, TensorDict(heads, batch_size=dist.batch_shape)


def _entropy_key(name: NestedKey) -> NestedKey:
    # torchrl's name for a head's entropy: ("action", "cat") -> ("action", "cat_entropy")
    return name + "_entropy" if isinstance(name, str) else (*name[:-1], name[-1] + "_entropy")


def _sum_heads(values: torch.Tensor | list[torch.Tensor], ndim: int) -> torch.Tensor:
    """The heads' values (one tensor or a list), each summed over its dims beyond ``ndim``."""
    values = values if isinstance(values, (list, tuple)) else [values]
    return sum(v.flatten(ndim, -1).sum(-1) if v.ndim > ndim else v for v in values)


def read_llm(tensordict: TensorDictBase, dist, stored: Stored, plan: ReadPlan) -> Inputs:
    """A torchrl LLM wrapper: its masked token distribution over ``("tokens", "full")``.

    As :class:`torchrl.objectives.llm.GRPOLoss`: the wrapper builds the left-padded logits
    and the mask of the masking strategy; tokens whose stored log-prob is not finite
    (torchrl's NaN placeholders) are not real. Log-probs and entropy come from the logits
    through :func:`~torchrl_grpo.token_log_prob_entropy`, which keeps no ``[B, T, V]``
    temporary for the backward pass.
    """
    keys = plan.keys
    mask = dist.mask.bool()  # (B, T)
    # the wrapper may compute elsewhere than the batch lives (TransformersWrapper(device=)):
    # the loss follows the policy's mask
    device = mask.device
    stored = stored.map(lambda value: value.to(device))
    tokens = _get_input(tensordict, keys.action, "the sampled tokens", plan, padding=-100)
    tokens = tokens.to(device)
    stored_shape = tokens.shape  # (B, T): each stored row left-padded
    answer = response_positions(tensordict, stored_shape, plan)
    index = _checked_positions(tensordict, tokens, plan)  # the wrapper's, if it drops pads
    tokens = relayout(tokens, index, -100)
    stored = stored.map(lambda value: relayout(value, index))
    if tokens.shape != mask.shape:
        raise ValueError(
            f"{keys.action!r} has shape {tuple(tokens.shape)} once padded, but the policy's "
            f"logits under masking_strategy={plan.masking_strategy!r} cover "
            f"{tuple(mask.shape)}: the tokens and the wrapper's input disagree."
        )
    old_log_prob = _match_shape(stored.old, mask.shape, keys.sample_log_prob)
    mask = mask & torch.isfinite(old_log_prob)
    if answer is not None:  # each row's own answer (torchrl's "sft" mask errs on ragged rows)
        mask = mask & relayout(answer.to(device), index, False)
    mask = mask & relayout(_token_mask(tensordict, stored_shape, device, plan), index, False)
    truncated = _truncated(tensordict, stored_shape, plan, last_tokens=tokens[:, -1])
    truncated = None if truncated is None else relayout(truncated.to(device), index, False)
    log_prob, entropy = _token_log_prob_entropy(dist, tokens.masked_fill(~mask, -100))
    entropy = entropy if plan.entropy else None
    return _line_up(log_prob, mask, entropy, stored._replace(old=old_log_prob), truncated, keys)


def _checked_positions(tensordict: TensorDictBase, tokens: torch.Tensor, plan: ReadPlan):
    """No pad between a row's real tokens (:func:`~torchrl_grpo.loss.positions.
    check_no_inner_pads`), and the stored columns a wrapper with ``pad_output=False`` reads
    (:func:`~torchrl_grpo.loss.positions.kept_positions`): both decided by one host read."""
    inner = inner_pads(tokens, plan)
    keep = kept_mask(tensordict, tokens, plan)
    flags = [torch.zeros((), dtype=torch.bool, device=tokens.device)] * 2
    if inner is not None:
        flags[0] = inner.any()
    if keep is not None:
        flags[1] = (keep != (tokens != -100)).any()
    has_inner, drops = torch.stack(flags).tolist()
    if has_inner:
        raise_inner_pads(inner, plan)
    return kept_index(keep) if drops else None


#: torchrl's messages for a missing log-prob, kept as the start of this package's (torchrl's
#: tests and users' handlers match on them), by the name of the key in the loss's keys.
_TORCHRL_MISSING = {
    "sample_log_prob": "Couldn't find the log-prob {key} in the input data. ",
    "ref_log_prob": "Couldn't find the ref log-prob {key} in the input data. ",
}


def _key_name(key: NestedKey, plan: ReadPlan) -> str | None:
    """The name, in the loss's keys, of the log-prob ``key`` (None for another entry)."""
    for name in _TORCHRL_MISSING:
        theirs = getattr(plan.keys, name)  # a multi-head policy's sampling keys: a list
        if not isinstance(theirs, list) and unravel_key(key) == unravel_key(theirs):
            return name
    return None


def _get_input(
    tensordict: TensorDictBase,
    key: NestedKey,
    why: str,
    plan: ReadPlan,
    padding: float = 0.0,
    per_token: bool = False,
) -> torch.Tensor:
    """An entry that must be data: present, without gradient; padded left if ragged. A
    ``per_token`` entry of an LLM wrapper's ragged batch is first lined up with each row's
    tokens (:func:`~torchrl_grpo.loss.positions.rows_on_tokens`)."""
    if plan.padded:
        side = "left"
        if key == plan.keys.ref_log_prob:
            side, padding = plan.ref_padding
        rows = tensordict.get(key, None, as_list=True)
        if isinstance(rows, list) and per_token:  # ragged rows: each on its row's tokens
            rows = rows_on_tokens(tensordict, key, rows, plan)
        if isinstance(rows, list) and len({tuple(r.shape[1:]) for r in rows}) == 1:
            value = ragged.padded(rows, padding, side)  # rows of a lazy stack, at a fixed cost
        else:
            value = tensordict.get(
                key, None, as_padded_tensor=True, padding_side=side, padding_value=padding
            )
    else:
        value = tensordict.get(key, None)
    if value is None:
        raise KeyError(
            _TORCHRL_MISSING.get(_key_name(key, plan), "").format(key=key)
            + f"{plan.owner} needs {key!r} ({why}) in the input batch; "
            # no double quote: KeyError's text stays as written (repr'd in single quotes, torchrl's
            # "Couldn't" would read "Couldn\'t" to a pytest.raises(match=...))
            f"found keys {', '.join(sorted(map(str, tensordict.keys(True, True))))}."
        )
    if value.requires_grad:
        raise RuntimeError(
            f"The stored {key!r} requires grad: it must be data, not part of "
            "the graph. Store it detached."
        )
    return value


def tokenizer_end_tokens(tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a finished completion: the tokenizer's EOS and pad tokens."""
    ends = (getattr(tokenizer, name, None) for name in ("eos_token_id", "pad_token_id"))
    return tuple(end for end in ends if end is not None)


def _truncated(
    tensordict: TensorDictBase, shape: torch.Size, plan: ReadPlan, last_tokens=None
) -> torch.Tensor | None:
    """Per-token flags of truncated completions, with ``TruncatedCompletions``.

    The ``truncated`` entry when present; for an LLM wrapper without it, TRL's rule on the
    last token of each (left-padded) sequence: neither EOS nor the pad token.
    """
    if not plan.truncated:
        return None
    key = plan.keys.truncated
    if _has(tensordict, key) or last_tokens is None:
        why = "for TruncatedCompletions"
        entry = _get_input(tensordict, key, why, plan, padding=False)
        return _per_token(entry, shape, key).bool()
    if not plan.end_tokens:
        raise KeyError(
            f"TruncatedCompletions needs {key!r} in the batch: the wrapper has no "
            "tokenizer with an EOS or pad token to tell truncated completions apart."
        )
    finished = torch.isin(last_tokens, torch.tensor(plan.end_tokens, device=last_tokens.device))
    return (~finished).unsqueeze(-1).expand(shape)


def _token_mask(
    tensordict: TensorDictBase, shape: torch.Size, device, plan: ReadPlan
) -> torch.Tensor:
    """``mask`` and-ed with torchrl's loss-mask entries (``loss_mask_key``); all True if none."""
    loss_mask = plan.loss_mask_key
    if loss_mask is None:
        extra = ()
    else:
        extra = AUTO_LOSS_MASK_KEYS if loss_mask == "auto" else (loss_mask,)
    mask = torch.ones(shape, dtype=torch.bool, device=device)
    for key in dict.fromkeys((plan.keys.mask, *extra)):
        if _has(tensordict, key):
            entry = _get_input(tensordict, key, "a mask", plan, padding=False, per_token=True)
            mask = mask & _per_token(entry, shape, key).bool().to(device)
    return mask


def _entropy(dist: torch.distributions.Distribution, samples_mc_entropy: int) -> torch.Tensor:
    """Analytic entropy; a Monte-Carlo estimate where there is none (or it is not finite)."""
    try:
        entropy = dist.entropy()
        if bool(torch.isfinite(entropy).all()):
            return entropy
    except NotImplementedError:
        pass
    sample_shape = (samples_mc_entropy,)
    sample = dist.rsample(sample_shape) if dist.has_rsample else dist.sample(sample_shape)
    return -dist.log_prob(sample).mean(0)


def _line_up(log_prob, mask, entropy, stored: Stored, truncated, keys) -> Inputs:
    """Every entry as ``(B, T)``, checked against the log-prob's shape, zeros on padding."""
    shape = log_prob.shape
    mask = _as_sequences(mask)  # (B, T)

    def tokens(x, key):  # (B, T), zeros on padding so nan/inf pads cannot leak
        if x is None:
            return None
        return torch.where(mask, _as_sequences(_match_shape(x, shape, key)), 0.0)

    advantage = _as_sequences(_per_token(stored.advantage, shape, keys.advantage))
    inputs = Inputs(
        log_prob=tokens(log_prob, "log_prob"),
        old_log_prob=tokens(stored.old, keys.sample_log_prob),
        advantage=torch.where(mask, advantage, 0.0),
        mask=mask,
        entropy=tokens(entropy, "entropy"),
        ref_log_prob=tokens(stored.ref, keys.ref_log_prob),
        inference_log_prob=tokens(stored.inference, keys.inference_log_prob),
        proximal_log_prob=tokens(stored.proximal, keys.proximal_log_prob),
        truncated=None if truncated is None else _as_sequences(truncated),
        shape=shape,
        entries=MappingProxyType(
            {
                name: _as_sequences(_per_token(value, shape, name)).masked_fill(~mask, 0)
                for name, value in stored.entries
            }
        ),
    )
    _check_finite(inputs, keys)
    return inputs


#: The stored entries of :class:`Inputs`: ``(field, key name, what it is, verb)``.
_STORED = (
    ("advantage", "advantage", "The advantage", "is"),
    ("old_log_prob", "sample_log_prob", "The sampling log-probs", "are"),
    ("ref_log_prob", "ref_log_prob", "The reference log-probs", "are"),
    ("inference_log_prob", "inference_log_prob", "The inference log-probs", "are"),
    ("proximal_log_prob", "proximal_log_prob", "The proximal log-probs", "are"),
)


def _check_finite(x: Inputs, keys) -> None:
    """The batch has a real token, and every stored entry is finite on every real token (they
    are zero on padding already).

    One reduction, over their sum, runs every call, read on the host with the mask's ``any``
    (one host wait for both); the entry at fault is looked for only when it fails (a sum that
    overflows with every entry finite raises nothing).

    Raises:
        ValueError: the mask is all False, or naming the entry's key and how many real tokens
            it is not finite on.
    """
    stored = [(getattr(x, field), *rest) for field, *rest in _STORED]
    stored = [entry for entry in stored if entry[0] is not None]
    total = stored[0][0]
    for value, *_ in stored[1:]:
        total = total + value
    real, finite = torch.stack([x.mask.any(), torch.isfinite(total).all()]).tolist()
    if not real:
        raise ValueError(
            f"The batch has no real token: the mask {keys.mask!r} is all False "
            f"(shape {tuple(x.shape)}). There is nothing to average."
        )
    if finite:
        return
    for value, name, what, verb in stored:
        bad = int((~torch.isfinite(value)).sum())
        if bad:
            raise ValueError(
                f"{what} under {getattr(keys, name)!r} {verb} not finite on {bad} of "
                f"{int(x.mask.sum())} real tokens: every token in the loss needs a finite value "
                "(padding, where the mask is False, may hold anything)."
            )


def _token_log_prob_entropy(dist, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``(B, T)`` of an LLM wrapper's masked distribution, in one pass.

    A distribution that computes both itself (``log_prob_entropy(tokens) -> (log_prob,
    entropy)``: :class:`~torchrl_grpo.LeanTransformersWrapper`'s, which holds no logits) is
    asked to; any other is read from its logits through
    :func:`~torchrl_grpo.token_log_prob_entropy`. Tokens below zero are padding.
    """
    log_prob_entropy = getattr(dist, "log_prob_entropy", None)
    if log_prob_entropy is not None:
        return log_prob_entropy(tokens)
    return token_log_prob_entropy(dist.logits, tokens)


def _has(tensordict: TensorDictBase, key: NestedKey) -> bool:
    # a membership test that never stacks a ragged entry (``get`` would)
    return unravel_key(key) in tensordict.keys(include_nested=True)


def _as_sequences(x: torch.Tensor) -> torch.Tensor:
    # [N] -> [N, 1] (one-token sequences); [..., T] -> [prod(...), T]
    return x.reshape(-1, 1) if x.ndim == 1 else x.reshape(-1, x.shape[-1])


def _match_shape(x: torch.Tensor, shape: torch.Size, key) -> torch.Tensor:
    # an entry must have the log-prob's shape, optionally with a trailing singleton dimension
    if x.shape == shape:
        return x
    if x.shape == shape + (1,):
        return x.squeeze(-1)
    raise ValueError(
        f"{key!r} has shape {tuple(x.shape)}, but the policy's log-prob has shape "
        f"{tuple(shape)}: expected {tuple(shape)} or {tuple(shape + (1,))}."
    )


def _per_token(adv: torch.Tensor, shape: torch.Size, key) -> torch.Tensor:
    # per token ([B, T] or [B, T, 1]) or, for token batches, per sequence: [B] followed by
    # singleton dimensions ([B], [B, 1], torchrl's LLM layout [B, 1, 1])
    if adv.shape in (shape, shape + (1,)):
        return _match_shape(adv, shape, key)
    per_sequence = shape[:-1]
    if len(shape) >= 2 and adv.shape[: len(per_sequence)] == per_sequence:
        if adv.numel() == per_sequence.numel():
            return adv.reshape(per_sequence + (1,)).expand(shape)
    expected = [shape, shape + (1,)]
    if len(shape) >= 2:
        expected += [per_sequence, per_sequence + (1,), per_sequence + (1, 1)]
    raise ValueError(
        f"{key!r} has shape {tuple(adv.shape)}, but the policy's log-prob has shape "
        f"{tuple(shape)}: expected one of {[tuple(s) for s in expected]}."
    )
