"""Boxes: the rectangular pieces of a tensor that chunks store and targets ask for.

A box is an offset and a size per dimension, the same shape of data as DCP's
``ChunkStorageMetadata``. Everything a plan does is box arithmetic: intersect a target box with
the source chunks, cut the result into slabs that fit the memory budget, and decide whether a
box is one contiguous byte range (so the kernel can copy it without us touching the bytes).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Box", "full_box", "c_order_slabs", "contiguous_range", "tiles_exactly", "tiles_columns", "tiling_suspects"]


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"box offsets {self.offsets} and sizes {self.sizes} differ in rank")

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes, or None when they share no element."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a, b) for a, b in zip(self.ends, other.ends))
        if any(hi_ <= lo_ for lo_, hi_ in zip(lo, hi)):
            return None
        return Box(lo, tuple(hi_ - lo_ for lo_, hi_ in zip(lo, hi)))

    def shifted(self, origin: Sequence[int]) -> Box:
        """This box in the coordinates of a box that starts at ``origin``."""
        return Box(tuple(o - p for o, p in zip(self.offsets, origin)), self.sizes)

    def contains(self, other: Box) -> bool:
        return all(
            a <= b and b + s <= a + t
            for a, t, b, s in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )

    def as_slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))


def full_box(shape: Sequence[int]) -> Box:
    return Box((0,) * len(shape), tuple(shape))


def c_order_slabs(box: Box, itemsize: int, max_bytes: int) -> Iterator[Box]:
    """Cut ``box`` into sub-boxes whose C-order bytes, concatenated, are the box's C-order bytes.

    Each slab fixes the leading indices, takes a run along one dimension and the full extent
    of every later dimension, so it is one contiguous run of the box's own byte order and
    can be appended to an output file as it is produced. Slabs hold at most ``max_bytes``
    unless a single element is larger.
    """
    if box.numel == 0:
        return
    if box.numel * itemsize <= max_bytes or box.ndim == 0:
        yield box
        return
    inner = math.prod(box.sizes[1:]) * itemsize
    if inner <= max_bytes:
        rows = max(1, max_bytes // inner)
        for start in range(0, box.sizes[0], rows):
            n = min(rows, box.sizes[0] - start)
            yield Box((box.offsets[0] + start,) + box.offsets[1:], (n,) + box.sizes[1:])
        return
    for i in range(box.sizes[0]):
        row = Box(box.offsets[1:], box.sizes[1:])
        for sub in c_order_slabs(row, itemsize, max_bytes):
            yield Box((box.offsets[0] + i,) + sub.offsets, (1,) + sub.sizes)


def contiguous_range(box: Box, shape: Sequence[int]) -> tuple[int, int] | None:
    """(first element, element count) when ``box`` is one contiguous run of a C-order array
    of ``shape``; None when reading it needs several runs."""
    if box.numel == 0:
        return (0, 0)
    # Past the first dimension whose extent is partial, every dimension must be a single index.
    ndim = len(shape)
    k = 0
    while k < ndim and box.sizes[k] == 1:
        k += 1
    # dims k+1.. must be full
    for d in range(k + 1, ndim):
        if box.offsets[d] != 0 or box.sizes[d] != shape[d]:
            return None
    start = 0
    for d in range(ndim):
        start = start * shape[d] + box.offsets[d]
    return (start, box.numel)


def tiles_exactly(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """None when ``boxes`` cover ``shape`` exactly once; otherwise what is wrong, in words."""
    whole = full_box(shape)
    for b in boxes:
        if b.ndim != len(shape):
            return f"chunk {b.offsets}+{b.sizes} has rank {b.ndim}, tensor has rank {len(shape)}"
        if any(o < 0 or s < 0 for o, s in zip(b.offsets, b.sizes)) or not whole.contains(b):
            return f"chunk at {b.offsets} of size {b.sizes} lies outside shape {tuple(shape)}"
    live = [b for b in boxes if b.numel > 0]
    total = sum(b.numel for b in live)
    # Sweep along the dim the chunks split most (dim 1 for column-wise TP shards), so that a
    # tensor cut into n pieces costs about n log n checks, not n^2.
    d = max(range(len(shape)), key=lambda k: len({b.offsets[k] for b in live}), default=None)
    start = (lambda b: b.offsets[d]) if d is not None else (lambda b: 0)  # a 0-d tensor: one element
    end = (lambda b: b.ends[d]) if d is not None else (lambda b: 1)
    ordered = sorted(live, key=lambda b: (start(b), b.offsets))
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if start(b) >= end(a):
                break
            if a.intersect(b) is not None:
                return f"chunks at {a.offsets} and {b.offsets} overlap"
    if total != whole.numel:
        return f"chunks cover {total} of {whole.numel} elements (holes)"
    return None


def tiling_suspects(shapes: Sequence[Sequence[int]], offsets: Sequence[np.ndarray], sizes: Sequence[np.ndarray]) -> list[int]:
    """Which of many tensors (all of one rank, each given as ``tiles_columns`` takes it) may
    fail ``tiles_columns``: checked together in a few array operations over every chunk, where
    one call per tensor cost more than reading the metadata of a 100k-tensor checkpoint. A
    tensor whose chunks cut several dims is always a suspect; the caller runs
    ``tiles_columns`` on the suspects, which also words the problem."""
    m = len(shapes)
    if not m:
        return []
    ndim = len(shapes[0])
    counts = np.fromiter(map(len, offsets), dtype=np.int64, count=m)
    n = int(counts.sum())
    if any(o.shape != (k, ndim) or z.shape != (k, ndim) for o, z, k in zip(offsets, sizes, counts.tolist())):
        return [t for t in range(m) if offsets[t].shape != sizes[t].shape or offsets[t].shape[1:] != (ndim,)]
    whole = np.asarray(shapes, dtype=np.int64).reshape(m, ndim)
    owner = np.repeat(np.arange(m), counts)
    o = np.concatenate(offsets).reshape(n, ndim) if n else np.zeros((0, ndim), dtype=np.int64)
    z = np.concatenate(sizes).reshape(n, ndim) if n else np.zeros((0, ndim), dtype=np.int64)
    w = whole[owner]
    suspect = np.zeros(m, dtype=bool)
    np.logical_or.at(suspect, owner, ((o < 0) | (z < 0) | (o + z > w)).any(axis=1))
    volume = z.prod(axis=1)
    covered = np.bincount(owner, weights=volume, minlength=m) if n else np.zeros(m)
    suspect |= covered != whole.prod(axis=1)  # holes, or (without overlaps) too much
    if ndim and n:
        live = volume > 0
        cut = np.zeros((m, ndim), dtype=bool)
        np.logical_or.at(cut, owner[live], ~((o[live] == 0) & (z[live] == w[live])))
        several = cut.sum(axis=1) > 1
        suspect |= several
        dim = np.where(cut.any(axis=1), cut.argmax(axis=1), 0)  # the one dim a tensor's chunks cut
        rows = np.flatnonzero(live & ~several[owner])
        t = owner[rows]
        start = o[rows, dim[t]]
        order = np.lexsort((start, t))
        t, start, end = t[order], start[order], (start + z[rows, dim[owner[rows]]])[order]
        clash = (t[1:] == t[:-1]) & (start[1:] < end[:-1])
        suspect[t[1:][clash]] = True
    return np.flatnonzero(suspect).tolist()


def tiles_columns(shape: Sequence[int], offsets: np.ndarray, sizes: np.ndarray) -> str | None:
    """``tiles_exactly`` for boxes held as ``[n, ndim]`` arrays (a DCP tensor saved by many
    ranks), in a few array operations when the chunks cut one dim only (FSDP's Shard(0), a
    column-wise TP shard): no element outside the shape, none covered twice, none left out.
    Chunks that cut several dims (a grid) are checked box by box."""
    ndim = len(shape)
    if offsets.shape != sizes.shape or offsets.shape[1:] != (ndim,):
        return f"chunks have rank {offsets.shape[1] if offsets.ndim == 2 else '?'}, tensor has rank {ndim}"
    whole = np.asarray(shape, dtype=np.int64).reshape(1, ndim)
    bad: np.ndarray | list[int] = []
    if ndim:
        bad = np.flatnonzero(((offsets < 0) | (sizes < 0) | (offsets + sizes > whole)).any(axis=1))
    if len(bad):
        k = bad[0]
        return f"chunk at {tuple(offsets[k].tolist())} of size {tuple(sizes[k].tolist())} lies outside shape {tuple(shape)}"
    live = sizes.prod(axis=1) > 0 if ndim else np.ones(len(sizes), dtype=bool)
    o, z = offsets[live], sizes[live]
    total = int(z.prod(axis=1).sum()) if ndim else int(live.sum())
    if ndim == 0 or len(o) <= 1:
        return None if total == math.prod(shape) else f"chunks cover {total} of {math.prod(shape)} elements (holes)"
    full = (o == 0) & (z == whole)  # per chunk and dim: spans the whole dim
    cut = np.flatnonzero(~full.all(axis=0))
    if len(cut) > 1:
        boxes = [Box(tuple(a.tolist()), tuple(b.tolist())) for a, b in zip(offsets, sizes)]
        return tiles_exactly(shape, boxes)
    d = int(cut[0]) if len(cut) else 0
    order = np.argsort(o[:, d], kind="stable")
    starts, ends = o[order, d], o[order, d] + z[order, d]
    clash = np.flatnonzero(starts[1:] < ends[:-1])
    if len(clash):
        a, b = order[clash[0]], order[clash[0] + 1]
        return f"chunks at {tuple(o[a].tolist())} and {tuple(o[b].tolist())} overlap"
    if total != math.prod(shape):
        return f"chunks cover {total} of {math.prod(shape)} elements (holes)"
    return None
