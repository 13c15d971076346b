"""Device meshes and placements: where each rank's shard of a tensor sits, by DTensor's rules.

This module knows DTensor's sharding semantics and nothing about files. A mesh is a shape
with a name per dimension (``4x8`` is ``dp_replicate=4,dp_shard=8``); a placement per mesh
dimension says how a tensor is laid over it: ``Shard(d)`` cuts tensor dim ``d`` the way
``torch.chunk`` does (chunks of ceil(n/k), so trailing ranks may hold less or nothing), and
``Replicate`` gives every rank along that mesh dimension the same data. Several mesh
dimensions may shard the same tensor dim: they cut it in mesh order, each cutting the piece
left by the previous one, as ``DTensor`` does by default.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from reshard.core.boxes import Box
from reshard.core.errors import UsageError

__all__ = [
    "KNOWN_DIMS",
    "REPLICATE",
    "MeshSpec",
    "Placement",
    "check_fits",
    "distinct_boxes",
    "format_placement",
    "local_boxes",
    "parse_mesh",
    "parse_placement",
    "rank_coordinate",
    "shard",
    "shard_box",
]

# ("Shard", dim) or ("Replicate", None): plain tuples, so they compare and hash as values.
Placement = tuple[str, int | None]
REPLICATE: Placement = ("Replicate", None)


def shard(dim: int) -> Placement:
    return ("Shard", dim)


_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_DEFAULT_NAMES = {1: ("dp_shard",), 2: ("dp_replicate", "dp_shard")}
# Named mesh dims reshard understands (torchtitan's names); anything else is a typo until a
# PLAN.json says what it means (--placements).
KNOWN_DIMS = ("dp_replicate", "dp_shard", "tp", "cp", "ep", "pp")


@dataclass(frozen=True)
class MeshSpec:
    """A device mesh without devices: its shape and the name of each dimension."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    named: bool = False  # the user named the dims (``dp_shard=2,tp=2``), rather than ``2x2``

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.names, self.shape))

    @property
    def label(self) -> str:
        """``4x8``: how the mesh appears in default output names."""
        return "x".join(str(s) for s in self.shape)


def parse_mesh(spec: str) -> MeshSpec:
    """``8``, ``4x8`` or ``dp_replicate=4,dp_shard=8`` (also ``tp=2``, ``cp=2``...)."""
    text = str(spec).strip().lower()
    hint = "give the mesh as 8, 4x8 or dp_replicate=4,dp_shard=8"
    if not text:
        raise UsageError(f"empty mesh spec; {hint}")
    if "=" in text:
        names, shape = [], []
        for part in text.split(","):
            name, eq, size = part.strip().partition("=")
            name = name.strip()
            if not eq or not _NAME.match(name) or not size.strip().isdigit():
                raise UsageError(f"mesh spec {spec!r}: {part.strip()!r} is not NAME=SIZE; {hint}")
            if name not in KNOWN_DIMS:
                raise UsageError(f"mesh spec {spec!r}: unknown dimension {name!r}; name dims "
                                 f"{', '.join(KNOWN_DIMS)} (or give the shape only: 8, 4x8)")
            if name in names:
                raise UsageError(f"mesh spec {spec!r} names {name!r} twice")
            names.append(name)
            shape.append(int(size))
    else:
        parts = text.split("x")
        if not all(p.strip().isdigit() for p in parts):
            raise UsageError(f"mesh spec {spec!r} is not understood; {hint}")
        shape = [int(p) for p in parts]
        names = list(_DEFAULT_NAMES.get(len(shape), tuple(f"dim{i}" for i in range(len(shape)))))
    if any(s < 1 for s in shape):
        raise UsageError(f"mesh spec {spec!r}: every mesh dimension needs at least 1 rank")
    return MeshSpec(tuple(shape), tuple(names), named="=" in text)


_PLACEMENT = re.compile(r"^\s*(?:(shard)\s*\(\s*(-?\d+)\s*\)|(replicate)\s*(?:\(\s*\))?|s(\d+)|r)\s*$", re.IGNORECASE)


def parse_placement(text: str) -> Placement:
    """``Shard(0)``, ``Replicate()`` (also ``Replicate``, ``S0``, ``R``)."""
    m = _PLACEMENT.match(str(text))
    if not m:
        raise UsageError(f"placement {text!r} is not understood; use Shard(d) or Replicate()")
    if m.group(1):
        return shard(int(m.group(2)))
    if m.group(4):
        return shard(int(m.group(4)))
    return REPLICATE


def format_placement(p: Placement) -> str:
    return f"Shard({p[1]})" if p[0] == "Shard" else "Replicate()"


def rank_coordinate(rank: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """A rank's coordinate in a mesh laid out in C order, as ``init_device_mesh`` does."""
    return tuple(rank // math.prod(mesh_shape[i + 1 :]) % n for i, n in enumerate(mesh_shape))


def shard_box(
    global_shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
) -> Box:
    """Where the shard of the rank at ``coordinate`` sits: mesh dims in order, each
    ``Shard(d)`` cutting the current extent of ``d`` as ``torch.chunk`` does. An empty shard
    sits at the end of the dim it was cut from, as DTensor places it."""
    offsets, sizes = [0] * len(global_shape), list(global_shape)
    for mesh_dim, (kind, dim) in enumerate(placements):
        if kind != "Shard" or dim is None:
            continue
        n, k = sizes[dim], mesh_shape[mesh_dim]
        step = -(-n // k)
        start = min(coordinate[mesh_dim] * step, n)
        offsets[dim] += start
        sizes[dim] = min(step, n - start)
    return Box(tuple(offsets), tuple(sizes))


def check_fits(name: str, shape: tuple[int, ...], placements: tuple[Placement, ...], mesh: MeshSpec) -> None:
    """Refuse a placement that cannot apply to this tensor, before any byte is written."""
    if len(placements) != mesh.ndim:
        raise UsageError(
            f"{name!r}: {len(placements)} placements for a {mesh.ndim}-D mesh ({mesh}); give one per mesh dimension"
        )
    for p in placements:
        if p[0] == "Shard" and not (p[1] is not None and 0 <= p[1] < len(shape)):
            raise UsageError(
                f"{name!r} has shape {list(shape)}: {format_placement(p)} does not fit it; "
                "fix the placements (PLAN.json) for this tensor"
            )


@functools.lru_cache(maxsize=4096)
def _rank_boxes(shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...],
                ) -> tuple[tuple[Box, ...], tuple[tuple[Box, tuple[int, ...]], ...]]:
    """(every rank's box, each distinct box with the ranks that hold it). Cached: a model's
    layers repeat a handful of shapes, and a 405B model on 256 ranks would otherwise build
    the same 256 boxes for each of its 3,411 tensors."""
    boxes = tuple(shard_box(shape, placements, mesh_shape, rank_coordinate(r, mesh_shape))
                  for r in range(math.prod(mesh_shape)))
    holders: dict[Box, list[int]] = {}
    for rank, box in enumerate(boxes):
        holders.setdefault(box, []).append(rank)
    return boxes, tuple((box, tuple(ranks)) for box, ranks in holders.items())


def local_boxes(shape: tuple[int, ...], placements: tuple[Placement, ...], mesh: MeshSpec) -> list[Box]:
    """Every rank's local shard, indexed by rank."""
    return list(_rank_boxes(tuple(shape), tuple(placements), mesh.shape)[0])


def mesh_shards(shape: tuple[int, ...], placements: tuple[Placement, ...], mesh: MeshSpec, itemsize: int,
                load: list[int]) -> tuple[list[Box], list[Box], list[int]]:
    """(every rank's local box, the distinct boxes, the rank that stores each): ``local_boxes``
    and ``distinct_boxes`` in one, from the cache."""
    shape, placements = tuple(shape), tuple(placements)
    local, holders = _rank_boxes(shape, placements, mesh.shape)
    fixed = _fixed_owners(shape, placements, mesh.shape, itemsize)
    if fixed is None:
        return list(local), *_assign_owners(holders, itemsize, load)
    boxes, ranks, added = fixed
    for rank, nbytes in added:
        load[rank] += nbytes
    return list(local), list(boxes), list(ranks)


@functools.lru_cache(maxsize=4096)
def _fixed_owners(shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...], itemsize: int
                  ) -> tuple[tuple[Box, ...], tuple[int, ...], tuple[tuple[int, int], ...]] | None:
    """``_assign_owners`` where no box is held by several ranks: then who stores each box does
    not depend on the load so far, and a model's layers (a handful of shapes) are placed once.
    (boxes, their ranks, (rank, bytes added to its load) pairs); None when some box has replicas."""
    _, holders = _rank_boxes(shape, placements, mesh_shape)
    if any(len(ranks) > 1 for _, ranks in holders):
        return None
    added: dict[int, int] = {}
    for box, (rank,) in holders:
        added[rank] = added.get(rank, 0) + box.numel * itemsize
    return tuple(b for b, _ in holders), tuple(r for _, (r,) in holders), tuple(added.items())


def distinct_boxes(boxes: list[Box], itemsize: int, load: list[int]) -> tuple[list[Box], list[int]]:
    """The distinct shards among ranks' local boxes (replicas stored once) and the rank that
    stores each: among the ranks holding a replica, the one with the fewest bytes so far
    (``load``, per rank, carried across tensors and updated here), so that replicated data
    spreads over all ranks' files as torch's DCP deduplication does."""
    holders: dict[Box, list[int]] = {}
    for rank, box in enumerate(boxes):
        holders.setdefault(box, []).append(rank)
    return _assign_owners(tuple((box, tuple(ranks)) for box, ranks in holders.items()), itemsize, load)


def _assign_owners(holders: tuple[tuple[Box, tuple[int, ...]], ...], itemsize: int,
                   load: list[int]) -> tuple[list[Box], list[int]]:
    out_boxes, out_ranks = [], []
    for box, ranks in holders:
        owner = ranks[0] if len(ranks) == 1 else min(ranks, key=lambda r: (load[r], r))
        load[owner] += box.numel * itemsize
        out_boxes.append(box)
        out_ranks.append(owner)
    return out_boxes, out_ranks
