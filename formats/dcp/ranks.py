"""DCP folders saved with ``dcp.save(..., use_collectives=False)``: one metadata file per rank.

Without collectives no rank sees the others' plans, so there is no ``.metadata``: each rank
writes ``__{rank}.metadata`` describing only what it wrote itself, its own shards of every
sharded tensor (with the tensor's global size) and its own copy of every replicated value.
torch's single-process readers read ``__0.metadata`` alone and silently leave the other ranks'
shards unread (zeros, or uninitialised memory in ``dcp_to_torch_save``). Here every rank's file
is merged: shards are united, so the usual tiling check proves nothing is missing, and a value
several ranks wrote is kept once, the lowest rank's, with the other ranks' records beside it
(``DCPIndex.copies``) so that reading can check the copies agree. Entries that disagree about
what a name is (dtype, size, chunk extent, nesting) are refused: there is no right one to pick.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.formats.dcp.metadata import DCPIndex, StorageRecord, read_metadata_file

from reshard.core.boxes import Box
from reshard.core.catalog import ChunkData
from reshard.core.errors import CorruptCheckpointError
from reshard.core.regions import read_exact
from reshard.core.storage import close, open_read

if TYPE_CHECKING:
    import torch

__all__ = ["rank_metadata_files", "merged_rank_index", "CheckedCopies", "same_bytes"]

_RANK_METADATA = re.compile(r"__(\d+)\.metadata")
_RANK_DATA = re.compile(r"__(\d+)_\d+\.distcp")


def rank_metadata_files(root: Path) -> list[tuple[int, Path]]:
    """(rank, ``__{rank}.metadata``) for every per-rank metadata file in ``root``, by rank."""
    if not root.is_dir():
        return []
    found = ((_RANK_METADATA.fullmatch(p.name), p) for p in root.iterdir())
    return sorted((int(m.group(1)), p) for m, p in found if m and p.is_file())


def merged_rank_index(root: Path, ranks: list[tuple[int, Path]]) -> DCPIndex:
    """One index from every rank's metadata; refused when a rank's file is missing (its data
    files could not be placed) or when two ranks describe one name differently."""
    have = {r for r, _ in ranks}
    data_ranks = {int(m.group(1)) for p in root.iterdir() if (m := _RANK_DATA.fullmatch(p.name))}
    missing = sorted((set(range(max(have) + 1)) | data_ranks) - have)
    if missing:
        raise CorruptCheckpointError(
            f"{root}: has per-rank metadata (use_collectives=False) for ranks {sorted(have)} but no "
            f"__{missing[0]}.metadata; that rank's data cannot be placed"
        )
    merged = DCPIndex({}, {}, {}, {}, {})
    origin: dict[str, Path] = {}  # name -> the metadata file that first described it
    for _, path in ranks:
        _merge(merged, read_metadata_file(path, root), path, origin)
    return merged


def _conflict(path: Path, name: str, here: str, there: str, other: Path) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path}: {name!r} is {here} here but {there} in {other.name}; the ranks' metadata disagree"
    )


def _merge(into: DCPIndex, index: DCPIndex, path: Path, origin: dict[str, Path]) -> None:
    for name, (shape, dtype, chunks) in index.tensors.items():
        if name in into.objects:
            raise _conflict(path, name, "a tensor", "an object", origin[name])
        if name not in into.tensors:
            into.tensors[name] = (shape, dtype, list(chunks))
            origin[name] = path
            continue
        shape0, dtype0, have = into.tensors[name]
        assert isinstance(have, list)  # merged entries are lists (above)
        if (shape0, dtype0) != (shape, dtype):
            raise _conflict(path, name, f"{dtype} {list(shape)}", f"{dtype0} {list(shape0)}", origin[name])
        boxes = {b.offsets: b for b, _ in have}
        for box, rec in chunks:
            if box.offsets not in boxes:
                have.append((box, rec))
                boxes[box.offsets] = box
            elif boxes[box.offsets] != box:
                b0 = boxes[box.offsets]
                raise _conflict(path, name, f"a chunk {box.sizes} at {box.offsets}", f"a chunk {b0.sizes}", origin[name])
            else:
                into.copies.setdefault((name, box.offsets), []).append(rec)
    for name, rec in index.objects.items():
        if name in into.tensors:
            raise _conflict(path, name, "an object", "a tensor", origin[name])
        if name in into.objects:
            into.copies.setdefault((name, ()), []).append(rec)
        else:
            into.objects[name] = rec
            origin[name] = path
    nestings: tuple[tuple[dict, dict], ...] = ((into.paths, index.paths), (into.containers, index.containers))
    for table, what in nestings:
        for key, value in what.items():
            if key in table and table[key] != value:
                raise CorruptCheckpointError(
                    f"{path}: nests {key!r} as {value!r}, another rank's metadata as {table[key]!r}; the ranks' metadata disagree"
                )
            table[key] = value


def _bits(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


class CheckedCopies:
    """A chunk several ranks each wrote (a replicated value saved without collectives): read
    from the first copy, every other copy read too and compared bit for bit, so a value the
    ranks held differently (per-rank state under one name) is refused instead of one rank's
    copy being passed off as the value. The price is reading such chunks once per rank; no
    kernel copy. Memory: the box twice."""

    def __init__(self, copies: list[tuple[ChunkData, Path]], name: str) -> None:
        self.copies, self.name = copies, name

    def read(self, box: Box) -> torch.Tensor:
        import torch

        (first, first_path), *others = self.copies
        value = first.read(box)
        for data, path in others:
            if not torch.equal(_bits(data.read(box)), _bits(value)):
                raise CorruptCheckpointError(
                    f"{path}: {self.name!r} differs from the copy in {first_path.name}; ranks saved different "
                    "values under one name (use_collectives=False) and reshard cannot choose one"
                )
        return value


def same_bytes(root: Path, name: str, records: list[StorageRecord], load: Callable[[], Any]) -> Callable[[], Any]:
    """A loader for an object several ranks wrote: the stored records must be identical (torch
    serializes equal values to equal bytes), then the first is loaded."""

    def loader() -> Any:
        first = _record_bytes(root, records[0])
        for rec in records[1:]:
            if _record_bytes(root, rec) != first:
                raise CorruptCheckpointError(
                    f"{root / rec.relpath}: object {name!r} differs from the copy in {records[0].relpath}; ranks "
                    "saved different values under one name (use_collectives=False) and reshard cannot choose one"
                )
        return load()

    return loader


def _record_bytes(root: Path, rec: StorageRecord) -> bytes:
    fd = open_read(root / rec.relpath)
    try:
        return bytes(read_exact(fd, rec.length, rec.offset, root / rec.relpath))
    finally:
        close(fd)
