"""``StorageReader``: any checkpoint reshard reads, as a source for torch's own ``dcp.load``.

Why it exists: torchtitan and every other trainer that resumes with
``torch.distributed.checkpoint.load`` (``dcp.load``) reads DCP folders through torch's
``FileSystemReader`` and HF folders through ``HuggingFaceStorageReader``, and nothing else. Handing
``dcp.load`` this reader instead lets such code load any format reshard reads (a DCP folder, a
safetensors file or HF folder, DeepSpeed, Megatron-Core, accelerate, zarr, torch files, per-rank
folders) without a conversion step, its own planner, DTensor resharding and ``Stateful``
handling unchanged::

    msd, osd = get_state_dict(model, optimizer)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=reshard.StorageReader("global_step2/"))   # a DeepSpeed folder
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

The protocol (``torch/distributed/checkpoint/storage.py``; the same methods on torch 2.9 to 2.15):

0. ``__init__`` / ``reset(checkpoint_id)``: the catalog is read here, on every rank (metadata
   only, as ``reshard.inspect`` reads it), so a bad source raises reshard's own error
   (``UnsupportedFormatError``, ``CorruptCheckpointError``...) from ``reshard.StorageReader(src)``
   or from ``dcp.load(..., checkpoint_id=src)``: torch swallows an error raised by
   ``read_metadata`` and raises its own ``AssertionError`` instead.
1. ``read_metadata``: the catalog as torch's ``Metadata`` (see ``_metadata``).
2. ``set_up_storage_reader``, 3. ``prepare_local_plan`` (refuses a box the checkpoint does not
   store whole, before anything is read), 4. ``prepare_global_plan``: nothing to coordinate.
5. ``read_data``: each rank reads exactly the boxes its plan asks for.
"""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _TorchStorageReader
from torch.futures import Future

from reshard.core.boxes import Box
from reshard.core.catalog import Catalog
from reshard.core.conventions import OPTIM_GROUP, OPTIM_STATE, PARAM, Layout, Place, convention_named, detect_layout
from reshard.core.errors import CorruptCheckpointError, ReshardError, UsageError
from reshard.features.keymap.lookup import load_keymap
from reshard.formats.registry import detect_format
from reshard.pipeline.options import SourceOptions, check_budget
from reshard.pipeline.plan import covered_elements
from reshard.runtime.runs import LocatedChunks
from reshard.runtime.transfer import BoxReader
from reshard.sources.reading import given_config, given_layout, local_path, read_catalog

__all__ = ["StorageReader"]

# How the callers of dcp.load name what they load, tried in this order for a name the checkpoint
# does not hold as it is: torch's get_state_dict nested as {"model", "optim"} (its DCP tutorial)
# or {"model", "optimizer"}, torchtitan's (model under model. or at the top level, optimizer
# state and param groups by FQN), get_optimizer_state_dict alone, a model's state_dict().
_LIVE_CONVENTIONS = ("torch-optim", "torch-optimizer", "torchtitan", "torchtitan-flat", "torch-optimizer-only",
                     "state-dict")

Identity = tuple[Any, ...]  # what a name is, whatever a tool calls it: (role, fqn or group, key)


def _identity(place: Place) -> Identity | None:
    """The identity of a placed name: a parameter by FQN, optimizer state by FQN and key, a
    param-group value by group (index or FQN) and key; None for anything else, and for a
    group's ``params`` (how a checkpoint lists its parameters is its own: FQNs or indexes)."""
    if place.role == PARAM and place.fqn is not None:
        return (PARAM, place.fqn)
    if place.role == OPTIM_STATE and place.fqn is not None and place.key is not None:
        return (OPTIM_STATE, place.fqn, place.key)
    if place.role == OPTIM_GROUP and place.key and place.key != "params":
        return (OPTIM_GROUP, place.group if place.group is not None else place.fqn, place.key)
    return None


class _Names:
    """The checkpoint's names, found from the names a caller's state dict uses, the way
    ``reshard.load_state_dict`` finds them: as they are, else as the same parameter, the same
    optimizer state or the same param-group value under the checkpoint's layout (torchtitan's
    ``optimizer.state.<fqn>.exp_avg`` fills get_state_dict's ``optim.state.<fqn>.exp_avg``;
    DeepSpeed's top-level ``model.embed_tokens.weight`` fills ``{"model": msd}``'s
    ``model.model.embed_tokens.weight``). The layout is detected when the first name needs it."""

    def __init__(self, catalog: Catalog, layout: str | None) -> None:
        self.catalog = catalog
        self.layout_name = layout
        self._index: dict[Identity, str] | None = None
        self._found: dict[str, str | None] = {}
        self._live = [Layout(convention_named(n), ()) for n in _LIVE_CONVENTIONS]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.stored(name) is not None

    def stored(self, name: str) -> str | None:
        """The checkpoint's name for ``name``, or None."""
        if name in self.catalog.tensors or name in self.catalog.objects:
            return name
        if name not in self._found:
            index = self._identities()
            self._found[name] = next((index[i] for layout in self._live
                                      if (i := _identity(layout.place(name))) is not None and i in index), None)
        return self._found[name]

    def _identities(self) -> dict[Identity, str]:
        if self._index is None:
            layout = detect_layout(self.catalog, self.layout_name)
            index: dict[Identity, str] = {}
            listed: dict[int, Any] = {}  # param group index -> its params list
            for name in [*self.catalog.tensors, *self.catalog.objects]:
                p = layout.place(name)
                if p.role == OPTIM_GROUP and p.key == "params" and p.group is not None:
                    listed[p.group] = self.catalog.objects[name]
                elif (identity := _identity(p)) is not None:
                    index.setdefault(identity, name)
            # Values of a group saved by index, found by the FQN of a parameter the group lists
            # too (get_state_dict lists FQNs; a list of indexes says nothing about FQNs).
            for identity, name in list(index.items()):
                params = listed.get(identity[1]) if identity[0] == OPTIM_GROUP else None
                for fqn in params if isinstance(params, (list, tuple)) else ():
                    if isinstance(fqn, str):
                        index.setdefault((OPTIM_GROUP, fqn, identity[2]), name)
            self._index = index
        return self._index


class _Entries(dict[str, Any]):  # torch's Metadata.state_dict_metadata is a dict
    """``Metadata.state_dict_metadata``: one entry per checkpoint name (what ``items()``
    lists, so torch's ``_EmptyStateDictLoadPlanner`` rebuilds the checkpoint as it is), and
    lookups that also find a caller's name for the same tensor (``_Names``), which is how
    torch's planner asks (``fqn in md``, ``md[fqn]``)."""

    def __init__(self, entries: Mapping[str, Any], names: _Names) -> None:
        super().__init__(entries)
        self._names = names

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or name in self._names

    def __missing__(self, name: str) -> Any:
        stored = self._names.stored(name) if isinstance(name, str) else None
        if stored is None:
            raise KeyError(name)
        return dict.__getitem__(self, stored)

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default


class StorageReader(_TorchStorageReader):
    """A ``torch.distributed.checkpoint`` storage reader of any checkpoint reshard reads
    (``path``: a path, a ``file://`` or fsspec URL, or a Hub repo id, as ``reshard.inspect``
    takes them), for ``dcp.load``. Values come out bit for bit as ``reshard.load_state_dict``
    loads them (the same box reads, the same casts into each tensor's dtype).

    ``keymap`` renames the checkpoint's names first (a preset such as ``"hf-to-titan"``, a JSON
    path or a dict); ``layout``, ``config``, ``allow_classes`` and ``storage_options`` are as in
    ``reshard.inspect``, or all of them as one ``options=SourceOptions(...)``. ``max_memory``
    bounds what one read holds beside its destination (a read that casts, or whose
    destination is not one run of host memory, goes in slabs of at most this) and how many
    bytes of resolved tensors wait to be committed to the planner.

    A name of the caller's state dict is found as it is in the checkpoint, else as the same
    parameter, optimizer state or param-group value under the checkpoint's layout, whichever
    tool wrote it (``reshard.core.conventions``); a param group's ``params`` list only as it
    is. ``bytes_read``: the tensor bytes the last ``read_data`` read on this rank.

    >>> msd, osd = get_state_dict(model, optimizer)
    >>> dcp.load({"model": msd, "optim": osd}, storage_reader=reshard.StorageReader("ckpt/"))
    >>> dcp.load(msd, storage_reader=reshard.StorageReader("Qwen/Qwen3-0.6B", keymap="hf-to-titan"))
    """

    def __init__(self, path: str | os.PathLike, *, keymap: Any = None, layout: str | None = None,
                 config: str | os.PathLike | None = None, allow_classes: str | tuple[str, ...] | list[str] = (),
                 storage_options: dict[str, Any] | None = None, max_memory: str | int = "1GiB",
                 options: SourceOptions | None = None) -> None:
        super().__init__()
        given = {k: v for k, v in (("keymap", keymap), ("layout", layout), ("config", config),
                                   ("allow_classes", allow_classes), ("storage_options", storage_options)) if v}
        self.options = SourceOptions.of(given, options.source if options is not None else None)
        self.slab_bytes = check_budget(max_memory)
        self.bytes_read = 0
        self._open(path)

    def _open(self, path: str | os.PathLike) -> None:
        opts = self.options
        with opts.allowing():
            catalog = given_config(given_layout(read_catalog(path, opts), opts.layout), opts.config)
            if opts.keymap is not None:
                catalog = load_keymap(opts.keymap).apply(catalog)
        self.path = path
        self.catalog = catalog
        self._names = _Names(catalog, opts.layout)
        self._metadata: Metadata | None = None

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        """The source being read (torch logs it)."""
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new load begins; ``checkpoint_id`` (``dcp.load(..., checkpoint_id=)``), when it names
        another source than the one being read, is read now (a bad one raises here)."""
        if checkpoint_id and str(checkpoint_id) != str(self.path):
            self._open(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = _metadata(self.catalog, self._names, self.path)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass  # every rank read its own catalog; nothing to learn from the planner's metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Refuses, before any read, a box that the checkpoint's chunks do not store whole
        (a rank's file missing from a per-rank folder, a flat partition cut short)."""
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                continue
            name, box = self._box(item)
            entry = self.catalog.tensors[name]
            covered = covered_elements(entry, box)
            if covered != box.numel:
                raise CorruptCheckpointError(f"{self.catalog.path}: {name!r} stores only {covered} of the {box.numel} "
                                             f"elements of box {box}; the checkpoint is incomplete")
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every item of this rank's plan, in one pass over the source files (each opened once):
        a tensor's box read from the chunks that hold it straight into the tensor the planner
        resolves, as ``load_state_dict`` reads (``reshard.runtime.transfer.BoxReader``: a box
        that is runs of its files and of the tensor's memory by the kernel, with its
        neighbours in one call; others slab by slab), committed once read (a budget's worth
        at a time: a planner may resolve to tensors of its own); an object as ``torch.save``
        of the value reshard's safe unpickler built."""
        self.bytes_read = 0
        tensors = [i for i in plan.items if i.type != LoadItemType.BYTE_IO]
        reader = BoxReader(LocatedChunks(self.catalog.tensors[self._box(i)[0]] for i in tensors), self.slab_bytes)
        read: list[tuple[ReadItem, torch.Tensor]] = []
        try:
            with self.options.allowing():
                pending = 0
                for item in plan.items:
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(item, self._object_bytes(item))
                        continue
                    read.append(self._read_tensor(item, planner, reader))
                    pending += read[-1][1].nbytes
                    if pending >= self.slab_bytes:
                        _commit(reader, read, planner)
                        pending = 0
                _commit(reader, read, planner)
        finally:
            reader.close()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _box(self, item: ReadItem) -> tuple[str, Box]:
        """The checkpoint's name and the box (global coordinates) ``item`` asks for."""
        name = self._names.stored(item.storage_index.fqn)
        if name is None or name not in self.catalog.tensors:
            raise UsageError(f"{self.catalog.path}: the load planner asked for tensor {item.storage_index.fqn!r}, "
                             "which the checkpoint does not hold (its metadata did not offer it)")
        origin = item.storage_index.offset or (0,) * len(item.lengths)  # the chunk the item is in: the whole tensor
        return name, Box(tuple(o + s for o, s in zip(origin, item.storage_offsets)), tuple(item.lengths))

    def _read_tensor(self, item: ReadItem, planner: LoadPlanner, reader: BoxReader) -> tuple[ReadItem, torch.Tensor]:
        name, box = self._box(item)
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != box.sizes:
            raise UsageError(f"{self.catalog.path}: {name!r}: the load planner resolved a tensor of shape "
                             f"{list(target.shape)} for a box of {list(box.sizes)}")
        self.bytes_read += reader.add(self.catalog.tensors[name], target, box)
        return item, target

    def _object_bytes(self, item: ReadItem) -> io.BytesIO:
        """The object as torch.save of its safe value: torch's planner unpickles what it is given
        with ``torch.load(weights_only=False)``, which would run any function a crafted file
        names; a value re-saved here holds only what reshard's allow-list unpickler built."""
        name = self._names.stored(item.storage_index.fqn)
        if name is None or name not in self.catalog.objects:
            raise UsageError(f"{self.catalog.path}: the load planner asked for object {item.storage_index.fqn!r}, "
                             "which the checkpoint does not hold (its metadata did not offer it)")
        out = io.BytesIO()
        torch.save(self.catalog.objects[name], out)
        out.seek(0)
        return out

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Whether ``checkpoint_id`` is a local path (or ``file://`` URL) of a format reshard
        reads, by detection alone (reading it may still refuse it); a remote URL or a Hub repo
        id says False here (pass the reader itself, which reads them)."""
        path = local_path(checkpoint_id)
        if path is None:
            return False
        try:
            detect_format(Path(path))
        except (ReshardError, OSError):
            return False
        return True


def _commit(reader: BoxReader, read: list[tuple[ReadItem, torch.Tensor]], planner: LoadPlanner) -> None:
    """The tensors of ``read`` filled (their runs read), handed to the planner, forgotten."""
    reader.flush()
    for item, target in read:
        planner.commit_tensor(item, target)
    read.clear()


def _metadata(catalog: Catalog, names: _Names, path: str | os.PathLike) -> Metadata:
    """torch's ``Metadata`` of ``catalog``.

    Each tensor is described as one chunk, the whole tensor, whatever its stored chunks are:
    torch's planner then asks each rank for exactly its local box, one ``ReadItem`` per local
    shard (not one per stored chunk it overlaps), and reshard assembles that box from the
    stored chunks itself, reading straight into the destination. The stored chunks are what
    reshard's readers know (DeepSpeed flat partitions, zarr chunk grids, computed key-map
    tensors) and may not be boxes torch's planner could read at all; and with one chunk at the
    origin, an item's ``storage_offsets`` are global coordinates.

    Objects are ``BytesStorageMetadata`` entries, read only when a state dict asks for them.
    ``planner_data`` is each name's nested path, so torch's ``_EmptyStateDictLoadPlanner``
    (``dcp_to_torch_save``) rebuilds the checkpoint's nesting, int keys included.
    """
    entries: dict[str, Any] = {}
    for name, entry in catalog.tensors.items():
        size = torch.Size(entry.shape)
        entries[name] = TensorStorageMetadata(TensorProperties(dtype=entry.dtype.torch), size,
                                              [ChunkStorageMetadata(torch.Size([0] * len(size)), size)])
    for name in catalog.objects:
        entries[name] = BytesStorageMetadata()
    planner_data = {name: catalog.nested_path(name) for name in entries}
    storage_meta = StorageMeta(checkpoint_id=path, load_id=uuid.uuid4().hex)
    return Metadata(state_dict_metadata=_Entries(entries, names), planner_data=planner_data, storage_meta=storage_meta)

