"""safetensors files and Hugging Face sharded folders (``model-00001-of-00003.safetensors`` +
``model.safetensors.index.json``).

Reading validates every header (see ``safetensors.header``) and every index entry before
trusting it, then hands out one ``StoredRegion`` per tensor: nothing is mmap'd and no tensor
byte is read until the engine asks for a box. Objects and nested paths that reshard wrote
come back from ``__metadata__``; other metadata and a folder's ``config.json`` /
``generation_config.json`` are kept in ``catalog.facts`` for later exports. A name may be in
several files only as torch's ``HuggingFaceStorageWriter(save_distributed=True)`` stores it,
each file's ``DCP_SHARDING_INFO`` saying which chunk it holds: those become one tensor with a
chunk per file, checked to tile it (``dcp_safetensors``). Only a folder's own files are read:
the ``sharded/`` folder torch's consolidation leaves beside its output is not.

Writing lays files out exactly as ``safetensors.torch.save_file`` and
``huggingface_hub.save_torch_state_dict`` do (same header bytes, same tensor order, same
greedy shard split, same index), so tools that read theirs read ours.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path, PureWindowsPath
from typing import Any

from reshard.formats.dcp.safetensors import DCP_KEYS, assemble, shard_boxes
from reshard.formats.safetensors.header import MAX_HEADER_SIZE, file_order, header_bytes, read_header, unstorable

from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Catalog, NestedPath
from reshard.core.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError, UsageError
from reshard.core.pieces import OutputFile, Piece
from reshard.core.regions import StoredRegion
from reshard.core.structure import CONTAINERS_KEY, containers_from_json, containers_to_json
from reshard.core.tagged_json import Unencodable, decode_value, encode_value
from reshard.core.target import Target
from reshard.pipeline.options import WriterOptions, shard_bytes

__all__ = ["SafetensorsFormat", "SafetensorsWriter", "INDEX_NAME", "OBJECTS_KEY", "PATHS_KEY"]

INDEX_NAME = "model.safetensors.index.json"
OBJECTS_KEY = "reshard.objects"
PATHS_KEY = "reshard.paths"
_SHARD_PATTERN = "model{suffix}.safetensors"
_HUB_SHARD_SIZE = "5GB"  # huggingface_hub's default max_shard_size


def take_hf_configs(catalog: Catalog, folder: Path) -> None:
    """An HF folder's config.json and generation_config.json, where present, into the
    catalog's facts (for later exports)."""
    if (folder / "config.json").is_file():
        catalog.facts.hf_config = _load_json(folder / "config.json", "config.json")
    if (folder / "generation_config.json").is_file():
        catalog.facts.hf_generation_config = _load_json(folder / "generation_config.json", "generation_config.json")


def _load_json(path: Path, what: str) -> Any:
    """A small JSON side file (index, config); bounded like a header, so a hostile one cannot
    exhaust memory, and nesting too deep for the parser is an error, not a crash."""
    try:
        if path.stat().st_size > MAX_HEADER_SIZE:
            raise CorruptCheckpointError(f"{path}: {what} is larger than {MAX_HEADER_SIZE} bytes")
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"{path}: {what} is not valid JSON ({e})") from None


# ---------------------------------------------------------------------------------- reading


def _shard_path(root: Path, index: Path, filename: Any) -> Path:
    """The file an index entry names, refused when it could reach outside ``root``.

    The name must be a relative path without ``..`` whose folders stay inside ``root`` once
    resolved. The file itself may be a symlink to elsewhere: the Hub cache stores every
    snapshot file as a link into ``../../blobs``, and a link is made by whoever owns the
    folder, not by the (possibly downloaded, possibly hostile) index.
    """
    where = f"{index}: weight_map file {filename!r}"
    if not isinstance(filename, str) or not filename:
        raise CorruptCheckpointError(f"{where} is not a file name")
    # Windows rules are the stricter superset: they also see drives and backslashes.
    win = PureWindowsPath(filename)
    if win.anchor or ".." in win.parts:
        raise UnsafeCheckpointError(f"{where} is not a plain path inside the checkpoint folder; refused")
    path = root / filename
    if not path.parent.resolve().is_relative_to(root.resolve()):
        raise UnsafeCheckpointError(f"{where} lies in a folder that resolves outside the checkpoint; refused")
    if not path.is_file():
        raise CorruptCheckpointError(f"{where} is missing")
    return path


def _indexed_files(root: Path, indexes: list[Path]) -> dict[Path, set[str]]:
    """file -> the tensor names its index puts there, for every index of a folder."""
    files: dict[Path, set[str]] = {}
    seen: dict[str, Path] = {}
    for index in indexes:
        data = _load_json(index, "index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise CorruptCheckpointError(f"{index}: no weight_map object")
        resolved: dict[Any, Path] = {}
        for name, filename in weight_map.items():
            if name in seen:
                raise CorruptCheckpointError(f"{index}: tensor {name!r} is also mapped by {seen[name]}")
            seen[name] = index
            if filename not in resolved:
                resolved[filename] = _shard_path(root, index, filename)
            files.setdefault(resolved[filename], set()).add(name)
    return files


def _source_files(path: Path) -> tuple[Path | None, dict[Path, set[str] | None]]:
    """(folder, files to read with the names an index expects in each, None without index)."""
    if path.is_file():
        if path.name.endswith(".safetensors.index.json"):
            return path.parent, dict(_indexed_files(path.parent, [path]))
        return None, {path: None}
    main = path / INDEX_NAME
    indexes = [main] if main.is_file() else sorted(p for p in path.glob("*.safetensors.index.json") if p.is_file())
    if indexes:
        indexed: dict[Path, set[str] | None] = dict(_indexed_files(path, indexes))
        single = path / "model.safetensors"
        if main.is_file() and single.is_file() and single not in indexed:
            # transformers loads model.safetensors before looking for an index: which one is
            # the model is not ours to guess.
            raise CorruptCheckpointError(f"{path}: holds both model.safetensors and {INDEX_NAME} naming other files; "
                                         "transformers would load model.safetensors and ignore the index: remove the "
                                         "one that does not belong")
        return path, indexed
    files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if not files:
        raise CheckpointNotFoundError(f"{path}: no *.safetensors file or index in this folder")
    _check_shard_set(path, [p.name for p in files])
    return path, {p: None for p in files}


_SHARD_NAME = re.compile(r"(.+)-(\d+)-of-(\d+)\.safetensors")


def _check_shard_set(folder: Path, names: list[str]) -> None:
    """Without an index, shards named ``NAME-00001-of-00004`` must all be there: fewer is an
    interrupted download or write (an object store shows shards before the index that
    completes them), never a smaller checkpoint."""
    groups: dict[tuple[str, int], set[int]] = {}
    for name in names:
        m = _SHARD_NAME.fullmatch(name)
        if m:
            groups.setdefault((m.group(1), int(m.group(3))), set()).add(int(m.group(2)))
    for (stem, total), have in sorted(groups.items()):
        if have != set(range(1, total + 1)):
            raise CorruptCheckpointError(
                f"{folder}: holds {len(have)} of the {total} shards {stem}-*-of-{total:05d}.safetensors and no index; "
                "an interrupted download or write? fetch or write it again")


def _check_against_index(file: Path, stored: set[str], expected: set[str] | None) -> None:
    if expected is None:
        return
    missing, extra = sorted(expected - stored), sorted(stored - expected)
    if missing:
        raise CorruptCheckpointError(f"{file}: the index maps tensor {missing[0]!r} here but the file does not hold it")
    if extra:
        raise CorruptCheckpointError(f"{file}: holds tensor {extra[0]!r}, which the index maps to another file or not at all")


def _decode_entries(file: Path, key: str, raw: str) -> dict[str, Any]:
    try:
        value = decode_value(json.loads(raw))
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{file}: __metadata__ {key!r} is not valid ({e})") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise CorruptCheckpointError(f"{file}: __metadata__ {key!r} is not an object keyed by name")
    return value


def _nested_path(file: Path, name: str, value: Any) -> NestedPath:
    if not isinstance(value, list) or not all(type(p) in (str, int) for p in value):
        raise CorruptCheckpointError(f"{file}: __metadata__ {PATHS_KEY!r} entry {name!r} is not a list of keys")
    return tuple(value)


def _take_metadata(catalog: Catalog, file: Path, metadata: dict[str, str]) -> None:
    rest = dict(metadata)
    if CONTAINERS_KEY in rest:
        try:
            raw = json.loads(rest.pop(CONTAINERS_KEY))
        except (ValueError, RecursionError) as e:
            raise CorruptCheckpointError(f"{file}: __metadata__ {CONTAINERS_KEY!r} is not valid JSON ({e})") from None
        catalog.facts.containers = containers_from_json(raw, f"{file}: __metadata__")
    objects = _decode_entries(file, OBJECTS_KEY, rest.pop(OBJECTS_KEY)) if OBJECTS_KEY in rest else {}
    paths = _decode_entries(file, PATHS_KEY, rest.pop(PATHS_KEY)) if PATHS_KEY in rest else {}
    for name, value in objects.items():
        if name in catalog.objects:
            raise CorruptCheckpointError(f"{file}: object {name!r} is stored in more than one file")
        catalog.objects[name] = value
    catalog.paths.update({n: _nested_path(file, n, p) for n, p in paths.items()})
    if rest:
        catalog.facts.safetensors_metadata = {**(catalog.facts.safetensors_metadata or {}), **rest}


class SafetensorsFormat:
    name = "safetensors"

    def detect(self, path: Path) -> bool:
        if path.is_file():
            return path.name.endswith((".safetensors", ".safetensors.index.json"))
        if not path.is_dir() or (path / ".metadata").exists():  # a DCP folder is DCP's
            return False
        return any(path.glob("*.safetensors.index.json")) or any(p.is_file() for p in path.glob("*.safetensors"))

    def read(self, path: Path) -> Catalog:
        """A ``*.safetensors`` file, its ``*.index.json``, or a folder (indexed or not)."""
        if not path.exists():
            raise CheckpointNotFoundError(f"{path}: no such file or directory")
        root, files = _source_files(path)
        catalog = Catalog(format=self.name, path=path)
        # A name may be in several files only as DCP's HuggingFaceStorageWriter shards it:
        # each file's DCP_SHARDING_INFO says which chunk it holds (dcp_safetensors).
        parts: dict[str, list[tuple[Path, StoredRegion, Box | None]]] = {}
        for file in sorted(files):
            header = read_header(file)
            _check_against_index(file, {t.name for t in header.tensors}, files[file])
            boxes = shard_boxes(file, header)
            for t in header.tensors:
                region = StoredRegion(file, header.data_start + t.begin, t.dtype, t.shape)
                parts.setdefault(t.name, []).append((file, region, boxes[t.name] if boxes else None))
            _take_metadata(catalog, file, {k: v for k, v in header.metadata.items() if k not in DCP_KEYS})
        catalog.tensors = {name: assemble(name, ps) for name, ps in parts.items()}
        if root is not None:
            take_hf_configs(catalog, root)
        return catalog

    def writer(self, dst: Path | str, options: WriterOptions | None = None) -> SafetensorsWriter:
        return SafetensorsWriter(dst, max_shard_size=shard_bytes(options or WriterOptions()))


# ---------------------------------------------------------------------------------- writing


def _encode_objects(objects: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(name -> encoded value, name -> why it could not be encoded)."""
    kept, dropped = {}, {}
    for name, value in objects.items():
        try:
            kept[name] = encode_value(value)
        except Unencodable as e:
            dropped[name] = f"holds a value of type {e}"
        except RecursionError:
            dropped[name] = "is nested too deeply"
    return kept, dropped


class SafetensorsWriter:
    """One ``.safetensors`` file when ``dst`` ends in ``.safetensors`` and no
    ``max_shard_size`` is given; otherwise a folder laid out like
    ``huggingface_hub.save_torch_state_dict``: tensors split greedily in target order into
    ``model-0000i-of-0000n.safetensors`` (5GB shards by default), a lone shard named
    ``model.safetensors``, and ``model.safetensors.index.json`` when there are several shards
    *or* the user asked for a ``max_shard_size`` (so scripts that pass one can count on an
    index) — except with no tensors at all, where an empty index would hide the lone file. Within a file tensors are ordered as
    ``save_file`` orders them (widest dtype first,
    then by name), which keeps every tensor aligned to its element size.

    ``__metadata__`` of the first file holds ``{"format": "pt"}``, the source's own metadata
    (``facts.safetensors_metadata``) and, when present, ``reshard.objects`` /
    ``reshard.paths`` as tagged JSON; other files hold ``{"format": "pt"}``. ``format`` is always
    ``pt`` (the bytes are torch's), whatever the source said.
    """


    def __init__(self, dst: Path | str, *, max_shard_size: int | None = None) -> None:
        if max_shard_size is not None and max_shard_size <= 0:
            raise UsageError(f"max_shard_size must be positive, got {max_shard_size}")
        self.max_shard_size = max_shard_size
        self.output_is_dir = max_shard_size is not None or Path(dst).suffix != ".safetensors"

    def _groups(self, target: Target) -> list[tuple[str, list[str]]]:
        if not self.output_is_dir:
            return [("", list(target.tensors))]
        from huggingface_hub import split_state_dict_into_shards_factory

        split = split_state_dict_into_shards_factory(
            {name: t.nbytes for name, t in target.tensors.items()},
            get_storage_size=lambda nbytes: nbytes,
            filename_pattern=_SHARD_PATTERN,
            max_shard_size=self.max_shard_size or _HUB_SHARD_SIZE,
        )
        return list(split.filename_to_tensors.items()) or [(_SHARD_PATTERN.format(suffix=""), [])]

    def _first_metadata(self, target: Target) -> dict[str, str]:
        source = target.facts.safetensors_metadata or {}
        meta = {k: v for k, v in source.items() if isinstance(k, str) and isinstance(v, str)}
        meta["format"] = "pt"
        objects, _ = _encode_objects(target.objects)
        if objects:
            meta[OBJECTS_KEY] = json.dumps(objects, separators=(",", ":"), allow_nan=False)
        paths = {n: list(p) for n, p in target.paths.items() if n in target.tensors or n in objects}
        if paths:
            meta[PATHS_KEY] = json.dumps(paths, separators=(",", ":"))
        containers = target.facts.containers
        if paths and containers:  # int-keyed dicts and tuples, which paths alone rebuild as lists
            meta[CONTAINERS_KEY] = json.dumps(containers_to_json(containers), separators=(",", ":"))
        return meta

    def layout(self, target: Target) -> list[OutputFile]:
        for t in target.tensors.values():
            if len(t.boxes) != 1 or t.boxes[0] != full_box(t.shape):
                raise UsageError(
                    f"safetensors holds whole tensors; {t.name!r} is laid out as {len(t.boxes)} boxes "
                    "(a mesh layout): write dcp for sharded output"
                )
            why = "the header reserves this name" if t.name == "__metadata__" else unstorable(t.dtype, t.shape)
            if why:
                raise UsageError(f"{t.name!r}: {why}; write dcp or torch instead")
        files = []
        for i, (relpath, names) in enumerate(self._groups(target)):
            order = file_order([(n, target.tensors[n].dtype) for n in names])
            tensors = [target.tensors[n] for n in order]
            meta = self._first_metadata(target) if i == 0 else {"format": "pt"}
            head = header_bytes([(t.name, t.dtype, t.shape) for t in tensors], meta)
            if len(head) - 8 > MAX_HEADER_SIZE:
                raise UsageError(
                    f"{relpath or 'output'}: header of {len(head) - 8} bytes passes safetensors' limit "
                    f"of {MAX_HEADER_SIZE}; use a smaller max_shard_size"
                )
            files.append(OutputFile(relpath, [head] + [Piece(t.name, t.boxes[0], t.dtype) for t in tensors]))
        return files

    def finish(self, staging: Path, target: Target, files: list[OutputFile]) -> None:
        """The index, written last (as the engine commits), in huggingface_hub's form."""
        if not self.output_is_dir or not target.tensors or (len(files) == 1 and self.max_shard_size is None):
            return  # an index without tensors would hide the lone file (and its objects) from readers
        where = {seg.name: f.relpath for f in files for seg in f.segments if isinstance(seg, Piece)}
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in target.tensors.values())},
            "weight_map": {name: where[name] for name in target.tensors},
        }
        with open(staging / INDEX_NAME, "w") as f:
            json.dump(index, f, indent=2)
            f.flush()
            os.fsync(f.fileno())

    def notices(self, target: Target) -> list[str]:
        _, dropped = _encode_objects(target.objects)
        return [
            f"object {name!r} {why}, which safetensors metadata cannot store; it is left out "
            "(write dcp or torch to keep it)"
            for name, why in dropped.items()
        ]
