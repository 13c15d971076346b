"""Device meshes: what each rank of a target mesh holds.

- ``sharding``: mesh specs (``4x8``, ``dp_shard=4,tp=2``) and DTensor's sharding rules
- ``placements``: placement presets (``fsdp``, ``hsdp``, ``fsdp+tp``) and PLAN.json
- ``target``: the output of a conversion laid out for a mesh, and the per-rank state policy
- ``report``: ``inspect --to-mesh``, bytes per rank before anything is written
"""

from reshard._lazy import lazy_exports

_EXPORTS = {
    "MeshSpec": "reshard.mesh.sharding",
    "parse_mesh": "reshard.mesh.sharding",
    "mesh_target": "reshard.mesh.target",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
