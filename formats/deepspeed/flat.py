"""Flattened tensors: a run of elements of a tensor's C-order flattening, stored somewhere.

DeepSpeed ZeRO keeps every rank's part of the model as one long 1-D buffer: parameters are
flattened, concatenated and cut into equal partitions, so a rank holds, say, the last 32
elements of one matrix and the first 4064 of the next. A run of a tensor's flat elements is
not a box, but it is at most ``2 * ndim - 1`` boxes: a partial row, full rows, a partial row
(recursively inside the partial rows), each one contiguous in the flat order and therefore in
the file. ``flat_boxes`` makes that cut; ``FlatBuffer`` finds where a run of a rank's buffer
lies in its file(s); ``fragment_chunks`` turns a fragment into catalog chunks whose data are
plain ``StoredRegion``s, which the engine streams (or kernel-copies) like any other chunk.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from reshard.core.boxes import Box
from reshard.core.catalog import Chunk
from reshard.core.errors import CorruptCheckpointError
from reshard.core.regions import StoredRegion

__all__ = ["flat_boxes", "FlatBuffer", "fragment_chunks"]


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> Iterator[tuple[Box, int]]:
    """The boxes that make up flat elements ``[start, stop)`` of a C-order tensor of ``shape``,
    in flat order, each with the flat index of its first element."""
    shape = tuple(shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of shape {shape}")
    if start == stop:
        return
    if not shape:
        yield Box((), ()), 0
        return
    inner = math.prod(shape[1:])
    if len(shape) == 1 or inner == 0:
        yield Box((start,) + (0,) * (len(shape) - 1), (stop - start,) + shape[1:]), start
        return
    row, col = divmod(start, inner)
    last_row, last_col = divmod(stop, inner)
    if row == last_row:  # inside one row
        for sub, at in flat_boxes(shape[1:], col, last_col):
            yield Box((row,) + sub.offsets, (1,) + sub.sizes), row * inner + at
        return
    if col:  # the end of a partial first row
        for sub, at in flat_boxes(shape[1:], col, inner):
            yield Box((row,) + sub.offsets, (1,) + sub.sizes), row * inner + at
        row += 1
    if last_row > row:  # whole rows
        yield Box((row,) + (0,) * (len(shape) - 1), (last_row - row,) + shape[1:]), row * inner
    if last_col:  # the start of a partial last row
        for sub, at in flat_boxes(shape[1:], 0, last_col):
            yield Box((last_row,) + sub.offsets, (1,) + sub.sizes), last_row * inner + at


@dataclass(frozen=True)
class FlatBuffer:
    """One rank's flat buffer: the concatenation of ``parts`` (1-D stored tensors, e.g. the
    fp32 partition of each ZeRO param group), named ``where`` in errors."""

    parts: tuple[StoredRegion, ...]
    where: str

    @property
    def numel(self) -> int:
        return sum(p.shape[0] for p in self.parts)

    def locate(self, start: int, count: int) -> Iterator[tuple[StoredRegion, int, int, int]]:
        """(part, element offset in part, element count, offset into the run) for the run
        ``[start, start + count)`` of the buffer, cut where one part ends and the next begins."""
        if start < 0 or start + count > self.numel:
            raise CorruptCheckpointError(
                f"{self.where}: needs elements [{start}, {start + count}) of a partition that holds {self.numel} "
                "(truncated, or from another run?)")
        base, done = 0, 0
        for part in self.parts:
            n = part.shape[0]
            lo, hi = max(start + done, base), min(start + count, base + n)
            if lo < hi:
                yield part, lo - base, hi - lo, done
                done += hi - lo
            base += n
            if done == count:
                return


def fragment_chunks(shape: tuple[int, ...], begin: int, end: int, buffer: FlatBuffer, at: int) -> list[Chunk]:
    """Chunks for flat elements ``[begin, end)`` of a tensor of ``shape`` stored from element
    ``at`` of ``buffer``: one chunk per box, each a contiguous run of the buffer's file."""
    out = []
    for part, offset, count, into in buffer.locate(at, end - begin):
        item = part.dtype.itemsize
        lo = begin + into
        for box, flat in flat_boxes(shape, lo, lo + count):
            byte = part.offset + (offset + flat - lo) * item
            out.append(Chunk(box, StoredRegion(part.path, byte, part.dtype, box.sizes)))
    return out
