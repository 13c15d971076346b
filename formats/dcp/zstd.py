"""DCP records compressed with zstd: ``FileSystemWriter(..., _extensions=[ZStandard()])``.

Each record, tensor chunk or object, is the usual torch.save archive compressed as one
independent zstd frame, and ``.metadata`` marks it with the transform ``stream.zstd/1``.
torch streams the frame out, so its header declares no content size: the archive's length is
known only once it is all decompressed, and its zip index, which says where the tensor's bytes
are, is at its end. ``zstandard`` does the decompression; it is an optional dependency
(``pip install 'reshard[zstd]'``) imported only when such a record is met.

A chunk is decompressed as a stream, never whole:

1. on its first read, one pass over the frame keeps the archive's first and last 64 KiB
   (a chunk archive's data.pkl and zip index live there; any other byte the index asks for is
   found by decompressing again) and checks that the frame ends exactly where its record does;
2. every read decompresses up to the box and keeps only the bytes the box spans. A stream
   paused after a read keeps its place, so slabs read in order cost one pass; a read behind
   the place starts the frame again. At most ``_LIVE_STREAMS`` paused streams are kept.

Memory per read: the bytes the box spans in the chunk (the box itself when it is one run, at
most the chunk's own bytes for a strided one), plus the zstd window (the frame's own: torch
writes 2 MiB, zstd refuses more than 128 MiB), plus 1 MiB of compressed input, plus one step's
output: 1 KiB of compressed input per step, which real data turns into a few KiB and a hostile
frame of RLE blocks into at most 32 MiB. The first pass holds the same, plus its 128 KiB of
head and tail. Objects are read the same way, their tensors whole.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.formats.torch.zip import TorchZipReader, materialize
from reshard.formats.torch.zip_index import ZipIndex

from reshard.core.boxes import Box
from reshard.core.dtypes import DType
from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError
from reshard.core.regions import StoredRegion, c_strides, read_exact
from reshard.core.storage import close, open_read

if TYPE_CHECKING:
    import torch

__all__ = ["DESCRIPTOR", "require_zstandard", "content_size", "ZstdChunk", "load_zstd_object"]

DESCRIPTOR = "stream.zstd/1"
_MAGIC = b"\x28\xb5\x2f\xfd"
_STEP = 1024  # compressed bytes per decompression step: bounds what one step can produce
_READ = 1 << 20  # compressed bytes per read from the file
_HEAD = _TAIL = 1 << 16
_LIVE_STREAMS = 8


def require_zstandard(where: str) -> Any:
    try:
        import zstandard
    except ImportError:
        raise UnsupportedFormatError(
            f"{where}: is zstd-compressed (DCP's ZStandard extension), which needs the zstd extra: "
            "pip install 'reshard[zstd]'"
        ) from None
    return zstandard


def content_size(head: bytes, where: str) -> int | None:
    """The decompressed size a zstd frame header declares (RFC 8878, 3.1.1.1), None when it
    declares none; refuses what is not a frame reshard can decode (no magic, a dictionary)."""
    if len(head) < 6 or head[:4] != _MAGIC:
        raise CorruptCheckpointError(f"{where}: is marked {DESCRIPTOR} but holds no zstd frame")
    desc = head[4]
    fcs_flag, single, dict_flag = desc >> 6, (desc >> 5) & 1, desc & 3
    if desc & 0x08:
        raise CorruptCheckpointError(f"{where}: zstd frame header sets a reserved bit")
    if dict_flag:
        raise UnsupportedFormatError(f"{where}: zstd frame needs a dictionary, which DCP never stores")
    at = 5 + (0 if single else 1)
    size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if size == 0:
        return None
    if len(head) < at + size:
        raise CorruptCheckpointError(f"{where}: zstd frame header is cut short")
    value = int.from_bytes(head[at:at + size], "little")
    return value + 256 if size == 2 else value


class _Stream:
    """A frame's decompressed bytes, produced in order from the start."""

    def __init__(self, path: Path, offset: int, length: int, where: str) -> None:
        zstandard = require_zstandard(where)
        self.path, self.end, self.where = path, offset + length, where
        self._obj = zstandard.ZstdDecompressor().decompressobj()
        self._error = zstandard.ZstdError
        self.raw = offset  # next compressed byte to read from the file
        self._buf, self._at = memoryview(b""), 0  # compressed bytes read, and how many were fed
        self.start = 0  # decompressed offset of pending[0]
        self.pending = b""

    @property
    def done(self) -> bool:
        return self._obj.eof

    def feed(self, fd: int) -> bool:
        """Decompress one more step into ``pending``; False once the frame has ended."""
        if self._obj.eof:
            return False
        if self._at == len(self._buf):
            if self.raw >= self.end:
                raise CorruptCheckpointError(f"{self.where}: zstd frame runs past the end of its record (truncated?)")
            n = min(_READ, self.end - self.raw)
            self._buf, self._at = memoryview(read_exact(fd, n, self.raw, self.path)), 0
            self.raw += n
        step = self._buf[self._at:self._at + _STEP]
        self._at += len(step)
        try:
            out = self._obj.decompress(step)
        except self._error as e:
            raise CorruptCheckpointError(f"{self.where}: zstd frame does not decompress ({e})") from None
        if self._obj.eof and (self._obj.unused_data or self._at < len(self._buf) or self.raw < self.end):
            raise CorruptCheckpointError(f"{self.where}: bytes follow the end of the zstd frame inside its record")
        self.start += len(self.pending)
        self.pending = out
        return True

    def read(self, fd: int, pos: int, n: int) -> bytearray:
        """``n`` decompressed bytes from ``pos``, which must not lie behind the stream."""
        out = bytearray(n)
        got = 0
        while got < n:
            rel = pos + got - self.start
            if 0 <= rel < len(self.pending):
                k = min(n - got, len(self.pending) - rel)
                out[got:got + k] = self.pending[rel:rel + k]
                got += k
            elif not self.feed(fd):
                raise CorruptCheckpointError(
                    f"{self.where}: archive ends at byte {self.start + len(self.pending)}, expected data up to {pos + n}"
                )
        return out


def _with_fd(path: Path, fn: Any) -> Any:
    fd = open_read(path)
    try:
        return fn(fd)
    finally:
        close(fd)


class _Archive:
    """The decompressed archive as the zip reader sees it: its length, and reads served from
    the head and tail kept by the first pass or, elsewhere, by decompressing again."""

    def __init__(self, path: Path, offset: int, length: int, where: str) -> None:
        self.path, self.offset, self.length_raw, self.where = path, offset, length, where
        stream = _Stream(path, offset, length, where)
        head, tail = bytearray(), bytearray()

        def scan(fd: int) -> None:
            while stream.feed(fd):
                if len(head) < _HEAD:
                    head.extend(stream.pending[:_HEAD - len(head)])
                tail.extend(stream.pending)
                del tail[:max(0, len(tail) - _TAIL)]

        _with_fd(path, scan)
        self.length = stream.start + len(stream.pending)
        self.head, self.tail = bytes(head), bytes(tail)

    def read(self, offset: int, n: int) -> bytes:
        if offset + n <= len(self.head):
            return self.head[offset:offset + n]
        if offset >= self.length - len(self.tail):
            at = offset - (self.length - len(self.tail))
            return self.tail[at:at + n]
        stream = _Stream(self.path, self.offset, self.length_raw, self.where)
        return bytes(_with_fd(self.path, lambda fd: stream.read(fd, offset, n)))


class _ArchiveIndex(ZipIndex):
    """``ZipIndex`` over a decompressed archive instead of a file."""

    def __init__(self, archive: _Archive) -> None:
        self._archive = archive
        super().__init__(-1, 0, archive.length, archive.where, archive.path)

    def _read(self, offset: int, n: int) -> bytes:
        if offset < 0 or n < 0 or offset + n > self.length:
            raise self._fail(f"a record at {offset}+{n} lies outside the {self.length}-byte archive")
        return self._archive.read(offset, n)


class _ArchiveReader(TorchZipReader):
    """``torch.zip``'s reader over a decompressed archive: the same allow-list unpickler and
    checks; the regions it returns are offsets inside the archive, not the file."""

    def __init__(self, archive: _Archive) -> None:
        self.path, self.fd, self.start, self.length = archive.path, -1, 0, archive.length
        self.where = archive.where
        self.zip = _ArchiveIndex(archive)
        self._find_pickle()


def _span(region: StoredRegion, box: Box, where: str) -> tuple[int, int, tuple[int, ...]]:
    """(first byte, byte count, element strides) of the bytes ``box`` spans in ``region``."""
    strides = region.strides or c_strides(region.shape)
    if any(s < 0 for s in strides):
        raise CorruptCheckpointError(f"{where}: tensor has negative strides {strides}")
    item = region.dtype.itemsize
    first = sum(o * s for o, s in zip(box.offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(box.offsets, box.sizes, strides))
    return region.offset + first * item, (last - first + 1) * item, strides


def _tensor(raw: bytearray, region: StoredRegion, box: Box, strides: tuple[int, ...]) -> torch.Tensor:
    import torch

    return torch.frombuffer(raw, dtype=region.dtype.torch).as_strided(box.sizes, strides)


_live: OrderedDict[int, ZstdChunk] = OrderedDict()
_live_lock = threading.Lock()


def _keep_live(chunk: ZstdChunk) -> None:
    """Remember ``chunk``'s paused stream; forget the oldest beyond the limit (each holds a window)."""
    with _live_lock:
        _live[id(chunk)] = chunk
        _live.move_to_end(id(chunk))
        while len(_live) > _LIVE_STREAMS:
            _, old = _live.popitem(last=False)
            old._stream = None


class ZstdChunk:
    """A DCP tensor chunk stored as a zstd-compressed torch.save archive (``ChunkData``).

    The archive is checked on the first read: it must hold one tensor of the dtype and shape
    ``.metadata`` gives the chunk; a mismatch is refused then (before the output is committed)."""

    def __init__(self, path: Path, offset: int, length: int, dtype: DType, shape: tuple[int, ...], where: str) -> None:
        self.path, self.offset, self.length = path, offset, length
        self.dtype, self.shape, self.where = dtype, shape, where
        self._region: StoredRegion | None = None
        self._stream: _Stream | None = None
        self._lock = threading.Lock()

    def _located(self) -> StoredRegion:
        if self._region is None:
            region = _ArchiveReader(_Archive(self.path, self.offset, self.length, self.where)).load()
            if not isinstance(region, StoredRegion):
                raise CorruptCheckpointError(f"{self.where}: holds {type(region).__name__}, not a tensor")
            if region.shape != self.shape or region.dtype != self.dtype:
                raise CorruptCheckpointError(
                    f"{self.where}: stores {region.dtype} {list(region.shape)}, metadata says {self.dtype} {list(self.shape)}"
                )
            self._region = region
        return self._region

    def read(self, box: Box) -> torch.Tensor:
        import torch

        if box.numel == 0:
            return torch.empty(box.sizes, dtype=self.dtype.torch)
        with self._lock:
            region = self._located()
            start, n, strides = _span(region, box, self.where)
            stream = self._stream
            if stream is None or start < stream.start:
                stream = _Stream(self.path, self.offset, self.length, self.where)
            raw = _with_fd(self.path, lambda fd: stream.read(fd, start, n))
            self._stream = None if stream.done else stream
        if self._stream is not None:
            _keep_live(self)
        return _tensor(raw, region, box, strides)


def load_zstd_object(path: Path, offset: int, length: int, where: str, name: str = "") -> Any:
    """The value of a zstd-compressed DCP byte object (``name``), tensors inside it read whole."""
    archive = _Archive(path, offset, length, where)
    reader = _ArchiveReader(archive)
    reader.root = name
    obj = reader.load()

    def read(region: StoredRegion) -> torch.Tensor:
        import torch

        box = Box((0,) * len(region.shape), region.shape)
        if box.numel == 0:
            return torch.empty(region.shape, dtype=region.dtype.torch)
        start, n, strides = _span(region, box, where)
        return _tensor(bytearray(archive.read(start, n)), region, box, strides).clone()

    return materialize(obj, read)
