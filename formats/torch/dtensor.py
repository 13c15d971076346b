"""DTensors in torch.save pickles, read without building anything of torch.distributed.

A DTensor pickles as ``_rebuild_from_type_v2(..., DTensor, ..., state)`` whose state holds its
local tensor and a ``DTensorSpec`` (mesh, placements, tensor metadata). The classes it names
are bound to sealed record classes that keep their arguments and BUILD state as data
(``Record``), and ``dtensor_ref`` reads what reshard needs from them: the local shard, the
global shape, the mesh shape, the rank's coordinate and the placements.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError
from reshard.core.regions import StoredRegion
from reshard.safe_pickle.inert import Sealed

__all__ = ["Record", "DTensorRef", "DTENSOR_CLASSES", "record_class", "dtensor_ref"]


@dataclass
class Record:
    """Stand-in for a class we allow in a pickle but never instantiate (DTensor metadata):
    it keeps the constructor arguments and the state, nothing runs."""

    kind: str
    args: tuple = ()
    state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def walk_children(self) -> list[Any]:
        return [*self.args, self.state]

    def remade(self, fn: Callable[[Any], Any]) -> Record:
        return Record(self.kind, tuple(fn(a) for a in self.args), fn(self.state))


def record_class(kind: str) -> type:
    """A sealed class (shared by every load, so a pickle must not change it) whose
    instances are Records."""

    def __new__(cls: type, *args: Any) -> Record:
        return Record(kind, args)

    return Sealed(kind, (), {"__new__": __new__})


@dataclass
class DTensorRef:
    """A DTensor found in a torch.save file: its local shard and what DTensor says of it."""

    local: StoredRegion
    global_shape: tuple[int, ...]
    placements: tuple[Record, ...]
    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...] | None
    mesh_dim_names: tuple[str, ...] | None = None
    extra: dict = field(default_factory=dict)


DTENSOR_CLASSES = {
    ("torch.distributed.tensor", "DTensor"): "DTensor",
    ("torch.distributed._tensor.api", "DTensor"): "DTensor",
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"): "DTensorSpec",
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"): "TensorMeta",
    ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"): "ShardOrderEntry",
    ("torch.distributed.device_mesh", "DeviceMesh"): "DeviceMesh",
    ("torch.distributed._mesh_layout", "_MeshLayout"): "_MeshLayout",
    ("torch.distributed._mesh_layout", "_FlatLayout"): "_FlatLayout",
    ("torch.distributed.tensor.placement_types", "Shard"): "Shard",
    ("torch.distributed.tensor.placement_types", "Replicate"): "Replicate",
    ("torch.distributed.tensor.placement_types", "Partial"): "Partial",
    ("torch.distributed.tensor.placement_types", "_StridedShard"): "_StridedShard",
}


def dtensor_ref(where: str, wrapper: Any, state: dict) -> DTensorRef:
    local, spec = state.get("_local_tensor"), state.get("_spec")
    if not isinstance(local, StoredRegion) or not isinstance(spec, Record):
        raise CorruptCheckpointError(f"{where}: DTensor without a local tensor or spec")
    s = spec.state or {}
    meta = s.get("tensor_meta")
    global_shape = tuple(meta.args[0]) if isinstance(meta, Record) and meta.args else None
    if global_shape is None and isinstance(wrapper, Record):
        global_shape = wrapper.args[1]
    if global_shape is None:
        raise CorruptCheckpointError(f"{where}: DTensor without its global shape")
    mesh = s.get("mesh")
    mstate = mesh.state if isinstance(mesh, Record) and isinstance(mesh.state, dict) else {}
    mesh_shape = _mesh_shape(where, mstate)
    coord = mstate.get("_coordinate_on_dim")
    order = s.get("shard_order")
    return DTensorRef(
        local=local,
        global_shape=tuple(int(x) for x in global_shape),
        placements=tuple(s.get("placements") or ()),
        mesh_shape=tuple(int(x) for x in mesh_shape),
        coordinate=tuple(coord) if coord is not None else None,
        mesh_dim_names=mstate.get("_mesh_dim_names"),
        extra={"shard_order": order} if order is not None else {},
    )


def _mesh_shape(where: str, mstate: dict) -> tuple[int, ...]:
    """The mesh's shape from a pickled DeviceMesh, in each form torch has pickled it: a ``mesh``
    tensor of rank ids (up to 2.9); a ``_MeshLayout`` of ``shape`` and ``stride`` beside a
    ``_rank_map`` (2.10 to 2.12); a ``_MeshLayout`` of one ``_FlatLayout`` per dimension beside
    the ``_rank_map`` (2.13 on). Ranks are placed in row-major order (``ranks._coordinate``), so
    a layout or rank map that orders them otherwise is refused, not read with wrong offsets; ()
    when the mesh is not there (the caller refuses the placements)."""
    layout = mstate.get("_layout")
    if isinstance(layout, Record) and isinstance(layout.state, dict):
        axes = layout.state.get("axes")
        if axes is not None:  # one _FlatLayout per mesh dimension; a flattened one's shape is a tuple
            axes = axes if isinstance(axes, tuple) else (axes,)
            if not (axes and all(isinstance(a, Record) and isinstance(a.state, dict) for a in axes)):
                return ()
            shapes, strides = [a.state.get("shape", ()) for a in axes], [a.state.get("stride", ()) for a in axes]
        else:
            shape, stride = layout.state.get("shape"), layout.state.get("stride")
            shapes = list(shape) if isinstance(shape, tuple) else [shape]
            strides = list(stride) if isinstance(stride, tuple) else [stride]
        sizes, steps = _flat(shapes), _flat(strides)
        if sizes is None or steps is None or len(sizes) != len(steps):
            return ()
        row_major = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
        if any(n > 1 and s != r for n, s, r in zip(sizes, steps, row_major)):
            raise UnsupportedFormatError(f"{where}: DTensor on a DeviceMesh whose ranks are not in row-major order "
                                         f"(layout {tuple(shapes)} : {tuple(strides)}); save it with dcp.save instead")
        _require_identity(where, mstate.get("_rank_map"), math.prod(sizes))
        return tuple(_numel(s) for s in shapes)
    if isinstance(mstate.get("mesh"), StoredRegion):
        return mstate["mesh"].shape
    return ()


def _flat(values: list[Any]) -> list[int] | None:
    out: list[int] = []
    for v in values:
        if isinstance(v, int):
            out.append(v)
        elif isinstance(v, tuple):
            inner = _flat(list(v))
            if inner is None:
                return None
            out += inner
        else:
            return None
    return out


def _require_identity(where: str, rank_map: Any, n: int) -> None:
    """A ``_rank_map`` other than ranks 0..n-1 in order puts shards elsewhere than row-major
    placement assumes: refused. (A one-rank mesh holds the whole tensor, whichever rank it is.)"""
    if rank_map is None or n <= 1:
        return
    if not isinstance(rank_map, StoredRegion) or _rank_map_values(rank_map) != tuple(range(n)):
        raise UnsupportedFormatError(f"{where}: DTensor on a DeviceMesh with its own rank order (_rank_map); "
                                     "save it with dcp.save instead")


@functools.lru_cache(maxsize=64)
def _rank_map_values(region: StoredRegion) -> tuple[int, ...]:
    """One read per mesh: every DTensor of a file names the same one."""
    return tuple(int(x) for x in region.read_all().reshape(-1).tolist())


def _numel(shape: Any) -> int:
    """Elements of a (possibly nested) int tuple, as DeviceMesh layouts store shapes."""
    if isinstance(shape, int):
        return shape
    n = 1
    for s in shape:
        n *= _numel(s)
    return n
