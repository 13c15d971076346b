"""The byte layout of torch.save files: an uncompressed zip holding ``data.pkl`` and one
record per storage. DCP stores every tensor chunk as such a zip too (one "blob" per chunk).

Reading: the pickle is replayed by reshard's allow-list unpickler, and every tensor becomes a
``StoredRegion`` pointing at its bytes inside the payload record, so tensors are read lazily,
in pieces, without torch.load and without mmap. DTensors become ``DTensorRef``. Beside
tensors and containers the pickle may hold the harmless values of ``reshard.safe_pickle.value_types``
and stand-ins for classes the user allowed; ``read_torch_file`` (a whole torch file, zip or
pre-1.6 legacy) leaves placeholders where other globals were, for the reader to refuse
object by object.

Writing lives in ``torch.zip_write``; the legacy layout in ``torch.legacy``; ``torch.file``
reads a whole file of either kind.
"""

from __future__ import annotations

import contextlib
import functools
from collections import ChainMap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.formats.torch.dtensor import DTENSOR_CLASSES, DTensorRef, Record, dtensor_ref, record_class
from reshard.formats.torch.zip_index import ZipIndex
from reshard import dtypes
from reshard.dtypes import DType
from reshard.errors import CorruptCheckpointError, UnsupportedFormatError
from reshard.safe_pickle.inert import Inert, Refused, Sealed, inert_name, is_refused
from reshard.safe_pickle.walk import find_in, replace_in
from reshard.safe_pickle.value_types import VALUE_GLOBALS
from reshard.regions import StoredRegion
from reshard.storage import close, handle_size, open_read
from reshard.safe_pickle.unpickler import Unpickled, safe_loads, safe_loads_deferred

if TYPE_CHECKING:
    import torch

__all__ = ["read_torch_zip", "read_torch_zip_deferred", "load_object_blob", "materialize", "TorchPickle", "DTensorRef",
           "Record", "STORAGE_DTYPES"]

# The storage classes torch.save names in a tensor's persistent id (the usual dtypes' tensors
# are rebuilt from them with no dtype global of their own).
STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "BFloat16Storage": "bfloat16", "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
}


# ---------------------------------------------------------------------------------- reading


def _parameter(data: Any, *_rest: Any) -> Any:
    return data


def _not_callable(cls: type, *_args: Any) -> Any:
    raise ValueError(f"{cls.__name__} may not be called from a pickle")


# ``torch.Tensor`` as _rebuild_from_type_v2 names it for a plain tensor that carries Python
# attributes (its __dict__, dropped: not tensor data); only compared, never called.
_TENSOR_TYPE = Sealed("Tensor", (), {"__new__": _not_callable})


def _wrapper_subclass(cls: Any, dtype: Any, size: Any, *_rest: Any) -> Record:
    return Record("wrapper", (dtype, tuple(size)))


class _TorchObjects(dict):
    """The entries of the allow-list that are torch's own objects (``torch.Size``, a device, a
    layout), made when a pickle first names one: tensor pickles name none, and reading them
    should not cost ``import torch``. Dtypes are ``DType`` (``materialize`` gives torch's).
    The last table asked, so only such names and refused ones get here."""

    def __missing__(self, key: tuple[str, str]) -> Any:
        if key in (("torch", "Size"), ("torch", "device")):
            import torch

            value = getattr(torch, key[1])
        elif key == ("torch.serialization", "_get_layout"):
            from reshard import _torch_compat

            value = _torch_compat.get_layout
        else:
            raise KeyError(key)
        self[key] = value
        return value


_TORCH_OBJECTS = _TorchObjects()


@functools.cache
def _static_globals() -> dict[tuple[str, str], Any]:
    """The part of the allow-list that does not depend on the file being read (built once:
    a DCP checkpoint has a blob per chunk, thousands of them)."""
    table: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_parameter"): _parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _parameter,
        ("torch._utils", "_rebuild_wrapper_subclass"): _wrapper_subclass,
        ("torch.storage", "UntypedStorage"): None,
    }
    table.update({("torch", n): dt for n, dt in dtypes.DTYPES.items()})  # a v3 tensor's dtype, or a value
    # Storage classes name the dtype of a storage (cuda ones in files saved from a GPU).
    table.update({(m, n): dtypes.by_name(dt) for n, dt in STORAGE_DTYPES.items() for m in ("torch", "torch.cuda")})
    table[("torch", "UntypedStorage")] = None
    table[("torch", "Tensor")] = _TENSOR_TYPE
    table.update({k: record_class(v) for k, v in DTENSOR_CLASSES.items()})
    return table


class TorchPickle:
    """The allow-list for a torch.save pickle and the tensors it rebuilds. A subclass says
    where the pickle and the storages are (``storage``: persistent id -> (key, dtype, byte
    offset in ``path``, element count)); every tensor view is checked against its storage."""

    path: Path
    where: str

    def storage(self, pid: Any) -> tuple[str, DType | None, int, int]:
        raise NotImplementedError

    def pickle_data(self) -> Any:
        """The pickle: bytes, or a binary file positioned at it."""
        raise NotImplementedError

    def region(self, storage: tuple, offset: int, size: Any, stride: Any, dtype: DType) -> StoredRegion:
        _key, sdtype, base, numel = storage
        dtype = dtypes.of(dtype)  # a v3 rebuild names a torch dtype
        item = dtype.itemsize
        avail = numel * (1 if sdtype is None else sdtype.itemsize)
        size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
        if type(offset) is not int or any(s < 0 for s in size) or len(size) != len(stride) or offset < 0:
            raise CorruptCheckpointError(f"{self.where}: invalid tensor view {size}/{stride}")
        if all(s > 0 for s in size):
            last = offset + sum((n - 1) * st for n, st in zip(size, stride))
            if (last + 1) * item > avail:
                raise CorruptCheckpointError(
                    f"{self.where}: tensor of shape {size} reads past its storage ({avail} bytes)"
                )
        return StoredRegion(self.path, base + offset * item, dtype, size, stride)

    def globals(self) -> ChainMap:
        def v2(storage, offset, size, stride, *_rest):
            return self.region(storage, offset, size, stride, storage[1] or dtypes.by_name("uint8"))

        def v3(storage, offset, size, stride, _rg, _hooks, dtype, *_rest):
            return self.region(storage, offset, size, stride, dtype)

        def from_type(func, new_type, args, state):
            base = func(*args)
            refused = next((x for x in (new_type, base) if is_refused(x)), None) or find_in(state, is_refused)
            if refused is not None:  # a tensor subclass or state nobody allowed: the object is refused
                return refused if isinstance(refused, Refused) else refused()
            if isinstance(new_type, type) and issubclass(new_type, Inert):
                raise UnsupportedFormatError(f"{self.where}: holds a tensor of class {inert_name(new_type)}; "
                                             "reshard reads plain tensors and DTensors only")
            # torch pickles an object's state as (__dict__ state, __slots__ state) when the
            # class has slots, as DTensor does; merge both as torch's _set_obj_state does.
            if isinstance(state, tuple) and len(state) == 2:
                state = {**(state[0] or {}), **(state[1] or {})}
            if getattr(new_type, "__name__", "") == "DTensor" and isinstance(state, dict):
                return dtensor_ref(self.where, base, state)
            return base

        return ChainMap({
            ("torch._utils", "_rebuild_tensor"): v2,  # torch < 1.0
            ("torch._utils", "_rebuild_tensor_v2"): v2,
            ("torch._utils", "_rebuild_tensor_v3"): v3,
            ("torch._tensor", "_rebuild_from_type_v2"): from_type,
        }, _static_globals(), VALUE_GLOBALS, _TORCH_OBJECTS)

    def load(self) -> Any:
        """The object, refusing at once any global that is neither listed nor allowed by the user."""
        return safe_loads(self.pickle_data(), self.globals(), origin=self.where, persistent_load=self.storage,
                          stand_ins=True)

    def load_deferred(self) -> Unpickled:
        """The object with placeholders where unlisted globals were (``safe_loads_deferred``)."""
        return safe_loads_deferred(self.pickle_data(), self.globals(), origin=self.where,
                                   persistent_load=self.storage)


class _TorchZipReader(TorchPickle):
    def __init__(self, path: Path, fd: int, start: int, length: int) -> None:
        self.path, self.fd, self.start, self.length = path, fd, start, length
        self.where = f"{path}" if start == 0 else f"{path} (bytes {start}..{start + length})"
        self.zip = ZipIndex(fd, start, length, self.where, path)
        self._find_pickle()

    def _find_pickle(self) -> None:
        """The archive's record prefix (``<name>/`` before ``data.pkl``); little-endian only."""
        pkl = [n for n in self.zip.entries if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise CorruptCheckpointError(f"{self.where}: expected one data.pkl record, found {len(pkl)}")
        self.prefix = pkl[0][: -len("data.pkl")]
        order = self.zip.entries.get(self.prefix + "byteorder")
        if order is not None and self.zip.read(order).strip() not in (b"little", b""):
            raise UnsupportedFormatError(f"{self.where}: big-endian torch files are not supported")

    def storage(self, pid: Any) -> tuple[str, DType | None, int, int]:
        """persistent_load: ('storage', type, key, location, numel) → (key, dtype, byte offset, numel)."""
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CorruptCheckpointError(f"{self.where}: unexpected persistent id {pid!r}")
        _, stype, key, _location, numel = pid
        info = self.zip.entries.get(f"{self.prefix}data/{key}")
        if info is None:
            raise CorruptCheckpointError(f"{self.where}: storage record data/{key} is missing")
        if not (stype is None or isinstance(stype, DType)):
            raise CorruptCheckpointError(f"{self.where}: storage data/{key} has no storage type")
        dtype = stype  # the allow-list maps storage class names to dtypes (None = untyped bytes)
        item = 1 if dtype is None else dtype.itemsize
        if not isinstance(numel, int) or numel < 0 or numel * item > info.size:
            raise CorruptCheckpointError(
                f"{self.where}: storage data/{key} claims {numel} elements but holds {info.size} bytes"
            )
        return (str(key), dtype, self.start + self.zip.data_start(info), numel)

    def pickle_data(self) -> bytes:
        return self.zip.read(self.zip.entries[self.prefix + "data.pkl"])


def read_torch_zip(path: Path, start: int = 0, length: int | None = None) -> Any:
    """The object a torch.save archive holds (whole file, or a blob inside a DCP file), with
    tensors as ``StoredRegion`` and DTensors as ``DTensorRef``. Nothing outside the
    allow-list is called; a global outside it (and not allowed by the user) is refused."""
    with _open_archive(path, start, length) as reader:
        return reader.load()


def read_torch_zip_deferred(path: Path) -> Unpickled:
    """A whole torch.save archive with placeholders where globals nobody allowed were."""
    with _open_archive(path, 0, None) as reader:
        return reader.load_deferred()


@contextlib.contextmanager
def _open_archive(path: Path, start: int, length: int | None) -> Iterator[_TorchZipReader]:
    fd = open_read(path)
    try:
        size = handle_size(fd)
        length = size - start if length is None else length
        if start + length > size:
            raise CorruptCheckpointError(f"{path}: expected {length} bytes at offset {start}, file has {size} (truncated?)")
        yield _TorchZipReader(path, fd, start, length)
    finally:
        close(fd)


def load_object_blob(path: Path, start: int, length: int, read: Callable[[StoredRegion], torch.Tensor]) -> Any:
    """A small pickled object (a DCP byte item); tensors inside it are read eagerly."""
    return materialize(read_torch_zip(path, start, length), read)


def materialize(obj: Any, read: Callable[[StoredRegion], torch.Tensor]) -> Any:
    """``obj`` with every tensor still on disk read into memory, wherever it sits (a dict, a
    deque, a stand-in's arguments...); containers keep their types."""
    return replace_in(obj, _materialized(read))


def _materialized(read: Callable[[StoredRegion], torch.Tensor]) -> Callable[[Any], Any]:
    def one(x: Any) -> Any:
        if isinstance(x, StoredRegion):
            return read(x)
        return x.torch if isinstance(x, DType) else x  # a dtype among the values: torch's, as torch.load gives

    return one


_materialize = materialize  # the name formats/dcp/zstd.py imports
