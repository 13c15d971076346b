"""``reshard inspect SRC --to-mesh SPEC``: will it fit, before launching on that mesh?

Bytes each target rank would hold (its local shards, replicas counted on every rank that
holds them, as the GPUs will), split into parameters, optimizer state and other tensors; the
imbalance between the fullest and the average rank; and the tensors whose dims the mesh does
not divide evenly (uneven or empty shards).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from reshard.core.catalog import Catalog
from reshard.core.conventions import OPTIM_GROUP, OPTIM_STATE, PARAM, Layout, detect_layout
from reshard.core.sharding import parse_mesh
from reshard.core.sizes import format_size, plural
from reshard.core.target import Target
from reshard.pipeline.mesh_target import mesh_target, uneven_dims
from reshard.pipeline.placements import load_placement_plan

__all__ = ["mesh_summary", "mesh_table", "rank_ranges", "summarize_for_mesh"]


_KINDS = {PARAM: "params", OPTIM_STATE: "optim", OPTIM_GROUP: "optim"}


def mesh_summary(target: Target, layout: Layout) -> dict[str, Any]:
    mesh = target.mesh
    if mesh is None:
        raise ValueError("mesh_summary needs a target laid out for a mesh")
    held = {kind: np.zeros(mesh.world_size, dtype=np.int64) for kind in ("params", "optim", "other")}
    numels: dict[tuple, np.ndarray] = {}  # per layout (shape, placements): elements on each rank
    uneven = {}
    for t in target.tensors.values():
        if t.local:
            key = (t.shape, t.placements)
            if key not in numels:
                numels[key] = np.array([box.numel for box in t.local], dtype=np.int64)
            held[_KINDS.get(layout.role(t.name), "other")] += numels[key] * t.dtype.itemsize
        notes = uneven_dims(t.shape, t.placements or (), mesh)
        if notes:
            uneven[t.name] = notes
    per_rank = [{"rank": r, "params": p, "optim": o, "other": x}
                for r, (p, o, x) in enumerate(zip(*(held[k].tolist() for k in ("params", "optim", "other"))))]
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


def rank_ranges(ranks: list[int]) -> str:
    """``0-3, 8-11``: sorted ranks, consecutive ones as ranges. A long regular pattern (the
    same run every k ranks, as the replicas of an HSDP mesh hold the same shard) is its first
    two runs, ``...``, the last and the step: ``0-1, 8-9, ..., 504-505 (every 8)``."""
    runs: list[tuple[int, int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    words = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
    steps = {b[0] - a[0] for a, b in zip(runs, runs[1:])}
    if len(runs) > 4 and len(steps) == 1 and len({b - a for a, b in runs}) == 1:
        return f"{words[0]}, {words[1]}, ..., {words[-1]} (every {steps.pop()})"
    return ", ".join(words)


def mesh_table(summary: dict[str, Any]) -> str:
    """Ranks that hold the same bytes share one row (a 128-rank mesh is a few rows, not 128),
    which names them last (``0-127``); the largest and smallest rank are always named, unless
    every rank holds the same bytes (then that size is)."""
    mesh = summary["mesh"]
    keys = ("params", "optim", "other", "total")
    groups: dict[tuple[int, ...], list[int]] = {}
    for row in summary["ranks"]:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row["rank"])
    lines = [f"on mesh {', '.join(f'{n}={s}' for n, s in zip(mesh['names'], mesh['shape']))}:",
             f"{'params':>10}  {'optim':>10}  {'other':>10}  {'total':>10}  ranks"]
    for values, ranks in sorted(groups.items(), key=lambda kv: kv[1][0]):
        lines.append("  ".join(f"{format_size(v):>10}" for v in values) + f"  {rank_ranges(ranks)}")
    totals = [(row["total"], row["rank"]) for row in summary["ranks"]]
    imbalance = f"imbalance (max/mean): {summary['imbalance']:.3f}"
    if totals:
        most, big = max(totals, key=lambda t: (t[0], -t[1]))
        least, small = min(totals)
        if most == least:  # no rank is the largest: each holds the same
            each = "the one rank" if len(totals) == 1 else f"each of the {len(totals)} ranks"
            lines.append(f"{each} holds {format_size(most)}; {imbalance}")
        else:
            lines.append(f"largest rank: {big} ({format_size(most)}); smallest rank: {small} ({format_size(least)}); "
                         f"{imbalance}")
    if summary["uneven"]:
        n = len(summary["uneven"])
        lines.append(f"warning: {plural(n, 'tensor')} {'does' if n == 1 else 'do'} not divide evenly over the mesh:")
        lines += [f"  {n}: {'; '.join(notes)}" for n, notes in list(summary["uneven"].items())[:20]]
        if len(summary["uneven"]) > 20:
            lines.append(f"  ... and {len(summary['uneven']) - 20} more")
    lines += [f"notice: {n}" for n in summary["notices"]]
    return "\n".join(lines)


def summarize_for_mesh(catalog: Catalog, to_mesh: str, placements: str | None) -> dict[str, Any]:
    spec = parse_mesh(to_mesh)
    layout = detect_layout(catalog)
    return mesh_summary(mesh_target(catalog, spec, load_placement_plan(placements, spec), layout=layout), layout)
