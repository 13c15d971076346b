"""Writing DCP's ``.metadata`` without importing torch.distributed.checkpoint.

torch reads ``.metadata`` with pickle, so the file must name torch's own classes
(``torch.distributed.checkpoint.metadata.Metadata`` ...). Importing that package to build
real instances costs one to two seconds (it pulls in all of DTensor), more than converting a
whole small checkpoint takes. Instead we emit the same pickle opcodes torch's dataclasses
produce (class, NEWOBJ, state dict, BUILD) from plain values; tests check that torch's own
``FileSystemReader.read_metadata`` and ``dcp.load`` read the result as their own.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ChunkRecord", "TensorRecord", "metadata_bytes"]

_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"


@dataclass(frozen=True)
class _Global:
    module: str
    name: str


@dataclass(frozen=True, eq=False)  # identity: each one is a distinct object in the pickle
class _New:
    """An instance of a torch class, rebuilt as torch's dataclasses pickle: NEWOBJ + BUILD."""

    cls: _Global
    state: Any


@dataclass(frozen=True, eq=False)
class _Call:
    """``cls(*args)`` at load time (how an Enum member pickles)."""

    cls: _Global
    args: tuple


@dataclass(frozen=True)
class ChunkRecord:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    relpath: str
    offset: int
    length: int


@dataclass(frozen=True)
class TensorRecord:
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[ChunkRecord, ...]


class _Pickler(pickle._Pickler):  # the Python pickler: its ``save`` can be extended
    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, (_Global, _New, _Call)):
            memo = self.memo.get(id(obj))
            if memo is not None:
                self.write(self.get(memo[0]))
                return
            if isinstance(obj, _Global):
                self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
            elif isinstance(obj, _Call):
                self.save(obj.cls)
                self.save(obj.args)
                self.write(pickle.REDUCE)
            else:
                self.save(obj.cls)
                self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
                self.memoize(obj)
                self.save(obj.state)
                self.write(pickle.BUILD)
                return
            self.memoize(obj)
            return
        super().save(obj, save_persistent_id)


def _size(values: tuple[int, ...]) -> torch.Size:
    return torch.Size(values)


def metadata_bytes(tensors: dict[str, TensorRecord], objects: dict[str, tuple[str, int, int]],
                   planner_data: dict[str, tuple]) -> bytes:
    """The pickle of a DCP ``Metadata`` for these tensors (chunks in storage order) and byte
    objects (name -> (relpath, offset, length))."""
    cls = {n: _Global(_META, n) for n in ("Metadata", "TensorStorageMetadata", "TensorProperties",
                                          "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex", "StorageMeta")}
    storage_info, contiguous = _Global(_FS, "_StorageInfo"), _Call(_Global(_META, "_MEM_FORMAT_ENCODING"), (0,))
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for name, t in tensors.items():
        props = _New(cls["TensorProperties"], (t.dtype, torch.strided, False, contiguous, False))
        chunks = [_New(cls["ChunkStorageMetadata"], {"offsets": _size(c.offsets), "sizes": _size(c.sizes)}) for c in t.chunks]
        sdm[name] = _New(cls["TensorStorageMetadata"], {"properties": props, "size": _size(t.shape), "chunks": chunks})
        for i, c in enumerate(t.chunks):
            index = _New(cls["MetadataIndex"], {"fqn": name, "offset": _size(c.offsets), "index": i})
            storage[index] = _New(storage_info, {"relative_path": c.relpath, "offset": c.offset, "length": c.length})
    for name, (relpath, offset, length) in objects.items():
        sdm[name] = _New(cls["BytesStorageMetadata"], {})
        index = _New(cls["MetadataIndex"], {"fqn": name, "offset": None, "index": None})
        storage[index] = _New(storage_info, {"relative_path": relpath, "offset": offset, "length": length})
    storage_meta = _New(cls["StorageMeta"], {"checkpoint_id": None, "save_id": None, "load_id": None, "modules": []})
    meta = _New(cls["Metadata"], {"state_dict_metadata": sdm, "planner_data": planner_data, "storage_data": storage,
                                  "storage_meta": storage_meta, "version": "1.0.0"})
    buf = io.BytesIO()
    _Pickler(buf, protocol=4).dump(meta)
    return buf.getvalue()
