"""accelerate's ``save_state`` folders with FSDP ``SHARDED_STATE_DICT``, read as one checkpoint.

``Accelerator.save_state(dir)`` under FSDP with sharded state dicts writes (accelerate 1.x,
``utils/fsdp_utils.py`` and ``checkpointing.py``):

| entry                        | holds                                                        | section           |
| ---------------------------- | ------------------------------------------------------------ | ----------------- |
| ``pytorch_model_fsdp_0/``    | a DCP folder of ``{"model": model.state_dict()}``            | ``model.``        |
| ``optimizer_0/``             | a DCP folder of ``{"optimizer": FSDP.optim_state_dict(...)}`` | ``optimizer.``    |
| ``scheduler.bin``            | ``torch.save(scheduler.state_dict())``                       | ``scheduler.``    |
| ``sampler.bin``, ``*.bin``   | other registered objects, one torch.save file each           | the file's stem   |
| ``random_states_{r}.pkl``    | rank ``r``'s RNG states (a torch.save zip despite the name)  | per rank          |

The two DCP folders already name their tensors under ``model.`` and ``optimizer.`` (the
optimizer state keyed by parameter FQN, ``param_groups`` listing FQNs), so they merge without
renaming, and the catalog records ``facts.layout = "accelerate"``. A folder with a second
model (``pytorch_model_fsdp_1/``, its optimizer in ``optimizer_1/``) would put two models under
one name: read whole it is refused, naming the ways out; ``read(path, model_index=1)`` (what
``reshard.load_model(..., section=1)`` asks for) reads that model and its optimizer as the
``model.`` and ``optimizer.`` sections. Each part is read by its own format's reader, with its
checks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, cast

from reshard.formats.dcp.format import DCPFormat
from reshard.formats.torch.save import TorchSaveFormat

from reshard.core.catalog import Catalog, ObjectTable, TensorEntry, object_loader
from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError, UsageError
from reshard.core.facts import Facts
from reshard.pipeline.options import WriterOptions

__all__ = ["AccelerateFormat", "MODEL_DIR", "OPTIMIZER_DIR", "model_indices"]

_MODEL_STEM = "pytorch_model_fsdp"
MODEL_DIR, OPTIMIZER_DIR = f"{_MODEL_STEM}_0", "optimizer_0"
_NUMBERED = re.compile(r"(pytorch_model_fsdp|optimizer)_(\d+)")
_PART_FILE = re.compile(r"[A-Za-z_][\w-]*\.(bin|pkl)")


def model_indices(path: Path) -> list[int]:
    """The model numbers of an accelerate folder: ``pytorch_model_fsdp_<i>/`` (accelerate numbers
    the models and the optimizers ``prepare`` saw, each in order)."""
    found = (_NUMBERED.fullmatch(p.name) for p in Path(path).iterdir() if p.is_dir())
    return sorted(int(m[2]) for m in found if m is not None and m[1] == _MODEL_STEM)


def _dcp_parts(path: Path, model_index: int | None) -> dict[str, Path]:
    """section -> DCP folder of an accelerate save_state folder: model ``model_index`` and the
    optimizer of the same number."""
    models = model_indices(path)
    if model_index is None:
        numbered = sorted(p.name for p in path.iterdir() if p.is_dir() and _NUMBERED.fullmatch(p.name))
        extra = [n for n in numbered if n not in (MODEL_DIR, OPTIMIZER_DIR)]
        if extra:
            raise UnsupportedFormatError(
                f"{path}: an accelerate folder of several models or optimizers ({', '.join(numbered)}); their names "
                f"collide in one checkpoint: load one with reshard.load_model(..., section={max(models)}), or "
                f"convert each folder on its own, e.g. reshard convert {path / extra[0]}")
        model_index = 0
    elif model_index not in models:
        raise UsageError(f"{path}: section={model_index!r} names no model of this accelerate folder; its models are "
                         f"{', '.join(map(str, models))} ({_MODEL_STEM}_<i>/)")
    parts = {"model": path / f"{_MODEL_STEM}_{model_index}", "optimizer": path / f"optimizer_{model_index}"}
    return {section: p for section, p in parts.items() if p.is_dir()}


class AccelerateFormat:
    name = "accelerate"

    def detect(self, path: Path) -> bool:
        return path.is_dir() and not (path / ".metadata").exists() and (path / MODEL_DIR / ".metadata").is_file()

    def read(self, path: Path, model_index: int | None = None) -> Catalog:
        """The folder as one checkpoint; ``model_index`` picks one model (and its optimizer) of
        a folder that holds several."""
        path = Path(path)
        catalog = Catalog(format=self.name, path=path, objects=ObjectTable(), facts=Facts(layout="accelerate"))
        containers: dict[tuple, str] = {}
        for section, folder in _dcp_parts(path, model_index).items():
            part = DCPFormat().read(folder)
            stray = next((n for n in [*part.tensors, *part.objects] if not n.startswith(section + ".")), None)
            if stray is not None:
                raise CorruptCheckpointError(f"{folder}: {stray!r} is outside the {section!r} section accelerate saves")
            _merge(catalog, part, containers)
            if catalog.facts.source_world_size is None:
                catalog.facts.source_world_size = part.facts.source_world_size
        for file in sorted(p for p in path.iterdir() if p.is_file() and _PART_FILE.fullmatch(p.name)):
            section = file.name.rsplit(".", 1)[0]
            _merge(catalog, _prefixed(TorchSaveFormat().read(file), section), containers)
        if containers:
            catalog.facts.containers = containers
        return catalog

    def writer(self, dst: Path, options: WriterOptions | None = None) -> Any:
        raise UsageError("accelerate folders are read only: write --to dcp (reshard.load_model resumes from it) "
                         "or --to hf")


def _prefixed(part: Catalog, section: str) -> Catalog:
    """``part``'s names under ``section.`` (a file's stem), its nesting one level deeper."""
    objects = ObjectTable()
    out = Catalog(format=part.format, path=part.path, objects=objects)
    for name, entry in part.tensors.items():
        out.tensors[f"{section}.{name}"] = TensorEntry(f"{section}.{name}", entry.shape, entry.dtype, entry.chunks)
    for name in part.objects:
        objects.set_lazy(f"{section}.{name}", object_loader(part.objects, name))
    out.paths = {f"{section}.{n}": (section, *part.nested_path(n)) for n in [*part.tensors, *part.objects]}
    out.facts.containers = {(section, *p): kind for p, kind in (part.facts.containers or {}).items()}
    out.notices = [f"{section}: {n}" for n in part.notices]
    return out


def _merge(catalog: Catalog, part: Catalog, containers: dict[tuple, str]) -> None:
    for name, entry in part.tensors.items():
        if name in catalog.tensors or name in catalog.objects:
            raise CorruptCheckpointError(f"{part.path}: {name!r} is also in another part of {catalog.path}")
        catalog.tensors[name] = entry
    for name in part.objects:
        if name in catalog.tensors or name in catalog.objects:
            raise CorruptCheckpointError(f"{part.path}: {name!r} is also in another part of {catalog.path}")
        cast(ObjectTable, catalog.objects).set_lazy(name, object_loader(part.objects, name))  # read() made it one
    catalog.paths.update({n: part.nested_path(n) for n in [*part.tensors, *part.objects] if n in part.paths})
    containers.update(part.facts.containers or {})
    catalog.notices += part.notices
