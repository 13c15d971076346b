"""``rank0`` mode: rank 0 reads the checkpoint and sends every other rank exactly its boxes.

* ``send_boxes`` (rank 0): reads each distinct box once and sends it to the ranks that hold
  it (``isend``); a tensor that every rank holds whole goes by ``broadcast``. Two send
  buffers rotate, so reading the next message overlaps sending the last, and rank 0 holds
  about the budget beyond its own shard. Its own boxes are read straight into its tensors
  while its sends are on the wire.
* ``receive_boxes`` (every other rank): receives the same messages in the same order.

Messages: a slab of at least ``_ALONE`` bytes travels alone, and a receiver takes it straight
into its tensor when the memory is contiguous and of the stored dtype; smaller slabs bound for
the same ranks are packed, each at an aligned offset, into messages of up to ``_PACK`` bytes
(a model's norms and biases: one message, not one each), which receivers take into scratch
and copy out, cast on the way. Sender and receivers agree on the messages without talking:
both cut the plan with ``messages(plan)``. Under NCCL the send buffers are pinned host memory
copied to the GPU as they go out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist

from reshard.core.boxes import Box, c_order_slabs
from reshard.core.catalog import TensorEntry
from reshard.pipeline.progress import Progress
from reshard.runtime.load_plan import LoadPlan, TransferItem
from reshard.runtime.runs import LocatedChunks
from reshard.runtime.targets import Slot
from reshard.runtime.transfer import BoxReader, read_boxes

__all__ = ["Message", "messages", "send_boxes", "receive_boxes"]

_ALONE = 1 << 20  # a slab of at least this many bytes is a message of its own
_PACK = 16 << 20  # smaller slabs are packed into messages of up to this many bytes
_ALIGN = 64  # where each packed slab starts: any dtype's view of the buffer is aligned


@dataclass(frozen=True)
class Part:
    item: TransferItem
    slab: Box
    at: int  # byte offset in its message

    @property
    def nbytes(self) -> int:
        return self.slab.numel * self.item.dtype.itemsize


@dataclass
class Message:
    """What one send carries: ``parts`` at their offsets, for the ranks ``to`` (None: every
    rank, by ``broadcast``)."""

    to: tuple[int, ...] | None
    parts: list[Part] = field(default_factory=list)
    nbytes: int = 0

    def add(self, item: TransferItem, slab: Box) -> None:
        at = -(-self.nbytes // _ALIGN) * _ALIGN
        part = Part(item, slab, at)
        self.parts.append(part)
        self.nbytes = at + part.nbytes


def messages(plan: LoadPlan) -> Iterator[Message]:
    """The messages of ``plan``, in the order rank 0 sends them and the receivers take them."""
    alone = min(_ALONE, plan.slab_bytes)
    limit = max(alone, min(_PACK, plan.slab_bytes))
    pending: Message | None = None
    for item in plan.items:
        for box, ranks in item.boxes:
            to = None if item.broadcast else tuple(r for r in ranks if r != 0)
            if to == ():
                continue  # rank 0's alone
            for slab in c_order_slabs(box, item.dtype.itemsize, plan.slab_bytes):
                n = slab.numel * item.dtype.itemsize
                if n >= alone:
                    single = Message(to)
                    single.add(item, slab)
                    yield single
                    continue
                if pending is not None and (pending.to != to or -(-pending.nbytes // _ALIGN) * _ALIGN + n > limit):
                    yield pending
                    pending = None
                if pending is None:
                    pending = Message(to)
                pending.add(item, slab)
    if pending is not None:
        yield pending


class _SendBuffer:
    """A message's worth of host memory (pinned under NCCL, with its device twin), and the
    sends still reading it: it is refilled only once they are done."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        on_gpu = device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
        self.wire = torch.empty(nbytes, dtype=torch.uint8, device=device) if on_gpu else None
        self.copied = torch.cuda.Event() if on_gpu else None
        self.works: list[dist.Work] = []

    def busy(self) -> bool:
        return any(not w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works.clear()
        if self.copied is not None:
            self.copied.synchronize()

    def view(self, part: Part) -> torch.Tensor:
        return _view(self.host, part)

    def to_wire(self, nbytes: int) -> torch.Tensor:
        """What goes on the wire: the host bytes themselves on CPU, their device twin under NCCL."""
        host = self.host[:nbytes]
        if self.wire is None or self.copied is None:  # both, or neither (on CPU)
            return host
        wire = self.wire[:nbytes]
        wire.copy_(host, non_blocking=True)
        self.copied.record()
        return wire


def _view(buffer: torch.Tensor, part: Part) -> torch.Tensor:
    """``part``'s slab in a message's bytes, as a tensor of its dtype and sizes."""
    return buffer[part.at: part.at + part.nbytes].view(part.item.dtype).view(part.slab.sizes)


def send_boxes(plan: LoadPlan, catalog_tensors: Mapping[str, TensorEntry], slots: Mapping[str, Slot],
               device: torch.device, progress: Progress) -> int:
    """Rank 0: read every distinct box once and send it to the ranks holding it; read its own."""
    located = LocatedChunks(catalog_tensors[i.source] for i in plan.items)
    size = max((m.nbytes for m in messages(plan)), default=0)
    ring = [_SendBuffer(size, device) for _ in range(2)] if size else []
    # Rank 0's own boxes are read by a thread of their own while the sends are on the wire
    # (the kernel copies without the interpreter lock).
    # Those others hold too are sent from the send buffer, which progress counts.
    own = [(catalog_tensors[i.source], slots[i.target].region(box), box, ranks == (0,))
           for i in plan.items if not i.broadcast for box, ranks in i.boxes if 0 in ranks]
    own_reader = BoxReader(located, plan.slab_bytes)

    def read_own() -> None:
        read_boxes(own_reader, [(e, into, box) for e, into, box, alone in own if alone], progress)
        read_boxes(own_reader, [(e, into, box) for e, into, box, alone in own if not alone], Progress(0, "", enabled=False))

    with ThreadPoolExecutor(1) as pool:
        own_done = pool.submit(read_own)
        reader = BoxReader(located, plan.slab_bytes)
        try:
            for turn, msg in enumerate(messages(plan)):
                buf = ring[turn % len(ring)]
                buf.wait()
                for part in msg.parts:
                    reader.add(catalog_tensors[part.item.source], buf.view(part), part.slab)
                reader.flush()
                wire = buf.to_wire(msg.nbytes)
                if msg.to is None:
                    for b in ring:  # a collective after pending sends would leave receivers waiting in order
                        b.wait()
                    dist.broadcast(wire, src=0)
                    for part in msg.parts:
                        slots[part.item.target].region(part.slab).copy_(buf.view(part))
                else:
                    # isend gives None only to a rank outside the group; this one is in the default group
                    buf.works.extend(cast("dist.Work", dist.isend(wire, dst=r)) for r in msg.to)
                progress.update(sum(p.nbytes for p in msg.parts))
            for b in ring:
                b.wait()
        finally:
            reader.close()
            own_done.result()
            own_reader.close()
    return plan.total_bytes


def receive_boxes(plan: LoadPlan, slots: Mapping[str, Slot], device: torch.device) -> int:
    """Every rank but 0: receive this rank's messages, in the order rank 0 sends them."""
    scratch: torch.Tensor | None = None
    done, rank = 0, dist.get_rank()
    for msg in messages(plan):
        if msg.to is not None and rank not in msg.to:
            continue
        regions = [slots[p.item.target].region(p.slab) for p in msg.parts]
        only = regions[0] if len(regions) == 1 else None
        direct = only is not None and only.is_contiguous() and only.dtype == msg.parts[0].item.dtype \
            and only.device == device
        if direct:
            assert only is not None  # direct says so
            wire = only
        else:
            if scratch is None or scratch.numel() < msg.nbytes:
                scratch = torch.empty(max(msg.nbytes, min(plan.slab_bytes, _PACK)), dtype=torch.uint8, device=device)
            wire = scratch[:msg.nbytes]
        if msg.to is None:
            dist.broadcast(wire, src=0)
        else:
            dist.recv(wire, src=0)
        if not direct:
            for part, region in zip(msg.parts, regions):
                region.copy_(_view(wire, part))
        done += sum(p.nbytes for p in msg.parts)
    return done
