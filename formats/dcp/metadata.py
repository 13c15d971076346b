"""Loading and validating a DCP ``.metadata`` file without trusting it.

torch pickles ``Metadata`` with plain pickle, and its own reader unpickles it the same way,
so a crafted ``.metadata`` runs code on load. We unpickle with an allow-list that maps DCP's
class names to inert records of our own (nothing of torch.distributed is imported or
constructed), then check the structure: every tensor's chunks tile it exactly once, every
chunk has a storage record, and every record names a file inside the checkpoint folder.

A folder saved with ``use_collectives=False`` has no ``.metadata`` but one
``__{rank}.metadata`` per rank; those are merged first (``dcp.ranks``) and checked as one.

Each stand-in knows every field torch 2.9 through 2.15 writes for its class (and what
Megatron-Core and reshard add). A field or state it does not know is refused as a newer
format (``NewerFormatError``): torch grows these classes between releases (2.15 added
``TensorProperties.strides``), and a field we skipped could change what the bytes mean.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from reshard.core import dtypes
from reshard.core.boxes import Box
from reshard.core.dtypes import DType
from reshard.core.errors import CorruptCheckpointError, NewerFormatError, ReshardError, UnsafeCheckpointError
from reshard.core.gc_pause import paused_gc
from reshard.core.torch_support import FLOOR, NEWEST_TESTED
from reshard.core.version import __version__
from reshard.safe_pickle.unpickler import safe_loads

__all__ = ["StorageRecord", "ChunkTable", "DCPIndex", "NewerFormatError", "read_metadata_file", "DCP_VERSIONS"]

_MAX_METADATA_BYTES = 1 << 30
# Metadata.version, the DCP format's own version (filesystem.CURRENT_DCP_VERSION); None before 2.4.
DCP_VERSIONS = frozenset({None, "1.0.0"})


class _NewField(ReshardError):
    """Raised inside the unpickler (which passes reshard's errors through); ``_unpickled``
    turns it into a ``NewerFormatError`` that names the file."""


class _Record:
    """A DCP metadata object as plain attributes, filled by pickle's BUILD step.

    Each stand-in keeps only the fields reshard reads, in ``__slots__``: a 2048-rank checkpoint
    has millions of chunk records, and a slotted object is a fifth of a dict-backed one (and
    faster to fill than torch's own dataclasses). Like torch's dataclasses, those that are not
    frozen cannot be hashed, so a file that uses one as a key is refused here as torch refuses it."""

    __slots__: tuple[str, ...] = ()
    # Fields torch writes that reshard does not need: known, so not refused, but not kept.
    _ignored: ClassVar[frozenset[str]] = frozenset()
    # None: unhashable, Python's way, which typeshed's object.__hash__ (a method) does not allow
    __hash__: ClassVar[Callable[[object], int] | None] = None  # type: ignore[assignment]

    def __setstate__(self, state: Any) -> None:
        fields = _as_dict(self, state)  # once per object: hundreds of thousands are unpickled
        _refuse_unknown(self, fields)
        for name in self.__slots__:
            object.__setattr__(self, name, fields.get(name))

    def __getattr__(self, name: str) -> Any:
        """A field the pickle never set (no BUILD): absent, as a missing key of its state is."""
        if name in type(self).__slots__:
            return None
        raise AttributeError(name)


def _as_dict(obj: _Record, state: Any) -> dict:
    if type(state) is dict:
        return state
    if isinstance(state, tuple) and len(state) == 2 and all(isinstance(x, (dict, type(None))) for x in state):
        return {**(state[0] or {}), **(state[1] or {})}  # (__dict__, __slots__) state
    raise ValueError(f"unexpected state for {type(obj).__name__}")  # safe_loads adds the file name


def _torch_name(obj: _Record) -> str:
    return type(obj).__name__.lstrip("_") if type(obj) is not StorageInfo else "_StorageInfo"


def _refuse_unknown(obj: _Record, fields: dict) -> None:
    unknown = fields.keys() - obj.__slots__ - obj._ignored
    if unknown:
        names = ", ".join(repr(n) for n in sorted(map(str, unknown)))
        raise _NewField(f"{_torch_name(obj)} has field{'s' if len(unknown) > 1 else ''} {names}, which reshard does not know")


class Metadata(_Record):
    # reshard_containers: written by reshard beside torch's fields (reshard.core.structure)
    __slots__ = ("state_dict_metadata", "planner_data", "storage_data", "reshard_containers", "version")
    # storage_meta: the run that saved it (ids, module names); all_local_plans: Megatron-Core's
    # copy of every rank's SavePlan, which the chunks and storage records say again
    _ignored = frozenset({"storage_meta", "all_local_plans"})
    state_dict_metadata: Any
    planner_data: Any
    storage_data: Any
    reshard_containers: Any
    version: Any


class TensorStorageMetadata(_Record):
    __slots__ = ("properties", "size", "chunks")


class BytesStorageMetadata(_Record):
    __slots__ = ()


class ChunkStorageMetadata(_Record):
    __slots__ = ("offsets", "sizes")

    def __setstate__(self, state: Any) -> None:  # one per chunk: written out for speed
        try:
            self.offsets, self.sizes = state["offsets"], state["sizes"]
            if len(state) == 2:
                return
        except (KeyError, TypeError):  # not torch's usual dict: the general path
            pass
        state = _as_dict(self, state)
        _refuse_unknown(self, state)
        self.offsets, self.sizes = state.get("offsets"), state.get("sizes")


class StorageMeta(_Record):
    __slots__ = ()
    _ignored = frozenset({"checkpoint_id", "save_id", "load_id", "modules"})


class MetadataIndex(_Record):
    __slots__ = ("fqn", "offset", "index")
    __hash__ = object.__hash__  # frozen in torch: storage_data's keys

    def __setstate__(self, state: Any) -> None:
        try:
            self.fqn, self.offset, self.index = state["fqn"], state["offset"], state["index"]
            if len(state) == 3:
                return
        except (KeyError, TypeError):
            pass
        state = _as_dict(self, state)
        _refuse_unknown(self, state)
        self.fqn, self.offset, self.index = state.get("fqn"), state.get("offset"), state.get("index")


class StorageInfo(_Record):
    # transform_descriptors: torch >= 2.8, and only where an extension (zstd) was applied
    __slots__ = ("relative_path", "offset", "length", "transform_descriptors")

    def __setstate__(self, state: Any) -> None:
        try:
            self.relative_path, self.offset, self.length = state["relative_path"], state["offset"], state["length"]
            self.transform_descriptors = state.get("transform_descriptors")
            if len(state) == 3 or (len(state) == 4 and "transform_descriptors" in state):
                return
        except (KeyError, TypeError, AttributeError):
            pass
        state = _as_dict(self, state)
        _refuse_unknown(self, state)
        self.relative_path, self.offset, self.length = state.get("relative_path"), state.get("offset"), state.get("length")
        self.transform_descriptors = state.get("transform_descriptors")


class _TensorProperties(_Record):
    """DCP pickles ``(dtype, layout, requires_grad, memory format code, pin_memory)``, and
    from torch 2.15 on ``strides`` after them: the saved tensor's strides (``(1, 4)`` for a
    transposed 4x2 weight). They say how the tensor lay in the saving process's memory, not
    how its bytes are stored: each torch.save record carries its own strides (read from the
    record, as torch does), and a safetensors blob is row-major whatever the tensor was. So
    reshard checks them and keeps them, and reads nothing by them."""

    __slots__ = ("dtype", "strides")
    _ignored = frozenset({"layout", "requires_grad", "memory_format", "pin_memory"})

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) in (5, 6):
            self.dtype = state[0]
            self.strides = state[5] if len(state) == 6 else None
        elif isinstance(state, tuple):
            raise _NewField(f"TensorProperties has {len(state)} fields, which reshard does not know "
                            "(it knows torch's 5 and, from torch 2.15, 6 with strides)")
        else:
            super().__setstate__(state)


_LAYOUTS = frozenset({"torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc", "torch.sparse_bsr",
                      "torch.sparse_bsc", "torch._mkldnn", "torch.jagged"})


def _layout(name: Any) -> str:
    """torch's ``_get_layout(name)``: the layout's name is all reshard keeps (and checks)."""
    if name not in _LAYOUTS:
        raise ValueError(f"tensor layout {name!r} is not one of torch's")  # safe_loads adds the file name
    return name


def _memory_format_code(value: Any) -> int:
    """torch's _MEM_FORMAT_ENCODING(value): contiguous, channels_last, preserve (0, 1, 2)."""
    if type(value) is not int or value not in (0, 1, 2):
        raise ValueError(f"memory format code {value!r} is not one of torch's (0, 1, 2)")  # safe_loads adds the file name
    return value


class _SavePlanRecord(_Record):
    """Megatron-Core adds every rank's ``SavePlan`` to ``Metadata`` (``all_local_plans``):
    read as data and dropped, because the chunks and storage records say all of it again."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        pass


def _write_item_type(value: Any) -> int:
    """torch's ``WriteItemType(value)``, an enum of 1 (tensor), 2 (shard), 3 (bytes)."""
    if type(value) is not int or value not in (1, 2, 3):
        raise ValueError(f"WriteItemType {value!r} is not one of torch's (1, 2, 3)")  # safe_loads adds the file name
    return value


_DCP = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
_PACKAGE = "torch.distributed.checkpoint"


class _DCPGlobals(dict):
    """The allow-list of ``.metadata``. A name of torch's DCP package that is not on it is a
    class a newer torch added (as it adds fields): refused as a newer format, which upgrading
    reshard fixes, and never built (``--allow-class`` does not apply: DCP metadata is read
    into reshard's own records, with no stand-ins). Other names are refused as unsafe."""

    def __missing__(self, key: tuple[str, str]) -> Any:
        module, name = key
        if module == _PACKAGE or module.startswith(_PACKAGE + "."):
            raise _NewField(f"refers to {module}.{name}, a class of torch's DCP package which reshard does not know")
        raise KeyError(key)


_GLOBALS = _DCPGlobals({
    (_DCP, "Metadata"): Metadata,
    (_DCP, "TensorStorageMetadata"): TensorStorageMetadata,
    (_DCP, "BytesStorageMetadata"): BytesStorageMetadata,
    (_DCP, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_DCP, "TensorProperties"): _TensorProperties,
    (_DCP, "StorageMeta"): StorageMeta,
    (_DCP, "MetadataIndex"): MetadataIndex,
    (_DCP, "_MEM_FORMAT_ENCODING"): _memory_format_code,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    **{(_PLANNER, n): _SavePlanRecord for n in ("SavePlan", "WriteItem", "TensorWriteData")},
    (_PLANNER, "WriteItemType"): _write_item_type,
    ("torch", "Size"): tuple,  # a torch.Size is a tuple; building torch's costs more and gives nothing here
    ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): __import__("pathlib").PurePosixPath,
    ("pathlib", "WindowsPath"): __import__("pathlib").PureWindowsPath,
    ("pathlib", "PurePosixPath"): __import__("pathlib").PurePosixPath,
    **{("torch", name): dt for name, dt in dtypes.DTYPES.items()},
})


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


def _unpickled(meta_path: Path) -> Any:
    """``.metadata`` unpickled with the cyclic garbage collector paused: a 256-rank file makes
    millions of objects, none in a reference cycle, and the collector's passes over them were
    a third of the unpickling time."""
    with paused_gc():
        try:
            return safe_loads(meta_path.read_bytes(), _GLOBALS, origin=meta_path)
        except _NewField as e:
            raise _newer(meta_path, str(e)) from None


def _newer(meta_path: Path, what: str) -> NewerFormatError:
    """The refusal of a ``.metadata`` newer than reshard. DCP records no torch version, so the
    message names the newest torch reshard was tested with."""
    return NewerFormatError(f"{meta_path}: {what}: written by a torch newer than reshard {__version__} supports "
                            f"(it reads DCP from torch {FLOOR} to {NEWEST_TESTED}); upgrade reshard (pip install -U reshard)")


def read_metadata_file(meta_path: Path, root: Path) -> DCPIndex:
    """One pickled ``Metadata`` (``.metadata`` or a rank's ``__R.metadata``), validated entry
    by entry into columns; chunks are not yet checked to tile their tensors (a rank's file
    holds only its own)."""
    size = meta_path.stat().st_size
    if size > _MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{meta_path}: {size} bytes is implausibly large for DCP metadata")
    meta = _unpickled(meta_path)
    if type(meta) is not Metadata or not isinstance(meta.state_dict_metadata, dict):
        raise CorruptCheckpointError(f"{meta_path}: does not hold DCP Metadata")
    if not isinstance(meta.storage_data, dict):
        raise CorruptCheckpointError(f"{meta_path}: has no storage records (storage_data)")
    if meta.version not in DCP_VERSIONS:
        if not isinstance(meta.version, str):
            raise CorruptCheckpointError(f"{meta_path}: DCP version {meta.version!r} is not a string")
        raise _newer(meta_path, f"DCP format version {meta.version!r}, which reshard does not know")
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
        dtype = md.properties.dtype if type(md.properties) is _TensorProperties else None
        if not isinstance(dtype, DType) or any(s < 0 for s in shape):
            raise CorruptCheckpointError(f"{where}: invalid dtype {dtype!r} or shape {shape}")
        strides = md.properties.strides
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
