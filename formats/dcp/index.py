"""A DCP folder's index: its ``.metadata``, or the per-rank ``__{rank}.metadata`` files of a
``use_collectives=False`` save merged into one, each tensor's chunks checked to tile it."""

from __future__ import annotations

from pathlib import Path

from reshard.formats.dcp.metadata import DCPIndex, read_metadata_file
from reshard.formats.dcp.ranks import merged_rank_index, rank_metadata_files

from reshard.core.boxes import tiles_columns, tiling_suspects
from reshard.core.errors import CheckpointNotFoundError, CorruptCheckpointError

__all__ = ["load_dcp_index"]


def load_dcp_index(root: Path) -> DCPIndex:
    """``root/.metadata``, or every ``root/__{rank}.metadata`` merged; each tensor's chunks
    checked to tile it exactly once."""
    meta_path = root / ".metadata"
    if meta_path.is_file():
        index, where = read_metadata_file(meta_path, root), f"{meta_path}"
    else:
        ranks = rank_metadata_files(root)
        if not ranks:
            raise CheckpointNotFoundError(f"{root}: no .metadata file; not a DCP checkpoint folder")
        index, where = merged_rank_index(root, ranks), f"{root}/__*.metadata"
    by_rank: dict[int, list[str]] = {}
    for name, (shape, _, _) in index.tensors.items():
        by_rank.setdefault(len(shape), []).append(name)
    suspects = []
    for names in by_rank.values():
        tables = [index.table(n) for n in names]
        found = tiling_suspects([index.tensors[n][0] for n in names], [t.offsets for t in tables], [t.sizes for t in tables])
        suspects += [names[k] for k in found]
    order = {name: i for i, name in enumerate(index.tensors)}
    for name in sorted(suspects, key=order.__getitem__):  # the first in the file's order is reported
        table = index.table(name)
        problem = tiles_columns(index.tensors[name][0], table.offsets, table.sizes)
        if problem:
            raise CorruptCheckpointError(f"{where}: {name!r}: {problem}")
    return index
