"""The ``torch-ranks`` format: a folder of per-rank torch.save files (``torch.ranks``), or
verl's three sets of them (``formats/torch/verl.py``), read as one checkpoint; ``rank{r}.pt``
outputs (``torch.ranks_write``)."""

from __future__ import annotations

from pathlib import Path

from reshard.formats.torch.ranks import first_refused, one_set, rank_files, read_set, read_trees
from reshard.formats.torch.ranks_write import TorchRanksWriter
from reshard.formats.torch.verl import read_verl, verl_sets

from reshard.core.catalog import Catalog
from reshard.core.errors import CheckpointNotFoundError, ReshardError, UnsafeCheckpointError
from reshard.pipeline.options import WriterOptions

__all__ = ["TorchRanksFormat"]


class TorchRanksFormat:
    name = "torch-ranks"

    def detect(self, path: Path) -> bool:
        if not path.is_dir() or (path / ".metadata").exists():  # a DCP folder is DCP's
            return False
        return any(len(files) >= 2 for files in rank_files(path).values())

    def read(self, path: Path) -> Catalog:
        """Catalog the folder: one set of rank files, or verl's three (``formats/torch/verl.py``).
        Objects are read when asked for; one that names a global nobody allowed is refused
        then, unless the folder cannot be read at all, when that refusal is what is reported."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointNotFoundError(f"{path}: not a folder of per-rank torch files")
        groups = rank_files(path)
        sets = verl_sets(path, groups)
        if sets is not None:
            return read_verl(path, sets)
        files = one_set(path, groups)
        trees = read_trees(files)
        try:
            return read_set(path, files, trees)
        except ReshardError as e:
            refused = None if isinstance(e, UnsafeCheckpointError) else first_refused(files, trees)
            if refused is not None:
                raise UnsafeCheckpointError(refused) from e
            raise

    def writer(self, dst: Path, options: WriterOptions | None = None) -> TorchRanksWriter:
        return TorchRanksWriter()
