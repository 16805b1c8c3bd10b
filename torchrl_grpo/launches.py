"""What a step launches: the operators it dispatches and the times the host waits on the device.

On an accelerator a small step is launch-bound: every operator is one kernel launch or more
(5-20 us each on a GPU, whatever its size), and every value the host reads back (``.item()``,
``.tolist()``, ``bool(tensor)``, a boolean index, ``nonzero``) stalls the stream until the device
has caught up. Both can be counted on a CPU, where they are the same calls:
:func:`count_launches` counts them at torch's dispatcher, forward and backward, so that a path's
launch cost is measured (and tested) on a machine without a GPU.

What is counted:

* ``ops``: every ATen operator dispatched (views included: each is a dispatch, and on a GPU the
  host time of one), in the forward pass and in the backward pass run inside the block.
* ``syncs``: the calls that read a device value on the host: ``_local_scalar_dense`` (``item``,
  ``bool``, ``int``), ``nonzero``, ``equal``, ``unique``, ``masked_select``, a boolean index
  (``x[mask]``, which runs ``nonzero``), ``repeat_interleave`` without ``output_size``,
  ``bincount``, and ``tolist`` / ``numpy`` (not operators: seen as tensor methods). On a CPU they
  cost little; counted here, they are the host waits of the same code on a GPU.
* ``uploads``: tensors made from host data (``torch.tensor(list)``, ``torch.as_tensor``): on a GPU
  a copy to the device, which waits for the stream unless pinned and ``non_blocking``.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from torchrl_grpo import _compat

__all__ = ["Launches", "count_launches"]

#: Operators (packet names) whose result the host must read before it can go on.
SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "nonzero",
        "equal",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "masked_select",
        "bincount",
        "allclose",
    }
)
#: Tensor methods that copy a tensor's values to the host (not operators).
SYNC_METHODS = frozenset({"tolist", "numpy", "__array__"})


@dataclass
class Launches:
    """The counts of one :func:`count_launches` block.

    Attributes:
        ops (int): operators dispatched.
        syncs (int): host synchronisations (reads of a device value on the host).
        uploads (int): tensors made from host data (a host-to-device copy on a GPU).
        by_op (collections.Counter): operators by name (``"aten.mm.default"``).
        by_sync (collections.Counter): synchronisations by what caused them.
    """

    ops: int = 0
    syncs: int = 0
    uploads: int = 0
    by_op: Counter = field(default_factory=Counter)
    by_sync: Counter = field(default_factory=Counter)

    def sync(self, why: str) -> None:
        """Count one host synchronisation, caused by ``why`` (an operator or method name)."""
        self.syncs += 1
        self.by_sync[why] += 1


def _is_sync(func, args, kwargs) -> bool:
    name = func._opname
    if name in SYNC_OPS:
        return True
    if name == "repeat_interleave" and func._overloadname == "Tensor":
        return (kwargs or {}).get("output_size") is None and (len(args) < 3 or args[2] is None)
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
    return False


class _Operators(_compat.TorchDispatchMode):
    def __init__(self, launches: Launches):
        super().__init__()
        self.launches = launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        launches = self.launches
        launches.ops += 1
        launches.by_op[str(func)] += 1
        if func._opname == "lift_fresh":
            launches.uploads += 1
        elif _is_sync(func, args, kwargs):
            launches.sync(func._opname)
        return func(*args, **(kwargs or {}))


class _Methods(TorchFunctionMode):
    def __init__(self, launches: Launches):
        super().__init__()
        self.launches = launches

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS:
            self.launches.sync(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def count_launches():
    """Count the operators dispatched and the host synchronisations inside the block.

    Yields:
        Launches: filled as the block runs (read it after the block).

    Examples:
        >>> import torch
        >>> from torchrl_grpo.launches import count_launches
        >>> x = torch.randn(4, requires_grad=True)
        >>> with count_launches() as launches:
        ...     loss = (x * 2).sum()
        ...     loss.backward()
        ...     positive = x[x > 0]
        ...     n = int((x > 0).sum())
        >>> launches.ops >= 6, launches.syncs
        (True, 2)
        >>> sorted(launches.by_sync)
        ['_local_scalar_dense', 'index']
    """
    launches = Launches()
    with _Operators(launches), _Methods(launches):
        yield launches
