"""Every private torch name reshard touches, in one place, so a torch upgrade breaks here.

Writing a file that ``torch.load(weights_only=True)`` reads means naming torch's tensor
rebuild function in the pickle, and reading DCP metadata means knowing its private storage
record type. Nothing else in reshard imports an underscored torch name.
"""

from __future__ import annotations


import torch
import torch._utils
import torch.serialization

__all__ = ["rebuild_tensor_v3", "get_layout", "dcp_storage_info_class", "TORCH_DTYPES"]

# The function torch.save names for every tensor of a "new" dtype; torch.load accepts it for
# all dtypes, so our writer uses it uniformly.
rebuild_tensor_v3 = torch._utils._rebuild_tensor_v3

# Maps a layout's name ("torch.strided") back to the layout; pickles of tensor metadata use it.
get_layout = torch.serialization._get_layout


def dcp_storage_info_class() -> type:
    """DCP's per-chunk record (relative_path, offset, length, transform_descriptors), needed
    only to write ``.metadata``; imported on demand because importing
    torch.distributed.checkpoint costs about a second of start-up."""
    from torch.distributed.checkpoint import filesystem

    return filesystem._StorageInfo


TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in dir(torch)
    if isinstance(getattr(torch, name, None), torch.dtype)
}
