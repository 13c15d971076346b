"""Loading and validating a DCP ``.metadata`` file without trusting it.

torch pickles ``Metadata`` with plain pickle, and its own reader unpickles it the same way,
so a crafted ``.metadata`` runs code on load. We unpickle with an allow-list that maps DCP's
class names to inert records of our own (nothing of torch.distributed is imported or
constructed), then check the structure: every tensor's chunks tile it exactly once, every
chunk has a storage record, and every record names a file inside the checkpoint folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reshard import _torch_compat
from reshard.boxes import Box, tiles_exactly
from reshard.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError
from reshard.safe_pickle import safe_loads

__all__ = ["StorageRecord", "DCPIndex", "load_dcp_index"]

_MAX_METADATA_BYTES = 1 << 30


class _Record:
    """One DCP metadata object as plain attributes, filled by pickle's BUILD step."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and all(isinstance(x, (dict, type(None))) for x in state):
            state = {**(state[0] or {}), **(state[1] or {})}  # (__dict__, __slots__) state
        if not isinstance(state, dict):
            raise ValueError(f"unexpected state for {type(self).__name__}")  # safe_loads adds the file name
        self.__dict__.update({k: v for k, v in state.items() if isinstance(k, str)})


class Metadata(_Record):
    state_dict_metadata: Any = None
    planner_data: Any = None
    storage_data: Any = None


class TensorStorageMetadata(_Record):
    properties: Any = None
    size: Any = None
    chunks: Any = ()


class BytesStorageMetadata(_Record):
    pass


class _TensorProperties(_Record):
    dtype: Any = None

    def __setstate__(self, state: Any) -> None:
        # DCP pickles (dtype, layout, requires_grad, memory format code, pin_memory).
        if isinstance(state, tuple) and len(state) == 5:
            self.dtype = state[0]
        else:
            super().__setstate__(state)


def _memory_format_code(value: Any) -> int:
    if not isinstance(value, int):
        raise ValueError(f"memory format code {value!r} is not an integer")  # safe_loads adds the file name
    return value


_DCP = "torch.distributed.checkpoint.metadata"
_GLOBALS: dict[tuple[str, str], Any] = {
    (_DCP, "Metadata"): Metadata,
    (_DCP, "TensorStorageMetadata"): TensorStorageMetadata,
    (_DCP, "BytesStorageMetadata"): BytesStorageMetadata,
    (_DCP, "ChunkStorageMetadata"): type("ChunkStorageMetadata", (_Record,), {}),
    (_DCP, "TensorProperties"): _TensorProperties,
    (_DCP, "StorageMeta"): type("StorageMeta", (_Record,), {}),
    (_DCP, "MetadataIndex"): type("MetadataIndex", (_Record,), {}),
    (_DCP, "_MEM_FORMAT_ENCODING"): _memory_format_code,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): type("StorageInfo", (_Record,), {}),
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _torch_compat.get_layout,
    ("pathlib", "PosixPath"): __import__("pathlib").PurePosixPath,
    ("pathlib", "WindowsPath"): __import__("pathlib").PureWindowsPath,
    ("pathlib", "PurePosixPath"): __import__("pathlib").PurePosixPath,
    **{("torch", name): dt for name, dt in _torch_compat.TORCH_DTYPES.items()},
}


@dataclass(frozen=True)
class StorageRecord:
    relpath: str
    offset: int
    length: int
    transforms: tuple


@dataclass
class DCPIndex:
    """The validated content of ``.metadata``."""

    tensors: dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[Box, StorageRecord]]]]
    objects: dict[str, StorageRecord]
    paths: dict[str, tuple]


def _ints(value: Any, where: str) -> tuple[int, ...]:
    try:
        out = tuple(value)
    except TypeError:
        raise CorruptCheckpointError(f"{where} is not a sequence of integers") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in out):
        raise CorruptCheckpointError(f"{where} is not a sequence of integers")
    return out


def _record(info: Any, where: str, root: Path, inside: dict[str, bool]) -> StorageRecord:
    if type(info).__name__ != "StorageInfo":
        raise CorruptCheckpointError(f"{where}: storage record has type {type(info).__name__}")
    rel = getattr(info, "relative_path", None)
    if not isinstance(rel, str) or not rel or rel.startswith(("/", "\\")) or ".." in Path(rel).parts:
        raise UnsafeCheckpointError(f"{where}: data file {rel!r} is outside the checkpoint folder")
    if rel not in inside:  # a few files hold thousands of chunks: resolve each file once
        inside[rel] = (root / rel).resolve().is_relative_to(root.resolve())
    if not inside[rel]:
        raise UnsafeCheckpointError(f"{where}: data file {rel!r} resolves outside the checkpoint folder")
    for field_name in ("offset", "length"):
        v = getattr(info, field_name, None)
        if not isinstance(v, int) or v < 0:
            raise CorruptCheckpointError(f"{where}: storage record {field_name} is {v!r}")
    return StorageRecord(rel, info.offset, info.length, tuple(getattr(info, "transform_descriptors", None) or ()))


def load_dcp_index(root: Path) -> DCPIndex:
    meta_path = root / ".metadata"
    if not meta_path.is_file():
        raise CheckpointNotFoundError(f"{root}: no .metadata file; not a DCP checkpoint folder")
    size = meta_path.stat().st_size
    if size > _MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{meta_path}: {size} bytes is implausibly large for DCP metadata")
    meta = safe_loads(meta_path.read_bytes(), _GLOBALS, origin=meta_path)
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise CorruptCheckpointError(f"{meta_path}: does not hold DCP Metadata")
    if not isinstance(meta.storage_data, dict):
        raise CorruptCheckpointError(f"{meta_path}: has no storage records (storage_data)")

    records: dict[tuple[str, tuple[int, ...]], StorageRecord] = {}
    inside: dict[str, bool] = {}
    for key, info in meta.storage_data.items():
        fqn, offset = getattr(key, "fqn", None), getattr(key, "offset", None)
        if not isinstance(fqn, str):
            raise CorruptCheckpointError(f"{meta_path}: storage key {key!r} has no name")
        offs = () if offset is None else _ints(offset, f"{meta_path}: {fqn} storage offset")
        records[(fqn, offs)] = _record(info, f"{meta_path}: {fqn}", root, inside)

    tensors, objects = {}, {}
    for name, md in meta.state_dict_metadata.items():
        where = f"{meta_path}: {name!r}"
        if not isinstance(name, str):
            raise CorruptCheckpointError(f"{meta_path}: entry name {name!r} is not a string")
        if isinstance(md, BytesStorageMetadata):
            rec = records.get((name, ())) or records.get((name, (0,)))
            if rec is None:
                raise CorruptCheckpointError(f"{where}: object has no storage record")
            objects[name] = rec
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{where}: unknown entry type {type(md).__name__}")
        shape = _ints(md.size, f"{where} size")
        dtype = getattr(md.properties, "dtype", None) if isinstance(md.properties, _TensorProperties) else None
        if not isinstance(dtype, torch.dtype) or any(s < 0 for s in shape):
            raise CorruptCheckpointError(f"{where}: invalid dtype {dtype!r} or shape {shape}")
        chunks = []
        if not isinstance(md.chunks, (list, tuple)):
            raise CorruptCheckpointError(f"{where}: chunk list is {type(md.chunks).__name__}")
        for c in md.chunks:
            box = Box(_ints(getattr(c, "offsets", None), f"{where} chunk offsets"),
                      _ints(getattr(c, "sizes", None), f"{where} chunk sizes"))
            rec = records.get((name, box.offsets))
            if rec is None:
                raise CorruptCheckpointError(f"{where}: chunk at {box.offsets} has no storage record")
            chunks.append((box, rec))
        problem = tiles_exactly(shape, [b for b, _ in chunks])
        if problem:
            raise CorruptCheckpointError(f"{where}: {problem}")
        tensors[name] = (shape, dtype, chunks)

    paths: dict[str, tuple] = {}
    if isinstance(meta.planner_data, dict):
        for name, p in meta.planner_data.items():
            if isinstance(name, str) and isinstance(p, (tuple, list)) and all(isinstance(x, (str, int)) for x in p):
                paths[name] = tuple(p)
    return DCPIndex(tensors, objects, paths)
