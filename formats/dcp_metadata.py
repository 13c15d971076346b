"""Loading and validating a DCP ``.metadata`` file without trusting it.

torch pickles ``Metadata`` with plain pickle, and its own reader unpickles it the same way,
so a crafted ``.metadata`` runs code on load. We unpickle with an allow-list of DCP's own
dataclasses, then check the structure: every tensor's chunks tile it exactly once, every chunk
has a storage record, and every record names a file inside the checkpoint folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from reshard import _torch_compat
from reshard.boxes import Box, tiles_exactly
from reshard.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError
from reshard.safe_pickle import safe_loads

__all__ = ["StorageRecord", "DCPIndex", "load_dcp_index"]

_MAX_METADATA_BYTES = 1 << 30


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


def _record(info: Any, where: str, root: Path) -> StorageRecord:
    if not isinstance(info, _torch_compat.DCPStorageInfo):
        raise CorruptCheckpointError(f"{where}: storage record has type {type(info).__name__}")
    rel = info.relative_path
    if not isinstance(rel, str) or not rel or rel.startswith(("/", "\\")) or ".." in Path(rel).parts:
        raise UnsafeCheckpointError(f"{where}: data file {rel!r} is outside the checkpoint folder")
    if not (root / rel).resolve().is_relative_to(root.resolve()):
        raise UnsafeCheckpointError(f"{where}: data file {rel!r} resolves outside the checkpoint folder")
    for field_name in ("offset", "length"):
        v = getattr(info, field_name)
        if not isinstance(v, int) or v < 0:
            raise CorruptCheckpointError(f"{where}: storage record {field_name} is {v!r}")
    return StorageRecord(rel, info.offset, info.length, tuple(info.transform_descriptors or ()))


def load_dcp_index(root: Path) -> DCPIndex:
    meta_path = root / ".metadata"
    if not meta_path.is_file():
        raise CheckpointNotFoundError(f"{root}: no .metadata file; not a DCP checkpoint folder")
    size = meta_path.stat().st_size
    if size > _MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{meta_path}: {size} bytes is implausibly large for DCP metadata")
    meta = safe_loads(meta_path.read_bytes(), _torch_compat.DCP_METADATA_GLOBALS, origin=meta_path)
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise CorruptCheckpointError(f"{meta_path}: does not hold DCP Metadata")
    if not isinstance(meta.storage_data, dict):
        raise CorruptCheckpointError(f"{meta_path}: has no storage records (storage_data)")

    records: dict[tuple[str, tuple[int, ...]], StorageRecord] = {}
    for key, info in meta.storage_data.items():
        fqn, offset = getattr(key, "fqn", None), getattr(key, "offset", None)
        if not isinstance(fqn, str):
            raise CorruptCheckpointError(f"{meta_path}: storage key {key!r} has no name")
        offs = () if offset is None else _ints(offset, f"{meta_path}: {fqn} storage offset")
        records[(fqn, offs)] = _record(info, f"{meta_path}: {fqn}", root)

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
        dtype = getattr(md.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype) or any(s < 0 for s in shape):
            raise CorruptCheckpointError(f"{where}: invalid dtype {dtype!r} or shape {shape}")
        chunks = []
        for c in md.chunks:
            box = Box(_ints(c.offsets, f"{where} chunk offsets"), _ints(c.sizes, f"{where} chunk sizes"))
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
