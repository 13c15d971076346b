"""Run a function on a local multi-process gloo world (tests, the example, `reshard train`).

Each world rendezvous through a ``file://`` store in its own temp dir (no ports to collide),
every wait has a deadline, and a failing rank's traceback is re-raised in the caller.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

__all__ = ["run_world"]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, store: str, args: tuple, errdir: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        try:
            fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        Path(errdir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    # Done and the group destroyed: leave without running C++ static destructors, where a
    # gloo thread still joinable at exit aborts the process ("terminate called without an
    # active exception": seen once in a full test run on a 2-core machine).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 1800.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise on any failure.

    ``fn`` must be a module-level function (it is pickled into the spawned processes).
    """
    with tempfile.TemporaryDirectory(prefix="reshard-world-") as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.start_processes(
            _entry, args=(fn, world_size, store, args, tmp), nprocs=world_size, join=False, start_method="spawn"
        )
        import time

        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gloo world of {world_size} ranks did not finish in {timeout:.0f}s")
        except mp.ProcessRaisedException as e:
            errs = sorted(Path(tmp).glob("rank*.err"))
            detail = "\n".join(p.read_text() for p in errs) or str(e)
            raise RuntimeError(f"a rank failed:\n{detail}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
