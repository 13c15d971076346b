"""The live side of a load: every tensor of the caller's state dict and the box of the global
tensor that this rank holds.

A plain tensor (a single process, DDP, an optimizer's ``step``) is held whole by every rank. A
DTensor (FSDP2 ``fully_shard`` on a 1-D or 2-D mesh) is held as one box per rank, computed by
torch's own rule, the one DCP saves with, so what we fill is exactly what torch would.
Only ``SlotMeta`` travels between ranks: it is small, plain and picklable.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from reshard import _torch_compat
from reshard.boxes import Box, full_box
from reshard.errors import UnsupportedFormatError, UsageError

__all__ = ["SlotMeta", "Slot", "flatten_state_dict", "make_slots", "storage_aliases"]


@dataclass(frozen=True)
class SlotMeta:
    """What rank 0 needs to know about another rank's tensor to send it its part."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    box: Box  # this rank's part, global coordinates; empty when the rank holds nothing


@dataclass
class Slot:
    name: str
    meta: SlotMeta
    local: torch.Tensor  # this rank's part, shape ``meta.box.sizes``; written in place

    def region(self, box: Box) -> torch.Tensor:
        """The view of ``local`` that holds ``box`` (global coordinates, inside this rank's box)."""
        return self.local[box.shifted(self.meta.box.offsets).as_slices()]


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


def _dtensor_box(name: str, t: torch.Tensor) -> tuple[Box, torch.Tensor]:
    from torch.distributed.tensor import Replicate, Shard

    for p in t.placements:
        # Strided shards (FSDP over TP) and partial sums are not one box of the global tensor.
        if type(p) not in (Shard, Replicate):
            raise UnsupportedFormatError(
                f"{name!r} is a DTensor with placement {p}; reshard loads Shard(d) and Replicate() "
                "placements only: load into a model sharded that way, then redistribute"
            )
    offsets, sizes = _torch_compat.dtensor_local_box(tuple(t.shape), t.device_mesh, tuple(t.placements))
    local = t.to_local()
    if tuple(local.shape) != sizes:
        raise UnsupportedFormatError(
            f"{name!r}: local shard has shape {list(local.shape)}, torch's layout rule says {list(sizes)} "
            "(padded or uneven custom sharding); reshard cannot tell which part of the tensor it holds"
        )
    return Box(offsets, sizes), local


def make_slots(state_dict: Mapping[Any, Any]) -> dict[str, Slot]:
    """One ``Slot`` per tensor of ``state_dict``, keyed by flat name."""
    from torch.distributed.tensor import DTensor

    slots = {}
    for name, t in flatten_state_dict(state_dict):
        if isinstance(t, DTensor):
            box, local = _dtensor_box(name, t)
        else:
            box, local = full_box(tuple(t.shape)), t
        if local.device.type == "meta":
            raise UsageError(
                f"{name!r} is on the meta device and has no storage to load into; materialize the "
                "model first, e.g. model.to_empty(device='cpu') (or 'cuda') after fully_shard"
            )
        slots[name] = Slot(name, SlotMeta(tuple(t.shape), t.dtype, box), local)
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
