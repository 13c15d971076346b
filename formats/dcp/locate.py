"""Locating the tensor bytes of many DCP chunk records at once.

Each chunk is its own torch.save archive, and where its elements start inside the archive is
known only by reading the archive's zip headers and pickle: one record at a time that is two
reads and a few hundred microseconds, a minute for the 400k chunks of a fine-grained MoE.
But torch writes every chunk of one dtype and shape the same way: the archives differ only
in their payload, their CRC-32 fields and a per-save serialization id. So one archive of each
kind is read as any other (``_LazyChunk``: checked against ``.metadata``), and every other
record of that kind is compared with it byte for byte outside those spans, reading the
records in large sequential blocks; each record equal to its pattern has its elements at the
pattern's offset. A record that differs, is compressed or is too large to be worth reading
whole is left to the one-at-a-time path, which reads (and refuses) it as before.
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

_MAX_RECORD = 1 << 16  # larger records: the one-at-a-time path (their headers are a small part of their bytes)
_BLOCK = 4 << 20  # bytes of a data file read at once (about) when comparing records
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
        todo = np.flatnonzero((start < 0) & (cols.length <= _MAX_RECORD) & (cols.kind >= 0))
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
            (pattern, fixed), data_at = found
            out[first] = int(cols.start[rows[first]]) + data_at
            todo = np.flatnonzero(left)
            same = todo[self._compare(cols, rows[todo], pattern, fixed)]
            out[same] = cols.start[rows[same]] + data_at
            left[same] = False
            misses = 0 if len(same) else misses + 1
        return out

    def _pattern(self, records: list[TensorRecords], cols: _Records, k: int
                 ) -> tuple[tuple[np.ndarray, np.ndarray], int] | None:
        """((record ``k``'s bytes, where another of its layout must equal them), where its
        elements start in it), read as its lazy chunk would; None when it is not a plain
        tensor record (or is refused: it will be again, when the one-by-one path reads it)."""
        owner, row = records[int(cols.owner[k])], int(cols.row[k])
        path, at, length = self.file_paths[int(cols.file[k])], int(cols.start[k]), int(cols.length[k])
        try:
            region = self._region(owner, row)
            if region is None or not region.is_contiguous:
                return None
            fd = open_read(path)
            try:
                pattern = np.frombuffer(read_exact(fd, length, at, path), dtype=np.uint8)
            finally:
                close(fd)
            fixed = np.ones(length, dtype=bool)
            for a, n in varying_spans(path, at, length):
                fixed[a:a + n] = False
        except ReshardError:
            return None
        return (pattern, fixed), region.offset - at

    def _compare(self, cols: _Records, rows: np.ndarray, pattern: np.ndarray, fixed: np.ndarray) -> np.ndarray:
        """Which of ``rows`` equal ``pattern`` wherever ``fixed``: each data file read in
        blocks, every record of a block compared in one array operation."""
        same = np.zeros(len(rows), dtype=bool)
        if not len(rows):
            return same
        length = len(pattern)
        order = np.lexsort((cols.start[rows], cols.file[rows]))
        file, start = cols.file[rows][order], cols.start[rows][order]
        block = start // _BLOCK
        cuts = np.flatnonzero((file[1:] != file[:-1]) | (block[1:] != block[:-1])) + 1
        mask = fixed.astype(np.uint8) * 0xFF
        want = pattern & mask
        for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, len(order)].tolist()):
            path = self.file_paths[int(file[a])]
            lo, hi = int(start[a]), int(start[b - 1]) + length
            data = np.empty(hi - lo, dtype=np.uint8)
            fd = open_read(path)
            try:
                read_into(fd, memoryview(data), lo, path)  # type: ignore[arg-type]  # numpy's stubs give an ndarray the buffer protocol on Python 3.12+ only
            finally:
                close(fd)
            recs = np.lib.stride_tricks.sliding_window_view(data, length)[start[a:b] - lo]
            same[order[a:b]] = ((recs & mask) == want).all(axis=1)
        return same


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
