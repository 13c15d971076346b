"""The catalog: what a checkpoint holds, independent of how its format stores it.

Plain data only. A catalog names every tensor with its global shape, dtype and the chunks
(boxes) it is stored in, plus the small non-tensor objects (step counters, optimizer
hyper-parameters, configs). Formats build catalogs; plans and engines consume them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from reshard.boxes import Box

if TYPE_CHECKING:
    from reshard.layout import MeshSpec, Placement

__all__ = ["ChunkData", "Chunk", "TensorEntry", "Catalog", "NestedPath", "TargetTensor", "Target"]

# Where a flat name sits in the nested state dict: ("optim", "state", "0.weight", "exp_avg").
NestedPath = tuple[str | int, ...]


class ChunkData(Protocol):
    """Something that can produce any sub-box of one stored chunk as a CPU tensor."""

    def read(self, box: Box) -> torch.Tensor:
        """``box`` is relative to the chunk's own origin; returns a tensor of ``box.sizes``."""
        ...


@dataclass(frozen=True)
class Chunk:
    box: Box  # where the chunk sits in the global tensor
    data: ChunkData


@dataclass
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass
class Catalog:
    """A checkpoint's contents. ``paths`` gives the nested position of flat names whose
    nesting cannot be recovered by splitting on dots (DCP's planner_data); ``attrs`` holds
    provenance (source mesh, HF config...) that writers may record."""

    format: str
    path: Path
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, NestedPath] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def nested_path(self, name: str) -> NestedPath:
        return self.paths.get(name, (name,))


@dataclass
class TargetTensor:
    """A tensor as the output will store it: ``boxes[i]`` is written into the file of target
    rank ``ranks[i]`` (always 0 for layouts without a mesh). On a mesh, ``boxes`` are the
    distinct shards (replicas once), ``local[r]`` is rank ``r``'s own shard and
    ``placements`` say how the tensor lies over the mesh."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: list[Box]
    ranks: list[int]
    local: list[Box] | None = None
    placements: tuple[Placement, ...] | None = None

    @property
    def nbytes(self) -> int:
        return sum(b.numel for b in self.boxes) * self.dtype.itemsize


@dataclass
class Target:
    """What an output will hold, before any byte moves: writers lay files out from this."""

    tensors: dict[str, TargetTensor]
    objects: dict[str, Any]
    paths: dict[str, NestedPath]
    attrs: dict[str, Any]
    world_size: int = 1
    mesh: MeshSpec | None = None
    notices: list[str] = field(default_factory=list)  # what the layout dropped or changed

    def nested_path(self, name: str) -> NestedPath:
        return self.paths.get(name, (name,))
