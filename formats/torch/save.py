"""Whole state dicts saved with ``torch.save`` (``.pt``, ``.pth``, HF ``pytorch_model.bin``).

Reading never runs ``torch.load``: ``read_torch_file`` replays the pickle (zip or pre-1.6
legacy layout) with an allow-list and hands back every tensor as a ``StoredRegion`` in the
file, so a 100 GB ``.pt`` is cataloged without reading a tensor byte. The object tree is
flattened the way DCP flattens state dicts (``{"model": {"a.b": t}}`` is ``model.a.b``; list
items by index), and every leaf's nested path is kept so that any writer can rebuild the same
nesting. Mappings other than plain dicts (a Counter, a defaultdict, an OrderedDict of
settings) stay whole unless they hold tensors, so they come back as their own type.

The whole pickle is one stream, so objects cannot be unpickled one by one; instead a global
nobody allowed becomes a placeholder, and each object that holds one becomes an entry of a
lazy ``ObjectTable`` that raises the one-line refusal when asked for (``inspect`` and full
conversions still fail; ``--only model`` does not touch it). Tensors inside such an object
are not tensors of the catalog. Objects that keep tensors inside something other than dicts
and lists (a deque, a stand-in's arguments) read those tensors when they are asked for.

DCP-style paths cannot tell an int-keyed dict (a plain optimizer's ``state``) from a list,
nor a tuple from a list: those containers are listed in ``catalog.facts.containers``,
so torch -> torch stays exact while paths from DCP rebuild as lists, as DCP's own
``dcp_to_torch_save`` does.

Writing emits the archive ``torch.save`` would (``torch_save_segments``), payloads 64-byte
aligned so ``mmap=True`` works. Tensors and plain values name only what
``torch.load(weights_only=True)`` accepts; other objects keep the types they were read as
(numpy arrays, a Namespace, stand-ins under their own names), so an output loads wherever its
input loaded.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.formats.torch.file import read_torch_file
from reshard.formats.torch.legacy import is_legacy
from reshard.formats.torch.zip import DTensorRef, Record, materialize
from reshard.formats.torch.zip_write import PieceRef, embed_tensors, torch_save_segments

from reshard.core.boxes import full_box
from reshard.core.catalog import Catalog, Chunk, NestedPath, ObjectTable, TensorEntry
from reshard.core.errors import UnsafeCheckpointError, UnsupportedFormatError, UsageError
from reshard.core.pieces import OutputFile, Piece, Segment
from reshard.core.regions import StoredRegion
from reshard.core.storage import as_location
from reshard.core.target import Target
from reshard.pipeline.options import WriterOptions
from reshard.safe_pickle.inert import is_refused, refused_name
from reshard.safe_pickle.unpickler import Unpickled, refusal_message
from reshard.safe_pickle.walk import find_in

__all__ = [
    "TORCH_SUFFIXES",
    "FlatTree",
    "TorchSaveFormat",
    "TorchSaveWriter",
    "build_tree",
    "flatten_tree",
    "RefusedLeaf",
    "OnDisk",
    "leaf_loader",
    "is_legacy_file",
    "add_leaves",
    "embed_tensors",
]

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
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
    (DCP would pickle those whole, we keep their tensors readable piece by piece), except
    that a mapping other than a plain dict is kept whole (with its type) unless it holds
    tensors."""
    if isinstance(value, Mapping):
        if type(value) is not dict and not _holds_tensor(value):
            return False
        return bool(value) and all(type(k) in (str, int) for k in value)
    if isinstance(value, list):
        return any(_is_tensor(v) or isinstance(v, Mapping) or (isinstance(v, (list, tuple)) and _is_branch(v))
                   for v in value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return _holds_tensor(value)
    return False


@dataclass(frozen=True)
class RefusedLeaf:
    """A leaf that holds a global nobody allowed (``refused``, as module.Name)."""

    refused: str


@dataclass(frozen=True)
class OnDisk:
    """A leaf object with tensors still in the file inside it (not in dicts or lists)."""

    value: Any


@dataclass
class FlatTree:
    """A torch.save object tree flattened: flat name -> (nested path, leaf), in file order.
    Leaves are tensors (``StoredRegion``, ``DTensorRef``), plain values, ``RefusedLeaf`` or
    ``OnDisk``; ``leaf_loader`` turns the last three into object loaders."""

    leaves: dict[str, tuple[NestedPath, Any]] = field(default_factory=dict)
    containers: dict[NestedPath, str] = field(default_factory=dict)


def flatten_tree(tree: Any, where: str) -> FlatTree:
    """Flatten ``tree`` (or what ``read_torch_file`` read) as DCP names state dicts; ``where``
    names the file in errors."""
    refused: tuple[str, ...] = ()
    if isinstance(tree, Unpickled):
        tree, refused = tree.value, tree.refused
    out = FlatTree()
    if isinstance(tree, Mapping) and not tree:
        return out
    if refused and is_refused(tree):
        raise UnsafeCheckpointError(refusal_message(where, refused_name(tree), opt_in=True))
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
        if refused and (hit := find_in(leaf, is_refused)) is not None:
            out.leaves[name] = (path, RefusedLeaf(refused_name(hit)))
            continue
        if isinstance(leaf, Record) and leaf.kind == "wrapper":
            raise UnsupportedFormatError(f"{where}: {name!r} is a tensor subclass reshard cannot read")
        if not _is_tensor(leaf) and _holds_tensor(leaf):
            raise UnsupportedFormatError(
                f"{where}: {name!r} keeps tensors inside a {type(leaf).__name__} (or a dict with keys "
                "other than str/int); re-save them in dicts or lists"
            )
        if not _is_tensor(leaf) and find_in(leaf, _is_tensor) is not None:
            leaf = OnDisk(leaf)
        out.leaves[name] = (path, leaf)
    return out


def leaf_loader(leaf: Any, where: str, name: str) -> Callable[[], Any]:
    """How an object leaf is read when asked for: refused with the one-line error naming the
    file and the global, its tensors read from the file, or as it is."""
    if isinstance(leaf, RefusedLeaf):
        message = refusal_message(where, leaf.refused, opt_in=True, what=f"{name!r} ")

        def refuse() -> Any:
            raise UnsafeCheckpointError(message)

        return refuse
    if isinstance(leaf, OnDisk):
        return lambda: materialize(leaf.value, lambda r: r.read_all())
    return lambda: leaf


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


def is_legacy_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return is_legacy(f.read(16))
    except OSError:
        return False


def add_leaves(catalog: Catalog, flat: FlatTree, where: Path) -> None:
    """Put a file's leaves into ``catalog``: tensors, and objects as lazy entries."""
    objects = catalog.objects if isinstance(catalog.objects, ObjectTable) else ObjectTable()
    for name, (nested, leaf) in flat.leaves.items():
        catalog.paths[name] = nested
        if _is_tensor(leaf):
            catalog.tensors[name] = _tensor_entry(name, leaf, where)
        elif isinstance(leaf, (RefusedLeaf, OnDisk)):
            objects.set_lazy(name, leaf_loader(leaf, str(where), name))
        else:
            objects[name] = leaf
    catalog.objects = objects


class TorchSaveFormat:
    name = "torch"

    def detect(self, path: Path) -> bool:
        if not path.is_file():
            return False
        return path.suffix.lower() in TORCH_SUFFIXES or _is_torch_zip(path) or is_legacy_file(path)

    def read(self, path: Path) -> Catalog:
        """Catalog a torch.save file (zip or legacy); DTensors only when their mesh has a single rank."""
        path = as_location(path)
        flat = flatten_tree(read_torch_file(path), str(path))
        catalog = Catalog(format=self.name, path=path)
        add_leaves(catalog, flat, path)
        if flat.containers:
            catalog.facts.containers = flat.containers
        return catalog

    def writer(self, dst: Path | str, options: WriterOptions | None = None) -> TorchSaveWriter:
        return TorchSaveWriter(dst)


class TorchSaveWriter:
    """One torch.save archive holding every tensor whole, nested as the source was."""

    output_is_dir = False

    def __init__(self, dst: Path | str) -> None:
        stem = Path(dst).stem
        self.archive = stem if _ARCHIVE_NAME.fullmatch(stem) else "archive"  # torch names it after the file

    def layout(self, target: Target) -> list[OutputFile]:
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
        tree = build_tree(((target.nested_path(n), leaves[n]) for n in order), target.facts.containers)
        return [OutputFile("", torch_save_segments(tree, records, archive=self.archive))]

    def finish(self, staging: Path, target: Target, files: list[OutputFile]) -> None:
        """Nothing comes last: the archive is complete once its segments are written."""

    def notices(self, target: Target) -> list[str]:
        return []

