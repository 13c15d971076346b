"""Tensors of DCP checkpoints saved with ``serialization_format=SerializationFormat.SAFETENSORS``.

Such a ``.distcp`` file holds the rank's non-tensor values first, as torch.save archives,
then one safetensors blob with every tensor of the file, keyed by flat name, whose
``__metadata__["DCP_SHARDING_INFO"]`` says which chunk (``saved_offsets``) each one is.
``.metadata`` gives every tensor of the file the same offset, the blob's start, and the
chunk's byte count as its length: ``[offset, offset + length)`` is the blob's header, not
the tensor. torch's own readers unpickle those bytes and fail; a reader that took them as
raw elements would convert garbage. Here the header at that offset is parsed and validated
like any safetensors file (its data must end the file, as torch appends it last), and each
chunk is found by name and checked against ``saved_offsets``, dtype and shape.

The blob is keyed by name, so a rank that held two chunks of one tensor (a ShardedTensor with
two local shards) kept only the last: ``.metadata`` still lists both. That checkpoint lost
data when it was saved, and is refused naming the chunk that is gone.

HuggingFaceStorageWriter's shard files (``save_distributed=True``) are whole safetensors
files with the same ``DCP_SHARDING_INFO``: one name in several files, each a different chunk.
The safetensors reader places them with ``shard_boxes`` and ``assemble``: the global shape is
the elementwise largest chunk end (nothing else records it), and the chunks must tile it
exactly, which also catches the files ``save_distributed=False`` on several ranks overwrote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from reshard.formats.safetensors.header import Header, read_header

from reshard.core.boxes import Box, full_box, tiles_exactly
from reshard.core.catalog import Chunk, TensorEntry
from reshard.core.dtypes import DType
from reshard.core.errors import CorruptCheckpointError
from reshard.core.regions import StoredRegion

__all__ = ["SHARDING_KEY", "DCP_KEYS", "saved_offsets", "BlobChunk", "Blob", "read_blob", "shard_boxes", "assemble"]

SHARDING_KEY = "DCP_SHARDING_INFO"
# What torch's writers put in __metadata__ about the file itself; not worth carrying into
# another checkpoint (DCP_SHARDING_INFO would misplace every tensor of a consolidated file).
DCP_KEYS = (SHARDING_KEY, "DCP_VERSION")


def saved_offsets(where: str, metadata: dict[str, str]) -> dict[str, tuple[int, ...]] | None:
    """name -> the global offsets of the chunk stored under it, from ``DCP_SHARDING_INFO``
    (``{"name": {"saved_offsets": [...]}}`` as a JSON string); None when there is none."""
    raw = metadata.get(SHARDING_KEY)
    if raw is None:
        return None
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: __metadata__ {SHARDING_KEY} is not valid JSON ({e})") from None
    if not isinstance(info, dict):
        raise CorruptCheckpointError(f"{where}: __metadata__ {SHARDING_KEY} is not an object keyed by name")
    out = {}
    for name, entry in info.items():
        offsets = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and all(type(o) is int and o >= 0 for o in offsets)):
            raise CorruptCheckpointError(f"{where}: {SHARDING_KEY} entry {name!r} has no list of saved_offsets")
        out[name] = tuple(offsets)
    return out


@dataclass(frozen=True)
class BlobChunk:
    """A chunk ``.metadata`` places in a blob, with the length its record gives."""

    name: str
    box: Box
    dtype: DType
    length: int


@dataclass(frozen=True)
class Blob:
    header_end: int  # file offset where the tensor data begins
    end: int  # file offset just past the blob (the end of the file)
    regions: list[StoredRegion]  # one per chunk asked for, in that order


def read_blob(path: Path, start: int, chunks: list[BlobChunk]) -> Blob:
    """The blob at byte ``start`` of ``path``, with a region for each of ``chunks``; every
    chunk must be there and every tensor there must be one of ``chunks``."""
    header = read_header(path, start)
    where = f"{path} (safetensors data at byte {start})"
    offsets = saved_offsets(where, header.metadata)
    if offsets is None:
        raise CorruptCheckpointError(f"{where}: no {SHARDING_KEY} in __metadata__, so which chunk each tensor is is unknown")
    stored = {t.name: t for t in header.tensors}
    regions, claimed = [], set()
    for c in chunks:
        t, saved = stored.get(c.name), offsets.get(c.name)
        if t is None:
            raise CorruptCheckpointError(f"{where}: .metadata places chunk {c.box.offsets} of {c.name!r} here, but it holds no "
                                         f"{c.name!r}")
        if saved is None:
            raise CorruptCheckpointError(f"{where}: {SHARDING_KEY} gives no saved_offsets for {c.name!r}")
        if saved != c.box.offsets or c.name in claimed:
            raise CorruptCheckpointError(
                f"{where}: .metadata places chunk {c.box.offsets} of {c.name!r} here, but only its chunk at "
                f"{saved} is stored; torch's SAFETENSORS serialization keeps one chunk per name and file, so the "
                "others were lost when this checkpoint was saved"
            )
        if t.dtype != c.dtype or t.shape != c.box.sizes:
            raise CorruptCheckpointError(
                f"{where}: {c.name!r} is stored as {t.dtype} {list(t.shape)}, .metadata says {c.dtype} {list(c.box.sizes)}"
            )
        if c.length != t.end - t.begin:
            raise CorruptCheckpointError(f"{where}: .metadata gives {c.name!r} {c.length} bytes, the blob {t.end - t.begin}")
        claimed.add(c.name)
        regions.append(StoredRegion(path, header.data_start + t.begin, t.dtype, t.shape))
    # .metadata's empty chunks (more ranks than rows) are not asked for; they hold no bytes.
    extra = sorted(n for n, t in stored.items() if n not in claimed and t.end > t.begin)
    if extra:
        raise CorruptCheckpointError(f"{where}: holds tensor {extra[0]!r}, which .metadata does not place here")
    end = header.data_start + max((t.end for t in header.tensors), default=0)
    return Blob(header.data_start, end, regions)


def shard_boxes(file: Path, header: Header) -> dict[str, Box] | None:
    """Each tensor's box in its global tensor, from the file's ``DCP_SHARDING_INFO``; None
    for a file without it (every tensor whole)."""
    offsets = saved_offsets(f"{file}", header.metadata)
    if offsets is None:
        return None
    boxes = {}
    for t in header.tensors:
        at = offsets.pop(t.name, None)
        if at is None or len(at) != len(t.shape):
            raise CorruptCheckpointError(f"{file}: {SHARDING_KEY} gives {at} as the offsets of {t.name!r}, of shape "
                                         f"{list(t.shape)}")
        boxes[t.name] = Box(at, t.shape)
    if offsets:
        raise CorruptCheckpointError(f"{file}: {SHARDING_KEY} names {next(iter(offsets))!r}, which the file does not hold")
    return boxes


def assemble(name: str, parts: list[tuple[Path, StoredRegion, Box | None]]) -> TensorEntry:
    """One tensor from its parts: (file, region, box from ``shard_boxes`` or None when whole)."""
    (file0, region0, box0), *rest = parts
    if box0 is None and not rest:
        return TensorEntry(name, region0.shape, region0.dtype, [Chunk(full_box(region0.shape), region0)])
    for file, region, box in rest:
        if box is None or box0 is None:
            raise CorruptCheckpointError(f"{file}: tensor {name!r} is also stored in {file0}")
        if region.dtype != region0.dtype:
            raise CorruptCheckpointError(f"{file}: {name!r} is {region.dtype} here but {region0.dtype} in {file0.name}")
    boxes = [box for _, _, box in parts if box is not None]  # every part's (checked above)
    shape = tuple(map(max, zip(*(b.ends for b in boxes))))
    problem = tiles_exactly(shape, boxes)
    if problem:
        raise CorruptCheckpointError(
            f"{file0}: {name!r}, placed by {SHARDING_KEY} in {len(parts)} file(s): {problem}; "
            "a shard file is missing, duplicated or was overwritten"
        )
    return TensorEntry(name, shape, region0.dtype, [Chunk(box, region) for box, (_, region, _) in zip(boxes, parts)])
