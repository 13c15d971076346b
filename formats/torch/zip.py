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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.formats.torch.dtensor import DTENSOR_CLASSES, DTensorRef, Record, dtensor_ref, record_class
from reshard.formats.torch.zip_index import ZipIndex

from reshard.core import dtypes
from reshard.core.dtypes import DType
from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError
from reshard.core.regions import StoredRegion
from reshard.core.storage import Handle, close, handle_size, open_read
from reshard.safe_pickle.inert import Inert, Refused, Sealed, inert_name, is_refused
from reshard.safe_pickle.unpickler import Unpickled, safe_loads, safe_loads_deferred
from reshard.safe_pickle.value_types import VALUE_GLOBALS
from reshard.safe_pickle.walk import find_in, path_to, replace_in

if TYPE_CHECKING:
    import torch

__all__ = ["read_torch_zip", "read_torch_zip_deferred", "varying_spans", "load_object_blob", "materialize", "TorchPickle",
           "TorchZipReader", "StorageRef", "DTensorRef", "Record", "STORAGE_DTYPES"]

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
            from reshard.core import torch_compat as _torch_compat

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


@dataclass(frozen=True)
class StorageRef:
    """A storage as a persistent id names it: ``key`` (what torch.load keeps storages by), its
    dtype (None: untyped bytes, which torch.load types uint8), where its bytes begin in the
    file and its element count; ``root`` is the storage it is a view of (a legacy file's
    view_metadata), else ``key`` itself."""

    key: str
    dtype: DType | None
    base: int
    numel: int
    root: str | None = None

    @property
    def typed(self) -> DType:
        return self.dtype or _UINT8

    @property
    def nbytes(self) -> int:
        return self.numel * self.typed.itemsize


_UINT8 = dtypes.by_name("uint8")


@dataclass(frozen=True)
class _Retyped:
    """A later reference typing a storage otherwise than its first reference did."""

    first: StorageRef
    ref: StorageRef


def _is_storage(value: Any) -> bool:
    return isinstance(value, (StorageRef, _Retyped))


class TorchPickle:
    """The allow-list for a torch.save pickle and the tensors it rebuilds. A subclass says
    where the pickle and the storages are (``storage``: persistent id -> ``StorageRef``);
    every tensor view is checked against its storage.

    Storages are shared as torch.load shares them: the first reference to a key makes the
    storage, its dtype and its size, and every later reference gets that one whatever it
    says. A later reference that types the storage otherwise would be read by torch.load as
    the first one's dtype, and a tensor that reaches past the storage as the first reference
    sized it fails there: both are refused, naming the two tensors (``_checked``), once the
    whole pickle is read and their names are known."""

    path: Path
    where: str
    root = ""  # the name of the pickled value in errors (a DCP object's); "" for a state dict

    def storage(self, pid: Any) -> StorageRef:
        raise NotImplementedError

    def pickle_data(self) -> Any:
        """The pickle: bytes, or a binary file positioned at it."""
        raise NotImplementedError

    def _reference(self, pid: Any) -> Any:
        """persistent_load: the storage as torch.load would hand it out (the first reference's)."""
        ref = self.storage(pid)
        if not isinstance(ref, StorageRef):
            return ref  # a legacy file's module class
        root = ref.root or ref.key
        if ref.nbytes:  # torch.load keeps no empty storage: each reference to one makes its own
            self._typed.setdefault(root, ref)
            self._made.setdefault(ref.key, ref)
        first = self._typed.get(root, ref)
        return self._made.get(ref.key, ref) if first.typed == ref.typed else _Retyped(first, ref)

    def region(self, storage: StorageRef | _Retyped, offset: int, size: Any, stride: Any,
               dtype: DType | None = None) -> StoredRegion:
        """The tensor ``_rebuild_tensor_v2/v3`` makes on ``storage``; ``dtype`` None (v2): the storage's."""
        retyped = storage if isinstance(storage, _Retyped) else None
        ref = storage.ref if isinstance(storage, _Retyped) else storage
        if not isinstance(ref, StorageRef):
            raise CorruptCheckpointError(f"{self.where}: a tensor is built on a {type(ref).__name__}, not a storage")
        dtype = ref.typed if dtype is None else dtypes.of(dtype)  # a v3 rebuild names a torch dtype
        item = dtype.itemsize
        size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
        if type(offset) is not int or any(s < 0 for s in size) or len(size) != len(stride) or offset < 0:
            raise CorruptCheckpointError(f"{self.where}: invalid tensor view {size}/{stride}")
        region = StoredRegion(self.path, ref.base + offset * item, dtype, size, stride)
        earlier = self._tensors.setdefault(ref.root or ref.key, region) if ref.nbytes else region
        if retyped is not None:
            first = retyped.first.typed.name
            self._clashes.append((None if earlier is region else earlier, region,
                                  lambda a, b: f"with different dtypes ({a} {first}, {b} {dtype.name}); torch.load "
                                               "types a storage by its first reference"))
        elif all(s > 0 for s in size):
            last = offset + sum((n - 1) * st for n, st in zip(size, stride))
            if (last + 1) * item > ref.nbytes:
                if earlier is region:
                    raise CorruptCheckpointError(
                        f"{self.where}: tensor of shape {size} reads past its storage ({ref.nbytes} bytes)"
                    )
                self._clashes.append((earlier, region, lambda a, b: f"but {b} (shape {size}) reaches past it "
                                                                    f"({ref.nbytes} bytes, as {a} made it; torch.load "
                                                                    "sizes a storage by its first reference)"))
        return region

    def _checked(self, value: Any) -> Any:
        """``value``, unless a tensor read a storage otherwise than torch.load would, or a
        storage stands alone (``tensor.untyped_storage()`` saved as such), not in a tensor."""
        if self._clashes:
            first, second, problem = self._clashes[0]
            a, b = (self._name(value, t) for t in (first, second))
            raise CorruptCheckpointError(f"{self.where}: tensors {a} and {b} share a storage {problem(a, b)}; "
                                         "refused, as torch.save never writes this")
        if find_in(value, _is_storage) is not None:
            bare = path_to(value, _is_storage) or ()
            raise UnsupportedFormatError(f"{self.where}: {self._label(bare, 'the pickled value')} is a bare storage, "
                                         "not a tensor; reshard reads tensors: save the tensor that uses it instead")
        return value

    def _name(self, value: Any, region: StoredRegion | None) -> str:
        if region is None:
            return "(a bare storage before them)"
        path = path_to(value, lambda x: x is region or (isinstance(x, DTensorRef) and x.local is region))
        if path is None:
            return f"(a {region.dtype.name} tensor of shape {region.shape} that the pickle drops)"
        return self._label(path, "(the pickled tensor)")

    def _label(self, path: tuple, whole: str) -> str:
        name = ".".join(map(str, ((self.root,) if self.root else ()) + path))
        return repr(name) if name else whole

    def _fresh(self) -> None:
        self._made: dict[str, StorageRef] = {}
        self._typed: dict[str, StorageRef] = {}
        self._tensors: dict[str, StoredRegion] = {}
        self._clashes: list[tuple[StoredRegion | None, StoredRegion, Callable[[str, str], str]]] = []

    def globals(self) -> ChainMap:
        def v2(storage, offset, size, stride, *_rest):
            return self.region(storage, offset, size, stride)

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

        # typeshed's ChainMap takes mutable maps only; this one is only read (hence the ignore)
        return ChainMap({
            ("torch._utils", "_rebuild_tensor"): v2,  # torch < 1.0
            ("torch._utils", "_rebuild_tensor_v2"): v2,
            ("torch._utils", "_rebuild_tensor_v3"): v3,
            ("torch._tensor", "_rebuild_from_type_v2"): from_type,
        }, _static_globals(), VALUE_GLOBALS, _TORCH_OBJECTS)  # type: ignore[arg-type]

    def load(self) -> Any:
        """The object, refusing at once any global that is neither listed nor allowed by the user."""
        self._fresh()
        return self._checked(safe_loads(self.pickle_data(), self.globals(), origin=self.where,
                                        persistent_load=self._reference, stand_ins=True))

    def load_deferred(self) -> Unpickled:
        """The object with placeholders where unlisted globals were (``safe_loads_deferred``)."""
        self._fresh()
        out = safe_loads_deferred(self.pickle_data(), self.globals(), origin=self.where,
                                  persistent_load=self._reference)
        self._checked(out.value)
        return out


class TorchZipReader(TorchPickle):
    """A torch.save zip archive at ``start`` (``length`` bytes) of an open file: its index, its
    ``data.pkl`` and where each storage's bytes lie. A reader of archives held elsewhere (the
    zstd-compressed records of ``formats/dcp/zstd.py``) subclasses it over its own index."""

    def __init__(self, path: Path, fd: Handle, start: int, length: int) -> None:
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

    def storage(self, pid: Any) -> StorageRef:
        """('storage', type, key, location, numel) → where that storage's bytes are."""
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
        return StorageRef(str(key), dtype, self.start + self.zip.data_start(info), numel)

    def pickle_data(self) -> bytes:
        return self.zip.read(self.zip.entries[self.prefix + "data.pkl"])


def read_torch_zip(path: Path, start: int = 0, length: int | None = None, name: str = "") -> Any:
    """The object a torch.save archive holds (whole file, or a blob inside a DCP file, whose
    ``name`` errors use), with tensors as ``StoredRegion`` and DTensors as ``DTensorRef``.
    Nothing outside the allow-list is called; a global outside it (and not allowed by the
    user) is refused."""
    with _open_archive(path, start, length) as reader:
        reader.root = name
        return reader.load()


def varying_spans(path: Path, start: int, length: int) -> list[tuple[int, int]]:
    """Where two torch.save archives of one layout may differ: (archive-relative offset,
    length) of every CRC-32 field, every storage payload (the tensor bytes) and the payload
    of ``.data/serialization_id`` (new on every save). Two archives equal outside these spans
    hold the same pickle, records and offsets, so one read of this archive describes both."""
    with _open_archive(path, start, length) as reader:
        entries = reader.zip.entries
        variable = [e for n, e in entries.items() if n.startswith(reader.prefix + "data/")
                    or n == reader.prefix + ".data/serialization_id"]
        spans = [(reader.zip.data_start(e), e.size) for e in variable]
        return spans + [(at, 4) for at in reader.zip.crc_fields()]


def read_torch_zip_deferred(path: Path) -> Unpickled:
    """A whole torch.save archive with placeholders where globals nobody allowed were."""
    with _open_archive(path, 0, None) as reader:
        return reader.load_deferred()


@contextlib.contextmanager
def _open_archive(path: Path, start: int, length: int | None) -> Iterator[TorchZipReader]:
    fd = open_read(path)
    try:
        size = handle_size(fd)
        length = size - start if length is None else length
        if start + length > size:
            raise CorruptCheckpointError(f"{path}: expected {length} bytes at offset {start}, file has {size} (truncated?)")
        yield TorchZipReader(path, fd, start, length)
    finally:
        close(fd)


def load_object_blob(path: Path, start: int, length: int, read: Callable[[StoredRegion], torch.Tensor],
                     name: str = "") -> Any:
    """A small pickled object (a DCP byte item named ``name``); tensors inside it are read eagerly."""
    return materialize(read_torch_zip(path, start, length, name), read)


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
