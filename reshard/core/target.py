"""The target: what an output will hold, before any byte moves.

Plain data, like the catalog it is built from (``plan.full_target``, ``mesh.target``): every
tensor's name, shape, dtype and the boxes each target rank's file stores, plus the objects
and the mesh. Writers lay their files out from it (``protocol.Writer.layout``).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from reshard.core import dtypes
from reshard.core.boxes import Box
from reshard.core.catalog import NestedPath
from reshard.core.dtypes import DType
from reshard.core.facts import Facts
from reshard.core.sharding import MeshSpec, Placement

__all__ = ["TargetTensor", "Target"]


@dataclass
class TargetTensor:
    """A tensor as the output will store it: ``boxes[i]`` is written into the file of target
    rank ``ranks[i]`` (always 0 for layouts without a mesh). On a mesh, ``boxes`` are the
    distinct shards (replicas once), ``local[r]`` is rank ``r``'s own shard and
    ``placements`` say how the tensor lies over the mesh."""

    name: str
    shape: tuple[int, ...]
    dtype: DType  # a torch dtype given here is taken as its DType
    boxes: list[Box]
    ranks: list[int]
    local: list[Box] | None = None
    placements: tuple[Placement, ...] | None = None

    def __post_init__(self) -> None:
        self.dtype = dtypes.of(self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(b.numel for b in self.boxes) * self.dtype.itemsize


@dataclass
class Target:
    """What an output will hold, before any byte moves: writers lay files out from this."""

    tensors: dict[str, TargetTensor]
    objects: MutableMapping[str, Any]  # a dict, or an ObjectTable read lazily
    paths: dict[str, NestedPath]
    facts: Facts
    world_size: int = 1
    mesh: MeshSpec | None = None
    notices: list[str] = field(default_factory=list)  # what the layout dropped or changed
    # tensor name -> the source's name where they differ (``Catalog.renamed_from``)
    renamed_from: dict[str, str] = field(default_factory=dict, repr=False)

    def nested_path(self, name: str) -> NestedPath:
        return self.paths.get(name, (name,))
