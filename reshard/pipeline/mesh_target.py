"""What an output laid out for a device mesh holds: every rank's shard of every tensor.

``mesh_target`` turns a catalog, a mesh and a placement plan into a ``Target`` whose boxes
are the distinct local shards of the target ranks (replicas once, each in the file of one
rank that holds it). Non-tensor state travels, except state that belongs to one rank (RNG
states, per-rank data loader positions): on a different rank count it has no meaning, so it
is dropped with a notice naming each entry unless the user asks to keep it as it is.
"""

from __future__ import annotations

from reshard.core.catalog import Catalog, pick_objects
from reshard.core.conventions import PER_RANK, Layout, detect_layout, is_per_rank
from reshard.core.dtypes import DType
from reshard.core.errors import option
from reshard.core.sharding import MeshSpec, format_placement, mesh_shards
from reshard.core.target import Target, TargetTensor
from reshard.pipeline.placements import PlacementPlan, assign_placements
from reshard.pipeline.plan import Casting, DtypeKeep, select

__all__ = ["mesh_target", "per_rank_names", "uneven_dims"]

def per_rank_names(names: list[str], layout: Layout | None = None) -> list[str]:
    """Names of entries that hold one rank's private state."""
    if layout is None:
        return [n for n in names if is_per_rank(n)]
    return [n for n in names if layout.role(n) == PER_RANK]


def uneven_dims(shape: tuple[int, ...], placements: tuple, mesh: MeshSpec) -> list[str]:
    """Human-readable notes on sharded dims that the mesh does not divide evenly."""
    out, sizes = [], list(shape)
    for mesh_dim, (kind, dim) in enumerate(placements):
        if kind != "Shard" or dim is None:
            continue
        n, k = sizes[dim], mesh.shape[mesh_dim]
        if n % k:
            out.append(f"dim {dim} ({n}) over {mesh.names[mesh_dim]}={k}" + (" leaves empty shards" if n < k else ""))
        sizes[dim] = -(-n // k)
    return out


def mesh_target(
    catalog: Catalog, mesh: MeshSpec, plan: PlacementPlan, *, dtype: DType | None = None,
    only: str | None = None, keep_per_rank: bool = False, layout: Layout | None = None, keep: DtypeKeep | None = None,
) -> Target:
    layout = layout or detect_layout(catalog)
    names, objects = select(catalog, only, layout)
    source_ranks = catalog.facts.source_world_size
    private = per_rank_names(names + objects, layout)
    notices = list(catalog.notices)
    if private and source_ranks != mesh.world_size:
        was = f"{source_ranks} ranks" if source_ranks else "an unknown rank count"
        if keep_per_rank:
            notices.append(f"kept per-rank state as it was saved on {was} ({option('--keep-per-rank', 'keep_per_rank=True')}): "
                           f"{', '.join(private)}")
        else:
            notices.append(
                f"dropped per-rank state saved on {was}, meaningless on {mesh.world_size} ranks "
                f"(rerun with {option('--keep-per-rank', 'keep_per_rank=True')} to carry it as is): {', '.join(private)}"
            )
            names = [n for n in names if n not in private]
            objects = [n for n in objects if n not in private]
    placements = assign_placements(plan, mesh, {n: catalog.tensors[n].shape for n in names}, layout)
    casting = Casting(catalog, dtype, layout, keep)
    load = [0] * mesh.world_size
    tensors = {}
    for name in names:
        entry = catalog.tensors[name]
        out_dtype = casting.dtype(name, entry)
        local, boxes, ranks = mesh_shards(entry.shape, placements[name], mesh, out_dtype.itemsize, load)
        tensors[name] = TargetTensor(name, entry.shape, out_dtype, boxes, ranks, local=local, placements=placements[name])
    notices += casting.notice()
    kept = set(tensors) | set(objects)
    facts = catalog.facts.but(
        target_mesh={"shape": list(mesh.shape), "names": list(mesh.names)},
        target_placements={n: [format_placement(p) for p in t.placements or ()] for n, t in tensors.items()})
    return Target(
        tensors=tensors,
        objects=pick_objects(catalog.objects, objects),
        paths={n: p for n, p in catalog.paths.items() if n in kept},
        facts=facts,
        world_size=mesh.world_size,
        mesh=mesh,
        notices=notices,
        renamed_from={n: s for n, s in catalog.renamed_from.items() if n in tensors},
    )
