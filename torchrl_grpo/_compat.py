"""Every reliance of torchrl_grpo on a private name or an undocumented behaviour of torch, torchrl
or tensordict, one small function each.

Each function here has a test in ``test/test_compat.py`` whose failure message names it, so that
an upgrade that changes one of them fails in one known place. Everything else in the package uses
public APIs only.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import torch
from tensordict import TensorDictBase
from torch.distributions import Distribution
from torchrl.data import ReplayBuffer
from torchrl.envs.transforms import Compose, Transform
from torchrl.modules.llm import TransformersWrapper

# The public methods of a replay buffer that hand data to (or append) its transforms; inside them
# the buffer is fully built, so reading its ``transform`` and ``storage`` is safe.
_BUFFER_METHODS = frozenset(
    {"extend", "add", "__setitem__", "append_transform", "insert_transform"}
)


def calling_replay_buffer(transform: Transform, depth: int = 16) -> ReplayBuffer | None:
    """The torchrl ``ReplayBuffer`` that is calling into ``transform``, if any (see
    :func:`buffer_call`)."""
    return buffer_call(transform, depth)[0]


def buffer_call(transform: Transform, depth: int = 16) -> tuple[ReplayBuffer | None, str | None]:
    """The torchrl ``ReplayBuffer`` that is calling into ``transform``, and the name of the
    buffer's method it calls from (``"extend"``, ``"add"``...); ``(None, None)`` if none.

    torchrl gives a transform no handle on its buffer: ``Transform.container`` is the buffer's
    ``Compose``, and that ``Compose`` has no container. The buffer is found instead as ``self`` of
    the buffer method that called into the transform (``extend``, ``add``, ``append_transform``...)
    a few frames up the call stack, and only if ``transform`` is one of its transforms.

    Reliance (torchrl 0.14.1): a buffer calls its transforms, and ``Compose.append``, from inside
    its own methods.

    Args:
        transform: the transform looking for its buffer.
        depth: how many frames up to look.

    Returns:
        ``(buffer, method)``, or ``(None, None)`` when the call does not come from a buffer
        holding ``transform``.
    """
    frame = inspect.currentframe()
    try:
        for _ in range(depth):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None, None
            name = frame.f_code.co_name
            if name not in _BUFFER_METHODS:
                continue
            buffer = frame.f_locals.get("self")
            if isinstance(buffer, ReplayBuffer) and _holds(buffer.transform, transform):
                return buffer, name
        return None, None
    finally:
        del frame  # frames reference their locals: do not keep them alive


#: Where torchrl's collectors live (a frame of code there is a collector at work).
_COLLECTORS = os.sep + os.path.join("torchrl", "collectors") + os.sep


def inside_collector(depth: int = 64) -> bool:
    """Whether a torchrl collector is on the call stack (it is driving the env that asks).

    Reliance (torchrl 0.14.1): collectors are the code of ``torchrl/collectors/``, and they
    reset and step their env from their own methods.
    """
    frame = inspect.currentframe()
    try:
        for _ in range(depth):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return False
            if _COLLECTORS in frame.f_code.co_filename:
                return True
        return False
    finally:
        del frame


def _holds(container: Transform, transform: Transform) -> bool:
    if container is transform:
        return True
    return isinstance(container, Compose) and any(_holds(t, transform) for t in container)


EMPTY_TENSOR_STORAGE_METADATA = {"metadata": {}, "is_pytree": True, "len": 0}


def write_empty_tensor_storage(path: str | Path) -> None:
    """Write at ``path`` what torchrl's ``TensorStorageCheckpointer.loads`` reads as an empty
    storage.

    torchrl's tensor storages refuse to save before their first write. The record written here
    is the one its checkpointer writes for a storage of no leaves: ``storage_metadata.json`` saying
    a pytree of no leaves and length 0. Loading it loads nothing and sets the storage's length to
    0, into a fresh storage or over a filled one.

    Reliance (torchrl 0.14.1): the format of ``storage_metadata.json`` and how
    ``TensorStorageCheckpointer.loads`` reads a pytree record.

    Args:
        path: the storage's checkpoint folder (created if missing).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "storage_metadata.json").write_text(json.dumps(EMPTY_TENSOR_STORAGE_METADATA))


# --- torch: the dispatcher hook that counts operators (torchrl_grpo.launches) -------------------

#: torch's Python hook at the dispatcher (``torch.utils._python_dispatch``, a private module):
#: every ATen operator, the backward pass's included (torch carries the mode into the autograd
#: engine's threads), calls ``__torch_dispatch__`` of the active mode.
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode  # noqa: E402

# --- torchrl.modules.llm: the masked token distribution of an LLM wrapper -------------------------

#: torchrl's masking strategies and the ``LLMWrapperBase`` method that builds each distribution.
#: torchrl's own ``GRPOLoss`` calls the same methods; they are provisional in torchrl ("will be
#: replaced by the ``get_dist`` method once we have a better masking strategy").
LLM_MASKED_DIST_METHODS = {
    "sft": "_get_sft_dist",  # response tokens: the attention mask without the prompt
    "rlhf": "_get_rlhf_dist",  # assistant tokens (history input)
    "generic": "_get_generic_dist",  # every attended token
}


def llm_masked_dist(wrapper, tensordict: TensorDictBase, masking_strategy: str) -> Distribution:
    """The wrapper's token distribution over ``("tokens", "full")``, masked by the strategy.

    Returns torchrl's ``LLMMaskedCategorical``: ``.logits`` ``[B, T, V]`` and ``.mask``
    ``[B, T]``, left-padded, aligned with ``tensordict.get(("tokens", "full"),
    as_padded_tensor=True, padding_side="left")``. With ``"rlhf"`` the wrapper may rewrite
    ``("tokens", "full")`` in ``tensordict`` (history input is tokenized again).

    Raises:
        NotImplementedError: the wrapper has no method for the strategy.
    """
    name = LLM_MASKED_DIST_METHODS[masking_strategy]
    method = getattr(wrapper, name, None)
    if method is None:
        raise NotImplementedError(
            f"{type(wrapper).__name__} has no {name}(), which torchrl uses for "
            f"masking_strategy={masking_strategy!r}; this torchrl release is not supported "
            "(see torchrl_grpo._compat)."
        )
    return method(tensordict)


# --- torchrl.modules.llm: where TransformersWrapper runs the model to score tokens --------------

#: The methods of ``TransformersWrapper`` through which every ``generate=False`` input mode runs
#: the causal LM, with the parameters ``LeanTransformersWrapper`` overrides them with (it returns
#: shifted hidden states where they return shifted logits), and the helpers it calls.
TRANSFORMERS_WRAPPER_SCORING = {
    "_model_forward_with_padded_sequences": (
        "tokens_full_padded",
        "attention_mask_full_padded",
        "pad_val",
        "logits_only",
    ),
    "_model_forward_with_packed_sequences": (
        "flat_input_ids",
        "block_diag_attention_mask",
        "pad",
        "logits_only",
    ),
    "_pack_sequences": ("input_ids", "attention_mask"),
    # the tokens path, whose input it reads for the response lengths (``log_probs_at``)
    "_from_transformers_logprobs_tokens": ("td", "cfg", "out", "logits_only"),
    "repeat_interleave_causal": ("sequence_lengths",),
    # the builders of the masked distributions, which it overrides to return them over hidden
    # states (``_get_sft_dist`` and the others of LLM_MASKED_DIST_METHODS call them)
    "_get_dist_with_prompt_mask": ("tensordict",),
    "_get_dist_with_assistant_mask": ("tensordict",),
    "_get_dist_with_attention_mask": ("tensordict",),
    "_get_dist_with_custom_mask": ("tensordict", "mask"),
    "get_dist": ("tensordict", "mask_key"),
}


def check_transformers_wrapper_scoring(cls: type = TransformersWrapper) -> None:
    """Raise unless ``cls`` still scores tokens through the methods the lean wrapper overrides.

    Reliance (torchrl 0.14.1): ``TransformersWrapper``'s ``generate=False`` paths (tokens,
    text, history) call ``_model_forward_with_padded_sequences`` or
    ``_model_forward_with_packed_sequences`` and read ``(log_probs, logits)`` back; the
    packed one packs with ``_pack_sequences`` (the lean one also builds its causal mask with
    ``repeat_interleave_causal``); the masking strategies' distributions are built by the
    ``_get_dist_with_*`` methods. If torchrl renamed them, a subclass overriding
    them would silently build the logits again.

    Raises:
        RuntimeError: a method is missing or its parameters changed (named in the message).
    """
    for name, params in TRANSFORMERS_WRAPPER_SCORING.items():
        method = getattr(cls, name, None)
        found = () if method is None else tuple(inspect.signature(method).parameters)
        missing = [p for p in params if p not in found]
        if method is None or missing:
            raise RuntimeError(
                f"torchrl's {cls.__name__}.{name} is missing or lost the parameters {missing}: "
                "this torchrl release scores tokens differently, and LeanTransformersWrapper "
                "would build the logits (see torchrl_grpo._compat)."
            )


# --- torchrl.modules.llm: the generation log-probs of TransformersWrapper -------------------------

#: The parameters of ``TransformersWrapper._log_probs_generate`` (torchrl 0.14.1), which
#: :class:`ExactLogProbsTransformersWrapper` overrides with the same signature.
LOG_PROBS_GENERATE_PARAMS = ("tokens", "logits", "pad_val", "pad")


def check_log_probs_generate(cls: type = TransformersWrapper) -> None:
    """Raise unless ``cls._log_probs_generate`` still has the parameters the override keeps.

    Raises:
        RuntimeError: the method is missing or its parameters changed (named in the message).
    """
    why = "ExactLogProbsTransformersWrapper's override of it would not run"
    _check_parameters(cls, "_log_probs_generate", LOG_PROBS_GENERATE_PARAMS, why)


def _check_parameters(cls: type, name: str, expected: tuple[str, ...], why: str) -> None:
    """Raise ``RuntimeError`` unless ``cls.<name>`` exists with the parameters ``expected``."""
    method = getattr(cls, name, None)
    found = () if method is None else tuple(inspect.signature(method).parameters)
    if found != expected:
        raise RuntimeError(
            f"torchrl's {cls.__name__}.{name} is missing or its parameters are {found}, not "
            f"{expected}: {why} (see torchrl_grpo._compat)."
        )


#: The parameters of torchrl's ``Transform._post_step_mdp_hooks`` that
#: :class:`~torchrl_grpo.llm.ExactTurns` overrides to cut the stored turn to its tokens.
POST_STEP_MDP_HOOK_PARAMS = ("self", "tensordict", "tensordict_")


def check_post_step_mdp_hook(cls: type = Transform) -> None:
    """Raise unless ``cls._post_step_mdp_hooks`` is still torchrl's hook of
    ``step_and_maybe_reset``, with the parameters ``ExactTurns`` overrides.

    Reliance (torchrl 0.14.1): ``EnvBase.step_and_maybe_reset`` calls the transforms'
    ``_post_step_mdp_hooks(tensordict, tensordict_)`` with the turn a collector stores and the
    next step's input, and uses what it returns. Documented as a hook to override, but private.

    Raises:
        RuntimeError: the hook is missing or its parameters changed (named in the message).
    """
    why = "ExactTurns could not cut the turns a collector stores to their tokens"
    _check_parameters(cls, "_post_step_mdp_hooks", POST_STEP_MDP_HOOK_PARAMS, why)


# --- transformers: the attention a model runs, and flex attention's block mask ------------------


def attention_implementation(model) -> str | None:
    """The attention implementation a Hugging Face model runs (``"sdpa"``, ``"eager"``,
    ``"flex_attention"``, ``"flash_attention_2"``...), or ``None`` if it says none.

    Reliance (transformers 5.x): ``config._attn_implementation``, the attribute every model's
    attention reads to pick its function (transformers has no public getter).
    """
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def block_mask(mask: torch.Tensor):
    """A boolean ``[R, W, W]`` mask as flex attention's ``BlockMask`` (``True``: attend).

    Reliance (torch 2.5+): ``torch.nn.attention.flex_attention.create_block_mask`` with a
    ``mask_mod`` that indexes a tensor.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, kv):
        return mask[b, q, kv]

    rows, width, _ = mask.shape
    return create_block_mask(mask_mod, rows, None, width, width, device=mask.device)


# --- every private name, in one table ---------------------------------------------------------

#: Every private name of torchrl (and of torch, tensordict and transformers) the package relies
#: on, the functions above included: ``"module:Owner.name"`` -> ``(parameters, who relies on it
#: and how)``. ``parameters``: the leading parameters an overridden method must keep (``None``:
#: a name read or set, not overridden). :func:`check_private_names` checks them all, and
#: ``test/test_compat.py`` one test each, so that a release that renames one fails in one known
#: place; a test also checks that every private method of torchrl the package's classes
#: override is listed here.
PRIVATE_NAMES: dict[str, tuple[tuple[str, ...] | None, str]] = {
    # torchrl.envs: the hooks of a transform (documented for subclassing, private by name)
    "torchrl.envs.transforms:Transform._inv_call": (
        ("self", "tensordict"),
        "MCAdvantage, ExactTurns, OverlongPenalty and TeacherLogProbs write into a replay buffer",
    ),
    "torchrl.envs.transforms:Transform._reset": (
        ("self", "tensordict", "tensordict_reset"),
        "SameStartGroups, ExactTurns and ToolReply act on a reset",
    ),
    "torchrl.envs.transforms:Transform._step": (
        ("self", "tensordict", "next_tensordict"),
        "SameStartGroups, ExactTurns, ToolReply, TurnReward and OverlongPenalty act on a step",
    ),
    "torchrl.envs.transforms:Transform._reset_on_native_autoreset": (
        ("self", "tensordict", "tensordict_reset"),
        "SameStartGroups refuses an env that resets itself inside step (it could not seed it)",
    ),
    "torchrl.envs.transforms:Transform._post_step_mdp_hooks": (
        POST_STEP_MDP_HOOK_PARAMS,
        "ExactTurns cuts the turns a collector stores to their tokens (check_post_step_mdp_hook)",
    ),
    "torchrl.envs.llm:ChatEnv._reset_tokens": (
        ("self", "tensordict", "history"),
        "ragged_prompts (torchrl_grpo.llm.ragged_chat) overrides it to read prompts as a list",
    ),
    # torchrl.modules.llm: the wrappers
    "torchrl.modules.llm.policies.common:Tokens._from_tensordict": (
        None,
        "llm/scoring.py and ragged_prompts build torchrl's Tokens on a TensorDict",
    ),
    "torchrl.modules.llm:TransformersWrapper._log_probs_generate": (
        None,
        "ExactLogProbsTransformersWrapper overrides it (check_log_probs_generate)",
    ),
    "torchrl.modules.llm:TransformersWrapper._in_get_dist_call": (
        None,
        "LeanTransformersWrapper returns the logits only inside get_dist, as torchrl's does",
    ),
    "torchrl.modules.llm:TransformersWrapper._device": (
        None,
        "LeanTransformersWrapper's own tokens path runs only when torchrl's moves no device",
    ),
    **{
        f"torchrl.modules.llm:TransformersWrapper.{name}": (
            None,
            "LeanTransformersWrapper overrides or calls it (check_transformers_wrapper_scoring)",
        )
        for name in TRANSFORMERS_WRAPPER_SCORING
        if name.startswith("_")
    },
    **{
        f"torchrl.modules.llm:LLMWrapperBase.{name}": (
            None,
            f"GRPOLoss's masking_strategy={strategy!r} builds its distribution (llm_masked_dist)",
        )
        for strategy, name in LLM_MASKED_DIST_METHODS.items()
    },
    # torchrl.objectives: GRPOLoss subclasses ClipPPOLoss
    "torchrl.objectives:PPOLoss._AcceptedKeys": (
        None,
        "GRPOLoss's keys extend ClipPPOLoss's (torchrl's convention for a loss's keys)",
    ),
    "torchrl.objectives:PPOLoss._set_in_keys": (("self",), "GRPOLoss's in_keys"),
    "torchrl.objectives:PPOLoss._in_keys": (None, "GRPOLoss's in_keys, reset when keys change"),
    "torchrl.objectives:LossModule._forward_value_estimator_keys": (
        ("self",),
        "TopKDistillationLoss refreshes its in_keys when set_keys changes a key",
    ),
    "torchrl.objectives:ClipPPOLoss._schedulable_buffers": (
        None,
        "GRPOLoss's coefficients are schedulable buffers, as ClipPPOLoss's clip_epsilon",
    ),
    # torchrl.data: the replay buffer's sampler
    "torchrl.data.replay_buffers:Sampler._rng": (
        None,
        "GroupSampler shuffles with the buffer's generator (ReplayBuffer.set_rng sets it)",
    ),
    "torchrl.data.replay_buffers:Sampler._empty": (("self",), "GroupSampler empties with it"),
    # torch and transformers
    "torch.nn:Module._buffers": (None, "GRPOLoss updates a scheduled value's buffer in place"),
    "torch.utils._python_dispatch:TorchDispatchMode": (
        None,
        "count_launches counts the operators dispatched (TorchDispatchMode above)",
    ),
    "transformers:PretrainedConfig._attn_implementation": (
        None,
        "shared-prefix scoring reads the attention a model runs (attention_implementation)",
    ),
}


def check_private_name(ref: str) -> None:
    """Raise unless the private name ``ref`` of :data:`PRIVATE_NAMES` is still there, with the
    leading parameters listed (an attribute set on instances is looked for in its owner's code).

    Raises:
        RuntimeError: the name is missing or its parameters changed (named in the message).
    """
    import importlib

    params, why = PRIVATE_NAMES[ref]
    module_name, _, path = ref.partition(":")
    owner_path, _, name = path.rpartition(".")
    owner = importlib.import_module(module_name)
    for part in filter(None, owner_path.split(".")):
        owner = getattr(owner, part)
    found = hasattr(owner, name) or any(  # an attribute its owner sets on each instance
        text in inspect.getsource(owner) for text in (f"self.{name} =", f'"{name}", ')
    )
    problem = None if found else "is missing"
    if found and params is not None:
        signature = tuple(inspect.signature(getattr(owner, name)).parameters)
        if signature[: len(params)] != params:
            problem = f"takes {signature}, not {params}..."
    if problem is not None:
        raise RuntimeError(f"{ref} {problem}: {why} (see torchrl_grpo._compat).")


def check_private_names() -> None:
    """:func:`check_private_name` for every name of :data:`PRIVATE_NAMES`.

    Examples:
        >>> from torchrl_grpo._compat import check_private_names
        >>> check_private_names()  # this torchrl release has every name the package uses
    """
    for ref in PRIVATE_NAMES:
        check_private_name(ref)
