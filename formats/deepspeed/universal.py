"""DeepSpeed universal checkpoints: what ``ds_to_universal`` writes from a ZeRO checkpoint.

The folder keeps the model states file(s) of the source and one folder per parameter:
``zero/<fqn>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt`` (and ``step.pt`` from ZeRO-1/2),
each a whole tensor: a plain flat tensor (from ZeRO-3) or ``{"param": tensor, "cat_dim": ...}``
at the parameter's shape (from ZeRO-1/2). ``zero/optimizer_state.pt`` holds the param groups
(and, from ZeRO-3, the step). The catalog has the same names as a ZeRO folder's
(``formats/deepspeed/format.py``): each file's tensor is one chunk, its bytes read where they lie.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reshard.formats.deepspeed.state import LAYOUT_KEYS, add_objects, add_tensor, field_of, load_state, plain, scalar_data
from reshard.formats.torch.file import read_torch_file

from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Catalog, Chunk
from reshard.core.errors import CheckpointNotFoundError, CorruptCheckpointError
from reshard.core.facts import Facts
from reshard.core.regions import StoredRegion

__all__ = ["read_universal"]

_MODEL = re.compile(r"(?:(?:bf16|fp16)_)?(?:zero_pp_rank_0_)?mp_rank_00_model_states\.pt")
_KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def _model_file(folder: Path) -> Path:
    found = sorted(p for p in folder.iterdir() if p.is_file() and _MODEL.fullmatch(p.name))
    if not found:
        raise CheckpointNotFoundError(f"{folder}: no mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt "
                                      "(ds_to_universal copies it beside zero/)")
    return found[0]


def _tensor(path: Path, shape: tuple[int, ...] | None) -> StoredRegion:
    """The tensor of one universal file. ``{"param": t, ...}`` files (from ZeRO-1/2) hold it at its
    full shape, tensor-parallel slices merged; plain flat files (from ZeRO-3) take ``shape``."""
    value = read_torch_file(path).value
    region = field_of(value, "param", path, StoredRegion) if isinstance(value, Mapping) else value
    if not isinstance(region, StoredRegion):
        raise CorruptCheckpointError(f"{path}: holds a {type(region).__name__}, not a tensor")
    if shape is None or region.shape == shape or isinstance(value, Mapping):
        return region
    if math.prod(region.shape) != math.prod(shape) or not region.is_contiguous:
        raise CorruptCheckpointError(f"{path}: holds {list(region.shape)}, but the parameter is {list(shape)}")
    return StoredRegion(region.path, region.offset, region.dtype, shape)


def _step(path: Path) -> Any:
    data = scalar_data(read_torch_file(path).value)
    if data is None:
        raise CorruptCheckpointError(f"{path}: holds no step count")
    return data


def read_universal(folder: Path) -> Catalog:
    zero = folder / "zero"
    model_path = _model_file(folder)
    model = load_state(model_path)
    groups = field_of(model.value, "param_shapes", model_path, (list, tuple))
    shapes: dict[str, tuple[int, ...]] = {}
    group_of: dict[str, int] = {}
    for g, group in enumerate(groups):
        for name, shape in dict(group).items():
            shapes[str(name)], group_of[str(name)] = tuple(shape), g
    on_disk = sorted(p.name for p in zero.iterdir() if p.is_dir())
    missing = [n for n in shapes if n not in on_disk]
    if missing:
        raise CorruptCheckpointError(f"{zero / missing[0]}: missing (the model has {len(shapes)} parameters, the "
                                     f"universal folder {len(on_disk)})")
    state_path = zero / "optimizer_state.pt"
    optim = load_state(state_path) if state_path.is_file() else None
    stage = plain(optim.value.get("zero_stage")) if optim else None
    catalog = Catalog("deepspeed", folder, facts=Facts(layout="deepspeed", deepspeed_universal=True,
                                                      deepspeed_zero_stage=stage))
    shared_step = _zero3_step(optim.value, state_path) if optim and stage == 3 else None
    for name in [*shapes, *(n for n in on_disk if n not in shapes)]:
        param = zero / name
        for kind in _KINDS:
            file = param / f"{kind}.pt"
            if not file.is_file():
                if kind == "fp32":
                    raise CorruptCheckpointError(f"{file}: missing (every parameter of a universal checkpoint has one)")
                continue
            region = _tensor(file, shapes.get(name))
            target, path = (name, (name,)) if kind == "fp32" else (f"optimizer.state.{name}.{kind}",
                                                                   ("optimizer", "state", name, kind))
            add_tensor(catalog, target, region.shape, region.dtype, [Chunk(full_box(region.shape), region)], path)
        step = _step(param / "step.pt") if (param / "step.pt").is_file() else shared_step
        if step is not None and f"optimizer.state.{name}.exp_avg" in catalog.tensors:
            dtype = step.dtype if isinstance(step, StoredRegion) else step.value.dtype
            add_tensor(catalog, f"optimizer.state.{name}.step", (), dtype, [Chunk(Box((), ()), step)],
                       ("optimizer", "state", name, "step"))
    _objects(catalog, model, model_path, optim, state_path, groups, group_of)
    return catalog


def _zero3_step(optim: dict, where: Path) -> Any:
    """ZeRO-3 universal folders keep the step only in the optimizer state's first group."""
    state = field_of(field_of(optim, "optimizer_state_dict", where, dict), "state", where, dict)
    first = state.get(0) if isinstance(state.get(0), Mapping) else {}
    step = first.get("step")
    if isinstance(step, StoredRegion) and step.shape == ():
        return step
    return None


def _objects(catalog: Catalog, model: Any, model_path: Path, optim: Any, state_path: Path, groups: Any,
             group_of: dict[str, int]) -> None:
    if optim is not None:
        values = {k: plain(v) for k, v in optim.value.items()
                  if k not in ("optimizer_state_dict", "fp32_flat_groups", "single_partition_of_fp32_groups")}
        names = [[n for n, g in group_of.items() if g == i] for i in range(len(groups))]
        fixed = []
        for group in values.get("param_groups") or []:
            group = dict(group)
            listed = group.get("params")
            ids = listed if isinstance(listed, list) else []
            group["params"] = [n for i in ids if isinstance(i, int) and i < len(names) for n in names[i]]
            fixed.append(group)
        if fixed:
            values["param_groups"] = fixed
        add_objects(catalog, {"optimizer": values}, optim.refused, state_path)
    rest = {k: v for k, v in model.value.items() if k not in LAYOUT_KEYS}
    add_objects(catalog, {"deepspeed": rest}, model.refused, model_path)
