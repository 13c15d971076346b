"""Start the training loop on N ranks: spawned here, or as one rank of a torchrun job.

``reshard train --nproc N`` spawns the ranks itself through ``reshard.runtime.world.run_world`` (a
``file://`` rendezvous in a temp dir, deadlines, the failing rank's traceback re-raised).
Under torchrun (``RANK`` and ``WORLD_SIZE`` set) this process is one rank and joins the job's
``env://`` rendezvous. The backend is gloo on CPU; NCCL when every rank has its own GPU.

A rank that stops on a ``ReshardError`` (a checkpoint that does not match the model, a
corrupt file) records it, and the parent raises the same error: the CLI still answers bad
input with exit 2 and one line, not a rank's traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reshard.core import errors
from reshard.core.errors import ReshardError, UsageError
from reshard.core.log import to_stream
from reshard.runtime.world import run_world
from reshard.train.checkpoint import latest_checkpoint
from reshard.train.loop import TRAIN_LOG, TrainConfig, TrainResult, check_config, train

__all__ = ["launch", "spawn", "train_json", "under_torchrun"]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _use_cuda(local_ranks: int, device: str) -> bool:
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device {device!r}: choose auto, cpu or cuda")
    if device == "cpu":
        return False
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
    if device == "cuda" and not enough:
        raise UsageError(f"--device cuda needs {local_ranks} GPUs on this node, found "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    return enough


def _backend(cuda: bool) -> str:
    # gloo stays available for CPU-side collectives (object broadcasts) next to NCCL.
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def _run_rank(rank: int, world_size: int, fn: Any, args: tuple, tmp: str, cuda: bool) -> None:
    """One spawned rank: (re)join with the right backend, run ``fn(*args)``; rank 0 writes its
    JSON-able result, a rank stopped by a ReshardError writes that. ``run_world`` starts every
    rank on gloo; a GPU run rejoins on a second file store with NCCL."""
    os.environ["LOCAL_RANK"] = os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    if not cuda:  # as torchrun does: N ranks on shared cores, not N times the cores in threads
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    else:
        dist.destroy_process_group()
        dist.init_process_group(_backend(True), init_method=f"file://{tmp}/nccl-store", rank=rank,
                                world_size=world_size)
    try:
        result = fn(*args)
    except ReshardError as e:
        Path(tmp, f"error-{rank}.json").write_text(json.dumps([type(e).__name__, str(e)]))
        raise
    if rank == 0:
        Path(tmp, "result.json").write_text(json.dumps(result))


def spawn(fn: Any, nproc: int, *args: Any, device: str = "auto", timeout: float = 3600.0) -> Any:
    """Run ``fn(*args)`` on ``nproc`` spawned ranks (``fn`` module-level); rank 0's JSON-able
    return value."""
    cuda = _use_cuda(nproc, device)
    with tempfile.TemporaryDirectory(prefix="reshard-train-") as tmp:
        try:
            run_world(_run_rank, nproc, fn, args, tmp, cuda, timeout=timeout)
        except Exception:
            recorded = sorted(Path(tmp).glob("error-*.json"))
            if recorded:
                kind, message = json.loads(recorded[0].read_text())
                cls = getattr(errors, kind, None)
                cls = cls if isinstance(cls, type) and issubclass(cls, ReshardError) else ReshardError
                raise cls(message) from None
            raise
        return json.loads(Path(tmp, "result.json").read_text())


@contextlib.contextmanager
def _log_on_stdout(enabled: bool) -> Iterator[None]:
    """The run's per-step lines on this process's stdout (rank 0 says them), as ``reshard
    train`` shows them; a process that launches training is the one place that decides where
    its log goes."""
    if not enabled:
        yield
        return
    with to_stream(sys.stdout, logging.INFO, TRAIN_LOG):
        yield


def train_json(cfg: TrainConfig) -> dict[str, Any]:
    """``train`` with a JSON-able result, for ``spawn``."""
    with _log_on_stdout(cfg.log):
        return train(cfg).to_json()


def launch(cfg: TrainConfig, nproc: int | None = None, *, device: str = "auto", timeout: float = 3600.0) -> TrainResult:
    """Train with ``cfg`` on ``nproc`` ranks (default: the mesh's size), spawned here; under
    torchrun, as this process's rank of the job."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if nproc is not None and nproc != world:
            raise UsageError(f"--nproc {nproc} but torchrun started {world} ranks; leave --nproc out under torchrun")
        check_config(cfg, world)
        cuda = _use_cuda(int(os.environ.get("LOCAL_WORLD_SIZE", world)), device)
        dist.init_process_group(_backend(cuda))
        try:
            with _log_on_stdout(cfg.log):
                return train(cfg)
        finally:
            dist.destroy_process_group()
    ranks = check_config(cfg).world_size
    nproc = ranks if nproc is None else nproc
    check_config(cfg, nproc)
    if cfg.resume:
        latest_checkpoint(Path(cfg.resume))  # a missing source fails here, before any rank starts
    return TrainResult.from_json(spawn(train_json, nproc, cfg, device=device, timeout=timeout))
