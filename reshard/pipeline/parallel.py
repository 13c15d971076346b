"""Conversions split over the ranks of a torchrun job.

Under ``torchrun --nproc_per_node N -m reshard convert ...`` every rank reads the (small)
source metadata and computes the same plan; each rank then writes its share of the output
files into one staging folder on the shared filesystem, and rank 0 writes what comes last
(DCP ``.metadata``) and renames the output into place after a barrier. Failures anywhere are
shared, so no rank waits forever and no partial output is committed.

The command line starts the job's process group (``torchrun_group``); a library call uses the
group its caller made (``current_workers``) and never starts one.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from reshard.core.errors import ReshardError, UsageError
from reshard.core.pieces import OutputFile

__all__ = ["Workers", "world", "current_workers", "torchrun_group", "split_files", "mark_shared", "said_by_rank_0"]


class RankFailedError(ReshardError):
    """Another rank of the job failed; its message is repeated here."""


@dataclass
class Workers:
    rank: int
    world_size: int

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        import torch.distributed as dist

        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank (small values only)."""
        import torch.distributed as dist

        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, value)
        return everyone

    def check(self, error: BaseException | None) -> None:
        """A barrier that also shares failures: raise on every rank if any rank failed."""
        import torch.distributed as dist

        mine = None if error is None else f"{type(error).__name__}: {error}"
        everyone: list[str | None] = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        if error is not None:
            mark_shared(error)
            raise error
        failed = [(r, m) for r, m in enumerate(everyone) if m is not None]
        if failed:
            rank, message = failed[0]
            raise mark_shared(RankFailedError(f"rank {rank} failed: {message}"))


def mark_shared(error: BaseException) -> BaseException:
    """``error``, marked as known to every rank of the job, rank 0 included: the command line
    prints it on rank 0 only (``said_by_rank_0``)."""
    error.reshard_shared = True  # type: ignore[attr-defined]
    return error


def said_by_rank_0(error: BaseException) -> bool:
    """Whether this process is a rank other than 0 of a torchrun job and rank 0 prints
    ``error`` too: an error the ranks shared, or one every rank meets alike (a usage error: the
    same options on every rank). Printed once, not once per rank."""
    if not _torchrun_env() or os.environ.get("RANK", "0") == "0":
        return False
    return getattr(error, "reshard_shared", False) or isinstance(error, UsageError) or (
        isinstance(getattr(error, "exit_code", None), int) and hasattr(error, "format_message"))  # option parsing


def _torchrun_env() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ


def _torch_loaded() -> bool:
    """Whether torch is imported: a process group cannot exist before it is, and a command
    that needs no torch should not import it to find that out."""
    return "torch" in sys.modules


def world() -> tuple[int, int]:
    """(rank, world size) in the process group this process belongs to; (0, 1) without one."""
    if not _torch_loaded():
        return 0, 1
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def current_workers() -> Workers | None:
    """The process group this process already belongs to, or None when it runs alone. A
    library call never starts one: under torchrun without a group every rank would write the
    same output, so that is refused, saying what to do."""
    rank, size = world()
    if size > 1:
        return Workers(rank, size)
    if _torch_loaded():
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return None  # a group of one
    if _torchrun_env():
        raise UsageError(
            f"this process is one of {os.environ['WORLD_SIZE']} torchrun workers and no process group is initialized: "
            "call torch.distributed.init_process_group() first (the ranks then split the conversion), or run it in "
            "one process")
    return None


@contextlib.contextmanager
def torchrun_group(timeout_s: float = 1800.0) -> Iterator[int]:
    """For ``reshard`` commands launched by torchrun: a gloo group for the command's duration
    (none when the process runs alone or already has one); yields this process's rank."""
    if not _torchrun_env():
        yield world()[0]
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        yield world()[0]
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        yield dist.get_rank()
    finally:
        dist.destroy_process_group()


def split_files(files: list[OutputFile], world_size: int) -> list[list[int]]:
    """File indices per rank, balanced by bytes (largest first onto the least loaded rank);
    deterministic, so every rank computes the same split."""
    shares: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(files)), key=lambda i: (-files[i].size, i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += files[i].size
    return [sorted(s) for s in shares]
