"""The files of a torch_checkpointing folder: which file holds each item of each rank, and what one
rank's file holds.

Every rank writes each item of a save to a file of its own: ``<item>_<rank>.pt`` (``torch.save``
of that rank's value, DTensors inside) unless the item's ``LayoutInfo`` names another file and
serialization (``model_{rank}.safetensors``: the rank's local tensors, keyed by their nested path
joined with dots). ``metadata.pkl`` records the layouts of the items saved with a resharder; the
other items are found by the default name alone. A file that neither accounts for is refused:
reshard cannot tell what it holds, and leaving it out would lose it silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.formats.safetensors.header import read_header
from reshard.formats.torch.file import read_torch_file
from reshard.formats.torch.save import flatten_tree
from reshard.formats.torch.zip import DTensorRef
from reshard.formats.torch_checkpointing.metadata import METADATA_FILE, ItemMetadata, joined

from reshard.core.catalog import NestedPath
from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError
from reshard.core.regions import StoredRegion
from reshard.safe_pickle.unpickler import Unpickled

__all__ = ["RankFile", "item_files", "read_torch_rank", "read_safetensors_rank", "is_tensor"]

# torch_checkpointing's default file of an item (default_torch_layout_info): item keys are
# letters, digits, hyphens and underscores; the rank is written as str(rank).
_ITEM_FILE = re.compile(r"([A-Za-z0-9_-]+)_(0|[1-9][0-9]*)\.pt")


@dataclass
class RankFile:
    """What one rank saved of one item: leaves by their nested path in the catalog (the item's
    key first), in file order."""

    rank: int
    path: Path
    leaves: dict[NestedPath, Any] = field(default_factory=dict)
    containers: dict[NestedPath, str] = field(default_factory=dict)


def is_tensor(leaf: Any) -> bool:
    return isinstance(leaf, (StoredRegion, DTensorRef))


def item_files(folder: Path, claimed: set[str]) -> dict[str, dict[int, Path]]:
    """The files ``<item>_<rank>.pt`` of the items without a layout in ``metadata.pkl``, by item
    and rank. ``claimed``: the files the layouts name (relative paths). Any other entry of the
    folder (hidden names aside) is refused by name."""
    claimed_dirs = {Path(c).parts[0] for c in claimed if len(Path(c).parts) > 1}
    found: dict[str, dict[int, Path]] = {}
    for p in sorted(folder.iterdir()):
        if p.name.startswith(".") or p.name == METADATA_FILE or p.name in claimed:
            continue
        if p.is_dir() and p.name in claimed_dirs:
            continue
        m = _ITEM_FILE.fullmatch(p.name)
        if m is None or not p.is_file():
            raise UnsupportedFormatError(
                f"{p}: not a file of the checkpoint's items (metadata.pkl names no such file, and it is not an item's "
                "default <item>_<rank>.pt), so reshard cannot tell what it holds; move it out of the folder")
        found.setdefault(m[1], {})[int(m[2])] = p
    return found


def read_torch_rank(item: str, rank: int, path: Path) -> RankFile:
    """A rank's ``torch.save`` of item ``item``, read through the allow-list (objects that name a
    global nobody allowed are refused when asked for), its leaves under the item's key."""
    if not path.is_file():
        raise CorruptCheckpointError(f"{path}: missing: rank {rank}'s file of item {item!r}")
    tree = read_torch_file(path)
    flat = flatten_tree(Unpickled({item: tree.value}, tree.refused), str(path))
    return RankFile(rank, path, {nested: leaf for nested, leaf in flat.leaves.values()}, flat.containers)


def read_safetensors_rank(item: str, rank: int, path: Path, meta: ItemMetadata) -> RankFile:
    """A rank's safetensors file of item ``item``: each tensor found under the key its nested
    path makes (``SafetensorsSerialization`` joins the path with dots); every key must be one of
    the paths ``metadata.pkl`` gives this rank."""
    if not path.is_file():
        raise CorruptCheckpointError(f"{path}: missing: rank {rank}'s file of item {item!r}")
    header = read_header(path)
    keys: dict[str, NestedPath] = {}
    for nested, groups in meta.paths.items():
        if any(rank in g.ranks for g in groups):
            other = keys.setdefault(joined(nested), nested)
            if other != nested:
                raise CorruptCheckpointError(f"{path}: the paths {list(other)} and {list(nested)} of item {item!r} "
                                             f"both make the safetensors key {joined(nested)!r}")
    out = RankFile(rank, path)
    for t in header.tensors:
        found = keys.get(t.name)
        if found is None:
            raise CorruptCheckpointError(f"{path}: holds {t.name!r}, which metadata.pkl does not give rank {rank} "
                                         f"of item {item!r}")
        out.leaves[(item,) + found] = StoredRegion(path, header.data_start + t.begin, t.dtype, t.shape)
    return out
