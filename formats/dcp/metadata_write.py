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
import io
import pickle
import struct
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard.dtypes import DType

if TYPE_CHECKING:
    import torch

__all__ = ["ChunkRecord", "TensorRecord", "metadata_bytes"]

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
class ChunkRecord:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    relpath: str
    offset: int
    length: int


@dataclass(frozen=True)
class TensorRecord:
    dtype: DType
    shape: tuple[int, ...]
    chunks: tuple[ChunkRecord, ...]


def _rename_globals(data: bytes) -> bytes:
    """Our stand-in classes' GLOBAL opcodes renamed to torch's modules. Without the memo each
    class is named at each use; no name in the pickle contains our module (checked first), so
    every occurrence is an opcode."""
    for name, module in _TORCH_MODULE.items():
        data = data.replace(f"c{__name__}\n{name}\n".encode(), f"c{module}\n{name}\n".encode())
    if f"{__name__}\n".encode() in data:
        raise ValueError("cannot write DCP metadata: a class reference was left unnamed")
    return data


def metadata_bytes(tensors: Mapping[str, TensorRecord], objects: dict[str, tuple[str, int, int]],
                   planner_data: Mapping[str, tuple], containers: dict[tuple, str] | None = None) -> bytes:
    """The pickle of a DCP ``Metadata`` for these tensors (chunks in storage order; a mapping
    whose records may be made on demand) and byte objects (name -> (relpath, offset, length));
    ``containers``: see ``reshard.structure``.

    The small outer object is pickled by the pickler; its three big dicts (one entry per
    tensor or chunk) are written by ``_Opcodes``, entry by entry, as the pickler would write
    them: nothing is held per chunk, and names and classes are memoized as the pickler does,
    so the file is as compact as its own pickle."""
    for name in (*tensors, *objects):
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
    out = io.BytesIO()
    out.write(pickle.PROTO + b"\x02")
    at = 0
    for where, part in sorted((head.index(placeholders[p]), p) for p in big):
        out.write(head[at:where])
        for opcodes in big[part]:
            out.write(opcodes)
        at = where + len(placeholders[part])
    out.write(head[at:] + pickle.STOP)
    return out.getvalue()


def _unmemoized(obj: Any) -> bytes:
    """``obj``'s pickle opcodes, without the PROTO header, STOP or any memo slot."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=2, fix_imports=False)
    pickler.fast = True
    pickler.dump(obj)
    return buf.getvalue()[2:-1]


_SETITEMS_BATCH = 1000  # items per SETITEMS / APPENDS, as the pickler batches them
_META_CLASS = {name: f"{module}\n{name}" for name, module in _TORCH_MODULE.items()}  # as GLOBAL names them


class _Opcodes:
    """Protocol-2 opcodes for DCP's metadata records, written as Python's pickler writes
    these dataclasses (``NEWOBJ`` with no arguments, then ``BUILD`` with their state) and
    memoized as it memoizes them: each class, dtype, field name and tensor name once, then
    ``BINGET``. torch's reader and reshard's read them as the pickler's own."""

    def __init__(self) -> None:
        self._memo: dict[Any, int] = {}

    def _memoized(self, key: Any, first: Callable[[], bytes]) -> bytes:
        index = self._memo.get(key)
        if index is not None:
            return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)
        index = self._memo[key] = len(self._memo)
        return first() + (b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index))

    def text(self, value: str, memo: bool = True) -> bytes:
        def encode() -> bytes:
            data = value.encode("utf-8", "surrogatepass")
            return b"X" + struct.pack("<I", len(data)) + data
        return self._memoized(("str", value), encode) if memo else encode()

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
        data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        return b"\x8a" + bytes([len(data)]) + data  # LONG1

    def _tuple(self, items: list[bytes]) -> bytes:
        if not items:
            return b")"
        if len(items) <= 3:
            return b"".join(items) + (b"\x85", b"\x86", b"\x87")[len(items) - 1]
        return b"(" + b"".join(items) + b"t"

    def _value(self, value: Any) -> bytes:
        """A planner path element or tuple: str, int, None or a tuple of them."""
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

    def state_dict_metadata(self, tensors: Mapping[str, TensorRecord], objects: Mapping[str, Any]) -> Iterator[bytes]:
        def chunk(c: ChunkRecord) -> bytes:
            return self._object("ChunkStorageMetadata", [("offsets", lambda: self._size(c.offsets)),
                                                         ("sizes", lambda: self._size(c.sizes))])

        def entries() -> Iterator[bytes]:
            for name, t in tensors.items():
                yield self.text(name) + self._object("TensorStorageMetadata", [
                    ("properties", lambda: self._properties(t.dtype)), ("size", lambda: self._size(t.shape)),
                    ("chunks", lambda: b"".join(self._batched((chunk(c) for c in t.chunks), b"]", b"e")))])
            for name in objects:
                yield self.text(name) + self._object("BytesStorageMetadata", None)
        return self._batched(entries(), b"}", b"u")

    def storage_data(self, tensors: Mapping[str, TensorRecord],
                     objects: Mapping[str, tuple[str, int, int]]) -> Iterator[bytes]:
        def entry(name: str, offset: Callable[[], bytes], index: Callable[[], bytes], where: tuple[str, int, int]) -> bytes:
            key = self._object("MetadataIndex", [("fqn", lambda: self.text(name)), ("offset", offset), ("index", index)])
            return key + self._object("_StorageInfo", [("relative_path", lambda: self.text(where[0])),
                                                       ("offset", lambda: self._int(where[1])),
                                                       ("length", lambda: self._int(where[2]))])

        def entries() -> Iterator[bytes]:
            for name, t in tensors.items():
                for i, c in enumerate(t.chunks):
                    yield entry(name, lambda: self._size(c.offsets), lambda: self._int(i), (c.relpath, c.offset, c.length))
            for name, where in objects.items():
                yield entry(name, lambda: b"N", lambda: b"N", where)
        return self._batched(entries(), b"}", b"u")

    def planner_data(self, planner_data: Mapping[str, tuple]) -> Iterator[bytes]:
        return self._batched((self.text(k) + self._value(v) for k, v in planner_data.items()), b"}", b"u")
