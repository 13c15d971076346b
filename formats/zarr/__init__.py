"""zarr v3 stores, local or behind an fsspec URL.

- ``format``: ``ZarrFormat`` and ``ZarrWriter``
- ``meta``: ``zarr.json`` (dtype names, codecs, chunk keys)
- ``grid``: chunk grids from target shards or a size
- ``chunks``: raw and compressed chunks, decoded on read
- ``store``: local folders and fsspec URLs (a URL output has no rename: the writer puts the root
  ``zarr.json`` last)
"""

from reshard.core.lazy import lazy_exports

_EXPORTS = {
    "ZarrFormat": "reshard.formats.zarr.format",
    "ZarrWriter": "reshard.formats.zarr.format",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
