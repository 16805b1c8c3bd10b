"""One insertion, read and checked: the steps, where each trajectory starts and ends, its rewards
and its group id.

:func:`read_insertion` is the only place that looks at what the user passed to ``extend``/``add``;
everything after it works on the :class:`Insertion` record. It reads every input shape the same
way (``[N]`` steps, ``[B, T]`` rows, one step without a batch dimension, lazy stacks of ragged
steps) and raises before anything else runs, so a bad input changes no state. It is also where an
insertion's trajectories are identified (:func:`trajectory_bounds`): the place where trajectories
that cross insertions would be joined with what an earlier insertion left unfinished.

Devices: the steps stay where they are (a CUDA insertion is stored, gathered and released on
CUDA); what the transform computes from them (done flags, group ids, rewards, and from them every
index, count and advantage) is read onto the CPU here, once. The transform's bookkeeping is small,
made of many tiny operations that would each cost a kernel launch on an accelerator, and it never
meets the data again except as CPU index tensors (which index CUDA data as they are) and as the
advantage, written on the reward's device (:func:`torchrl_grpo._release.release`).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple

import torch
from tensordict import (
    LazyStackedTensorDict,
    NestedKey,
    TensorDictBase,
    is_leaf_nontensor,
    lazy_stack,
)
from torch import Tensor

if TYPE_CHECKING:
    from torchrl_grpo._pending import Pending


class Keys(NamedTuple):
    """The transform's keys: what it reads from an insertion, and what it writes."""

    group: NestedKey  # the group id: a prompt string, or a tensor compared by value
    reward: NestedKey
    done: NestedKey
    advantage: NestedKey  # written on the released steps
    # beyond torchrl: several rewards and their weights (GDPO; () reads ``reward`` alone), and
    # each step's anchor state (GiGPO's step groups; None: none)
    reward_weights: tuple[tuple[NestedKey, float], ...] = ()
    anchor: NestedKey | None = None


class Insertion(NamedTuple):
    """One insertion, flattened and split into trajectories (every tensor is 1-D or ``(n, k)``)."""

    data: TensorDictBase | list  # (N,) steps: a flat TensorDict, or step TensorDicts if ragged
    starts: Tensor  # (n,) first step of each trajectory
    lengths: Tensor  # (n,) steps of each trajectory
    width: int  # the steps of every trajectory when all have as many, else 0
    group_ids: Tensor | list  # (n, k) tensor ids, or n strings
    rewards: Tensor  # (E,) every reward element, trajectory after trajectory (with several
    # rewards, their weighted sum in float64)
    reward_lengths: Tensor  # (n,) reward elements of each trajectory
    reward_width: int | None  # the same for reward elements; None: not known (found on use)
    num_steps: int  # N

    @property
    def num_trajectories(self) -> int:
        return self.lengths.shape[0]

    @property
    def ragged(self) -> bool:
        return isinstance(self.data, list)


def read_insertion(tensordict: TensorDictBase, keys: Keys, state: Pending) -> Insertion | None:
    """Read one insertion; ``None`` if it holds no step.

    Args:
        tensordict: what was passed to ``extend``: ``[N]`` steps, ``[B, T]`` rows that each end
            with a done step, one step (``[]``), or a lazy stack of steps.
        keys: the keys to read.
        state: what the transform holds; the insertion's steps and group ids must be of the same
            kind (dense or ragged steps; string or tensor ids of one width).

    Raises:
        KeyError: a key is missing (the message names it and lists the input's keys).
        RuntimeError: the input does not end with a done step (as torchrl).
        ValueError: done flags or rewards of the wrong shape, an empty or non-finite reward,
            rewards with different numbers of elements at a step, or tensor ids of another width
            than the pending ones.
        TypeError: a group id or an anchor state that is neither a string nor a tensor, or
            strings mixed with tensors.
    """
    if tensordict.batch_dims == 0:
        tensordict = tensordict.unsqueeze(0)
    ragged = state.ragged
    if isinstance(tensordict, LazyStackedTensorDict):
        concrete = _materialize(tensordict)
        ragged = ragged or concrete is None
        tensordict = tensordict if concrete is None else concrete
    shape = tensordict.batch_size
    if shape.numel() == 0:
        return None
    done = _get(tensordict, keys.done, "done")
    group_id = _get(tensordict, keys.group, "group id")  # checked before any work
    done = _done_flags(done, shape, keys.done)  # (N,)
    if len(shape) > 1:
        flat = tensordict.reshape(-1)
        tensordict = lazy_stack(list(flat.unbind(0))) if ragged else flat
        group_id = None  # read again from the flat steps
    data = list(tensordict.unbind(0)) if ragged else tensordict

    starts, lengths, width = trajectory_bounds(done)
    if keys.reward_weights:
        rewards, per_step = _weighted_rewards(tensordict, data, done.shape[0], keys.reward_weights)
    else:
        rewards, per_step = _reward_elements(tensordict, data, done.shape[0], keys.reward)
    if keys.anchor is not None:
        _check_anchors(tensordict, data, done.shape[0], keys.anchor)
    if isinstance(per_step, int):
        reward_lengths = lengths if per_step == 1 else lengths * per_step
        reward_width = width * per_step
    else:  # elements per trajectory: differences of the running count at the trajectory ends
        ends = starts + lengths - 1
        reward_lengths = torch.diff(torch.cumsum(per_step, 0)[ends], prepend=ends.new_zeros(1))
        reward_width = None
    group_ids = _group_ids(tensordict, data, group_id, starts, keys.group, state)
    return Insertion(
        data=data,
        starts=starts,
        lengths=lengths,
        width=width,
        group_ids=group_ids,
        rewards=rewards,
        reward_lengths=reward_lengths,
        reward_width=reward_width,
        num_steps=done.shape[0],
    )


def trajectory_bounds(done: Tensor) -> tuple[Tensor, Tensor, int]:
    """Where the trajectories of an insertion start, how long they are, and their common length.

    Args:
        done: ``(N,)`` bool, the done flag of every step; the last one is set.

    Returns:
        ``(starts, lengths, width)``: two ``(n,)`` tensors, and the length of every trajectory
        when all have the same (else ``0``). The tensors of a lone trajectory are shared
        constants: never write to them.
    """
    ends = done.nonzero()  # (n, 1) last step of each trajectory
    if ends.shape[0] == 1:  # one trajectory (the last step is done): nothing to compute
        return _ZERO, _one_length(done.shape[0]), done.shape[0]
    ends = ends.squeeze(1)  # (n,)
    lengths = torch.diff(ends, prepend=_MINUS_ONE)
    shortest, longest = _bounds(lengths)
    return ends - lengths + 1, lengths, shortest if shortest == longest else 0


def _get(tensordict: TensorDictBase, key: NestedKey, role: str):
    value = tensordict.get(key, None)
    if value is None:
        raise KeyError(
            f"MCAdvantage: the {role} key {key!r} is missing from the input "
            f"(keys: {sorted(map(str, tensordict.keys(True, True)))})."
        )
    return value


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


def _done_flags(done, shape: torch.Size, key: NestedKey) -> Tensor:
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
            f"(row {row} of batch {tuple(shape)}) has {key!r}=False."
        )
    done = done.cpu()  # bookkeeping is on the CPU whatever the data's device (no-op there)
    return done if done.dtype == torch.bool else done.bool()


def _reward_elements(
    tensordict, data, num_steps: int, key: NestedKey
) -> tuple[Tensor, int | Tensor]:
    """Every reward element, flat and checked finite, and the elements of each step (an int when
    every step has as many, else one count per step)."""
    if isinstance(data, list):
        rewards = [_get(step, key, "reward") for step in data]
        per_step = torch.tensor([r.numel() for r in rewards])  # (N,)
        values = torch.cat([r.reshape(-1).cpu() for r in rewards])
    else:
        reward = _get(tensordict, key, "reward")
        if not isinstance(reward, Tensor) or reward.ndim == 0 or reward.shape[0] != num_steps:
            raise ValueError(
                f"MCAdvantage: the reward under {key!r} must be a tensor with one entry per step "
                f"({num_steps}), got {type(reward).__name__} of shape "
                f"{tuple(getattr(reward, 'shape', ()))}."
            )
        per_step = math.prod(reward.shape[1:])
        values = reward.reshape(-1).cpu()  # the advantage is computed on the CPU
        if per_step == 0:
            per_step = torch.zeros(num_steps, dtype=torch.long)  # reported below
    if isinstance(per_step, Tensor) and not bool(per_step.all()):
        step = int((per_step == 0).nonzero()[0])
        raise ValueError(f"MCAdvantage: the reward under {key!r} is empty at step {step}.")
    if not _all_finite(values):
        bad = ~torch.isfinite(values)
        first = int(bad.nonzero()[0])
        step = (
            first // per_step
            if isinstance(per_step, int)
            else int(torch.searchsorted(torch.cumsum(per_step, 0), first, right=True))
        )
        raise ValueError(
            f"MCAdvantage: {int(bad.sum())} non-finite reward value(s) under {key!r}, the first "
            f"at step {step} (value {float(values[bad][0])})."
        )
    return values, per_step


def _weighted_rewards(
    tensordict, data, num_steps: int, weights: tuple[tuple[NestedKey, float], ...]
) -> tuple[Tensor, int | Tensor]:
    """The weighted sum of several rewards' elements (float64), each read and checked as one
    reward is, and the elements of each step; every reward has as many elements at each step."""
    total, first_key, first_per_step = None, None, None
    for key, weight in weights:
        values, per_step = _reward_elements(tensordict, data, num_steps, key)
        if first_key is None:
            first_key, first_per_step = key, per_step
        elif not _same_counts(per_step, first_per_step):
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
    return total, first_per_step


def _same_counts(a: int | Tensor, b: int | Tensor) -> bool:
    """Whether two per-step element counts (an int for all steps, or one per step) agree."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool((torch.as_tensor(a) == torch.as_tensor(b)).all())


def _check_anchors(tensordict, data, num_steps: int, key: NestedKey) -> None:
    """Every step has an anchor state under ``key``: a tensor entry (one row per step), or a
    string per step (for ragged steps, a tensor or a string each)."""
    if isinstance(data, list):
        values = [_get(step, key, "anchor") for step in data]
    else:
        value = _get(tensordict, key, "anchor")
        if isinstance(value, Tensor):  # a TensorDict entry: one row per step
            return
        values = value.tolist() if hasattr(value, "tolist") else value
        values = values if isinstance(values, list) else [values] * num_steps
    for value in values:
        value = getattr(value, "data", value)  # NonTensorData
        if not isinstance(value, (Tensor, str)):
            raise TypeError(
                f"MCAdvantage: the anchor state under {key!r} must be a tensor or a string, got "
                f"{type(value).__name__}: {value!r:.80}."
            )


def _group_ids(tensordict, data, value, starts: Tensor, key: NestedKey, state: Pending):
    """The group id of each trajectory, read at its first step: ``(n, k)`` tensor or n strings."""
    n = starts.shape[0]
    if isinstance(data, list):
        raw = [data[i].get(key) for i in starts.tolist()]
        raw = [v.cpu() if isinstance(v, Tensor) else getattr(v, "data", v) for v in raw]
        ids = torch.stack(raw) if isinstance(raw[0], Tensor) else raw
    else:
        value = tensordict.get(key) if value is None else value
        if isinstance(value, Tensor):
            ids = value[:1] if n == 1 else value.index_select(0, starts)
        elif hasattr(value, "tolist"):  # NonTensorStack / NonTensorData: prompts
            values = value.tolist()
            values = values if isinstance(values, list) else [values] * tensordict.shape[0]
            ids = [values[i] for i in starts.tolist()] if n > 1 else values[:1]
        else:
            ids = [value] * n
    if isinstance(ids, Tensor):
        ids = ids.reshape(n, -1).cpu()
        if isinstance(state.keys, list):
            raise TypeError(
                f"MCAdvantage: group ids under {key!r} are tensors, but the pending groups are "
                "keyed by strings; use one kind of group id per transform."
            )
        if state.num_pending and state.keys.shape[1] != ids.shape[1]:
            raise ValueError(
                f"MCAdvantage: group ids under {key!r} have {ids.shape[1]} values per "
                f"trajectory, but the pending ones have {state.keys.shape[1]}."
            )
        return ids
    for group_id in ids:
        if not isinstance(group_id, str):
            raise TypeError(
                f"MCAdvantage: the group id under {key!r} must be a string or a tensor, got "
                f"{type(group_id).__name__}: {group_id!r:.80}."
            )
    if isinstance(state.keys, Tensor) and state.num_pending:
        raise TypeError(
            f"MCAdvantage: group ids under {key!r} are strings, but the pending groups are keyed "
            "by tensors; use one kind of group id per transform."
        )
    return ids


def data_device(data: TensorDictBase | list) -> torch.device | None:
    """Where a TensorDict's tensors are: its device, else its first tensor's (``None``: none);
    for a list of steps, its first step's."""
    if isinstance(data, list):
        return data_device(data[0]) if data else None
    if data.device is not None:
        return data.device
    for value in data.values(True, True):
        if isinstance(value, Tensor):
            return value.device
    return None


def on_one_device(parts: list) -> list:
    """TensorDicts about to be concatenated, moved to the device of the last (the newest data)
    where they differ: pending steps restored onto the CPU (``map_location``) join CUDA ones."""
    if len(parts) < 2:
        return parts
    devices = [data_device(part) for part in parts]
    target = devices[-1]
    if target is None or all(device == target for device in devices):
        return parts
    return [p if d == target else _to(p, target) for p, d in zip(parts, devices)]


def _to(data: TensorDictBase | list, device: torch.device):
    return [step.to(device) for step in data] if isinstance(data, list) else data.to(device)


def _all_finite(x: Tensor) -> bool:
    """Whether every value is finite; one reduction when it is (a NaN or inf makes the sum so)."""
    return math.isfinite(x.sum().item()) or bool(torch.isfinite(x).all())


_ZERO = torch.zeros(1, dtype=torch.long)  # the start of a lone trajectory (never written to)
_MINUS_ONE = torch.full((1,), -1, dtype=torch.long)  # the end before the first step (read-only)


def _bounds(x: Tensor) -> tuple[int, int]:
    """``(min, max)`` of a non-empty integer tensor as Python ints (one reduction)."""
    low, high = torch.aminmax(x)
    return int(low), int(high)


@functools.lru_cache(maxsize=4096)
def _one_length(n: int) -> Tensor:
    """``torch.tensor([n])``, made once per length (never written to): a lone trajectory's."""
    return torch.tensor([n])
