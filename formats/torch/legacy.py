"""torch.save's legacy layout (torch < 1.6, or ``_use_new_zipfile_serialization=False``),
which many older HF ``pytorch_model.bin`` files use, read as data.

The file is a run of pickles and raw bytes (torch/serialization.py ``_legacy_save``): the
magic number, the protocol version (1001), a sys_info dict, the object (each storage a
persistent id ``('storage', storage_type, key, location, numel, view_metadata)``), the sorted
list of storage keys, then for each key in that order an 8-byte little-endian element count
and the storage's bytes. Walking those counts (8 bytes read per storage, the data skipped)
gives every storage's offset, so tensors become ``StoredRegion``s as in zip files: nothing is
loaded, nothing is run.

The object pickle is replayed twice by the same allow-list unpickler: first to learn each
storage's dtype and element count (the step over its bytes depends on them), then with every
storage's place known. The pickle is small beside the data.

The older tar layout (torch < 0.4) is refused by the caller (``torch.file.read_torch_file``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

from reshard.formats.torch.zip import StorageRef, TorchPickle

from reshard.core.dtypes import DType
from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError
from reshard.safe_pickle.unpickler import Unpickled, safe_loads

__all__ = ["MAGIC_NUMBER", "PROTOCOL_VERSION", "is_tar", "is_legacy", "read_legacy"]

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
_MAGIC_LONG = b"\x8a\x0a" + MAGIC_NUMBER.to_bytes(10, "little")  # the magic as pickle's LONG1 opcode


def is_tar(head: bytes) -> bool:
    return head[257:262] == b"ustar"


def is_legacy(head: bytes) -> bool:
    """Whether a file's first bytes are the legacy magic number's pickle (any protocol)."""
    return head[:1] == b"\x80" and _MAGIC_LONG in head[:16]


class _LegacyObject(TorchPickle):
    """The object pickle; storages are placed at ``bases[key]`` (0 on the first replay)."""

    def __init__(self, path: Path, stream: BinaryIO, start: int, bases: dict[str, int] | None) -> None:
        self.path, self.where, self.stream, self.start, self.bases = path, str(path), stream, start, bases
        self.seen: dict[str, tuple[DType | None, int]] = {}

    def pickle_data(self) -> BinaryIO:
        self.stream.seek(self.start)
        return self.stream

    def storage(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 4 and pid[0] == "module":
            return pid[1]  # a pickled nn.Module's class: refused or allowed like any global
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
            raise CorruptCheckpointError(f"{self.where}: unexpected persistent id {pid!r}")
        _, dtype, key, _location, numel, view = pid
        if not (dtype is None or isinstance(dtype, DType)) or not isinstance(key, str) \
                or type(numel) is not int or numel < 0:
            raise CorruptCheckpointError(f"{self.where}: malformed storage reference {pid!r}")
        # torch.load keeps a storage as its first reference makes it, and that one's dtype and size
        # step over its bytes in the stream; a later one that retypes it is refused by TorchPickle,
        # naming the tensors. An empty storage is not kept there: one that gains elements later
        # would read the next storage's bytes.
        first_dtype, first_numel = self.seen.setdefault(key, (dtype, numel))
        if first_numel == 0 and numel:
            raise CorruptCheckpointError(f"{self.where}: storage {key} is referenced with 0 and then {numel} elements")
        base = 0 if self.bases is None else self.bases[key]
        if view is None:
            return StorageRef(key, dtype, base, numel)
        item = _itemsize(dtype)
        if not (isinstance(view, tuple) and len(view) == 3 and all(type(v) is int for v in view[1:])) \
                or view[1] < 0 or view[2] < 0 or (view[1] + view[2]) * item > first_numel * _itemsize(first_dtype):
            raise CorruptCheckpointError(f"{self.where}: storage view {view!r} lies outside storage {key}")
        return StorageRef(str(view[0]), dtype, base + view[1] * item, view[2], root=key)


def _itemsize(dtype: DType | None) -> int:
    return 1 if dtype is None else dtype.itemsize


def _expect(stream: BinaryIO, where: str, what: str, check: Any) -> Any:
    value = safe_loads(stream, {}, origin=where)
    if not check(value):
        raise CorruptCheckpointError(f"{where}: not a legacy torch.save file ({what} is {value!r:.80})")
    return value


def read_legacy(path: Path) -> Unpickled:
    """The object of a legacy torch.save file, tensors as StoredRegions, with placeholders
    where globals nobody allowed were (see ``torch.file.read_torch_file``)."""
    where = str(path)
    with open(path, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        _expect(stream, where, "the magic number", lambda v: v == MAGIC_NUMBER)
        _expect(stream, where, "the protocol version", lambda v: v == PROTOCOL_VERSION)
        info = _expect(stream, where, "sys_info", lambda v: isinstance(v, dict))
        if info.get("little_endian") is False:
            raise UnsupportedFormatError(f"{path}: saved on a big-endian machine; reshard reads little-endian files only")
        start = stream.tell()
        first = _LegacyObject(path, stream, start, None)
        first.load_deferred()
        keys = _expect(stream, where, "the storage key list",
                       lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v))
        bases = _storage_offsets(path, stream, keys, first.seen, size)
        return _LegacyObject(path, stream, start, bases).load_deferred()


def _storage_offsets(path: Path, stream: BinaryIO, keys: list[str], seen: dict[str, tuple[DType | None, int]],
                     size: int) -> dict[str, int]:
    """Where each storage's bytes begin: after its 8-byte element count, the storages in the
    order the key list gives."""
    unused, unlisted = sorted(set(keys) - set(seen)), sorted(set(seen) - set(keys))
    if unused or unlisted or len(set(keys)) != len(keys):
        raise CorruptCheckpointError(f"{path}: the storage key list does not match the storages the object uses "
                                     f"(listed only: {unused[:3]}, used only: {unlisted[:3]})")
    at = stream.tell()
    bases = {}
    for key in keys:
        dtype, numel = seen[key]
        head = os.pread(stream.fileno(), 8, at)
        if len(head) < 8:
            raise CorruptCheckpointError(f"{path}: ends inside the header of storage {key} (truncated?)")
        count = int.from_bytes(head, "little")
        if count != numel:
            raise CorruptCheckpointError(f"{path}: storage {key} holds {count} elements, the object says {numel}")
        bases[key] = at + 8
        at += 8 + count * _itemsize(dtype)
        if at > size:
            raise CorruptCheckpointError(f"{path}: storage {key} runs past the end of the file (truncated?)")
    return bases
