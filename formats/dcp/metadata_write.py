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
import pickle
from dataclasses import dataclass, field
from typing import Any

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
    dtype: torch.dtype

    def __getstate__(self) -> tuple:
        # torch's own state: (dtype, layout, requires_grad, memory format code, pin_memory)
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
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[ChunkRecord, ...]


def _rename_globals(data: bytes) -> bytes:
    for name, module in _TORCH_MODULE.items():
        ours = f"c{__name__}\n{name}\n".encode()
        found = data.count(ours)
        if found > 1:  # a tensor name containing this exact text: refuse rather than guess
            raise ValueError(f"cannot write DCP metadata: ambiguous class reference {name!r} in the pickle")
        data = data.replace(ours, f"c{module}\n{name}\n".encode())
    return data


def metadata_bytes(tensors: dict[str, TensorRecord], objects: dict[str, tuple[str, int, int]],
                   planner_data: dict[str, tuple], containers: dict[tuple, str] | None = None) -> bytes:
    """The pickle of a DCP ``Metadata`` for these tensors (chunks in storage order) and byte
    objects (name -> (relpath, offset, length)); ``containers``: see ``reshard.structure``."""
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for name, t in tensors.items():
        chunks = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks]
        sdm[name] = TensorStorageMetadata(TensorProperties(t.dtype), torch.Size(t.shape), chunks)
        for i, c in enumerate(t.chunks):
            storage[MetadataIndex(name, torch.Size(c.offsets), i)] = _StorageInfo(c.relpath, c.offset, c.length)
    for name, (relpath, offset, length) in objects.items():
        sdm[name] = BytesStorageMetadata()
        storage[MetadataIndex(name)] = _StorageInfo(relpath, offset, length)
    meta = Metadata(sdm, planner_data=planner_data, storage_data=storage, storage_meta=StorageMeta(), version="1.0.0",
                    reshard_containers=containers or None)
    return _rename_globals(pickle.dumps(meta, protocol=2))
