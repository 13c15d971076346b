"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3) and universal checkpoints, read without DeepSpeed.

A ``global_stepN/`` folder (or its parent, through ``latest``) becomes a catalog in the
``deepspeed`` layout (``reshard.core.conventions``):

* ``<fqn>``: the fp32 master weights, exactly what DeepSpeed's ``zero_to_fp32`` rebuilds
  (``get_fp32_state_dict_from_zero_checkpoint``), with buffers, frozen and shared parameters;
* ``optimizer.state.<fqn>.<key>``: every flat optimizer state of the partitions (Adam's
  ``exp_avg`` and ``exp_avg_sq``), laid out like the master weights, and its per-group
  scalars (``step``) for every parameter of the group;
* ``optimizer.param_groups.<g>.<key>``: hyper-parameters (``lr``...), ``params`` as FQNs;
* ``module.<fqn>``: the weights in the model's dtype where the checkpoint stores them apart
  from the master (ZeRO-1/2 with bf16/fp16; ZeRO-3 keeps placeholders, and an fp32 run's
  module is the master itself);
* ``optimizer.*`` and ``deepspeed.*``: the rest of the engine and optimizer state (loss
  scale, ZeRO stage, ``global_steps``, the config, client state) as plain values.

Nothing is gathered: each parameter's fragment of a rank's flat partition becomes a few boxes
(``formats/deepspeed/flat.py``), each a run of bytes in that rank's file, so conversions stream under
``--max-memory`` and stay exact. Files are unpickled by the allow-list; DeepSpeed's own classes
(loss scaler, stage enum, fragment addresses) are read as data (``reshard.safe_pickle.value_types``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reshard.formats.deepspeed.files import ZeroFiles, check_world, is_universal_folder, is_zero_folder, resolve_tag, zero_files
from reshard.formats.deepspeed.flat import FlatBuffer, fragment_chunks
from reshard.formats.deepspeed.state import (
    LAYOUT_KEYS,
    add_objects,
    add_tensor,
    field_of,
    flat_partition,
    load_state,
    plain,
    scalar_data,
)
from reshard.formats.deepspeed.universal import read_universal
from reshard.formats.deepspeed.zero import ZeroParam, split_concatenated, zero3_params, zero12_params

from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Catalog, Chunk
from reshard.core.errors import CorruptCheckpointError, ReshardError, UnsupportedFormatError, UsageError
from reshard.core.facts import Facts
from reshard.core.regions import StoredRegion
from reshard.pipeline.options import WriterOptions
from reshard.safe_pickle.inert import Inert

__all__ = ["DeepSpeedFormat"]

# Entries of the ZeRO optimizer state that hold partitions (read as tensors, not carried).
_PARTITIONS = ("single_partition_of_fp32_groups", "fp32_flat_groups", "base_optimizer_state", "optimizer_state_dict",
               "param_slice_mappings")


def _stage(value: Any, where: Path) -> int:
    stage = plain(value)
    if type(stage) is not int or stage not in (1, 2, 3):
        raise UnsupportedFormatError(f"{where}: zero_stage {stage!r}; reshard reads ZeRO stages 1, 2 and 3")
    return stage


def _shapes(model: dict, where: Path) -> list[dict[str, tuple[int, ...]]]:
    groups = field_of(model, "param_shapes", where, (list, tuple))
    out = []
    for g in groups:
        if not isinstance(g, Mapping) or not all(isinstance(s, tuple) and all(type(d) is int and d >= 0 for d in s)
                                                 for s in g.values()):
            raise CorruptCheckpointError(f"{where}: param_shapes holds something other than name -> shape")
        out.append({str(k): tuple(v) for k, v in g.items()})
    return out


class _Zero:
    """One ZeRO folder being read: its files, their unpickled dicts, the flat buffers."""

    def __init__(self, files: ZeroFiles, shown: Path) -> None:
        self.files = files
        first = load_state(files.optim[0])
        osd0 = field_of(first.value, "optimizer_state_dict", files.optim[0], dict)
        self.stage, self.world = _stage(field_of(osd0, "zero_stage", files.optim[0]), files.optim[0]), self._count(osd0, 0)
        check_world(files, self.world, files.optim[0])
        optim = {0: first, **{r: load_state(p) for r, p in files.optim.items() if r}}
        self.model = {r: load_state(p) for r, p in files.model.items()}
        self.osd = {r: field_of(u.value, "optimizer_state_dict", files.optim[r], dict) for r, u in optim.items()}
        self.optim_refused = first.refused
        for r, o in self.osd.items():
            stage, count = _stage(field_of(o, "zero_stage", files.optim[r]), files.optim[r]), self._count(o, r)
            if (stage, count) != (self.stage, self.world):
                raise CorruptCheckpointError(
                    f"{files.optim[r]}: ZeRO-{stage} partition of a {count}-rank run, but {files.optim[0].name} is "
                    f"ZeRO-{self.stage} of {self.world} ranks (left over from another run?)")
        self.catalog = Catalog("deepspeed", shown, facts=Facts(layout="deepspeed", source_world_size=self.world,
                                                              deepspeed_zero_stage=self.stage))
        self.shapes = _shapes(self.model[0].value, files.model[0])

    def _count(self, osd: dict, r: int) -> int:
        count = plain(field_of(osd, "partition_count", self.files.optim[r], (int, list, tuple, Inert)))
        counts = set(count) if isinstance(count, (list, tuple)) else {count}
        if len(counts) != 1 or not all(type(c) is int and c > 0 for c in counts):
            raise UnsupportedFormatError(f"{self.files.optim[r]}: param groups partitioned over world sizes "
                                         f"{sorted(counts)} (expert parallelism?), which reshard does not read")
        return counts.pop()

    def where(self, r: int) -> str:
        return str(self.files.optim[r])

    def read(self) -> Catalog:
        params, buffers, scalars = self._zero3() if self.stage == 3 else self._zero12()
        for p in params:
            for kind, ranks in buffers.items():
                chunks = [c for f in p.fragments for c in fragment_chunks(p.shape, f.begin, f.end, ranks[f.buffer], f.at)]
                dtype = next(iter(ranks.values())).parts[0].dtype
                name, path = (p.name, (p.name,)) if kind == "fp32" else (f"optimizer.state.{p.name}.{kind}",
                                                                         ("optimizer", "state", p.name, kind))
                add_tensor(self.catalog, name, p.shape, dtype, chunks, path)
            for key, data in scalars.get(p.group, {}).items():
                dtype = data.dtype if isinstance(data, StoredRegion) else data.value.dtype
                add_tensor(self.catalog, f"optimizer.state.{p.name}.{key}", (), dtype, [Chunk(Box((), ()), data)],
                           ("optimizer", "state", p.name, key))
        self._module_and_frozen([p.name for p in params])
        self._objects(params)
        return self.catalog

    # -------------------------------------------------------------------- the two layouts

    def _state_buffers(self, states: list[list[Mapping]], parts: list[list[StoredRegion]], key: tuple[int, int] | None
                       ) -> tuple[dict[str, dict[tuple[int, int], FlatBuffer]], dict[int, dict[str, Any]]]:
        """Per-kind flat buffers (``fp32`` and each flat optimizer state) for every rank, and
        each group's scalars (``step``). ``states[r][g]`` is rank r's optimizer state of group
        g, ``parts[r][g]`` its fp32 partition; ``key`` None: one buffer per (rank, group)."""
        buffers: dict[str, dict[tuple[int, int], FlatBuffer]] = {"fp32": {}}
        scalars: dict[int, dict[str, Any]] = {}
        kinds = [k for k, v in states[0][0].items() if isinstance(v, StoredRegion) and len(v.shape) == 1] if states[0] else []
        for r in range(self.world):
            if len(states[r]) != len(parts[r]):
                raise CorruptCheckpointError(f"{self.where(r)}: optimizer state for {len(states[r])} flat groups, "
                                             f"fp32 partitions for {len(parts[r])}")
            for kind in ["fp32", *kinds]:
                regions = []
                for g, part in enumerate(parts[r]):
                    where = f"{self.where(r)}: {kind} of flat group {g}"
                    region = flat_partition(part if kind == "fp32" else field_of(states[r][g], kind, where), where)
                    if region.shape[0] < part.shape[0]:
                        raise CorruptCheckpointError(f"{where} has {region.shape[0]} elements, the fp32 partition "
                                                     f"{part.shape[0]} (truncated?)")
                    # The last rank's moments keep the padding its fp32 partition was saved without:
                    # only the partition's own elements are state, the rest is never addressed.
                    regions.append(StoredRegion(region.path, region.offset, region.dtype, part.shape))
                target = buffers.setdefault(kind, {})
                if key is None:
                    target.update({(r, g): FlatBuffer((reg,), f"{self.where(r)}: {kind} of param group {g}")
                                   for g, reg in enumerate(regions)})
                else:
                    target[(r, 0)] = FlatBuffer(tuple(regions), f"{self.where(r)}: {kind} partition")
            if r == 0:
                for g, state in enumerate(states[0]):
                    found = {k: d for k, v in state.items() if k not in kinds and (d := scalar_data(v)) is not None}
                    scalars[g] = found
        return buffers, scalars

    def _partitions(self, fp32_key: str, torch_key: str) -> tuple[list[list[StoredRegion]], list[list[Mapping]]]:
        """Per rank: its fp32 partition of every flat group, and the torch optimizer's state of each."""
        parts, states = [], []
        for r, o in self.osd.items():
            where = self.files.optim[r]
            groups = field_of(o, fp32_key, where, (list, tuple))
            parts.append([flat_partition(g, f"{where}: fp32 partition") for g in groups])
            base = field_of(field_of(o, torch_key, where, dict), "state", where, dict)
            states.append([field_of(base, g, where, dict) for g in range(len(groups))])
        return parts, states

    def _zero12(self) -> tuple[list[ZeroParam], dict, dict]:
        parts, states = self._partitions("single_partition_of_fp32_groups", "base_optimizer_state")
        if len(parts[0]) != len(self.shapes):
            raise CorruptCheckpointError(f"{self.where(0)}: {len(parts[0])} fp32 partitions for the "
                                         f"{len(self.shapes)} param groups of {self.files.model[0].name}")
        lengths = [[p.shape[0] for p in ranks] for ranks in parts]
        paddings = self.osd[0].get("param_alignment_paddings")
        params = zero12_params(self.shapes, lengths, paddings, [self.where(r) for r in range(self.world)])
        self._check_slices(params)
        buffers, scalars = self._state_buffers(states, parts, None)
        return params, buffers, scalars

    def _check_slices(self, params: list[ZeroParam]) -> None:
        """Each rank's file names the fragments it holds (``param_slice_mappings``): they must
        be the ones the shapes give, or the files do not belong together."""
        for r, o in self.osd.items():
            mappings = o.get("param_slice_mappings")
            if not isinstance(mappings, (list, tuple)):
                continue
            for p in params:
                mine = [f for f in p.fragments if f.rank == r]
                group = mappings[p.group] if p.group < len(mappings) else None
                saved = group.get(p.name) if isinstance(group, Mapping) else None
                state = getattr(saved, "state", None) if isinstance(saved, Inert) else None
                got = (state.get("numel"), state.get("start")) if isinstance(state, dict) else None
                want = (mine[0].end - mine[0].begin, mine[0].at) if mine else None
                if got != want:
                    raise CorruptCheckpointError(
                        f"{self.where(r)}: holds {p.name!r} as (numel, start) {got}, but the shapes and partition "
                        f"sizes give {want}; the files do not belong to one checkpoint")

    def _zero3(self) -> tuple[list[ZeroParam], dict, dict]:
        parts, states = self._partitions("fp32_flat_groups", "optimizer_state_dict")
        ends = [sum(p.shape[0] for p in parts[0][: g + 1]) for g in range(len(parts[0]))]
        for r in range(1, self.world):
            if [p.shape[0] for p in parts[r]] != [p.shape[0] for p in parts[0]]:
                raise CorruptCheckpointError(f"{self.where(r)}: flat partition sizes {[p.shape[0] for p in parts[r]]} "
                                             f"differ from rank 0's {[p.shape[0] for p in parts[0]]}")
        lengths = [sum(p.shape[0] for p in ranks) for ranks in parts]
        params = zero3_params(self.shapes, lengths, ends, [self.where(r) for r in range(self.world)])
        buffers, scalars = self._state_buffers(states, parts, (0, 0))
        return params, buffers, scalars

    # -------------------------------------------------------------------- the rest

    def _module_and_frozen(self, trained: list[str]) -> None:
        m0, where = self.model[0].value, self.files.model[0]
        module = field_of(m0, "module", where, dict)
        for b in field_of(m0, "buffer_names", where, (list, tuple)):
            region = module.get(b)
            if not isinstance(region, StoredRegion):
                raise CorruptCheckpointError(f"{where}: buffer {b!r} is not stored in module")
            add_tensor(self.catalog, b, region.shape, region.dtype, [Chunk(full_box(region.shape), region)], (b,))
        frozen = m0.get("frozen_param_shapes") or {}
        for name, shape in frozen.items():
            pieces = [field_of(field_of(u.value, "frozen_param_fragments", self.files.model[r], dict), name,
                               self.files.model[r], StoredRegion) for r, u in self.model.items()]
            if self.stage < 3:  # one whole copy, in the single model file
                region = pieces[0]
                if region.shape != tuple(shape):
                    raise CorruptCheckpointError(f"{where}: frozen {name!r} is {list(region.shape)}, not {list(shape)}")
                add_tensor(self.catalog, name, region.shape, region.dtype, [Chunk(full_box(region.shape), region)], (name,))
                continue
            files = [str(self.files.model[r]) for r in self.model]
            flats = {(r, 0): FlatBuffer((flat_partition(p, files[r]),), files[r]) for r, p in enumerate(pieces)}
            frags = split_concatenated(tuple(shape), [p.shape[0] for p in pieces], name, files)
            chunks = [c for f in frags for c in fragment_chunks(tuple(shape), f.begin, f.end, flats[f.buffer], f.at)]
            add_tensor(self.catalog, name, tuple(shape), pieces[0].dtype, chunks, (name,))
        for name in trained:  # model-dtype copies (ZeRO-1/2 bf16/fp16): module holds them whole
            region = module.get(name)
            entry = self.catalog.tensors[name]
            if isinstance(region, StoredRegion) and region.shape == entry.shape and region.dtype != entry.dtype:
                add_tensor(self.catalog, f"module.{name}", region.shape, region.dtype,
                           [Chunk(full_box(region.shape), region)], ("module", name))
        shared = m0.get("shared_params") or {}
        for alias, source in shared.items() if isinstance(shared, Mapping) else ():
            original = self.catalog.tensors.get(source)
            if original is not None and alias not in self.catalog.tensors:
                add_tensor(self.catalog, alias, original.shape, original.dtype, original.chunks, (alias,))

    def _objects(self, params: list[ZeroParam]) -> None:
        """Param groups (``params`` as FQNs), the optimizer's own scalars and the engine state."""
        o0 = self.osd[0]
        torch_state = o0.get("base_optimizer_state" if self.stage < 3 else "optimizer_state_dict") or {}
        groups = torch_state.get("param_groups") if isinstance(torch_state, Mapping) else None
        names_of: dict[int, list[str]] = {}
        for p in params:
            names_of.setdefault(p.group, []).append(p.name)
        optimizer: dict[str, Any] = {k: plain(v) for k, v in o0.items() if k not in _PARTITIONS}
        if isinstance(groups, (list, tuple)):
            optimizer["param_groups"] = []
            for g in groups:
                g = dict(g)
                listed = g.get("params")
                ids = listed if isinstance(listed, list) else []
                g["params"] = [n for i in ids if isinstance(i, int) for n in names_of.get(i, [])]
                optimizer["param_groups"].append(g)
        add_objects(self.catalog, {"optimizer": optimizer}, self.optim_refused, self.files.optim[0])
        m0 = self.model[0]
        rest = {k: v for k, v in m0.value.items() if k not in LAYOUT_KEYS}
        add_objects(self.catalog, {"deepspeed": rest}, m0.refused, self.files.model[0])


class DeepSpeedFormat:
    name = "deepspeed"

    def detect(self, path: Path) -> bool:
        if not path.is_dir():
            return False
        if is_zero_folder(path) or is_universal_folder(path):
            return True
        # A parent folder: DeepSpeed writes the tag of the last save into ``latest`` (checked
        # when read), copies zero_to_fp32.py beside it and keeps earlier tags' folders.
        try:
            folder = resolve_tag(path)
        except ReshardError:
            if not (path / "latest").is_file():
                return False
            return (path / "zero_to_fp32.py").is_file() or any(
                d.is_dir() and (is_zero_folder(d) or is_universal_folder(d)) for d in path.iterdir())
        return is_zero_folder(folder) or is_universal_folder(folder)

    def read(self, path: Path) -> Catalog:
        """Catalog a ZeRO tag folder, a universal folder, or the folder whose ``latest`` names one."""
        path = Path(path)
        folder = resolve_tag(path)
        if is_universal_folder(folder) and not is_zero_folder(folder):
            return read_universal(folder)
        return _Zero(zero_files(folder), folder).read()

    def writer(self, dst: Path, options: WriterOptions | None = None) -> Any:
        raise UsageError("reshard reads DeepSpeed checkpoints but does not write them; convert to dcp, safetensors, "
                         "torch or hf (or --to-mesh for an FSDP2 run)")

