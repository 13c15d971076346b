"""Conversions split over the ranks of a torchrun job.

Under ``torchrun --nproc_per_node N -m reshard convert ...`` every rank reads the (small)
source metadata and computes the same plan; each rank then writes its share of the output
files into one staging folder on the shared filesystem, and rank 0 writes what comes last
(DCP ``.metadata``) and renames the output into place after a barrier. Failures anywhere are
shared, so no rank waits forever and no partial output is committed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from reshard.errors import ReshardError
from reshard.formats.pieces import FileLayout

__all__ = ["Workers", "join_workers", "split_files"]


class RankFailedError(ReshardError):
    """Another rank of the job failed; its message is repeated here."""


@dataclass
class Workers:
    rank: int
    world_size: int
    owns_group: bool  # we started the process group, so we end it

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
            raise error
        failed = [(r, m) for r, m in enumerate(everyone) if m is not None]
        if failed:
            rank, message = failed[0]
            raise RankFailedError(f"rank {rank} failed: {message}")

    def close(self) -> None:
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def join_workers(timeout_s: float = 1800.0) -> Workers | None:
    """The torchrun job this process is part of, or None when it runs alone."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return Workers(dist.get_rank(), dist.get_world_size(), owns_group=False) if dist.get_world_size() > 1 else None
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
        return None
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return Workers(dist.get_rank(), dist.get_world_size(), owns_group=True)


def split_files(files: list[FileLayout], world_size: int) -> list[list[int]]:
    """File indices per rank, balanced by bytes (largest first onto the least loaded rank);
    deterministic, so every rank computes the same split."""
    shares: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(files)), key=lambda i: (-files[i].size, i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += files[i].size
    return [sorted(s) for s in shares]
