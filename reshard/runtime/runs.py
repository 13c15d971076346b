"""Boxes of stored tensors as runs of file bytes, read by the kernel straight into memory.

Loading a sharded checkpoint onto another number of ranks mostly moves whole rows: a rank's
``Shard(0)`` box of a tensor overlaps a few of the stored chunks, and each overlap is one
contiguous run of bytes both in its file and in the memory it goes to (the rank's own
tensor, or rank 0's send buffer). Such a box needs no slab buffer and no cast. Here the
stored chunks of a load are located once, in bulk (``byte_runs.locate_chunks``: one pass
over a DCP folder's records, not a parse of each record's archive), each box becomes its
runs, and runs are read file by file in file order, neighbours in one ``preadv`` (the few
bytes between them, a DCP record's zip trailer and the next one's header, into scratch):
a rank reading a thousand tensors makes a few dozen calls.

What is not such a run (another dtype, a device tensor, non-contiguous memory, a strided or
compressed chunk, a file on an object store) is left to the slab path (``transfer``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from reshard.core.boxes import Box, contiguous_range
from reshard.core.catalog import TensorEntry
from reshard.core.errors import CorruptCheckpointError
from reshard.pipeline.byte_runs import locate_chunks

__all__ = ["Run", "LocatedChunks", "RunReader", "byte_view"]

# Bytes between two runs of one file read through (into scratch) rather than skipped: a DCP
# record's trailer and the next record's header are about 1.6 KiB.
_GAP = 64 << 10
_IOV_MAX = 1024  # buffers one preadv takes (Linux's UIO_MAXIOV)
_MAX_CALL = 1 << 30  # bytes asked of one preadv (Linux reads at most ~2 GiB per call)

# (file index, offset in the file, where the bytes go)
Run = tuple[int, int, memoryview]


def byte_view(t: torch.Tensor) -> memoryview | None:
    """A contiguous CPU tensor's bytes as a writable memoryview; None for any other tensor."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return None
    # the ignore: numpy's stubs give an ndarray the buffer protocol on Python 3.12+ only
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


class LocatedChunks:
    """Where the stored chunks of ``entries`` lie in their files, located once for a load."""

    def __init__(self, entries: Iterable[TensorEntry]) -> None:
        unique = {id(e): e for e in entries}
        order = list(unique.values())
        stored = locate_chunks(order)
        self.paths: list[Path] = stored.paths
        self._file, self._start = stored.file, stored.start
        self._first: dict[int, int] = {}
        at = 0
        for e in order:
            self._first[id(e)] = at
            at += e.chunk_count
        self._columns: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def runs(self, entry: TensorEntry, into: torch.Tensor, box: Box) -> list[Run] | None:
        """The runs that fill ``into`` (``box.sizes``, the stored dtype, contiguous CPU memory)
        with ``box`` of ``entry``; None when ``into`` is not such memory, or some part of the
        box is not one run both of its stored chunk and of the box."""
        view = byte_view(into) if into.dtype == entry.dtype.torch else None
        parts = self.file_runs(entry, box) if view is not None else None
        if view is None or parts is None:
            return None
        return [(f, offset, view[at:at + n]) for f, offset, at, n in parts]

    def file_runs(self, entry: TensorEntry, box: Box) -> list[tuple[int, int, int, int]] | None:
        """(file, offset in the file, offset in the box's C-order bytes, bytes) of each part of
        ``box`` of ``entry``; None when a part is not one run both of its stored chunk and of
        the box, or the stored chunks leave part of the box uncovered."""
        first = self._first.get(id(entry))
        if first is None:
            return None
        cols = self._columns.get(id(entry))
        if cols is None:
            cols = self._columns[id(entry)] = entry.columns
        offsets, sizes = cols
        item = entry.dtype.itemsize
        lo = np.maximum(offsets, np.asarray(box.offsets, dtype=np.int64))
        hi = np.minimum(offsets + sizes, np.asarray(box.ends, dtype=np.int64))
        hits = np.flatnonzero((hi > lo).all(axis=1)) if box.ndim else np.arange(len(offsets))
        out = []
        covered = 0
        for k in hits.tolist():
            f = int(self._file[first + k])
            if f < 0:
                return None
            part = Box(tuple(lo[k].tolist()), tuple((hi[k] - lo[k]).tolist()))
            src = contiguous_range(part.shifted(tuple(offsets[k].tolist())), tuple(sizes[k].tolist()))
            dst = contiguous_range(part.shifted(box.offsets), box.sizes)
            if src is None or dst is None:
                return None
            out.append((f, int(self._start[first + k]) + src[0] * item, dst[0] * item, src[1] * item))
            covered += src[1]
        return out if covered == box.numel else None


class RunReader:
    """Reads runs of ``paths``' files, each file opened once for the load."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self._fds: dict[int, int] = {}
        self._scratch = memoryview(bytearray(_GAP))

    def read(self, runs: list[Run]) -> int:
        """Fill every run's memory; returns the bytes of the runs (gaps read through not counted)."""
        done = 0
        for f, offset, buffers, n in self._calls(runs):
            fd = self._fds.get(f)
            if fd is None:
                fd = self._fds[f] = os.open(self.paths[f], os.O_RDONLY)
            _preadv_all(fd, buffers, offset, self.paths[f])
            done += n
        return done

    def _calls(self, runs: list[Run]) -> Iterator[tuple[int, int, list[memoryview], int]]:
        """(file, offset, buffers, bytes of runs) of each ``preadv``: the runs in file order,
        neighbours within ``_GAP`` joined (the bytes between them read into scratch), up to
        ``_IOV_MAX`` buffers and about ``_MAX_CALL`` bytes a call."""
        call: list[memoryview] = []
        f0 = at = end = -1
        moved = 0
        for f, offset, dest in sorted(runs, key=lambda r: (r[0], r[1])):
            gap = offset - end
            if call and (f != f0 or gap < 0 or gap > _GAP or len(call) + 2 > _IOV_MAX or end - at > _MAX_CALL):
                yield f0, at, call, moved
                call = []
            if not call:
                f0, at, moved = f, offset, 0
            elif gap:
                call.append(self._scratch[:gap])
            call.append(dest)
            moved += dest.nbytes
            end = offset + dest.nbytes
        if call:
            yield f0, at, call, moved

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _preadv_all(fd: int, buffers: list[memoryview], offset: int, path: Path) -> None:
    """``preadv`` until every buffer is full; a file that ends first is truncated."""
    want = sum(b.nbytes for b in buffers)
    done = 0
    while True:
        n = os.preadv(fd, buffers, offset + done)
        done += n
        if done == want:
            return
        if n == 0:
            raise CorruptCheckpointError(f"{path}: file ends at byte {offset + done}, expected data up to byte "
                                         f"{offset + want} (truncated?)")
        while n and n >= buffers[0].nbytes:  # drop the buffers filled, cut the one filled in part
            n -= buffers[0].nbytes
            buffers = buffers[1:]
        if n:
            buffers = [buffers[0][n:], *buffers[1:]]
