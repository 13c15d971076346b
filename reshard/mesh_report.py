"""``reshard inspect SRC --to-mesh SPEC``: will it fit, before launching on that mesh?

Bytes each target rank would hold (its local shards, replicas counted on every rank that
holds them, as the GPUs will), split into parameters, optimizer state and other tensors; the
imbalance between the fullest and the average rank; and the tensors whose dims the mesh does
not divide evenly (uneven or empty shards).
"""

from __future__ import annotations

from typing import Any

from reshard.catalog import Catalog, Target
from reshard.mesh_target import mesh_target, uneven_dims
from reshard.placements import param_fqn
from reshard.sizes import format_size

__all__ = ["mesh_summary", "mesh_table", "summarize_for_mesh"]


def _kind(name: str, sectioned: bool) -> str:
    if name.startswith("optim."):
        return "optim"
    return "params" if param_fqn(name, sectioned=sectioned) is not None else "other"


def mesh_summary(target: Target) -> dict[str, Any]:
    mesh = target.mesh
    if mesh is None:
        raise ValueError("mesh_summary needs a target laid out for a mesh")
    sectioned = any(n.startswith(("model.", "optim.state.")) for n in target.tensors)
    per_rank = [{"rank": r, "params": 0, "optim": 0, "other": 0} for r in range(mesh.world_size)]
    uneven = {}
    for t in target.tensors.values():
        kind = _kind(t.name, sectioned)
        for r, box in enumerate(t.local or []):
            per_rank[r][kind] += box.numel * t.dtype.itemsize
        notes = uneven_dims(t.shape, t.placements or (), mesh)
        if notes:
            uneven[t.name] = notes
    for row in per_rank:
        row["total"] = row["params"] + row["optim"] + row["other"]
    totals = [row["total"] for row in per_rank]
    mean = sum(totals) / len(totals) if totals else 0
    return {
        "mesh": {"shape": list(mesh.shape), "names": list(mesh.names)},
        "ranks": per_rank,
        "max_rank_bytes": max(totals, default=0),
        "imbalance": (max(totals) / mean) if mean else 1.0,
        "uneven": uneven,
        "notices": list(target.notices),
    }


def mesh_table(summary: dict[str, Any]) -> str:
    mesh = summary["mesh"]
    lines = [f"on mesh {', '.join(f'{n}={s}' for n, s in zip(mesh['names'], mesh['shape']))}:",
             f"{'rank':>5}  {'params':>10}  {'optim':>10}  {'other':>10}  {'total':>10}"]
    for row in summary["ranks"]:
        lines.append(f"{row['rank']:>5}  " + "  ".join(f"{format_size(row[k]):>10}" for k in ("params", "optim", "other", "total")))
    lines.append(f"largest rank: {format_size(summary['max_rank_bytes'])}; imbalance (max/mean): {summary['imbalance']:.3f}")
    if summary["uneven"]:
        lines.append(f"warning: {len(summary['uneven'])} tensors do not divide evenly over the mesh:")
        lines += [f"  {n}: {'; '.join(notes)}" for n, notes in list(summary["uneven"].items())[:20]]
        if len(summary["uneven"]) > 20:
            lines.append(f"  ... and {len(summary['uneven']) - 20} more")
    lines += [f"notice: {n}" for n in summary["notices"]]
    return "\n".join(lines)


def summarize_for_mesh(catalog: Catalog, spec: str, placements: str | None) -> dict[str, Any]:
    from reshard.layout import parse_mesh
    from reshard.placements import load_placement_plan

    mesh = parse_mesh(spec)
    return mesh_summary(mesh_target(catalog, mesh, load_placement_plan(placements, mesh)))
