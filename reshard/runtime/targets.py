"""The live side of a load: every tensor of the caller's state dict and the box of the global
tensor that this rank holds.

A plain tensor (a single process, DDP, an optimizer's ``step``) is held whole by every rank. A
DTensor (FSDP2 ``fully_shard`` on a 1-D or 2-D mesh) is held as one box per rank, computed by
torch's own rule, the one DCP saves with, so what we fill is exactly what torch would; under
FSDP over tensor parallelism (``_StridedShard``) a rank may hold several runs of rows, one box
each.
Only ``SlotMeta`` travels between ranks: it is small, plain and picklable.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from reshard.core import torch_compat as _torch_compat
from reshard.core.boxes import Box, full_box
from reshard.core.errors import UnsupportedFormatError, UsageError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["SlotMeta", "Slot", "flatten_state_dict", "make_slots", "storage_aliases"]


@dataclass(frozen=True)
class SlotMeta:
    """What rank 0 needs to know about another rank's tensor to send it its parts."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: tuple[Box, ...]  # this rank's parts, global coordinates; none when the rank holds nothing

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.boxes)


@dataclass
class Slot:
    name: str
    meta: SlotMeta
    local: torch.Tensor  # this rank's parts, written in place
    origins: tuple[tuple[int, ...], ...]  # where each of ``meta.boxes`` starts in ``local``

    def region(self, box: Box) -> torch.Tensor:
        """The view of ``local`` that holds ``box`` (global coordinates, inside one of this
        rank's boxes)."""
        for part, origin in zip(self.meta.boxes, self.origins):
            if part.contains(box):
                moved = box.shifted(part.offsets).shifted(tuple(-o for o in origin))
                return self.local[moved.as_slices()]
        raise ValueError(f"{self.name!r}: {box} is not held by this rank")


def flatten_state_dict(state_dict: Mapping[Any, Any], prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(flat name, tensor) for every tensor leaf, named the way DCP flattens nested state
    dicts (``{"optim": {"state": {"w": {"exp_avg": t}}}}`` is ``optim.state.w.exp_avg``), so a
    state dict's names meet a checkpoint's without translation. Non-tensor leaves are skipped."""
    for key, value in state_dict.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, Mapping):
            yield from flatten_state_dict(value, name + ".")
        elif isinstance(value, (list, tuple)):
            yield from flatten_state_dict(dict(enumerate(value)), name + ".")


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """(global start, length, local start) of each run of consecutive global indices."""
    if index.numel() == 0:
        return []
    breaks = (torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1).tolist()
    starts, ends = [0, *breaks], [*breaks, index.numel()]
    return [(int(index[a]), b - a, a) for a, b in zip(starts, ends)]


def _dtensor_parts(name: str, t: DTensor, seen: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]]
                   ) -> tuple[tuple[Box, ...], tuple[tuple[int, ...], ...], torch.Tensor]:
    """This rank's boxes of DTensor ``t``, where each starts in its local tensor, and the local
    tensor: one box for ``Shard(d)``/``Replicate()``; under ``_StridedShard`` (FSDP over TP)
    one box per run of consecutive rows the rank holds, by torch's own index rule. ``seen``:
    the boxes already worked out in this call, by shape, mesh and placements (a model's
    tensors come in a few shapes)."""
    from torch.distributed.tensor import Replicate, Shard

    strided = _torch_compat.STRIDED_SHARD
    for p in t.placements:
        # Partial sums are not a region of the global tensor.
        if type(p) not in (Shard, Replicate) and not (strided is not None and isinstance(p, strided)):
            raise UnsupportedFormatError(
                f"{name!r} is a DTensor with placement {p}; reshard loads Shard(d), _StridedShard and "
                "Replicate() placements: load into a model sharded that way, then redistribute"
            )
    local = t.to_local()
    if all(type(p) in (Shard, Replicate) for p in t.placements):
        key = (tuple(t.shape), t.device_mesh, tuple(t.placements))
        found = seen.get(key)
        if found is None:
            found = seen[key] = _torch_compat.dtensor_local_box(*key)
        offsets, sizes = found
        boxes: tuple[Box, ...] = (Box(offsets, sizes),)
        origins: tuple[tuple[int, ...], ...] = ((0,) * len(sizes),)
    else:
        index = _torch_compat.dtensor_local_indices(tuple(t.shape), t.device_mesh, tuple(t.placements))
        sizes = tuple(len(i) for i in index) if index is not None else (0,) * t.ndim
        runs = [_runs(i) for i in index] if index is not None else []
        parts = list(itertools.product(*runs)) if runs and all(runs) else []
        boxes = tuple(Box(tuple(r[0] for r in part), tuple(r[1] for r in part)) for part in parts)
        origins = tuple(tuple(r[2] for r in part) for part in parts)
    if tuple(local.shape) != tuple(sizes):
        raise UnsupportedFormatError(
            f"{name!r}: local shard has shape {list(local.shape)}, torch's layout rule says {list(sizes)} "
            "(padded or uneven custom sharding); reshard cannot tell which part of the tensor it holds"
        )
    if math.prod(sizes) == 0:
        return (), (), local
    return boxes, origins, local


def make_slots(state_dict: Mapping[Any, Any]) -> dict[str, Slot]:
    """One ``Slot`` per tensor of ``state_dict``, keyed by flat name."""
    from torch.distributed.tensor import DTensor

    slots = {}
    seen: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for name, t in flatten_state_dict(state_dict):
        if isinstance(t, DTensor):
            boxes, origins, local = _dtensor_parts(name, t, seen)
        else:
            boxes, origins, local = (full_box(tuple(t.shape)),), ((0,) * t.ndim,), t
            if t.numel() == 0:
                boxes, origins = (), ()
        if local.device.type == "meta":
            raise UsageError(
                f"{name!r} is on the meta device and has no storage to load into; materialize the "
                "model first, e.g. model.to_empty(device='cpu') (or 'cuda') after fully_shard"
            )
        slots[name] = Slot(name, SlotMeta(tuple(t.shape), t.dtype, boxes), local, origins)
    return slots


def storage_aliases(slots: Mapping[str, Slot]) -> list[tuple[str, ...]]:
    """Groups of names whose local tensors are the same memory (tied embeddings): one load
    fills them all, and a checkpoint that stores only one of the names is complete."""
    groups: dict[tuple, list[str]] = {}
    for name, slot in slots.items():
        t = slot.local
        if t.numel() == 0:
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        groups.setdefault(key, []).append(name)
    return [tuple(names) for names in groups.values() if len(names) > 1]
