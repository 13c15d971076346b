"""What writers hand the engine: a file as an ordered list of literal bytes and tensor pieces.

Every format reshard writes stores tensor data as raw C-order bytes between headers it can
compute up front (sizes are known from the catalog before any data moves). So a writer never
touches tensor data: it describes each output file as segments, and the engine streams each
``Piece`` into its place under the memory budget, with kernel copies where it can.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reshard import dtypes
from reshard.boxes import Box
from reshard.dtypes import DType

__all__ = ["Piece", "OutputFile", "Segment", "segment_size"]


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
    """One output file: ``relpath`` inside the output (``""`` when the output is this file)."""

    relpath: str
    segments: list[Segment] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(segment_size(s) for s in self.segments)

    def offsets(self) -> list[int]:
        """Byte offset of each segment in the file."""
        out, at = [], 0
        for s in self.segments:
            out.append(at)
            at += segment_size(s)
        return out
