"""``.metadata`` unpickled without trusting it: torch's DCP classes read as inert stand-ins.

torch pickles ``Metadata`` with plain pickle, and its own reader unpickles it the same way,
so a crafted ``.metadata`` runs code on load. We unpickle with an allow-list that maps DCP's
class names to inert records of our own (nothing of torch.distributed is imported or
constructed); ``reshard.formats.dcp.metadata`` then checks what they hold and keeps it as
columns.

Each stand-in knows every field torch 2.9 through 2.15 writes for its class (and what
Megatron-Core and reshard add). A field or state it does not know is refused as a newer
format (``NewerFormatError``): torch grows these classes between releases (2.15 added
``TensorProperties.strides``), and a field we skipped could change what the bytes mean.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from reshard.core import dtypes
from reshard.core.errors import NewerFormatError, ReshardError
from reshard.core.gc_pause import paused_gc
from reshard.core.torch_support import FLOOR, NEWEST_TESTED
from reshard.core.version import __version__
from reshard.safe_pickle.unpickler import safe_loads

__all__ = ["Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "StorageMeta",
           "MetadataIndex", "StorageInfo", "properties_of", "unpickled_metadata", "newer_format"]


class _NewField(ReshardError):
    """Raised inside the unpickler (which passes reshard's errors through); ``_unpickled``
    turns it into a ``NewerFormatError`` that names the file."""


class _Record:
    """A DCP metadata object as plain attributes, filled by pickle's BUILD step.

    Each stand-in keeps only the fields reshard reads, in ``__slots__``: a 2048-rank checkpoint
    has millions of chunk records, and a slotted object is a fifth of a dict-backed one (and
    faster to fill than torch's own dataclasses). Like torch's dataclasses, those that are not
    frozen cannot be hashed, so a file that uses one as a key is refused here as torch refuses it."""

    __slots__: tuple[str, ...] = ()
    # Fields torch writes that reshard does not need: known, so not refused, but not kept.
    _ignored: ClassVar[frozenset[str]] = frozenset()
    # None: unhashable, Python's way, which typeshed's object.__hash__ (a method) does not allow
    __hash__: ClassVar[Callable[[object], int] | None] = None  # type: ignore[assignment]

    def __setstate__(self, state: Any) -> None:
        fields = _as_dict(self, state)  # once per object: hundreds of thousands are unpickled
        _refuse_unknown(self, fields)
        for name in self.__slots__:
            object.__setattr__(self, name, fields.get(name))

    def __getattr__(self, name: str) -> Any:
        """A field the pickle never set (no BUILD): absent, as a missing key of its state is."""
        if name in type(self).__slots__:
            return None
        raise AttributeError(name)


def _as_dict(obj: _Record, state: Any) -> dict:
    if type(state) is dict:
        return state
    if isinstance(state, tuple) and len(state) == 2 and all(isinstance(x, (dict, type(None))) for x in state):
        return {**(state[0] or {}), **(state[1] or {})}  # (__dict__, __slots__) state
    raise ValueError(f"unexpected state for {type(obj).__name__}")  # safe_loads adds the file name


def _torch_name(obj: _Record) -> str:
    return type(obj).__name__.lstrip("_") if type(obj) is not StorageInfo else "_StorageInfo"


def _refuse_unknown(obj: _Record, fields: dict) -> None:
    unknown = fields.keys() - obj.__slots__ - obj._ignored
    if unknown:
        names = ", ".join(repr(n) for n in sorted(map(str, unknown)))
        raise _NewField(f"{_torch_name(obj)} has field{'s' if len(unknown) > 1 else ''} {names}, which reshard does not know")


class Metadata(_Record):
    # reshard_containers: written by reshard beside torch's fields (reshard.core.structure)
    __slots__ = ("state_dict_metadata", "planner_data", "storage_data", "reshard_containers", "version")
    # storage_meta: the run that saved it (ids, module names); all_local_plans: Megatron-Core's
    # copy of every rank's SavePlan, which the chunks and storage records say again
    _ignored = frozenset({"storage_meta", "all_local_plans"})
    state_dict_metadata: Any
    planner_data: Any
    storage_data: Any
    reshard_containers: Any
    version: Any


class TensorStorageMetadata(_Record):
    __slots__ = ("properties", "size", "chunks")


class BytesStorageMetadata(_Record):
    __slots__ = ()


class ChunkStorageMetadata(_Record):
    __slots__ = ("offsets", "sizes")

    def __setstate__(self, state: Any) -> None:  # one per chunk: written out for speed
        try:
            self.offsets, self.sizes = state["offsets"], state["sizes"]
            if len(state) == 2:
                return
        except (KeyError, TypeError):  # not torch's usual dict: the general path
            pass
        state = _as_dict(self, state)
        _refuse_unknown(self, state)
        self.offsets, self.sizes = state.get("offsets"), state.get("sizes")


class StorageMeta(_Record):
    __slots__ = ()
    _ignored = frozenset({"checkpoint_id", "save_id", "load_id", "modules"})


class MetadataIndex(_Record):
    __slots__ = ("fqn", "offset", "index")
    __hash__ = object.__hash__  # frozen in torch: storage_data's keys

    def __setstate__(self, state: Any) -> None:
        try:
            self.fqn, self.offset, self.index = state["fqn"], state["offset"], state["index"]
            if len(state) == 3:
                return
        except (KeyError, TypeError):
            pass
        state = _as_dict(self, state)
        _refuse_unknown(self, state)
        self.fqn, self.offset, self.index = state.get("fqn"), state.get("offset"), state.get("index")


class StorageInfo(_Record):
    # transform_descriptors: torch >= 2.8, and only where an extension (zstd) was applied
    __slots__ = ("relative_path", "offset", "length", "transform_descriptors")

    def __setstate__(self, state: Any) -> None:
        try:
            self.relative_path, self.offset, self.length = state["relative_path"], state["offset"], state["length"]
            self.transform_descriptors = state.get("transform_descriptors")
            if len(state) == 3 or (len(state) == 4 and "transform_descriptors" in state):
                return
        except (KeyError, TypeError, AttributeError):
            pass
        state = _as_dict(self, state)
        _refuse_unknown(self, state)
        self.relative_path, self.offset, self.length = state.get("relative_path"), state.get("offset"), state.get("length")
        self.transform_descriptors = state.get("transform_descriptors")


class _TensorProperties(_Record):
    """DCP pickles ``(dtype, layout, requires_grad, memory format code, pin_memory)``, and
    from torch 2.15 on ``strides`` after them: the saved tensor's strides (``(1, 4)`` for a
    transposed 4x2 weight). They say how the tensor lay in the saving process's memory, not
    how its bytes are stored: each torch.save record carries its own strides (read from the
    record, as torch does), and a safetensors blob is row-major whatever the tensor was. So
    reshard checks them and keeps them, and reads nothing by them."""

    __slots__ = ("dtype", "strides")
    _ignored = frozenset({"layout", "requires_grad", "memory_format", "pin_memory"})

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) in (5, 6):
            self.dtype = state[0]
            self.strides = state[5] if len(state) == 6 else None
        elif isinstance(state, tuple):
            raise _NewField(f"TensorProperties has {len(state)} fields, which reshard does not know "
                            "(it knows torch's 5 and, from torch 2.15, 6 with strides)")
        else:
            super().__setstate__(state)


_LAYOUTS = frozenset({"torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc", "torch.sparse_bsr",
                      "torch.sparse_bsc", "torch._mkldnn", "torch.jagged"})


def _layout(name: Any) -> str:
    """torch's ``_get_layout(name)``: the layout's name is all reshard keeps (and checks)."""
    if name not in _LAYOUTS:
        raise ValueError(f"tensor layout {name!r} is not one of torch's")  # safe_loads adds the file name
    return name


def _memory_format_code(value: Any) -> int:
    """torch's _MEM_FORMAT_ENCODING(value): contiguous, channels_last, preserve (0, 1, 2)."""
    if type(value) is not int or value not in (0, 1, 2):
        raise ValueError(f"memory format code {value!r} is not one of torch's (0, 1, 2)")  # safe_loads adds the file name
    return value


class _SavePlanRecord(_Record):
    """Megatron-Core adds every rank's ``SavePlan`` to ``Metadata`` (``all_local_plans``):
    read as data and dropped, because the chunks and storage records say all of it again."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        pass


def _write_item_type(value: Any) -> int:
    """torch's ``WriteItemType(value)``, an enum of 1 (tensor), 2 (shard), 3 (bytes)."""
    if type(value) is not int or value not in (1, 2, 3):
        raise ValueError(f"WriteItemType {value!r} is not one of torch's (1, 2, 3)")  # safe_loads adds the file name
    return value


_DCP = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
_PACKAGE = "torch.distributed.checkpoint"


class _DCPGlobals(dict):
    """The allow-list of ``.metadata``. A name of torch's DCP package that is not on it is a
    class a newer torch added (as it adds fields): refused as a newer format, which upgrading
    reshard fixes, and never built (``--allow-class`` does not apply: DCP metadata is read
    into reshard's own records, with no stand-ins). Other names are refused as unsafe."""

    def __missing__(self, key: tuple[str, str]) -> Any:
        module, name = key
        if module == _PACKAGE or module.startswith(_PACKAGE + "."):
            raise _NewField(f"refers to {module}.{name}, a class of torch's DCP package which reshard does not know")
        raise KeyError(key)


_GLOBALS = _DCPGlobals({
    (_DCP, "Metadata"): Metadata,
    (_DCP, "TensorStorageMetadata"): TensorStorageMetadata,
    (_DCP, "BytesStorageMetadata"): BytesStorageMetadata,
    (_DCP, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_DCP, "TensorProperties"): _TensorProperties,
    (_DCP, "StorageMeta"): StorageMeta,
    (_DCP, "MetadataIndex"): MetadataIndex,
    (_DCP, "_MEM_FORMAT_ENCODING"): _memory_format_code,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    **{(_PLANNER, n): _SavePlanRecord for n in ("SavePlan", "WriteItem", "TensorWriteData")},
    (_PLANNER, "WriteItemType"): _write_item_type,
    ("torch", "Size"): tuple,  # a torch.Size is a tuple; building torch's costs more and gives nothing here
    ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): __import__("pathlib").PurePosixPath,
    ("pathlib", "WindowsPath"): __import__("pathlib").PureWindowsPath,
    ("pathlib", "PurePosixPath"): __import__("pathlib").PurePosixPath,
    **{("torch", name): dt for name, dt in dtypes.DTYPES.items()},
})


def properties_of(value: Any) -> tuple[Any, Any]:
    """(dtype, strides) of a ``TensorStorageMetadata``'s ``properties``, unchecked; (None,
    None) when they are no ``TensorProperties``."""
    return (value.dtype, value.strides) if type(value) is _TensorProperties else (None, None)


def unpickled_metadata(meta_path: Path) -> Any:
    """``.metadata`` unpickled with the cyclic garbage collector paused: a 256-rank file makes
    millions of objects, none in a reference cycle, and the collector's passes over them were
    a third of the unpickling time."""
    with paused_gc():
        try:
            return safe_loads(meta_path.read_bytes(), _GLOBALS, origin=meta_path)
        except _NewField as e:
            raise newer_format(meta_path, str(e)) from None


def newer_format(meta_path: Path, what: str) -> NewerFormatError:
    """The refusal of a ``.metadata`` newer than reshard. DCP records no torch version, so the
    message names the newest torch reshard was tested with."""
    return NewerFormatError(f"{meta_path}: {what}: written by a torch newer than reshard {__version__} supports "
                            f"(it reads DCP from torch {FLOOR} to {NEWEST_TESTED}); upgrade reshard (pip install -U reshard)")
