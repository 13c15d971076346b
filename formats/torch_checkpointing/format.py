"""The ``torch-checkpointing`` format: folders saved by meta-pytorch's torch_checkpointing
(``CheckpointManager.save(path, {"model": ..., "optim": ..., "step": ...})``), read as one
checkpoint whose names are DCP's flattening of the saved mapping: ``model.<fqn>``,
``optim.state.<fqn>.exp_avg``, ``optim.param_groups.0.lr``, ``step``, so the conventions of torch's
``get_state_dict`` (``--only model``, ``load_model(optimizer=...)``) apply as they do to a DCP.

A folder holds one file per item and rank (``files``) and, when an item declared a resharder,
``metadata.pkl`` with each tensor's sharding (``metadata``); items are read into the catalog by
``items``. Reading touches pickles and safetensors headers only, never tensor data, except where
an item saved without a resharder must prove that every rank saved the same plain tensor.
Writing is ``write.TorchCheckpointingWriter``.
"""

from __future__ import annotations

from pathlib import Path

from reshard.formats.torch.ranks import rank_files
from reshard.formats.torch_checkpointing.files import (
    RankFile,
    item_files,
    read_safetensors_rank,
    read_torch_rank,
)
from reshard.formats.torch_checkpointing.items import add_objects, plain_item, sharded_item
from reshard.formats.torch_checkpointing.metadata import (
    METADATA_FILE,
    ItemMetadata,
    SafetensorsSerialization,
    TCMetadata,
    read_metadata,
)

from reshard.core.catalog import Catalog, NestedPath, ObjectTable
from reshard.core.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError
from reshard.core.facts import Facts
from reshard.core.sizes import plural
from reshard.pipeline.options import WriterOptions
from reshard.pipeline.protocol import Writer

__all__ = ["TorchCheckpointingFormat"]


class TorchCheckpointingFormat:
    name = "torch-checkpointing"

    def detect(self, path: Path) -> bool:
        """A folder with ``metadata.pkl`` (not a DCP folder), or one whose every file is an item's
        ``<item>_<rank>.pt`` for ranks 0..N-1 (a save without a resharder) and none is named as
        the ``torch-ranks`` format's per-rank files are (``rank3.pt``, ``checkpoint_<r>.pt``)."""
        if not path.is_dir() or (path / ".metadata").exists():
            return False
        if (path / METADATA_FILE).is_file():
            return True
        try:
            found = item_files(path, set())
        except UnsupportedFormatError:
            return False
        if not found or rank_files(path):  # rank3.pt, model_world_size_1_rank_0.pt: torch-ranks' names
            return False
        return _world(path, found) is not None

    def read(self, path: Path) -> Catalog:
        path = Path(path)
        if not path.is_dir():
            raise CheckpointNotFoundError(f"{path}: not a torch_checkpointing folder")
        meta = read_metadata(path) if (path / METADATA_FILE).is_file() else None
        claimed = {layout.file for m in meta.items.values() for layout in m.layouts.values()} if meta else set()
        defaults = item_files(path, claimed)
        world = meta.world_size if meta is not None else _world(path, defaults)
        if world is None:
            counts = ", ".join(f"{item}: ranks {sorted(files)}" for item, files in defaults.items()) or "none"
            raise CorruptCheckpointError(f"{path}: the items' files are not one set of ranks 0..N-1 ({counts})")
        catalog = Catalog(format=self.name, path=path, objects=ObjectTable(), facts=Facts(source_world_size=world))
        items: dict[str, ItemMetadata] = meta.items if meta is not None else {}
        for item, files in defaults.items():
            if item in items:
                raise CorruptCheckpointError(f"{files[min(files)]}: item {item!r} is saved in the files metadata.pkl "
                                             f"names ({items[item].layouts[0].file}...), not in {item}_<rank>.pt")
            missing = sorted(set(range(world)) - set(files))
            if missing or max(files) >= world:
                raise CorruptCheckpointError(f"{path}: item {item!r} has files for ranks {sorted(files)}, the checkpoint "
                                             f"was saved by {plural(world, 'rank')}")
        per_rank: list[str] = []
        containers: dict[NestedPath, str] = {}
        for item, item_meta in items.items():
            rank_files_ = {r: _read_rank(path, item, r, item_meta) for r in range(world)}
            sharded_item(catalog, item, item_meta, rank_files_)
            per_rank += add_objects(catalog, item, rank_files_)
            containers.update(rank_files_[0].containers)
        for item, files in defaults.items():
            plain = {r: read_torch_rank(item, r, files[r]) for r in range(world)}
            plain_item(catalog, item, plain)
            per_rank += add_objects(catalog, item, plain)
            containers.update(plain[0].containers)
        if containers:
            catalog.facts.containers = containers
        _notices(catalog, meta, [i for i in defaults if _has_tensors(catalog, i)], per_rank)
        return catalog

    def writer(self, dst: Path | str, options: WriterOptions | None = None) -> Writer:
        from reshard.formats.torch_checkpointing.write import TorchCheckpointingWriter  # its own module (write.py)

        return TorchCheckpointingWriter(dst, options)


def _read_rank(folder: Path, item: str, rank: int, meta: ItemMetadata) -> RankFile:
    layout = meta.layouts[rank]
    file = folder / layout.file
    if isinstance(layout.serialization, SafetensorsSerialization):
        return read_safetensors_rank(item, rank, file, meta)
    return read_torch_rank(item, rank, file)


def _world(path: Path, found: dict[str, dict[int, Path]]) -> int | None:
    """The number of ranks when every item has files for ranks 0..N-1, the same N; else None."""
    sizes = {len(files) for files in found.values()}
    if len(sizes) != 1:
        return None
    world = sizes.pop()
    return world if all(set(files) == set(range(world)) for files in found.values()) else None


def _has_tensors(catalog: Catalog, item: str) -> bool:
    return any(name == item or name.startswith(item + ".") for name in catalog.tensors)


def _notices(catalog: Catalog, meta: TCMetadata | None, plain: list[str], per_rank: list[str]) -> None:
    if plain:
        catalog.notices.append(
            f"{plural(len(plain), 'item')} ({', '.join(plain)}) saved without a resharder (no sharding in "
            f"{'metadata.pkl' if meta is not None else 'the folder: no metadata.pkl'}): read as the files prove, "
            "DTensors by their own placements, plain tensors because every rank saved the same bytes")
    if per_rank:
        shown = ", ".join(per_rank[:8]) + (" ..." if len(per_rank) > 8 else "")
        catalog.notices.append(f"{plural(len(per_rank), 'value')} differ between the ranks' files (per-rank state) and "
                               f"are kept once per rank as NAME.rank<r>: {shown}")
