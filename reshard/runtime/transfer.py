"""Moving a load plan's bytes into the live tensors, slab by slab, under a memory budget.

Three ways, one per role:

* ``read_local``: this rank reads its own boxes from the checkpoint (``parallel`` mode, or a
  single process).
* ``send_boxes`` (rank 0 in ``rank0`` mode): reads each distinct box once, in C-order slabs,
  and sends every slab to exactly the ranks that hold that box (``isend``); a tensor that
  every rank holds whole goes by ``broadcast``. Two send buffers rotate, so reading the next
  slab overlaps sending the last, and rank 0 never holds more than about the budget.
* ``receive_boxes`` (every other rank): receives the same slabs in the same order, straight
  into its tensor when the memory is contiguous and of the stored dtype, else through a
  scratch slab that is cast on the way in.

Sender and receivers agree on the order without talking: both walk the plan's items in order
and cut each box with ``c_order_slabs(box, itemsize, plan.slab_bytes)``. Under NCCL the
send buffers are pinned host memory copied to the GPU as they go out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import cast

import torch
import torch.distributed as dist

from reshard.core.boxes import Box, c_order_slabs
from reshard.core.catalog import TensorEntry
from reshard.core.dtypes import DType
from reshard.core.fd_pool import FdPool
from reshard.pipeline.assemble import fill_from_sources
from reshard.pipeline.plan import sources_for
from reshard.pipeline.progress import Progress
from reshard.runtime.load_plan import LoadPlan
from reshard.runtime.targets import Slot

__all__ = ["OpenFiles", "read_box", "read_local", "send_boxes", "receive_boxes"]


class OpenFiles(FdPool):
    """Read-only descriptors of the source files, for the duration of a load."""


def read_box(out: torch.Tensor, box: Box, entry: TensorEntry, files: OpenFiles) -> None:
    """Fill ``out`` (shape ``box.sizes``, any dtype or device) with ``box`` of ``entry``, as
    the engine fills a slab (``fill_from_sources``): rank 0's send buffer and CPU parameters
    take the stored runs they hold straight from the file."""
    fill_from_sources(out, box, sources_for(entry, box), files)


def read_local(plan: LoadPlan, catalog_tensors: Mapping[str, TensorEntry], slots: Mapping[str, Slot],
               progress: Progress) -> int:
    """Read this rank's own boxes straight into its tensors; returns the bytes read."""
    files, done = OpenFiles(), 0
    try:
        for item in plan.items:
            slot = slots.get(item.target)
            if slot is None:
                continue
            entry = catalog_tensors[item.source]
            for box in slot.meta.boxes:
                for slab in c_order_slabs(box, entry.dtype.itemsize, plan.slab_bytes):
                    read_box(slot.region(slab), slab, entry, files)
                    n = slab.numel * entry.dtype.itemsize
                    done += n
                    progress.update(n)
    finally:
        files.close()
    return done


class _SendBuffer:
    """A slab's worth of host memory (pinned under NCCL, with its device twin), and the sends
    still reading it: it is refilled only once they are done."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        on_gpu = device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
        self.wire = torch.empty(nbytes, dtype=torch.uint8, device=device) if on_gpu else None
        self.copied = torch.cuda.Event() if on_gpu else None
        self.works: list[dist.Work] = []

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works.clear()
        if self.copied is not None:
            self.copied.synchronize()

    def host_view(self, dtype: DType, sizes: tuple[int, ...]) -> torch.Tensor:
        return self.host[: math.prod(sizes) * dtype.itemsize].view(dtype.torch).view(sizes)

    def to_wire(self, host: torch.Tensor) -> torch.Tensor:
        """What goes on the wire: ``host`` itself on CPU, its device twin under NCCL."""
        if self.wire is None or self.copied is None:  # both, or neither (on CPU)
            return host
        wire = self.wire[: host.numel() * host.element_size()].view(host.dtype).view(host.shape)
        wire.copy_(host, non_blocking=True)
        self.copied.record()
        return wire


def send_boxes(plan: LoadPlan, catalog_tensors: Mapping[str, TensorEntry], slots: Mapping[str, Slot],
               device: torch.device, progress: Progress) -> int:
    """Rank 0: read every distinct box once and send each slab to the ranks holding it."""
    ring = [_SendBuffer(plan.slab_bytes, device) for _ in range(2)]
    files, turn, done = OpenFiles(), 0, 0

    def drain() -> None:
        for b in ring:
            b.wait()

    try:
        for item in plan.items:
            entry = catalog_tensors[item.source]
            own = slots.get(item.target)
            for box, ranks in item.boxes:
                for slab in c_order_slabs(box, entry.dtype.itemsize, plan.slab_bytes):
                    buf = ring[turn % len(ring)]
                    turn += 1
                    buf.wait()
                    host = buf.host_view(entry.dtype, slab.sizes)
                    read_box(host, slab, entry, files)
                    wire = buf.to_wire(host)
                    if item.broadcast:
                        drain()  # a collective after pending sends would leave receivers waiting in order
                        dist.broadcast(wire, src=0)
                    else:
                        # isend gives None only to a rank outside the group; this one is in the default group
                        buf.works.extend(cast("dist.Work", dist.isend(wire, dst=r)) for r in ranks if r != 0)
                    if 0 in ranks:
                        assert own is not None  # rank 0 holds this box: its slot is one of its own
                        own.region(slab).copy_(host)
                    n = slab.numel * entry.dtype.itemsize
                    done += n
                    progress.update(n)
        drain()
    finally:
        files.close()
    return done


def receive_boxes(plan: LoadPlan, slots: Mapping[str, Slot], device: torch.device) -> int:
    """Every rank but 0: receive this rank's slabs, in the order rank 0 sends them."""
    scratch: torch.Tensor | None = None
    done, rank = 0, dist.get_rank()
    for item in plan.items:
        slot = slots.get(item.target)
        if slot is None:
            continue
        mine = [box for box, ranks in item.boxes if rank in ranks]
        for slab in (s for box in mine for s in c_order_slabs(box, item.dtype.itemsize, plan.slab_bytes)):
            region = slot.region(slab)
            direct = region.is_contiguous() and region.dtype == item.dtype and region.device == device
            if direct:
                wire = region
            else:
                if scratch is None:
                    scratch = torch.empty(plan.slab_bytes, dtype=torch.uint8, device=device)
                wire = scratch[: slab.numel * item.dtype.itemsize].view(item.dtype).view(slab.sizes)
            if item.broadcast:
                dist.broadcast(wire, src=0)
            else:
                dist.recv(wire, src=0)
            if not direct:
                region.copy_(wire)
            done += slab.numel * item.dtype.itemsize
    return done
