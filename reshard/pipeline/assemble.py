"""Assembling a box of a tensor from the source chunks that hold it: the bytes the engine
writes, verify compares and the runtime sends.

Two paths, chosen per box: where every source is stored bytes of the wanted dtype
(``moves_bytes``), numpy moves them (``assemble_bytes``: no torch import, reads straight into
the caller's scratch where the box is one run of it); otherwise torch builds the box, casting
a band at a time and computing dequantized values in place (``assemble``). Callers hand in a
scratch buffer they keep from box to box, so no box costs fresh pages.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import numpy as np

from reshard.core import dtypes
from reshard.core.boxes import Box
from reshard.core.catalog import ArrayChunkData, ChunkData
from reshard.core.dtypes import DType
from reshard.core.fd_pool import FdPool
from reshard.core.regions import (
    BAND_BYTES,
    StoredRegion,
    array_run,
    as_array,
    as_region,
    bytes_of_run,
    fill_in_bands,
    read_in_place,
)
from reshard.core.storage import close, open_read
from reshard.pipeline.plan import Source

if TYPE_CHECKING:
    import torch

__all__ = ["assemble", "assemble_any", "assemble_bytes", "as_bytes", "contiguous_in", "fill_from_sources", "moves_bytes",
           "stored_dtype"]

def _read_part(data: ChunkData, box: Box, fds: FdPool | None, into: torch.Tensor | None = None) -> torch.Tensor:
    """``box`` of a chunk; ``into``: uint8 scratch a box stored as one run may be read into."""
    region = as_region(data) if fds is not None else None
    if region is not None and fds is not None:
        with fds.use(region.path) as fd:
            return region.read_from(fd, box, into)
    return data.read(box)


def stored_dtype(src: Source) -> DType | None:
    region = as_region(src.chunk.data)
    return None if region is None else region.dtype


def _buffer(into: torch.Tensor | None, sizes: tuple[int, ...], dtype: DType) -> torch.Tensor:
    """A tensor of ``sizes`` and ``dtype`` in ``into`` (uint8 scratch) when given, else new."""
    import torch

    nbytes = math.prod(sizes) * dtype.itemsize
    if into is None or into.numel() < nbytes:
        return torch.empty(sizes, dtype=dtype.torch)
    return into[:nbytes].view(dtype.torch).view(sizes)


def _byte_source(data: ChunkData) -> StoredRegion | ArrayChunkData | None:
    """What gives ``data``'s bytes as they are: its file region, or the data itself when it
    reads arrays of its dtype's width (``read_array``: a decoded zarr chunk); else None."""
    region = as_region(data)
    if region is not None:
        return region
    return cast(ArrayChunkData, data) if callable(getattr(data, "read_array", None)) else None


def moves_bytes(dtype: DType, sources: list[Source]) -> bool:
    """Whether every source is stored bytes of ``dtype`` (no cast, nothing to compute): then
    the piece is assembled by ``assemble_bytes``, without torch."""
    return all((b := _byte_source(s.chunk.data)) is not None and b.dtype is dtype for s in sources)


def _array_buffer(into: np.ndarray | None, sizes: tuple[int, ...], dtype: DType) -> np.ndarray:
    """``_buffer`` as an array of ``dtype.bytes_dtype``."""
    nbytes = math.prod(sizes) * dtype.itemsize
    if into is None or into.size < nbytes:
        return np.empty(sizes, dtype=dtype.bytes_dtype)
    return into[:nbytes].view(dtype.bytes_dtype).reshape(sizes)


def _read_array_part(data: ChunkData, box: Box, fds: FdPool | None, into: np.ndarray | None) -> np.ndarray:
    region = as_region(data)
    if region is None:
        return cast(ArrayChunkData, data).read_array(box)  # moves_bytes said it can
    if fds is None:
        fd = open_read(region.path)
        try:
            return region.read_array(fd, box, into)
        finally:
            close(fd)
    with fds.use(region.path) as fd:
        return region.read_array(fd, box, into)


def assemble_bytes(piece_box: Box, dtype: DType, sources: list[Source], fds: FdPool | None = None,
                   into: np.ndarray | None = None) -> np.ndarray:
    """``assemble`` where ``moves_bytes`` holds: ``piece_box``'s bytes as an array of
    ``dtype.bytes_dtype`` (maybe a strided view of a read, or a view of ``into``, uint8
    scratch). Byte copies between files need no torch: numpy moves them as torch would."""
    if len(sources) == 1 and sources[0].box.intersect(piece_box) == piece_box:
        src = sources[0]
        return _read_array_part(src.chunk.data, piece_box.shifted(src.chunk.box.offsets), fds, into)
    out = _array_buffer(into, piece_box.sizes, dtype)
    for src in sources:
        part = src.box.intersect(piece_box)
        if part is None:
            continue
        local = part.shifted(piece_box.offsets)
        dest = array_run(out, local)
        data = _read_array_part(src.chunk.data, part.shifted(src.chunk.box.offsets), fds, dest)
        if dest is None or not data.size or data.ctypes.data != dest.ctypes.data:  # not read in place
            out[local.as_slices()] = data
    return out


_CAST_BAND_BYTES = BAND_BYTES  # stored bytes read per step of a cast


def _cast_in_bands(src: Source, stored: DType, piece_box: Box, fds: FdPool | None,
                   out: torch.Tensor) -> torch.Tensor:
    """``piece_box`` of one source cast into ``out``, read a band at a time: one read of the
    whole slab in its stored dtype would be fresh pages, faulted in and zeroed."""
    offsets = src.chunk.box.offsets
    return fill_in_bands(out, piece_box, stored.itemsize, _CAST_BAND_BYTES,
                         lambda band: _read_part(src.chunk.data, band.shifted(offsets), fds))


def assemble(piece_box: Box, dtype: DType | torch.dtype, sources: list[Source], fds: FdPool | None = None,
             into: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor for ``piece_box`` (global coordinates) in ``dtype``, read from ``sources``.
    A box that one source holds whole is returned as read (in ``dtype``; maybe a strided view
    or a source's own tensor: callers copy it out and never write to it), not copied again.

    ``into``: scratch memory (uint8, at least the box's bytes) the result may be built in,
    so a worker reuses one buffer instead of faulting in fresh pages per slab; the result
    may then be a view of it."""
    dtype = dtypes.of(dtype)
    if len(sources) == 1 and sources[0].box.intersect(piece_box) == piece_box:
        src = sources[0]
        compute = getattr(src.chunk.data, "read_into", None)
        if compute is not None and into is not None:  # computed values (dequantized) land in the slab itself
            out = _buffer(into, piece_box.sizes, dtype)
            compute(piece_box.shifted(src.chunk.box.offsets), out)
            return out
        stored = stored_dtype(src)
        if into is not None and stored is not None and stored != dtype:
            return _cast_in_bands(src, stored, piece_box, fds, _buffer(into, piece_box.sizes, dtype))
        direct = into if into is not None and stored == dtype else None
        data = _read_part(src.chunk.data, piece_box.shifted(src.chunk.box.offsets), fds, direct)
        if data.dtype == dtype.torch:
            return data
        return _buffer(into, piece_box.sizes, dtype).copy_(data)
    return fill_from_sources(_buffer(into, piece_box.sizes, dtype), piece_box, sources, fds)


def fill_from_sources(out: torch.Tensor, box: Box, sources: list[Source], fds: FdPool | None = None) -> torch.Tensor:
    """Fill ``out`` (``box.sizes``, any dtype or device) with ``box`` (global coordinates)
    from ``sources``, each part read on its own, so at most one part is held beside ``out``.
    A part stored as one run that is one run of ``out`` (host memory of its dtype: a slab
    buffer, a send buffer, a CPU parameter) is read straight into it; the rest are read and
    copied over, cast on the way."""
    for src in sources:
        part = src.box.intersect(box)
        if part is None:
            continue
        local = part.shifted(box.offsets)
        dest = bytes_of_run(out, local, stored_dtype(src))
        data = _read_part(src.chunk.data, part.shifted(src.chunk.box.offsets), fds, dest)
        if not read_in_place(data, dest):  # strided in its file, cast, or not a stored region
            out[local.as_slices()] = data
    return out


def as_bytes(t: np.ndarray | torch.Tensor) -> memoryview:
    """A C-contiguous array's or tensor's bytes."""
    if not isinstance(t, np.ndarray):
        t = as_array(t)
    # the ignore: numpy's stubs give an ndarray the buffer protocol on Python 3.12+ only
    return memoryview(t.reshape(-1).view(np.uint8)) if t.size else memoryview(b"")  # type: ignore[arg-type]


def contiguous_in(t: np.ndarray | torch.Tensor, into: np.ndarray) -> np.ndarray | torch.Tensor:
    """``t`` C-contiguous, copied into scratch ``into`` (uint8) when it is not already."""
    if isinstance(t, np.ndarray):
        if t.flags.c_contiguous:
            return t
        out = into[:t.nbytes].view(t.dtype).reshape(t.shape)
        out[...] = t
        return out
    return t if t.is_contiguous() else _buffer(_tensor_of(into), tuple(t.shape), dtypes.of(t.dtype)).copy_(t)


def _tensor_of(scratch: np.ndarray) -> torch.Tensor:
    """uint8 scratch as a tensor for the torch path (same memory)."""
    import torch

    return torch.from_numpy(scratch)


def assemble_any(box: Box, dtype: DType, sources: list[Source], fds: FdPool, scratch: np.ndarray
              ) -> np.ndarray | torch.Tensor:
    """``box`` of a piece: its bytes moved by numpy when nothing needs casting or computing,
    else built by torch (``assemble``)."""
    if moves_bytes(dtype, sources):
        return assemble_bytes(box, dtype, sources, fds, scratch)
    return assemble(box, dtype, sources, fds, _tensor_of(scratch))
