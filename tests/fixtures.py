"""Real checkpoints for tests come from reshard.example (written by torch itself); one helper
reads a catalog entry back whole, through its chunks' own reads."""

import torch

from reshard.boxes import full_box
from reshard.catalog import TensorEntry
from reshard.example import TinyNet, full_reference, save_fsdp2_dcp

__all__ = ["TinyNet", "save_fsdp2_dcp", "full_reference", "full_tensor"]


def full_tensor(entry: TensorEntry) -> torch.Tensor:
    """The whole tensor of ``entry``, each chunk read by its reader (``torch.empty``: a box no
    chunk covers keeps garbage, so it cannot pass for zeros)."""
    out = torch.empty(entry.shape, dtype=entry.dtype.torch)
    for c in entry.chunks:
        out[c.box.as_slices()] = c.data.read(full_box(c.box.sizes))
    return out
