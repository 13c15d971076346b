"""torch_checkpointing's ``metadata.pkl``, read without trusting it.

torch_checkpointing (meta-pytorch) writes ``metadata.pkl`` whenever an item of the save declares
a resharder: ``pickle.dumps(DistributedMetadata.to_dict())``, plain dicts, lists, tuples, strings
and ints, and reads it back with plain ``pickle.loads``. We replay it with the allow-list
unpickler (it names no class, so nothing beyond plain values is allowed) and check every field:

```
{"version": "2.0", "world_size": N,
 "metadata": {ITEM: {                                  # items saved with a resharder
     "nested_path_to_metadata": {'["state","w","exp_avg"]': [   # json of the path inside the item
         {"ranks": (0, 1),                             # the ranks that hold this sharding
          "sharding_metadata": {"type": "DTensorShardingMetadata", "data": {
              "global_shape": [7, 5], "dtype": "torch.float32", "stride": [5, 1],
              "mesh_spec": {"device_type": "cpu", "mesh_shape": (2,), "mesh_data": (0, 1),
                            "mesh_dim_names": ("dp_shard",)},
              "placements": [{"type": "Shard", "dim": 0}]}}}]},
     "rank_to_layout_info": {RANK: None                # None: <ITEM>_<RANK>.pt, torch.save
                             | {"file_path": "model_0.safetensors",
                                "serialization_format": {"type": "SafetensorsSerialization"}}}}}}
```

Plain tensors of an item are recorded as replicated over a 1-D mesh of every rank. A key, type,
placement, serialization or version this module does not know is refused as a newer format
(``NewerFormatError``), never skipped: each of them changes which bytes a rank holds. Known kinds
reshard cannot place (``StridedShard``, the ``default_tensor_v1`` geometry of tensor subclasses,
JSON or raw items with sharded tensors, version 1.0 from older releases) are refused by name.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from reshard.core.boxes import Box
from reshard.core.catalog import NestedPath
from reshard.core.dtypes import DTYPES, DType
from reshard.core.errors import CorruptCheckpointError, NewerFormatError, UnsupportedFormatError
from reshard.core.sharding import REPLICATE, Placement, rank_coordinate, shard, shard_box
from reshard.safe_pickle.unpickler import safe_loads

__all__ = ["METADATA_FILE", "ITEM_NAME", "VERSIONS", "READS", "TorchSerialization", "SafetensorsSerialization", "ItemLayout",
           "DTensorSharding", "Group", "ItemMetadata", "TCMetadata", "read_metadata", "default_layout", "joined", "newer"]

METADATA_FILE = "metadata.pkl"
# What the library takes as an item's key (CheckpointBase's check): letters, digits, _ and -, so no
# two items' names can run together once their paths are joined with dots.
ITEM_NAME = re.compile(r"[a-zA-Z0-9_-]+")
# DistributedMetadata's versions: "2.0" is what torch_checkpointing 0.1.1 writes (_CURRENT_VERSION).
VERSIONS = frozenset({"2.0"})
READS = "metadata.pkl version 2.0, as torch_checkpointing 0.1.1 writes it"
_OLDER_VERSIONS = frozenset({"1.0"})  # per-path keys of releases before 0.1.1: read by the library only
_MAX_BYTES = 1 << 30

_TOP = frozenset({"metadata", "world_size", "version"})
_ITEM = frozenset({"nested_path_to_metadata", "rank_to_layout_info"})
_GROUP = frozenset({"sharding_metadata", "ranks"})
_PACKED = frozenset({"type", "data"})
_DTENSOR = frozenset({"global_shape", "dtype", "stride", "mesh_spec", "placements"})
_MESH = frozenset({"device_type", "mesh_shape", "mesh_data", "mesh_dim_names"})
_LAYOUT = frozenset({"file_path", "serialization_format"})
_PLACEMENTS = {"Shard": frozenset({"type", "dim"}), "Replicate": frozenset({"type"})}
_DTENSOR_TYPE = "DTensorShardingMetadata"
# Kinds torch_checkpointing 0.1.1 knows that reshard cannot place, and why.
_REFUSED_SHARDINGS = {
    "default_tensor_v1": "explicit shard offsets of a CheckpointableTensor subclass (DefaultShardingMetadata)"}
_REFUSED_PLACEMENTS = {
    "StridedShard": "StridedShard (FSDP2 over tensor parallel on the same dim), which reshard cannot place"}
_REFUSED_SERIALIZATIONS = {"JsonSerialization": "JSON", "RawSerialization": "raw bytes"}


@dataclass(frozen=True)
class TorchSerialization:
    """An item's file is ``torch.save`` of that rank's value (DTensors inside)."""


@dataclass(frozen=True)
class SafetensorsSerialization:
    """An item's file is a safetensors file of that rank's local tensors, keyed by the nested
    path joined with dots (``SafetensorsSerialization.prepare_tensors_for_save``)."""

    metadata: tuple[tuple[str, str], ...] | None = None  # the file's own __metadata__, as the layout gives it


@dataclass(frozen=True)
class ItemLayout:
    file: str  # relative to the checkpoint folder
    serialization: TorchSerialization | SafetensorsSerialization


def default_layout(item: str, rank: int) -> ItemLayout:
    """Where torch_checkpointing puts an item without a layout of its own: ``<item>_<rank>.pt``."""
    return ItemLayout(f"{item}_{rank}.pt", TorchSerialization())


@dataclass(frozen=True)
class DTensorSharding:
    """How a tensor is laid out on a device mesh, as DTensorShardingMetadata records it."""

    global_shape: tuple[int, ...]
    dtype: DType
    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]  # mesh_data: the global rank at each mesh position, in C order
    mesh_dim_names: tuple[str, ...] | None
    placements: tuple[Placement, ...]

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Where ``rank`` sits in the mesh: its position in ``mesh_data``, in C order."""
        return rank_coordinate(_positions(self.mesh_ranks)[rank], self.mesh_shape)

    def box(self, rank: int) -> Box:
        """The part of the global tensor ``rank`` holds, by DTensor's sharding rules."""
        return shard_box(self.global_shape, self.placements, self.mesh_shape, self.coordinate(rank))


@functools.lru_cache(maxsize=64)
def _positions(mesh_ranks: tuple[int, ...]) -> dict[int, int]:
    """rank -> position in ``mesh_data``: every tensor of a checkpoint names one of a few meshes."""
    return {rank: i for i, rank in enumerate(mesh_ranks)}


@dataclass(frozen=True)
class Group:
    sharding: DTensorSharding
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ItemMetadata:
    paths: dict[NestedPath, tuple[Group, ...]]  # every tensor of the item, by its path inside the item
    layouts: dict[int, ItemLayout]  # rank -> its file


@dataclass(frozen=True)
class TCMetadata:
    version: str
    world_size: int
    items: dict[str, ItemMetadata]


def read_metadata(folder: Path) -> TCMetadata:
    """``folder/metadata.pkl`` unpickled with the allow-list and checked field by field."""
    file = folder / METADATA_FILE
    size = file.stat().st_size
    if size > _MAX_BYTES:
        raise CorruptCheckpointError(f"{file}: {size} bytes is implausibly large for torch_checkpointing metadata")
    raw = safe_loads(file.read_bytes(), {}, origin=file)
    return _Reader(file).top(raw)


def newer(file: Path | str, what: str) -> NewerFormatError:
    return NewerFormatError(f"{file}: {what}: written by a torch_checkpointing newer than reshard reads ({READS}); "
                            "upgrade reshard (pip install -U reshard)")


class _Reader:
    """The checks, each naming the file and where in it the problem is."""

    def __init__(self, file: Path) -> None:
        self.file = file

    def corrupt(self, where: str, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.file}: {where}: {what}")

    def keys(self, value: Any, known: frozenset[str], where: str, optional: frozenset[str] = frozenset()) -> dict:
        if not isinstance(value, dict):
            raise self.corrupt(where, f"expected a dict, found {type(value).__name__}")
        unknown = sorted(map(repr, set(value) - known))
        if unknown:
            raise newer(self.file, f"{where} has the field {unknown[0]} that reshard does not know")
        missing = sorted(known - optional - set(value))
        if missing:
            raise self.corrupt(where, f"lacks the field {missing[0]!r}")
        return value

    def ints(self, value: Any, where: str, *, low: int = 0) -> tuple[int, ...]:
        if not isinstance(value, (list, tuple)) or not all(type(x) is int and x >= low for x in value):
            raise self.corrupt(where, f"expected a sequence of integers >= {low}, found {value!r}")
        return tuple(value)

    def top(self, raw: Any) -> TCMetadata:
        version = raw.get("version", "1.0") if isinstance(raw, dict) else None  # the library's default: 1.0
        if isinstance(raw, dict) and (not isinstance(version, str) or version not in VERSIONS):
            if isinstance(version, str) and version in _OLDER_VERSIONS:
                raise UnsupportedFormatError(f"{self.file}: metadata version {version!r}, from a torch_checkpointing "
                                             f"before 0.1.1; reshard reads {READS}: load and save it again with 0.1.1")
            raise newer(self.file, f"metadata version {version!r}")
        d = self.keys(raw, _TOP, "the top level")
        world = d["world_size"]
        if type(world) is not int or world < 1:
            raise self.corrupt("world_size", f"expected a positive integer, found {world!r}")
        if not isinstance(d["metadata"], dict):
            raise self.corrupt("metadata", f"expected a dict of items, found {type(d['metadata']).__name__}")
        items = {}
        for item, value in d["metadata"].items():
            if not isinstance(item, str) or not ITEM_NAME.fullmatch(item):  # the library refuses other keys
                raise self.corrupt("metadata", f"the item key {item!r} is not a name torch_checkpointing takes "
                                               f"({ITEM_NAME.pattern})")
            items[item] = self.item(item, value, world)
        self.distinct_files(items)
        return TCMetadata(d["version"], world, items)

    def item(self, item: str, value: Any, world: int) -> ItemMetadata:
        where = f"item {item!r}"
        d = self.keys(value, _ITEM, where)
        layouts_raw = d["rank_to_layout_info"]
        # the count first: a hostile world_size must not be allocated as a range
        if not isinstance(layouts_raw, dict) or len(layouts_raw) != world \
                or not all(type(r) is int and 0 <= r < world for r in layouts_raw):
            found = sorted(layouts_raw, key=repr)[:8] if isinstance(layouts_raw, dict) else layouts_raw
            raise self.corrupt(where, f"rank_to_layout_info must name ranks 0 to {world - 1}, found {found!r}")
        layouts = {r: self.layout(item, r, layouts_raw[r]) for r in range(world)}
        paths_raw = d["nested_path_to_metadata"]
        if not isinstance(paths_raw, dict):
            raise self.corrupt(where, "nested_path_to_metadata is not a dict")
        paths: dict[NestedPath, tuple[Group, ...]] = {}
        for key, groups in paths_raw.items():
            path = self.nested_path(key, where)
            if path in paths:
                raise self.corrupt(where, f"the path {key!r} is given twice")
            paths[path] = self.groups(groups, f"{where} path {key}", world)
        return ItemMetadata(paths, layouts)

    def nested_path(self, key: Any, where: str) -> NestedPath:
        try:
            path = json.loads(key) if isinstance(key, str) else None
        except ValueError:
            path = None
        if not isinstance(path, list) or not all(type(p) in (str, int) for p in path):
            raise self.corrupt(where, f"the nested path {key!r} is not a JSON list of keys and indices")
        return tuple(path)

    def layout(self, item: str, rank: int, value: Any) -> ItemLayout:
        if value is None:
            return default_layout(item, rank)
        where = f"item {item!r} rank {rank} layout"
        d = self.keys(value, _LAYOUT, where)
        file = d["file_path"]
        parts = PurePosixPath(file).parts if isinstance(file, str) else ()
        if not parts or file.startswith("/") or ".." in parts or "\\" in file or "\0" in file:
            raise self.corrupt(where, f"file_path {file!r} is not a path inside the checkpoint folder")
        return ItemLayout(file, self.serialization(d["serialization_format"], where))

    def serialization(self, value: Any, where: str) -> TorchSerialization | SafetensorsSerialization:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "TorchSerialization":
            self.keys(value, frozenset({"type"}), f"{where} TorchSerialization")
            return TorchSerialization()
        if kind == "SafetensorsSerialization":
            d = self.keys(value, frozenset({"type", "metadata"}), f"{where} SafetensorsSerialization",
                          optional=frozenset({"metadata"}))
            meta = d.get("metadata")
            if meta is not None and not (isinstance(meta, dict) and all(isinstance(x, str) for kv in meta.items()
                                                                           for x in kv)):
                raise self.corrupt(where, "the safetensors metadata is not a dict of strings")
            return SafetensorsSerialization(tuple(sorted(meta.items())) if meta is not None else None)
        if kind in _REFUSED_SERIALIZATIONS:
            raise UnsupportedFormatError(f"{self.file}: {where}: an item of sharded tensors saved as "
                                         f"{_REFUSED_SERIALIZATIONS[kind]} ({kind}), which cannot hold them")
        raise newer(self.file, f"{where} has the serialization {kind!r}")

    def groups(self, value: Any, where: str, world: int) -> tuple[Group, ...]:
        if not isinstance(value, list) or not value:
            raise self.corrupt(where, "expected a non-empty list of rank groups")
        out: list[Group] = []
        seen: set[int] = set()
        for g in value:
            d = self.keys(g, _GROUP, where)
            ranks = self.ints(d["ranks"], f"{where} ranks")
            if not ranks or len(set(ranks)) != len(ranks) or max(ranks) >= world or seen & set(ranks):
                raise self.corrupt(where, f"the ranks {ranks!r} are not distinct ranks of a world of {world}, "
                                          "each in one group")
            seen |= set(ranks)
            sharding = self.sharding(d["sharding_metadata"], where, world)
            if not set(ranks) <= set(sharding.mesh_ranks):
                raise self.corrupt(where, f"ranks {ranks!r} hold a tensor of a mesh of ranks {sharding.mesh_ranks!r}")
            out.append(Group(sharding, ranks))
        return tuple(out)

    def sharding(self, value: Any, where: str, world: int) -> DTensorSharding:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind in _REFUSED_SHARDINGS:
            raise UnsupportedFormatError(f"{self.file}: {where}: the sharding {kind!r} ({_REFUSED_SHARDINGS[kind]}) "
                                         "is not one reshard places; save DTensors instead")
        if kind != _DTENSOR_TYPE:
            raise newer(self.file, f"{where} has the sharding type {kind!r}")
        d = self.keys(self.keys(value, _PACKED, where)["data"], _DTENSOR, f"{where} {kind}")
        shape = self.ints(d["global_shape"], f"{where} global_shape")
        self.ints(d["stride"], f"{where} stride")  # the global tensor's strides: the bytes are the file's own
        if len(d["stride"]) != len(shape):
            raise self.corrupt(where, f"stride {d['stride']!r} does not fit global_shape {list(shape)}")
        dtype = d["dtype"]
        name = dtype.removeprefix("torch.") if isinstance(dtype, str) and dtype.startswith("torch.") else None
        if name is None or name not in DTYPES:
            raise newer(self.file, f"{where} has the dtype {dtype!r}")
        mesh = self.keys(d["mesh_spec"], _MESH, f"{where} mesh_spec")
        mesh_shape = self.ints(mesh["mesh_shape"], f"{where} mesh_shape", low=1)
        mesh_ranks = self.ints(mesh["mesh_data"], f"{where} mesh_data")
        names = mesh["mesh_dim_names"]
        if not isinstance(mesh["device_type"], str):
            raise self.corrupt(where, f"device_type {mesh['device_type']!r} is not a string")
        if (not mesh_shape or len(mesh_ranks) != math.prod(mesh_shape) or len(set(mesh_ranks)) != len(mesh_ranks)
                or max(mesh_ranks) >= world):
            raise self.corrupt(where, f"mesh_data {mesh_ranks!r} is not {math.prod(mesh_shape or (0,))} distinct ranks "
                                      f"of a world of {world} for mesh_shape {mesh_shape!r}")
        if names is not None and (not isinstance(names, (list, tuple)) or len(names) != len(mesh_shape)
                                  or not all(isinstance(n, str) for n in names)):
            raise self.corrupt(where, f"mesh_dim_names {names!r} do not name the dims of mesh_shape {mesh_shape!r}")
        placements = self.placements(d["placements"], where, len(shape), len(mesh_shape))
        return DTensorSharding(shape, DTYPES[name], mesh_shape, mesh_ranks, tuple(names) if names else None,
                               placements)

    def placements(self, value: Any, where: str, ndim: int, mesh_ndim: int) -> tuple[Placement, ...]:
        if not isinstance(value, (list, tuple)) or len(value) != mesh_ndim:
            raise self.corrupt(where, f"placements {value!r} are not one per mesh dim ({mesh_ndim})")
        out: list[Placement] = []
        for p in value:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in _REFUSED_PLACEMENTS:
                raise UnsupportedFormatError(f"{self.file}: {where}: is sharded with {_REFUSED_PLACEMENTS[kind]}")
            if kind not in _PLACEMENTS:
                raise newer(self.file, f"{where} has the placement {kind!r}")
            self.keys(p, _PLACEMENTS[kind], f"{where} placement {kind}")
            if kind == "Replicate":
                out.append(REPLICATE)
                continue
            dim = p["dim"]
            if type(dim) is not int or not 0 <= dim < ndim:
                raise self.corrupt(where, f"Shard dim {dim!r} for a tensor of {ndim} dims")
            out.append(shard(dim))
        return tuple(out)

    def distinct_files(self, items: Mapping[str, ItemMetadata]) -> None:
        """No two items' ranks write one file (torch_checkpointing checks this when it saves)."""
        owner: dict[str, tuple[str, int]] = {}
        for item, meta in items.items():
            for rank, layout in meta.layouts.items():
                other = owner.setdefault(layout.file, (item, rank))
                if other != (item, rank):
                    raise self.corrupt("rank_to_layout_info", f"item {other[0]!r} rank {other[1]} and item {item!r} "
                                                              f"rank {rank} both name the file {layout.file!r}")


def joined(path: Sequence[str | int]) -> str:
    """A nested path as SafetensorsSerialization keys it: its parts joined with dots."""
    return ".".join(map(str, path))
