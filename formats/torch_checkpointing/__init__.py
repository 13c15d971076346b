"""torch_checkpointing (meta-pytorch) folders: ``metadata.pkl`` and ``<item>_<rank>.pt`` files.

- ``format``: ``TorchCheckpointingFormat``
- ``write``: ``TorchCheckpointingWriter``
"""

from reshard.core.lazy import lazy_exports

_EXPORTS = {
    "TorchCheckpointingFormat": "reshard.formats.torch_checkpointing.format",
    "TorchCheckpointingWriter": "reshard.formats.torch_checkpointing.write",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
