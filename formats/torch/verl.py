"""verl's FSDP checkpoint folders: three sets of per-rank torch files read as one catalog.

verl's ``FSDPCheckpointManager.save_checkpoint`` writes, on every rank ``r`` of a world of
``W`` (each with plain ``torch.save``):

| file                                     | holds                                          | section  |
| ---------------------------------------- | ---------------------------------------------- | -------- |
| ``model_world_size_{W}_rank_{r}.pt``     | ``model.state_dict()``: DTensor shards (FSDP2) | model.   |
| ``optim_world_size_{W}_rank_{r}.pt``     | ``optimizer.state_dict()``: int-keyed state    | optim.   |
| ``extra_state_world_size_{W}_rank_{r}``  | ``{"lr_scheduler": ..., "rng": {...}}``        | extra.   |

and ``huggingface/config.json`` beside them, carried like an HF folder's (``--to hf``). A set
is absent when verl was told not to save it, and a file holds ``None`` where there was no
optimizer or scheduler. The catalog records ``facts.layout = "verl"``, the convention
(``reshard/core/conventions.py``) that says which section is which, never guessed from names.
FSDP1 saves ShardedTensors instead of DTensors: refused with one line (``read_set``).
"""

from __future__ import annotations

import re
from pathlib import Path

from reshard.formats.safetensors.format import take_hf_configs
from reshard.formats.torch.file import read_torch_file
from reshard.formats.torch.ranks import complete_set, first_refused, read_set
from reshard.formats.torch.save import FlatTree, flatten_tree

from reshard.core.catalog import Catalog, ObjectTable, TensorEntry, object_loader
from reshard.core.errors import CorruptCheckpointError, ReshardError, UnsafeCheckpointError
from reshard.core.facts import Facts

__all__ = ["VERL_SETS", "verl_sets", "read_verl"]

# File prefix -> catalog section, in the order the sections are listed.
VERL_SETS = {"model": "model", "optim": "optim", "extra_state": "extra"}
_FILES = re.compile(r"(model|optim|extra_state)_world_size_(\d+)_rank_\{\}\.pt")
_HF_FOLDER = "huggingface"


def verl_sets(path: Path, groups: dict[str, dict[int, Path]]) -> dict[str, dict[int, Path]] | None:
    """section -> rank -> file when the folder's rank files are verl's (the model's set and at
    least one other, nothing else); None otherwise."""
    found: dict[str, tuple[int, dict[int, Path]]] = {}
    for pattern, files in groups.items():
        m = _FILES.fullmatch(pattern)
        if m is None:
            return None
        found[m.group(1)] = (int(m.group(2)), files)
    if "model" not in found or len(found) < 2:
        return None
    worlds = sorted({w for w, _ in found.values()})
    if len(worlds) != 1:
        raise CorruptCheckpointError(f"{path}: verl's rank files name different world sizes {worlds}")
    sets = {}
    for prefix, section in VERL_SETS.items():
        if prefix in found:
            files = complete_set(path, found[prefix][1])
            if len(files) != worlds[0]:
                raise CorruptCheckpointError(f"{path}: {len(files)} {prefix} rank files for a world of {worlds[0]}")
            sets[section] = files
    return sets


def _trees(files: dict[int, Path]) -> dict[int, FlatTree] | None:
    read = {r: read_torch_file(f) for r, f in files.items()}
    if all(u.value is None for u in read.values()):  # verl saves None for an absent optimizer
        return None
    return {r: flatten_tree(u, str(files[r])) for r, u in read.items()}


def read_verl(path: Path, sets: dict[str, dict[int, Path]]) -> Catalog:
    """One catalog of every set, each under its section; per-set rules as ``read_set``
    (the optimizer's and the extra state's plain tensors are per-rank state, not shards)."""
    trees = {section: t for section, files in sets.items() if (t := _trees(files)) is not None}
    try:
        parts = {section: read_set(path, sets[section], t, plain_per_rank=section != "model")
                 for section, t in trees.items()}
    except ReshardError as e:
        refused = None if isinstance(e, UnsafeCheckpointError) else next(
            (r for s, t in trees.items() if (r := first_refused(sets[s], t)) is not None), None)
        if refused is not None:
            raise UnsafeCheckpointError(refused) from e
        raise
    world = len(next(iter(sets.values())))
    objects = ObjectTable()
    catalog = Catalog(format="torch-ranks", path=path, objects=objects,
                      facts=Facts(source_world_size=world, layout="verl"))
    containers, placements = {}, {}
    for section, part in parts.items():
        for name, entry in part.tensors.items():
            catalog.tensors[f"{section}.{name}"] = TensorEntry(f"{section}.{name}", entry.shape, entry.dtype, entry.chunks)
        for name in part.objects:
            objects.set_lazy(f"{section}.{name}", object_loader(part.objects, name))
        catalog.paths.update({f"{section}.{name}": (section, *nested) for name, nested in part.paths.items()})
        containers.update({(section, *p): kind for p, kind in (part.facts.containers or {}).items()})
        placements.update({f"{section}.{n}": p for n, p in (part.facts.source_placements or {}).items()})
        if catalog.facts.source_mesh is None:
            catalog.facts.source_mesh = part.facts.source_mesh
        if catalog.facts.source_mesh_dim_names is None:
            catalog.facts.source_mesh_dim_names = part.facts.source_mesh_dim_names
        catalog.notices += [f"{section}: {n}" for n in part.notices]
    if containers:
        catalog.facts.containers = containers
    if placements:
        catalog.facts.source_placements = placements
    take_hf_configs(catalog, path / _HF_FOLDER)
    return catalog
