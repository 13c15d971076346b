"""Folders saved by meta-pytorch's torch_checkpointing (``CheckpointManager``), 0.1.1.

- ``format``: ``TorchCheckpointingFormat`` (detect, read, its writer)
- ``metadata``: ``metadata.pkl`` read through the allow-list and checked field by field
- ``files``: which file holds each item of each rank; one rank's torch.save or safetensors file
- ``items``: an item's tensors placed by its recorded sharding, or by what its files prove
- ``write``: ``TorchCheckpointingWriter``
"""

from reshard.core.lazy import lazy_exports

_EXPORTS = {
    "TorchCheckpointingFormat": "reshard.formats.torch_checkpointing.format",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
