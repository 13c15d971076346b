"""The byte layout of torch.save files: an uncompressed zip holding ``data.pkl`` and one
record per storage. DCP stores every tensor chunk as such a zip too (one "blob" per chunk).

Reading: the pickle is replayed by reshard's allow-list unpickler, and every tensor becomes a
``StoredRegion`` pointing at its bytes inside the payload record, so tensors are read lazily,
in pieces, without torch.load and without mmap. DTensors become ``DTensorRef``.

Writing lives in ``torch_zip_write``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reshard.formats.zip_index import ZipIndex
from reshard import _torch_compat
from reshard.errors import CorruptCheckpointError, UnsupportedFormatError
from reshard.regions import StoredRegion
from reshard.safe_pickle import safe_loads

__all__ = ["read_torch_zip", "load_object_blob", "DTensorRef", "Record"]

_LEGACY_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16,
    "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "BFloat16Storage": torch.bfloat16, "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}


# ---------------------------------------------------------------------------------- reading


@dataclass
class Record:
    """Stand-in for a class we allow in a pickle but never instantiate (DTensor metadata):
    it keeps the constructor arguments and the state, nothing runs."""

    kind: str
    args: tuple = ()
    state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _record_class(kind: str) -> type:
    def __new__(cls: type, *args: Any) -> Record:
        return Record(kind, args)

    return type(kind, (), {"__new__": __new__})


@dataclass
class DTensorRef:
    """A DTensor found in a torch.save file: its local shard and what DTensor says of it."""

    local: StoredRegion
    global_shape: tuple[int, ...]
    placements: tuple[Record, ...]
    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...] | None
    mesh_dim_names: tuple[str, ...] | None = None
    extra: dict = field(default_factory=dict)


_DTENSOR_CLASSES = {
    ("torch.distributed.tensor", "DTensor"): "DTensor",
    ("torch.distributed._tensor.api", "DTensor"): "DTensor",
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"): "DTensorSpec",
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"): "TensorMeta",
    ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"): "ShardOrderEntry",
    ("torch.distributed.device_mesh", "DeviceMesh"): "DeviceMesh",
    ("torch.distributed._mesh_layout", "_MeshLayout"): "_MeshLayout",
    ("torch.distributed._mesh_layout", "_FlatLayout"): "_FlatLayout",
    ("torch.distributed.tensor.placement_types", "Shard"): "Shard",
    ("torch.distributed.tensor.placement_types", "Replicate"): "Replicate",
    ("torch.distributed.tensor.placement_types", "Partial"): "Partial",
    ("torch.distributed.tensor.placement_types", "_StridedShard"): "_StridedShard",
}


def _parameter(data: Any, *_rest: Any) -> Any:
    return data


def _wrapper_subclass(cls: Any, dtype: Any, size: Any, *_rest: Any) -> Record:
    return Record("wrapper", (dtype, tuple(size)))


@functools.cache
def _static_globals() -> dict[tuple[str, str], Any]:
    """The part of the allow-list that does not depend on the file being read (built once:
    a DCP checkpoint has a blob per chunk, thousands of them)."""
    table: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_parameter"): _parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _parameter,
        ("torch._utils", "_rebuild_wrapper_subclass"): _wrapper_subclass,
        ("torch.storage", "UntypedStorage"): None,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("torch.serialization", "_get_layout"): _torch_compat.get_layout,
    }
    table.update({("torch", n): dt for n, dt in _torch_compat.TORCH_DTYPES.items()})
    table.update({("torch", n): dt for n, dt in _LEGACY_STORAGE_DTYPES.items()})
    table.update({k: _record_class(v) for k, v in _DTENSOR_CLASSES.items()})
    return table


class _TorchZipReader:
    def __init__(self, path: Path, fd: int, start: int, length: int) -> None:
        self.path, self.fd, self.start, self.length = path, fd, start, length
        self.where = f"{path}" if start == 0 else f"{path} (bytes {start}..{start + length})"
        self.zip = ZipIndex(fd, start, length, self.where, path)
        pkl = [n for n in self.zip.entries if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise CorruptCheckpointError(f"{self.where}: expected one data.pkl record, found {len(pkl)}")
        self.prefix = pkl[0][: -len("data.pkl")]
        order = self.zip.entries.get(self.prefix + "byteorder")
        if order is not None and self.zip.read(order).strip() not in (b"little", b""):
            raise UnsupportedFormatError(f"{self.where}: big-endian torch files are not supported")

    def storage(self, pid: Any) -> tuple[str, torch.dtype | None, int, int]:
        """persistent_load: ('storage', type, key, location, numel) → (key, dtype, byte offset, numel)."""
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CorruptCheckpointError(f"{self.where}: unexpected persistent id {pid!r}")
        _, stype, key, _location, numel = pid
        info = self.zip.entries.get(f"{self.prefix}data/{key}")
        if info is None:
            raise CorruptCheckpointError(f"{self.where}: storage record data/{key} is missing")
        dtype = stype  # the allow-list maps storage class names to dtypes (None = untyped bytes)
        item = 1 if dtype is None else dtype.itemsize
        if not isinstance(numel, int) or numel < 0 or numel * item > info.size:
            raise CorruptCheckpointError(
                f"{self.where}: storage data/{key} claims {numel} elements but holds {info.size} bytes"
            )
        return (str(key), dtype, self.start + self.zip.data_start(info), numel)

    def region(self, storage: tuple, offset: int, size: Any, stride: Any, dtype: torch.dtype) -> StoredRegion:
        _key, sdtype, base, numel = storage
        item = dtype.itemsize
        avail = numel * (1 if sdtype is None else sdtype.itemsize)
        size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
        if any(s < 0 for s in size) or len(size) != len(stride) or offset < 0:
            raise CorruptCheckpointError(f"{self.where}: invalid tensor view {size}/{stride}")
        if all(s > 0 for s in size):
            last = offset + sum((n - 1) * st for n, st in zip(size, stride))
            if (last + 1) * item > avail:
                raise CorruptCheckpointError(
                    f"{self.where}: tensor of shape {size} reads past its storage ({avail} bytes)"
                )
        return StoredRegion(self.path, base + offset * item, dtype, size, stride)

    def globals(self) -> dict[tuple[str, str], Any]:
        def v2(storage, offset, size, stride, *_rest):
            return self.region(storage, offset, size, stride, storage[1] or torch.uint8)

        def v3(storage, offset, size, stride, _rg, _hooks, dtype, *_rest):
            return self.region(storage, offset, size, stride, dtype)

        def from_type(func, new_type, args, state):
            base = func(*args)
            # torch pickles an object's state as (__dict__ state, __slots__ state) when the
            # class has slots, as DTensor does; merge both as torch's _set_obj_state does.
            if isinstance(state, tuple) and len(state) == 2:
                state = {**(state[0] or {}), **(state[1] or {})}
            if getattr(new_type, "__name__", "") == "DTensor" and isinstance(state, dict):
                return _dtensor(self.where, base, state)
            return base

        return {
            **_static_globals(),
            ("torch._utils", "_rebuild_tensor_v2"): v2,
            ("torch._utils", "_rebuild_tensor_v3"): v3,
            ("torch._tensor", "_rebuild_from_type_v2"): from_type,
        }

    def load(self) -> Any:
        data = self.zip.read(self.zip.entries[self.prefix + "data.pkl"])
        return safe_loads(data, self.globals(), origin=self.where, persistent_load=self.storage)


def _dtensor(where: str, wrapper: Any, state: dict) -> DTensorRef:
    local, spec = state.get("_local_tensor"), state.get("_spec")
    if not isinstance(local, StoredRegion) or not isinstance(spec, Record):
        raise CorruptCheckpointError(f"{where}: DTensor without a local tensor or spec")
    s = spec.state or {}
    meta = s.get("tensor_meta")
    global_shape = tuple(meta.args[0]) if isinstance(meta, Record) and meta.args else None
    if global_shape is None and isinstance(wrapper, Record):
        global_shape = wrapper.args[1]
    mesh = s.get("mesh")
    mstate = mesh.state if isinstance(mesh, Record) and isinstance(mesh.state, dict) else {}
    layout = mstate.get("_layout")
    mesh_shape: tuple[int, ...] = ()
    if isinstance(layout, Record) and isinstance(layout.state, dict):
        # One _FlatLayout per mesh dimension; a flattened dimension's shape is itself a tuple.
        axes = layout.state.get("axes")
        axes = axes if isinstance(axes, tuple) else (axes,)
        if axes and all(isinstance(a, Record) and isinstance(a.state, dict) for a in axes):
            mesh_shape = tuple(_numel(a.state.get("shape", ())) for a in axes)
    if not mesh_shape and isinstance(mstate.get("mesh"), StoredRegion):
        mesh_shape = mstate["mesh"].shape
    coord = mstate.get("_coordinate_on_dim")
    order = s.get("shard_order")
    return DTensorRef(
        local=local,
        global_shape=tuple(int(x) for x in global_shape),
        placements=tuple(s.get("placements") or ()),
        mesh_shape=tuple(int(x) for x in mesh_shape),
        coordinate=tuple(coord) if coord is not None else None,
        mesh_dim_names=mstate.get("_mesh_dim_names"),
        extra={"shard_order": order} if order is not None else {},
    )


def _numel(shape: Any) -> int:
    """Elements of a (possibly nested) int tuple, as DeviceMesh layouts store shapes."""
    if isinstance(shape, int):
        return shape
    n = 1
    for s in shape:
        n *= _numel(s)
    return n


def read_torch_zip(path: Path, start: int = 0, length: int | None = None) -> Any:
    """The object a torch.save archive holds (whole file, or a blob inside a DCP file), with
    tensors as ``StoredRegion`` and DTensors as ``DTensorRef``. Nothing outside the
    allow-list is called."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        length = size - start if length is None else length
        if start + length > size:
            raise CorruptCheckpointError(
                f"{path}: expected {length} bytes at offset {start}, file has {size} (truncated?)"
            )
        return _TorchZipReader(path, fd, start, length).load()
    finally:
        os.close(fd)


def load_object_blob(path: Path, start: int, length: int, read: Callable[[StoredRegion], torch.Tensor]) -> Any:
    """A small pickled object (a DCP byte item); tensors inside it are read eagerly."""
    obj = read_torch_zip(path, start, length)
    return _materialize(obj, read)


def _materialize(obj: Any, read: Callable[[StoredRegion], torch.Tensor]) -> Any:
    if isinstance(obj, StoredRegion):
        return read(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _materialize(v, read)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_materialize(v, read) for v in obj)
    return obj
