"""DTensors in the torch.save pickles of a torch_checkpointing output, their data left to the engine.

torch_checkpointing loads a rank's file without resharding only where the saved values are
of the live ones' types: a DTensor for a DTensor. torch pickles a DTensor as
``_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (wrapper args), state)``, the
state holding its local tensor and its ``DTensorSpec`` (mesh, placements, global shape).
The wrapper and the local tensor are written here by name around a ``PieceRef`` the engine
fills. The spec and its mesh are private torch classes whose pickled state changes between
torch releases, so they are made by the installed torch (``reshard.core.torch_compat``) and
written as it pickles them, the mesh's rank tensor moved into a storage record of the file
as torch.save moves it: the output is what this torch's ``torch.save`` writes for such a
DTensor. The mesh carries no process group names (they name groups of the job that saved).
"""

from __future__ import annotations

import copyreg
from typing import Any

from reshard.formats.torch.zip_write import PieceRef, embed_tensors

from reshard.core.dtypes import DType
from reshard.core.errors import UnsupportedFormatError
from reshard.core.pieces import Segment
from reshard.core.sharding import MeshSpec, Placement
from reshard.safe_pickle.inert import Inert, standin_class

__all__ = ["RankDTensors"]

_REBUILD_FROM_TYPE = standin_class("torch._tensor", "_rebuild_from_type_v2")
_REBUILD_WRAPPER = standin_class("torch._utils", "_rebuild_wrapper_subclass")
_DTENSOR = standin_class("torch.distributed.tensor", "DTensor")
_GET_LAYOUT = standin_class("torch.serialization", "_get_layout")
_DEVICE = standin_class("torch", "device")


def _as_written(obj: Any, state: Any) -> Inert:
    """A stand-in that pickles as ``obj`` does (``cls.__new__(cls)``, then ``state``), under
    its class's own name; refused when this torch pickles the class another way."""
    reduced = obj.__reduce_ex__(2)
    cls = type(obj)
    if reduced[0] is not getattr(copyreg, "__newobj__", None) or tuple(reduced[1]) != (cls,):
        raise UnsupportedFormatError(f"this torch pickles {cls.__module__}.{cls.__qualname__} in a way reshard cannot "
                                     "write into a torch_checkpointing file; write --to dcp instead")
    standin = standin_class(cls.__module__, cls.__qualname__)
    out = standin.__new__(standin)
    out.state = state
    return out


class RankDTensors:
    """The DTensors of one rank's file: every one shares the file's mesh, as torch.save
    shares one mesh object among the DTensors of a state dict."""

    def __init__(self, mesh: MeshSpec, mesh_dim_names: tuple[str, ...] | None, device_type: str, rank: int,
                 records: dict[str, Segment]) -> None:
        from reshard.core import torch_compat  # torch.distributed only for outputs that hold DTensors

        self._compat = torch_compat
        self._mesh = torch_compat.offline_device_mesh(device_type, mesh.shape, mesh_dim_names, rank)
        state = self._mesh.__reduce_ex__(2)[2]
        self._mesh_standin = _as_written(self._mesh, embed_tensors(state, records))  # its rank tensor: a record
        self._layout = _GET_LAYOUT("torch.strided")
        self._device = _DEVICE("cpu")  # where the local tensor's storage loads, as its record says

    def leaf(self, local: PieceRef, shape: tuple[int, ...], dtype: DType, placements: tuple[Placement, ...]) -> Inert:
        """The DTensor of global ``shape`` whose local tensor is ``local``."""
        spec = self._compat.dtensor_spec(self._mesh, placements, shape, dtype.torch)
        state = dict(spec.__reduce_ex__(2)[2])
        state["mesh"] = self._mesh_standin
        stride = tuple(int(s) for s in spec.tensor_meta.stride)
        args = (_DTENSOR, dtype, tuple(shape), stride, 0, self._layout, self._device, False)
        return _REBUILD_FROM_TYPE(_REBUILD_WRAPPER, _DTENSOR, args,
                                  {"_local_tensor": local, "_spec": _as_written(spec, state)})
