"""The torch_checkpointing format's entry: written here; reading comes with its reader."""

from __future__ import annotations

from pathlib import Path

from reshard.formats.torch_checkpointing.write import TorchCheckpointingWriter

from reshard.core.catalog import Catalog
from reshard.core.errors import UnsupportedFormatError
from reshard.pipeline.options import WriterOptions

__all__ = ["TorchCheckpointingFormat"]


class TorchCheckpointingFormat:
    name = "torch-checkpointing"

    def detect(self, path: Path) -> bool:
        return False

    def read(self, path: Path) -> Catalog:
        raise UnsupportedFormatError(f"{path}: reading torch_checkpointing folders is not supported yet")

    def writer(self, dst: Path | str, options: WriterOptions | None = None) -> TorchCheckpointingWriter:
        return TorchCheckpointingWriter(dst, options)
