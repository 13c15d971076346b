"""Writing torch.save's byte layout: an uncompressed zip of ``data.pkl`` and one record per
storage, laid out as segments around payloads the engine streams in later (reading is
``torch.zip``).

CRC fields of streamed payloads are left 0, as torch's own
``serialization.config.save.compute_crc32 = False`` writes them; torch's reader does not check
them, and computing them would force every byte through user space.

Records are laid out as torch's writer (miniz) lays them out, because ``torch.load`` onto the
meta device does not read where a storage starts: it computes it, from the first storage's
place, assuming every storage follows the one the pickle first used before it, each payload
followed by a data descriptor (none after an empty one). Storages are therefore named and
stored in the order the pickle first uses them (``"0"`` first), each payload with its
descriptor, and zip64 fields where torch puts them; readers that do offset reads from those
computed places (torch_checkpointing's resharder) read the right bytes.

Stand-ins for classes the user allowed (``reshard.safe_pickle.inert``) are written back under their
original global names, so the output loads wherever the input loaded. The C pickler can name
a class only by importing its module, so a tree holding stand-ins is pickled by the
pure-Python pickler, which writes those names itself; every other tree by the C one. Tensors
go that way too: torch's rebuild function, its storage class and the dtype are stand-ins
written by name, so writing a torch file does not import torch.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
import struct
import sys
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from reshard.core import dtypes
from reshard.core.dtypes import DType
from reshard.core.errors import UnsafeCheckpointError
from reshard.core.pieces import Segment, segment_size
from reshard.safe_pickle.inert import Inert, Refused, standin_class
from reshard.safe_pickle.walk import replace_in

__all__ = ["PieceRef", "torch_pickle", "zip_segments", "torch_save_segments", "embed_tensors", "torch_save_bytes"]

_ALIGN = 64


@dataclass(frozen=True)
class PieceRef:
    """Marks a tensor in an object tree handed to ``torch_pickle``: storage ``key`` holds it."""

    key: str
    dtype: DType
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):  # a torch dtype
            object.__setattr__(self, "dtype", dtypes.of(self.dtype))


_REBUILD_V3 = standin_class("torch._utils", "_rebuild_tensor_v3")  # what torch.save names for every dtype
_UNTYPED_STORAGE = standin_class("torch.storage", "UntypedStorage")


def _reduce_piece(obj: PieceRef) -> tuple:
    n = 1
    for s in obj.shape:
        n *= s
    stride, acc = [], 1
    for s in reversed(obj.shape):
        stride.append(acc)
        acc *= s
    args: tuple[Any, ...] = (_StorageKey(obj.key, n * obj.dtype.itemsize), 0,
                             tuple(obj.shape),  # a tuple, as torch.save writes it
                             tuple(reversed(stride)), False, OrderedDict(), obj.dtype)
    return (_REBUILD_V3, args)


class _HasStandins(Exception):
    """The tree holds stand-ins (or tensors): pickle it again with ``_StandinPickler``."""


def _is_standin_class(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, (Inert, Refused)) and obj not in (Inert, Refused)


def _persistent_id(obj: Any) -> Any:
    if isinstance(obj, _StorageKey):
        return ("storage", _UNTYPED_STORAGE, obj.key, "cpu", obj.nbytes)
    return None


class _TorchPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (PieceRef, DType, Inert, Refused)) or _is_standin_class(obj):
            raise _HasStandins
        return NotImplemented


class _StandinPickler(pickle._Pickler):
    """The pure-Python pickler, for trees that hold stand-ins: a stand-in class is written as
    the global the input named (Python 2 spellings restored, as pickle's protocol 2 does).
    Storages are named as torch.save names them, in the order the pickle first uses them
    (``storage_names``: each PieceRef key's name in the archive).

    typeshed's ``_Pickler`` leaves out the methods overridden and called here (``save``,
    ``save_global``, ``write``, ``memoize``): hence the ignores."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.storage_names: dict[str, str] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageKey):
            name = self.storage_names.setdefault(obj.key, str(len(self.storage_names)))
            return _persistent_id(_StorageKey(name, obj.nbytes))
        return _persistent_id(obj)

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, DType):  # torch's global of that name, as torch.save writes a dtype
            obj = standin_class("torch", obj.name)
        super().save(obj, save_persistent_id)  # type: ignore[misc]

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, PieceRef):
            return _reduce_piece(obj)
        return NotImplemented

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if not _is_standin_class(obj):
            return super().save_global(obj, name)  # type: ignore[misc]
        if issubclass(obj, Refused):
            raise UnsafeCheckpointError(f"{obj.refused} was never read (not allowed); it cannot be written")
        module, qualname = obj.inert_module, obj.inert_qualname
        if (module, qualname) in _compat_pickle.REVERSE_NAME_MAPPING:
            module, qualname = _compat_pickle.REVERSE_NAME_MAPPING[(module, qualname)]
        elif module in _compat_pickle.REVERSE_IMPORT_MAPPING:
            module = _compat_pickle.REVERSE_IMPORT_MAPPING[module]
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode("utf-8"))  # type: ignore[attr-defined]
        self.memoize(obj)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class _StorageKey:
    key: str
    nbytes: int


def torch_pickle(obj: Any) -> bytes:
    """Pickle ``obj`` (containers, plain values, stand-ins, PieceRef) as torch.save's data.pkl would."""
    return _torch_pickle(obj)[0]


def _torch_pickle(obj: Any) -> tuple[bytes, dict[str, str]]:
    """data.pkl, and the name each PieceRef key's storage has in it."""
    buf = io.BytesIO()
    try:
        _TorchPickler(buf, protocol=2).dump(obj)
        return buf.getvalue(), {}
    except _HasStandins:
        buf = io.BytesIO()
        pickler = _StandinPickler(buf, protocol=2)
        pickler.dump(obj)
        return buf.getvalue(), pickler.storage_names


def embed_tensors(value: Any, records: dict[str, Segment]) -> Any:
    """``value`` with every in-memory tensor (objects read from DCP byte items may hold
    some, in any container or stand-in) replaced by a storage record of its bytes, as
    torch.save would store it."""

    torch = sys.modules.get("torch")  # not imported: nothing here is a tensor

    def embed(item: Any) -> Any:
        if torch is None or not isinstance(item, torch.Tensor):
            return item
        t = item.detach().cpu().contiguous()
        key = str(len(records))
        records[key] = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return PieceRef(key, dtypes.of(t.dtype), tuple(t.shape))

    return replace_in(value, embed)


def torch_save_bytes(value: Any) -> bytes:
    """What ``torch.save(value, buffer)`` writes, for a value read from a checkpoint (a DCP
    byte object): tensors anywhere in it stored as records, stand-ins under their original
    names (torch.save would import their modules to name them, or fail)."""
    records: dict[str, Segment] = {}
    tree = embed_tensors(value, records)
    return b"".join(cast("list[bytes]", torch_save_segments(tree, records)))  # embed_tensors records bytes only


_DOS_DATE = (0, 33)  # 1980-01-01 00:00, as zip wants a date; torch writes the same zeros


def zip_segments(records: list[tuple[str, Segment]], archive: str = "archive") -> list[Segment]:
    """Lay out a stored (uncompressed) zip of ``records`` as segments, as torch's writer lays
    them out: each payload starting on a 64-byte boundary from the archive start (what
    torch.load(mmap=True) expects) and followed by a data descriptor unless empty, zip64
    fields where sizes or offsets pass 4 GiB."""
    out: list[Segment] = []
    central: list[bytes] = []
    at = 0
    for name, payload in records:
        fname = f"{archive}/{name}".encode()
        size = segment_size(payload)
        crc = zlib.crc32(payload) if isinstance(payload, bytes) else 0
        big, far = size >= 0xFFFFFFFF, at >= 0xFFFFFFFF
        local64 = [size, size] if big else []
        local64 += [at] if far else []
        zip64 = struct.pack(f"<HH{len(local64)}Q", 1, 8 * len(local64), *local64) if local64 else b""
        base = at + 30 + len(fname) + len(zip64)
        pad = (-(base + 4)) % _ALIGN  # 4 = the padding field's own header
        extra = zip64 + struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB" id, as torch's writer
        s32 = 0xFFFFFFFF if big else size
        # A descriptor after the payload carries its CRC and sizes (bit 3); an empty record has none.
        flag, head_crc, head_size = (0x08, 0, 0) if size else (0, crc, 0)
        out.append(struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 45 if big or far else 20, flag, 0, *_DOS_DATE,
                               head_crc, head_size, head_size, len(fname), len(extra)) + fname + extra)
        out.append(payload)
        wide = big or far  # zip64 descriptors: 8-byte sizes
        descriptor = (struct.pack("<4sIQQ" if wide else "<4sIII", b"PK\x07\x08", crc, size, size) if size else b"")
        cextra_vals = ([size, size] if big else []) + ([at] if far else [])
        cextra = struct.pack(f"<HH{len(cextra_vals)}Q", 1, 8 * len(cextra_vals), *cextra_vals) if cextra_vals else b""
        central.append(struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 45, 45 if (big or far) else 20, flag, 0,
                                   *_DOS_DATE, crc, s32, s32, len(fname), len(cextra), 0, 0, 0, 0,
                                   0xFFFFFFFF if far else at) + fname + cextra)
        at += segment_size(out[-2]) + size
        if descriptor:
            out.append(descriptor)
            at += len(descriptor)
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


def torch_save_segments(tree: Any, pieces: Mapping[str, Segment], archive: str = "archive") -> list[Segment]:
    """A whole torch.save archive: ``tree`` holds PieceRef(key) where ``pieces[key]`` goes.
    Storages are stored, and named, in the order the pickle first uses them (module docstring)."""
    data, names = _torch_pickle(tree)
    records: list[tuple[str, Segment]] = [
        ("data.pkl", data),
        (".format_version", b"1"),
        (".storage_alignment", b"64"),
        ("byteorder", b"little"),
    ]
    for key in pieces:  # a record the tree never names still goes in, after the used ones
        names.setdefault(key, str(len(names)))
    records += [(f"data/{name}", pieces[key]) for key, name in sorted(names.items(), key=lambda kv: int(kv[1]))
                if key in pieces]
    records += [("version", b"3\n")]
    return zip_segments(records, archive)
