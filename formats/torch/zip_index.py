"""The record index of a stored (uncompressed) zip archive, as torch.save writes them.

A DCP checkpoint holds one torch.save archive per chunk, thousands per checkpoint, so opening
them through ``zipfile`` (a dozen small reads and Python objects per archive) dominated reading
the catalog. Here an archive costs two reads: its tail (end record and central directory) and
its head (the first local headers and the small records torch puts first); everything else
comes from those buffers. Every offset and size is checked against the archive's length
before it is used.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError
from reshard.core.regions import read_exact
from reshard.core.storage import Handle

__all__ = ["ZipEntry", "ZipIndex"]

_EOCD = struct.Struct("<4sHHHHIIH")
_EOCD64_LOCATOR = struct.Struct("<4sIQI")
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_TAIL = 4096  # holds the end record and central directory of any DCP chunk archive
_HEAD = 4096  # holds data.pkl and the small records of a DCP chunk archive
_MAX_COMMENT = 0xFFFF


@dataclass(frozen=True)
class ZipEntry:
    name: str
    header_offset: int
    size: int
    compressed: bool


class ZipIndex:
    """``entries`` by name; ``data_start(entry)`` is where its bytes begin in the archive."""

    def __init__(self, fd: Handle, start: int, length: int, where: str, path: Path | str) -> None:
        self.fd, self.start, self.length, self.where, self.path = fd, start, length, where, path
        self._head = b""
        self._head = self._read(0, min(_HEAD, length))
        self.entries = self._central_directory()

    def _fail(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: not a torch.save zip archive ({what})")

    def _read(self, offset: int, n: int) -> bytes:
        if offset < 0 or n < 0 or offset + n > self.length:
            raise self._fail(f"a record at {offset}+{n} lies outside the {self.length}-byte archive")
        if offset + n <= len(self._head):
            return self._head[offset : offset + n]
        return bytes(read_exact(self.fd, n, self.start + offset, self.path))

    def _end_record(self) -> tuple[int, int, int]:
        """(number of entries, central directory size, its offset)."""
        for span in (min(_TAIL, self.length), min(_EOCD.size + _MAX_COMMENT, self.length)):
            tail = self._read(self.length - span, span)
            at = tail.rfind(b"PK\x05\x06")
            if at >= 0 and len(tail) - at >= _EOCD.size:
                break
        else:
            raise self._fail("no end-of-central-directory record")
        eocd = self.length - span + at
        _, _, _, _, n, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
        if n == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
            loc = self._read(eocd - _EOCD64_LOCATOR.size, _EOCD64_LOCATOR.size) if eocd >= _EOCD64_LOCATOR.size else b""
            if loc[:4] != b"PK\x06\x07":
                raise self._fail("zip64 sizes without a zip64 locator")
            rec = self._read(_EOCD64_LOCATOR.unpack(loc)[2], _EOCD64.size)
            if rec[:4] != b"PK\x06\x06":
                raise self._fail("bad zip64 end record")
            _, _, _, _, _, _, _, n, cd_size, cd_offset = _EOCD64.unpack(rec)
        return n, cd_size, cd_offset

    def _central_directory(self) -> dict[str, ZipEntry]:
        n, cd_size, cd_offset = self._end_record()
        cd = self._read(cd_offset, cd_size)
        entries: dict[str, ZipEntry] = {}
        at = 0
        for _ in range(n):
            if at + _CENTRAL.size > len(cd) or cd[at : at + 4] != b"PK\x01\x02":
                raise self._fail("truncated central directory")
            f = _CENTRAL.unpack_from(cd, at)
            method, csize, usize, name_len, extra_len, comment_len, offset = f[4], f[8], f[9], f[10], f[11], f[12], f[16]
            end = at + _CENTRAL.size + name_len + extra_len + comment_len
            if end > len(cd):
                raise self._fail("truncated central directory")
            name = cd[at + _CENTRAL.size : at + _CENTRAL.size + name_len].decode("utf-8", "replace")
            extra = cd[at + _CENTRAL.size + name_len : at + _CENTRAL.size + name_len + extra_len]
            usize, csize, offset = _zip64_fields(extra, usize, csize, offset)
            if offset + _LOCAL.size + usize > self.length:
                raise CorruptCheckpointError(f"{self.where}: record {name} runs past the end of the data (truncated?)")
            entries[name] = ZipEntry(name, offset, usize, compressed=method != 0 or csize != usize)
            at = end
        return entries

    def crc_fields(self) -> list[int]:
        """Where every CRC-32 field of the archive starts (local headers, data descriptors,
        central directory): the bytes two archives of one layout may differ in beside their
        payloads (``formats.dcp.locate`` compares archives with that allowance)."""
        n, cd_size, cd_offset = self._end_record()
        cd = self._read(cd_offset, cd_size)
        out, at = [], 0
        for _ in range(n):
            f = _CENTRAL.unpack_from(cd, at)
            out.append(cd_offset + at + 16)
            at += _CENTRAL.size + f[10] + f[11] + f[12]
        for entry in self.entries.values():
            head = self._read(entry.header_offset, _LOCAL.size)
            out.append(entry.header_offset + 14)
            if _LOCAL.unpack(head)[2] & 0x08:  # a data descriptor after the payload: [signature] crc sizes
                end = self.data_start(entry) + entry.size
                out.append(end + 4 if self._read(end, 4) == b"PK\x07\x08" else end)
        return out

    def data_start(self, entry: ZipEntry) -> int:
        if entry.compressed:
            raise UnsupportedFormatError(f"{self.where}: record {entry.name} is compressed")
        head = self._read(entry.header_offset, _LOCAL.size)
        if head[:4] != b"PK\x03\x04":
            raise CorruptCheckpointError(f"{self.where}: bad zip local header for {entry.name}")
        name_len, extra_len = _LOCAL.unpack(head)[9:11]
        data = entry.header_offset + _LOCAL.size + name_len + extra_len
        if data + entry.size > self.length:
            raise CorruptCheckpointError(f"{self.where}: record {entry.name} runs past the end of the data (truncated?)")
        return data

    def read(self, entry: ZipEntry) -> bytes:
        return self._read(self.data_start(entry), entry.size)


def _zip64_fields(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    """Sizes and offset from the zip64 extra field, for the 32-bit fields that overflowed."""
    at = 0
    while at + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, at)
        if at + 4 + size > len(extra):
            break
        if tag == 1:
            values = list(struct.unpack_from(f"<{size // 8}Q", extra, at + 4))
            if usize == 0xFFFFFFFF and values:
                usize = values.pop(0)
            if csize == 0xFFFFFFFF and values:
                csize = values.pop(0)
            if offset == 0xFFFFFFFF and values:
                offset = values.pop(0)
        at += 4 + size
    return usize, csize, offset
