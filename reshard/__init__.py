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
import os
from typing import TYPE_CHECKING, Any

from reshard.core.errors import ReshardError

if TYPE_CHECKING:
    from reshard.commands.convert import ConvertResult, convert
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
__version__ = "0.2.0"

# name -> the module that defines it (imported when the name is first used).
_LAZY = {
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


def inspect(path: str | os.PathLike, *, options: SourceOptions | None = None, layout: str | None = None,
            storage_options: dict[str, Any] | None = None, source_options: SourceOptions | None = None) -> Catalog:
    """The catalog of checkpoint ``path`` (a path, a zarr URL, or a Hub repo id as ``convert``
    takes them): every tensor's shape, dtype and chunks, and the objects. Reads metadata only,
    never tensor data, and does not import torch: a tensor's ``dtype`` is a
    ``reshard.core.dtypes.DType`` (torch's name and width; ``.torch`` gives torch's dtype).
    ``layout`` names the tool whose conventions the checkpoint follows when detection gets it
    wrong (``reshard.core.conventions``); ``storage_options`` are fsspec arguments for a URL.
    ``options`` (a ``SourceOptions``; ``source_options=`` is its former name) gives these and
    the rest of how a source is read as one value: ``allow_classes`` also holds for the
    catalog's objects read later, ``config`` says what model it is, and ``keymap`` shows the
    names it renames them to.

    >>> cat = reshard.inspect("ckpt/")
    >>> cat                      # a one-screen summary; print(cat.table()) for every tensor
    >>> cat.tensors["model.embed.weight"].dtype.torch is torch.bfloat16
    """
    from reshard.commands.inspect import CatalogReport
    from reshard.pipeline.options import SourceOptions, former_keyword
    from reshard.sources.reading import given_config, given_layout, read_catalog

    given = {k: v for k, v in (("layout", layout), ("storage_options", storage_options)) if v is not None}
    opts = SourceOptions.of(given, former_keyword("reshard.inspect", "source_options", "options", source_options, options))
    with opts.allowing():
        catalog = given_config(given_layout(read_catalog(path, opts), opts.layout), opts.config)
        if opts.keymap is not None:
            from reshard.features.keymap.lookup import load_keymap

            catalog = load_keymap(opts.keymap).apply(catalog)
    if opts.allow_classes:  # objects are read when first asked for: the allowance goes with them
        from reshard.core.catalog import ObjectTable

        catalog.objects = ObjectTable({name: _allowing(opts, catalog.objects, name) for name in catalog.objects})
    return CatalogReport.of(catalog)


def _allowing(opts: SourceOptions, objects: Any, name: str) -> Any:
    """A loader of ``objects[name]`` that reads it with ``opts.allow_classes`` allowed."""
    def load() -> Any:
        with opts.allowing():
            return objects[name]
    return load


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'reshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
