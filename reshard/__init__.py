"""reshard: convert and reshard PyTorch training checkpoints.

>>> import reshard
>>> cat = reshard.inspect("ckpt/")                  # what a checkpoint holds, any format
>>> reshard.convert("ckpt/", "model.safetensors", only="model")
>>> reshard.verify("ckpt/", "model.safetensors").equal
"""

from __future__ import annotations

import os
from pathlib import Path

from reshard.catalog import Catalog
from reshard.convert import ConvertResult, convert
from reshard.errors import ReshardError
from reshard.verify import VerifyResult, verify

__all__ = ["inspect", "convert", "verify", "Catalog", "ConvertResult", "VerifyResult", "ReshardError"]
__version__ = "0.1.0"


def inspect(path: str | os.PathLike) -> Catalog:
    """The catalog of checkpoint ``path``: every tensor's shape, dtype and chunks, and the
    objects. Reads metadata only, never tensor data."""
    from reshard.formats.registry import detect_format

    path = Path(path)
    return detect_format(path).read(path)
