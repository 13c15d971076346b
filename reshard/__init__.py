"""reshard: convert and reshard PyTorch training checkpoints.

>>> import reshard
>>> cat = reshard.inspect("ckpt/")                  # what a checkpoint holds, any format
>>> reshard.convert("ckpt/", "model.safetensors", only="model")
>>> reshard.verify("ckpt/", "model.safetensors", only="model").equal
>>> reshard.load_model(model, "ckpt/", optimizer=opt)  # under torchrun, onto any mesh
>>> dcp.load(state_dict, storage_reader=reshard.StorageReader("ckpt/"))  # torch's dcp.load, any format

Every name below is imported on first use (``import reshard`` does not import torch), so the
command line answers ``--help`` at once; ``dir(reshard)`` and ``help(reshard)`` list them all.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from reshard.core.errors import ReshardError
from reshard.core.version import __version__

if TYPE_CHECKING:
    from reshard.commands.convert import ConvertResult, convert
    from reshard.commands.inspect import inspect
    from reshard.commands.verify import VerifyResult, verify
    from reshard.core.catalog import Catalog
    from reshard.features.hub import PushResult, push
    from reshard.formats.options import ConvertOptions
    from reshard.pipeline.options import LoadOptions, SourceOptions
    from reshard.runtime.load import LoadResult, load_model, load_state_dict
    from reshard.runtime.storage_reader import StorageReader
    from reshard.safe_pickle.unpickler import allow_classes

__all__ = ["inspect", "convert", "verify", "load_model", "load_state_dict", "StorageReader", "push", "Catalog",
           "SourceOptions",
           "ConvertOptions", "LoadOptions", "ConvertResult", "VerifyResult", "PushResult", "LoadResult", "ReshardError",
           "allow_classes", "__version__"]

# name -> the module that defines it (imported when the name is first used).
_LAZY = {
    "inspect": "reshard.commands.inspect",
    "convert": "reshard.commands.convert", "ConvertResult": "reshard.commands.convert",
    "ConvertOptions": "reshard.formats.options",
    "SourceOptions": "reshard.pipeline.options", "LoadOptions": "reshard.pipeline.options",
    "verify": "reshard.commands.verify", "VerifyResult": "reshard.commands.verify",
    "push": "reshard.features.hub", "PushResult": "reshard.features.hub",
    "load_model": "reshard.runtime.load", "load_state_dict": "reshard.runtime.load", "LoadResult": "reshard.runtime.load",
    "StorageReader": "reshard.runtime.storage_reader",
    "Catalog": "reshard.core.catalog",
    "allow_classes": "reshard.safe_pickle.unpickler",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'reshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
