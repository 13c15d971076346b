"""torch.distributed.checkpoint directories: ``.metadata`` plus ``__{rank}_{n}.distcp`` files.

Reading: ``.metadata`` (or, saved with ``use_collectives=False``, every ``__{rank}.metadata``
merged: ``dcp.ranks``) is loaded without trusting it (``dcp.metadata``), then every record is
placed and checked (``dcp_records``): a torch.save zip, whose payload record is raw bytes we
read or kernel-copy directly; a zstd frame around one (``dcp_zstd``, decompressed as a stream
on read); or a tensor of the safetensors blob torch writes with
``SerializationFormat.SAFETENSORS`` (``dcp_safetensors``), again raw bytes at a known offset.
Objects are unpickled (by the allow-list unpickler) only when something asks for them, so a
conversion that keeps the model never reads the optimizer's or the data loader's pickles.

Writing: we write the default form, so torch's own ``dcp.load`` and ``dcp_to_torch_save``
read our output; ``.metadata`` is written last, which is what makes a DCP folder look complete.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from reshard.formats.dcp.index import load_dcp_index
from reshard.formats.dcp.locate import RecordLocator, TensorRecords
from reshard.formats.dcp.metadata import ChunkTable, DCPIndex, StorageRecord
from reshard.formats.dcp.ranks import CheckedCopies, rank_metadata_files, same_bytes
from reshard.formats.dcp.records import BLOB, ZIP, ZSTD, Item, Placed, RecordColumns, place_records, sniff_record
from reshard.formats.dcp.zstd import ZstdChunk, load_zstd_object
from reshard.formats.torch.zip import load_object_blob, read_torch_zip
from reshard.formats.torch.zip_write import PieceRef, torch_save_bytes, torch_save_segments

from reshard.core.boxes import Box
from reshard.core.catalog import Catalog, Chunk, ChunkData, IndexedTensorEntry, ObjectTable, TensorEntry
from reshard.core.columns import unique_rows
from reshard.core.dtypes import DType
from reshard.core.errors import CorruptCheckpointError
from reshard.core.pieces import OutputFile, PieceTable, SegmentTable
from reshard.core.regions import StoredRegion
from reshard.core.storage import will_read
from reshard.core.structure import dcp_path, from_dcp_path
from reshard.core.target import Target
from reshard.pipeline.options import WriterOptions

if TYPE_CHECKING:
    import torch

__all__ = ["DCPFormat", "DCPWriter"]

_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp")


def _copies(index: DCPIndex, name: str, rec: StorageRecord, box: Box | None = None, dtype: DType | None = None
            ) -> list[Item]:
    """The item and, when several ranks wrote it (use_collectives=False), the others' copies."""
    return [Item(name, r, box, dtype) for r in [rec, *index.copies.get((name, box.offsets if box else ()), [])]]


def _items(index: DCPIndex) -> list[Item]:
    """Every record to place: each chunk that holds elements and each object, every rank's copy."""
    items = []
    for name, (_, dtype, chunks) in index.tensors.items():
        for box, rec in chunks:
            if box.numel:  # empty shards (more ranks than rows) hold no bytes worth reading
                items += _copies(index, name, rec, box, dtype)
    for name, rec in index.objects.items():
        items += _copies(index, name, rec)
    return items


def _chunk_data(root: Path, it: Item, placed: Placed, path: Path | None = None) -> ChunkData:
    path = path or root / it.rec.relpath
    where = f"{path}: {it.describe()}"
    assert it.box is not None and it.dtype is not None  # a tensor chunk's item
    if placed.kind == ZSTD:
        return ZstdChunk(path, it.rec.offset, it.rec.length, it.dtype, it.box.sizes, where)
    if placed.kind != ZIP:
        assert placed.region is not None  # a blob's, located by place_records
        return placed.region
    region = read_torch_zip(path, it.rec.offset, it.rec.length, it.name)
    if not isinstance(region, StoredRegion):
        raise CorruptCheckpointError(f"{where} holds {type(region).__name__}, not a tensor")
    if region.shape != it.box.sizes or region.dtype != it.dtype:
        raise CorruptCheckpointError(
            f"{where} stores {region.dtype} {list(region.shape)}, metadata says {it.dtype} {list(it.box.sizes)}"
        )
    return region


def _lazy_object(root: Path, name: str, rec: StorageRecord) -> Callable[[], Any]:
    it = Item(name, rec)
    return lambda: _object_loader(root, it, Placed(sniff_record(root / rec.relpath, it, allow_blob=False)))()


def _object_loader(root: Path, it: Item, placed: Placed) -> Callable[[], Any]:
    path, rec = root / it.rec.relpath, it.rec
    if placed.kind == ZSTD:
        return lambda: load_zstd_object(path, rec.offset, rec.length, f"{path}: {it.describe()}", it.name)
    return lambda: load_object_blob(path, rec.offset, rec.length, lambda r: r.read_all(), it.name)


class _LazyChunk:
    """A chunk's record, read the first time its bytes are wanted: the torch.save archive (or
    zstd frame around one) is located and checked against ``.metadata`` then. Reading every
    archive's header up front would cost a read per chunk before ``inspect`` could print."""

    __slots__ = ("path", "name", "table", "k", "located", "box", "dtype", "_data")
    _data: ChunkData | None

    def __init__(self, path: Path, name: str, table: ChunkTable, k: int, located: np.ndarray, box: Box,
                 dtype: DType) -> None:
        self.path, self.name, self.table, self.k, self.located = path, name, table, k, located
        self.box, self.dtype, self._data = box, dtype, None

    @property
    def rec(self) -> StorageRecord:
        return self.table.record(self.k)

    def resolve(self) -> ChunkData:
        """The chunk's bytes, located once per record: a contiguous tensor's data offset is
        kept in the tensor's ``located`` column, so a chunk made afresh for the next piece
        that reads it (entries do not hold chunk objects) is not parsed again."""
        if self._data is None:
            at = int(self.located[self.k])
            if at >= 0:
                self._data = StoredRegion(self.path, at, self.dtype, self.box.sizes)
                return self._data
            rec = self.rec
            will_read(self.path, rec.offset, rec.length)  # on an object store: one request, not one per header
            it = Item(self.name, rec, self.box, self.dtype)
            kind = sniff_record(self.path, it, allow_blob=False)
            data = _chunk_data(self.path.parent, it, Placed(kind), self.path)
            if isinstance(data, StoredRegion) and data.is_contiguous:
                self.located[self.k] = data.offset
            self._data = data
        return self._data

    def region(self) -> StoredRegion | None:
        data = self.resolve()
        return data if isinstance(data, StoredRegion) else None

    def read(self, box: Box) -> torch.Tensor:
        return self.resolve().read(box)


def _lazy_entry(name: str, shape: tuple[int, ...], dtype: DType, table: ChunkTable,
                file_paths: list[Path], locator: RecordLocator) -> TensorEntry:
    """``file_paths``: the folder's data files as paths, made once for all tensors (a path per
    chunk cost more than the rest of planning)."""
    # No empty shards (the usual case): the columns as they are, not copies.
    rows = None if table.sizes.all() else table.nonempty()
    # each record's tensor data offset, once known (``TensorRecords.located``): made when first asked
    records = TensorRecords(name, table, rows, dtype)

    def make(i: int, box: Box) -> ChunkData:
        k = i if rows is None else int(rows[i])
        return _LazyChunk(file_paths[table.file[k]], name, table, k, records.located_column(), box, dtype)

    def paths() -> set[Path]:
        return {file_paths[f] for f in set((table.file if rows is None else table.file[rows]).tolist())}

    # Chunk objects are not held, except zstd ones: each keeps its paused decompression stream
    # for the next piece that reads on from where the last one stopped.
    keep = bool(table.transforms)
    offsets, sizes = (table.offsets, table.sizes) if rows is None else (table.offsets[rows], table.sizes[rows])
    return IndexedTensorEntry(name, shape, dtype, offsets, sizes, make, paths, keep=keep, locator=locator, records=records)


def _region_of(file_paths: list[Path]) -> Callable[[TensorRecords, int], StoredRegion | None]:
    """How ``RecordLocator`` reads one record on its own: as a lazy chunk would."""
    def region(records: TensorRecords, k: int) -> StoredRegion | None:
        table = records.table
        return _LazyChunk(file_paths[table.file[k]], records.name, table, k, records.located_column(), table.box(k),
                          cast(DType, records.dtype)).region()
    return region


def _fast_path(root: Path, index: DCPIndex, records: RecordColumns) -> bool:
    """Whether records can be read lazily: every rank wrote its own (no copies), no two records
    of a file start at one byte, and each file's first tensor record is a torch.save archive
    or a zstd frame (not the safetensors blob of SerializationFormat.SAFETENSORS, whose shared
    offsets need the blob's header read up front: ``place_records``). One read per file."""
    if index.copies or records.shared_starts():
        return False
    first = records.first_tensor_record()
    return all(sniff_record(root / index.files[f], records.item(k)) != BLOB for f, k in first.items())


class DCPFormat:
    name = "dcp"

    def detect(self, path: Path) -> bool:
        return path.is_dir() and ((path / ".metadata").is_file() or bool(rank_metadata_files(path)))

    def read(self, path: Path) -> Catalog:
        index = load_dcp_index(path)
        catalog = Catalog(format=self.name, path=path)
        if index.containers:
            catalog.paths = {n: from_dcp_path(p, index.containers) for n, p in index.paths.items()}
            catalog.facts.containers = index.containers
        else:
            catalog.paths = index.paths
        for name in index.tensors:  # columns for every tensor (merged rank files come as lists)
            index.table(name)
        ranks = {int(m.group(1)) for f in index.files if (m := _DATA_FILE.fullmatch(f))}
        if ranks:
            catalog.facts.source_world_size = max(ranks) + 1
        records = RecordColumns(index)
        if _fast_path(path, index, records):
            records.check(path)
            file_paths = [path / f for f in index.files]
            locator = RecordLocator(file_paths, _region_of(file_paths))
            for name, (shape, dtype, _) in index.tensors.items():
                catalog.tensors[name] = _lazy_entry(name, shape, dtype, index.table(name), file_paths, locator)
            catalog.objects = ObjectTable({name: _lazy_object(path, name, rec) for name, rec in index.objects.items()})
            return catalog
        placed = place_records(path, _items(index))
        for name, (shape, dtype, chunks) in index.tensors.items():
            entry = TensorEntry(name, shape, dtype)
            for box, rec in chunks:
                if box.numel == 0:
                    continue
                data = [(_chunk_data(path, it, placed[it]), path / it.rec.relpath) for it in _copies(index, name, rec, box,
                                                                                                     dtype)]
                entry.chunks.append(Chunk(box, data[0][0] if len(data) == 1 else CheckedCopies(data, name)))
            catalog.tensors[name] = entry
        loaders = {}
        for name, rec in index.objects.items():
            first, *others = _copies(index, name, rec)
            loaders[name] = _object_loader(path, first, placed[first])
            if others:
                loaders[name] = same_bytes(path, name, [it.rec for it in (first, *others)], loaders[name])
        catalog.objects = ObjectTable(loaders)
        return catalog

    def writer(self, dst: Path | str, options: WriterOptions | None = None) -> DCPWriter:
        return DCPWriter()


class _Computed(Mapping):
    """A read-only mapping over ``keys`` whose values ``value(key)`` makes on each access."""

    def __init__(self, keys: list[str], value: Callable[[str], Any]) -> None:
        self._keys, self._value = keys, value

    def __getitem__(self, key: str) -> Any:
        return self._value(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class DCPWriter:
    """One ``__{rank}_0.distcp`` per target rank holding the boxes the target assigns to that
    rank; objects in rank 0's file.

    Laid out in columns (``PieceTable``, ``SegmentTable``): a mesh layout of a fine-grained
    MoE has hundreds of thousands of chunks, each its own torch.save archive, and the archives
    of one dtype and shape differ only in their payload, so each kind is built once and every
    chunk's place in its file is an array operation."""

    output_is_dir = True

    def __init__(self) -> None:
        # Where each chunk's record lies, per row of the layout's PieceTable: (file, offset, length).
        self._table: PieceTable | None = None
        self._file = self._start = self._length = np.zeros(0, dtype=np.int64)
        self._relpaths: list[str] = []
        self._objects: dict[str, tuple[str, int, int]] = {}

    def layout(self, target: Target) -> list[OutputFile]:
        table = self._table = PieceTable.of_target(target)
        self._relpaths = [f"__{r}_0.distcp" for r in range(target.world_size)]
        self._objects = {}
        literals, head, tail = self._archives(table)
        lengths = np.array([len(b) for b in literals], dtype=np.int64)
        nbytes = table.nbytes
        blob = lengths[head] + nbytes + lengths[tail]  # each row's archive
        self._file, self._start, self._length = table.rank, np.zeros(len(table), dtype=np.int64), blob
        files = []
        for rank, relpath in enumerate(self._relpaths):
            rows = np.flatnonzero(table.rank == rank)
            self._start[rows] = np.cumsum(blob[rows]) - blob[rows]
            kind = np.stack([head[rows], np.full(len(rows), -1), tail[rows]], axis=1).reshape(-1)
            row = np.stack([np.full(len(rows), -1), rows, np.full(len(rows), -1)], axis=1).reshape(-1)
            if rank == 0 and target.objects:
                at = int(blob[rows].sum())
                extra = []
                for name, value in target.objects.items():
                    # What torch.save writes, without torch.save's imports: an opted-in class (an inert
                    # stand-in) is written back under its own name (reshard.safe_pickle.unpickler.allow_classes).
                    data = torch_save_bytes(value)
                    self._objects[name] = (relpath, at, len(data))
                    at += len(data)
                    extra.append(len(literals))
                    literals.append(data)
                kind = np.concatenate([kind, extra])
                row = np.concatenate([row, np.full(len(extra), -1)])
            # A rank that stores nothing (its shards are replicas kept by others) gets no file.
            if len(kind) or rank == 0:
                segments = SegmentTable(table, literals, kind.astype(np.int64), row.astype(np.int64))
                files.append(OutputFile(relpath, cast(list, segments)))  # a SegmentTable is a sequence of segments
        return files

    @staticmethod
    def _archives(table: PieceTable) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """(literals, head, tail): the torch.save archive around each row's box is
        ``literals[head[row]]``, the box's bytes, ``literals[tail[row]]``. Its bytes depend
        only on the box's dtype and shape (offsets inside an archive are archive-relative):
        one archive per kind, the row's piece in it."""
        codes = {d: i for i, d in enumerate(dict.fromkeys(table.dtypes))}
        dtype_code = np.array([codes[d] for d in table.dtypes], dtype=np.int64)[table.tensor]
        # rows of one kind: same dtype, same sizes over the tensor's own dims (padding is 1s)
        key = np.column_stack([dtype_code, table.ndim[table.tensor], table.sizes])
        first, kind_of = unique_rows(key)
        literals: list[bytes] = []
        head_of, tail_of = [], []
        for row in first.tolist():
            piece = table.piece(row)
            segments = torch_save_segments(PieceRef("0", piece.dtype, piece.box.sizes), {"0": piece})
            at = next(i for i, s in enumerate(segments) if s is piece)
            head_of.append(len(literals))
            literals.append(b"".join(segments[:at]))  # type: ignore[arg-type]
            tail_of.append(len(literals))
            literals.append(b"".join(segments[at + 1:]))  # type: ignore[arg-type]
        kind_of = kind_of.reshape(-1)
        return literals, np.array(head_of, dtype=np.int64)[kind_of], np.array(tail_of, dtype=np.int64)[kind_of]

    def finish(self, staging: Path, target: Target, files: list[OutputFile]) -> None:
        # Deferred: only writing needs it, and its dataclasses cost every reading command 7 ms.
        from reshard.formats.dcp.metadata_write import TensorTable, write_metadata

        table = self._table
        if table is None or table.pattern is None or list(target.tensors) != table.names:
            raise ValueError("DCPWriter.finish: the target is not the one laid out")
        count = np.bincount(table.tensor, minlength=len(table.names))
        tensors = TensorTable(table.names, table.dtypes, [t.shape for t in target.tensors.values()], table.first, count,
                              table.pattern, table.offsets, table.sizes, self._file, self._start, self._length,
                              self._relpaths)
        objects = {name: self._objects[name] for name in target.objects}
        # Paths as torch's dcp.save spells them (dict keys as strings), so torch's readers
        # rebuild what they would from their own save; the int keys and tuples it cannot
        # express ride beside them, for reshard's reader.
        containers = dict(target.facts.containers or {})
        names = [*target.tensors, *objects]
        planner_data = _Computed(names, lambda name: dcp_path(target.nested_path(name), containers))
        with open(staging / ".metadata", "wb") as out:  # written as made: tens of MiB at 100k tensors
            write_metadata(out, tensors, objects, planner_data, containers)

    def notices(self, target: Target) -> list[str]:
        return []
