"""reshard: convert and reshard PyTorch training checkpoints.

>>> import reshard
>>> cat = reshard.inspect("ckpt/")                  # what a checkpoint holds, any format
>>> reshard.convert("ckpt/", "model.safetensors", only="model")
>>> reshard.verify("ckpt/", "model.safetensors").equal
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.catalog import Catalog
from reshard.convert import ConvertResult, convert
from reshard.errors import ReshardError
from reshard.hub import PushResult, push
from reshard.verify import VerifyResult, verify

if TYPE_CHECKING:
    import torch

    from reshard.runtime import LoadResult

__all__ = ["inspect", "convert", "verify", "load_model", "load_state_dict", "push", "Catalog", "ConvertResult",
           "VerifyResult", "PushResult", "ReshardError"]
__version__ = "0.1.0"


def inspect(path: str | os.PathLike) -> Catalog:
    """The catalog of checkpoint ``path``: every tensor's shape, dtype and chunks, and the
    objects. Reads metadata only, never tensor data."""
    from reshard.formats.registry import detect_format

    path = Path(path)
    return detect_format(path).read(path)


def load_model(
    model: torch.nn.Module, source: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
    mode: str = "auto", keymap: Any = None, strict: bool = True, max_memory: str | int = "1GiB", *,
    progress: bool = True,
) -> LoadResult:
    """Load ``source`` into a plain, DDP or FSDP2 model (and its optimizer) on every rank; see
    ``reshard.runtime.load_model``. The runtime is imported on first use, so ``import reshard``
    stays light."""
    from reshard.runtime import load_model as _load_model

    return _load_model(model, source, optimizer, mode, keymap, strict, max_memory, progress=progress)


def load_state_dict(
    state_dict: Mapping[str, Any], source: str | os.PathLike, mode: str = "auto", keymap: Any = None,
    strict: bool = True, max_memory: str | int = "1GiB", *, progress: bool = True,
) -> LoadResult:
    """Fill a (sharded) state dict's tensors in place from ``source``; see
    ``reshard.runtime.load_state_dict``."""
    from reshard.runtime import load_state_dict as _load_state_dict

    return _load_state_dict(state_dict, source, mode, keymap, strict, max_memory, progress=progress)
