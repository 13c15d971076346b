"""torch.save files: full state dicts, folders of per-rank DTensor files, legacy files.

- ``save``: ``TorchSaveFormat`` (one file) and its writer
- ``rank_folder``: ``TorchRanksFormat`` (a folder of per-rank files, verl's too); ``ranks``
  reads one set of rank files, ``ranks_write`` writes ``rank{r}.pt`` outputs
- ``zip``, ``zip_index``: torch.save's zip archive, read safely; ``zip_write``: written as streamed segments
- ``legacy``: pre-1.6 (non-zip) files, read as data; ``file``: a whole file of either kind
- ``dtensor``: DTensors inside torch files: their mesh and local shard
"""

from reshard.core.lazy import lazy_exports

_EXPORTS = {
    "TorchRanksFormat": "reshard.formats.torch.rank_folder",
    "TorchSaveFormat": "reshard.formats.torch.save",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
