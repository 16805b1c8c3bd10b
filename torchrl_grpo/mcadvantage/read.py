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
import itertools
from collections.abc import Callable
from typing import NamedTuple

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase, is_leaf_nontensor, lazy_stack
from torch import Tensor

from torchrl_grpo.mcadvantage.ids import GroupIds, PromptIds, TensorIds
from torchrl_grpo.mcadvantage.options import Keys
from torchrl_grpo.mcadvantage.records import NO_VERSION, Insertion, Pending
from torchrl_grpo.mcadvantage.steps import DenseSteps, Elements, RaggedSteps, Steps, get_entry

__all__ = [
    "PADDING_MASK",
    "arrival_checks",
    "drop_padding",
    "fail_checks",
    "read_insertion",
    "read_versions",
    "trajectory_bounds",
]

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

    Every size and check it needs from the values (the trajectories' number and lengths, the
    range of the group ids, whether the rewards are finite...) is read on the host at once
    (:func:`~torchrl_grpo.mcadvantage.host.read_ints`); a failed check reads more to name the
    cause.

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
    steps, done, row_ends, ids = _flat_steps(tensordict, keys, pending.ragged)
    if steps is None:
        return None
    if keys.reward_weights:
        rewards, elements, checks = _weighted_rewards(steps, keys.reward_weights)
    else:
        rewards, elements, checks = _checked_rewards(steps, keys.reward)
    if keys.anchor is not None:
        _check_anchors(steps, keys.anchor)
    version = None if keys.version is None else _probe(steps).get(keys.version, None)
    dense_versions = _dense_versions(steps, version, done.shape[0])
    census = _census(done, row_ends, checks, ids, pending, dense_versions, host_indexed=ids is None)
    if census.bounds is None:  # a row does not end with a done step
        raise _not_ended(done if row_ends is None else row_ends, tensordict.batch_size, keys.done)
    fail_checks(checks, census.checks)  # raises, unless a closer look clears it
    starts, lengths, width = census.bounds
    at = starts if ids is not None else census.starts  # a list where the host indexes steps
    return Insertion(
        steps=steps,
        starts=starts,
        lengths=lengths,
        width=width,
        group_ids=_group_ids(steps, at, keys.group, pending, ids, census.nan, census.bounds_of_ids),
        rewards=rewards,
        reward_lengths=elements.per_run(lengths),
        reward_width=elements.run_width(width),
        num_steps=done.shape[0],
        num_trajectories=lengths.shape[0],
        versions=read_versions(
            steps, at, keys.version, required=required_version, present=version is not None
        ),
        id_range=census.id_range,
        newest=census.newest,
    )


def arrival_checks(tensordict: TensorDictBase, keys: Keys) -> list[_Check]:
    """The checks that the rewards of every step of an insertion joined by trajectory id are
    finite, to read with the join's sizes (:func:`~torchrl_grpo.mcadvantage.tails.join`).

    The steps of an unfinished trajectory are held, not read (:func:`read_insertion` reads a
    trajectory once it completes): without this, a NaN on a dialog's first turn would be held
    and refused in the later insertion that completes the dialog, a good one, and refused again
    at every insertion that brings the rest of that dialog. Checked on arrival, the insertion
    that brings it is refused, naming its step, and nothing is held.

    Args:
        tensordict: the insertion as :func:`~torchrl_grpo.mcadvantage.tails.streamed` gives
            it: dense steps (``[N]`` or ``[B, T]``) or a lazy stack of ragged steps.
        keys: where the rewards are.

    Raises:
        KeyError: a step lacks a reward.
        ValueError: a reward is empty at a step, or of the wrong shape.
    """
    if isinstance(tensordict, LazyStackedTensorDict):
        steps = RaggedSteps(list(tensordict.unbind(0)))
    else:
        steps = DenseSteps(tensordict.reshape(-1) if tensordict.batch_dims > 1 else tensordict)
    if keys.reward_weights:
        return _weighted_rewards(steps, keys.reward_weights)[2]
    return _checked_rewards(steps, keys.reward)[2]


def fail_checks(checks: list[_Check], sums: list[int]) -> None:
    """Raise for the first check whose sum (read on the host) is not finite, naming its
    cause (a sum that overflows while every value is finite passes)."""
    for check, bits in zip(checks, sums, strict=True):
        if not _is_finite(bits):
            check.fail()


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
    ends, sizes = _ends(done)
    n, first, _, most = sizes.tolist()
    return _bounds(ends, n, _longest(first, most), done.shape[0])


def _ends(done: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(ends, read)``: the last step of each trajectory, ``(N,)`` padded with ``-1`` (use the
    first ``n``), and what to read (a ``(4,)`` int64): the number of trajectories ``n``, the
    first end, and the least and largest difference of consecutive ends. With several
    trajectories, the longest is the first end plus one or the largest difference (the
    padding's are not above 0), and the least difference is ``-N`` exactly when the padding
    follows an end at the last step (``-1 - (N - 1)``; without padding every length is 1)."""
    num_steps = done.shape[0]
    ends = torch.nonzero_static(done, size=num_steps, fill_value=-1).view(-1)
    if num_steps == 1:  # (no difference: 0 and 1, the least not -N)
        return ends, torch.cat([done.long(), ends, _ZERO, _ZERO + 1])
    least, most = torch.aminmax(ends[1:] - ends[:-1])
    return ends, torch.cat([done.count_nonzero().view(1), ends[:1], torch.stack([least, most])])


def _longest(first: int, most: int) -> int:
    """The longest trajectory's length from what :func:`_ends` read (several trajectories)."""
    return max(first + 1, most)


def _bounds(ends, n: int, longest: int, num_steps: int) -> tuple[Tensor, Tensor, int]:
    """:func:`trajectory_bounds` from the (padded) ends, the number of trajectories and the
    longest length (read on the host): every trajectory has the longest's length exactly when
    ``n * longest`` is every step."""
    if n == 1:  # one trajectory (the last step is done): nothing to compute
        return _ZERO, _one_length(num_steps), num_steps
    if n * longest == num_steps:
        return torch.arange(0, num_steps, longest), torch.full((n,), longest), longest
    ends = ends[:n]
    lengths = torch.diff(ends, prepend=_MINUS_ONE)
    return ends - lengths + 1, lengths, 0


class _Check(NamedTuple):
    """A check of the input's values: a sum that is finite when they are (:func:`_finite`), read
    with the other sizes, and what to do once it is not: ``fail()`` reads what names the cause
    and raises, unless a closer look (a sum that overflows while every value is finite) clears
    it."""

    sum: Tensor  # (1,) int64: the bits of a float64 sum
    fail: Callable[[], None]


class _Census(NamedTuple):
    """What :func:`read_insertion` needs on the host, read at once."""

    bounds: tuple | None  # (starts, lengths, width) as trajectory_bounds; None: a row does not
    # end with a done step
    checks: list  # the sum of each _Check, as bits
    id_range: tuple | None  # (low, high, held ids) of the integer group ids, pending included
    nan: bool | None  # some (floating) group id is NaN, at some step; None: not looked at
    starts: list | None  # the first step of each trajectory, where the done flags were read
    bounds_of_ids: tuple[int, int] | None  # the incoming integer ids' (low, high)
    newest: int | None  # the newest policy version at a trajectory's first step (dense steps)


#: An input of at most this many steps has its done flags read whole, and its trajectories
#: found on the host (C-level list operations, no Python loop): fewer operators than
#: :func:`_ends` for a short input (a trajectory added alone), as for string ids and ragged
#: steps, which the host indexes.
WHOLE_FLAGS = 512


def _census(
    done, row_ends, checks, ids, pending: Pending, versions, *, host_indexed: bool
) -> _Census:
    """Read the input's sizes and flags at once: one synchronisation (of int64 tensors only:
    stacking mixed ones costs a cast each)."""
    num_steps = done.shape[0]
    parts = [check.sum for check in checks]  # (1,) each, read with one cat
    if versions is not None:  # the newest at a trajectory's first step (after a done step)
        starts = torch.ones_like(done)
        starts[1:] = done[:-1]
        parts.append(torch.where(starts, versions, NO_VERSION).max(0, keepdim=True).values)
    ranged = ids is not None and ids.numel() == num_steps and _integer(ids.dtype)
    held = _held_range(pending, num_steps) if ranged else None
    held_read = held is not None and isinstance(held[0], Tensor)  # else known already
    if ranged:
        parts += [*torch.aminmax(ids, dim=0, keepdim=ids.ndim == 1), *(held if held_read else ())]
    floating = ids is not None and (ids.dtype.is_floating_point or ids.dtype.is_complex)
    if floating:
        parts.append(ids.isnan().sum().reshape(1))
    whole = host_indexed or num_steps <= WHOLE_FLAGS
    if whole:
        values = torch.cat([*parts, done.long()]).tolist()
    else:
        ends, sizes = _ends(done)
        rows = None if row_ends is None else row_ends.sum().view(1)  # the rows that end
        values = torch.cat([*parts, sizes, *([] if rows is None else [rows])]).tolist()
    values = iter(values)
    sums = [next(values) for _ in checks]
    newest = None if versions is None else next(values)
    low = high = id_range = None
    if ranged:
        low, high = next(values), next(values)
        if held_read:
            held = next(values), next(values)
        id_range = (
            (low, high, None)
            if held is None
            else (min(low, held[0]), max(high, held[1]), pending.ids)
        )
    nan = bool(next(values)) if floating else None
    rows = 1 if row_ends is None else row_ends.shape[0]
    if whole:
        bounds, starts = _bounds_of_flags(list(values), rows, host_indexed)
    else:
        n, first, least, most, *ended = values  # see _ends, and the rows that end
        rows_end = (n == num_steps or least == -num_steps) if not ended else ended[0] == rows
        longest = _longest(first, most)
        bounds, starts = _bounds(ends, n, longest, num_steps) if rows_end else None, None
    bounds_of_ids = None if low is None else (low, high)
    return _Census(bounds, sums, id_range, nan, starts, bounds_of_ids, newest)


def _bounds_of_flags(flags: list, rows: int, listed: bool) -> tuple:
    """``((starts, lengths, width), starts)``: :func:`trajectory_bounds` of the done flags read
    on the host, and (``listed``) the starts as a list; ``(None, None)`` if a row of ``rows``
    does not end with a done step."""
    num_steps = len(flags)
    if not (flags[-1] if rows == 1 else all(flags[num_steps // rows - 1 :: num_steps // rows])):
        return None, None
    ends = list(itertools.compress(range(num_steps), flags))
    starts = [0, *itertools.compress(range(1, num_steps), flags[:-1])] if listed else None
    n, width = len(ends), ends[0] + 1
    if n == 1 or (n * width == num_steps and ends == list(range(width - 1, num_steps, width))):
        return _bounds(None, n, width, num_steps), starts
    return _bounds(torch.tensor(ends), n, 0, num_steps), starts


def _probe(steps: Steps):
    """What a key's presence is looked for in: the steps, or the first of ragged ones."""
    return steps.data[0] if steps.ragged else steps.data


def _dense_versions(steps: Steps, value, num_steps: int) -> Tensor | None:
    """The policy version entry ``value`` of dense steps, on the CPU, when it is one integer per
    step (else ``None``: read at the trajectories' starts only, by :func:`read_versions`)."""
    if steps.ragged or not isinstance(value, Tensor) or value.numel() != num_steps:
        return None
    if not _integer(value.dtype):
        return None
    return value.reshape(-1).to(device="cpu", dtype=torch.long)


def _integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _held_range(pending: Pending, num_steps: int):
    """``(low, high)`` of the pending ids when they can be coded with the incoming ones through
    one table (integers, one value each), else ``None``: their bounds when known and close
    enough to be a table's, else tensors to read."""
    held = pending.ids if pending.num_pending else None
    if type(held) is not TensorIds:
        return None
    values, bounds = held.values, held.bounds
    if values.shape[1] != 1 or not _integer(values.dtype):
        return None
    if bounds is not None and bounds[1] - bounds[0] <= 4 * (values.shape[0] + num_steps) + 1024:
        return bounds
    return torch.aminmax(values, dim=0)  # (1,) each


def _flat_steps(tensordict: TensorDictBase, keys: Keys, ragged: bool):
    """``(steps, done, row_ends, ids)``: the input as flat steps, their ``(N,)`` done flags (on
    the CPU), the done flag of each row's last step (not checked yet), and the group id entry
    when the steps are dense and it is a tensor (one row per step; else ``None``: read step by
    step, at the trajectories' starts); all ``None`` for an input of no step. Steps are ragged
    if the held ones are, or if they do not stack."""
    if tensordict.batch_dims == 0:
        tensordict = tensordict.unsqueeze(0)
    if isinstance(tensordict, LazyStackedTensorDict):
        concrete = _materialize(tensordict)
        ragged = ragged or concrete is None
        tensordict = tensordict if concrete is None else concrete
    shape = tensordict.batch_size
    if shape.numel() == 0:
        return None, None, None, None
    done = get_entry(tensordict, keys.done, "done")
    ids = get_entry(tensordict, keys.group, "group id")  # checked before any work
    done, row_ends = _done_flags(done, shape, keys.done)  # (N,), (rows,)
    ids = None if ragged or not isinstance(ids, Tensor) else ids.cpu()  # (bookkeeping: CPU)
    if len(shape) > 1:
        flat = tensordict.reshape(-1)
        tensordict = lazy_stack(list(flat.unbind(0))) if ragged else flat
        ids = None if ids is None else ids.reshape(done.shape[0], *ids.shape[len(shape) :])
    if ragged:
        return RaggedSteps(list(tensordict.unbind(0))), done, row_ends, None
    return DenseSteps(tensordict), done, row_ends, ids


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


def _done_flags(done, shape: torch.Size, key) -> tuple[Tensor, Tensor]:
    """The ``(N,)`` done flags (one per step, checked) on the CPU, and the flag of each row's
    last step (every row must end with one: checked by the caller, with the other flags;
    ``None`` for flat steps, whose last step is the last end)."""
    if not isinstance(done, Tensor) or done.numel() != shape.numel():
        raise ValueError(
            f"MCAdvantage: the done key {key!r} must hold one flag per step, got shape "
            f"{tuple(getattr(done, 'shape', ()))} for a batch of {tuple(shape)}."
        )
    done = done.reshape(-1).cpu()  # bookkeeping is on the CPU whatever the data's device
    done = done if done.dtype == torch.bool else done.bool()
    row_ends = None if len(shape) == 1 else done.view(-1, shape[-1])[:, -1]  # (rows,)
    return done, row_ends


def _not_ended(row_ends: Tensor, shape: torch.Size, key) -> RuntimeError:
    row = int((~row_ends).nonzero()[0]) if len(shape) > 1 else 0
    return RuntimeError(
        "MCAdvantage: expected complete trajectories, but the input's last step "
        f"(row {row} of batch {tuple(shape)}) has {key!r}=False. A collector's batch can "
        "end inside a trajectory (an agent's dialog after one of its turns): give every "
        "step a trajectory id (traj_key) and the unfinished ones are held until they end. "
        "torchrl's collectors write ('collector', 'traj_ids'); torchrl's LLMCollector "
        "writes none: append torchrl_grpo.llm.ExactTurns to the env and use "
        "MCAdvantage(traj_key='dialog_id'), or collect whole dialogs "
        "(LLMCollector(yield_completed_trajectories=True))."
    )


def _checked_rewards(steps: Steps, key) -> tuple[Tensor, Elements, list[_Check]]:
    """Every reward element, flat, how they lie on the steps (non-empty: checked), and the
    check that they are finite (one reduction: a NaN or inf makes the sum so)."""
    values, elements = steps.reward_elements(key)
    step = elements.empty_step(len(steps))
    if step is not None:
        raise ValueError(f"MCAdvantage: the reward under {key!r} is empty at step {step}.")

    def fail() -> None:
        bad = ~torch.isfinite(values)
        if not bool(bad.any()):
            return  # finite values whose sum overflows
        step = elements.step_of(int(bad.nonzero()[0]))
        raise ValueError(
            f"MCAdvantage: {int(bad.sum())} non-finite reward value(s) under {key!r}, the first "
            f"at step {step} (value {float(values[bad][0])})."
        )

    return values, elements, [_Check(_finite(values), fail)]


def _weighted_rewards(
    steps: Steps, weights: tuple[tuple[object, float], ...]
) -> tuple[Tensor, Elements, list[_Check]]:
    """The weighted sum of several rewards' elements (float64), each read and checked as one
    reward is, how they lie on the steps (every reward has as many elements at each step), and
    the checks: each reward finite, then their weighted sum."""
    total, first_key, first_elements, checks = None, None, None, []
    for key, weight in weights:
        values, elements, check = _checked_rewards(steps, key)
        checks += check
        if first_key is None:
            first_key, first_elements = key, elements
        elif not elements.same(first_elements):
            raise ValueError(
                f"MCAdvantage: the rewards under {key!r} and {first_key!r} must have as many "
                "elements at every step."
            )
        term = values.double() * weight
        total = term if total is None else total.add_(term)

    def overflows() -> None:  # finite terms whose weighted sum is not
        if not bool(torch.isfinite(total).all()):
            raise ValueError(
                f"MCAdvantage: the weighted sum of the rewards {[k for k, _ in weights]} overflows."
            )

    return total, first_elements, [*checks, _Check(_finite(total), overflows)]


def _finite(values: Tensor) -> Tensor:
    """The bits of the values' sum (as a float64), a ``(1,)`` int64 to read with the other
    checks: it is finite when every value is (a NaN or an inf makes the sum so), the one
    reduction a check needs; a sum that is not is looked at closer (see :func:`_is_finite`):
    summed in the values' dtype, several times faster than in float64 on a CPU, it may
    overflow where they do not."""
    return values.sum(0, keepdim=True).double().view(torch.int64)


def _is_finite(bits: int) -> bool:
    """Whether the float64 of these bits (read by :func:`_finite`) is finite: its exponent is
    not all ones."""
    return (bits >> 52) & 0x7FF != 0x7FF


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


def read_versions(
    steps: Steps, starts: Tensor | list, key, required: bool = False, present: bool | None = None
) -> Tensor | None:
    """The policy version of each trajectory, read at its first step (torchrl's
    ``PolicyVersion`` writes an integer per step); ``None`` without ``key`` in the input, or
    with versions that are not integers (``PolicyVersion(version_type="uuid")``'s strings),
    unless ``required``. ``present``: whether the caller found ``key`` (else looked for).

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
    probe = _probe(steps)  # a cheap look before the read
    if not (probe.get(key, None) is not None if present is None else present):
        if required:
            get_entry(probe, key, "policy version")  # raises KeyError, naming the keys there
        return None
    values = steps.entries(key, "policy version", starts)
    if isinstance(values, list) and values and all(isinstance(v, Tensor) for v in values):
        values = torch.stack([value.reshape(-1).cpu() for value in values])  # ragged steps
    n = starts.shape[0] if isinstance(starts, Tensor) else len(starts)
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


def _group_ids(
    steps: Steps, at, key, pending: Pending, ids, nan: bool | None, bounds=None
) -> GroupIds:
    """The group id of each trajectory, read at its first step ``at`` (from ``ids``, the dense
    steps' tensor entry, when given), checked against the pending ones: tensor ids of one
    width, or strings. ``nan``: whether some id (at any step) was seen NaN, ``None`` if not
    looked at; ``bounds``: tensor ids' bounds, if read."""
    n = at.shape[0] if isinstance(at, Tensor) else len(at)
    if ids is None:
        values = steps.entries(key, "group id", at)
    else:
        values = ids[:1] if n == 1 else ids.index_select(0, at)
    if isinstance(values, list) and values and isinstance(values[0], Tensor):  # ragged steps
        values = torch.stack([value.cpu() for value in values])
    held = pending.ids if pending.num_pending else None
    if isinstance(values, Tensor):
        found = TensorIds(values.reshape(n, -1).cpu(), bounds)
        held_ids = held if held is not None and held.kind == found.kind else None
        _check_tensor_ids(found, held_ids, key, nan)
    else:
        for group_id in values:
            if not isinstance(group_id, str):
                raise TypeError(
                    f"MCAdvantage: the group id under {key!r} must be a string or a tensor, got "
                    f"{type(group_id).__name__}: {group_id!r:.80}."
                )
        found = PromptIds(values)
    if held is not None and held.kind != found.kind:
        raise TypeError(
            f"MCAdvantage: group ids under {key!r} are {found.kind}, but the pending groups are "
            f"keyed by {held.kind}; use one kind of group id per transform."
        )
    return found


def _check_tensor_ids(ids: TensorIds, held: TensorIds | None, key, nan: bool | None) -> None:
    """Tensor ids compare by exact value: no NaN (it equals nothing, so its group could never
    complete), and of the width and number family (integer, floating...) of the pending ones,
    so that none is rounded into another. ``nan``: as in :func:`_group_ids`."""
    values = ids.values
    dtype = values.dtype
    floating = dtype.is_floating_point or dtype.is_complex
    if floating and nan is not False and bool(values.isnan().any()):
        bad = values.isnan().any(1)
        raise ValueError(
            f"MCAdvantage: the group id under {key!r} of trajectory {int(bad.nonzero()[0])} "
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


_ZERO = torch.zeros(1, dtype=torch.long)  # the start of a lone trajectory (never written to)
_MINUS_ONE = torch.full((1,), -1, dtype=torch.long)  # the end before the first step (read-only)


@functools.lru_cache(maxsize=4096)
def _one_length(n: int) -> Tensor:
    """``torch.tensor([n])``, made once per length (never written to): a lone trajectory's."""
    return torch.tensor([n])
