"""Locating the tensor bytes of many DCP chunk records at once.

Each chunk is its own torch.save archive, and where its elements start inside the archive is
known only by reading the archive's zip headers and pickle: one record at a time that is two
reads and a few hundred microseconds, a minute for the 400k chunks of a fine-grained MoE.
But torch writes every chunk of one dtype and shape the same way: the archives differ only
in their payload, their CRC-32 fields and a per-save serialization id. So one archive of each
kind is read as any other (``_LazyChunk``: checked against ``.metadata``), and every other
record of that kind is compared with it byte for byte outside those spans, reading the
records in large sequential blocks; each record equal to its pattern has its elements at the
pattern's offset. Only the bytes that must be equal are read: of a large record (a tensor
of megabytes), its zip headers and pickle before the payload and its trailer after it, which
for records laid end to end in a file are one read (one record's trailer, the next one's
head). A record that differs or is compressed is left to the one-at-a-time path, which reads
(and refuses) it as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from reshard.formats.dcp.metadata import ChunkTable
from reshard.formats.torch.zip import varying_spans

from reshard.core.catalog import StoredChunks
from reshard.core.columns import ranges, unique_rows
from reshard.core.errors import ReshardError
from reshard.core.regions import StoredRegion, read_exact, read_into
from reshard.core.storage import RemotePath, close, open_read

__all__ = ["TensorRecords", "RecordLocator"]

_BLOCK = 4 << 20  # bytes of a data file read at once (about) when comparing records
_GAP = 4 << 10  # varying bytes up to this long between fixed ones are read with them, longer ones skipped
_MISSES = 3  # patterns in a row that match no other record before the rest of a kind is left alone


class TensorRecords:
    """One tensor's records: rows ``rows`` of its ``ChunkTable`` (None: every row; empty
    shards are left out) and, once located, each row's element offset (``located``, -1
    before: the lazy chunks read and fill the same column)."""

    __slots__ = ("name", "table", "rows", "dtype", "located")

    def __init__(self, name: str, table: ChunkTable, rows: np.ndarray | None, dtype: object) -> None:
        self.name, self.table, self.rows, self.dtype = name, table, rows, dtype
        self.located: np.ndarray | None = None

    def located_column(self) -> np.ndarray:
        if self.located is None:
            self.located = np.full(len(self.table), -1, dtype=np.int64)
        return self.located

    def row_numbers(self) -> np.ndarray:
        return np.arange(len(self.table)) if self.rows is None else self.rows


@dataclass
class _Records:
    """Every record asked for, as columns (one row per chunk, in the order asked)."""

    owner: np.ndarray  # which TensorRecords
    row: np.ndarray  # its row in that tensor's table
    file: np.ndarray
    start: np.ndarray
    length: np.ndarray
    kind: np.ndarray  # records of one kind (dtype, shape, length) share a pattern


class RecordLocator:
    """``ChunkLocator`` for one DCP folder's lazily read tensors. ``region(records, row)``
    locates one record on its own (reading it as ``_LazyChunk`` does): the pattern of its kind."""

    def __init__(self, file_paths: list[Path], region: Callable[[TensorRecords, int], StoredRegion | None]) -> None:
        self.file_paths, self._region = file_paths, region

    def locate(self, records: list[TensorRecords]) -> StoredChunks:
        cols = _columns(records)
        bounds = np.r_[0, np.cumsum(np.bincount(cols.owner, minlength=len(records)))].tolist()
        start = np.full(len(cols.row), -1, dtype=np.int64)
        for i, r in enumerate(records):  # what earlier reads found
            if r.located is not None:
                start[bounds[i]:bounds[i + 1]] = r.located[r.row_numbers()]
        todo = np.flatnonzero((start < 0) & (cols.kind >= 0))
        if len(todo) and not any(isinstance(p, RemotePath) for p in self.file_paths):
            for kind in np.unique(cols.kind[todo]).tolist():
                rows = todo[cols.kind[todo] == kind]
                start[rows] = self._locate_kind(records, cols, rows)
        for i, r in enumerate(records):  # what was found, for the lazy chunks too
            mine = start[bounds[i]:bounds[i + 1]]
            if r.located is None and r.rows is None:
                r.located = mine  # the same values: a view, not a copy per tensor
            else:
                found = mine >= 0
                r.located_column()[r.row_numbers()[found]] = mine[found]
        file = np.where(start >= 0, cols.file, -1)
        return StoredChunks(self.file_paths, file, start)

    def _locate_kind(self, records: list[TensorRecords], cols: _Records, rows: np.ndarray) -> np.ndarray:
        """Element offsets of records ``rows`` (one kind), -1 where a record is none of the
        patterns': the first record left is the next pattern (two torch versions' archives of
        one kind are two patterns), until ``_MISSES`` patterns in a row match no other record."""
        out = np.full(len(rows), -1, dtype=np.int64)
        left, misses = np.ones(len(rows), dtype=bool), 0
        while left.any() and misses < _MISSES:
            first = int(np.argmax(left))
            left[first] = False
            found = self._pattern(records, cols, int(rows[first]))
            if found is None:
                misses += 1
                continue
            out[first] = int(cols.start[rows[first]]) + found.data_at
            todo = np.flatnonzero(left)
            same = todo[self._compare(cols, rows[todo], found)]
            out[same] = cols.start[rows[same]] + found.data_at
            left[same] = False
            misses = 0 if len(same) else misses + 1
        return out

    def _pattern(self, records: list[TensorRecords], cols: _Records, k: int) -> _Pattern | None:
        """Record ``k``'s fixed bytes (where another of its layout must equal it) and where its
        elements start in it, read as its lazy chunk would; None when it is not a plain tensor
        record (or is refused: it will be again, when the one-by-one path reads it)."""
        owner, row = records[int(cols.owner[k])], int(cols.row[k])
        path, at, length = self.file_paths[int(cols.file[k])], int(cols.start[k]), int(cols.length[k])
        try:
            region = self._region(owner, row)
            if region is None or not region.is_contiguous:
                return None
            varying = varying_spans(path, at, length)
            windows = _windows(varying, length)
            fd = open_read(path)
            try:
                data = [np.frombuffer(read_exact(fd, n, at + a, path), dtype=np.uint8) for a, n in windows]
            finally:
                close(fd)
        except ReshardError:
            return None
        return _Pattern(windows, data, varying, region.offset - at)

    def _compare(self, cols: _Records, rows: np.ndarray, pattern: _Pattern) -> np.ndarray:
        """Which of ``rows`` equal ``pattern`` in its fixed bytes: each record's windows read
        with their neighbours' (file order, gaps under ``_GAP`` read through) in spans of about
        ``_BLOCK``, every record of a batch compared in one array operation per window."""
        same = np.zeros(len(rows), dtype=bool)
        if not len(rows):
            return same
        order = np.lexsort((cols.start[rows], cols.file[rows]))
        file, start = cols.file[rows][order], cols.start[rows][order]
        span = max(1, sum(n for _, n in pattern.windows))
        per_batch = max(1, _BLOCK // span)
        cuts = np.flatnonzero((file[1:] != file[:-1]) | (np.arange(1, len(file)) % per_batch == 0)) + 1
        for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, len(order)].tolist()):
            same[order[a:b]] = self._compare_batch(self.file_paths[int(file[a])], start[a:b], pattern)
        return same

    def _compare_batch(self, path: Path, start: np.ndarray, pattern: _Pattern) -> np.ndarray:
        """Records at ``start`` (sorted) of one file against ``pattern``."""
        lo = (start[:, None] + np.array([a for a, _ in pattern.windows], dtype=np.int64)).reshape(-1)
        hi = lo + np.tile(np.array([n for _, n in pattern.windows], dtype=np.int64), len(start))
        if not len(lo):
            return np.ones(len(start), dtype=bool)
        new = np.r_[True, lo[1:] - hi[:-1] > _GAP]  # a read starts where the gap from the last window is long
        first = np.flatnonzero(new)
        read_lo, read_hi = np.minimum.reduceat(lo, first), np.maximum.reduceat(hi, first)
        base = np.r_[0, np.cumsum(read_hi - read_lo)]
        data = np.empty(int(base[-1]), dtype=np.uint8)
        fd = open_read(path)
        try:
            for r0, r1, at in zip(read_lo.tolist(), read_hi.tolist(), base.tolist()):
                read_into(fd, memoryview(data[at:at + r1 - r0]), r0, path)  # type: ignore[arg-type]  # numpy's stubs give an ndarray the buffer protocol on Python 3.12+ only
        finally:
            close(fd)
        read = np.cumsum(new) - 1  # which read each window is in
        where = (base[read] + lo - read_lo[read]).reshape(len(start), len(pattern.windows))
        ok = np.ones(len(start), dtype=bool)
        for at, want, mask in zip(where.T, pattern.want, pattern.mask):
            # every window of len(want) bytes of data (no copy), then the rows the records start at
            recs = np.lib.stride_tricks.as_strided(data, (len(data) - len(want) + 1, len(want)), (1, 1))[at]
            ok &= ((recs & mask) == want).all(axis=1)
        return ok


class _Pattern:
    """A record's bytes that others of its layout must equal: ``windows`` of it ((offset,
    length), in order), each with its bytes where fixed (``want``, the ``varying`` spans
    zeroed) and its ``mask`` (0xFF where fixed); ``data_at``: where its elements start in it."""

    def __init__(self, windows: list[tuple[int, int]], data: list[np.ndarray], varying: list[tuple[int, int]],
                 data_at: int) -> None:
        self.windows, self.data_at = windows, data_at
        self.mask = []
        for at, n in windows:
            mask = np.full(n, 0xFF, dtype=np.uint8)
            for a, k in varying:
                mask[max(0, a - at):max(0, min(n, a + k - at))] = 0
            self.mask.append(mask)
        self.want = [d & m for d, m in zip(data, self.mask)]


def _windows(varying: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The parts of a record of ``length`` bytes worth reading to compare it: everything but
    its ``varying`` spans (offset, length) of at least ``_GAP`` bytes (the tensor's payload)."""
    out, at = [], 0
    for a, n in sorted(s for s in varying if s[1] >= _GAP):
        if a > at:
            out.append((at, a - at))
        at = max(at, a + n)
    if at < length:
        out.append((at, length - at))
    return out


def _columns(records: list[TensorRecords]) -> _Records:
    tables = [r.table for r in records]
    picks = [r.rows for r in records]
    counts = np.fromiter((len(t) if p is None else len(p) for t, p in zip(tables, picks)), dtype=np.int64,
                         count=len(records))
    every = all(p is None for p in picks)
    row = ranges(np.zeros(len(records), dtype=np.int64), counts) if every else \
        np.concatenate([r.row_numbers() for r in records]).astype(np.int64)
    owner = np.repeat(np.arange(len(records)), counts)
    file = _gather([t.file for t in tables], picks, every)
    start = _gather([t.start for t in tables], picks, every)
    length = _gather([t.length for t in tables], picks, every)
    # A kind: same dtype, same chunk sizes, same record length. Compressed records have none.
    codes: dict[object, int] = {}
    dtype = np.repeat(np.fromiter((codes.setdefault(r.dtype, len(codes)) for r in records), dtype=np.int64,
                                  count=len(records)), counts)
    ndims = np.fromiter((t.sizes.shape[1] for t in tables), dtype=np.int64, count=len(tables))
    width = int(ndims.max(initial=0))
    sizes = np.full((len(row), width + 1), -1, dtype=np.int64)
    for d in np.unique(ndims).tolist():
        which = np.flatnonzero(ndims == d)
        at = np.flatnonzero(ndims[owner] == d)
        sizes[at, :d] = _gather([tables[i].sizes for i in which.tolist()], [picks[i] for i in which.tolist()], every)
        sizes[at, width] = d
    kind = unique_rows(np.column_stack([dtype, length, sizes]))[1]
    for i, r in enumerate(records):
        if r.table.transforms:
            k = np.flatnonzero(np.isin(r.row_numbers(), list(r.table.transforms)))
            kind[np.flatnonzero(owner == i)[k]] = -1
    return _Records(owner, row, file.astype(np.int64), start.astype(np.int64), length.astype(np.int64), kind)


def _gather(columns: list[np.ndarray], pick: list[np.ndarray | None], every: bool) -> np.ndarray:
    """``columns`` (one per tensor) concatenated, each cut to its ``pick`` rows where given
    (``every``: none is)."""
    if not columns:
        return np.zeros(0, dtype=np.int64)
    if every:
        return np.concatenate(columns)
    return np.concatenate([c if p is None else c[p] for c, p in zip(columns, pick)])
