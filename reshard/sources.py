"""What a SRC argument can be, resolved the same way by every command: a local path, a
``file://`` or fsspec zarr URL, or an ``owner/name[@revision]`` Hub repo id."""

from __future__ import annotations

import os
from pathlib import Path

from reshard.catalog import Catalog

__all__ = ["read_catalog"]


def read_catalog(src: str | os.PathLike) -> Catalog:
    """The catalog of ``src``, metadata only."""
    from reshard.formats.zarr.store import is_url

    if is_url(src):
        from reshard.formats.zarr.remote import _catalog

        return _catalog(src)
    from reshard.formats.registry import detect_format
    from reshard.hub import hub_source

    path, _ = hub_source(Path(src))
    return detect_format(path).read(path)
