"""Placement plans: which placements each tensor gets on a target mesh.

A plan maps parameter-name globs to one placement per mesh dimension; the first pattern that
matches wins, and optimizer state follows its parameter (``optim.state.<fqn>.exp_avg`` is
placed like ``model.<fqn>``, under whichever names the checkpoint's tool uses: see
``reshard.core.conventions``). Presets cover the usual layouts: ``fsdp`` (``Shard(0)`` on a 1-D
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

from reshard.core.conventions import Layout
from reshard.core.errors import UsageError, option
from reshard.core.sharding import (
    REPLICATE,
    MeshSpec,
    Placement,
    check_fits,
    parse_placement,
    shard,
)

__all__ = ["PlacementPlan", "assign_placements", "load_placement_plan"]

_S0, _S1, _R = shard(0), shard(1), REPLICATE


@dataclass(frozen=True)
class PlacementPlan:
    name: str
    rules: tuple[tuple[str, tuple[Placement, ...]], ...]
    default: tuple[Placement, ...] | None
    mesh_names: tuple[str, ...] | None = None  # the mesh dims the plan was written for
    strict_patterns: bool = True  # every pattern must match some tensor


# Tensor parallelism for Llama-style models, per parameter FQN: "col" shards the output dim
# (Shard(0) of a Linear weight: q/k/v, gate/up, the vocab of embeddings and the output head),
# "row" the input dim (Shard(1): o/down), everything else (norms, o/down biases) is replicated
# over tp. Both families of names: torchtitan's (and this project's training model), and HF's
# for llama, mistral, qwen2/qwen3 (q/k/v biases, q/k norms) and the like.
_TP_RULES: tuple[tuple[str, str], ...] = (
    ("tok_embeddings.weight", "col"),
    ("layers.*.attention.w[qkv].weight", "col"),
    ("layers.*.attention.wo.weight", "row"),
    ("layers.*.feed_forward.w[13].weight", "col"),
    ("layers.*.feed_forward.w2.weight", "row"),
    ("output.weight", "col"),
    ("model.embed_tokens.weight", "col"),
    ("model.layers.*.self_attn.[qkv]_proj.weight", "col"),
    ("model.layers.*.self_attn.[qkv]_proj.bias", "col"),
    ("model.layers.*.self_attn.o_proj.weight", "row"),
    ("model.layers.*.mlp.gate_proj.weight", "col"),
    ("model.layers.*.mlp.up_proj.weight", "col"),
    ("model.layers.*.mlp.down_proj.weight", "row"),
    ("lm_head.weight", "col"),
)


def _tp_preset(mesh: MeshSpec) -> PlacementPlan:
    """FSDP (Shard(0) over dp_shard, Replicate over dp_replicate) times the TP table; the mesh's
    last dim is tp."""
    dp = tuple(_R if n == "dp_replicate" else _S0 for n in mesh.names[:-1])
    tp = {"col": _S0, "row": _S1}
    rules = tuple((pattern, dp + (tp[kind],)) for pattern, kind in _TP_RULES)
    names = ("dp_replicate", "dp_shard", "tp") if mesh.ndim == 3 else ("dp_shard", "tp")
    return PlacementPlan("fsdp+tp", rules, dp + (_R,), names, strict_patterns=False)



def _named(preset: str) -> str:
    return option(f"--placements {preset}", f"placements={preset!r}")


def _preset(name: str, mesh: MeshSpec) -> PlacementPlan:
    if name == "fsdp":
        if mesh.ndim != 1:
            raise UsageError(f"{_named('fsdp')} needs a 1-D mesh, got {mesh}; use hsdp or a PLAN.json")
        return PlacementPlan("fsdp", (), (_S0,))
    if name == "hsdp":
        if mesh.ndim != 2:
            raise UsageError(f"{_named('hsdp')} needs a 2-D mesh (replicate x shard), got {mesh}")
        return PlacementPlan("hsdp", (), (_R, _S0))
    if name == "fsdp+tp":
        if mesh.ndim not in (2, 3):
            raise UsageError(f"{_named('fsdp+tp')} needs a 2-D mesh (dp_shard x tp) or dp_replicate x dp_shard x tp, "
                             f"got {mesh}")
        return _tp_preset(mesh)
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


def _default_for(mesh: MeshSpec) -> str:
    """The placements a mesh's dimension names ask for: ``dp_shard`` -> fsdp, ``dp_replicate,
    dp_shard`` -> hsdp, ``dp_shard,tp`` (or ``dp_replicate,dp_shard,tp``) -> fsdp+tp. Any other
    mesh needs --placements: guessing would lay tensors out for a parallelism the names do not say."""
    if mesh.names == ("dp_shard",):
        return "fsdp"
    if mesh.names == ("dp_replicate", "dp_shard"):
        return "hsdp"
    if mesh.names in (("dp_shard", "tp"), ("dp_replicate", "dp_shard", "tp")):
        return "fsdp+tp"
    raise UsageError(
        f"mesh {mesh} has no default placements; give --placements fsdp (dp_shard=N), hsdp "
        "(dp_replicate=R,dp_shard=S), fsdp+tp (dp_shard=S,tp=T; Llama-style torchtitan or HF names) or a PLAN.json")


def load_placement_plan(spec: str | None, mesh: MeshSpec) -> PlacementPlan:
    """``None`` picks what the mesh's dimension names say (``_default_for``)."""
    if spec is None:
        spec = _default_for(mesh)
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
            raise UsageError(f"placement plan {plan.name}: {pattern!r} has {len(placements)} placements, the mesh {mesh} has "
                             f"{mesh.ndim} dimensions")
    if plan.default is not None and len(plan.default) != mesh.ndim:
        raise UsageError(f"placement plan {plan.name}: default has {len(plan.default)} placements, the mesh {mesh} has "
                         f"{mesh.ndim} dimensions")


def assign_placements(
    plan: PlacementPlan, mesh: MeshSpec, shapes: dict[str, tuple[int, ...]], layout: Layout,
) -> dict[str, tuple[Placement, ...]]:
    """Placements for every tensor: a parameter's from the plan, and its optimizer state's the
    same (found through the same FQN, whatever the tool's names); non-parameters and 0-d
    tensors (optimizer ``step``) are replicated, as FSDP2 keeps them."""
    replicated = (REPLICATE,) * mesh.ndim
    used: set[str] = set()
    out = {}
    for name, shape in shapes.items():
        fqn = layout.param_fqn(name)
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
