"""What each record of a DCP folder's ``.distcp`` files holds, checked before any is read.

``.metadata`` gives every tensor chunk and every object a record: (file, offset, length) and
the transforms applied. What lies there depends on how torch serialized the checkpoint:

- a torch.save zip archive, exactly the record (the default ``SerializationFormat.TORCH_SAVE``);
- one zstd frame holding such an archive (``_extensions=[ZStandard()]``: ``stream.zstd/1``);
- for tensors with ``SerializationFormat.SAFETENSORS``, the start of the safetensors blob that
  holds every tensor of the file (see ``dcp.safetensors``): those records share one offset.

Anything else is refused, not guessed at. In each file the records (a blob counted as one,
header and data) must not share a byte, and a record must not run past the end of its file
(truncation): a record inside another, or inside a blob's header, would hand out the wrong
bytes under a right-looking name. Files no record names (a ``thread_count`` writer leaves
empty ones) are not opened.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
from reshard.formats.dcp.metadata import DCPIndex, StorageRecord
from reshard.formats.dcp.safetensors import BlobChunk, read_blob
from reshard.formats.dcp.zstd import DESCRIPTOR, content_size, require_zstandard

from reshard.core.boxes import Box
from reshard.core.dtypes import DType
from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError
from reshard.core.regions import StoredRegion, read_exact
from reshard.core.storage import Handle, close, handle_size, open_read

__all__ = ["ZIP", "ZSTD", "BLOB", "Item", "Placed", "place_records", "sniff_record", "RecordColumns"]

ZIP, ZSTD, BLOB = "torch.save archive", "zstd frame", "safetensors blob"
_SNIFF = 18  # a zip signature, a safetensors length and "{", or a zstd frame header


@dataclass(frozen=True)
class Item:
    """One record ``.metadata`` names: a tensor chunk (``box``, ``dtype``) or an object."""

    name: str
    rec: StorageRecord
    box: Box | None = None
    dtype: DType | None = None

    def describe(self) -> str:
        if self.box is None:
            return f"object {self.name!r}"
        return f"{self.name!r}" + (f" chunk {self.box.offsets}" if self.box.offsets else "")


@dataclass(frozen=True)
class Placed:
    kind: str  # ZIP, ZSTD or BLOB
    region: StoredRegion | None = None  # BLOB: where the chunk's elements are


@dataclass(frozen=True)
class _Extent:
    start: int
    end: int
    what: str
    header_end: int | None = None  # a blob: where its header ends


def place_records(root: Path, items: list[Item]) -> dict[Item, Placed]:
    """What each item's record holds; raises on the first record that is truncated, of an
    unknown kind, or shares bytes with another."""
    by_file: dict[str, list[Item]] = defaultdict(list)
    for it in items:
        by_file[it.rec.relpath].append(it)
    placed: dict[Item, Placed] = {}
    for relpath, its in by_file.items():
        placed.update(_place_file(root / relpath, its))
    return placed


def _place_file(path: Path, items: list[Item]) -> dict[Item, Placed]:
    try:
        fd = open_read(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: data file named in .metadata is missing") from None
    try:
        size = handle_size(fd)
        kinds = {it: _kind(fd, size, path, it) for it in items}
    finally:
        close(fd)
    placed: dict[Item, Placed] = {}
    extents: list[_Extent] = []
    blobs: dict[int, list[Item]] = defaultdict(list)
    for it, kind in kinds.items():
        if kind == BLOB:
            blobs[it.rec.offset].append(it)
        else:
            placed[it] = Placed(kind)
            extents.append(_Extent(it.rec.offset, it.rec.offset + it.rec.length, f"the {kind} of {it.describe()}"))
    for start, group in blobs.items():
        # a blob holds tensor chunks only (_kind): each item has its box and dtype
        blob = read_blob(path, start, [BlobChunk(it.name, cast(Box, it.box), cast(DType, it.dtype), it.rec.length)
                                       for it in group])
        placed.update((it, Placed(BLOB, region)) for it, region in zip(group, blob.regions))
        extents.append(_Extent(start, blob.end, f"the safetensors blob at byte {start}", blob.header_end))
    _check_disjoint(path, extents)
    return placed


def _kind(fd: Handle, size: int, path: Path, it: Item) -> str:
    rec = it.rec
    truncated = CorruptCheckpointError(
        f"{path}: {it.describe()} needs bytes up to {rec.offset + rec.length}, file has {size} (truncated?)"
    )
    if rec.offset > size:
        raise truncated
    head = bytes(read_exact(fd, min(_SNIFF, size - rec.offset), rec.offset, path))
    where = f"{path}: {it.describe()} at byte {rec.offset}"
    if rec.transforms:
        if list(rec.transforms) != [DESCRIPTOR]:
            raise UnsupportedFormatError(
                f"{where} is stored through transforms {list(rec.transforms)}; reshard reads only [{DESCRIPTOR!r}]"
            )
        if content_size(head, where) == 0 and it.box is not None:
            raise UnsupportedFormatError(
                f"{where} is an empty zstd frame: torch wrote this checkpoint with ZStandard and "
                "SerializationFormat.SAFETENSORS together, which leaves tensors where .metadata cannot find them; "
                "re-save it with one of the two"
            )
    if rec.offset + rec.length > size:
        raise truncated
    if rec.transforms:
        require_zstandard(f"{path}")
        return ZSTD
    if head[:4] == b"PK\x03\x04":
        return ZIP
    if it.box is not None and head[8:9] == b"{":
        return BLOB
    raise CorruptCheckpointError(f"{where} is neither a torch.save archive nor a safetensors header")


def sniff_record(path: Path, it: Item, *, allow_blob: bool = True) -> str:
    """What one record holds (``_kind``), read when its bytes are first wanted."""
    try:
        fd = open_read(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: data file named in .metadata is missing") from None
    try:
        kind = _kind(fd, handle_size(fd), path, it)
    finally:
        close(fd)
    if kind == BLOB and not allow_blob:
        raise CorruptCheckpointError(f"{path}: {it.describe()} at byte {it.rec.offset} is a safetensors blob among "
                                     "torch.save archives, a layout torch does not write")
    return kind


class RecordColumns:
    """Every record of a DCP folder in a few arrays, sorted by (file, start): what the checks
    that need no reading (truncation, overlap, shared offsets) work on, in array operations
    over all tensors at once, not per tensor or per chunk."""

    def __init__(self, index: DCPIndex) -> None:
        self.index = index
        names = list(index.tensors)
        tables = [index.table(n) for n in names]
        ids = {rel: i for i, rel in enumerate(index.files)}
        obj_names = list(index.objects)
        for n in obj_names:
            rel = index.objects[n].relpath
            if rel not in ids:
                ids[rel] = len(index.files)
                index.files.append(rel)
        self.names, self.tables, self.objects = names, tables, obj_names
        counts = [len(t) for t in tables]
        obj = [index.objects[n] for n in obj_names]
        file = np.concatenate([t.file.astype(np.int64) for t in tables] + [np.array([ids[r.relpath] for r in obj],
                                                                                    dtype=np.int64)])
        start = np.concatenate([t.start for t in tables] + [np.array([r.offset for r in obj], dtype=np.int64)])
        length = np.concatenate([t.length for t in tables] + [np.array([r.length for r in obj], dtype=np.int64)])
        # owner >= 0: the tensor's number; owner < 0: object -1 - owner
        owner = np.concatenate([np.repeat(np.arange(len(tables)), counts), -1 - np.arange(len(obj))]).astype(np.int64)
        row = np.concatenate([np.arange(c) for c in counts] + [np.zeros(len(obj), dtype=np.int64)]).astype(np.int64)
        order = np.lexsort((start, file))
        self.file, self.start, self.end = file[order], start[order], start[order] + length[order]
        self.owner, self.row = owner[order], row[order]

    def label(self, k: int) -> str:
        owner, row = int(self.owner[k]), int(self.row[k])
        if owner < 0:
            name = self.objects[-1 - owner]
            return f"the {ZSTD if self.index.objects[name].transforms else ZIP} of object {name!r}"
        t = self.tables[owner]
        return f"the {ZSTD if row in t.transforms else ZIP} of {self.names[owner]!r} chunk {tuple(t.offsets[row].tolist())}"

    def _keyed(self) -> tuple[np.ndarray, np.ndarray]:
        """Starts and ends shifted by file, so one running maximum spans every file."""
        span = int(self.end.max(initial=0)) + 1
        return self.start + self.file * span, self.end + self.file * span

    def shared_starts(self) -> bool:
        """Whether two records of one file start at one byte (SerializationFormat.SAFETENSORS)."""
        keyed, _ = self._keyed()
        return bool(len(keyed) > 1 and (keyed[1:] == keyed[:-1]).any())

    def first_tensor_record(self) -> dict[int, int]:
        """file -> position of its first tensor record (by offset)."""
        tensor_records = np.flatnonzero(self.owner >= 0)
        files, first = np.unique(self.file[tensor_records], return_index=True)  # records are sorted by (file, start)
        return dict(zip(files.tolist(), tensor_records[first].tolist()))

    def item(self, k: int) -> Item:
        owner, row = int(self.owner[k]), int(self.row[k])
        if owner < 0:
            name = self.objects[-1 - owner]
            return Item(name, self.index.objects[name])
        t = self.tables[owner]
        return Item(self.names[owner], t.record(row), t.box(row), self.index.tensors[self.names[owner]][1])

    def check(self, root: Path) -> None:
        """Without reading any record: each file exists, no record runs past its end, and no two
        records of a file share a byte (so no name can be handed another one's bytes)."""
        if not len(self.file):
            return
        bounds = np.flatnonzero(np.r_[True, self.file[1:] != self.file[:-1]])
        last = np.r_[bounds[1:], len(self.file)] - 1
        reach = np.maximum.reduceat(self.end, bounds)
        for f, b, e, top in zip(self.file[bounds].tolist(), bounds.tolist(), last.tolist(), reach.tolist()):
            path = root / self.index.files[f]
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{path}: data file named in .metadata is missing") from None
            if top > size:
                k = b + int(np.argmax(self.end[b:e + 1]))
                raise CorruptCheckpointError(f"{path}: {self.label(k)} needs bytes up to {int(self.end[k])}, file has "
                                             f"{size} (truncated?)")
        keyed_start, keyed_end = self._keyed()
        running = np.maximum.accumulate(keyed_end)
        clash = np.flatnonzero(keyed_start[1:] < running[:-1])
        if len(clash):
            b = int(clash[0]) + 1
            a = int(np.argmax(keyed_end[:b] == running[b - 1]))
            raise CorruptCheckpointError(f"{root / self.index.files[int(self.file[b])]}: {self.label(b)} (bytes "
                                         f"{int(self.start[b])}..{int(self.end[b])}) overlaps {self.label(a)} (bytes "
                                         f"{int(self.start[a])}..{int(self.end[a])})")


def _check_disjoint(path: Path, extents: list[_Extent]) -> None:
    reach: _Extent | None = None  # of the extents so far, the one that ends last
    for e in sorted((e for e in extents if e.end > e.start), key=lambda e: (e.start, e.end)):
        if reach is not None and e.start < reach.end:
            blob, other = (reach, e) if reach.header_end is not None else (e, reach)
            if blob.header_end is not None and other.start < blob.header_end and other.end > blob.start:
                raise CorruptCheckpointError(
                    f"{path}: {other.what} (bytes {other.start}..{other.end}) overlaps the safetensors header "
                    f"at byte {blob.start} (bytes {blob.start}..{blob.header_end})"
                )
            raise CorruptCheckpointError(
                f"{path}: {e.what} (bytes {e.start}..{e.end}) overlaps {reach.what} (bytes {reach.start}..{reach.end})"
            )
        if reach is None or e.end > reach.end:
            reach = e
