"""zarr v3 chunks as catalog ``ChunkData``: the codec pipeline, decoded on read.

An uncompressed local chunk (codecs ``[bytes(little)]``, what reshard writes by default) is
plain C-order elements and becomes a ``StoredRegion`` in the reader, so the engine copies it
like any other format. Everything else goes through ``EncodedChunk``: the chunk's bytes are
fetched (a byte range when the pipeline is raw), then the codecs run in reverse:
bytes-to-bytes codecs (zstd, gzip, blosc, crc32c, via numcodecs, zarr's own codec library),
the ``bytes`` codec's byte order, then ``transpose``. Decoding goes into a buffer of exactly
the chunk's size, after checking the size a compressed frame declares, so a hostile frame
cannot make us allocate more than one chunk. Missing chunks read as ``fill_value``
(``FillChunk``), as zarr defines.
"""

from __future__ import annotations

import math
import struct
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from reshard.core.boxes import Box, contiguous_range
from reshard.core.dtypes import DType
from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError, UsageError
from reshard.core.regions import as_tensor

if TYPE_CHECKING:
    import torch

__all__ = ["Codecs", "EncodedChunk", "FillChunk", "ZSTD_CODECS", "RAW_CODECS", "compress"]

RAW_CODECS: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
# zarr-python's default compressor for v3 arrays; tensorstore reads it too.
ZSTD_CODECS: list[dict[str, Any]] = RAW_CODECS + [{"name": "zstd", "configuration": {"level": 0, "checksum": False}}]
_BYTES_CODECS = ("zstd", "gzip", "blosc", "crc32c")


def _import_numcodecs() -> Any:
    """numcodecs (a dependency; zarr-python's codec library) holds the codecs; raw chunks never need it."""
    try:
        import numcodecs
    except ImportError:
        raise UsageError("compressed zarr chunks need numcodecs: pip install numcodecs") from None
    return numcodecs


def compress(data: bytes | bytearray | memoryview) -> bytes:
    """One chunk's bytes encoded as ``ZSTD_CODECS`` says."""
    return bytes(_import_numcodecs().Zstd(level=0).encode(data))


def _zstd_content_size(data: bytes) -> int | None:
    """The decoded size a zstd frame declares (RFC 8878, 3.1.1.1), or None if it does not say."""
    if len(data) < 6 or data[:4] != b"\x28\xb5\x2f\xfd":
        return None
    desc = data[4]
    fcs_flag, single = desc >> 6, (desc >> 5) & 1
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[desc & 3]
    size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if size == 0 or len(data) < at + size:
        return None
    value = int.from_bytes(data[at:at + size], "little")
    return value + 256 if size == 2 else value


def _declared_size(name: str, data: bytes) -> int | None:
    if name == "zstd":
        return _zstd_content_size(data)
    if name == "gzip" and len(data) >= 4:
        return struct.unpack("<I", data[-4:])[0]  # ISIZE: the size modulo 2**32
    if name == "blosc" and len(data) >= 16:
        return struct.unpack("<I", data[4:8])[0]
    return None


class Codecs:
    """A validated codec list. ``raw`` when the stored bytes are the chunk's little-endian
    C-order elements as they are (no transpose, no compression)."""

    def __init__(self, specs: list[dict[str, Any]], dtype: DType, where: str) -> None:
        self.where, self.dtype = where, dtype
        self.order: tuple[int, ...] | None = None
        self.big_endian = False
        self.compressors: list[tuple[str, Any]] = []
        stage = "array"
        for spec in specs:
            name, config = spec["name"], spec.get("configuration") or {}
            if name == "transpose" and stage == "array":
                order = config.get("order")
                if not isinstance(order, list) or not all(type(i) is int for i in order):
                    raise CorruptCheckpointError(f"{where}: transpose order {order!r} is not a list of dims")
                self.order = tuple(order) if self.order is None else tuple(self.order[i] for i in order)
            elif name == "bytes" and stage == "array":
                endian = config.get("endian", "little")
                if endian not in ("little", "big"):
                    raise CorruptCheckpointError(f"{where}: bytes codec endian {endian!r}")
                self.big_endian = endian == "big" and dtype.itemsize > 1
                stage = "bytes"
            elif name in _BYTES_CODECS and stage == "bytes":
                self.compressors.append((name, self._numcodec(name, config)))
            else:
                hint = " (sharded arrays: rewrite without sharding, e.g. with zarr-python)" if name == "sharding_indexed" else ""
                if spec.get("must_understand") is False:  # the spec lets a reader skip it; skipping a codec can misread bytes
                    hint = (' (its "must_understand": false aside: a chunk is not decoded without every codec; '
                            'zarr-python refuses it too)')
                raise UnsupportedFormatError(f"{where}: codec {name!r} is not supported here{hint}")
        if stage != "bytes":
            raise CorruptCheckpointError(f"{where}: codecs have no array-to-bytes codec ('bytes')")

    def _numcodec(self, name: str, config: dict[str, Any]) -> Any:
        numcodecs = _import_numcodecs()

        if name == "crc32c":
            return numcodecs.CRC32C()
        return {"zstd": numcodecs.Zstd, "gzip": numcodecs.GZip, "blosc": numcodecs.Blosc}[name]()

    @property
    def raw(self) -> bool:
        return not self.compressors and not self.big_endian and (self.order is None or self.order == tuple(sorted(self.order)))

    def decode(self, data: bytes, chunk_shape: tuple[int, ...], key: str) -> np.ndarray:
        """The chunk ``chunk_shape`` (padded, as stored) from its stored bytes, as an array of
        the dtype's width (``DType.bytes_dtype``; a transposed view when stored transposed)."""
        where = f"{self.where}/{key}"
        expected = math.prod(chunk_shape) * self.dtype.itemsize
        for i, (name, codec) in enumerate(reversed(self.compressors)):
            innermost = i == len(self.compressors) - 1
            declared = _declared_size(name, data)
            if innermost and declared is not None and declared != expected % (1 << 32 if name == "gzip" else 1 << 64):
                raise CorruptCheckpointError(f"{where}: {name} frame holds {declared} bytes, a chunk has {expected}")
            try:
                data = codec.decode(data, out=bytearray(expected)) if innermost and name != "crc32c" else codec.decode(data)
            except (ValueError, RuntimeError, TypeError) as e:
                raise CorruptCheckpointError(f"{where}: {name} decoding failed ({e})") from None
            data = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        if len(data) != expected:
            raise CorruptCheckpointError(
                f"{where}: chunk holds {len(data)} bytes, expected {expected} for {list(chunk_shape)} {self.dtype} "
                "(truncated, or zarr.json's shape does not match the data)"
            )
        buf = data if isinstance(data, bytearray) else bytearray(data)  # writable: callers may view it as a tensor
        flat = np.frombuffer(buf, dtype=np.uint8)
        if self.big_endian:
            unit = self.dtype.itemsize // 2 if self.dtype.is_complex else self.dtype.itemsize
            flat = np.ascontiguousarray(flat.reshape(-1, unit)[:, ::-1]).reshape(-1)
        order = self.order or tuple(range(len(chunk_shape)))
        if sorted(order) != list(range(len(chunk_shape))):
            raise CorruptCheckpointError(f"{where}: transpose order {list(order)} is not a permutation of the array's dims")
        stored = flat.view(self.dtype.bytes_dtype).reshape([chunk_shape[d] for d in order])
        return stored.transpose([order.index(d) for d in range(len(order))])


_last_decoded = threading.local()


class FillChunk:
    """A chunk that was never written: every element is the array's ``fill_value``."""

    def __init__(self, fill: bytes, dtype: DType) -> None:
        self.fill, self.dtype = fill, dtype

    def read(self, box: Box) -> torch.Tensor:
        return as_tensor(self.read_array(box), self.dtype)

    def read_array(self, box: Box) -> np.ndarray:
        one = np.frombuffer(self.fill, dtype=np.uint8).view(self.dtype.bytes_dtype).reshape(())
        return np.broadcast_to(one, box.sizes).copy()


class EncodedChunk:
    """A stored chunk read through ``store`` and decoded on every read; raw chunks fetch only
    the byte range a contiguous box needs."""

    def __init__(self, store: Any, key: str, codecs: Codecs, chunk_shape: tuple[int, ...], size: int) -> None:
        self.store, self.key, self.codecs, self.chunk_shape, self.size = store, key, codecs, chunk_shape, size
        self.dtype = codecs.dtype

    @property
    def decoded_bytes(self) -> int:
        """Bytes a read holds whatever box it asks for: a compressed chunk is decoded whole."""
        return 0 if self.codecs.raw else math.prod(self.chunk_shape) * self.dtype.itemsize

    def _fetch(self, start: int = 0, length: int | None = None) -> bytes:
        data = self.store.get(self.key, start, length)
        if data is None:
            raise CorruptCheckpointError(f"{self.store.where}/{self.key}: chunk disappeared while reading")
        return data

    def read(self, box: Box) -> torch.Tensor:
        return as_tensor(self.read_array(box), self.dtype)

    def read_array(self, box: Box) -> np.ndarray:
        """``box``'s bytes as an array of the dtype's width (``DType.bytes_dtype``)."""
        run = contiguous_range(box, self.chunk_shape) if self.codecs.raw and box.numel else None
        if run is not None:
            item = self.dtype.itemsize
            data = self._fetch(run[0] * item, run[1] * item)
            if len(data) != run[1] * item:
                raise CorruptCheckpointError(f"{self.store.where}/{self.key}: chunk ends early (truncated?)")
            return np.frombuffer(bytearray(data), dtype=np.uint8).view(self.dtype.bytes_dtype).reshape(box.sizes)
        if box.sizes == self.chunk_shape:
            return self.codecs.decode(self._fetch(), self.chunk_shape, self.key)
        # The engine reads a chunk in slabs; keep this thread's last decoded chunk, so a chunk
        # is decoded once, not once per slab. One chunk per worker thread: what decoding needs
        # anyway, and it goes with the thread.
        last = getattr(_last_decoded, "entry", None)
        if last is not None and last[0] is self:
            chunk = last[1]
        else:
            _last_decoded.entry = last = None  # the previous chunk goes before the next is decoded
            chunk = self.codecs.decode(self._fetch(), self.chunk_shape, self.key)
            _last_decoded.entry = (self, chunk)
        return chunk[box.as_slices()].copy()
