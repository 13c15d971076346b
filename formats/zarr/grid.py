"""How reshard lays tensors out as zarr arrays: chunk shapes, and each chunk file as segments.

Chunks are the unit everything else works in: one file (or object) per chunk, written by
whichever rank owns it without coordination, read partially by any reader. So the chunk shape
follows the target: with a device mesh it is the shard shape (torch.chunk semantics give a
regular grid, ``ceil(n/k)`` per sharded dim, the trailing shards smaller or empty); without one
a tensor is cut along its leading dim into chunks of about ``CHUNK_BYTES`` (small tensors are
one chunk), which also keeps every edge chunk contiguous.

An uncompressed zarr v3 chunk is the C-order elements of the full chunk shape, edge chunks
padded. Data is laid out as ``Piece``s for the engine; padding inside a chunk (edge chunks cut
in a trailing dim) is literal zero bytes, and padding at the end of a chunk is left out of the
layout: the writer extends the file to its full size at finish (a sparse zero tail, never held
in memory).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from reshard.formats.zarr.meta import ZARR_JSON, ArrayMeta

from reshard.core.boxes import Box
from reshard.core.dtypes import DType
from reshard.core.errors import UsageError
from reshard.core.pieces import Piece, Segment
from reshard.core.target import Target, TargetTensor

__all__ = ["CHUNK_BYTES", "ArrayLayout", "plan_arrays", "default_chunk_shape", "mesh_chunk_shape", "chunk_segments"]

CHUNK_BYTES = 64 << 20  # big enough for object-store throughput, small enough to decode cheaply


def default_chunk_shape(shape: tuple[int, ...], itemsize: int, target: int | None = None) -> tuple[int, ...]:
    """About ``target`` (default ``CHUNK_BYTES``) bytes per chunk, split along the leading dims
    only (so every chunk, the edge one included, is one contiguous run of the tensor);
    balanced, so the last chunk is not a sliver."""
    target = CHUNK_BYTES if target is None else target
    dims = [max(1, n) for n in shape]  # zarr wants chunk sizes >= 1, also for empty dims
    for d in range(len(dims)):
        inner = math.prod(dims[d + 1:]) * itemsize
        if inner <= target or d == len(dims) - 1:
            rows = max(1, min(dims[d], target // inner))
            rows = -(-dims[d] // -(-dims[d] // rows))
            return (1,) * d + (rows,) + tuple(dims[d + 1:])
    return ()


def mesh_chunk_shape(t: TargetTensor) -> tuple[tuple[int, ...], bool]:
    """(chunk shape, whether chunks are exactly the shards). Shards of one dim split form a
    regular grid; nested splits of one dim (two mesh dims sharding dim 0) may not, and then
    chunks are the largest boxes that tile every shard."""
    boxes = [b for b in t.boxes if b.numel]
    if not boxes:
        return default_chunk_shape(t.shape, t.dtype.itemsize), True
    chunk = tuple(max(1, max(b.sizes[d] for b in boxes)) for d in range(len(t.shape)))
    grid = math.prod(-(-n // c) for n, c in zip(t.shape, chunk))
    regular = len(boxes) == grid and all(
        o % c == 0 and s == min(c, n - o) for b in boxes for o, s, c, n in zip(b.offsets, b.sizes, chunk, t.shape))
    if regular:
        return chunk, True
    out = []
    for d, n in enumerate(t.shape):
        g = 0
        for b in boxes:
            g = math.gcd(g, b.offsets[d])
            if b.offsets[d] + b.sizes[d] != n:
                g = math.gcd(g, b.offsets[d] + b.sizes[d])
        out.append(g or max(1, n))
    return tuple(out), False


@lru_cache(maxsize=64)
def _zeros(n: int) -> bytes:
    return bytes(n)  # one shared object per length: every edge row of a tensor pads the same


def chunk_segments(name: str, dtype: DType, box: Box, chunk_shape: tuple[int, ...]) -> list[Segment]:
    """The chunk file for ``box`` (global, clipped to the array) without its zero tail."""
    sizes = box.sizes
    partial = [d for d, (s, c) in enumerate(zip(sizes, chunk_shape)) if s < c]
    if not partial or box.numel == 0:
        return [Piece(name, box, dtype)] if box.numel else []
    k = partial[-1]  # dims after k are whole, so each run over dims >= k is contiguous
    inner = math.prod(chunk_shape[k + 1:])
    segments: list[Segment] = []
    zeros = 0  # elements of padding not yet emitted
    for idx in itertools.product(*(range(c) for c in chunk_shape[:k])):
        if any(i >= s for i, s in zip(idx, sizes)):
            zeros += chunk_shape[k] * inner
            continue
        if zeros:
            segments.append(_zeros(zeros * dtype.itemsize))
        offs = tuple(o + i for o, i in zip(box.offsets, idx)) + box.offsets[k:]
        segments.append(Piece(name, Box(offs, (1,) * k + sizes[k:]), dtype))
        zeros = (chunk_shape[k] - sizes[k]) * inner
    return segments


@dataclass(frozen=True)
class ArrayLayout:
    """One tensor as a zarr array: its metadata (for chunk keys and boxes) and whether the
    chunks are exactly the target's shards."""

    name: str
    meta: ArrayMeta
    regular: bool
    placements: Any = None
    split: bool = False  # chunks cut smaller than the shards, to fit a memory cap

    def chunks(self) -> list[tuple[str, Box]]:
        """(key relative to the store root, global box) of every chunk, in C order."""
        return [(f"{self.name}/{self.meta.chunk_key(c)}", self.meta.chunk_box(c))
                for c in itertools.product(*(range(g) for g in self.meta.grid))]


def _check_name(name: str) -> None:
    """zarr node names: no '/', not empty, not only periods, not starting with '__'."""
    if not name or "/" in name or name.startswith("__") or set(name) == {"."} or name == ZARR_JSON or name.startswith("."):
        raise UsageError(f"tensor {name!r} cannot be a zarr array name; rename it with --keymap or write dcp")


def plan_arrays(target: Target, codecs: list[dict[str, Any]], chunk_bytes: int | None = None,
                cap: int | None = None) -> list[ArrayLayout]:
    """Every target tensor as an array; the same on every rank (pure function of the target).
    ``chunk_bytes`` overrides ``CHUNK_BYTES`` where no mesh fixes the chunks; ``cap`` bounds
    every chunk, shards included (``within_cap``)."""
    out = []
    for t in target.tensors.values():
        _check_name(t.name)
        if target.mesh is not None or len(t.boxes) != 1:
            chunk, regular = mesh_chunk_shape(t)
        else:
            size = chunk_bytes if cap is None else min(chunk_bytes or CHUNK_BYTES, cap)
            chunk, regular = default_chunk_shape(t.shape, t.dtype.itemsize, size), True
        capped = chunk if cap is None else within_cap(chunk, t.dtype.itemsize, cap)
        meta = ArrayMeta(t.shape, t.dtype, capped, codecs, None, "c", "/")
        out.append(ArrayLayout(t.name, meta, regular, t.placements, split=capped != chunk))
    return out


def within_cap(chunk: tuple[int, ...], itemsize: int, cap: int) -> tuple[int, ...]:
    """``chunk`` cut until it holds at most ``cap`` bytes (or one element), leading dims first
    (the pieces stay contiguous in C order). Each cut divides a dim by its smallest prime
    factor, so the new size divides the old: every old chunk (a shard) is still a whole number
    of new ones, and the grid stays regular."""
    out = list(chunk)
    for d in range(len(out)):
        while math.prod(out) * itemsize > cap and out[d] > 1:
            out[d] //= next(p for p in range(2, out[d] + 1) if out[d] % p == 0)
    return tuple(out)
