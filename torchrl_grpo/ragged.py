"""Ragged rows padded and unpadded with a fixed number of operators, whatever their number.

torchrl's LLM stack stores one sequence per row of a lazy stack; padding them row by row
(``pad_sequence``, tensordict's ``as_padded_tensor``) dispatches a few operators per row, and on
an accelerator each is a kernel launch. Here the rows are concatenated once (one operator) and
written into, or read out of, a padded tensor through one index computed on the host from their
lengths, which are known from the shapes without reading any value. :func:`host_rows` reads
the rows' values on the host with one copy, for the decisions that need them (which rows share a
prefix), and :func:`upload` sends a host-made index to the device without waiting for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["host_rows", "kept", "padded", "padded_index", "rows_of", "upload"]


def upload(array, device: torch.device | str | None = None) -> torch.Tensor:
    """A host array (numpy, or a CPU tensor) on ``device``, without a host wait.

    On an accelerator the array is pinned and copied with ``non_blocking=True``: a copy from
    pageable memory makes the host wait for the whole stream first.

    Examples:
        >>> import numpy as np
        >>> from torchrl_grpo.ragged import upload
        >>> upload(np.arange(3))
        tensor([0, 1, 2])
    """
    tensor = (
        torch.from_numpy(np.ascontiguousarray(array)) if isinstance(array, np.ndarray) else array
    )
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def host_rows(rows: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """The values of 1-D rows on the host, read with one copy (one host wait on a device).

    Examples:
        >>> import torch
        >>> from torchrl_grpo.ragged import host_rows
        >>> [r.tolist() for r in host_rows([torch.tensor([1, 2]), torch.tensor([3])])]
        [[1, 2], [3]]
    """
    if not len(rows):
        return []
    lengths = [int(r.shape[0]) for r in rows]
    flat = torch.cat(list(rows)).detach().cpu().numpy()
    return np.split(flat, np.cumsum(lengths)[:-1])


def padded_index(lengths: Sequence[int], width: int, side: str = "left") -> np.ndarray:
    """Where each row's elements go in a ``[B, width]`` tensor flattened: ``[sum(lengths)]``.

    Examples:
        >>> from torchrl_grpo.ragged import padded_index
        >>> padded_index([2, 1], 3).tolist()  # row 0 at columns 1, 2; row 1 at column 2
        [1, 2, 5]
        >>> padded_index([2, 1], 3, side="right").tolist()
        [0, 1, 3]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}.")
    starts = np.arange(len(lengths), dtype=np.int64) * width
    if side == "left":
        starts += width - lengths
    before = np.cumsum(lengths) - lengths  # where each row starts in the concatenation
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - before, lengths)


def padded(
    rows: Sequence[torch.Tensor],
    value=0,
    side: str = "left",
    width: int | None = None,
) -> torch.Tensor:
    """Rows ``[L_i, ...]`` as one ``[B, width, ...]`` tensor padded with ``value``.

    The same result as ``pad_sequence(rows, batch_first=True, padding_side=side)`` (padded on
    to ``width`` if given), with five operators whatever the number of rows.

    Args:
        rows: tensors of the same dtype, device and trailing shape.
        value: the padding value.
        side (str): ``"left"`` or ``"right"``.
        width (int, optional): at least the longest row. Defaults to the longest row.

    Examples:
        >>> import torch
        >>> from torchrl_grpo.ragged import padded
        >>> padded([torch.tensor([1, 2]), torch.tensor([3])], value=-1)
        tensor([[ 1,  2],
                [-1,  3]])
    """
    if not len(rows):
        return torch.empty(0, width or 0)
    lengths = [int(r.shape[0]) for r in rows]
    width = max(lengths) if width is None else int(width)
    if width < max(lengths):
        raise ValueError(f"width {width} is shorter than the longest row ({max(lengths)}).")
    first = rows[0]
    if all(n == width for n in lengths):
        return torch.stack(list(rows))
    flat = torch.cat(list(rows))  # (N, ...)
    out = flat.new_full((len(rows) * width, *first.shape[1:]), value)
    index = upload(padded_index(lengths, width, side), flat.device)
    out.index_put_((index,), flat)
    return out.view(len(rows), width, *first.shape[1:])


def rows_of(x: torch.Tensor, lengths: Sequence[int], side: str = "left") -> list[torch.Tensor]:
    """The rows of a padded ``[B, W, ...]`` tensor, ``lengths[i]`` elements each, as a list.

    The inverse of :func:`padded`, with three operators whatever the number of rows.

    Examples:
        >>> import torch
        >>> from torchrl_grpo.ragged import rows_of
        >>> rows_of(torch.tensor([[1, 2], [-1, 3]]), [2, 1])
        [tensor([1, 2]), tensor([3])]
    """
    lengths = [int(n) for n in lengths]
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    index = upload(padded_index(lengths, x.shape[1], side), x.device)
    return list(flat[index].split(lengths))


def kept(rows: Sequence[torch.Tensor], keep: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """Each row's elements where its host mask ``keep[i]`` (``[L_i]`` bool) is set, as a list:
    ``[row[k] for row, k in zip(rows, keep)]`` with four operators and no host read.

    Examples:
        >>> import numpy as np, torch
        >>> from torchrl_grpo.ragged import kept
        >>> kept([torch.tensor([1, 2, 3]), torch.tensor([4])], [np.array([1, 0, 1]), np.array([0])])
        [tensor([1, 3]), tensor([], dtype=torch.int64)]
    """
    if not len(rows):
        return []
    flat = torch.cat(list(rows))
    index = upload(
        np.flatnonzero(np.concatenate([np.asarray(k, dtype=bool) for k in keep])), flat.device
    )
    return list(flat[index].split([int(np.count_nonzero(k)) for k in keep]))
