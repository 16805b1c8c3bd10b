"""One insertion, read and checked: its steps, where each trajectory starts and ends, its rewards
and its group id.

:func:`read_insertion` is the only place that looks at what the user passed to ``extend``/``add``;
every later step works on the :class:`~torchrl_grpo.mcadvantage.records.Insertion` it returns.
It reads every input shape the same way (``[N]`` steps, ``[B, T]`` rows, one step without a
batch dimension, lazy stacks of ragged steps), decides once whether the steps are dense or
ragged (:mod:`~torchrl_grpo.mcadvantage.steps`) and whether the group ids are prompts or tensors
(:mod:`~torchrl_grpo.mcadvantage.ids`), and raises before anything else runs, so that a bad
input changes no state.

Devices: the steps stay where they are (a CUDA insertion is stored, gathered and released on
CUDA); what the transform computes from them (done flags, group ids, rewards, and from them every
index, count and advantage) is read onto the CPU here, once. The bookkeeping is many tiny
operations that would each cost a kernel launch on an accelerator, and it meets the data again
only as CPU index tensors (which index CUDA data as they are) and as the advantage, written on the
reward's device.
"""

from __future__ import annotations

import functools
import math

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase, is_leaf_nontensor, lazy_stack
from torch import Tensor

from torchrl_grpo.mcadvantage.ids import GroupIds, PromptIds, TensorIds
from torchrl_grpo.mcadvantage.options import Keys
from torchrl_grpo.mcadvantage.records import Insertion, Pending
from torchrl_grpo.mcadvantage.steps import DenseSteps, Elements, RaggedSteps, Steps, get_entry

__all__ = ["PADDING_MASK", "drop_padding", "read_insertion", "read_versions", "trajectory_bounds"]

#: The entry torchrl's collectors write with ``split_trajs=True``: ``True`` on real steps,
#: ``False`` on the zero padding of each ``[trajectories, max length]`` row.
PADDING_MASK = ("collector", "mask")


def drop_padding(tensordict: TensorDictBase) -> TensorDictBase:
    """The input without the steps a collector padded (``split_trajs=True``): the real steps of
    each row, row after row (one trajectory's steps stay contiguous, in time order). An input
    without :data:`PADDING_MASK` is returned as it is.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> rows = TensorDict(x=torch.arange(6).reshape(2, 3), collector=TensorDict(
        ...     mask=torch.tensor([[True, True, False], [True, False, False]]), batch_size=[2, 3]),
        ...     batch_size=[2, 3])
        >>> drop_padding(rows)["x"]
        tensor([0, 1, 3])
    """
    if tensordict.batch_dims != 2 or "collector" not in tensordict.keys():
        return tensordict  # split_trajs batches are [trajectories, max length]
    mask = tensordict.get(PADDING_MASK, None)
    if mask is None or mask.shape != tensordict.batch_size:
        return tensordict
    return tensordict[mask]


def read_insertion(
    tensordict: TensorDictBase, keys: Keys, pending: Pending, required_version: bool = False
) -> Insertion | None:
    """Read one insertion; ``None`` if it holds no step.

    Args:
        tensordict: what was passed to ``extend``: ``[N]`` steps, ``[B, T]`` rows that each end
            with a done step, one step (``[]``), or a lazy stack of steps.
        keys: the keys to read.
        pending: what is held back; the insertion's steps and group ids must be of the same
            kind (dense or ragged steps; string or tensor ids of one width).
        required_version: the policy version must be there (``max_policy_lag`` is set); else
            it is read when the input has it.

    Raises:
        KeyError: a key is missing (the message names it and lists the input's keys).
        RuntimeError: the input does not end with a done step (as torchrl).
        ValueError: done flags or rewards of the wrong shape, an empty or non-finite reward,
            rewards with different numbers of elements at a step, or tensor ids of another width
            than the pending ones.
        TypeError: a group id or an anchor state that is neither a string nor a tensor, or
            strings mixed with tensors.
    """
    steps, done, group_id = _flat_steps(tensordict, keys, pending.ragged)
    if steps is None:
        return None
    starts, lengths, width = trajectory_bounds(done)
    num_steps = done.shape[0]
    if keys.reward_weights:
        rewards, elements = _weighted_rewards(steps, keys.reward_weights)
    else:
        rewards, elements = _checked_rewards(steps, keys.reward)
    if keys.anchor is not None:
        _check_anchors(steps, keys.anchor)
    return Insertion(
        steps=steps,
        starts=starts,
        lengths=lengths,
        width=width,
        group_ids=_group_ids(steps, starts, keys.group, pending, group_id),
        rewards=rewards,
        reward_lengths=elements.per_run(lengths),
        reward_width=elements.run_width(width),
        num_steps=num_steps,
        num_trajectories=lengths.shape[0],
        versions=read_versions(steps, starts, keys.version, required=required_version),
    )


def trajectory_bounds(done: Tensor) -> tuple[Tensor, Tensor, int]:
    """Where the trajectories of an insertion start, how long they are, and their common length.

    Args:
        done: ``(N,)`` bool, the done flag of every step; the last one is set.

    Returns:
        ``(starts, lengths, width)``: two ``(n,)`` tensors, and the length of every trajectory
        when all have the same (else ``0``). The tensors of a lone trajectory are shared
        constants: never write to them.

    Examples:
        >>> import torch
        >>> trajectory_bounds(torch.tensor([True, False, True]))
        (tensor([0, 1]), tensor([1, 2]), 0)
    """
    ends = done.nonzero()  # (n, 1) last step of each trajectory
    if ends.shape[0] == 1:  # one trajectory (the last step is done): nothing to compute
        return _ZERO, _one_length(done.shape[0]), done.shape[0]
    ends = ends.squeeze(1)  # (n,)
    lengths = torch.diff(ends, prepend=_MINUS_ONE)
    shortest, longest = (int(v) for v in torch.aminmax(lengths))
    return ends - lengths + 1, lengths, shortest if shortest == longest else 0


def _flat_steps(tensordict: TensorDictBase, keys: Keys, ragged: bool):
    """``(steps, done, group_id)``: the input as flat steps, their ``(N,)`` done flags
    (checked), and the group id entry when it is a tensor of the flat dense steps (else
    ``None``: read from the steps); ``(None, None, None)`` for an input of no step. Steps are
    ragged if the held ones are, or if they do not stack."""
    if tensordict.batch_dims == 0:
        tensordict = tensordict.unsqueeze(0)
    if isinstance(tensordict, LazyStackedTensorDict):
        concrete = _materialize(tensordict)
        ragged = ragged or concrete is None
        tensordict = tensordict if concrete is None else concrete
    shape = tensordict.batch_size
    if shape.numel() == 0:
        return None, None, None
    done = get_entry(tensordict, keys.done, "done")
    group_id = get_entry(tensordict, keys.group, "group id")  # checked before any work
    done = _done_flags(done, shape, keys.done)  # (N,)
    if len(shape) > 1:
        flat = tensordict.reshape(-1)
        tensordict = lazy_stack(list(flat.unbind(0))) if ragged else flat
        group_id = None
    if ragged:
        return RaggedSteps(list(tensordict.unbind(0))), done, None
    return DenseSteps(tensordict), done, group_id if isinstance(group_id, Tensor) else None


def _materialize(tensordict: LazyStackedTensorDict) -> TensorDictBase | None:
    """A lazy stack as one contiguous TensorDict, or ``None`` if its steps are ragged."""
    try:
        concrete = tensordict.contiguous()
    except RuntimeError:
        return None
    # contiguous() may silently drop stacked non-tensor entries; keep the lazy form then.
    lazy_keys = set(tensordict.keys(True, True, is_leaf=is_leaf_nontensor))
    if lazy_keys - set(concrete.keys(True, True, is_leaf=is_leaf_nontensor)):
        return None
    return concrete


def _done_flags(done, shape: torch.Size, key) -> Tensor:
    """The ``(N,)`` done flags, checked: one per step, and every row ends with one."""
    if not isinstance(done, Tensor) or done.numel() != shape.numel():
        raise ValueError(
            f"MCAdvantage: the done key {key!r} must hold one flag per step, got shape "
            f"{tuple(getattr(done, 'shape', ()))} for a batch of {tuple(shape)}."
        )
    done = done.reshape(-1)
    row_ends = done[-1:] if len(shape) == 1 else done.view(-1, shape[-1])[:, -1]  # (rows,)
    if not (bool(row_ends) if row_ends.shape[0] == 1 else bool(row_ends.all())):
        row = int((~row_ends.bool()).nonzero()[0])
        raise RuntimeError(
            "MCAdvantage: expected complete trajectories, but the input's last step "
            f"(row {row} of batch {tuple(shape)}) has {key!r}=False. A collector's batch can "
            "end inside a trajectory (an agent's dialog after one of its turns): give every "
            "step a trajectory id (traj_key) and the unfinished ones are held until they end. "
            "torchrl's collectors write ('collector', 'traj_ids'); torchrl's LLMCollector "
            "writes none: append torchrl_grpo.llm.ExactTurns to the env and use "
            "MCAdvantage(traj_key='dialog_id'), or collect whole dialogs "
            "(LLMCollector(yield_completed_trajectories=True))."
        )
    done = done.cpu()  # bookkeeping is on the CPU whatever the data's device (no-op there)
    return done if done.dtype == torch.bool else done.bool()


def _checked_rewards(steps: Steps, key) -> tuple[Tensor, Elements]:
    """Every reward element, flat and checked non-empty and finite, and how they lie on the
    steps."""
    values, elements = steps.reward_elements(key)
    step = elements.empty_step(len(steps))
    if step is not None:
        raise ValueError(f"MCAdvantage: the reward under {key!r} is empty at step {step}.")
    if not _all_finite(values):
        bad = ~torch.isfinite(values)
        step = elements.step_of(int(bad.nonzero()[0]))
        raise ValueError(
            f"MCAdvantage: {int(bad.sum())} non-finite reward value(s) under {key!r}, the first "
            f"at step {step} (value {float(values[bad][0])})."
        )
    return values, elements


def _weighted_rewards(
    steps: Steps, weights: tuple[tuple[object, float], ...]
) -> tuple[Tensor, Elements]:
    """The weighted sum of several rewards' elements (float64), each read and checked as one
    reward is, and how they lie on the steps; every reward has as many elements at each step."""
    total, first_key, first_elements = None, None, None
    for key, weight in weights:
        values, elements = _checked_rewards(steps, key)
        if first_key is None:
            first_key, first_elements = key, elements
        elif not elements.same(first_elements):
            raise ValueError(
                f"MCAdvantage: the rewards under {key!r} and {first_key!r} must have as many "
                "elements at every step."
            )
        term = values.double() * weight
        total = term if total is None else total.add_(term)
    if not _all_finite(total):  # finite terms whose weighted sum overflows
        raise ValueError(
            f"MCAdvantage: the weighted sum of the rewards {[k for k, _ in weights]} overflows."
        )
    return total, first_elements


def _check_anchors(steps: Steps, key) -> None:
    """Every step has an anchor state under ``key``: a tensor entry (one row per step), or a
    string per step (for ragged steps, a tensor or a string each)."""
    values = steps.entries(key, "anchor")
    if isinstance(values, Tensor):  # a TensorDict entry: one row per step
        return
    for value in values:
        if not isinstance(value, (Tensor, str)):
            raise TypeError(
                f"MCAdvantage: the anchor state under {key!r} must be a tensor or a string, got "
                f"{type(value).__name__}: {value!r:.80}."
            )


def read_versions(steps: Steps, starts: Tensor, key, required: bool = False) -> Tensor | None:
    """The policy version of each trajectory, read at its first step (torchrl's
    ``PolicyVersion`` writes an integer per step); ``None`` without ``key`` in the input, or
    with versions that are not integers (``PolicyVersion(version_type="uuid")``'s strings),
    unless ``required``.

    Raises:
        KeyError: ``required`` and the input has no ``key``.
        TypeError: ``required`` and the versions are not one integer per step.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl_grpo.mcadvantage.steps import DenseSteps
        >>> steps = DenseSteps(TensorDict(policy_version=torch.tensor([3, 3, 5]), batch_size=[3]))
        >>> read_versions(steps, torch.tensor([0, 2]), "policy_version")
        tensor([3, 5])
    """
    if key is None:
        return None
    probe = steps.data[0] if steps.ragged else steps.data  # a cheap look before the read
    if probe.get(key, None) is None:
        if required:
            get_entry(probe, key, "policy version")  # raises KeyError, naming the keys there
        return None
    values = steps.entries(key, "policy version", starts)
    if isinstance(values, list) and values and all(isinstance(v, Tensor) for v in values):
        values = torch.stack([value.reshape(-1).cpu() for value in values])  # ragged steps
    n = starts.shape[0]
    if isinstance(values, Tensor) and not values.is_floating_point() and not values.is_complex():
        values = values.reshape(n, -1)
        if values.shape[1] == 1 and values.dtype != torch.bool:
            return values[:, 0].to(device="cpu", dtype=torch.long)
    if required:
        raise TypeError(
            f"MCAdvantage: max_policy_lag compares integer policy versions, one per step, but "
            f"{key!r} holds {type(values).__name__} values (PolicyVersion(version_type=int) "
            "writes integers)."
        )
    return None


def _group_ids(steps: Steps, starts: Tensor, key, pending: Pending, group_id) -> GroupIds:
    """The group id of each trajectory, read at its first step (from ``group_id``, the flat
    steps' tensor entry, when given), checked against the pending ones: tensor ids of one
    width, or strings."""
    n = starts.shape[0]
    if group_id is None:
        values = steps.entries(key, "group id", starts)
    else:
        values = group_id[:1] if n == 1 else group_id.index_select(0, starts.to(group_id.device))
    if isinstance(values, list) and values and isinstance(values[0], Tensor):  # ragged steps
        values = torch.stack([value.cpu() for value in values])
    held = pending.ids if pending.num_pending else None
    if isinstance(values, Tensor):
        ids = TensorIds(values.reshape(n, -1).cpu())
        _check_tensor_ids(ids, held if held is not None and held.kind == ids.kind else None, key)
    else:
        for group_id in values:
            if not isinstance(group_id, str):
                raise TypeError(
                    f"MCAdvantage: the group id under {key!r} must be a string or a tensor, got "
                    f"{type(group_id).__name__}: {group_id!r:.80}."
                )
        ids = PromptIds(values)
    if held is not None and held.kind != ids.kind:
        raise TypeError(
            f"MCAdvantage: group ids under {key!r} are {ids.kind}, but the pending groups are "
            f"keyed by {held.kind}; use one kind of group id per transform."
        )
    return ids


def _check_tensor_ids(ids: TensorIds, held: TensorIds | None, key) -> None:
    """Tensor ids compare by exact value: no NaN (it equals nothing, so its group could never
    complete), and of the width and number family (integer, floating...) of the pending ones,
    so that none is rounded into another."""
    values = ids.values
    dtype = values.dtype
    if (dtype.is_floating_point or dtype.is_complex) and bool(values.isnan().any()):
        nan = values.isnan().any(1)
        raise ValueError(
            f"MCAdvantage: the group id under {key!r} of trajectory {int(nan.nonzero()[0])} "
            "of this insertion is NaN: NaN equals nothing, so its group could never complete."
        )
    if held is None:
        return
    if held.width != ids.width:
        raise ValueError(
            f"MCAdvantage: group ids under {key!r} have {ids.width} values per "
            f"trajectory, but the pending ones have {held.width}."
        )
    if held.values.dtype != dtype and held.family != ids.family:
        raise TypeError(
            f"MCAdvantage: group ids under {key!r} are {ids.values.dtype}, but the pending ones "
            f"are {held.values.dtype}: ids are compared by exact value, so use one kind of number "
            f"for them (cast them, e.g. to {held.values.dtype})."
        )


def _all_finite(x: Tensor) -> bool:
    """Whether every value is finite; one reduction when it is (a NaN or inf makes the sum so)."""
    return math.isfinite(x.sum().item()) or bool(torch.isfinite(x).all())


_ZERO = torch.zeros(1, dtype=torch.long)  # the start of a lone trajectory (never written to)
_MINUS_ONE = torch.full((1,), -1, dtype=torch.long)  # the end before the first step (read-only)


@functools.lru_cache(maxsize=4096)
def _one_length(n: int) -> Tensor:
    """``torch.tensor([n])``, made once per length (never written to): a lone trajectory's."""
    return torch.tensor([n])
