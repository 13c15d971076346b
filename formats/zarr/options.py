"""``--compress``, the zarr format's own output option (its registry entry takes it and
``--max-shard-size``), declared apart from the format so ``reshard --help`` does not import it."""

from __future__ import annotations

from reshard.pipeline.options import OutputOption

__all__ = ["COMPRESS"]

COMPRESS: OutputOption[bool] = OutputOption(
    "compress", "--compress", "zstd-compress the chunks of a {takes:compress} output (smaller, slower; default off).",
    default=False, type=bool, api="compress=True", after="fsync")
