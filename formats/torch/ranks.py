"""A folder of per-rank ``torch.save`` files: what a job gets from saving an FSDP2 (or any
DTensor) ``model.state_dict()`` on every rank, as ``rank0.pt``, ``model_rank_1.bin``,
``model_world_size_4_rank_3.pt``...

Each file holds that rank's local shards as DTensors, which carry the global shape, the
mesh shape, the rank's mesh coordinate and the placements. Where each shard sits in the
global tensor follows from DTensor's sharding rules, so the folder becomes a catalog with one
chunk per distinct shard: replicated copies are stored once, empty shards not at all, and the
chunks must tile every tensor exactly (a missing or foreign rank file is caught here, not
when the bytes are already half written).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from reshard.formats.torch.file import read_torch_file
from reshard.formats.torch.ranks_write import (
    LAYOUT_KEY,
    read_layout_files,
)
from reshard.formats.torch.save import (
    TORCH_SUFFIXES,
    FlatTree,
    OnDisk,
    RefusedLeaf,
    flatten_tree,
    leaf_loader,
)
from reshard.formats.torch.zip import DTensorRef, Record

from reshard.core.boxes import Box, full_box, tiles_exactly
from reshard.core.catalog import Catalog, Chunk, ObjectTable, TensorEntry
from reshard.core.errors import (
    CorruptCheckpointError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from reshard.core.facts import Facts
from reshard.core.regions import StoredRegion
from reshard.core.sharding import Placement, shard_box
from reshard.core.values import same_value, tensor_digest

__all__ = ["rank_files", "read_set", "read_trees", "complete_set", "first_refused", "one_set", "dtensor_placements",
           "sharded_entry", "plain_copies_differ", "objects_differ", "per_rank_name"]

_RANK = re.compile(r"(?<![a-z])rank[_-]?(\d+)(?!\d)", re.IGNORECASE)
# torch.distributed.checkpoint._experimental's checkpointer: one torch.save per rank, named by the
# rank alone. Taken as a rank set only when the numbers run 0..N-1 (not step-numbered saves).
_EXPERIMENTAL = re.compile(r"checkpoint_(\d+)\.pt")

def rank_files(folder: Path) -> dict[str, dict[int, Path]]:
    """Torch files whose names carry a rank number, grouped by the name around the number
    (``model_rank{}.pt``); a name that repeats a rank (``rank1``, ``rank01``) keeps the first."""
    groups: dict[str, dict[int, Path]] = {}
    for p in sorted(folder.iterdir()):
        if p.suffix.lower() not in TORCH_SUFFIXES or not p.is_file():
            continue
        found = list(_RANK.finditer(p.name))
        if found:
            m = found[-1]
            groups.setdefault(p.name[: m.start(1)] + "{}" + p.name[m.end(1) :], {}).setdefault(int(m.group(1)), p)
        elif numbered_by_rank := _EXPERIMENTAL.fullmatch(p.name):
            groups.setdefault("checkpoint_{}.pt", {}).setdefault(int(numbered_by_rank.group(1)), p)
    numbered = groups.get("checkpoint_{}.pt")
    if numbered is not None and sorted(numbered) != list(range(len(numbered))):
        del groups["checkpoint_{}.pt"]
    return groups


def dtensor_placements(ref: DTensorRef, where: str) -> tuple[Placement, ...]:
    out: list[Placement] = []
    for p in ref.placements:
        kind = p.kind if isinstance(p, Record) else type(p).__name__
        if kind == "Replicate":
            out.append(("Replicate", None))
        elif kind == "Shard":
            state = p.state if isinstance(p, Record) and isinstance(p.state, dict) else {}
            dim = state.get("dim", p.args[0] if isinstance(p, Record) and p.args else None)
            if not isinstance(dim, int) or not -len(ref.global_shape) <= dim < len(ref.global_shape):
                raise CorruptCheckpointError(f"{where}: Shard placement with dim {dim!r} for shape {ref.global_shape}")
            out.append(("Shard", dim % len(ref.global_shape)))
        elif kind == "_StridedShard":
            raise UnsupportedFormatError(
                f"{where}: is sharded with _StridedShard (FSDP2 over tensor parallel on the same dim); "
                "reshard cannot place such shards from per-rank files: save the model with dcp.save instead"
            )
        elif kind == "Partial":
            raise UnsupportedFormatError(
                f"{where}: holds partial sums (Partial placement) that must be reduced first; "
                "redistribute it to Replicate or Shard before saving"
            )
        else:
            raise UnsupportedFormatError(f"{where}: has the unknown DTensor placement {kind!r}")
    if len(out) != len(ref.mesh_shape):
        raise CorruptCheckpointError(f"{where}: {len(out)} placements for a mesh of shape {ref.mesh_shape}")
    _check_shard_order(ref, tuple(out), where)
    return tuple(out)


def _check_shard_order(ref: DTensorRef, placements: tuple[Placement, ...], where: str) -> None:
    """A DTensor may shard one dim over several mesh dims in another order than left to
    right; our rule covers the default order only, so refuse anything else."""
    order = ref.extra.get("shard_order")
    if order is None:
        return
    dims = sorted({d for k, d in placements if k == "Shard" and d is not None})  # a Shard has its dim
    default = [(d, tuple(m for m, (k, dd) in enumerate(placements) if k == "Shard" and dd == d)) for d in dims]
    got = []
    for entry in order if isinstance(order, tuple) else ():
        args = entry.args if isinstance(entry, Record) else ()
        if len(args) == 2 and isinstance(args[1], tuple):
            got.append((args[0], args[1]))
    if got != default:
        raise UnsupportedFormatError(f"{where}: shards in a non-default order ({order!r}); save it with dcp.save instead")


def _coordinate(ref: DTensorRef, rank: int, where: str) -> tuple[int, ...]:
    coord = ref.coordinate
    if coord is None:  # not recorded: the default mesh lays ranks out in C order
        coord = tuple(rank // math.prod(ref.mesh_shape[i + 1 :]) % n for i, n in enumerate(ref.mesh_shape))
    if len(coord) != len(ref.mesh_shape) or not all(isinstance(c, int) and 0 <= c < n for c, n in zip(coord, ref.mesh_shape)):
        raise CorruptCheckpointError(f"{where}: mesh coordinate {coord} does not fit mesh {ref.mesh_shape}")
    return tuple(coord)


def sharded_entry(name: str, shards: list[tuple[int, Path, DTensorRef]], world_size: int, folder: Path) -> TensorEntry:
    _, file0, ref0 = shards[0]
    placements = dtensor_placements(ref0, f"{file0}: {name!r}")
    if math.prod(ref0.mesh_shape) != world_size:
        raise CorruptCheckpointError(
            f"{file0}: {name!r} lives on a mesh of {math.prod(ref0.mesh_shape)} ranks {ref0.mesh_shape}, "
            f"but {folder} holds {world_size} rank files"
        )
    chunks: dict[Box, Chunk] = {}
    for rank, file, ref in shards:
        where = f"{file}: {name!r}"
        same = (ref.global_shape, ref.mesh_shape, ref.local.dtype) == (ref0.global_shape, ref0.mesh_shape, ref0.local.dtype)
        if not same or dtensor_placements(ref, where) != placements:
            raise CorruptCheckpointError(
                f"{where} is {ref.local.dtype} {list(ref.global_shape)} on mesh {ref.mesh_shape}, but in {file0} it is "
                f"{ref0.local.dtype} {list(ref0.global_shape)} on mesh {ref0.mesh_shape} (placements must match too)"
            )
        box = shard_box(ref.global_shape, placements, ref.mesh_shape, _coordinate(ref, rank, where))
        if box.sizes != ref.local.shape:
            raise CorruptCheckpointError(
                f"{where}: the local shard has shape {list(ref.local.shape)}, but DTensor's sharding rules give "
                f"{list(box.sizes)} at mesh coordinate {ref.coordinate} (padded or foreign shard?)"
            )
        if box.numel > 0 and box not in chunks:  # replicas are stored once, empty shards not at all
            chunks[box] = Chunk(box, ref.local)
    why = tiles_exactly(ref0.global_shape, list(chunks))
    if why is not None:
        raise CorruptCheckpointError(f"{folder}: the rank files' shards of {name!r} do not make up the tensor: {why}")
    return TensorEntry(name, ref0.global_shape, ref0.local.dtype, list(chunks.values()))


def plain_copies_differ(copies: list[tuple[int, Path, StoredRegion]]) -> bool:
    """Whether the ranks' copies of a plain tensor differ: shape, dtype or content (a SHA-256
    per rank, streamed in slabs, so no copy is held whole)."""
    first = copies[0][2]
    if any((r.shape, r.dtype) != (first.shape, first.dtype) for _, _, r in copies[1:]):
        return True
    digests = {tensor_digest(r, r.shape, r.dtype) for _, _, r in copies}
    return len(digests) > 1


def objects_differ(copies: list[tuple[int, Path, Any]]) -> bool:
    values = [leaf_loader(v, str(f), "")() if isinstance(v, OnDisk) else v for _, f, v in copies]
    return any(not same_value(values[0], v) for v in values[1:])


def per_rank_name(name: str, nested: tuple, rank: int) -> tuple[str, tuple]:
    """Where rank ``rank``'s own copy of ``name`` goes: one level below it, ``rank{r}``."""
    return f"{name}.rank{rank}", nested + (f"rank{rank}",)


def _kind(leaf: Any) -> str:
    return "DTensor" if isinstance(leaf, DTensorRef) else "tensor" if isinstance(leaf, StoredRegion) else "object"


def _placement_names(placements: tuple[Any, ...]) -> list[str]:
    return [f"{p.kind}({(p.state or {}).get('dim', '')})" if isinstance(p, Record) else repr(p) for p in placements]


def one_set(path: Path, groups: dict[str, dict[int, Path]]) -> dict[int, Path]:
    """rank -> file of the folder's single set of per-rank files, ranks 0..N-1 all present."""
    if len(groups) != 1:
        kinds = ", ".join(sorted(g.format("*") for g in groups)) or "none"
        raise UnsupportedFormatError(
            f"{path}: expected one set of per-rank torch files, found {kinds}; put each set in its own folder"
        )
    return complete_set(path, next(iter(groups.values())))


def complete_set(path: Path, files: dict[int, Path]) -> dict[int, Path]:
    missing = sorted(set(range(max(files) + 1)) - set(files))
    if missing:
        raise CorruptCheckpointError(f"{path}: rank file(s) for rank {missing} are missing (found ranks {sorted(files)})")
    return dict(sorted(files.items()))


def read_trees(files: dict[int, Path]) -> dict[int, FlatTree]:
    return {r: flatten_tree(read_torch_file(f), str(f)) for r, f in files.items()}


def first_refused(files: dict[int, Path], trees: dict[int, FlatTree]) -> str | None:
    """The refusal of the first object that names a global nobody allowed, if any: reported
    before any other problem of a folder, as the one a user must decide on first."""
    for r, tree in trees.items():
        for name, (_, leaf) in tree.leaves.items():
            if isinstance(leaf, RefusedLeaf):
                try:
                    leaf_loader(leaf, str(files[r]), name)()
                except UnsafeCheckpointError as e:
                    return str(e)
    return None


def read_set(path: Path, files: dict[int, Path], trees: dict[int, FlatTree], *, plain_per_rank: bool = False) -> Catalog:
    """Catalog one set of rank files: DTensors from every rank's shards; plain tensors and
    objects once when every rank holds the same value, else once per rank
    (``NAME.rank<r>``). ``plain_per_rank``: plain tensors without any DTensor are per-rank
    state (an RNG state), not parts reshard cannot place."""
    for r, tree in trees.items():
        for leaf_name, (_, leaf) in tree.leaves.items():
            if isinstance(leaf, RefusedLeaf) and leaf.refused.endswith("ShardedTensor"):
                raise UnsupportedFormatError(
                    f"{files[r]}: {leaf_name!r} is an FSDP1 ShardedTensor; reshard reads DTensor (FSDP2) rank files: "
                    "save with FSDP2, or save a DCP checkpoint (dcp.save) and convert that")
    if LAYOUT_KEY in trees[0].leaves:  # written by reshard for a mesh
        return read_layout_files(path, files, trees)
    objects = ObjectTable()
    catalog = Catalog(format="torch-ranks", path=path, facts=Facts(source_world_size=len(files)), objects=objects)
    names = list(dict.fromkeys(n for t in trees.values() for n in t.leaves))
    placements: dict[str, list[str]] = {}
    per_rank: list[str] = []
    for name in names:
        held = [(r, files[r], t.leaves[name]) for r, t in trees.items() if name in t.leaves]
        nested, leaf = held[0][2]
        copies = [(r, f, v) for r, f, (_, v) in held]
        refused = next(((f, v) for _, f, v in copies if isinstance(v, RefusedLeaf)), None)
        if refused is not None:  # refused when asked for, whatever the other ranks hold
            objects.set_lazy(name, leaf_loader(refused[1], str(refused[0]), name))
            catalog.paths[name] = nested
            continue
        kinds = {_kind(v): f for _, f, v in copies}
        if len(kinds) > 1:
            (a, fa), (b, fb) = list(kinds.items())[:2]
            raise CorruptCheckpointError(f"{path}: {name!r} is a {a} in {fa.name} but a {b} in {fb.name}")
        if isinstance(leaf, DTensorRef):
            shards = [(r, f, v) for r, f, (_, v) in held]
            catalog.tensors[name] = sharded_entry(name, shards, len(files), path)
            catalog.paths[name] = nested
            if catalog.facts.source_mesh is None:
                catalog.facts.source_mesh = leaf.mesh_shape
            if leaf.mesh_dim_names and catalog.facts.source_mesh_dim_names is None:
                catalog.facts.source_mesh_dim_names = tuple(leaf.mesh_dim_names)
            placements[name] = _placement_names(leaf.placements)
            continue
        # Plain tensors and objects: one value when every rank holds the same one (buffers,
        # step counters, configs); otherwise per-rank state (RNG states, per-rank counters)
        # that no single copy stands for, so each rank's copy is kept under its own name.
        tensor = isinstance(leaf, StoredRegion)
        if len(held) == len(files) and not (plain_copies_differ(copies) if tensor else objects_differ(copies)):
            values = [(name, nested, files[held[0][0]], leaf)]
        else:
            values = [(*per_rank_name(name, nested, r), f, v) for r, f, v in copies]
            per_rank.append(name)
        for flat, where, file, value in values:
            if flat != name and flat in names:
                raise UnsupportedFormatError(f"{path}: {name!r} differs between rank files, and its per-rank name "
                                             f"{flat!r} is taken by another entry")
            if tensor:
                catalog.tensors[flat] = TensorEntry(flat, value.shape, value.dtype, [Chunk(full_box(value.shape), value)])
            else:
                objects.set_lazy(flat, leaf_loader(value, str(file), flat))
            catalog.paths[flat] = where
    if per_rank:
        catalog.notices.append(
            f"{len(per_rank)} {'entry differs' if len(per_rank) == 1 else 'entries differ'} between the rank files "
            "(per-rank state such as RNG states) and are "
            f"kept once per rank as NAME.rank<r>: {', '.join(per_rank[:8])}" + (" ..." if len(per_rank) > 8 else ""))
    if not placements and catalog.tensors and not plain_per_rank:
        raise UnsupportedFormatError(
            f"{path}: the rank files hold plain tensors, no DTensors, so where each rank's part belongs is "
            "unknown (tensor-parallel shards?); if every rank saved the same state, read one file on its own"
        )
    if placements:
        catalog.facts.source_placements = placements
    if trees[0].containers:
        catalog.facts.containers = trees[0].containers
    return catalog
