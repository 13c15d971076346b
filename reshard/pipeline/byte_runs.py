"""The column path of a plan: many small pieces moved as runs of bytes, planned with arrays.

A mesh layout of a fine-grained MoE has hundreds of thousands of pieces of a few hundred
bytes. Planned and copied one by one (boxes, sources, a kernel copy each), Python costs a
hundred times what moving the bytes does. Here:

* ``LayoutColumns``: every segment of a layout's files as arrays (read straight from a
  writer's ``SegmentTable``, or gathered once from a list of segments).
* Pieces whose tensors share their chunk boxes, and whose own boxes are equal, are one
  pattern: its sources are found once by the box arithmetic of ``plan.sources_for``, and
  where each part is one contiguous run both of its stored chunk and of the piece (whole
  chunks, row slabs), the pattern's runs are repeated for every piece by array operations.
  Stored chunks are located in bulk (``ChunkLocator``, else chunk by chunk).
* ``Gathered``: each output file that holds many such pieces as runs of bytes (its literal
  bytes and the pieces' stored bytes) in file order, which the engine writes a window at a
  time (``reshard.pipeline.gather``): tiny pieces bound for one file become one read and one write.

Everything else (casts, strided or compressed chunks, pieces large enough for a kernel copy
of their own, sources on object stores) stays on the piece-by-piece path, which also raises
for pieces no stored chunk covers, exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from reshard.core.boxes import Box, contiguous_range
from reshard.core.catalog import Catalog, StoredChunks, TensorEntry
from reshard.core.columns import ranges, unique_rows
from reshard.core.dtypes import DType
from reshard.core.pieces import OutputFile, Piece, SegmentTable
from reshard.core.regions import as_region
from reshard.core.storage import RemotePath

__all__ = ["LayoutColumns", "FileRuns", "Gathered", "gather_plan", "locate_chunks", "GATHER_MAX_PIECE", "GATHER_MIN_PIECES"]

# A piece up to this size is gathered with others rather than copied on its own: below it the
# per-piece cost of a kernel copy (a syscall and its bookkeeping, ~20 us) outweighs moving its
# bytes through memory.
GATHER_MAX_PIECE = 32 << 10
# ... in files that hold at least this many such pieces: a few small pieces cost nothing either
# way, and left alone they move without passing through memory.
GATHER_MIN_PIECES = 64


@dataclass
class LayoutColumns:
    """Every segment of a layout's files as columns. Per tensor (``names``): its dtype and
    ``ndim``. Per piece: its file (index into the layout), segment index and byte offset in
    that file, tensor, box (``offsets`` / ``sizes`` padded as in ``PieceTable``) and bytes.
    Per literal segment: its file, byte offset and ``literals`` index (each distinct literal
    kept once)."""

    names: list[str]
    dtypes: list[DType]
    ndim: np.ndarray
    file: np.ndarray
    segment: np.ndarray
    offset: np.ndarray
    tensor: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    nbytes: np.ndarray
    literals: list[bytes]
    lit_file: np.ndarray
    lit_segment: np.ndarray
    lit_offset: np.ndarray
    lit_index: np.ndarray

    @classmethod
    def of_files(cls, files: list[OutputFile]) -> LayoutColumns:
        tables: list[Any] = [f.segments for f in files]  # SegmentTables, when every file is one
        if tables and all(isinstance(t, SegmentTable) for t in tables) and \
                len({id(t.pieces) for t in tables}) == 1 and len({id(t.literals) for t in tables}) == 1:
            return cls._of_tables(tables)
        return cls._of_lists(files)

    @classmethod
    def _of_tables(cls, tables: list[SegmentTable]) -> LayoutColumns:
        pt = tables[0].pieces
        keys = ("file", "segment", "offset", "row", "lfile", "lseg", "loff", "lidx")
        parts: dict[str, list[np.ndarray]] = {k: [] for k in keys}
        for i, t in enumerate(tables):
            offsets = t.offsets()
            pieces, lits = np.flatnonzero(t.kind < 0), np.flatnonzero(t.kind >= 0)
            for key, value in (("file", np.full(len(pieces), i)), ("segment", pieces), ("offset", offsets[pieces]),
                               ("row", t.row[pieces]), ("lfile", np.full(len(lits), i)), ("lseg", lits),
                               ("loff", offsets[lits]), ("lidx", t.kind[lits])):
                parts[key].append(value)
        col = {k: np.concatenate(v).astype(np.int64) for k, v in parts.items()}
        rows = col["row"]
        return cls(pt.names, pt.dtypes, pt.ndim, col["file"], col["segment"], col["offset"], pt.tensor[rows],
                   pt.offsets[rows], pt.sizes[rows], pt.nbytes[rows], tables[0].literals, col["lfile"], col["lseg"],
                   col["loff"], col["lidx"])

    @classmethod
    def _of_lists(cls, files: list[OutputFile]) -> LayoutColumns:
        tensors: dict[tuple[str, DType], int] = {}
        ndims: list[int] = []
        pieces: list[tuple[int, int, int, int, Box]] = []
        literals: dict[int, int] = {}  # id of a literal -> its index
        kept: list[bytes] = []
        lits: list[tuple[int, int, int, int]] = []
        for i, f in enumerate(files):
            for k, (at, seg) in enumerate(zip(f.offsets(), f.segments)):
                if isinstance(seg, Piece):
                    t = tensors.setdefault((seg.name, seg.dtype), len(tensors))
                    if t == len(ndims):
                        ndims.append(seg.box.ndim)
                    pieces.append((i, k, at, t, seg.box))
                else:
                    j = literals.setdefault(id(seg), len(kept))
                    if j == len(kept):
                        kept.append(seg)
                    lits.append((i, k, at, j))
        width = max(ndims, default=0)
        offsets = np.zeros((len(pieces), width), dtype=np.int64)
        sizes = np.ones((len(pieces), width), dtype=np.int64)
        for r, (_, _, _, _, box) in enumerate(pieces):
            offsets[r, :box.ndim] = box.offsets
            sizes[r, :box.ndim] = box.sizes
        cols = np.array([p[:4] for p in pieces], dtype=np.int64).reshape(-1, 4)
        lcols = np.array(lits, dtype=np.int64).reshape(-1, 4)
        dts = [d for _, d in tensors]
        itemsize = np.array([d.itemsize for d in dts], dtype=np.int64)
        return cls([n for n, _ in tensors], dts, np.array(ndims, dtype=np.int64), cols[:, 0], cols[:, 1], cols[:, 2],
                   cols[:, 3], offsets, sizes, sizes.prod(axis=1) * itemsize[cols[:, 3]], kept, lcols[:, 0], lcols[:, 1],
                   lcols[:, 2], lcols[:, 3])

    def box(self, i: int) -> Box:
        n = int(self.ndim[self.tensor[i]])
        return Box(tuple(self.offsets[i, :n].tolist()), tuple(self.sizes[i, :n].tolist()))


@dataclass
class FileRuns:
    """One output file's bytes as runs in file order: ``length[i]`` bytes at ``dst[i]`` come
    from byte ``src_off[i]`` of source file ``src[i]``, or of the literal pool where ``src[i]``
    is -1. Runs are adjacent except where a piece of the piece-by-piece path lies between.
    ``piece_bytes``: the pieces' bytes among them (what progress counts)."""

    dst: np.ndarray
    length: np.ndarray
    src: np.ndarray
    src_off: np.ndarray
    piece_bytes: int


@dataclass
class Gathered:
    """The files of a plan written as runs (``FileRuns`` by relpath), the source files their
    runs read (``paths``), the literal bytes (``pool``), and per file the segments the runs
    write (``segments``: indices; every literal of the file and the gathered pieces)."""

    paths: list[Path]
    pool: np.ndarray
    files: dict[str, FileRuns]
    segments: dict[str, np.ndarray]

    def subset(self, relpaths: set[str]) -> Gathered | None:
        files = {r: f for r, f in self.files.items() if r in relpaths}
        return Gathered(self.paths, self.pool, files, {r: self.segments[r] for r in files}) if files else None


def locate_chunks(entries: list[TensorEntry]) -> StoredChunks:
    """Where every chunk of ``entries`` lies as plain bytes (``StoredChunks``, chunks in
    ``columns`` order, entry after entry): entries of one ``locator`` in one pass, others chunk
    by chunk."""
    paths: dict[Path, int] = {}
    counts = np.fromiter((e.chunk_count for e in entries), dtype=np.int64, count=len(entries))
    at = np.r_[0, np.cumsum(counts)].astype(np.int64)
    file = np.full(int(at[-1]), -1, dtype=np.int64)
    start = np.full(len(file), -1, dtype=np.int64)
    by_locator: dict[int, list[int]] = {}
    for i, e in enumerate(entries):
        locator = getattr(e, "locator", None)
        if locator is not None:
            by_locator.setdefault(id(locator), []).append(i)
            continue
        for k, chunk in enumerate(e.chunks):
            region = as_region(chunk.data)
            if (region is not None and region.is_contiguous and region.dtype == e.dtype and region.shape == chunk.box.sizes
                    and not isinstance(region.path, RemotePath)):
                file[at[i] + k] = paths.setdefault(region.path, len(paths))
                start[at[i] + k] = region.offset
    for group in by_locator.values():
        found = entries[group[0]].locator.locate([entries[i].records for i in group])  # type: ignore[attr-defined]
        ids = np.array([paths.setdefault(p, len(paths)) for p in found.paths] + [-1], dtype=np.int64)
        rows = ranges(at[group], counts[group])
        file[rows] = ids[found.file]  # -1 stays -1 (the appended last id)
        start[rows] = found.start
    return StoredChunks(list(paths), file, start)


def gather_plan(catalog: Catalog, files: list[OutputFile], cols: LayoutColumns) -> Gathered | None:
    """The runs of the files that hold ``GATHER_MIN_PIECES`` pieces of up to
    ``GATHER_MAX_PIECE`` whose bytes are stored runs; None when no file does."""
    if isinstance(catalog.path, RemotePath):
        return None
    small = cols.nbytes <= GATHER_MAX_PIECE
    count = np.bincount(cols.file[small], minlength=len(files))
    pick = small & (count[cols.file] >= GATHER_MIN_PIECES)
    if not pick.any():
        return None
    runs, paths = _piece_runs(catalog, cols, pick)
    if runs is None:
        return None
    piece, src, src_off, dst, length, gathered = runs
    pool_at = np.concatenate([[0], np.cumsum([len(b) for b in cols.literals])]).astype(np.int64)
    taken = np.bincount(cols.file[gathered], minlength=len(files)) >= GATHER_MIN_PIECES  # files written as runs
    # Everything grouped by file once (stable: file order within), then cut per file.
    by_run, by_piece, by_lit = (np.argsort(f, kind="stable") for f in (cols.file[piece], cols.file, cols.lit_file))
    cut_run, cut_piece, cut_lit = (np.searchsorted(f[order], np.arange(len(files) + 1))
                                   for f, order in ((cols.file[piece], by_run), (cols.file, by_piece),
                                                    (cols.lit_file, by_lit)))
    out: dict[str, FileRuns] = {}
    segments: dict[str, np.ndarray] = {}
    for i in np.flatnonzero(taken).tolist():
        p_runs = by_run[cut_run[i]:cut_run[i + 1]]
        mine = by_piece[cut_piece[i]:cut_piece[i + 1]]
        mine = mine[gathered[mine]]
        lits = by_lit[cut_lit[i]:cut_lit[i + 1]]
        lit_at, lit_end = pool_at[cols.lit_index[lits]], pool_at[cols.lit_index[lits] + 1]
        d = np.concatenate([dst[p_runs], cols.lit_offset[lits]])
        order = np.argsort(d, kind="stable")
        out[files[i].relpath] = FileRuns(d[order], np.concatenate([length[p_runs], lit_end - lit_at])[order],
                                         np.concatenate([src[p_runs], np.full(len(lits), -1)])[order],
                                         np.concatenate([src_off[p_runs], lit_at])[order], int(cols.nbytes[mine].sum()))
        segments[files[i].relpath] = np.concatenate([cols.segment[mine], cols.lit_segment[lits]])
    if not out:
        return None
    pool = np.frombuffer(b"".join(cols.literals), dtype=np.uint8)
    return Gathered(paths, pool, out, segments)


_Runs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _piece_runs(catalog: Catalog, cols: LayoutColumns, pick: np.ndarray) -> tuple[_Runs | None, list[Path]]:
    """(piece, source file, source offset, file offset, length) of every run of the picked
    pieces that can be gathered, and which pieces can (a mask over all pieces)."""
    layouts: dict[tuple, int] = {}
    chunk_boxes: list[tuple[tuple[int, ...], np.ndarray, np.ndarray]] = []
    layout_of = np.full(len(cols.names), -1, dtype=np.int64)
    chunk_base = np.zeros(len(cols.names), dtype=np.int64)
    entries: list[TensorEntry] = []
    base = 0
    for t in np.unique(cols.tensor[pick]).tolist():
        entry = catalog.tensors.get(cols.names[t])
        if entry is None or entry.dtype != cols.dtypes[t] or len(entry.shape) != cols.ndim[t]:
            continue  # missing (the piece-by-piece check says so) or cast on the way
        offsets, sizes = entry.columns
        key = (entry.shape, offsets.shape, offsets.tobytes(), sizes.tobytes())
        layout = layouts.setdefault(key, len(layouts))
        if layout == len(chunk_boxes):
            chunk_boxes.append((tuple(entry.shape), offsets, sizes))
        layout_of[t], chunk_base[t] = layout, base
        base += len(offsets)
        entries.append(entry)
    stored = locate_chunks(entries)
    live = np.flatnonzero(pick & (layout_of[cols.tensor] >= 0))
    if not len(live):
        return None, stored.paths
    firsts, pattern = unique_rows(np.column_stack([layout_of[cols.tensor[live]], cols.offsets[live], cols.sizes[live]]))
    gathered = np.zeros(len(cols.tensor), dtype=bool)
    out: list[list[np.ndarray]] = [[], [], [], [], []]
    itemsize = np.array([d.itemsize for d in cols.dtypes], dtype=np.int64)
    by_pattern = np.argsort(pattern, kind="stable")
    bounds = np.r_[0, np.cumsum(np.bincount(pattern, minlength=len(firsts)))]
    for u, first in enumerate(firsts.tolist()):
        i = int(live[first])
        parts = _pattern_parts(chunk_boxes[layout_of[cols.tensor[i]]], cols.box(i))
        if parts is None:
            continue
        mine = live[by_pattern[bounds[u]:bounds[u + 1]]]
        item = itemsize[cols.tensor[mine]]
        ok = np.ones(len(mine), dtype=bool)
        runs = []
        for k, src, dst, n in parts:
            chunk = chunk_base[cols.tensor[mine]] + k
            runs.append((stored.file[chunk], stored.start[chunk] + src * item, cols.offset[mine] + dst * item, n * item))
            ok &= stored.file[chunk] >= 0
        gathered[mine[ok]] = True
        for file, src_off, dst_off, length in runs:
            for column, value in zip(out, (mine[ok], file[ok], src_off[ok], dst_off[ok], length[ok])):
                column.append(value)
    if not gathered.any():
        return None, stored.paths
    piece, file, src_off, dst_off, length = (np.concatenate(c).astype(np.int64) if c else np.zeros(0, dtype=np.int64)
                                             for c in out)
    return (piece, file, src_off, dst_off, length, gathered), stored.paths


def _pattern_parts(layout: tuple[tuple[int, ...], np.ndarray, np.ndarray], box: Box
                   ) -> list[tuple[int, int, int, int]] | None:
    """(chunk, first element in the chunk, first element in the piece, elements) of each part
    of ``box`` when the chunks cover it and every part is one run of both; else None."""
    _, offsets, sizes = layout
    lo = np.maximum(offsets, np.asarray(box.offsets, dtype=np.int64))
    hi = np.minimum(offsets + sizes, np.asarray(box.ends, dtype=np.int64))
    hits = np.flatnonzero((hi > lo).all(axis=1)) if box.ndim else np.arange(len(offsets))
    if int((hi - lo)[hits].prod(axis=1).sum()) != box.numel:
        return None  # not covered: the piece-by-piece check refuses it
    parts = []
    for k in hits.tolist():
        part = Box(tuple(lo[k].tolist()), tuple((hi[k] - lo[k]).tolist()))
        src = contiguous_range(part.shifted(tuple(offsets[k].tolist())), tuple(sizes[k].tolist()))
        dst = contiguous_range(part.shifted(box.offsets), box.sizes)
        if src is None or dst is None:
            return None
        parts.append((k, src[0], dst[0], src[1]))
    return parts
