"""Every private torch name reshard touches, in one place, so a torch upgrade breaks here.

Writing a file that ``torch.load(weights_only=True)`` reads means naming torch's tensor
rebuild function in the pickle, and reading DCP metadata means knowing its private storage
record type. Nothing else in reshard imports an underscored torch name.
"""

from __future__ import annotations


import torch
import torch._utils
import torch.serialization

__all__ = ["rebuild_tensor_v3", "get_layout", "dtensor_local_box", "init_optimizer_state", "TORCH_DTYPES"]

# The function torch.save names for every tensor of a "new" dtype; torch.load accepts it for
# all dtypes, so our writer uses it uniformly.
rebuild_tensor_v3 = torch._utils._rebuild_tensor_v3

# Maps a layout's name ("torch.strided") back to the layout; pickles of tensor metadata use it.
get_layout = torch.serialization._get_layout


def dtensor_local_box(shape: tuple[int, ...], mesh: object, placements: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local sizes) of this rank's piece of a DTensor, by torch's own rule
    (DCP saves with the same function); zero sizes when this rank is outside ``mesh``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    if len(offsets) != len(shape):
        return (0,) * len(shape), (0,) * len(shape)
    return tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors (a zero-gradient step at lr 0), as torch's
    ``get_state_dict`` does before loading, so a checkpoint's state can be copied into them."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in dir(torch)
    if isinstance(getattr(torch, name, None), torch.dtype)
}
