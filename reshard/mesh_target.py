"""What an output laid out for a device mesh holds: every rank's shard of every tensor.

``mesh_target`` turns a catalog, a mesh and a placement plan into a ``Target`` whose boxes
are the distinct local shards of the target ranks (replicas once, each in the file of one
rank that holds it). Non-tensor state travels, except state that belongs to one rank (RNG
states, per-rank data loader positions): on a different rank count it has no meaning, so it
is dropped with a notice naming each entry unless the user asks to keep it as it is.
"""

from __future__ import annotations

import re

import torch

from reshard.catalog import Catalog, Target, TargetTensor
from reshard.layout import MeshSpec, distinct_boxes, format_placement, local_boxes
from reshard.placements import PlacementPlan, assign_placements
from reshard.plan import cast_dtype, select

__all__ = ["mesh_target", "per_rank_names", "uneven_dims"]

# A name part that says "this is one rank's": rank3, dp_rank_3, rank-3, rng/RNG states,
# data loader positions. Matched per dotted component so "rank" inside a word does not count.
_PER_RANK = re.compile(
    r"^(?:(?:dp_|tp_|pp_|global_|local_)?rank[_-]?\d+|rng|rngs|rng_state|rng_states|random_state|"
    r"cuda_rng_state|torch_rng_state|numpy_rng_state|py_rng_state|dataloader|data_loader|dataloaders)$",
    re.IGNORECASE,
)


def per_rank_names(names: list[str]) -> list[str]:
    """Names of entries that hold one rank's private state."""
    return [n for n in names if any(_PER_RANK.match(part) for part in n.split("."))]


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
    catalog: Catalog, mesh: MeshSpec, plan: PlacementPlan, *, dtype: torch.dtype | None = None,
    only: str | None = None, keep_per_rank: bool = False,
) -> Target:
    names, objects = select(catalog, only)
    source_ranks = catalog.attrs.get("source_world_size")
    private = per_rank_names(names + objects)
    notices = []
    if private and source_ranks != mesh.world_size:
        was = f"{source_ranks} ranks" if source_ranks else "an unknown rank count"
        if keep_per_rank:
            notices.append(f"kept per-rank state as it was saved on {was} (--keep-per-rank): {', '.join(private)}")
        else:
            notices.append(
                f"dropped per-rank state saved on {was}, meaningless on {mesh.world_size} ranks "
                f"(rerun with --keep-per-rank to carry it as is): {', '.join(private)}"
            )
            names = [n for n in names if n not in private]
            objects = [n for n in objects if n not in private]
    placements = assign_placements(plan, mesh, {n: catalog.tensors[n].shape for n in names})
    load = [0] * mesh.world_size
    tensors = {}
    for name in names:
        entry = catalog.tensors[name]
        out_dtype = cast_dtype(entry.dtype, dtype)
        local = local_boxes(entry.shape, placements[name], mesh)
        boxes, ranks = distinct_boxes(local, out_dtype.itemsize, load)
        tensors[name] = TargetTensor(name, entry.shape, out_dtype, boxes, ranks, local=local, placements=placements[name])
    kept = set(tensors) | set(objects)
    attrs = dict(catalog.attrs)
    attrs["target_mesh"] = {"shape": list(mesh.shape), "names": list(mesh.names)}
    attrs["target_placements"] = {n: [format_placement(p) for p in t.placements or ()] for n, t in tensors.items()}
    return Target(
        tensors=tensors,
        objects={n: catalog.objects[n] for n in objects},
        paths={n: p for n, p in catalog.paths.items() if n in kept},
        attrs=attrs,
        world_size=mesh.world_size,
        mesh=mesh,
        notices=notices,
    )
