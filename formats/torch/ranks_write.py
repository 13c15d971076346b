"""Writing per-rank torch files for a mesh, and reading back the layout record they carry.

``--to torch --to-mesh N`` writes ``rank{r}.pt`` per target rank: a torch.save archive with
that rank's local shards as plain tensors, nested as the source state dict was, every object,
and a ``reshard_layout`` entry (a JSON string: mesh, the rank's coordinate, and per tensor its
global shape, offsets and placements). Plain tensors keep the files loadable with
``torch.load(weights_only=True)`` by any framework, and the record lets reshard (or anyone)
put the shards back together without pickled DTensors and their device meshes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from reshard.formats.torch.save import (
    FlatTree,
    build_tree,
    embed_tensors,
    leaf_loader,
)
from reshard.formats.torch.zip_write import PieceRef, torch_save_segments

from reshard.core.boxes import Box, tiles_exactly
from reshard.core.catalog import Catalog, Chunk, ObjectTable, TensorEntry
from reshard.core.errors import CorruptCheckpointError, UsageError
from reshard.core.facts import Facts
from reshard.core.pieces import OutputFile, Piece
from reshard.core.regions import StoredRegion
from reshard.core.sharding import format_placement, parse_placement, rank_coordinate, shard_box
from reshard.core.target import Target

__all__ = ["LAYOUT_KEY", "TorchRanksWriter", "read_layout_files"]

LAYOUT_KEY = "reshard_layout"


class TorchRanksWriter:
    """``rank{r}.pt`` for every rank of the target mesh."""

    output_is_dir = True

    def layout(self, target: Target) -> list[OutputFile]:
        if target.mesh is None:
            raise UsageError("per-rank torch files need a mesh: add --to-mesh N (or write --to torch for one file)")
        files = []
        order = {name: i for i, name in enumerate(target.paths)}
        for rank in range(target.world_size):
            records: dict[str, Any] = {}
            leaves: dict[str, Any] = {}
            tensors = {}
            for t in target.tensors.values():
                box = t.local[rank] if t.local is not None else t.boxes[0]
                key = str(len(records))
                records[key] = Piece(t.name, box, t.dtype)
                leaves[t.name] = PieceRef(key, t.dtype, box.sizes)
                tensors[t.name] = {"shape": list(t.shape), "offsets": list(box.offsets),
                                   "placements": [format_placement(p) for p in t.placements or ()]}
            for name, value in target.objects.items():
                leaves[name] = embed_tensors(value, records)
            record = {"mesh": {"shape": list(target.mesh.shape), "names": list(target.mesh.names)}, "rank": rank,
                      "coordinate": list(rank_coordinate(rank, target.mesh.shape)), "tensors": tensors}
            names = sorted(leaves, key=lambda n: order.get(n, len(order)))
            nested = [(target.nested_path(n), leaves[n]) for n in names] + [((LAYOUT_KEY,), json.dumps(record))]
            tree = build_tree(nested, target.facts.containers)
            files.append(OutputFile(f"rank{rank}.pt", torch_save_segments(tree, records, archive=f"rank{rank}")))
        return files

    def finish(self, staging: Path, target: Target, files: list[OutputFile]) -> None:
        """Nothing comes last: each rank's archive is complete once written."""

    def notices(self, target: Target) -> list[str]:
        return []


def _record(tree: FlatTree, file: Path) -> dict[str, Any]:
    _, text = tree.leaves[LAYOUT_KEY]
    try:
        record = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError:
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("tensors"), dict) or "mesh" not in record:
        raise CorruptCheckpointError(f"{file}: the {LAYOUT_KEY!r} entry is not a reshard layout record")
    return record


def read_layout_files(path: Path, files: dict[int, Path], trees: dict[int, FlatTree]) -> Catalog:
    """A catalog of per-rank files that carry a ``reshard_layout`` record: every shard is
    checked against DTensor's rules for its placements before it is trusted."""
    catalog = Catalog(format="torch-ranks", path=path, facts=Facts(source_world_size=len(files)))
    chunks: dict[str, dict[Box, Chunk]] = {}
    for rank, tree in trees.items():
        file = files[rank]
        record = _record(tree, file)
        try:
            mesh_shape = tuple(int(s) for s in record["mesh"]["shape"])
            coord = tuple(int(c) for c in record["coordinate"])
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpointError(f"{file}: {LAYOUT_KEY!r} lacks a valid mesh shape or coordinate") from None
        if len(files) != math.prod(mesh_shape) or coord != rank_coordinate(rank, mesh_shape):
            raise CorruptCheckpointError(f"{file}: written for rank at {coord} of mesh {mesh_shape}, found as rank {rank} of "
                                         f"{len(files)}")
        for name, info in record["tensors"].items():
            nested, leaf = tree.leaves.get(name, ((), None))
            if not isinstance(leaf, StoredRegion):
                raise CorruptCheckpointError(f"{file}: the layout names {name!r}, which is not a tensor in the file")
            shape = tuple(int(s) for s in info.get("shape", ()))
            placements = tuple(parse_placement(p) for p in info.get("placements", ()))
            box = shard_box(shape, placements, mesh_shape, coord) if placements else Box((0,) * len(shape), shape)
            if box.sizes != leaf.shape or list(box.offsets) != list(info.get("offsets", box.offsets)):
                raise CorruptCheckpointError(f"{file}: {name!r} shard {list(leaf.shape)} does not sit where its placements say")
            entry = catalog.tensors.setdefault(name, TensorEntry(name, shape, leaf.dtype))
            if entry.shape != shape or entry.dtype != leaf.dtype:
                raise CorruptCheckpointError(f"{file}: {name!r} is {leaf.dtype} {list(shape)} here, {entry.dtype} "
                                             f"{list(entry.shape)} in rank 0's file")
            if box.numel:
                chunks.setdefault(name, {}).setdefault(box, Chunk(box, leaf))
            catalog.paths[name] = nested
    for name, entry in catalog.tensors.items():
        entry.chunks = list(chunks.get(name, {}).values())
        why = tiles_exactly(entry.shape, [c.box for c in entry.chunks])
        if why is not None:
            raise CorruptCheckpointError(f"{path}: the rank files' shards of {name!r} do not make up the tensor: {why}")
    objects = ObjectTable()
    for name, (nested, leaf) in trees[0].leaves.items():
        if name == LAYOUT_KEY or name in catalog.tensors:
            continue
        if isinstance(leaf, StoredRegion):  # a tensor inside an object: whole, from rank 0
            catalog.tensors[name] = TensorEntry(name, leaf.shape, leaf.dtype, [Chunk(Box((0,) * len(leaf.shape), leaf.shape),
                                                                                     leaf)])
        else:
            objects.set_lazy(name, leaf_loader(leaf, str(files[0]), name))
        catalog.paths[name] = nested
    catalog.objects = objects
    record0 = _record(trees[0], files[0])
    catalog.facts.source_mesh = tuple(record0["mesh"]["shape"])
    catalog.facts.source_mesh_dim_names = tuple(record0["mesh"].get("names", ()))
    catalog.facts.source_placements = {n: i.get("placements", []) for n, i in record0["tensors"].items()}
    if trees[0].containers:
        catalog.facts.containers = trees[0].containers
    return catalog

