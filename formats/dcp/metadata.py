"""Loading and validating a DCP ``.metadata`` file without trusting it.

The file is unpickled into inert stand-ins of torch's classes (``dcp.metadata_pickle``:
nothing of torch.distributed is imported or constructed, a field it does not know is refused
as a newer format); then the structure is checked: every tensor's chunks tile it exactly
once, every chunk has a storage record, and every record names a file inside the checkpoint
folder. What it holds is kept as columns (``ChunkTable``): a 2048-rank checkpoint has
millions of chunks.

A folder saved with ``use_collectives=False`` has no ``.metadata`` but one
``__{rank}.metadata`` per rank; those are merged first (``dcp.ranks``) and checked as one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np
from reshard.formats.dcp.metadata_pickle import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
    newer_format,
    properties_of,
    unpickled_metadata,
)

from reshard.core.boxes import Box
from reshard.core.dtypes import DType
from reshard.core.errors import CorruptCheckpointError, NewerFormatError, UnsafeCheckpointError

__all__ = ["StorageRecord", "ChunkTable", "DCPIndex", "NewerFormatError", "read_metadata_file", "DCP_VERSIONS"]

_MAX_METADATA_BYTES = 1 << 30
# Metadata.version, the DCP format's own version (filesystem.CURRENT_DCP_VERSION); None before 2.4.
DCP_VERSIONS = frozenset({None, "1.0.0"})


@dataclass(frozen=True)
class StorageRecord:
    relpath: str
    offset: int
    length: int
    transforms: tuple


class ChunkTable:
    """One tensor's chunks as columns, in ``.metadata``'s order (empty shards included):
    boxes as ``offsets`` / ``sizes`` arrays ``[n, ndim]``, and the record of each as a file
    number (into ``files``, each name kept once), a byte offset and a length. A 2048-rank
    checkpoint has millions of chunks: held as objects they would cost more memory and time
    than the rest of the conversion plans. Iterating gives ``(Box, StorageRecord)`` pairs for
    code that wants objects (a few tensors at a time)."""

    __slots__ = ("offsets", "sizes", "file", "start", "length", "transforms", "files")

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray, file: np.ndarray, start: np.ndarray,
                 length: np.ndarray, files: list[str], transforms: dict[int, tuple] | None = None) -> None:
        self.offsets, self.sizes, self.file, self.start, self.length = offsets, sizes, file, start, length
        self.files, self.transforms = files, transforms or {}

    @classmethod
    def from_pairs(cls, pairs: list[tuple[Box, StorageRecord]], ndim: int, files: list[str]) -> ChunkTable:
        ids = {f: i for i, f in enumerate(files)}
        for _, rec in pairs:
            if rec.relpath not in ids:
                ids[rec.relpath] = len(files)
                files.append(rec.relpath)
        shape = (len(pairs), ndim)
        return cls(np.array([b.offsets for b, _ in pairs], dtype=np.int64).reshape(shape),
                   np.array([b.sizes for b, _ in pairs], dtype=np.int64).reshape(shape),
                   np.array([ids[r.relpath] for _, r in pairs], dtype=np.int32),
                   np.array([r.offset for _, r in pairs], dtype=np.int64),
                   np.array([r.length for _, r in pairs], dtype=np.int64), files,
                   {i: r.transforms for i, (_, r) in enumerate(pairs) if r.transforms})

    def __len__(self) -> int:
        return len(self.start)

    def box(self, i: int) -> Box:
        return Box(tuple(self.offsets[i].tolist()), tuple(self.sizes[i].tolist()))

    def record(self, i: int) -> StorageRecord:
        return StorageRecord(self.files[self.file[i]], int(self.start[i]), int(self.length[i]), self.transforms.get(i, ()))

    def __getitem__(self, i: int) -> tuple[Box, StorageRecord]:
        return self.box(i), self.record(i)

    def __iter__(self) -> Iterator[tuple[Box, StorageRecord]]:
        return (self[i] for i in range(len(self)))

    def nonempty(self) -> np.ndarray:
        """Indices of the chunks that hold elements (more ranks than rows leave empty shards)."""
        return np.flatnonzero(self.sizes.prod(axis=1) > 0) if self.sizes.shape[1] else np.arange(len(self))


@dataclass
class DCPIndex:
    """The validated content of ``.metadata``.

    ``copies`` holds, for a chunk (``(name, offsets)``) or an object (``(name, ())``) that
    several ranks each wrote (``use_collectives=False``), the other ranks' records; the record
    in ``tensors`` / ``objects`` is the lowest rank's."""

    tensors: dict[str, tuple[tuple[int, ...], DType, ChunkTable | list[tuple[Box, StorageRecord]]]]
    objects: dict[str, StorageRecord]
    paths: dict[str, tuple]
    containers: dict[tuple, str] = field(default_factory=dict)
    copies: dict[tuple[str, tuple[int, ...]], list[StorageRecord]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    def table(self, name: str) -> ChunkTable:
        shape, _, chunks = self.tensors[name]
        if not isinstance(chunks, ChunkTable):  # merged from several ranks' files
            chunks = ChunkTable.from_pairs(list(chunks), len(shape), self.files)
            self.tensors[name] = (shape, self.tensors[name][1], chunks)
        return chunks


def _ints(value: Any, where: str) -> tuple[int, ...]:
    try:
        out = tuple(value)
    except TypeError:
        raise CorruptCheckpointError(f"{where} is not a sequence of integers") from None
    if not all(type(v) is int for v in out):
        raise CorruptCheckpointError(f"{where} is not a sequence of integers")
    return out


class _Files:
    """Data file names, each checked once and numbered once (thousands of chunks share one)."""

    def __init__(self, root: Path, names: list[str]) -> None:
        self.root, self.names, self.ids = root, names, {n: i for i, n in enumerate(names)}

    def add(self, rel: str) -> str | None:
        """Number ``rel``; what is wrong with it, if anything."""
        if rel in self.ids:
            return None
        if not rel or rel.startswith(("/", "\\")) or ".." in Path(rel).parts:
            return f"data file {rel!r} is outside the checkpoint folder"
        if not (self.root / rel).resolve().is_relative_to(self.root.resolve()):
            return f"data file {rel!r} resolves outside the checkpoint folder"
        self.ids[rel] = len(self.names)
        self.names.append(rel)
        return None


def _all_of_type(records: list[Any], cls: type, where: str) -> None:
    """Refuse any record that is not a ``cls``; checked with set(map(...)), which runs in C,
    where a loop over millions of records would not."""
    if set(map(type, records)) - {cls}:
        bad = next(r for r in records if type(r) is not cls)
        raise CorruptCheckpointError(f"{where} is a {type(bad).__name__}, not a {cls.__name__}")


def _field(records: list[Any], name: str) -> list[Any]:
    return list(map(attrgetter(name), records))


def _nonnegative(values: list[Any]) -> np.ndarray | int:
    """``values`` as int64, or the position of the first that is not an int in [0, 2**63)."""
    if not set(map(type, values)) - {int}:
        try:
            arr = np.array(values, dtype=np.int64)
        except OverflowError:
            arr = None
        if arr is not None and (not len(arr) or arr.min() >= 0):
            return arr
    return next(i for i, v in enumerate(values) if type(v) is not int or not 0 <= v < 2**63)


class _StorageRecords:
    """Every storage record of one ``.metadata`` as columns, grouped by name: built once from
    ``storage_data`` with column operations, then handed out tensor by tensor."""

    def __init__(self, storage: dict, meta_path: Path, files: _Files) -> None:
        keys, infos = list(storage), list(storage.values())
        _all_of_type(keys, MetadataIndex, f"{meta_path}: a storage key")
        fqns = _field(keys, "fqn")
        if set(map(type, fqns)) - {str}:
            bad = next(f for f in fqns if type(f) is not str)
            raise CorruptCheckpointError(f"{meta_path}: a storage key's name is {bad!r}, not a string")
        self.meta_path, self.fqns, self.files = meta_path, fqns, files
        self.offsets, hints = _field(keys, "offset"), _field(keys, "index")
        _all_of_type(infos, StorageInfo, f"{meta_path}: a storage record")
        rel = _field(infos, "relative_path")
        if set(map(type, rel)) - {str}:
            k = next(i for i, r in enumerate(rel) if type(r) is not str)
            raise UnsafeCheckpointError(f"{meta_path}: {fqns[k]}: data file {rel[k]!r} is outside the checkpoint folder")
        for r in dict.fromkeys(rel):
            problem = files.add(r)
            if problem:
                raise UnsafeCheckpointError(f"{meta_path}: {fqns[rel.index(r)]}: {problem}")
        n = len(rel)
        self.file = np.fromiter(map(files.ids.__getitem__, rel), dtype=np.int32, count=n)
        columns = []
        for what in ("offset", "length"):
            values = _field(infos, what)
            arr = _nonnegative(values)
            if isinstance(arr, int):
                raise CorruptCheckpointError(f"{meta_path}: {fqns[arr]}: storage record {what} is {values[arr]!r}")
            columns.append(arr)
        self.start, self.length = columns
        descriptors = _field(infos, "transform_descriptors")
        self.transforms: dict[int, tuple] = {}
        for k in compress(range(n), map(bool, descriptors)):
            if not isinstance(descriptors[k], (list, tuple)):
                raise CorruptCheckpointError(f"{meta_path}: {fqns[k]}: transform descriptors are a "
                                             f"{type(descriptors[k]).__name__}")
            self.transforms[k] = tuple(descriptors[k])
        del keys, infos, descriptors
        self.raw_hints = hints
        if set(map(type, hints)) - {int} or not all(map((2**62).__gt__, hints)):
            self.hints = np.fromiter((h if type(h) is int and 0 <= h < 2**62 else -1 for h in hints), dtype=np.int64, count=n)
        else:
            self.hints = np.array(hints, dtype=np.int64)
        # Positions of each name's records, in storage order: one stable sort of name codes.
        names = {name: i for i, name in enumerate(dict.fromkeys(fqns))}
        codes = np.fromiter(map(names.__getitem__, fqns), dtype=np.int64, count=n)
        order = np.argsort(codes, kind="stable")
        bounds = np.searchsorted(codes[order], np.arange(len(names) + 1)).tolist()
        self.by_name = {name: order[bounds[i]:bounds[i + 1]] for name, i in names.items()}

    def record(self, k: int) -> tuple[int, int, int, tuple]:
        """(file number, offset, length, transforms) of record ``k``."""
        return int(self.file[k]), int(self.start[k]), int(self.length[k]), self.transforms.get(k, ())

    def offsets_of(self, k: int) -> tuple[int, ...]:
        offset = self.offsets[k]
        return () if offset is None else _ints(offset, f"{self.meta_path}: {self.fqns[k]} storage offset")

    def object_record(self, name: str) -> StorageRecord | None:
        for k in self.by_name.get(name, np.zeros(0, dtype=np.int64)).tolist():
            if self.offsets_of(k) in ((), (0,)):
                f, start, length, transforms = self.record(k)
                return StorageRecord(self.files.names[f], start, length, transforms)
        return None

    def table(self, name: str, chunks: list[Any], ndim: int, where: str) -> ChunkTable:
        """The columns of one tensor: every chunk's box and the record of its bytes. Records
        written by torch name their chunk (``MetadataIndex.index``) and match it one to one:
        checked with array operations. Anything else (records found by offsets, an empty
        chunk sharing another's record) takes the general path, ``_matched_table``."""
        records = self.by_name.get(name, np.zeros(0, dtype=np.int64))
        _all_of_type(chunks, ChunkStorageMetadata, f"{where}: a chunk")
        n = len(chunks)
        offsets = _int_array(_field(chunks, "offsets"), (n, ndim))
        sizes = _int_array(_field(chunks, "sizes"), (n, ndim))
        if offsets is not None and sizes is not None and len(records) == n:
            hints = self.hints[records]
            if not n:
                return ChunkTable(offsets, sizes, np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64),
                                  np.zeros(0, dtype=np.int64), self.files.names)
            if hints.min() >= 0 and hints.max() < n and (np.bincount(hints, minlength=n) == 1).all():
                stored = _int_array(list(map(self.offsets.__getitem__, records.tolist())), (n, ndim))
                if stored is not None and (offsets[hints] == stored).all():
                    rec = np.empty(n, dtype=np.int64)
                    rec[hints] = records
                    transforms = ({k: self.transforms[r] for k, r in enumerate(rec.tolist()) if r in self.transforms}
                                  if self.transforms else {})
                    return ChunkTable(offsets, sizes, self.file[rec], self.start[rec], self.length[rec],
                                      self.files.names, transforms)
        recs = [(self.offsets_of(k), self.raw_hints[k], self.record(k)) for k in records.tolist()]
        return _matched_table(chunks, recs, ndim, self.files.names, where)

    def tables(self, entries: list[tuple[str, list[Any], int, str]]) -> dict[str, ChunkTable]:
        """``table`` for every ``(name, chunks, ndim, where)`` at once: the checks of its fast
        path done in array operations over all tensors of one ndim (a 100k-tensor checkpoint
        spent more time in ``table``'s per-tensor numpy calls than in unpickling), the tables
        views of shared columns. A tensor any check fails goes through ``table`` alone, which
        takes the general path or words the problem."""
        out: dict[str, ChunkTable] = {}
        by_ndim: dict[int, list[tuple[str, list[Any], int, str]]] = {}
        for entry in entries:
            by_ndim.setdefault(entry[2], []).append(entry)
        for ndim, group in by_ndim.items():
            out.update(self._tables_of_ndim(group, ndim))
        return {name: out[name] for name, _, _, _ in entries}

    def _tables_of_ndim(self, group: list[tuple[str, list[Any], int, str]], ndim: int) -> dict[str, ChunkTable]:
        m = len(group)
        counts = np.fromiter((len(g[1]) for g in group), dtype=np.int64, count=m)
        flat = [c for g in group for c in g[1]]
        n = len(flat)
        offsets = sizes = None
        if not set(map(type, flat)) - {ChunkStorageMetadata}:
            offsets = _int_array(_field(flat, "offsets"), (n, ndim))
            sizes = _int_array(_field(flat, "sizes"), (n, ndim))
        if offsets is None or sizes is None or self.transforms:  # odd values, or zstd records: one by one
            return {name: self.table(name, chunks, d, where) for name, chunks, d, where in group}
        empty = np.zeros(0, dtype=np.int64)
        records = [self.by_name.get(g[0], empty) for g in group]
        good = np.fromiter(map(len, records), dtype=np.int64, count=m) == counts
        first = np.concatenate(([0], np.cumsum(counts)))  # each tensor's first chunk row
        kept = np.flatnonzero(good)
        rec = np.concatenate([records[i] for i in kept.tolist()]) if len(kept) else empty
        owner = np.repeat(kept, counts[kept])
        hints = self.hints[rec]
        bad_row = (hints < 0) | (hints >= counts[owner])
        row = first[owner] + np.where(bad_row, 0, hints)  # the chunk each record says it holds
        seen = np.bincount(row[~bad_row], minlength=n)
        stored = _int_array(list(map(self.offsets.__getitem__, rec.tolist())), (len(rec), ndim))
        if stored is None:
            bad_row |= True
        else:
            bad_row |= (seen[row] != 1) | (offsets[row] != stored).any(axis=1)
        bad = ~good
        np.logical_or.at(bad, owner, bad_row)
        chunk_rec = np.zeros(n, dtype=np.int64)
        ok_rows = ~bad[owner]
        chunk_rec[row[ok_rows]] = rec[ok_rows]
        file, start, length = self.file[chunk_rec], self.start[chunk_rec], self.length[chunk_rec]
        names = self.files.names
        out = {}
        for i, (name, chunks, d, where) in enumerate(group):
            if bad[i]:
                out[name] = self.table(name, chunks, d, where)
            else:
                a, b = int(first[i]), int(first[i + 1])
                out[name] = ChunkTable(offsets[a:b], sizes[a:b], file[a:b], start[a:b], length[a:b], names)
        return out


def _int_array(rows: list[Any], shape: tuple[int, int]) -> np.ndarray | None:
    """``rows`` as an int64 array of ``shape`` if every value is an int; else None."""
    if not rows or shape[1] == 0:
        return np.zeros(shape, dtype=np.int64) if all(r == () for r in rows) else None
    if set(map(type, rows)) - {tuple}:
        return None
    try:
        arr = np.array(rows)
    except (ValueError, TypeError, OverflowError):
        return None
    return arr.astype(np.int64, copy=False) if arr.dtype.kind == "i" and arr.shape == shape else None


def read_metadata_file(meta_path: Path, root: Path) -> DCPIndex:
    """One pickled ``Metadata`` (``.metadata`` or a rank's ``__R.metadata``), validated entry
    by entry into columns; chunks are not yet checked to tile their tensors (a rank's file
    holds only its own)."""
    size = meta_path.stat().st_size
    if size > _MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{meta_path}: {size} bytes is implausibly large for DCP metadata")
    meta = unpickled_metadata(meta_path)
    if type(meta) is not Metadata or not isinstance(meta.state_dict_metadata, dict):
        raise CorruptCheckpointError(f"{meta_path}: does not hold DCP Metadata")
    if not isinstance(meta.storage_data, dict):
        raise CorruptCheckpointError(f"{meta_path}: has no storage records (storage_data)")
    if meta.version not in DCP_VERSIONS:
        if not isinstance(meta.version, str):
            raise CorruptCheckpointError(f"{meta_path}: DCP version {meta.version!r} is not a string")
        raise newer_format(meta_path, f"DCP format version {meta.version!r}, which reshard does not know")
    files = _Files(root, [])
    records = _StorageRecords(meta.storage_data, meta_path, files)
    meta.storage_data = None  # its records are columns now; let the objects go

    tensors: dict[str, tuple[tuple[int, ...], DType, Any]] = {}  # chunk lists, then their tables
    objects = {}
    for name, md in meta.state_dict_metadata.items():
        where = f"{meta_path}: {name!r}"
        if not isinstance(name, str):
            raise CorruptCheckpointError(f"{meta_path}: entry name {name!r} is not a string")
        if type(md) is BytesStorageMetadata:
            rec = records.object_record(name)
            if rec is None:
                raise CorruptCheckpointError(f"{where}: object has no storage record")
            objects[name] = rec
            continue
        if type(md) is not TensorStorageMetadata:
            raise CorruptCheckpointError(f"{where}: unknown entry type {type(md).__name__}")
        shape = _ints(md.size, f"{where} size")
        dtype, strides = properties_of(md.properties)
        if not isinstance(dtype, DType) or any(s < 0 for s in shape):
            raise CorruptCheckpointError(f"{where}: invalid dtype {dtype!r} or shape {shape}")
        if strides is not None and len(_ints(strides, f"{where} strides")) != len(shape):
            raise CorruptCheckpointError(f"{where}: strides {tuple(strides)} do not fit shape {shape}")
        if not isinstance(md.chunks, (list, tuple)):
            raise CorruptCheckpointError(f"{where}: chunk list is {type(md.chunks).__name__}")
        tensors[name] = (shape, dtype, list(md.chunks))
    meta.state_dict_metadata = None
    tables = records.tables([(name, chunks, len(shape), f"{meta_path}: {name!r}")
                             for name, (shape, _, chunks) in tensors.items()])
    tensors = {name: (shape, dtype, tables[name]) for name, (shape, dtype, _) in tensors.items()}

    paths: dict[str, tuple] = {}
    if isinstance(meta.planner_data, dict):
        for name, p in meta.planner_data.items():
            if isinstance(name, str) and isinstance(p, (tuple, list)) and all(isinstance(x, (str, int)) for x in p):
                paths[name] = tuple(p)
    return DCPIndex(tensors, objects, paths, _containers(meta.reshard_containers, meta_path), files=files.names)


def _int_columns(rows: list[tuple], shape: tuple[int, int], where: str) -> np.ndarray:
    """``_int_array``, refused when a value is not an int (a bool, float, string or an int past
    int64 makes numpy pick another kind)."""
    arr = _int_array(rows, shape)
    if arr is None:
        raise CorruptCheckpointError(f"{where} are not sequences of integers")
    return arr


def _matched_table(chunks: list[ChunkStorageMetadata], recs: list[tuple[tuple[int, ...], Any, tuple]], ndim: int,
                   files: list[str], where: str) -> ChunkTable:
    """The columns of one tensor whose records are matched to chunks one by one: by their
    chunk index where it is usable, else by offsets."""
    n = len(chunks)
    offsets = [_ints(c.offsets, f"{where} chunk offsets") for c in chunks]
    sizes = [_ints(c.sizes, f"{where} chunk sizes") for c in chunks]
    placed: list[Any] = [None] * n
    by_offsets: dict[tuple[int, ...], int] | None = None
    for offs, hint, rec in recs:
        i = hint if type(hint) is int and 0 <= hint < n and offsets[hint] == offs and placed[hint] is None else None
        if i is None:  # no usable hint: find the chunk by its offsets
            by_offsets = by_offsets if by_offsets is not None else {o: k for k, o in enumerate(offsets)}
            i = by_offsets.get(offs)
            if i is None or placed[i] is not None:
                continue  # a record of no chunk (or a second one): unused, as torch leaves it
        placed[i] = rec
    for k, rec in enumerate(placed):
        if rec is None and 0 in tuple(sizes[k]):
            # An empty chunk at the offsets of another: torch's index keys records by offsets, so
            # both share that record, and an empty one reads nothing from it.
            placed[k] = next((placed[j] for j, o in enumerate(offsets) if o == offsets[k] and placed[j]), None)
    missing = next((k for k, rec in enumerate(placed) if rec is None), None)
    if missing is not None:
        raise CorruptCheckpointError(f"{where}: chunk at {offsets[missing]} has no storage record")
    if any(len(o) != ndim for o in offsets) or any(len(s) != ndim for s in sizes):
        bad = next(k for k in range(n) if len(offsets[k]) != ndim or len(sizes[k]) != ndim)
        raise CorruptCheckpointError(f"{where}: chunk {offsets[bad]}+{sizes[bad]} has rank {len(sizes[bad])}, "
                                     f"tensor has rank {ndim}")
    shape = (n, ndim)
    return ChunkTable(_int_columns(offsets, shape, f"{where} chunk offsets"), _int_columns(sizes, shape, f"{where} chunk sizes"),
                      np.array([r[0] for r in placed], dtype=np.int32), np.array([r[1] for r in placed], dtype=np.int64),
                      np.array([r[2] for r in placed], dtype=np.int64), files,
                      {k: r[3] for k, r in enumerate(placed) if r[3]})


def _containers(value: Any, meta_path: Path) -> dict[tuple, str]:
    if value is None:
        return {}
    ok = isinstance(value, dict) and all(
        isinstance(k, tuple) and all(type(x) in (str, int) for x in k) and v in ("dict", "tuple") for k, v in value.items())
    if not ok:
        raise CorruptCheckpointError(f"{meta_path}: reshard_containers is not a map of nested paths to 'dict'/'tuple'")
    return dict(value)
