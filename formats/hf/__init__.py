"""Hugging Face model folders.

- ``format``: ``HFFormat``, the ``--to hf`` writer (weights, config.json, assets, model card)
- ``files``: the side files (configs, tokenizer assets, the card)
- ``bin``: ``HFBinFormat``, folders of ``pytorch_model*.bin`` weights (read only)
"""

from reshard.core.lazy import lazy_exports

_EXPORTS = {
    "HFBinFormat": "reshard.formats.hf.bin",
    "HFFormat": "reshard.formats.hf.format",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
