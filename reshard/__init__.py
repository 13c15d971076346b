"""reshard: convert and reshard PyTorch training checkpoints.

>>> import reshard
>>> cat = reshard.inspect("ckpt/")                  # what a checkpoint holds, any format
>>> reshard.convert("ckpt/", "model.safetensors", only="model")
>>> reshard.verify("ckpt/", "model.safetensors").equal
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.catalog import Catalog
from reshard.convert import ConvertResult, convert
from reshard.errors import ReshardError
from reshard.hub import PushResult, push
from reshard.verify import VerifyResult, verify

if TYPE_CHECKING:
    from reshard.runtime import LoadResult, load_model, load_state_dict

__all__ = ["inspect", "convert", "verify", "load_model", "load_state_dict", "push", "Catalog", "ConvertResult",
           "VerifyResult", "PushResult", "LoadResult", "ReshardError"]
__version__ = "0.1.0"


def inspect(path: str | os.PathLike) -> Catalog:
    """The catalog of checkpoint ``path``: every tensor's shape, dtype and chunks, and the
    objects. Reads metadata only, never tensor data."""
    from reshard.formats.registry import detect_format

    path = Path(path)
    return detect_format(path).read(path)


_LAZY = {"load_model", "load_state_dict", "LoadResult"}  # reshard.runtime imports torch.distributed


def __getattr__(name: str) -> Any:
    """``reshard.load_model`` and ``reshard.load_state_dict`` are ``reshard.runtime``'s own,
    imported on first use so that ``import reshard`` stays light."""
    if name in _LAZY:
        from reshard import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'reshard' has no attribute {name!r}")
