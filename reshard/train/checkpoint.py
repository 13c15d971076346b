"""Training checkpoints: what the loop saves, and how it finds its place again on resume.

A checkpoint is one ``dcp.save`` of the nested state dict every reshard component agrees on::

    {"model": get_state_dict's model part, "optim": its optimizer part (keyed by FQN),
     "train": {"step", "data_position", "scheduler": LambdaLR.state_dict(), "model_config"}}

written into a hidden staging folder and renamed into place by rank 0 once every rank has
written (``StagedOutput``), so a crash mid-save never leaves a checkpoint that looks whole.
Resuming reads it back through ``reshard.load_model``, which takes any format and any mesh;
the ``train.*`` objects travel as flat names (``train.scheduler.lr_lambdas.0.warmup``) and
are nested again here.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from reshard.core.errors import CheckpointNotFoundError
from reshard.pipeline.staging import StagedOutput
from reshard.train.model import ModelConfig

__all__ = ["save_checkpoint", "train_objects", "latest_checkpoint", "state_digest", "unflatten"]

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, step: int, data_position: int,
                    model_cfg: ModelConfig) -> Path:
    """Save on every rank (collective) into ``path``, atomically; returns ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd, "train": {
        "step": step, "data_position": data_position, "scheduler": scheduler.state_dict(),
        "model_config": asdict(model_cfg)}}
    # fsync: a training checkpoint is what a job restarts from after a node dies.
    staged = StagedOutput(path, is_dir=True, fsync=True)
    entered = False
    try:
        shared: list[Any] = [None]
        if _rank() == 0:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                staged.__enter__()
                entered = True
                shared[0] = str(staged.staging)
            except Exception as e:  # every rank must learn of it, or they wait in dcp.save
                shared[0] = e
        if dist.is_initialized():
            dist.broadcast_object_list(shared, src=0)
        if isinstance(shared[0], BaseException):
            raise shared[0]
        dcp.save(state, checkpoint_id=shared[0])
        if dist.is_initialized():
            dist.barrier()
        if entered:
            staged.commit()
    finally:
        if entered:
            staged.__exit__(None, None, None)
    return path


def unflatten(objects: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The nested dict under ``prefix`` of DCP-flattened objects; all-digit keys become lists
    (``lr_lambdas.0.warmup`` -> ``{"lr_lambdas": [{"warmup": ...}]}``)."""
    root: dict[str, Any] = {}
    for name, value in objects.items():
        if not name.startswith(prefix):
            continue
        *parents, leaf = name[len(prefix):].split(".")
        node = root
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    items = {k: _lists(v) for k, v in node.items()}
    if items and all(k.isdigit() for k in items):
        return [items[k] for k in sorted(items, key=int)]
    return items


def train_objects(objects: Mapping[str, Any]) -> dict[str, Any]:
    """``{"step", "data_position", "scheduler", "model_config"}`` as far as the checkpoint has them."""
    return unflatten(objects, "train.")


def latest_checkpoint(path: Path) -> Path:
    """``path`` itself when it is a checkpoint; the highest ``step-N`` inside a ``--ckpt-dir``."""
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such checkpoint to resume from")
    if path.is_dir() and not (path / ".metadata").exists():
        steps = [(int(m.group(1)), p) for p in path.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
        if steps:
            return max(steps)[1]
    return path


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 over the bytes of every full parameter and optimizer-state tensor, by name.

    Collective (gathers each sharded tensor in turn); equal digests on two meshes mean the
    training state is bit-for-bit the same, however it is sharded.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    msd, osd = get_state_dict(model, optimizer)
    flat = {f"model.{k}": cast(torch.Tensor, v) for k, v in msd.items()}  # a model's state: tensors only
    # torch types "state" as any optimizer state value; an optimizer's is param -> {name: value}
    for fqn, st in cast("dict[str, dict[str, Any]]", osd["state"]).items():
        flat.update({f"optim.state.{fqn}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    h = hashlib.sha256()
    for name in sorted(flat):
        t = flat[name]
        t = t.full_tensor() if isinstance(t, DTensor) else t
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
