"""Steps of trajectories laid one after the other: dense or ragged, decided once, when read.

An insertion's steps are *dense* when they concatenate into one flat TensorDict (every entry has
the same shape at every step), and *ragged* otherwise: token sequences of different lengths in a
lazy stack are kept as a list of step TensorDicts. :class:`DenseSteps` and :class:`RaggedSteps`
offer the same operations, so the steps of an insertion (taking trajectories, joining pieces,
reading a reward, writing the advantage) never ask which kind they hold.

Devices: steps stay where they are. What the transform computes from them is read onto the CPU
(:meth:`Steps.elements`); only index tensors and the advantage go back to the data's device.
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack
from torch import Tensor

from torchrl_grpo._segments import Segments

__all__ = [
    "DenseSteps",
    "Elements",
    "RaggedSteps",
    "Steps",
    "Uniform",
    "Varying",
    "get_entry",
]


def get_entry(tensordict: TensorDictBase, key, role: str):
    """``tensordict[key]``; a ``KeyError`` naming the ``role`` and the keys present if absent."""
    value = tensordict.get(key, None)
    if value is None:
        raise KeyError(
            f"MCAdvantage: the {role} key {key!r} is missing from the input "
            f"(keys: {sorted(map(str, tensordict.keys(True, True)))})."
        )
    return value


class Steps:
    """Steps one after the other; ``len`` is their number. Subclasses hold the data."""

    __slots__ = ("data",)
    ragged = False

    def __init__(self, data):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    @staticmethod
    def cat(parts: list[Steps]) -> Steps:
        """The steps of ``parts``, one after the other, on the device of the last (the newest
        data): a new TensorDict, or the one part as it is. Dense parts whose entries differ in
        shape (a reward of one element, then of two) cannot be concatenated: the result is then
        ragged, as when any part is; ragged results hold copies of the steps (a shallow copy
        each), so that what is written on them does not reach the parts."""
        ragged = any(part.ragged for part in parts)
        if len(parts) == 1 and not ragged:
            return parts[0]
        parts = _on_one_device(parts)
        if not ragged:
            try:
                return DenseSteps(torch.cat([part.data for part in parts]))
            except RuntimeError:
                pass
        return RaggedSteps([step.copy() for part in parts for step in part.step_list()])

    def take_sorted(self, index: Tensor) -> Steps:
        """Steps ``index`` (increasing); a contiguous run is a view, the whole is ``self``."""
        first, last = int(index[0]), int(index[-1])
        if last - first + 1 == index.numel():
            return (
                self if first == 0 and index.numel() == len(self) else self.window(first, last + 1)
            )
        return self.take(index)

    def entries(self, key, role: str, at: Tensor | list | None = None) -> Tensor | list:
        """The entry ``key`` of every step (or of steps ``at``, a tensor or a list read on the
        host): a tensor with one row per step, or a list of one value per step (strings, or
        tensors of different shapes).

        Raises:
            KeyError: a step lacks ``key`` (the message names the ``role``).
        """
        raise NotImplementedError

    def reward_elements(self, key) -> tuple[Tensor, Elements]:
        """Every element of the reward ``key`` at every step, flat, on the CPU, and how they lie
        on the steps; ``key`` ``None`` (no reward read: pure distillation) gives one ``0`` per
        step.

        Raises:
            KeyError: a step lacks ``key``.
            ValueError: a dense reward is not a tensor with one row per step.
        """
        raise NotImplementedError

    def device(self) -> torch.device | None:
        """Where the steps' tensors are (``None``: they hold none)."""
        raise NotImplementedError


class DenseSteps(Steps):
    """Steps as one flat TensorDict ``[N]``."""

    __slots__ = ()

    def take(self, index: Tensor) -> DenseSteps:
        return DenseSteps(self.data[index])

    def window(self, start: int, stop: int) -> DenseSteps:
        return DenseSteps(self.data[start:stop])

    def keep(self, mask: Tensor) -> DenseSteps | None:
        return DenseSteps(self.data[mask]) if bool(mask.any()) else None

    def step_list(self) -> list:
        return list(self.data.unbind(0))

    def output(self) -> TensorDictBase:
        return self.data

    def reward_elements(self, key) -> tuple[Tensor, Uniform]:
        if key is None:
            return torch.zeros(len(self)), Uniform(1)
        value = get_entry(self.data, key, "reward")
        num_steps = self.data.shape[0]
        if not isinstance(value, Tensor) or value.ndim == 0 or value.shape[0] != num_steps:
            raise ValueError(
                f"MCAdvantage: the reward under {key!r} must be a tensor with one entry per step "
                f"({num_steps}), got {type(value).__name__} of shape "
                f"{tuple(getattr(value, 'shape', ()))}."
            )
        return value.reshape(-1).cpu(), Uniform(math.prod(value.shape[1:]))

    def write(self, key, values: Tensor, like) -> None:
        """Set ``key`` to ``values`` (one per element of ``like``), shaped and placed as it."""
        reference = self.data.get(like)
        self.data.set(key, values.to(reference.device).reshape(reference.shape))

    def entries(self, key, role: str, at: Tensor | list | None = None) -> Tensor | list:
        value = get_entry(self.data, key, role)
        if isinstance(value, Tensor):
            if at is None:
                return value
            return value.index_select(0, torch.as_tensor(at, device=value.device))
        if hasattr(value, "tolist"):  # NonTensorStack / NonTensorData: strings
            values = value.tolist()
            values = values if isinstance(values, list) else [values] * self.data.shape[0]
        else:
            values = [value] * self.data.shape[0]
        return values if at is None else [values[i] for i in _host(at)]

    def device(self) -> torch.device | None:
        if self.data.device is not None:
            return self.data.device
        for value in self.data.values(True, True):
            if isinstance(value, Tensor):
                return value.device
        return None

    def to(self, device: torch.device) -> DenseSteps:
        return DenseSteps(self.data.to(device))

    def to_plain(self):
        return self.data.to_dict()

    @staticmethod
    def from_plain(plain, num_steps: int) -> DenseSteps:
        return DenseSteps(TensorDict.from_dict(plain, batch_size=[num_steps]))


class RaggedSteps(Steps):
    """Steps as a list of step TensorDicts whose entries may differ in shape."""

    __slots__ = ()
    ragged = True

    def take(self, index: Tensor) -> RaggedSteps:
        return RaggedSteps([self.data[i] for i in index.tolist()])

    def window(self, start: int, stop: int) -> RaggedSteps:
        return RaggedSteps(self.data[start:stop])

    def keep(self, mask: Tensor) -> RaggedSteps | None:
        kept = [step for step, k in zip(self.data, mask.tolist()) if k]
        return RaggedSteps(kept) if kept else None

    def step_list(self) -> list:
        return self.data

    def output(self) -> TensorDictBase:
        return lazy_stack(self.data)

    def reward_elements(self, key) -> tuple[Tensor, Elements]:
        if key is None:
            return torch.zeros(len(self)), Uniform(1)
        values = [get_entry(step, key, "reward") for step in self.data]
        counts = [value.numel() for value in values]
        if values and len({value.shape for value in values}) == 1:  # one shape: no op per step
            flat = torch.cat(values).reshape(-1).cpu()
        else:
            flat = torch.cat([value.reshape(-1).cpu() for value in values])
        if counts and all(count == counts[0] for count in counts):  # ragged tokens, one reward
            return flat, Uniform(counts[0])
        return flat, Varying(torch.tensor(counts), counts)

    def write(self, key, values: Tensor, like) -> None:
        """Set ``key`` at each step to its share of ``values``, shaped and placed as ``like``
        (a fixed number of operators when every step's ``like`` has one shape and device)."""
        references = [step.get(like) for step in self.data]
        if references and len({(r.shape, r.device) for r in references}) == 1:
            first = references[0]
            pieces = values.to(first.device).reshape(len(references), *first.shape).unbind(0)
            for step, piece in zip(self.data, pieces, strict=True):
                step.set(key, piece)
            return
        pieces = values.split([reference.numel() for reference in references])
        for step, piece, reference in zip(self.data, pieces, references):
            step.set(key, piece.to(reference.device).reshape(reference.shape))

    def entries(self, key, role: str, at: Tensor | list | None = None) -> Tensor | list:
        steps = self.data if at is None else [self.data[i] for i in _host(at)]
        values = (get_entry(step, key, role) for step in steps)
        return [getattr(value, "data", value) for value in values]

    def device(self) -> torch.device | None:
        return DenseSteps(self.data[0]).device() if self.data else None

    def to(self, device: torch.device) -> RaggedSteps:
        return RaggedSteps([step.to(device) for step in self.data])

    def to_plain(self):
        return [step.to_dict() for step in self.data]

    @staticmethod
    def from_plain(plain, num_steps: int) -> RaggedSteps:
        return RaggedSteps([TensorDict.from_dict(step, batch_size=[]) for step in plain])


class Elements:
    """How a reward's elements lie on the steps: as many at every step (:class:`Uniform`), or a
    count per step (:class:`Varying`, ragged steps). Decided when the reward is read; every step
    that spreads a per-step value on the elements, or sums the elements per step, asks it."""

    __slots__ = ()


class Uniform(Elements):
    """``per_step`` elements at each step (a dense reward of shape ``(N, *shape)``)."""

    __slots__ = ("per_step",)

    def __init__(self, per_step: int):
        self.per_step = per_step

    def empty_step(self, num_steps: int) -> int | None:
        """The first step with no element (``None``: none)."""
        return 0 if self.per_step == 0 and num_steps else None

    def step_of(self, element: int) -> int:
        return element // self.per_step

    def same(self, other: Elements) -> bool:
        return isinstance(other, Uniform) and other.per_step == self.per_step

    def per_run(self, steps: Tensor) -> Tensor:
        """Elements of runs of ``steps`` steps each."""
        return steps if self.per_step == 1 else steps * self.per_step

    def run_width(self, width: int) -> int:
        """Elements of every run when each has ``width`` steps."""
        return width * self.per_step

    def step_sums(self, values: Tensor) -> Tensor:
        """Each step's elements summed, ``(S,)``."""
        return values if self.per_step == 1 else values.double().view(-1, self.per_step).sum(1)

    def spread(self, per_step: Tensor) -> Tensor:
        """A value per step, on each of its elements, ``(E,)``."""
        if self.per_step == 1:
            return per_step
        return per_step.unsqueeze(1).expand(-1, self.per_step).reshape(-1)


class Varying(Elements):
    """``counts[i]`` elements at step ``i`` (ragged steps)."""

    __slots__ = ("counts", "host")

    def __init__(self, counts: Tensor, host: list[int] | None = None):
        self.counts = counts  # (N,)
        self.host = host  # the same as a list, when the counts were found on the host

    def empty_step(self, num_steps: int) -> int | None:
        if self.host is not None:
            return self.host.index(0) if 0 in self.host else None
        empty = self.counts == 0
        return int(empty.nonzero()[0]) if bool(empty.any()) else None

    def step_of(self, element: int) -> int:
        return int(torch.searchsorted(torch.cumsum(self.counts, 0), element, right=True))

    def same(self, other: Elements) -> bool:
        if not isinstance(other, Varying):
            return False
        if self.host is not None and other.host is not None:
            return self.host == other.host
        return torch.equal(other.counts, self.counts)

    def per_run(self, steps: Tensor) -> Tensor:
        ends = torch.cumsum(steps, 0) - 1  # differences of the running count at the run ends
        return torch.diff(torch.cumsum(self.counts, 0)[ends], prepend=ends.new_zeros(1))

    def run_width(self, width: int) -> None:
        return None  # not known without a pass over the counts

    def step_sums(self, values: Tensor) -> Tensor:
        width = None if self.host is None else 0  # counts found on the host differ (else Uniform)
        return Segments(None, lengths=self.counts, width=width).sum(values.double())

    def spread(self, per_step: Tensor) -> Tensor:
        total = None if self.host is None else sum(self.host)
        return per_step.repeat_interleave(self.counts, output_size=total)


def _host(index: Tensor | list) -> list:
    """An index as a list (a tensor is read on the host)."""
    return index if isinstance(index, list) else index.tolist()


def _on_one_device(parts: list[Steps]) -> list[Steps]:
    """Parts about to be concatenated, moved to the device of the last (the newest data) where
    they differ: pending steps restored onto the CPU (``map_location``) join CUDA ones."""
    devices = [part.device() for part in parts]
    target = devices[-1]
    if target is None or all(device == target for device in devices):
        return parts
    return [part if device == target else part.to(target) for part, device in zip(parts, devices)]
