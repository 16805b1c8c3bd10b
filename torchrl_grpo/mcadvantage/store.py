"""The chunked store of held steps, shared by the pending groups and the unfinished tails.

What an insertion leaves held is kept as a *chunk*: the insertion's own steps as they came (the
pending groups), or one copy of its unfinished pieces (the tails); holding a trajectory back
copies nothing more. A trajectory (or a piece of one) is a *span* ``(chunk, offset, length)``:
steps ``offset : offset + length`` of chunk ``chunk``. Span tables are ``(m, c)`` int64 tensors
whose first three columns are :data:`CHUNK`, :data:`OFFSET` and :data:`LENGTH`; their owners add
columns of their own after them.

A :class:`Chunks` value is never changed in place: adding or releasing a chunk makes a new one,
so a state that held it stays valid (a rejected insertion changes nothing).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from torchrl_grpo.mcadvantage.host import read_ints
from torchrl_grpo.mcadvantage.steps import Steps

__all__ = ["CHUNK", "LENGTH", "LENIENT", "OFFSET", "REBUILD_ABOVE", "Chunks", "ranges"]

CHUNK, OFFSET, LENGTH = range(3)
#: Spans gathered one view each (a slice) when they are at most this many, each from its own
#: chunk; above, one take per chunk.
_FEW_SPANS = 32
#: Released chunks are dropped from the numbering once empty slots exceed twice the live ones
#: plus this many.
_SLACK_SLOTS = 64
#: :meth:`Chunks.take` concatenates the chunks involved whole, then indexes once, when they hold
#: at most this many times the steps taken plus ``_WHOLE_SLACK``: on a CPU each operation on a
#: TensorDict costs more than copying several thousand small steps.
_WHOLE_FACTOR, _WHOLE_SLACK = 8, 8192
#: Held chunks are rebuilt from their live steps (one copy) once they hold more than
#: ``factor * live + slack`` steps, so that a long-lived span does not keep large chunks alive:
#: copying costs at most ``1 / factor`` step per step released. The default suits pending
#: groups; the tails, whose chunks are already copies, use :data:`LENIENT`.
REBUILD_ABOVE = (2, 1024)
LENIENT = (4, 16384)


def ranges(starts: Tensor, lengths: Tensor, total: int | None = None) -> Tensor:
    """Concatenate ``arange(s, s + l)`` for each pair, without a Python loop; ``total``, the sum
    of ``lengths`` when the caller knows it (else it is read on the host).

    Examples:
        >>> import torch
        >>> ranges(torch.tensor([5, 0]), torch.tensor([2, 3]))
        tensor([5, 6, 0, 1, 2])
    """
    total = int(lengths.sum()) if total is None else total
    offsets = torch.cumsum(lengths, 0) - lengths  # (n,)
    shift = torch.repeat_interleave(offsets - starts, lengths, output_size=total)
    return torch.arange(total) - shift


class Chunks(NamedTuple):
    """Held chunks of steps, addressed by span.

    ``steps[c]`` is chunk ``c`` (``None`` once no span holds it) and ``sizes[c]`` its number of
    steps (``0`` once released); ``held`` is the sum of ``sizes``.
    """

    steps: tuple = ()
    sizes: tuple = ()
    held: int = 0

    def add(self, steps: Steps) -> Chunks:
        """These chunks and ``steps`` as chunk number ``len(self.steps)``."""
        size = len(steps)
        return Chunks((*self.steps, steps), (*self.sizes, size), self.held + size)

    def gather(self, spans: Tensor) -> Steps:
        """The steps of ``spans``, one span after the other (any order of chunks).

        One view (a slice) per span when there are a few, each from its own chunk; otherwise
        :meth:`take`. A span that is a whole chunk is that chunk, not a copy; so is a lone
        span's slice.
        """
        windows = self._windows(spans)
        if windows is not None:
            return Steps.cat(windows)
        lengths = spans[:, LENGTH]
        chunk = torch.repeat_interleave(spans[:, CHUNK], lengths)  # (K,) in output order
        return self.take(chunk, ranges(spans[:, OFFSET], lengths))

    def parts(self, spans: Tensor, taken: list | None = None) -> list[Steps]:
        """The steps of ``spans``, given in increasing ``(chunk, offset)`` order, as parts to
        concatenate: one view per span when there are a few, each from its own chunk; else one
        take (a view for a contiguous run) per chunk. ``taken``: the steps of ``spans`` in each
        chunk, when read with them: then one take per chunk (a whole chunk as it is), reading
        nothing more."""
        if taken is not None:
            return self._parts_known(spans, taken)
        windows = self._windows(spans)
        if windows is not None:
            return windows
        lengths = spans[:, LENGTH]
        chunk = torch.repeat_interleave(spans[:, CHUNK], lengths)  # (K,)
        position = ranges(spans[:, OFFSET], lengths)
        numbers, counts = torch.unique_consecutive(chunk, return_counts=True)
        return [
            self.steps[c].take_sorted(pos)
            for c, pos in zip(numbers.tolist(), position.split(counts.tolist()))
        ]

    def _parts_known(self, spans: Tensor, taken: list) -> list[Steps]:
        used = [(c, k) for c, k in enumerate(taken) if k]
        lengths = spans[:, LENGTH]
        position = ranges(spans[:, OFFSET], lengths, sum(k for _, k in used))  # in chunk order
        pieces = position.split([k for _, k in used])
        return [
            self.steps[c] if k == self.sizes[c] else self.steps[c].take(piece)
            for (c, k), piece in zip(used, pieces)
        ]

    def _windows(self, spans: Tensor) -> list[Steps] | None:
        """One view per span when they are a few, each from its own chunk; else ``None``."""
        if spans.shape[0] > _FEW_SPANS:
            return None
        rows = spans[:, :3].tolist()
        if len({row[CHUNK] for row in rows}) != len(rows):
            return None
        return [self._window(*row) for row in rows]

    def take(self, chunk: Tensor, position: Tensor) -> Steps:
        """Steps ``(chunk[i], position[i])``, in that order.

        When the chunks involved hold few more steps than are taken, they are concatenated
        whole and indexed once (two operations on the TensorDicts, whatever their number);
        otherwise each is taken from (a view where its positions are a contiguous increasing
        run), and the parts are put in order with one more indexing unless they come chunk
        after chunk.
        """
        used, local = torch.unique(chunk, return_inverse=True)  # (u,), (K,)
        numbers = used.tolist()
        held = sum(self.sizes[c] for c in numbers)
        if len(numbers) > 1 and held <= _WHOLE_FACTOR * chunk.numel() + _WHOLE_SLACK:
            whole, starts = self.concatenated(numbers)
            return whole.take(starts[local] + position)
        grouped = bool((chunk[1:] >= chunk[:-1]).all())
        if not grouped:
            by_chunk = torch.argsort(chunk, stable=True)
            chunk, position = chunk[by_chunk], position[by_chunk]
        ascending = bool(((chunk[1:] > chunk[:-1]) | (position[1:] > position[:-1])).all())
        counts = torch.bincount(local, minlength=len(numbers)).tolist()
        parts = [
            self.steps[c].take_sorted(pos) if ascending else self.steps[c].take(pos)
            for c, pos in zip(numbers, position.split(counts))
        ]
        steps = Steps.cat(parts)
        return steps if grouped else steps.take(torch.argsort(by_chunk))

    def concatenated(self, numbers: list[int]) -> tuple[Steps, Tensor]:
        """Chunks ``numbers``, one after the other (one concatenation), and ``(u,)`` where each
        starts in it."""
        sizes = [self.sizes[c] for c in numbers]
        starts = torch.tensor([0, *sizes[:-1]]).cumsum(0)
        return Steps.cat([self.steps[c] for c in numbers]), starts

    def _window(self, c: int, offset: int, length: int) -> Steps:
        chunk = self.steps[c]
        return chunk if length == self.sizes[c] else chunk.window(offset, offset + length)

    def tidy(
        self,
        spans: Tensor,
        dropped: Tensor | None = None,
        rebuild_above=REBUILD_ABOVE,
        *,
        emptied: list[int] | None = None,
        live: int | None = None,
    ) -> tuple[Chunks, Tensor]:
        """Release the chunks that no span of ``spans`` holds any more; rebuild the live steps
        into one chunk once released steps inside held chunks outnumber them, or drop the empty
        slots from the numbering once they outnumber the live chunks.

        Args:
            spans: every span still held.
            dropped: the chunk numbers of the spans just given up, the only chunks that can have
                lost their last span (``None``: look at every chunk).
            rebuild_above: ``(factor, slack)``: rebuild once the held chunks hold more than
                ``factor * live + slack`` steps.
            emptied: the chunks no span holds any more, when the caller read them (``dropped``
                is then not looked at).
            live: the steps of ``spans``, when the caller read them.

        Returns:
            The chunks, and ``spans`` with their chunk numbers (and offsets, when rebuilt)
            updated; other columns are kept.
        """
        if not spans.shape[0]:
            return Chunks(), spans
        chunks, (factor, slack) = self, rebuild_above
        if emptied is None and (dropped is None or dropped.numel()):
            emptied = self._emptied(spans, dropped)
        gone = {c for c in emptied or () if self.sizes[c]}
        if gone:
            steps, sizes = list(self.steps), list(self.sizes)
            for c in gone:
                steps[c], sizes[c] = None, 0
            chunks = Chunks(tuple(steps), tuple(sizes), sum(sizes))
        if chunks.held > slack:
            live = int(spans[:, LENGTH].sum()) if live is None else live
            if chunks.held > factor * live + slack:
                return chunks._rebuilt(spans)
        slots = len(chunks.sizes)
        if slots > 2 * (slots - chunks.sizes.count(0)) + _SLACK_SLOTS:
            held = torch.tensor([size > 0 for size in chunks.sizes])  # (C,)
            renumber = torch.cumsum(held, 0) - 1  # (C,) new number of each live chunk
            spans = spans.clone()
            spans[:, CHUNK] = renumber[spans[:, CHUNK]]
            kept = [c for c in chunks.steps if c is not None]
            return Chunks(tuple(kept), tuple(len(c) for c in kept), chunks.held), spans
        return chunks, spans

    def _emptied(self, spans: Tensor, dropped: Tensor | None) -> list[int]:
        """The chunks among ``dropped`` (all for ``None``) that no span of ``spans`` holds."""
        chunk = spans[:, CHUNK]
        counts = torch.zeros(len(self.steps), dtype=torch.long).index_add_(
            0, chunk, torch.ones_like(chunk)
        )  # (C,)
        candidates = torch.arange(len(self.steps)) if dropped is None else dropped
        numbers, empty = read_ints(candidates, counts.index_select(0, candidates) == 0)
        return [c for c, e in zip(numbers, empty) if e]

    def _rebuilt(self, spans: Tensor) -> tuple[Chunks, Tensor]:
        """One chunk of the steps of ``spans``, in span order (a copy)."""
        steps = self.gather(spans)
        spans = spans.clone()
        lengths = spans[:, LENGTH]
        spans[:, CHUNK] = 0
        spans[:, OFFSET] = torch.cumsum(lengths, 0) - lengths
        return Chunks((steps,), (len(steps),), len(steps)), spans
