"""Whole state dicts saved with ``torch.save`` (``.pt``, ``.pth``, HF ``pytorch_model.bin``).

Reading never runs ``torch.load``: ``read_torch_zip`` replays the pickle with an allow-list
and hands back every tensor as a ``StoredRegion`` in the file, so a 100 GB ``.pt`` is
cataloged without reading a tensor byte. The object tree is flattened the way DCP flattens
state dicts (``{"model": {"a.b": t}}`` is ``model.a.b``; list items by index), and every
leaf's nested path is kept so that any writer can rebuild the same nesting.

DCP-style paths cannot tell an int-keyed dict (a plain optimizer's ``state``) from a list,
nor a tuple from a list: those containers are listed in ``catalog.attrs[CONTAINERS_ATTR]``,
so torch -> torch stays exact while paths from DCP rebuild as lists, as DCP's own
``dcp_to_torch_save`` does.

Writing emits the archive ``torch.save`` would (``torch_save_segments``): the pickle names
only what ``torch.load(weights_only=True)`` accepts, and payloads are 64-byte aligned so
``mmap=True`` works.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from reshard.formats.pieces import FileLayout, Piece, Segment
from reshard.formats.torch_zip import DTensorRef, Record, read_torch_zip
from reshard.formats.torch_zip_write import PieceRef, torch_save_segments

from reshard.boxes import full_box
from reshard.catalog import Catalog, Chunk, NestedPath, Target, TensorEntry
from reshard.errors import UnsupportedFormatError, UsageError
from reshard.regions import StoredRegion

__all__ = [
    "CONTAINERS_ATTR",
    "TORCH_SUFFIXES",
    "FlatTree",
    "TorchSaveFormat",
    "TorchSaveWriter",
    "build_tree",
    "flatten_tree",
]

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
# catalog.attrs key: {nested path of a container: "dict" | "tuple"} where the keys alone
# would rebuild the wrong type (int keys mean a list otherwise).
CONTAINERS_ATTR = "torch_containers"
_ARCHIVE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")


# ---------------------------------------------------------------------------------- the tree


def _is_tensor(value: Any) -> bool:
    return isinstance(value, (StoredRegion, DTensorRef))


def _holds_tensor(value: Any) -> bool:
    if _is_tensor(value):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(v) for v in value)
    return False


def _is_branch(value: Any) -> bool:
    """Whether flattening descends into ``value``; DCP's rule, plus tuples that hold tensors
    (DCP would pickle those whole, we keep their tensors readable piece by piece)."""
    if isinstance(value, Mapping):
        return bool(value) and all(type(k) in (str, int) for k in value)
    if isinstance(value, list):
        return any(_is_tensor(v) or isinstance(v, Mapping) or (isinstance(v, (list, tuple)) and _is_branch(v))
                   for v in value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return _holds_tensor(value)
    return False


@dataclass
class FlatTree:
    """A torch.save object tree flattened: flat name -> (nested path, leaf), in file order."""

    leaves: dict[str, tuple[NestedPath, Any]] = field(default_factory=dict)
    containers: dict[NestedPath, str] = field(default_factory=dict)


def flatten_tree(tree: Any, where: str) -> FlatTree:
    """Flatten ``tree`` as DCP names state dicts; ``where`` names the file in errors."""
    out = FlatTree()
    if isinstance(tree, Mapping) and not tree:
        return out
    if not _is_branch(tree):
        raise UnsupportedFormatError(
            f"{where}: holds a single {type(tree).__name__}, not a state dict (a dict of tensors)"
        )
    for path, leaf in _walk(tree, (), out.containers):
        name = ".".join(map(str, path))
        if name in out.leaves:
            raise UnsupportedFormatError(
                f"{where}: entries {out.leaves[name][0]} and {path} both flatten to the name {name!r}"
            )
        if isinstance(leaf, Record) and leaf.kind == "wrapper":
            raise UnsupportedFormatError(f"{where}: {name!r} is a tensor subclass reshard cannot read")
        if not _is_tensor(leaf) and _holds_tensor(leaf):
            raise UnsupportedFormatError(
                f"{where}: {name!r} keeps tensors inside a {type(leaf).__name__} (or a dict with keys "
                "other than str/int); re-save them in dicts or lists"
            )
        out.leaves[name] = (path, leaf)
    return out


def _walk(value: Any, path: NestedPath, containers: dict[NestedPath, str]) -> Iterator[tuple[NestedPath, Any]]:
    if not _is_branch(value):
        yield path, value
        return
    if isinstance(value, Mapping):
        if all(type(k) is int for k in value):
            containers[path] = "dict"
        items: Iterable[tuple[Any, Any]] = value.items()
    else:
        if isinstance(value, tuple):
            containers[path] = "tuple"
        items = enumerate(value)
    for key, item in items:
        yield from _walk(item, path + (key,), containers)


class _Branch(dict):
    """An inner node while rebuilding (told apart from dict-valued leaves)."""


def build_tree(leaves: Iterable[tuple[NestedPath, Any]], containers: Mapping[NestedPath, str] | None = None) -> Any:
    """The nested object ``flatten_tree`` came from: int keys make lists (DCP's rule) unless
    ``containers`` says the node was a dict or a tuple. A list's missing items are None,
    as in DCP's ``unflatten_state_dict``."""
    root = _Branch()
    for path, value in leaves:
        if not path:
            raise UsageError("an entry has an empty nested path")
        node = root
        for i, key in enumerate(path):
            last = i == len(path) - 1
            if key in node and (last or not isinstance(node[key], _Branch)):
                raise UsageError(f"entries at {path[: i + 1]} and below it collide in the nested state dict")
            if last:
                node[key] = value
            else:
                node = node.setdefault(key, _Branch())
    return _finish(root, (), containers or {})


def _finish(node: _Branch, path: NestedPath, containers: Mapping[NestedPath, str]) -> Any:
    items = {k: _finish(v, path + (k,), containers) if isinstance(v, _Branch) else v for k, v in node.items()}
    kind = containers.get(path)
    if kind == "dict" or not items or not all(type(k) is int and k >= 0 for k in items):
        return items
    seq: list[Any] = [None] * (max(items) + 1)
    for k, v in items.items():
        seq[k] = v
    return tuple(seq) if kind == "tuple" else seq


# ---------------------------------------------------------------------------------- format


def _tensor_entry(name: str, leaf: StoredRegion | DTensorRef, where: Path) -> TensorEntry:
    if isinstance(leaf, DTensorRef):
        if any(n != 1 for n in leaf.mesh_shape) or leaf.local.shape != leaf.global_shape:
            raise UnsupportedFormatError(
                f"{where}: {name!r} is one rank's shard of a DTensor (mesh {leaf.mesh_shape}); this file is "
                "a part of a sharded checkpoint: put every rank's file in one folder and read the folder"
            )
        leaf = leaf.local
    return TensorEntry(name, leaf.shape, leaf.dtype, [Chunk(full_box(leaf.shape), leaf)])


def _is_torch_zip(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            return any(n == "data.pkl" or n.endswith("/data.pkl") for n in z.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


class TorchSaveFormat:
    name = "torch"

    def detect(self, path: Path) -> bool:
        if not path.is_file():
            return False
        return path.suffix.lower() in TORCH_SUFFIXES or _is_torch_zip(path)

    def read(self, path: Path) -> Catalog:
        """Catalog a torch.save file; DTensors only when their mesh has a single rank."""
        path = Path(path)
        flat = flatten_tree(read_torch_zip(path), str(path))
        catalog = Catalog(format=self.name, path=path)
        for name, (nested, leaf) in flat.leaves.items():
            catalog.paths[name] = nested
            if _is_tensor(leaf):
                catalog.tensors[name] = _tensor_entry(name, leaf, path)
            else:
                catalog.objects[name] = leaf
        if flat.containers:
            catalog.attrs[CONTAINERS_ATTR] = flat.containers
        return catalog

    def writer(self, dst: Path, **options: Any) -> TorchSaveWriter:
        return TorchSaveWriter(dst)


def embed_tensors(value: Any, records: dict[str, Segment]) -> Any:
    """``value`` with every in-memory tensor (objects read from DCP byte items may hold
    some) replaced by a storage record of its bytes, as torch.save would store it."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        key = str(len(records))
        records[key] = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return PieceRef(key, t.dtype, tuple(t.shape))
    if isinstance(value, dict):
        return type(value)((k, embed_tensors(v, records)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(embed_tensors(v, records) for v in value)
    return value


class TorchSaveWriter:
    """One torch.save archive holding every tensor whole, nested as the source was."""

    output_is_dir = False

    def __init__(self, dst: Path) -> None:
        stem = Path(dst).stem
        self.archive = stem if _ARCHIVE_NAME.fullmatch(stem) else "archive"  # torch names it after the file

    def layout(self, target: Target) -> list[FileLayout]:
        records: dict[str, Segment] = {}
        leaves: dict[str, Any] = {}
        for t in target.tensors.values():
            if len(t.boxes) != 1 or t.boxes[0] != full_box(t.shape):
                raise UsageError(
                    f"torch files hold whole tensors; {t.name!r} is laid out as {len(t.boxes)} boxes "
                    "(a mesh layout): write dcp for sharded output (per-rank torch files come later)"
                )
            key = str(len(records))
            records[key] = Piece(t.name, t.boxes[0], t.dtype)
            leaves[t.name] = PieceRef(key, t.dtype, t.shape)
        for name, value in target.objects.items():
            leaves[name] = embed_tensors(value, records)
        # Keep the source's key order where it is known (a model's state_dict order).
        rank = {name: i for i, name in enumerate(target.paths)}
        order = sorted(leaves, key=lambda n: rank.get(n, len(rank)))
        tree = build_tree(((target.nested_path(n), leaves[n]) for n in order), target.attrs.get(CONTAINERS_ATTR))
        return [FileLayout("", torch_save_segments(tree, records, archive=self.archive))]  # type: ignore[arg-type]

    def finish(self, staging: Path, target: Target, files: list[FileLayout]) -> None:
        """Nothing comes last: the archive is complete once its segments are written."""

    def notices(self, target: Target) -> list[str]:
        return []

