"""One item of a torch_checkpointing folder as catalog entries, from every rank's file of it.

An item saved with a resharder (``sharded_item``) has its tensors in ``metadata.pkl``: the global
shape, dtype, mesh and placements of each, and which ranks hold it. Each rank's part sits where
DTensor's sharding rules put it; the part in the rank's file must have exactly that shape and
dtype (and, for a DTensor in a torch file, the same global shape, mesh, coordinate and
placements), distinct parts become chunks (replicas once, empty shards not at all), and they
must tile the tensor exactly. Every tensor in a file must be one the metadata gives that rank.
A plain tensor, which torch_checkpointing records as replicated on every rank, is read from the
first rank's file, as its own loader reads any one copy: the record says the copies are equal,
and comparing them would read tensor data.

An item saved without one (``plain_item``) has no record: only what its files prove is read. A
DTensor carries its own mesh, coordinate and placements (``reshard.formats.torch.ranks``); a
plain tensor is whole when one rank saved the item, or when every rank saved the same bytes
(compared by SHA-256, the one read of tensor data a catalog makes, and only here); otherwise
nothing says where each rank's copy belongs, and the item is refused.

Objects (non-tensor values: ``param_groups``, a step counter) are kept once when every rank
saved the same value, else once per rank (``NAME.rank<r>``), as the per-rank torch reader does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from reshard.formats.torch.ranks import (
    dtensor_placements,
    objects_differ,
    per_rank_name,
    plain_copies_differ,
    sharded_entry,
)
from reshard.formats.torch.save import RefusedLeaf, leaf_loader
from reshard.formats.torch.zip import DTensorRef
from reshard.formats.torch_checkpointing.files import RankFile, is_tensor
from reshard.formats.torch_checkpointing.metadata import DTensorSharding, ItemMetadata

from reshard.core.boxes import Box, full_box, tiles_exactly
from reshard.core.catalog import Catalog, Chunk, NestedPath, ObjectTable, TensorEntry
from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError
from reshard.core.regions import StoredRegion
from reshard.core.sharding import format_placement

__all__ = ["sharded_item", "plain_item", "add_objects"]


def _name(nested: NestedPath) -> str:
    return ".".join(map(str, nested))


def sharded_item(catalog: Catalog, item: str, meta: ItemMetadata, files: dict[int, RankFile]) -> None:
    """The tensors of an item ``metadata.pkl`` describes, placed by their recorded sharding."""
    held: dict[int, set[NestedPath]] = {r: set() for r in files}
    placements = dict(catalog.facts.source_placements or {})
    for path, groups in meta.paths.items():
        nested = (item, *path)
        name = _name(nested)
        first = groups[0].sharding
        chunks: dict[Box, Chunk] = {}
        for group in groups:
            s = group.sharding
            if (s.global_shape, s.dtype) != (first.global_shape, first.dtype):
                raise CorruptCheckpointError(
                    f"{catalog.path}/metadata.pkl: {name!r} is {first.dtype} {list(first.global_shape)} on ranks "
                    f"{groups[0].ranks} but {s.dtype} {list(s.global_shape)} on ranks {group.ranks}")
            for rank in group.ranks:
                box = s.box(rank)
                region = _local_part(files[rank], nested, name, s, box)
                held[rank].add(nested)
                if box.numel > 0 and box not in chunks:  # replicas are stored once, empty shards not at all
                    chunks[box] = Chunk(box, region)
        why = tiles_exactly(first.global_shape, list(chunks))
        if why is not None:
            raise CorruptCheckpointError(f"{catalog.path}: the ranks' parts of {name!r} do not make up the tensor "
                                         f"metadata.pkl describes: {why}")
        _unclaimed(catalog, name)
        catalog.tensors[name] = TensorEntry(name, first.global_shape, first.dtype, list(chunks.values()))
        catalog.paths[name] = nested
        if catalog.facts.source_mesh is None and any(kind == "Shard" for kind, _ in first.placements):
            catalog.facts.source_mesh = first.mesh_shape  # plain tensors are recorded replicated on every rank
            catalog.facts.source_mesh_dim_names = first.mesh_dim_names
        placements[name] = [format_placement(p) for p in first.placements]
    if placements:
        catalog.facts.source_placements = placements
    for rank, rank_file in files.items():
        extra = [n for n, leaf in rank_file.leaves.items() if is_tensor(leaf) and n not in held[rank]]
        if extra:
            raise CorruptCheckpointError(f"{rank_file.path}: holds the tensor {_name(extra[0])!r}, which metadata.pkl "
                                         f"does not give rank {rank}")


def _local_part(rank_file: RankFile, nested: NestedPath, name: str, s: DTensorSharding, box: Box) -> StoredRegion:
    """The stored part of ``name`` in ``rank_file``, checked against what the sharding says it is."""
    where = f"{rank_file.path}: {name!r}"
    leaf = rank_file.leaves.get(nested)
    if leaf is None:
        raise CorruptCheckpointError(f"{rank_file.path}: lacks {name!r}, which metadata.pkl says rank {rank_file.rank} "
                                     "holds")
    if isinstance(leaf, DTensorRef):
        coordinate = s.coordinate(rank_file.rank)
        if (leaf.global_shape != s.global_shape or leaf.mesh_shape != s.mesh_shape
                or dtensor_placements(leaf, where) != s.placements
                or (leaf.coordinate is not None and tuple(leaf.coordinate) != coordinate)):
            raise CorruptCheckpointError(
                f"{where} is a DTensor of shape {list(leaf.global_shape)} on mesh {leaf.mesh_shape} at {leaf.coordinate}, "
                f"but metadata.pkl records shape {list(s.global_shape)} on mesh {s.mesh_shape} at {coordinate} "
                f"({', '.join(map(format_placement, s.placements))})")
        leaf = leaf.local
    if not isinstance(leaf, StoredRegion):
        raise CorruptCheckpointError(f"{where} is a {type(leaf).__name__}, but metadata.pkl records a tensor")
    if leaf.shape != box.sizes or leaf.dtype != s.dtype:
        raise CorruptCheckpointError(
            f"{where}: rank {rank_file.rank}'s part is {leaf.dtype} {list(leaf.shape)}, but metadata.pkl's sharding gives "
            f"it {s.dtype} {list(box.sizes)} at offset {list(box.offsets)}")
    return leaf


def plain_item(catalog: Catalog, item: str, files: dict[int, RankFile]) -> None:
    """The tensors of an item saved without a resharder, where the files prove their places."""
    world = len(files)
    paths = list(dict.fromkeys(n for f in files.values() for n, leaf in f.leaves.items() if is_tensor(leaf)))
    placements = dict(catalog.facts.source_placements or {})
    for nested in paths:
        name = _name(nested)
        copies = [(r, f.path, f.leaves[nested]) for r, f in files.items() if nested in f.leaves]
        kinds = {type(leaf).__name__ for _, _, leaf in copies}
        if len(kinds) > 1 or not all(is_tensor(leaf) for _, _, leaf in copies):
            raise CorruptCheckpointError(f"{catalog.path}: {name!r} is not the same kind of value in every rank's file "
                                         f"of item {item!r} ({', '.join(sorted(kinds))})")
        if len(copies) != world:
            missing = sorted(set(files) - {r for r, _, _ in copies})
            raise CorruptCheckpointError(f"{files[missing[0]].path}: lacks {name!r}, which the other ranks' files hold")
        _unclaimed(catalog, name)
        if isinstance(copies[0][2], DTensorRef):
            ref = copies[0][2]
            catalog.tensors[name] = sharded_entry(name, [(r, p, leaf) for r, p, leaf in copies], world, catalog.path)
            placements[name] = [format_placement(p) for p in dtensor_placements(ref, f"{copies[0][1]}: {name!r}")]
            if catalog.facts.source_mesh is None:
                catalog.facts.source_mesh = ref.mesh_shape
                catalog.facts.source_mesh_dim_names = tuple(ref.mesh_dim_names) if ref.mesh_dim_names else None
        else:
            regions = [(r, p, leaf) for r, p, leaf in copies]
            if world > 1 and plain_copies_differ(regions):
                raise UnsupportedFormatError(
                    f"{catalog.path}: {name!r} differs between the ranks' files of item {item!r}, which was saved "
                    "without a resharder, so nothing records where each rank's part belongs; save it with "
                    "ItemSpec(resharder=DefaultResharder()) (or read one rank's file on its own)")
            region = regions[0][2]
            catalog.tensors[name] = TensorEntry(name, region.shape, region.dtype, [Chunk(full_box(region.shape), region)])
        catalog.paths[name] = nested
    if placements:
        catalog.facts.source_placements = placements


def _unclaimed(catalog: Catalog, name: str) -> None:
    """Two values under one name (a tensor and an object, or two items' paths that read alike)
    would leave one of them out: refused, never one dropped."""
    if name in catalog.tensors or name in catalog.objects:
        raise CorruptCheckpointError(f"{catalog.path}: two values are saved under the name {name!r}; "
                                     "reshard cannot tell which one a reader means")


def add_objects(catalog: Catalog, item: str, files: dict[int, RankFile]) -> list[str]:
    """The item's non-tensor values: once when every rank saved the same, else once per rank.
    Returns the names kept per rank."""
    objects = cast(ObjectTable, catalog.objects)  # the table the reader made
    per_rank: list[str] = []
    paths = list(dict.fromkeys(n for f in files.values() for n, leaf in f.leaves.items() if not is_tensor(leaf)))
    for nested in paths:
        name = _name(nested)
        _unclaimed(catalog, name)
        copies: list[tuple[int, Path, Any]] = [(r, f.path, f.leaves[nested]) for r, f in files.items()
                                               if nested in f.leaves]
        if any(is_tensor(leaf) for _, _, leaf in copies):
            raise CorruptCheckpointError(f"{catalog.path}: {name!r} is a tensor in some ranks' files of item {item!r} "
                                         "and not in others")
        refused = next(((p, leaf) for _, p, leaf in copies if isinstance(leaf, RefusedLeaf)), None)
        if refused is not None:  # refused when asked for, whatever the other ranks hold
            objects.set_lazy(name, leaf_loader(refused[1], str(refused[0]), name))
            catalog.paths[name] = nested
        elif len(copies) == len(files) and not objects_differ(copies):
            objects.set_lazy(name, leaf_loader(copies[0][2], str(copies[0][1]), name))
            catalog.paths[name] = nested
        else:
            per_rank.append(name)
            for rank, path, leaf in copies:
                flat, where = per_rank_name(name, nested, rank)
                if flat in catalog.tensors or flat in objects:
                    raise UnsupportedFormatError(f"{catalog.path}: {name!r} differs between the ranks' files, and its "
                                                 f"per-rank name {flat!r} is taken by another entry")
                objects.set_lazy(flat, leaf_loader(leaf, str(path), flat))
                catalog.paths[flat] = where
    return per_rank
