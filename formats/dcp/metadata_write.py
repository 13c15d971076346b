"""Writing DCP's ``.metadata`` without importing torch.distributed.checkpoint.

torch reads ``.metadata`` with pickle, so the file must name torch's own classes
(``torch.distributed.checkpoint.metadata.Metadata`` ...). Importing that package to build
real instances costs one to two seconds (it pulls in all of DTensor), more than converting a
whole small checkpoint takes. Instead the classes below mirror torch's dataclasses field for
field; they are pickled by the C pickler with protocol 2, where each class appears exactly
once as a ``GLOBAL module\nname\n`` opcode, and those opcodes are then renamed to torch's
module. Tests check that torch's ``FileSystemReader.read_metadata`` and ``dcp.load`` read the
result as their own.
"""

from __future__ import annotations

import enum
import functools
import io
import pickle
import struct
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
from reshard.formats.dcp.opcode_rows import Slot, int_slot, join_rows, table_slot

from reshard.core.columns import unique_rows
from reshard.core.dtypes import DType

if TYPE_CHECKING:
    import torch

__all__ = ["TensorTable", "write_metadata"]

_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"


class _MEM_FORMAT_ENCODING(enum.Enum):  # noqa: N801 - torch's name, renamed in the pickle
    TORCH_CONTIGUOUS_FORMAT = 0


@dataclass
class ChunkStorageMetadata:
    offsets: torch.Size
    sizes: torch.Size


@dataclass
class TensorProperties:
    dtype: DType

    def __getstate__(self) -> tuple:
        # torch's own state: (dtype, layout, requires_grad, memory format code, pin_memory)
        import torch

        return (self.dtype, torch.strided, False, _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, False)


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    pass


@dataclass
class StorageMeta:
    checkpoint_id: Any = None
    save_id: Any = None
    load_id: Any = None
    modules: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class MetadataIndex:
    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(hash=False, compare=False, default=None)


@dataclass
class Metadata:
    state_dict_metadata: dict[str, Any]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None
    # Not torch's: int-keyed dicts and tuples that planner_data cannot express (torch's reader
    # keeps unknown attributes and ignores them; reshard's restores the structure from it).
    reshard_containers: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if not state.get("reshard_containers"):
            del state["reshard_containers"]
        return state


@dataclass
class _StorageInfo:
    relative_path: str
    offset: int
    length: int

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)


_TORCH_MODULE = {c.__name__: _META for c in (_MEM_FORMAT_ENCODING, ChunkStorageMetadata, TensorProperties,
                                             TensorStorageMetadata, BytesStorageMetadata, StorageMeta, MetadataIndex, Metadata)}
_TORCH_MODULE["_StorageInfo"] = _FS


@dataclass(frozen=True)
class TensorTable:
    """Every tensor's entry as columns. Tensor ``t`` is ``names[t]`` of ``dtypes[t]`` and
    ``shapes[t]``; its chunks, in storage order, are rows ``first[t]`` to ``first[t] +
    count[t]``. Row ``i`` is the box ``offsets[i]`` / ``sizes[i]`` (``[rows, width]`` arrays,
    a tensor's own dims first), stored in ``relpaths[file[i]]`` from byte ``start[i]``,
    ``length[i]`` bytes. ``pattern[t]``: tensors with one pattern have the same boxes."""

    names: list[str]
    dtypes: list[DType]
    shapes: list[tuple[int, ...]]
    first: np.ndarray
    count: np.ndarray
    pattern: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    file: np.ndarray
    start: np.ndarray
    length: np.ndarray
    relpaths: list[str]


def _rename_globals(data: bytes) -> bytes:
    """Our stand-in classes' GLOBAL opcodes renamed to torch's modules. Without the memo each
    class is named at each use; no name in the pickle contains our module (checked first), so
    every occurrence is an opcode."""
    for name, module in _TORCH_MODULE.items():
        data = data.replace(f"c{__name__}\n{name}\n".encode(), f"c{module}\n{name}\n".encode())
    if f"{__name__}\n".encode() in data:
        raise ValueError("cannot write DCP metadata: a class reference was left unnamed")
    return data


def write_metadata(out: BinaryIO, tensors: TensorTable, objects: dict[str, tuple[str, int, int]],
                   planner_data: Mapping[str, tuple], containers: dict[tuple, str] | None = None) -> None:
    """Write to ``out`` the pickle of a DCP ``Metadata`` for these tensors (chunks in storage
    order) and byte objects (name -> (relpath, offset, length)); ``containers``: see
    ``reshard.core.structure``.

    The small outer object is pickled by the pickler; its three big dicts (one entry per
    tensor or chunk) are written by ``_Opcodes``, entry by entry, as the pickler would write
    them: nothing is held per chunk, and names and classes are memoized as the pickler does,
    so the file is as compact as its own pickle."""
    for name in (*tensors.names, *objects):
        if __name__ in name:  # it would read as one of our class references: refuse rather than guess
            raise ValueError(f"cannot write DCP metadata: the name {name!r} contains {__name__!r}")
    ops = _Opcodes()
    big = {"state_dict_metadata": ops.state_dict_metadata(tensors, objects),
           "storage_data": ops.storage_data(tensors, objects),
           "planner_data": ops.planner_data(planner_data)}
    # The outer object with a unique token in place of each big dict, pickled without a memo
    # (so its opcodes use no memo slots of ours); each token's opcodes are then replaced by
    # the dict's, in the order the tokens appear.
    tokens = {part: f"reshard-{uuid.uuid4().hex}" for part in big}
    meta = Metadata(tokens["state_dict_metadata"], planner_data=tokens["planner_data"],  # type: ignore[arg-type]
                    storage_data=tokens["storage_data"], storage_meta=StorageMeta(), version="1.0.0",
                    reshard_containers=containers or None)
    head = _rename_globals(_unmemoized(meta))
    placeholders = {part: ops.text(token, memo=False) for part, token in tokens.items()}
    out.write(pickle.PROTO + b"\x02")
    at = 0
    for where, part in sorted((head.index(placeholders[p]), p) for p in big):
        out.write(head[at:where])
        for opcodes in big[part]:
            out.write(opcodes)
        at = where + len(placeholders[part])
    out.write(head[at:] + pickle.STOP)


def _unmemoized(obj: Any) -> bytes:
    """``obj``'s pickle opcodes, without the PROTO header, STOP or any memo slot."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=2, fix_imports=False)
    pickler.fast = True
    pickler.dump(obj)
    return buf.getvalue()[2:-1]


_SETITEMS_BATCH = 1000  # items per SETITEMS / APPENDS, as the pickler batches them
_ROWS_AT_ONCE = 1 << 16  # storage entries assembled at once (``_StorageRows``)
_META_CLASS = {name: f"{module}\n{name}" for name, module in _TORCH_MODULE.items()}  # as GLOBAL names them


class _Opcodes:
    """Protocol-2 opcodes for DCP's metadata records, written as Python's pickler writes
    these dataclasses (``NEWOBJ`` with no arguments, then ``BUILD`` with their state) and
    memoized as it memoizes them: each class, dtype, field name and tensor name once, then
    ``BINGET``. torch's reader and reshard's read them as the pickler's own."""

    def __init__(self) -> None:
        self._memo: dict[Any, int] = {}
        self._stable: dict[Any, bytes] = {}
        self._text_refs: dict[str, bytes] = {}

    def _cached(self, key: Any, make: Callable[[], bytes]) -> bytes:
        """``make()``, kept under ``key`` once it is stable: made without adding to the memo,
        its bytes only refer to memo slots that never change, so the same inputs give the
        same bytes from then on (a model's layers repeat a handful of chunk layouts)."""
        out = self._stable.get(key)
        if out is None:
            before = len(self._memo)
            out = make()
            if len(self._memo) == before:
                self._stable[key] = out
        return out

    def _memoized(self, key: Any, first: Callable[[], bytes]) -> bytes:
        index = self._memo.get(key)
        if index is not None:
            return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)
        index = self._memo[key] = len(self._memo)
        return first() + (b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index))

    def text(self, value: str, memo: bool = True) -> bytes:
        ref = self._text_refs.get(value) if memo else None
        if ref is not None:  # a name or field met before: its memo reference, made once
            return ref
        data = value.encode("utf-8", "surrogatepass")
        encoded = b"X" + struct.pack("<I", len(data)) + data
        if not memo:
            return encoded
        out = self._memoized(("str", value), lambda: encoded)
        self._text_refs[value] = self._memoized(("str", value), lambda: encoded)
        return out

    def _global(self, qualified: str) -> bytes:
        return self._memoized(("global", qualified), lambda: b"c" + qualified.encode() + b"\n")

    @staticmethod
    def _int(value: int) -> bytes:
        if 0 <= value < 256:
            return b"K" + bytes([value])
        if 0 <= value < 65536:
            return b"M" + struct.pack("<H", value)
        if -(2**31) <= value < 2**31:
            return b"J" + struct.pack("<i", value)
        data = pickle.encode_long(value)  # the pickler's own bytes
        return b"\x8a" + bytes([len(data)]) + data  # LONG1

    def _tuple(self, items: list[bytes]) -> bytes:
        if not items:
            return b")"
        if len(items) <= 3:
            return b"".join(items) + (b"\x85", b"\x86", b"\x87")[len(items) - 1]
        return b"(" + b"".join(items) + b"t"

    def _value(self, value: Any) -> bytes:
        """A planner path element or tuple: str, int, None or a tuple of them."""
        if type(value) is tuple and all(type(v) is str for v in value):  # the usual path: names only
            return self._tuple([self.text(v) for v in value])
        if isinstance(value, str):
            return self.text(value)
        if value is None:
            return b"N"
        if isinstance(value, bool):
            return b"\x88" if value else b"\x89"
        if isinstance(value, int):
            return self._int(value)
        if isinstance(value, tuple):
            return self._tuple([self._value(v) for v in value])
        raise TypeError(f"cannot write {type(value).__name__} in DCP planner data")

    def _size(self, dims: tuple[int, ...]) -> bytes:
        return self._global("torch\nSize") + self._tuple([self._int(d) for d in dims]) + b"\x85R"

    def _object(self, cls: str, fields: list[tuple[str, Callable[[], bytes]]] | None) -> bytes:
        """``cls()`` by NEWOBJ, then BUILD with a dict of ``fields`` (none: no BUILD). Every
        part is made in the order it is written, so a memo slot is always set before use."""
        out = [self._global(_META_CLASS[cls]) + b")\x81"]
        if fields is None:
            return out[0]
        out.append(b"}(")
        for key, value in fields:
            out.append(self.text(key))
            out.append(value())
        out.append(b"ub")
        return b"".join(out)

    def _properties(self, dtype: DType) -> bytes:
        # TensorProperties.__setstate__'s tuple: (dtype, layout, requires_grad, memory format, pin_memory)
        out = [self._global(_META_CLASS["TensorProperties"]) + b")\x81("]
        out.append(self._global("torch\n" + str(dtype).removeprefix("torch.")))
        out.append(self._memoized("layout", lambda: self._global("torch.serialization\n_get_layout")
                                  + self.text("torch.strided") + b"\x85R"))
        out.append(b"\x89")
        out.append(self._memoized("format", lambda: self._global(_META_CLASS["_MEM_FORMAT_ENCODING"]) + b"K\x00\x85R"))
        out.append(b"\x89tb")
        return b"".join(out)

    @staticmethod
    def _batched(entries: Iterator[bytes], empty: bytes, close: bytes) -> Iterator[bytes]:
        yield empty
        batch: list[bytes] = []
        for entry in entries:
            batch.append(entry)
            if len(batch) == _SETITEMS_BATCH:
                yield b"(" + b"".join(batch) + close
                batch = []
        if batch:
            yield b"(" + b"".join(batch) + close

    def state_dict_metadata(self, tensors: TensorTable, objects: Mapping[str, Any]) -> Iterator[bytes]:
        def chunk(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> bytes:
            return self._object("ChunkStorageMetadata", [("offsets", lambda: self._size(offsets)),
                                                         ("sizes", lambda: self._size(sizes))])

        def body(t: int) -> bytes:
            a, b, n = int(tensors.first[t]), int(tensors.first[t] + tensors.count[t]), len(tensors.shapes[t])
            boxes = zip(tensors.offsets[a:b, :n].tolist(), tensors.sizes[a:b, :n].tolist())
            return self._object("TensorStorageMetadata", [
                ("properties", lambda: self._properties(tensors.dtypes[t])), ("size", lambda: self._size(tensors.shapes[t])),
                ("chunks", lambda: b"".join(self._batched((chunk(tuple(o), tuple(z)) for o, z in boxes), b"]", b"e")))])

        def entries() -> Iterator[bytes]:
            for t, (name, dtype, shape, pattern) in enumerate(zip(tensors.names, tensors.dtypes, tensors.shapes,
                                                                 tensors.pattern.tolist())):
                yield self.text(name) + self._cached(("tensor", dtype, shape, pattern), lambda: body(t))
            for name in objects:
                yield self.text(name) + self._object("BytesStorageMetadata", None)
        return self._batched(entries(), b"}", b"u")

    def storage_data(self, tensors: TensorTable,
                     objects: Mapping[str, tuple[str, int, int]]) -> Iterator[bytes]:
        # An entry is MetadataIndex(fqn, offset, index) -> _StorageInfo(relative_path, offset,
        # length), written in parts: all but the name, the chunk and the record's two numbers
        # are the same bytes for every chunk once their memo slots exist.
        def key_head() -> bytes:  # up to the fqn's value
            return self._global(_META_CLASS["MetadataIndex"]) + b")\x81}(" + self.text("fqn")

        def key_tail(chunk: tuple[tuple[int, ...], int] | None) -> bytes:  # the rest of the key
            offset, index = (b"N", b"N") if chunk is None else (self._size(chunk[0]), self._int(chunk[1]))
            return self.text("offset") + offset + self.text("index") + index + b"ub"

        def info_head(relpath: str) -> bytes:  # the value, up to its offset's number
            return (self._global(_META_CLASS["_StorageInfo"]) + b")\x81}(" + self.text("relative_path")
                    + self.text(relpath) + self.text("offset"))

        def entry(name: str, chunk: tuple[tuple[int, ...], int] | None, where: tuple[str, int, int]) -> bytes:
            return b"".join((self._cached("key_head", key_head), self.text(name),
                             self._cached(("chunk", chunk), lambda: key_tail(chunk)),
                             self._cached(("info", where[0]), lambda: info_head(where[0])), self._int(where[1]),
                             self._cached("length", lambda: self.text("length")), self._int(where[2]), b"ub"))

        yield b"}"
        rows = _StorageRows(tensors)
        done = 0
        for a in range(0, rows.count, _ROWS_AT_ONCE):
            b = min(a + _ROWS_AT_ONCE, rows.count)
            yield rows.opcodes(self, a, b, done, entry, key_head, key_tail, info_head)
            done = b
        for name, where in objects.items():
            yield (b"(" if done % _SETITEMS_BATCH == 0 else b"") + entry(name, None, where)
            done += 1
            if done % _SETITEMS_BATCH == 0:
                yield b"u"
        if done % _SETITEMS_BATCH:
            yield b"u"

    def planner_data(self, planner_data: Mapping[str, tuple]) -> Iterator[bytes]:
        return self._batched((self.text(k) + self._value(v) for k, v in planner_data.items()), b"}", b"u")


class _StorageRows:
    """Every tensor chunk's storage entry as columns, in the order they are written: which
    tensor, which chunk of it (offsets and index), and its record. Entries are assembled a
    block at a time from byte slots (``opcode_rows``); an entry that is the first to need a
    memo slot (a new chunk layout, a new file, the first entry) is written by ``entry`` as the
    pickler would, in order, so every slot is set before a later entry refers to it."""

    def __init__(self, tensors: TensorTable) -> None:
        t = tensors
        self.count = int(t.count.sum())
        self.names, self.relpaths = t.names, t.relpaths
        self.tensor = np.repeat(np.arange(len(t.names)), t.count)
        rows = np.concatenate([np.arange(a, a + n) for a, n in zip(t.first.tolist(), t.count.tolist())]) \
            if not _consecutive(t) else np.arange(self.count)
        self.index = np.arange(self.count) - np.repeat(np.cumsum(t.count) - t.count, t.count)
        self.file, self.start, self.length = t.file[rows], t.start[rows], t.length[rows]
        ndim = np.array([len(s) for s in t.shapes], dtype=np.int64)[self.tensor]
        width = t.offsets.shape[1]
        offsets = np.where(np.arange(width) < ndim[:, None], t.offsets[rows], 0)
        key = np.column_stack([offsets, ndim, self.index])
        first_chunk, self.chunk = unique_rows(key)
        self.layouts = [(tuple(key[r, :int(key[r, width])].tolist()), int(self.index[r])) for r in first_chunk.tolist()]
        _, first_file = np.unique(self.file, return_index=True)
        self.first_use = np.zeros(self.count, dtype=bool)
        self.first_use[np.r_[first_chunk, first_file, [0] if self.count else []].astype(np.int64)] = True
        self._name_refs: list[bytes] | None = None

    def opcodes(self, ops: _Opcodes, a: int, b: int, done: int, entry: Callable, key_head: Callable,
                key_tail: Callable, info_head: Callable) -> bytes:
        """The opcodes of entries ``[a, b)``, ``done`` entries having been written before them
        (SETITEMS batches of ``_SETITEMS_BATCH``)."""
        rows = np.arange(a, b)
        first = rows[self.first_use[a:b]]
        slow = [entry(self.names[self.tensor[r]], self.layouts[self.chunk[r]],
                      (self.relpaths[self.file[r]], int(self.start[r]), int(self.length[r]))) for r in first.tolist()]
        # Every memo slot these entries use is set now: each part's bytes are the same for all.
        if self._name_refs is None:
            self._name_refs = [ops.text(name) for name in self.names]
        names = self._name_refs
        heads = [ops._cached("key_head", key_head)]
        tails = [ops._cached(("chunk", c), functools.partial(key_tail, c)) for c in self.layouts]
        infos = [ops._cached(("info", r), functools.partial(info_head, r)) for r in self.relpaths]
        closers = [ops._cached("length", lambda: ops.text("length")), b"ub", b"(", b"u"]
        fast = ~self.first_use[a:b]
        none = np.full(b - a, -1, dtype=np.int64)
        position = done + rows - a  # among all entries
        opens = np.where(position % _SETITEMS_BATCH == 0, 2, -1)
        closes = np.where(position % _SETITEMS_BATCH == _SETITEMS_BATCH - 1, 3, -1)
        slow_pick = none.copy()
        slow_pick[self.first_use[a:b]] = np.arange(len(slow))
        start_slot, length_slot = int_slot(self.start[a:b]), int_slot(self.length[a:b])
        start_slot = Slot(start_slot.pool, start_slot.at, np.where(fast, start_slot.length, 0))
        length_slot = Slot(length_slot.pool, length_slot.at, np.where(fast, length_slot.length, 0))
        return join_rows([
            table_slot(closers, opens),
            table_slot(slow, slow_pick),
            table_slot(heads, np.where(fast, 0, -1)),
            table_slot(names, np.where(fast, self.tensor[a:b], -1)),
            table_slot(tails, np.where(fast, self.chunk[a:b], -1)),
            table_slot(infos, np.where(fast, self.file[a:b], -1)),
            start_slot,
            table_slot(closers, np.where(fast, 0, -1)),
            length_slot,
            table_slot(closers, np.where(fast, 1, -1)),
            table_slot(closers, closes),
        ])


def _consecutive(t: TensorTable) -> bool:
    """Whether the tensors' rows follow one another from row 0 (the layout's own order)."""
    return bool(len(t.first) == 0 or (t.first[0] == 0 and (t.first[1:] == (t.first + t.count)[:-1]).all()))
