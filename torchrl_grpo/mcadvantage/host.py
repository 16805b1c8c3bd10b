"""What the host reads of an insertion's bookkeeping: many integers, one synchronisation.

On an accelerator, every value read back on the host (``int(t)``, ``bool(t)``, ``.tolist()``,
``nonzero``, a boolean index ``x[mask]``, ``unique``, ``bincount``...) waits until the device has
caught up. So the steps of an insertion compute the sizes, counts and checks they need as
tensors, with operators whose output shape is known beforehand (``nonzero_static``,
``repeat_interleave(..., output_size=...)``, ``index_add_`` for counts), and read them together
with :func:`read_ints`. The common path of an insertion reads twice: what the input holds (its
trajectories and the checks of its values, in
:func:`~torchrl_grpo.mcadvantage.read.read_insertion`) and what completes (in
:func:`~torchrl_grpo.mcadvantage.groups.find_rounds`). A check reads only a flag; the value that
names the cause in its message is read once the check failed.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["read_ints"]


def read_ints(*values: Tensor | int | bool | None) -> list:
    """``values`` on the host, with one synchronisation for all the tensors among them.

    Args:
        values: integer or boolean tensors (plain ``torch.Tensor``), 0-d (read as an ``int``)
            or 1-d (read as a list), on one device; Python values and ``None`` pass through
            unchanged.

    Returns:
        One entry per value, in order.

    Examples:
        >>> import torch
        >>> done = torch.tensor([False, True, True])
        >>> read_ints(done.sum(), done.all(), 7, torch.tensor([3, 4]))
        [2, 0, 7, [3, 4]]
    """
    scalars = [v for v in values if type(v) is Tensor and v.ndim == 0]
    vectors = [v for v in values if type(v) is Tensor and v.ndim]
    if not vectors:
        if not scalars:
            return list(values)
        flat = [scalars[0].tolist()] if len(scalars) == 1 else torch.stack(scalars).tolist()
    else:
        flat = torch.cat([torch.stack(scalars), *vectors] if scalars else vectors).tolist()
    at, along, out = 0, len(scalars), []  # the scalars first, then the vectors
    for value in values:
        if type(value) is not Tensor:
            out.append(value)
        elif value.ndim == 0:
            out.append(flat[at])
            at += 1
        else:
            out.append(flat[along : along + value.shape[0]])
            along += value.shape[0]
    return out
