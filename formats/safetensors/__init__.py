"""safetensors files and sharded folders with ``model.safetensors.index.json``.

- ``format``: ``SafetensorsFormat`` and its writer
- ``header``: the header, validated as the Rust core validates it (docs/architecture.md says
  why reshard reads it itself)
"""

from reshard.core.lazy import lazy_exports

_EXPORTS = {
    "SafetensorsFormat": "reshard.formats.safetensors.format",
    "SafetensorsWriter": "reshard.formats.safetensors.format",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
