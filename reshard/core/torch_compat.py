"""Every private torch name reshard touches, in one place, so a torch upgrade breaks here.

Writing a file that ``torch.load(weights_only=True)`` reads means naming torch's tensor
rebuild function in the pickle, and reading DCP metadata means knowing its private storage
record type. Nothing else in reshard imports an underscored torch name.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch._utils
import torch.serialization

from reshard.core.torch_support import note_newer_torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["rebuild_tensor_v3", "get_layout", "dtensor_local_box", "dtensor_local_indices", "STRIDED_SHARD",
           "init_optimizer_state", "offline_device_mesh", "dtensor_spec"]

note_newer_torch(torch.__version__)  # the library's first use of torch: once per process, if newer than tested

# The function torch.save names for every tensor of a "new" dtype; torch.load accepts it for
# all dtypes, so our writer uses it uniformly.
rebuild_tensor_v3 = torch._utils._rebuild_tensor_v3

# Maps a layout's name ("torch.strided") back to the layout; pickles of tensor metadata use it.
get_layout = torch.serialization._get_layout


def dtensor_local_box(shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local sizes) of this rank's piece of a DTensor, by torch's own rule
    (DCP saves with the same function); zero sizes when this rank is outside ``mesh``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    if len(offsets) != len(shape):
        return (0,) * len(shape), (0,) * len(shape)
    return tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)


def _strided_shard_type() -> type | None:
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # torch builds without distributed
        return None
    return _StridedShard


STRIDED_SHARD: type | None  # set by __getattr__ on first use


def __getattr__(name: str) -> object:
    """``STRIDED_SHARD``: FSDP2 over tensor parallelism shards a parameter's dim twice; the
    outer shard is a ``_StridedShard`` whose pieces are not one box in general. Looked up on
    first use: importing torch.distributed.tensor costs more than half a second, which
    ``inspect`` and plain conversions do not need to pay."""
    if name == "STRIDED_SHARD":
        value = globals()["STRIDED_SHARD"] = _strided_shard_type()
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtensor_local_indices(shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple) -> list[torch.Tensor] | None:
    """Per dim of a DTensor, the global indices this rank's local tensor holds, in local order
    (torch's own rule for every ``Shard``/``_StridedShard`` placement, applied mesh dim by mesh
    dim as ``compute_local_shape_and_global_offset`` does); None when this rank is outside
    ``mesh``."""
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets

    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    sizes = list(shape)
    index: dict[int, torch.Tensor] = {}
    for mesh_dim, placement in enumerate(placements):
        dim = getattr(placement, "dim", None)
        if dim is None:  # Replicate()
            continue
        size, offsets = _get_shard_size_and_offsets(sizes[dim], mesh.size(mesh_dim), coordinate[mesh_dim],
                                                    placement, index.get(dim), shape[dim], False)
        assert offsets is not None  # torch gives them unless asked to skip them (the last argument)
        sizes[dim] = size
        index[dim] = offsets[:size]
    return [index[d] if d in index else torch.arange(n) for d, n in enumerate(shape)]


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors (a zero-gradient step at lr 0), as torch's
    ``get_state_dict`` does before loading, so a checkpoint's state can be copied into them."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)



def offline_device_mesh(device_type: str, mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...] | None,
                        rank: int) -> DeviceMesh:
    """The mesh of ranks 0..N-1 in C order (``init_device_mesh``'s layout) as rank ``rank`` holds
    it, made without process groups: what a DTensor saved by that rank pickles, less the names
    of its process groups, which mean nothing outside the job that made them."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(math.prod(mesh_shape), dtype=torch.int).reshape(mesh_shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=mesh_dim_names, _init_backend=False, _rank=rank)


def dtensor_spec(mesh: DeviceMesh, placements: tuple[tuple[str, int | None], ...], shape: tuple[int, ...],
                 dtype: torch.dtype) -> Any:
    """The ``DTensorSpec`` of a contiguous DTensor of ``shape`` laid over ``mesh`` with
    ``placements`` (reshard's ``("Shard", dim)`` / ``("Replicate", None)``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    torch_placements = tuple(Shard(dim) if kind == "Shard" and dim is not None else Replicate() for kind, dim in placements)
    return DTensorSpec(mesh, torch_placements, tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))
