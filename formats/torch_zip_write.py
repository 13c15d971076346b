"""Writing torch.save's byte layout: an uncompressed zip of ``data.pkl`` and one record per
storage, laid out as segments around payloads the engine streams in later (reading is
``torch_zip``).

CRC fields of streamed payloads are left 0, as torch's own
``serialization.config.save.compute_crc32 = False`` writes them; torch's reader does not check
them, and computing them would force every byte through user space.
"""

from __future__ import annotations

import io
import pickle
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from reshard import _torch_compat
from reshard.formats.pieces import Piece, Segment, segment_size

__all__ = ["PieceRef", "torch_pickle", "zip_segments", "torch_save_segments"]

_ALIGN = 64


@dataclass(frozen=True)
class PieceRef:
    """Marks a tensor in an object tree handed to ``torch_pickle``: storage ``key`` holds it."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class _TorchPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageKey):
            return ("storage", torch.UntypedStorage, obj.key, "cpu", obj.nbytes)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, PieceRef):
            n = 1
            for s in obj.shape:
                n *= s
            stride, acc = [], 1
            for s in reversed(obj.shape):
                stride.append(acc)
                acc *= s
            args = (_StorageKey(obj.key, n * obj.dtype.itemsize), 0, torch.Size(obj.shape),
                    tuple(reversed(stride)), False, OrderedDict(), obj.dtype)
            return (_torch_compat.rebuild_tensor_v3, args)
        return NotImplemented


@dataclass(frozen=True)
class _StorageKey:
    key: str
    nbytes: int


def torch_pickle(obj: Any) -> bytes:
    """Pickle ``obj`` (containers, plain values, PieceRef) as torch.save's data.pkl would."""
    buf = io.BytesIO()
    _TorchPickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


_DOS_DATE = (0, 33)  # 1980-01-01 00:00, as zip wants a date; torch writes the same zeros


def zip_segments(records: list[tuple[str, Segment]], archive: str = "archive") -> list[Segment]:
    """Lay out a stored (uncompressed) zip of ``records`` as segments, each payload starting
    on a 64-byte boundary from the archive start (what torch.load(mmap=True) expects).
    Zip64 fields are used where sizes or offsets pass 4 GiB."""
    out: list[Segment] = []
    central: list[bytes] = []
    at = 0
    for name, payload in records:
        fname = f"{archive}/{name}".encode()
        size = segment_size(payload)
        crc = zlib.crc32(payload) if isinstance(payload, bytes) else 0
        big = size >= 0xFFFFFFFF
        zip64 = struct.pack("<HHQQ", 1, 16, size, size) if big else b""
        base = at + 30 + len(fname) + len(zip64)
        pad = (-(base + 4)) % _ALIGN  # 4 = the padding field's own header
        extra = zip64 + struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB" id, as torch's writer
        s32 = 0xFFFFFFFF if big else size
        out.append(struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 45 if big else 20, 0, 0, *_DOS_DATE,
                               crc, s32, s32, len(fname), len(extra)) + fname + extra)
        out.append(payload)
        far = at >= 0xFFFFFFFF
        cextra_vals = ([size, size] if big else []) + ([at] if far else [])
        cextra = struct.pack(f"<HH{len(cextra_vals)}Q", 1, 8 * len(cextra_vals), *cextra_vals) if cextra_vals else b""
        central.append(struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 45, 45 if (big or far) else 20, 0, 0,
                                   *_DOS_DATE, crc, s32, s32, len(fname), len(cextra), 0, 0, 0, 0,
                                   0xFFFFFFFF if far else at) + fname + cextra)
        at += segment_size(out[-2]) + size
    cd = b"".join(central)
    n = len(records)
    tail = b""
    if at >= 0xFFFFFFFF or n >= 0xFFFF:
        tail += struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, len(cd), at)
        tail += struct.pack("<4sIQI", b"PK\x06\x07", 0, at + len(cd), 1)
    tail += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                        min(len(cd), 0xFFFFFFFF), min(at, 0xFFFFFFFF), 0)
    out.append(cd + tail)
    return out


def torch_save_segments(tree: Any, pieces: dict[str, Piece], archive: str = "archive") -> list[Segment]:
    """A whole torch.save archive: ``tree`` holds PieceRef(key) where ``pieces[key]`` goes."""
    records: list[tuple[str, Segment]] = [
        ("data.pkl", torch_pickle(tree)),
        (".format_version", b"1"),
        (".storage_alignment", b"64"),
        ("byteorder", b"little"),
    ]
    records += [(f"data/{key}", piece) for key, piece in pieces.items()]
    records += [("version", b"3\n")]
    return zip_segments(records, archive)
