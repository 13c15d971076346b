"""Reading tensors straight from bytes stored in a file, without mmap and without a copy
of more than the requested box.

Every format reshard reads keeps a chunk as plain little-endian elements at a known offset of
some file (safetensors data, the payload record of a torch.save zip, a DCP blob). Reading with
``os.preadv`` into a buffer we own keeps resident memory to what we asked for: mmap'd pages
would count towards RSS and stay until the kernel evicts them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from reshard.core import dtypes
from reshard.core.boxes import Box, c_order_slabs, contiguous_range, full_box
from reshard.core.dtypes import DType
from reshard.core.errors import CorruptCheckpointError
from reshard.core.storage import Handle, close, open_read, pread_into

if TYPE_CHECKING:
    import torch

__all__ = ["StoredRegion", "as_tensor", "as_array", "read_exact", "read_into", "c_strides", "as_region", "bytes_of_run",
           "array_run", "read_in_place", "fill_in_bands", "BAND_BYTES", "Banded"]

_MIN_SPAN = 1 << 16  # a strided read may always span this much: fewer, larger reads of small boxes


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def read_exact(fd: Handle, nbytes: int, offset: int, path: Path | str) -> bytearray:
    """Read exactly ``nbytes`` at ``offset``; a short read means the file is truncated."""
    buf = bytearray(nbytes)
    _read_into(fd, memoryview(buf), offset, path)
    return buf


def read_into(fd: Handle, view: memoryview, offset: int, path: Path | str) -> None:
    """Fill ``view`` from ``offset``; a short read means the file is truncated."""
    _read_into(fd, view, offset, path)


def _read_array(fd: Handle, nbytes: int, offset: int, path: Path | str) -> np.ndarray:
    """``read_exact`` into uninitialised memory, as uint8: a bytearray is zero-filled first,
    one more pass over every byte read (and the pass that faults its pages in)."""
    buf = np.empty(nbytes, dtype=np.uint8)
    if nbytes:
        # the ignore: numpy's stubs give an ndarray the buffer protocol on Python 3.12+ only
        _read_into(fd, memoryview(buf), offset, path)  # type: ignore[arg-type]
    return buf


def as_tensor(array: np.ndarray, dtype: DType) -> torch.Tensor:
    """The torch tensor of ``dtype`` whose bytes are ``array`` (of ``dtype.bytes_dtype``, any
    strides): shared memory, not a copy."""
    import torch

    if not array.size:  # numpy gives empty arrays zero strides; torch's own are C-order
        return torch.empty(array.shape, dtype=dtype.torch)
    return torch.from_numpy(array).view(dtype.torch)


def as_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a numpy array of its shape and strides, of its dtype's
    ``bytes_dtype``: shared memory, not a copy."""
    same_width = dtypes.by_name(dtypes.of(tensor.dtype).bytes_dtype.name)
    return tensor.detach().view(same_width.torch).numpy()


def _read_into(fd: Handle, view: memoryview, offset: int, path: Path | str) -> None:
    done, nbytes = 0, view.nbytes
    while done < nbytes:
        n = pread_into(fd, view[done:], offset + done)
        if n == 0:
            raise CorruptCheckpointError(
                f"{path}: file ends at byte {offset + done}, expected data up to byte "
                f"{offset + nbytes} (truncated?)"
            )
        done += n


@dataclass(frozen=True)
class StoredRegion:
    """``shape`` elements of ``dtype`` stored C-contiguously from byte ``offset`` of ``path``
    (or with element ``strides`` from there, as torch.save keeps non-contiguous views)."""

    path: Path
    offset: int
    dtype: DType
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):  # a reader's torch dtype
            object.__setattr__(self, "dtype", dtypes.of(self.dtype))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        return self.strides is None or self.strides == c_strides(self.shape) or math.prod(self.shape) <= 1

    def byte_range(self, box: Box) -> tuple[int, int] | None:
        """(file offset, length) of ``box`` when it is one contiguous run in the file."""
        if not self.is_contiguous:
            return None
        run = contiguous_range(box, self.shape)
        if run is None:
            return None
        start, count = run
        item = self.dtype.itemsize
        return (self.offset + start * item, count * item)

    def read(self, box: Box) -> torch.Tensor:
        fd = open_read(self.path)
        try:
            return self.read_from(fd, box)
        finally:
            close(fd)

    def read_from(self, fd: Handle, box: Box, into: torch.Tensor | None = None) -> torch.Tensor:
        """``read_array`` as a torch tensor of the region's dtype; ``into``: uint8 scratch."""
        if box.numel == 0:  # torch's own empty tensor: numpy cannot shape one with a dim past 2**63 bytes
            import torch

            return torch.empty(box.sizes, dtype=self.dtype.torch)
        return as_tensor(self.read_array(fd, box, None if into is None else into.numpy()), self.dtype)

    def read_array(self, fd: Handle, box: Box, into: np.ndarray | None = None) -> np.ndarray:
        """``box``'s bytes through an already open ``fd`` of ``path`` (the engine keeps them
        open), as an array of ``dtype.bytes_dtype`` (maybe a strided view: callers copy it out).

        ``into``: a contiguous uint8 buffer of at least the box's bytes that a box lying in
        one run of the file is read into (and returned as a view of), instead of fresh
        memory; the engine reuses one per worker, so reading does not fault in and zero
        new pages for every slab. Other boxes ignore it."""
        item = self.dtype.itemsize
        if box.numel == 0:
            return np.empty(box.sizes, dtype=self.dtype.bytes_dtype)
        direct = self.byte_range(box)
        if direct is not None:
            offset, nbytes = direct
            if into is not None and into.size >= nbytes:
                buf = into[:nbytes]
                # the ignore: numpy's stubs give an ndarray the buffer protocol on Python 3.12+ only
                _read_into(fd, memoryview(buf), offset, self.path)  # type: ignore[arg-type]
            else:
                buf = _read_array(fd, nbytes, offset, self.path)
            return buf.view(self.dtype.bytes_dtype).reshape(box.sizes)
        strides = self.strides or c_strides(self.shape)
        return self._read_strided(fd, box, strides, max(2 * box.numel * item, _MIN_SPAN))

    def _read_strided(self, fd: Handle, box: Box, strides: tuple[int, ...], allowed: int) -> np.ndarray:
        """``box`` of a region it does not lie in as one run (a column block, a strided view).

        A span of the file that holds the box and at most ``allowed`` bytes is read in one go
        and viewed with the box's strides (the caller copies it out). A box whose span is
        larger is read in blocks along its first dimension of more than one index, each block
        spanning at most ``allowed``: a column shard of a row-major tensor is then a few reads
        of whole row bands, not one read per row, and memory stays within twice the box."""
        item = self.dtype.itemsize
        first = sum(o * s for o, s in zip(box.offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(box.offsets, box.sizes, strides))
        span = (last - first + 1) * item
        if span <= allowed:
            raw = _read_array(fd, span, self.offset + first * item, self.path).view(self.dtype.bytes_dtype)
            return np.lib.stride_tricks.as_strided(raw, box.sizes, tuple(s * item for s in strides))
        d = next(i for i, n in enumerate(box.sizes) if n > 1)  # a box spanning more than one run has one
        pitch = strides[d] * item  # bytes from one index along d to the next
        one = span - (box.sizes[d] - 1) * pitch  # the span of a block of one index (dims before d are 1)
        step = max(1, min(box.sizes[d] - 1, (allowed - one) // pitch + 1)) if allowed > one else 1
        out = np.empty(box.sizes, dtype=self.dtype.bytes_dtype)
        for i in range(0, box.sizes[d], step):
            n = min(step, box.sizes[d] - i)
            offs = box.offsets[:d] + (box.offsets[d] + i,) + box.offsets[d + 1:]
            sub = Box(offs, box.sizes[:d] + (n,) + box.sizes[d + 1:])
            out[(slice(None),) * d + (slice(i, i + n),)] = self._read_strided(fd, sub, strides, allowed)
        return out

    def read_all(self) -> torch.Tensor:
        return self.read(full_box(self.shape))


def bytes_of_run(out: torch.Tensor, box: Box, dtype: DType | None) -> torch.Tensor | None:
    """``box`` of ``out`` as a uint8 view, when it is one run of contiguous CPU memory of
    ``dtype``: a ``read_from(into=)`` buffer, so a stored part is read where it belongs
    instead of into new memory and copied over. None otherwise."""
    if dtype is None or out.device.type != "cpu" or out.dtype != dtype.torch or not out.is_contiguous():
        return None
    run = contiguous_range(box, tuple(out.shape))
    if run is None or not run[1]:
        return None
    import torch

    return out.detach().view(-1)[run[0]: run[0] + run[1]].view(torch.uint8)  # a write target only


def array_run(out: np.ndarray, box: Box) -> np.ndarray | None:
    """``bytes_of_run`` for a C-contiguous byte array (``read_array(into=)``)."""
    run = contiguous_range(box, out.shape)
    if run is None or not run[1]:
        return None
    return out.reshape(-1)[run[0]: run[0] + run[1]].view(np.uint8)


def read_in_place(part: torch.Tensor, dest: torch.Tensor | None) -> bool:
    """Whether ``read_from`` put ``part`` in ``dest`` (a box stored as one run), so there is
    nothing to copy."""
    return dest is not None and part.numel() > 0 and part.data_ptr() == dest.data_ptr()


# Bytes of one band of ``fill_in_bands``: under the 4 MiB mmap threshold the CLI sets, so the
# band's temporaries reuse memory malloc already holds instead of fresh pages, faulted in and
# zeroed by the kernel each time.
BAND_BYTES = 2 << 20


def fill_in_bands(out: torch.Tensor, box: Box, itemsize: int, band_bytes: int,
                  band: Callable[[Box], torch.Tensor]) -> torch.Tensor:
    """Fill ``out`` (contiguous, ``box.sizes``) with ``band(sub)`` for C-order sub-boxes of
    ``box`` of at most ``band_bytes`` at ``itemsize`` (cast into ``out``'s dtype on the way),
    so no temporary behind it is as large as ``box``."""
    flat, at = out.view(-1), 0
    for sub in c_order_slabs(box, itemsize, band_bytes):
        n = sub.numel
        flat[at: at + n].view(sub.sizes).copy_(band(sub))
        at += n
    return out


class Banded:
    """Chunk data whose values are computed (``_band(box)``: a float32 tensor, or already in
    ``out_dtype``) a band of rows at a time, so no temporary is as large as the box asked:
    ``read_into`` takes the engine's slab buffer (any dtype, rounded into once)."""

    out_dtype = "float32"  # what ``read`` returns

    def _band(self, box: Box) -> torch.Tensor:
        raise NotImplementedError

    def read(self, box: Box) -> torch.Tensor:
        import torch

        out = torch.empty(box.sizes, dtype=getattr(torch, self.out_dtype))
        self.read_into(box, out)
        return out

    def read_into(self, box: Box, out: torch.Tensor) -> None:
        fill_in_bands(out, box, 4, BAND_BYTES, self._band)


def as_region(data: object) -> StoredRegion | None:
    """The ``StoredRegion`` behind a chunk's data, when its bytes lie as they are in one file
    (a lazily located DCP record says so once located: ``region()``), else None."""
    if isinstance(data, StoredRegion):
        return data
    region = getattr(data, "region", None)
    return region() if callable(region) else None
