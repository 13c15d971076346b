"""Placement plans: which placements each tensor gets on a target mesh.

A plan maps parameter-name globs to one placement per mesh dimension; the first pattern that
matches wins, and optimizer state follows its parameter (``optim.state.<fqn>.exp_avg`` is
placed like ``model.<fqn>``). Presets cover the usual layouts: ``fsdp`` (``Shard(0)`` on a 1-D
mesh), ``hsdp`` (``Replicate, Shard(0)`` on a 2-D mesh) and ``fsdp+tp`` for the project's
Llama-style training model (column-wise wq/wk/wv/w1/w3, row-wise wo/w2, replicated norms).
A PLAN.json says the same in data::

    {"mesh": ["dp_shard", "tp"],
     "placements": {"layers.*.attention.wo.weight": ["Shard(0)", "Shard(1)"],
                    "layers.*.attention.w*.weight": ["Shard(0)", "Shard(0)"]},
     "default": ["Shard(0)", "Replicate()"]}

Layouts that would be silently wrong are refused before any byte moves: a plan for another
mesh, a pattern that matches nothing, a placement that does not fit a tensor.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from reshard.errors import UsageError
from reshard.layout import (
    REPLICATE,
    MeshSpec,
    Placement,
    check_fits,
    parse_placement,
    shard,
)

__all__ = ["PlacementPlan", "assign_placements", "load_placement_plan", "param_fqn"]

_S0, _S1, _R = shard(0), shard(1), REPLICATE


@dataclass(frozen=True)
class PlacementPlan:
    name: str
    rules: tuple[tuple[str, tuple[Placement, ...]], ...]
    default: tuple[Placement, ...] | None
    mesh_names: tuple[str, ...] | None = None  # the mesh dims the plan was written for
    strict_patterns: bool = True  # every pattern must match some tensor


def _tp_preset() -> PlacementPlan:
    col, row, rep = (_S0, _S0), (_S0, _S1), (_S0, _R)
    rules = (
        ("tok_embeddings.weight", col),
        ("layers.*.attention.w[qkv].weight", col),
        ("layers.*.attention.wo.weight", row),
        ("layers.*.feed_forward.w[13].weight", col),
        ("layers.*.feed_forward.w2.weight", row),
        ("layers.*.attention_norm.weight", rep),
        ("layers.*.ffn_norm.weight", rep),
        ("norm.weight", rep),
        ("output.weight", col),
    )
    return PlacementPlan("fsdp+tp", rules, rep, ("dp_shard", "tp"), strict_patterns=False)


def _preset(name: str, mesh: MeshSpec) -> PlacementPlan:
    if name == "fsdp":
        if mesh.ndim != 1:
            raise UsageError(f"--placements fsdp needs a 1-D mesh, got {mesh}; use hsdp or a PLAN.json")
        return PlacementPlan("fsdp", (), (_S0,))
    if name == "hsdp":
        if mesh.ndim != 2:
            raise UsageError(f"--placements hsdp needs a 2-D mesh (replicate x shard), got {mesh}")
        return PlacementPlan("hsdp", (), (_R, _S0))
    if name == "fsdp+tp":
        if mesh.ndim != 2:
            raise UsageError(f"--placements fsdp+tp needs a 2-D mesh (dp_shard x tp), got {mesh}")
        return _tp_preset()
    raise UsageError(f"unknown placements {name!r}: use fsdp, hsdp, fsdp+tp or a PLAN.json file")


def _placements_list(value: object, where: str) -> tuple[Placement, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"{where}: placements must be a list of strings like [\"Shard(0)\", \"Replicate()\"]")
    try:
        return tuple(parse_placement(v) for v in value)
    except UsageError as e:
        raise UsageError(f"{where}: {e}") from None


def _read_plan_file(path: Path) -> PlacementPlan:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path}: placement plan not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("placements", {}), dict):
        raise UsageError(f"{path}: expected {{\"placements\": {{GLOB: [PLACEMENT, ...]}}, \"default\": [...]}}")
    unknown = set(data) - {"mesh", "placements", "default"}
    if unknown:
        raise UsageError(f"{path}: unknown keys {sorted(unknown)}; a plan has mesh, placements and default")
    rules = tuple((str(k), _placements_list(v, f"{path}: {k!r}")) for k, v in data.get("placements", {}).items())
    default = _placements_list(data["default"], f"{path}: default") if "default" in data else None
    mesh = data.get("mesh")
    if mesh is not None and not (isinstance(mesh, list) and all(isinstance(m, str) for m in mesh)):
        raise UsageError(f"{path}: \"mesh\" must list the mesh dimension names, e.g. [\"dp_shard\", \"tp\"]")
    return PlacementPlan(path.name, rules, default, tuple(mesh) if mesh else None)


def load_placement_plan(spec: str | None, mesh: MeshSpec) -> PlacementPlan:
    """``None`` picks the default for the mesh: ``fsdp`` on 1-D, ``hsdp`` on 2-D."""
    if spec is None:
        if mesh.ndim > 2:
            raise UsageError(f"a {mesh.ndim}-D mesh ({mesh}) has no default placements; give --placements PLAN.json")
        spec = "fsdp" if mesh.ndim == 1 else "hsdp"
    plan = _read_plan_file(Path(spec)) if spec.lower().endswith(".json") else _preset(spec.lower(), mesh)
    _check_mesh(plan, mesh)
    return plan


def _check_mesh(plan: PlacementPlan, mesh: MeshSpec) -> None:
    names = plan.mesh_names
    if names is not None and (len(names) != mesh.ndim or (mesh.named and names != mesh.names)):
        raise UsageError(
            f"placement plan {plan.name} is written for a mesh ({', '.join(names)}), "
            f"not for {mesh}; give --to-mesh {','.join(f'{n}=N' for n in names)}"
        )
    for pattern, placements in plan.rules:
        if len(placements) != mesh.ndim:
            raise UsageError(f"placement plan {plan.name}: {pattern!r} has {len(placements)} placements, the mesh {mesh} has {mesh.ndim} dimensions")
    if plan.default is not None and len(plan.default) != mesh.ndim:
        raise UsageError(f"placement plan {plan.name}: default has {len(plan.default)} placements, the mesh {mesh} has {mesh.ndim} dimensions")


def param_fqn(name: str, *, sectioned: bool = True) -> str | None:
    """The parameter a tensor belongs to: ``model.X`` and ``optim.state.X.<key>`` give ``X``.
    In a checkpoint with sections, tensors of any other section (``extra.``, ``train.``) are
    not parameters and stay whole; in a flat state dict every name is its own parameter."""
    if name.startswith("model."):
        return name[len("model."):]
    if name.startswith("optim.state."):
        return name[len("optim.state."):].rpartition(".")[0] or None
    return None if sectioned else name


def assign_placements(
    plan: PlacementPlan, mesh: MeshSpec, shapes: dict[str, tuple[int, ...]]
) -> dict[str, tuple[Placement, ...]]:
    """Placements for every tensor; non-parameters and 0-d tensors (optimizer ``step``) are
    replicated, as FSDP2 keeps them."""
    replicated = (REPLICATE,) * mesh.ndim
    sectioned = any(n.startswith(("model.", "optim.state.")) for n in shapes)
    used: set[str] = set()
    out = {}
    for name, shape in shapes.items():
        fqn = param_fqn(name, sectioned=sectioned)
        if fqn is None or not shape:
            out[name] = replicated
            continue
        chosen = None
        for pattern, placements in plan.rules:
            if fnmatch.fnmatchcase(fqn, pattern):
                chosen = placements
                used.add(pattern)
                break
        if chosen is None:
            if plan.default is None:
                raise UsageError(f"placement plan {plan.name}: no pattern matches {fqn!r} and there is no default")
            chosen = plan.default
        check_fits(name, shape, chosen, mesh)
        out[name] = chosen
    unused = [p for p, _ in plan.rules if p not in used]
    if unused and (plan.strict_patterns or len(unused) == len(plan.rules)):
        raise UsageError(
            f"placement plan {plan.name}: {', '.join(repr(p) for p in unused)} match no tensor of this checkpoint; "
            "check the names with `reshard inspect`"
        )
    return out
