"""What writers hand the engine: a file as an ordered list of literal bytes and tensor pieces.

Every format reshard writes stores tensor data as raw C-order bytes between headers it can
compute up front (sizes are known from the catalog before any data moves). So a writer never
touches tensor data: it describes each output file as segments, and the engine streams each
``Piece`` into its place under the memory budget, with kernel copies where it can.

A layout of hundreds of thousands of small pieces (a fine-grained MoE on a mesh) is better
described in columns than as a ``Piece`` per box: ``PieceTable`` holds every box of a
target as arrays, and a ``SegmentTable`` is a file's segments as indices into it and into
a list of distinct literals. It is still a sequence of segments (each made when asked for),
so code that walks segments reads it as it reads a list; plans and the engine read its
columns instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, overload

import numpy as np

from reshard.core import dtypes
from reshard.core.boxes import Box
from reshard.core.dtypes import DType

if TYPE_CHECKING:
    from reshard.core.target import Target

__all__ = ["Piece", "OutputFile", "Segment", "segment_size", "PieceTable", "SegmentTable"]


@dataclass(frozen=True)
class Piece:
    """The box ``box`` of tensor ``name``, as C-order elements of ``dtype``."""

    name: str
    box: Box
    dtype: DType

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):  # a writer's torch dtype
            object.__setattr__(self, "dtype", dtypes.of(self.dtype))

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.dtype.itemsize


Segment = bytes | Piece


def segment_size(seg: Segment) -> int:
    return seg.nbytes if isinstance(seg, Piece) else len(seg)


@dataclass
class OutputFile:
    """One output file: ``relpath`` inside the output (``""`` when the output is this file).

    ``zero_tail``: zero bytes after the segments (a zarr edge chunk's padding: made by sizing
    a local file, written only to an upload). ``encode``: the file's stored form made from
    all of its bytes at once (zarr's zstd): the engine assembles such a file whole, in memory
    under the budget, and writes what this returns."""

    relpath: str
    segments: list[Segment] = field(default_factory=list)
    zero_tail: int = 0
    encode: Callable[[memoryview], bytes] | None = None

    @property
    def size(self) -> int:
        """Bytes before ``encode``: the segments and the zero tail."""
        if isinstance(self.segments, SegmentTable):
            return int(self.segments.sizes.sum()) + self.zero_tail
        return sum(segment_size(s) for s in self.segments) + self.zero_tail

    def offsets(self) -> list[int]:
        """Byte offset of each segment in the file."""
        if isinstance(self.segments, SegmentTable):
            return self.segments.offsets().tolist()
        out, at = [], 0
        for s in self.segments:
            out.append(at)
            at += segment_size(s)
        return out


class PieceTable:
    """Every box of every tensor of a target, as columns. Row ``first[t] + j`` is box ``j``
    of tensor ``t`` (``names[t]``, in the target's order), to be stored in the file of rank
    ``rank[row]``; boxes are ``offsets`` / ``sizes`` arrays ``[rows, ndim]`` padded past a
    tensor's own ``ndim[t]`` with offset 0 and size 1 (which changes neither its element
    count nor its C order)."""

    def __init__(self, names: list[str], dtypes_: list[DType], ndim: np.ndarray, tensor: np.ndarray,
                 offsets: np.ndarray, sizes: np.ndarray, rank: np.ndarray, pattern: np.ndarray | None = None) -> None:
        self.names, self.dtypes, self.ndim = names, dtypes_, ndim
        # per tensor: tensors of one pattern have the same boxes in the same ranks (None: unknown)
        self.pattern = pattern
        self.tensor, self.offsets, self.sizes, self.rank = tensor, offsets, sizes, rank
        counts = np.bincount(tensor, minlength=len(names)) if len(tensor) else np.zeros(len(names), dtype=np.int64)
        self.first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if len(names) else counts
        self.itemsize = np.array([d.itemsize for d in dtypes_], dtype=np.int64)

    @classmethod
    def of_target(cls, target: Target) -> PieceTable:
        """The table of ``target``'s boxes: tensors that share their boxes and ranks (a model's
        layers, on a mesh) are one pattern, laid out once and repeated by array operations."""
        patterns: dict[tuple, int] = {}
        of_tensor: list[int] = []
        names, dts, ndims = [], [], []
        for t in target.tensors.values():
            key = (tuple(t.boxes), tuple(t.ranks))
            p = patterns.setdefault(key, len(patterns))
            of_tensor.append(p)
            names.append(t.name)
            dts.append(t.dtype)
            ndims.append(len(t.shape))
        width = max(ndims, default=0)
        counts = np.array([len(k[0]) for k in patterns], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        boxes = [b for k in patterns for b in k[0]]
        offsets = np.zeros((len(boxes), width), dtype=np.int64)
        sizes = np.ones((len(boxes), width), dtype=np.int64)
        for i, b in enumerate(boxes):
            offsets[i, :b.ndim] = b.offsets
            sizes[i, :b.ndim] = b.sizes
        ranks = np.array([r for k in patterns for r in k[1]], dtype=np.int64)
        pattern = np.array(of_tensor, dtype=np.int64)
        per_tensor = counts[pattern] if len(pattern) else counts[:0]
        tensor = np.repeat(np.arange(len(pattern), dtype=np.int64), per_tensor)
        # row r of tensor t is row (r - first row of t) of t's pattern
        first = np.concatenate([[0], np.cumsum(per_tensor)[:-1]]).astype(np.int64) if len(pattern) else per_tensor
        at = starts[pattern][tensor] + np.arange(len(tensor), dtype=np.int64) - first[tensor] if len(tensor) else tensor
        return cls(names, dts, np.array(ndims, dtype=np.int64), tensor, offsets[at], sizes[at], ranks[at], pattern)

    def __len__(self) -> int:
        return len(self.tensor)

    @property
    def nbytes(self) -> np.ndarray:
        """Bytes of each row's box."""
        return self.sizes.prod(axis=1) * self.itemsize[self.tensor]

    def box(self, row: int) -> Box:
        n = int(self.ndim[self.tensor[row]])
        return Box(tuple(self.offsets[row, :n].tolist()), tuple(self.sizes[row, :n].tolist()))

    def piece(self, row: int) -> Piece:
        t = int(self.tensor[row])
        return Piece(self.names[t], self.box(row), self.dtypes[t])


class SegmentTable(Sequence[Segment]):
    """An output file's segments as columns: segment ``k`` is ``literals[kind[k]]`` when
    ``kind[k] >= 0``, else the piece of row ``row[k]`` of ``pieces``. Indexing makes the
    segment (a ``Piece`` each time: compare them by value, not identity)."""

    def __init__(self, pieces: PieceTable, literals: list[bytes], kind: np.ndarray, row: np.ndarray) -> None:
        self.pieces, self.literals, self.kind, self.row = pieces, literals, kind, row
        self._sizes: np.ndarray | None = None

    @property
    def sizes(self) -> np.ndarray:
        """Bytes of each segment."""
        if self._sizes is None:
            lengths = np.array([len(b) for b in self.literals], dtype=np.int64)
            is_piece = self.kind < 0
            out = np.zeros(len(self.kind), dtype=np.int64)
            out[~is_piece] = lengths[self.kind[~is_piece]]
            out[is_piece] = self.pieces.nbytes[self.row[is_piece]] if is_piece.any() else 0
            self._sizes = out
        return self._sizes

    def offsets(self) -> np.ndarray:
        """Byte offset of each segment in the file."""
        return np.cumsum(self.sizes) - self.sizes

    def __len__(self) -> int:
        return len(self.kind)

    @overload
    def __getitem__(self, k: int) -> Segment: ...

    @overload
    def __getitem__(self, k: slice) -> list[Segment]: ...

    def __getitem__(self, k: int | slice) -> Segment | list[Segment]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        kind = int(self.kind[k])
        return self.literals[kind] if kind >= 0 else self.pieces.piece(int(self.row[k]))

    def __iter__(self) -> Iterator[Segment]:
        return (self[k] for k in range(len(self)))
