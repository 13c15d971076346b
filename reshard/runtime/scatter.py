"""``rank0`` mode: rank 0 reads the checkpoint and sends every other rank exactly its boxes.

* ``send_boxes`` (rank 0): reads each distinct box once and sends it to the ranks that hold
  it (``isend``); a tensor that every rank holds whole goes by ``broadcast``. ``_IN_FLIGHT``
  send buffers rotate, so reading the next message overlaps sending the last ones, and rank
  0 holds at most a slab (a quarter of the budget) beyond its own shard. Its own boxes are
  read straight into its tensors by a thread of their own while its sends are on the wire.
* ``receive_boxes`` (every other rank): receives the same messages in the same order, with
  receives posted ahead so the wire does not wait for Python between two messages.

Messages hold up to ``_MESSAGE`` bytes (``message_bytes``): boxes are cut where stored chunks
start (``TransferItem.cuts``), then into C-order slabs of that size; a slab of at least
``_ALONE`` bytes travels alone: rank 0 sends it from the page cache as it lies in its file (a
read-only mapping: no copy into a buffer) when it is one run of one file, and a receiver
takes it straight into its tensor when the memory is contiguous and of the stored dtype.
Smaller slabs bound for the same ranks are packed, each at an aligned offset (a model's norms
and biases: one message, not one each), which receivers take into scratch and copy out, cast
on the way. Sender and receivers agree on the messages without talking: both cut the plan
with ``messages(plan)``. Under NCCL the send buffers are pinned host memory copied to the GPU
as they go out.
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from reshard.core.boxes import Box, c_order_slabs
from reshard.core.catalog import TensorEntry
from reshard.core.errors import CorruptCheckpointError
from reshard.pipeline.progress import Progress
from reshard.runtime.load_plan import LoadPlan, TransferItem
from reshard.runtime.runs import LocatedChunks
from reshard.runtime.targets import Slot
from reshard.runtime.transfer import BoxReader, read_boxes

__all__ = ["Message", "messages", "message_bytes", "send_boxes", "receive_boxes"]

_ALONE = 1 << 20  # a slab of at least this many bytes is a message of its own
_MESSAGE = 16 << 20  # the most a message holds (less under a small budget): slabs are cut to it, small ones packed
_ALIGN = 64  # where each packed slab starts: any dtype's view of the buffer is aligned
_IN_FLIGHT = 4  # messages on the wire at once: rank 0's send buffers, a receiver's receives posted ahead


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


def _pieces(box: Box, cuts: tuple[int, ...]) -> Iterator[Box]:
    """``box`` cut along dim 0 where stored chunks start (``TransferItem.cuts``)."""
    if not box.ndim:
        yield box
        return
    start, end = box.offsets[0], box.ends[0]
    for cut in [c for c in cuts if start < c < end] + [end]:
        yield Box((start, *box.offsets[1:]), (cut - start, *box.sizes[1:]))
        start = cut


def message_bytes(plan: LoadPlan) -> int:
    """The most one message holds: ``_MESSAGE``, or a quarter of a slab under a small budget
    (``_IN_FLIGHT`` of them are on the wire at once)."""
    return max(1, min(_MESSAGE, plan.slab_bytes // _IN_FLIGHT))


def messages(plan: LoadPlan) -> Iterator[Message]:
    """The messages of ``plan``, in the order rank 0 sends them and the receivers take them."""
    limit = message_bytes(plan)
    alone = min(_ALONE, limit)
    pending: Message | None = None
    for item in plan.items:
        for box, ranks in item.boxes:
            to = None if item.broadcast else tuple(r for r in ranks if r != 0)
            if to == ():
                continue  # rank 0's alone
            for slab in (s for piece in _pieces(box, item.cuts) for s in c_order_slabs(piece, item.dtype.itemsize, limit)):
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
        self.mapped: mmap.mmap | None = None

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works.clear()
        self.mapped = None  # unmapped once nothing holds it: the sends are done
        if self.copied is not None:
            self.copied.synchronize()

    def map(self, path: Path, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of ``path`` from ``offset`` as they lie in the page cache (a read-only
        mapping, no copy), to send in place of the buffer; held until the sends are done."""
        skip = offset % mmap.ALLOCATIONGRANULARITY
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if offset + nbytes > size:  # a mapped page past the end would kill the process (SIGBUS), not raise
                raise CorruptCheckpointError(f"{path}: file ends at byte {size}, expected data up to byte "
                                             f"{offset + nbytes} (truncated?)")
            self.mapped = mmap.mmap(fd, nbytes + skip, prot=mmap.PROT_READ, offset=offset - skip, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        if hasattr(mmap, "MADV_WILLNEED"):
            self.mapped.madvise(mmap.MADV_WILLNEED)  # a cold file: read ahead while earlier messages go out
        with warnings.catch_warnings():  # the mapping is read-only; the tensor is only sent
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self.mapped, dtype=torch.uint8, count=nbytes, offset=skip)

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


def _one_run(located: LocatedChunks, catalog_tensors: Mapping[str, TensorEntry], msg: Message
             ) -> tuple[Path, int, int] | None:
    """(file, offset, bytes) when ``msg`` is one slab that lies as one run of one file, for
    other ranks only (rank 0 copies a broadcast into its own tensor)."""
    if msg.to is None or len(msg.parts) != 1:
        return None
    part = msg.parts[0]
    runs = located.file_runs(catalog_tensors[part.item.source], part.slab)
    if runs is None or len(runs) != 1:
        return None
    f, offset, _, n = runs[0]
    return located.paths[f], offset, n


def send_boxes(plan: LoadPlan, catalog_tensors: Mapping[str, TensorEntry], slots: Mapping[str, Slot],
               device: torch.device, progress: Progress) -> int:
    """Rank 0: read every distinct box once and send it to the ranks holding it; read its own."""
    located = LocatedChunks(catalog_tensors[i.source] for i in plan.items)
    size = max((m.nbytes for m in messages(plan)), default=0)
    ring = [_SendBuffer(size, device) for _ in range(_IN_FLIGHT)] if size else []
    # Rank 0's own boxes are read by a thread of their own while the sends are on the wire
    # (the kernel copies without the interpreter lock). Those others hold too are sent from
    # the send buffer, which progress counts.
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
                run = _one_run(located, catalog_tensors, msg) if device.type == "cpu" else None
                if run is not None:  # sent from the page cache as it lies: read into no buffer
                    wire = buf.map(*run)
                else:
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


@dataclass
class _Receive:
    """A message being received: where it lands (``wire``: a region of one tensor, or a view
    of ``scratch``) and what is left to do once it has."""

    msg: Message
    regions: list[torch.Tensor]
    wire: torch.Tensor
    scratch: torch.Tensor | None
    work: dist.Work | None = None

    def finish(self, free: list[torch.Tensor]) -> int:
        if self.work is not None:
            self.work.wait()
        if self.scratch is not None:
            for part, region in zip(self.msg.parts, self.regions):
                region.copy_(_view(self.wire, part))
            free.append(self.scratch)
        return sum(p.nbytes for p in self.msg.parts)


def receive_boxes(plan: LoadPlan, slots: Mapping[str, Slot], device: torch.device) -> int:
    """Every rank but 0: receive this rank's messages, in the order rank 0 sends them, with
    up to ``_IN_FLIGHT`` receives posted ahead: a message of one slab straight into its
    tensor's memory where it can (contiguous, the stored dtype), others into scratch (one per
    receive in flight), copied out and cast once received."""
    done, rank = 0, dist.get_rank()
    free: list[torch.Tensor] = []  # scratch not in use
    pending: deque[_Receive] = deque()
    for msg in messages(plan):
        if msg.to is not None and rank not in msg.to:
            continue
        # a collective waits for every receive posted before it; else at most _IN_FLIGHT at once
        while pending and (msg.to is None or len(pending) >= _IN_FLIGHT):
            done += pending.popleft().finish(free)
        regions = [slots[p.item.target].region(p.slab) for p in msg.parts]
        one = regions[0]
        if len(regions) == 1 and one.is_contiguous() and one.dtype == msg.parts[0].item.dtype and one.device == device:
            recv = _Receive(msg, regions, one, None)
        else:
            scratch = free.pop() if free else None
            if scratch is None or scratch.numel() < msg.nbytes:
                scratch = torch.empty(max(msg.nbytes, message_bytes(plan)), dtype=torch.uint8, device=device)
            recv = _Receive(msg, regions, scratch[:msg.nbytes], scratch)
        if msg.to is None:
            dist.broadcast(recv.wire, src=0)
            done += recv.finish(free)
        else:
            # irecv gives None only to a rank outside the group; this one is in the default group
            recv.work = cast("dist.Work", dist.irecv(recv.wire, src=0))
            pending.append(recv)
    while pending:
        done += pending.popleft().finish(free)
    return done
