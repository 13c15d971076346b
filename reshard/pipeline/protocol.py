"""The protocol every checkpoint format implements: one reader, one writer, nothing else.

Lifecycle of a conversion, and who calls what:

1. ``registry.detect(path)`` picks the ``Format`` whose ``detect`` accepts the source.
2. ``fmt.read(path)`` validates the source's metadata and returns a ``Catalog``: every
   tensor's global shape, dtype and chunks (each chunk can read any sub-box of itself), and
   the small objects. No tensor data is read here.
3. The engine builds a ``Target`` (what the output holds: names, shapes, dtypes, boxes per
   target rank, objects) and asks ``fmt.writer(dst, options)`` for a ``Writer``; it reads the
   ``ConvertOptions`` its registry entry declares, and ignores the rest.
4. ``writer.layout(target)`` returns the output files as ``OutputFile``s: literal header
   bytes and ``Piece``s in file order. Everything a format needs to say about sizes and
   offsets is computable here, before data moves.
5. The engine writes every file through a sink (``reshard.pipeline.sinks``: a local staging folder,
   or an object store's uploads), streaming each Piece's bytes.
6. ``writer.finish(staging, target, files)`` writes what must come last (DCP ``.metadata``,
   a safetensors index) into a local folder, then the sink makes the output appear: renames
   the staging into place, or puts those files after the data, the marker last.

A format module knows its byte layout and the catalog, nothing about meshes or budgets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from reshard.core.catalog import Catalog
from reshard.core.pieces import OutputFile
from reshard.core.target import Target
from reshard.pipeline.options import WriterOptions

__all__ = ["Format", "Writer"]


class Writer(Protocol):
    # True when the output is a directory (DCP, sharded safetensors), False for one file.
    # Optional: ``marker``, the relpath of a file ``finish`` makes that makes the folder a
    # checkpoint for its readers (zarr's root ``zarr.json``), put last to an object store
    # (``reshard.pipeline.sinks.RemoteSink``; DCP ``.metadata`` and safetensors indexes are known).
    output_is_dir: bool

    def layout(self, target: Target) -> list[OutputFile]: ...

    def finish(self, staging: Path, target: Target, files: list[OutputFile]) -> None: ...

    def notices(self, target: Target) -> list[str]:
        """What this output cannot hold (objects dropped...), said to the user once."""
        ...


class Format(Protocol):
    name: str

    def detect(self, path: Path) -> bool: ...

    def read(self, path: Path) -> Catalog: ...

    def writer(self, dst: Path | str, options: WriterOptions | None = None) -> Writer:
        """``dst``: a local path, or the URL of an output written to a store (``reshard.pipeline.sinks``)."""
        ...
