"""torch.save files: full state dicts, folders of per-rank DTensor files, legacy files.

- ``save``: ``TorchSaveFormat`` (one file) and its writer
- ``ranks``, ``ranks_write``: ``TorchRanksFormat`` (a folder of per-rank files) and ``rank{r}.pt`` outputs
- ``zip``, ``zip_index``: torch.save's zip archive, read safely; ``zip_write``: written as streamed segments
- ``legacy``: pre-1.6 (non-zip) files, read as data
- ``dtensor``: DTensors inside torch files: their mesh and local shard
"""

from reshard._lazy import lazy_exports

_EXPORTS = {
    "TorchRanksFormat": "reshard.formats.torch.ranks",
    "TorchSaveFormat": "reshard.formats.torch.save",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
