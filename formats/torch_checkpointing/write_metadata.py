"""``metadata.pkl`` of a torch_checkpointing output: what torch_checkpointing 0.1.1 writes for it.

The library pickles ``DistributedMetadata.to_dict()``: plain dicts, lists, tuples, strings
and ints, never its own classes, with ``pickle.dumps``. So does this module, from the same
dicts built the same way::

    {"metadata": {item: {"nested_path_to_metadata": {'["state","w","exp_avg"]': [
                             {"sharding_metadata": {"type": "DTensorShardingMetadata", "data": {
                                  "global_shape": [11, 5], "dtype": "torch.float32", "stride": [5, 1],
                                  "mesh_spec": {"device_type": "cuda", "mesh_shape": (2,), "mesh_data": (0, 1),
                                                "mesh_dim_names": None},
                                  "placements": [{"type": "Shard", "dim": 0}]}},
                              "ranks": (0, 1)}], ...},
                         "rank_to_layout_info": {0: None, 1: None}}, ...},
     "world_size": 2, "version": "2.0"}

Each tensor is one group held by every rank (a DTensor's mesh spans them all; a plain tensor
is recorded as replicated over the world, as the library records one). Nested paths are the
JSON of the path inside the item. ``None`` layouts mean the library's default file,
``<item>_<rank>.pt``. One mesh's ``mesh_spec`` is one dict, as the library shares one cached
dict per mesh, so the pickle holds it once. Items without tensors are not recorded: the
library records an item only when its resharder finds tensors in it.
"""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reshard.core.catalog import NestedPath
from reshard.core.dtypes import DType
from reshard.core.sharding import Placement

__all__ = ["METADATA_FILE", "MeshRecord", "RecordedTensor", "metadata_pickle"]

METADATA_FILE = "metadata.pkl"
_VERSION = "2.0"


@dataclass(frozen=True)
class MeshRecord:
    """A device mesh as the metadata records it: ranks 0..N-1 laid out in C order."""

    device_type: str
    shape: tuple[int, ...]
    names: tuple[str, ...] | None


@dataclass(frozen=True)
class RecordedTensor:
    """A tensor of an item, at ``path`` inside it, laid over ``mesh`` with ``placements``."""

    path: NestedPath
    shape: tuple[int, ...]
    dtype: DType
    mesh: MeshRecord
    placements: tuple[Placement, ...]


def _placement(p: Placement) -> dict[str, Any]:
    return {"type": "Shard", "dim": p[1]} if p[0] == "Shard" else {"type": "Replicate"}


def _stride(shape: tuple[int, ...]) -> list[int]:
    return [math.prod(shape[i + 1:]) for i in range(len(shape))]


def metadata_pickle(world_size: int, items: Mapping[str, list[RecordedTensor]]) -> bytes:
    """The bytes of ``metadata.pkl`` for a checkpoint of ``world_size`` ranks."""
    meshes: dict[MeshRecord, dict[str, Any]] = {}
    ranks = tuple(range(world_size))
    metadata: dict[str, Any] = {}
    for item, tensors in items.items():
        if not tensors:
            continue
        paths: dict[str, list[dict[str, Any]]] = {}
        for t in tensors:
            mesh = meshes.get(t.mesh)
            if mesh is None:
                mesh = meshes[t.mesh] = {"device_type": t.mesh.device_type, "mesh_shape": t.mesh.shape,
                                         "mesh_data": tuple(range(math.prod(t.mesh.shape))),
                                         "mesh_dim_names": t.mesh.names}
            data = {"global_shape": list(t.shape), "dtype": str(t.dtype), "stride": _stride(t.shape), "mesh_spec": mesh,
                    "placements": [_placement(p) for p in t.placements]}
            paths[json.dumps(list(t.path), separators=(",", ":"))] = [
                {"sharding_metadata": {"type": "DTensorShardingMetadata", "data": data}, "ranks": tuple(range(world_size))}]
        metadata[item] = {"nested_path_to_metadata": paths, "rank_to_layout_info": dict.fromkeys(ranks)}
    return pickle.dumps({"metadata": metadata, "world_size": world_size, "version": _VERSION})
