"""Moving a load plan's bytes into the live tensors, under a memory budget.

Two ways, one per mode:

* ``read_local`` (here): this rank reads its own boxes from the checkpoint (``parallel``
  mode, or a single process).
* ``send_boxes`` / ``receive_boxes`` (``scatter``): rank 0 reads and sends every other rank
  its boxes (``rank0`` mode).

A box that is runs of its files and of the memory it goes to (the stored dtype, contiguous
host memory) is read by the kernel straight into place (``runs``); any other box is built
slab by slab (C-order slabs of the plan's ``slab_bytes``), cast on the way (``read_box``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from reshard.core.boxes import Box, c_order_slabs
from reshard.core.catalog import TensorEntry
from reshard.core.fd_pool import FdPool
from reshard.pipeline.assemble import fill_from_sources
from reshard.pipeline.plan import sources_for
from reshard.pipeline.progress import Progress
from reshard.runtime.load_plan import LoadPlan
from reshard.runtime.runs import LocatedChunks, Run, RunReader
from reshard.runtime.targets import Slot

__all__ = ["OpenFiles", "BoxReader", "read_box", "read_local", "read_boxes"]


class OpenFiles(FdPool):
    """Read-only descriptors of the source files, for the duration of a load."""


def read_box(out: torch.Tensor, box: Box, entry: TensorEntry, files: OpenFiles) -> None:
    """Fill ``out`` (shape ``box.sizes``, any dtype or device) with ``box`` of ``entry``, as
    the engine fills a slab (``fill_from_sources``): rank 0's send buffer and CPU parameters
    take the stored runs they hold straight from the file."""
    fill_from_sources(out, box, sources_for(entry, box), files)


class BoxReader:
    """Reads boxes of a load's stored tensors into memory: as runs where they are runs
    (collected, then read in file order), else slab by slab through ``read_box``."""

    def __init__(self, located: LocatedChunks, slab_bytes: int) -> None:
        self.located, self.slab_bytes = located, slab_bytes
        self.runs = RunReader(located.paths)
        self.files = OpenFiles()
        self._pending: list[Run] = []

    def add(self, entry: TensorEntry, into: torch.Tensor, box: Box) -> int:
        """Fill ``into`` (``box.sizes``) with ``box`` of ``entry``: now, or at the next
        ``flush`` when it is runs. Returns its bytes."""
        runs = self.located.runs(entry, into, box)
        if runs is not None:
            self._pending += runs
        else:
            for slab in c_order_slabs(box, entry.dtype.itemsize, self.slab_bytes):
                read_box(into[slab.shifted(box.offsets).as_slices()], slab, entry, self.files)
        return box.numel * entry.dtype.itemsize

    def flush(self) -> None:
        """Read the runs collected since the last flush."""
        if self._pending:
            self.runs.read(self._pending)
            self._pending = []

    def close(self) -> None:
        self.runs.close()
        self.files.close()


def read_boxes(reader: BoxReader, wanted: list[tuple[TensorEntry, torch.Tensor, Box]], progress: Progress) -> int:
    """Fill every ``(entry, into, box)`` of ``wanted``; returns the bytes. Runs are read in
    batches of about a slab, so progress moves."""
    done = batch = 0
    for entry, into, box in wanted:
        n = reader.add(entry, into, box)
        done += n
        batch += n
        if batch >= reader.slab_bytes:
            reader.flush()
            progress.update(batch)
            batch = 0
    reader.flush()
    progress.update(batch)
    return done


def read_local(plan: LoadPlan, catalog_tensors: Mapping[str, TensorEntry], slots: Mapping[str, Slot],
               progress: Progress) -> int:
    """Read this rank's own boxes straight into its tensors; returns the bytes read."""
    wanted = [(catalog_tensors[item.source], slot.region(box), box)
              for item in plan.items if (slot := slots.get(item.target)) is not None for box in slot.meta.boxes]
    reader = BoxReader(LocatedChunks(e for e, _, _ in wanted), plan.slab_bytes)
    try:
        return read_boxes(reader, wanted, progress)
    finally:
        reader.close()
