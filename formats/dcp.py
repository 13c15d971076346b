"""torch.distributed.checkpoint directories: ``.metadata`` plus ``__{rank}_{n}.distcp`` files.

Each stored chunk is a blob inside a ``.distcp`` file: a torch.save zip by default (the payload
record is raw bytes we can read or kernel-copy directly), or raw bytes when DCP was told to
serialize that way. We write the default form, so torch's own ``dcp.load`` and
``dcp_to_torch_save`` read our output; ``.metadata`` is written last, which is what makes a
DCP folder look complete.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from reshard.boxes import Box
from reshard.catalog import Catalog, Chunk, Target, TensorEntry
from reshard.errors import CorruptCheckpointError, UnsupportedFormatError
from reshard.formats.dcp_metadata import StorageRecord, load_dcp_index
from reshard.formats.dcp_metadata_write import ChunkRecord, TensorRecord, metadata_bytes
from reshard.formats.pieces import FileLayout, Piece
from reshard.formats.torch_zip import load_object_blob, read_torch_zip
from reshard.formats.torch_zip_write import PieceRef, torch_save_segments
from reshard.regions import StoredRegion, read_exact

__all__ = ["DCPFormat", "DCPWriter"]


def _chunk_region(root: Path, name: str, box: Box, dtype: torch.dtype, rec: StorageRecord) -> StoredRegion:
    path = root / rec.relpath
    where = f"{path}: chunk {box.offsets} of {name!r}"
    if rec.transforms:
        raise UnsupportedFormatError(f"{where} is stored with transforms {rec.transforms} (compressed DCP)")
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: data file named in .metadata is missing") from None
    try:
        size = os.fstat(fd).st_size
        if rec.offset + rec.length > size:
            raise CorruptCheckpointError(
                f"{path}: {name!r} needs bytes up to {rec.offset + rec.length}, file has {size} (truncated?)"
            )
        magic = bytes(read_exact(fd, min(4, rec.length), rec.offset, path))
    finally:
        os.close(fd)
    if magic == b"PK\x03\x04":
        region = read_torch_zip(path, rec.offset, rec.length)
        if not isinstance(region, StoredRegion):
            raise CorruptCheckpointError(f"{where} holds {type(region).__name__}, not a tensor")
        if region.shape != box.sizes or region.dtype != dtype:
            raise CorruptCheckpointError(
                f"{where} stores {region.dtype} {list(region.shape)}, metadata says {dtype} {list(box.sizes)}"
            )
        return region
    if rec.length != box.numel * dtype.itemsize:
        raise CorruptCheckpointError(f"{where} holds {rec.length} bytes, expected {box.numel * dtype.itemsize}")
    return StoredRegion(path, rec.offset, dtype, box.sizes)


class DCPFormat:
    name = "dcp"

    def detect(self, path: Path) -> bool:
        return path.is_dir() and (path / ".metadata").is_file()

    def read(self, path: Path) -> Catalog:
        index = load_dcp_index(path)
        catalog = Catalog(format=self.name, path=path, paths=index.paths)
        for name, (shape, dtype, chunks) in index.tensors.items():
            entry = TensorEntry(name, shape, dtype)
            for box, rec in chunks:
                if box.numel == 0:
                    continue  # empty shards (more ranks than rows) hold no bytes
                entry.chunks.append(Chunk(box, _chunk_region(path, name, box, dtype, rec)))
            catalog.tensors[name] = entry
        for name, rec in index.objects.items():
            if rec.transforms:
                raise UnsupportedFormatError(f"{path / rec.relpath}: object {name!r} is stored with transforms")
            catalog.objects[name] = load_object_blob(path / rec.relpath, rec.offset, rec.length, lambda r: r.read_all())
        ranks = {int(r.relpath.split("_")[2]) for _, (_, _, cs) in index.tensors.items() for _, r in cs
                 if r.relpath.startswith("__") and r.relpath.count("_") >= 3 and r.relpath.split("_")[2].isdigit()}
        if ranks:
            catalog.attrs["source_world_size"] = max(ranks) + 1
        return catalog

    def writer(self, dst: Path, **options: Any) -> DCPWriter:
        return DCPWriter()


class DCPWriter:
    """One ``__{rank}_0.distcp`` per target rank holding the boxes the target assigns to that
    rank; objects in rank 0's file."""

    output_is_dir = True

    def __init__(self) -> None:
        self._records: dict[tuple[str, tuple[int, ...]], tuple[str, int, int]] = {}
        self._blobs: dict[tuple[torch.dtype, tuple[int, ...]], tuple[list, int]] = {}

    def layout(self, target: Target) -> list[FileLayout]:
        files = [FileLayout(f"__{r}_0.distcp") for r in range(target.world_size)]
        sizes = [0] * target.world_size
        self._records.clear()

        def add(rank: int, key: tuple[str, tuple[int, ...]], segments: list) -> None:
            length = sum(s.nbytes if isinstance(s, Piece) else len(s) for s in segments)
            self._records[key] = (files[rank].relpath, sizes[rank], length)
            files[rank].segments.extend(segments)
            sizes[rank] += length

        for t in target.tensors.values():
            for box, rank in zip(t.boxes, t.ranks):
                add(rank, (t.name, box.offsets), self._blob(Piece(t.name, box, t.dtype)))
        for name, value in target.objects.items():
            buf = io.BytesIO()
            torch.save(value, buf)  # our own in-memory value, not user input
            add(0, (name, ()), [buf.getvalue()])
        # A rank that stores nothing (its shards are replicas kept by others) gets no file.
        return [f for i, f in enumerate(files) if f.segments or i == 0]

    def _blob(self, piece: Piece) -> list:
        """The torch.save archive around one chunk. Its header bytes depend only on the
        chunk's dtype and shape (offsets inside a blob are blob-relative), and a mesh layout
        has thousands of chunks of a few shapes: build each kind once, then swap the piece in."""
        key = (piece.dtype, piece.box.sizes)
        if key not in self._blobs:
            segments = torch_save_segments(PieceRef("0", piece.dtype, piece.box.sizes), {"0": piece})
            self._blobs[key] = (segments, next(i for i, s in enumerate(segments) if s is piece))
            return segments
        segments, at = self._blobs[key]
        return [*segments[:at], piece, *segments[at + 1:]]

    def finish(self, staging: Path, target: Target, files: list[FileLayout]) -> None:
        tensors = {}
        for t in target.tensors.values():
            chunks = tuple(ChunkRecord(b.offsets, b.sizes, *self._records[(t.name, b.offsets)]) for b in t.boxes)
            tensors[t.name] = TensorRecord(t.dtype, t.shape, chunks)
        objects = {name: self._records[(name, ())] for name in target.objects}
        planner_data = {name: target.nested_path(name) for name in (*tensors, *objects)}
        (staging / ".metadata").write_bytes(metadata_bytes(tensors, objects, planner_data))

    def notices(self, target: Target) -> list[str]:
        return []
