"""The catalog: what a checkpoint holds, independent of how its format stores it.

Plain data only. A catalog names every tensor with its global shape, dtype and the chunks
(boxes) it is stored in, plus the small non-tensor objects (step counters, optimizer
hyper-parameters, configs). Formats build catalogs; plans and engines consume them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from reshard.core import dtypes
from reshard.core.boxes import Box
from reshard.core.dtypes import DType
from reshard.core.facts import Facts
from reshard.core.sizes import format_size

if TYPE_CHECKING:
    import torch

__all__ = ["ChunkData", "ArrayChunkData", "Chunk", "ChunkLocator", "StoredChunks", "TensorEntry", "IndexedTensorEntry",
           "Catalog", "NestedPath", "ObjectTable", "object_loader", "pick_objects"]

# Where a flat name sits in the nested state dict: ("optim", "state", "0.weight", "exp_avg").
NestedPath = tuple[str | int, ...]


class ChunkData(Protocol):
    """Something that can produce any sub-box of one stored chunk as a CPU tensor."""

    def read(self, box: Box) -> torch.Tensor:
        """``box`` is relative to the chunk's own origin; returns a tensor of ``box.sizes``.

        Data that computes its values (``reshard.features.dequantize``) may also have ``read_into(box,
        out)``, writing them into ``out`` (contiguous, the box's sizes, any float dtype):
        the engine then passes its slab buffer instead of taking a new tensor per slab."""
        ...


class ArrayChunkData(ChunkData, Protocol):
    """Chunk data that also gives its stored bytes without torch (a decoded zarr chunk): the
    engine moves them as they are when the output keeps ``dtype``."""

    dtype: DType

    def read_array(self, box: Box) -> np.ndarray:
        """``box`` (relative to the chunk) as an array of ``dtype.bytes_dtype``."""
        ...


@dataclass(frozen=True)
class Chunk:
    box: Box  # where the chunk sits in the global tensor
    data: ChunkData


@dataclass(frozen=True)
class StoredChunks:
    """Where chunks lie as plain bytes, as columns: chunk ``i``'s elements are C-order bytes of
    its tensor's dtype from byte ``start[i]`` of ``paths[file[i]]``; ``file[i] == -1`` where
    they are not (compressed, strided, of another dtype, not located)."""

    paths: list[Path]
    file: np.ndarray
    start: np.ndarray


class ChunkLocator(Protocol):
    """A reader's way of locating many tensors' chunks at once (``IndexedTensorEntry.locator``):
    one pass over a checkpoint's records, where locating each chunk on its own costs a read
    per chunk."""

    def locate(self, records: list[Any]) -> StoredChunks:
        """For each entry's ``records`` handle, in order, every chunk in ``columns`` order."""
        ...


@dataclass
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: DType  # a torch dtype given here is taken as its DType
    chunks: list[Chunk] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.dtype = dtypes.of(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        """The chunks' boxes as ``[n, ndim]`` offsets and sizes arrays."""
        shape = (len(self.chunks), len(self.shape))
        return (np.array([c.box.offsets for c in self.chunks], dtype=np.int64).reshape(shape),
                np.array([c.box.sizes for c in self.chunks], dtype=np.int64).reshape(shape))

    @property
    def chunk_count(self) -> int:
        return len(self.chunks)

    def renamed(self, name: str) -> TensorEntry:
        return TensorEntry(name, self.shape, self.dtype, self.chunks)

    def chunk(self, i: int) -> Chunk:
        return self.chunks[i]

    def source_paths(self) -> set[Path]:
        """The files this tensor's bytes come from, for chunks that name one (``path``)."""
        return {p for c in self.chunks if isinstance(p := getattr(c.data, "path", None), Path)}


class IndexedTensorEntry(TensorEntry):
    """A tensor whose chunk boxes are columns (``offsets``, ``sizes``: ``[n, ndim]``) and whose
    ``Chunk`` objects, with their readers, are built the first time something asks for them.

    A checkpoint saved by 2048 ranks has millions of chunks; ``inspect``, the tiling check and
    the per-rank report need only the columns, and a conversion builds one tensor's chunks at
    a time, as it plans that tensor."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: DType, offsets: np.ndarray, sizes: np.ndarray,
                 make: Callable[[int, Box], ChunkData], paths: Callable[[], set[Path]] | None = None, *,
                 keep: bool = True, locator: ChunkLocator | None = None, records: Any = None) -> None:
        self.name, self.shape, self.dtype = name, shape, dtypes.of(dtype)
        self._offsets, self._sizes, self._make, self._paths = offsets, sizes, make, paths
        # ``locator.locate([records, ...])`` locates this entry's chunks with other entries'.
        self.locator, self.records = locator, records
        self._built: list[Chunk | None] | None = None
        self._complete = False
        # False: chunks are made afresh each time they are asked for and never held (a reader
        # that remembers what it located in columns of its own: 100k+ tensors' chunk objects,
        # held, were hundreds of MiB).
        self._keep = keep

    def chunk(self, i: int) -> Chunk:
        """Chunk ``i`` alone: planning a re-layout builds the chunks each piece reads, one
        tensor at a time, never a list of every chunk it does not need yet."""
        found = self._built[i] if self._built is not None else None
        if found is None:
            box = Box(tuple(self._offsets[i].tolist()), tuple(self._sizes[i].tolist()))
            found = Chunk(box, self._make(i, box))
            if self._keep:
                if self._built is None:
                    self._built = [None] * len(self._offsets)
                self._built[i] = found
        return found

    @property
    def chunks(self) -> list[Chunk]:
        if not self._complete and not self._keep:
            return [self.chunk(i) for i in range(len(self._offsets))]
        if not self._complete:
            for i in range(len(self._offsets)):
                self.chunk(i)
            self._complete = True
        return cast("list[Chunk]", self._built or [])  # complete: no slot is None

    @chunks.setter
    def chunks(self, value: list[Chunk]) -> None:
        self._built, self._complete = list(value), True

    @property
    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        return self._offsets, self._sizes

    @property
    def chunk_count(self) -> int:
        return len(self._offsets)

    def source_paths(self) -> set[Path]:
        return self._paths() if self._paths is not None else super().source_paths()

    def renamed(self, name: str) -> TensorEntry:
        other = IndexedTensorEntry(name, self.shape, self.dtype, self._offsets, self._sizes, self._make, self._paths,
                                   keep=self._keep, locator=self.locator, records=self.records)
        other._built, other._complete = self._built, self._complete
        return other

    def __repr__(self) -> str:
        return f"IndexedTensorEntry({self.name!r}, {self.shape}, {self.dtype}, {self.chunk_count} chunks)"


class ObjectTable(MutableMapping[str, Any]):
    """A checkpoint's objects by name, each read from its file the first time it is asked for.

    Objects are pickles from strangers and may hold types reshard refuses to build (or that
    are simply expensive): a conversion that keeps only the model never unpickles the data
    loader's state. Names are known up front and keep their order; ``lazy`` hands a value's
    loader on to another table (a renamed catalog) without running it.
    """

    def __init__(self, loaders: dict[str, Callable[[], Any]] | None = None) -> None:
        self._order: dict[str, None] = dict.fromkeys(loaders or {})
        self._loaders: dict[str, Callable[[], Any]] = dict(loaders or {})
        self._values: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name in self._values:
            return self._values[name]
        if name in self._loaders:
            value = self._values[name] = self._loaders[name]()
            del self._loaders[name]
            return value
        raise KeyError(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self._order[name] = None
        self._loaders.pop(name, None)
        self._values[name] = value

    def __delitem__(self, name: str) -> None:
        del self._order[name]
        self._loaders.pop(name, None)
        self._values.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self._order

    def lazy(self, name: str) -> Callable[[], Any]:
        """A loader for ``name`` that reads it only when called (now, if it was read already)."""
        if name not in self._order:
            raise KeyError(name)
        return lambda: self[name]

    def set_lazy(self, name: str, loader: Callable[[], Any]) -> None:
        self._order[name] = None
        self._values.pop(name, None)
        self._loaders[name] = loader

    def __repr__(self) -> str:
        return f"ObjectTable({list(self._order)})"


def object_loader(objects: MutableMapping[str, Any], name: str) -> Callable[[], Any]:
    """A loader for ``objects[name]`` that defers the read when the table is lazy."""
    if isinstance(objects, ObjectTable):
        return objects.lazy(name)
    value = objects[name]
    return lambda: value


def pick_objects(objects: MutableMapping[str, Any], names: Iterator[str] | list[str]) -> ObjectTable:
    """The named objects, still unread where they were."""
    out = ObjectTable()
    for name in names:
        out.set_lazy(name, object_loader(objects, name))
    return out


@dataclass
class Catalog:
    """A checkpoint's contents. ``paths`` gives the nested position of flat names whose
    nesting cannot be recovered by splitting on dots (DCP's planner_data); ``facts`` holds
    what the reader learned that later steps need (source mesh, HF config...: ``reshard.core.facts``); ``notices`` says what the
    reader had to do that the user should know (per-rank copies named apart...)."""

    format: str
    path: Path
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: MutableMapping[str, Any] = field(default_factory=dict)  # a dict, or an ObjectTable read lazily
    paths: dict[str, NestedPath] = field(default_factory=dict)
    facts: Facts = field(default_factory=Facts)
    notices: list[str] = field(default_factory=list)
    # What ``conventions.detect_layout`` found, carried by ``dataclasses.replace`` to the next
    # step's catalog (a step that changes the tables or the layout attributes changes the key).
    detected_layouts: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    # name here -> the source's name, for the tensors a key map or an export renamed: advice
    # names what the user can type (``--exclude`` matches source names)
    renamed_from: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def source_name(self, name: str) -> str:
        """What the source calls tensor ``name`` of this catalog."""
        return self.renamed_from.get(name, name)

    def nested_path(self, name: str) -> NestedPath:
        return self.paths.get(name, (name,))

    def __repr__(self) -> str:
        """Counts only: ``reshard.inspect`` gives the catalog with its table and summary
        (``reshard.commands.inspect.CatalogReport``)."""
        return (f"Catalog({self.format!r}, {str(self.path)!r}, {len(self.tensors)} tensors, {len(self.objects)} objects, "
                f"{format_size(self.total_bytes)})")
