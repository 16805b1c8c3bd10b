"""Grouped reductions behind :mod:`torchrl_grpo.advantages`: sums, maxima, scans by segment.

A *segment* is a trajectory or a group. Samples are mapped to segments either by one index per
sample or as contiguous runs (see :class:`Segments`); every reduction is one pass over the samples,
never a Python loop over segments. Private: the public math lives in ``torchrl_grpo.advantages``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "Segments",
    "dense_codes",
    "dense_codes_and_order",
    "discounted_suffix_sum",
    "group_codes",
    "lexicographic_codes",
]


def _num_segments(index: Tensor, num: int | None) -> int:
    if num is not None:
        return int(num)
    return int(index.max()) + 1 if index.numel() else 0


class Segments:
    r"""Which segment (trajectory or group) each sample belongs to, and the reductions over them.

    Two descriptions of the same mapping:

    * one index per sample: ``index`` of shape ``(S,)``, values in ``[0, num)``;
    * contiguous *runs* of samples (the reward elements of one trajectory, say): ``lengths`` of
      shape ``(R,)`` samples per run, and ``index`` of shape ``(R,)`` the segment of each run
      (``None``: run ``i`` is segment ``i``).

    Both give the same numbers. With runs, no per-sample index exists: per-sample work goes
    through segment reductions and ``repeat_interleave`` (or plain views when every run has the
    same length), which on a CPU is several times cheaper than a scatter or gather by index over
    every sample; group-level work is done once per run.

    Args:
        index: segment of each sample, or of each run when ``lengths`` is given; ``None`` with
            ``lengths`` means one segment per run.
        num: number of segments; defaults to ``index.max() + 1`` (or the number of runs).
        lengths: samples per run, shape ``(R,)``, or ``None``.
        width: with ``lengths``, the length every run has, or ``0`` if they differ, when the
            caller knows it (it is found from ``lengths`` otherwise).
        total: with ``lengths``, the number of samples (their sum), when the caller knows it:
            spreading per-run values over the samples then reads nothing back on the host.

    Examples:
        >>> import torch
        >>> x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
        >>> by_sample = Segments(torch.tensor([0, 0, 1, 1, 1]))
        >>> by_run = Segments(None, lengths=torch.tensor([2, 3]))
        >>> by_sample.sum(x), by_run.sum(x)
        (tensor([ 3., 12.]), tensor([ 3., 12.]))
        >>> by_run.expand(torch.tensor([10.0, 20.0]))
        tensor([10., 10., 20., 20., 20.])
    """

    def __init__(
        self,
        index: Tensor | None,
        num: int | None = None,
        lengths: Tensor | None = None,
        *,
        width: int | None = None,
        total: int | None = None,
    ):
        if lengths is None and index is None:
            raise ValueError("Segments needs an index, or run lengths.")
        self.lengths = lengths
        self.index = index
        self.total = total  # samples, when known (else read from lengths when needed)
        self.width = 0  # runs of one common length > 0, viewed as (R, width); 0: not so
        self.known_width = width  # as given (None: not known), whatever the segments
        if lengths is None:
            self.num = _num_segments(index, num)
        else:
            runs = lengths.numel()
            self.num = runs if index is None and num is None else _num_segments(index, num)
        # One segment (a lone group, say): plain reductions, no index or runs needed at all.
        self.single = self.num == 1
        if lengths is None or self.single:
            return
        # Every run of the same length: runs are the rows of a (R, L) view.
        if width is not None:
            self.width = width
        elif runs:
            shortest, longest = (int(v) for v in torch.aminmax(lengths))
            self.width = shortest if shortest == longest else 0
        self.known_width = self.width

    @property
    def count(self) -> Tensor:
        """Samples per segment, ``(num,)`` int64."""
        if self.single:
            if self.lengths is None:
                return torch.full((1,), self.index.numel(), device=self.index.device)
            return self.lengths.sum().reshape(1)
        if self.lengths is None:  # an index_add, not bincount: no size read back on the host
            ones = torch.ones_like(self.index)
            return torch.zeros(self.num, dtype=torch.long, device=ones.device).index_add_(
                0, self.index, ones
            )
        if self.index is None:
            return self.lengths.clone()  # not the caller's tensor
        zeros = torch.zeros(self.num, dtype=torch.long, device=self.index.device)
        return zeros.index_add_(0, self.index, self.lengths)

    def _runs_to_segments(self, per_run: Tensor, init: Tensor, reduce: str = "sum") -> Tensor:
        if self.index is None:
            return per_run
        if reduce == "sum":
            return init.index_add_(0, self.index, per_run)
        return init.scatter_reduce(0, self.index, per_run, reduce=reduce, include_self=True)

    def view(self, x: Tensor) -> Tensor:
        """The samples as a ``(R, L)`` view when every run has length ``L``, else as they are.

        The methods below take either form, and :meth:`spread` values broadcast against it.
        """
        return x.view(-1, self.width) if self.width else x

    def spread(self, values: Tensor) -> Tensor:
        """Per-segment ``values`` made to broadcast against :meth:`view` of the samples."""
        if self.single:
            return values  # (1,)
        if self.width:
            return self._at_runs(values).unsqueeze(1)  # (R, 1)
        return self.expand(values)

    def _at_runs(self, values: Tensor) -> Tensor:
        """Per-segment values at each run, ``(R,)``."""
        return values if self.index is None else values.index_select(0, self.index)

    def _per_run(self, x: Tensor, reduce: str) -> Tensor:
        if self.width:
            rows = x.view(-1, self.width)  # (R, L)
            if reduce == "sum" and self.width < 16 and x.is_floating_point():  # faster as mat-vec
                return rows @ torch.ones(self.width, dtype=x.dtype, device=x.device)
            return rows.sum(1) if reduce == "sum" else rows.amax(1)
        x = x.reshape(-1)
        if x.numel() == 0:
            return x.new_zeros(self.lengths.shape)
        return torch.segment_reduce(x, reduce, lengths=self.lengths)

    def sum(self, x: Tensor) -> Tensor:
        """Per-segment sum of the samples ``x`` (``(S,)`` or its :meth:`view`), ``(num,)``."""
        if self.single:
            return x.sum().reshape(1)
        zeros = torch.zeros(self.num, dtype=x.dtype, device=x.device)
        if self.lengths is None:
            return zeros.scatter_add_(0, self.index, x)
        return self._runs_to_segments(self._per_run(x, "sum"), zeros)

    def amax(self, x: Tensor) -> Tensor:
        """Per-segment maximum, ``(num,)`` (``-inf`` for an empty segment)."""
        init = torch.full((self.num,), float("-inf"), dtype=x.dtype, device=x.device)
        if self.single:
            return x.amax().reshape(1) if x.numel() else init
        if self.lengths is None:
            return init.scatter_reduce(0, self.index, x, reduce="amax", include_self=True)
        return self._runs_to_segments(self._per_run(x, "max"), init, "amax")

    def last(self, x: Tensor) -> Tensor:
        """Each segment's last sample in the order of ``x``, ``(num,)``."""
        if self.single:
            return x.reshape(-1)[-1:]
        if self.lengths is None:
            position = torch.arange(x.numel(), device=x.device)
            last = torch.zeros(self.num, dtype=torch.long, device=x.device)
            last = last.scatter_reduce(0, self.index, position, reduce="amax", include_self=False)
            return x[last]
        x = x.reshape(-1)
        ends = torch.cumsum(self.lengths, 0) - 1  # (R,) last sample of each run
        if self.index is None:
            return x[ends]
        last = torch.zeros(self.num, dtype=torch.long, device=x.device)
        return x[last.scatter_reduce(0, self.index, ends, reduce="amax", include_self=False)]

    def member(self, x: Tensor) -> Tensor:
        """One sample of each segment, ``(num,)``: its maximum, or with runs the largest first
        sample of its runs (no pass over every sample)."""
        if self.single and x.numel():
            return x.reshape(-1)[:1]
        if self.lengths is None or self.single:
            return self.amax(x)
        if self.width:
            firsts = x.view(-1, self.width)[:, 0]  # (R,)
        else:
            firsts = x.reshape(-1)[torch.cumsum(self.lengths, 0) - self.lengths]  # (R,)
        init = torch.full((self.num,), float("-inf"), dtype=x.dtype, device=x.device)
        return self._runs_to_segments(firsts, init, "amax")

    def expand(self, values: Tensor) -> Tensor:
        """Per-segment ``values`` (``(num,)``) repeated for every sample, shape ``(S,)``."""
        if self.single:
            if self.lengths is None:
                return values.repeat(self.index.numel())
            return values.repeat(self.total if self.total is not None else int(self.lengths.sum()))
        if self.lengths is None:
            return values.index_select(0, self.index)
        per_run = self._at_runs(values)  # (R,)
        if self.width:
            return per_run.unsqueeze(1).expand(-1, self.width).reshape(-1)
        return per_run.repeat_interleave(self.lengths, output_size=self.total)


def discounted_suffix_sum(
    x: Tensor, lengths: Tensor, gamma: float, *, width: int = 0, longest: int | None = None
) -> Tensor:
    r"""Within each run, :math:`y_t = \sum_{k \ge t} \gamma^{k - t} x_k` (its samples in order).

    Two vectorized forms, the same numbers up to rounding, neither a Python loop over samples:

    * runs laid out as the rows of a ``(R, L)`` table (directly when every run has length ``L``,
      zero-padded when the table is at most four times the samples): :math:`y_t = \gamma^{-t}
      \sum_{k \ge t} \gamma^k x_k`, one reversed ``cumsum`` along the rows. Used while
      :math:`\gamma^{L-1} \ge 10^{-100}`, so that neither factor leaves float64's range;
    * otherwise a scan by doubling (Hillis and Steele, 1986): after the pass of stride ``s``,
      ``y_t`` holds the discounted sum of the ``2 s`` samples from ``t`` on (cut at the end of
      its run), so ``ceil(log2(longest run))`` passes cover every run, with weights
      :math:`\gamma^s \le 1` only.

    Args:
        x: samples, shape ``(S,)``, runs one after the other.
        lengths: samples per run, shape ``(R,)``, summing to ``S``.
        gamma: the discount, in ``[0, 1]``.
        width: the length every run has when they all have one (``0``: they differ, or unknown).
        longest: the longest run's length, when the caller read it (else read here).

    Returns:
        ``y``, shape ``(S,)``, in the dtype of ``x``.

    Examples:
        >>> import torch
        >>> discounted_suffix_sum(torch.tensor([1.0, 1.0, 1.0, 2.0]), torch.tensor([3, 1]), 0.5)
        tensor([1.7500, 1.5000, 1.0000, 2.0000])
    """
    if x.numel() == 0 or gamma == 0.0:
        return x.clone()
    longest = width or (int(lengths.max()) if longest is None else longest)
    if gamma ** (longest - 1) >= 1e-100 and (width or lengths.numel() * longest <= 4 * x.numel()):
        if width:
            return _scaled_suffix_sum(x.reshape(-1, width), gamma).reshape(-1)
        starts = torch.cumsum(lengths, 0) - lengths  # (R,)
        run = torch.arange(lengths.numel(), device=x.device)
        run = run.repeat_interleave(lengths, output_size=x.numel())  # (S,)
        slot = run * longest + torch.arange(x.numel(), device=x.device) - starts[run]  # (S,)
        table = x.new_zeros(lengths.numel() * longest)
        table[slot] = x  # (R * L,) zero-padded rows
        return _scaled_suffix_sum(table.view(-1, longest), gamma).reshape(-1)[slot]
    if width:
        rows = x.reshape(-1, width)  # (R, L)
        s = 1
        while s < longest:
            rows = torch.cat([rows[:, :-s] + gamma**s * rows[:, s:], rows[:, -s:]], dim=1)
            s *= 2
        return rows.reshape(-1)
    ends = torch.cumsum(lengths, 0) - 1  # (R,) last sample of each run
    ahead = ends.repeat_interleave(lengths, output_size=x.numel())
    ahead = ahead - torch.arange(x.numel(), device=x.device)  # (S,)
    y = x.reshape(-1)
    s = 1
    while s < longest:
        shifted = torch.zeros_like(y)
        shifted[:-s] = y[s:]  # y[t + s], from another run where ahead[t] < s: masked next
        y = y + gamma**s * shifted.masked_fill_(ahead < s, 0)
        s *= 2
    return y


def _scaled_suffix_sum(rows: Tensor, gamma: float) -> Tensor:
    """``(R, L)`` rows: ``gamma^-t * reversed cumsum(gamma^k x_k)`` along each row."""
    scale = gamma ** torch.arange(rows.shape[1], dtype=rows.dtype, device=rows.device)  # (L,)
    return (rows * scale).flip(1).cumsum(1).flip(1).div_(scale)


def dense_codes(keys: Tensor, *, span: int | None = None) -> tuple[Tensor, int]:
    """A code in ``[0, num)`` per key, equal iff the keys are, numbered in increasing key order.

    Integer keys within a compact range (ids, seeds, small states: at most ``4 n + 1024`` apart)
    are coded through a table of the range, with no sort; others through one sort.

    Args:
        keys: keys, shape ``(n,)``.
        span: when the caller knows that every key lies in ``[0, span)``, a compact range: the
            table is used without looking for the range.

    Returns:
        ``(codes, num)``: int64 codes, shape ``(n,)``, and the number of distinct keys.

    Examples:
        >>> import torch
        >>> dense_codes(torch.tensor([7, 3, 7, 10]))
        (tensor([1, 0, 1, 2]), 3)
    """
    codes, num, _ = dense_codes_and_order(keys, span=span)
    return codes, num


def dense_codes_and_order(
    keys: Tensor, *, span: int | None = None
) -> tuple[Tensor, int, Tensor | None]:
    """:func:`dense_codes`, and the stable order of the keys by code when the codes came from a
    sort (``None`` from the table): keys grouped by code, in their order within a code.

    Examples:
        >>> import torch
        >>> dense_codes_and_order(torch.tensor([0.5, -1.0, 0.5]))
        (tensor([1, 0, 1]), 2, tensor([1, 0, 2]))
    """
    if keys.numel() == 0:
        return keys.long(), 0, None
    codes, numbers, order = _coded(keys, None if span is None else (0, span - 1))
    return codes, int(numbers[-1]) + 1, order


def group_codes(
    keys: Tensor, *, bounds: tuple[int, int] | None = None
) -> tuple[Tensor, Tensor | None]:
    """:func:`dense_codes_and_order` without the number of codes, so that nothing is read back
    on the host.

    Args:
        keys: keys, shape ``(n,)``.
        bounds: ``(low, high)`` when the caller knows that every (integer) key lies in it: a
            compact range is coded through its table without reading the range back.

    Returns:
        ``(codes, order)`` as in :func:`dense_codes_and_order`.

    Examples:
        >>> import torch
        >>> group_codes(torch.tensor([7, 3, 7]), bounds=(0, 9))
        (tensor([1, 0, 1]), None)
    """
    if keys.numel() == 0:
        return keys.long(), None
    codes, _, order = _coded(keys, bounds)
    return codes, order


def _coded(keys: Tensor, bounds) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(codes, numbers, order)``: ``numbers[-1] + 1`` is the number of codes."""
    integers = not (keys.is_floating_point() or keys.is_complex() or keys.dtype == torch.bool)
    if integers:
        low, high = bounds if bounds is not None else (int(v) for v in torch.aminmax(keys))
        if high - low <= 4 * keys.numel() + 1024:  # a table of the range: no sort
            shifted = (keys - low).long() if low else keys.long()
            present = torch.zeros(high - low + 1, dtype=torch.bool, device=keys.device)
            present.index_fill_(0, shifted, True)
            table = torch.cumsum(present, 0) - 1
            return table.index_select(0, shifted), table, None
    sorted_keys, order = torch.sort(keys, stable=True)
    starts = torch.ones_like(sorted_keys, dtype=torch.bool)
    torch.ne(sorted_keys[1:], sorted_keys[:-1], out=starts[1:])
    numbers = torch.cumsum(starts, 0) - 1
    codes = torch.empty_like(order)
    codes[order] = numbers
    return codes, numbers, order


def lexicographic_codes(rows: Tensor) -> Tensor:
    """A code per row of ``rows`` ``(n, k)``, equal iff the rows are, numbered in increasing
    lexicographic order (``torch.unique(rows, dim=0, return_inverse=True)``'s numbering), by one
    stable sort per column instead of ``unique``, which reads its size back on the host.

    Returns:
        int64 codes ``(n,)``.

    Examples:
        >>> import torch
        >>> lexicographic_codes(torch.tensor([[1, 5], [0, 9], [1, 5], [1, 2]]))
        tensor([2, 0, 2, 1])
    """
    n = rows.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=rows.device)
    order = torch.arange(n, device=rows.device)
    for column in reversed(range(rows.shape[1])):  # the last column first: a radix sort
        order = order.index_select(0, torch.sort(rows[order, column], stable=True)[1])
    ordered = rows.index_select(0, order)
    starts = torch.ones(n, dtype=torch.bool, device=rows.device)
    starts[1:] = (ordered[1:] != ordered[:-1]).any(1)
    numbers = torch.cumsum(starts, 0) - 1
    codes = torch.empty_like(order)
    codes[order] = numbers
    return codes
