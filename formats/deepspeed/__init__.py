"""DeepSpeed ZeRO checkpoints (``global_stepN/``, through ``latest``) and universal folders.

- ``format``: ``DeepSpeedFormat`` (read only)
- ``files``: which files a tag folder holds, and their world size
- ``zero``: ZeRO 1/2/3 flat partitions mapped onto each parameter
- ``state``: the pickled engine and optimizer state, read as data
- ``universal``: ``ds_to_universal`` folders
- ``flat``: a flat element range of a tensor as exact row-major boxes
"""

from reshard.core.lazy import lazy_exports

_EXPORTS = {
    "DeepSpeedFormat": "reshard.formats.deepspeed.format",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
