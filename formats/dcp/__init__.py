"""torch.distributed.checkpoint folders: ``.metadata`` plus ``__R_N.distcp`` files.

- ``format``: ``DCPFormat`` (reader) and ``DCPWriter``
- ``metadata``: ``.metadata`` validated into columnar chunk tables
- ``metadata_pickle``: ``.metadata`` unpickled through inert stand-ins of torch's DCP classes
- ``metadata_write``: ``.metadata`` written without importing torch's DCP package
- ``records``: what each record holds (archive, zstd frame, safetensors blob), checked first
- ``ranks``: ``use_collectives=False`` folders (one metadata file per rank), merged
- ``safetensors``: ``SerializationFormat.SAFETENSORS`` blobs and HF storage-writer shards
- ``zstd``: zstd-compressed records, streamed
"""

from reshard.core.lazy import lazy_exports

_EXPORTS = {
    "DCPFormat": "reshard.formats.dcp.format",
    "DCPWriter": "reshard.formats.dcp.format",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
