"""Writing a torch_checkpointing folder (meta-pytorch's ``torch_checkpointing`` 0.1.1).

``CheckpointManager.save(path, {"model": msd, "optim": osd, "step": 2})`` writes, per item
and rank, ``<item>_<rank>.pt`` (``torch.save`` of that rank's value of the item) and
``metadata.pkl`` (every tensor's sharding, for loads onto other rank counts). This writes
the same folder, its items the source's sections (``model``, ``optim``, ``step``...; the
tensors of a model saved at the top level, as HF and plain state dicts are, form the item
``model``), each rank's ``.pt`` described as literal bytes around its tensors' pieces:

* on a mesh (``--to-mesh N``), a tensor sharded over it is a DTensor over that mesh
  (``write_dtensor``) and the rest (replicated: an optimizer's ``step``, buffers) plain
  tensors in every rank's file, as FSDP2 keeps them; ``CheckpointManager.load`` with
  ``DefaultResharder`` then loads a live state dict of that mesh without resharding, and
  any other one through its resharder;
* without a mesh, one rank's files of whole plain tensors, what the library writes for a
  model saved by one process: its resharder loads them onto any number of ranks.

``metadata.pkl`` comes last (``finish``), written by ``write_metadata`` with our own code:
reshard never imports torch_checkpointing. Which device the meshes are recorded on is the
``--device-type`` option (``write_options``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reshard.formats.torch.save import build_tree
from reshard.formats.torch.zip_write import PieceRef, embed_tensors, torch_save_segments
from reshard.formats.torch_checkpointing.metadata import ITEM_NAME
from reshard.formats.torch_checkpointing.write_dtensor import RankDTensors
from reshard.formats.torch_checkpointing.write_metadata import (
    METADATA_FILE,
    MeshRecord,
    RecordedTensor,
    metadata_pickle,
)
from reshard.formats.torch_checkpointing.write_options import device_type

from reshard.core.catalog import Catalog, NestedPath, TensorEntry
from reshard.core.conventions import PARAM, Layout, detect_layout
from reshard.core.errors import UsageError
from reshard.core.pieces import OutputFile, Piece, Segment
from reshard.core.sharding import REPLICATE
from reshard.core.target import Target, TargetTensor
from reshard.pipeline.options import WriterOptions

__all__ = ["TorchCheckpointingWriter"]

_MODEL_ITEM = "model"  # the item of a model saved at the top level (what trainers name it)


def _layout(target: Target) -> Layout:
    """The layout the target's names follow (the source's, or the one ``--layout`` gave)."""
    tensors = {n: TensorEntry(n, t.shape, t.dtype) for n, t in target.tensors.items()}
    names = Catalog(format="target", path=Path(), tensors=tensors, objects=dict.fromkeys(target.objects),
                    paths=target.paths, facts=target.facts)
    return detect_layout(names)  # which tensors are the model decides the items: an ambiguous layout is refused


def _items(target: Target) -> dict[str, list[tuple[NestedPath, str]]]:
    """Each item's entries, in the source's order: (path inside the item, name)."""
    layout = _layout(target)
    model_at_top = layout.convention.model == ""
    order = {name: i for i, name in enumerate(target.paths)}
    names = sorted([*target.tensors, *target.objects], key=lambda n: order.get(n, len(order)))
    items: dict[str, list[tuple[NestedPath, str]]] = {}
    for name in names:
        path = target.nested_path(name)
        item: str | int
        if model_at_top and layout.role(name) == PARAM:
            item, inner = _MODEL_ITEM, path
        else:
            item, inner = path[0], path[1:]
        if not isinstance(item, str) or not ITEM_NAME.fullmatch(item):
            raise UsageError(f"{name!r}: a torch_checkpointing item is named by the top-level key {item!r}, which "
                             f"torch_checkpointing does not take as an item ({ITEM_NAME.pattern}); rename it with --keymap "
                             "or leave it out with --exclude")
        items.setdefault(item, []).append((inner, name))
    for item, entries in items.items():
        if any(not inner for inner, _ in entries) and len(entries) > 1:
            raise UsageError(f"{item!r} is both a value and a section of the checkpoint; a torch_checkpointing item is one")
    return items


def _is_dtensor(t: TargetTensor) -> bool:
    """Whether the output keeps ``t`` as a DTensor: when it is sharded over the mesh. What
    is replicated everywhere stays a plain tensor, as FSDP2 leaves an optimizer's ``step``."""
    return t.local is not None and any(p[0] == "Shard" for p in t.placements or ())


class TorchCheckpointingWriter:
    """``<item>_<rank>.pt`` per item and target rank, then ``metadata.pkl``."""

    output_is_dir = True
    marker = METADATA_FILE

    def __init__(self, dst: Path | str, options: WriterOptions | None = None) -> None:
        self.device_type = device_type(options or WriterOptions())
        self._items: tuple[Target, dict[str, list[tuple[NestedPath, str]]]] | None = None

    def items(self, target: Target) -> dict[str, list[tuple[NestedPath, str]]]:
        """Each item's entries (``_items``), worked out once per target."""
        if self._items is None or self._items[0] is not target:
            self._items = (target, _items(target))
        return self._items[1]

    def _mesh_names(self, target: Target) -> tuple[str, ...] | None:
        """Dimension names the mesh is recorded with: the user's (``dp_shard=4``), else none,
        as ``init_device_mesh`` leaves a mesh made without them."""
        mesh = target.mesh
        return mesh.names if mesh is not None and mesh.named else None

    def _recorded(self, t: TargetTensor, target: Target, inner: NestedPath) -> RecordedTensor:
        if _is_dtensor(t):
            assert target.mesh is not None and t.placements is not None  # _is_dtensor: laid out on the mesh
            mesh = MeshRecord(self.device_type, target.mesh.shape, self._mesh_names(target))
            return RecordedTensor(inner, t.shape, t.dtype, mesh, t.placements)
        # A plain tensor, recorded as the library records one: replicated over every rank. torch's
        # optimizers keep their 0-d ``step`` on the CPU (unless fused or capturable).
        device = "cpu" if not t.shape else self.device_type
        return RecordedTensor(inner, t.shape, t.dtype, MeshRecord(device, (target.world_size,), None), (REPLICATE,))

    def layout(self, target: Target) -> list[OutputFile]:
        files = []
        for item, entries in self.items(target).items():
            for rank in range(target.world_size):
                records: dict[str, Segment] = {}
                dtensors: RankDTensors | None = None
                leaves: list[tuple[NestedPath, Any]] = []
                for inner, name in entries:
                    t = target.tensors.get(name)
                    if t is None:
                        leaves.append((inner, embed_tensors(target.objects[name], records)))
                        continue
                    box = t.local[rank] if t.local is not None else t.boxes[0]
                    key = str(len(records))
                    records[key] = Piece(t.name, box, t.dtype)
                    leaf: Any = PieceRef(key, t.dtype, box.sizes)
                    if _is_dtensor(t):
                        assert target.mesh is not None and t.placements is not None  # _is_dtensor: laid out on the mesh
                        if dtensors is None:
                            dtensors = RankDTensors(target.mesh, self._mesh_names(target), self.device_type, rank, records)
                        leaf = dtensors.leaf(leaf, t.shape, t.dtype, t.placements)
                    leaves.append((inner, leaf))
                tree = self._tree(item, entries, leaves, target)
                files.append(OutputFile(f"{item}_{rank}.pt", torch_save_segments(tree, records)))
        return files

    @staticmethod
    def _tree(item: str, entries: list[tuple[NestedPath, str]], leaves: list[tuple[NestedPath, Any]],
              target: Target) -> Any:
        """The item's value: its entries nested as the source nested them."""
        if len(leaves) == 1 and not leaves[0][0]:
            return leaves[0][1]
        full = target.facts.containers or {}
        inner, name = entries[0]
        if target.nested_path(name) != inner:  # a section: its paths start with the item
            containers = {path[1:]: kind for path, kind in full.items() if path[:1] == (item,)}
        else:  # a model saved at the top level: its paths are the item's own
            heads = {inner[0] for inner, _ in leaves}
            containers = {path: kind for path, kind in full.items() if path and path[0] in heads}
        return build_tree(leaves, containers)

    def finish(self, staging: Path, target: Target, files: list[OutputFile]) -> None:
        """``metadata.pkl``, once every rank's files are written (the staging folder appears
        whole, so a reader never sees metadata without its files)."""
        recorded = {item: [self._recorded(target.tensors[name], target, inner)
                           for inner, name in entries if name in target.tensors]
                    for item, entries in self.items(target).items()}
        (staging / METADATA_FILE).write_bytes(metadata_pickle(target.world_size, recorded))

    def notices(self, target: Target) -> list[str]:
        if target.mesh is not None:
            return []
        plain = [item for item, entries in self.items(target).items() if not any(n in target.tensors for _, n in entries)]
        if not plain:
            return []
        what = f"items {', '.join(plain)} hold" if len(plain) > 1 else f"item {plain[0]} holds"
        return [f"{what} no tensors: torch_checkpointing reads such an item from the loading rank's <item>_<rank>.pt, "
                "written here for rank 0; write --to-mesh N to load it on N ranks"]
