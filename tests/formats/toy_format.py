"""A toy format, as a contributor would add one: this module plus one registry entry (see
tests/formats/test_toy_format.py), with an output option of its own (``--toy-level`` /
``toy_level=``: declared here, named by the entry; the command line, the API and the
messages take it from there). A ``NAME.toy/`` folder holds ``data.bin`` (each tensor's
C-order bytes, one after another; ``data-<rank>.bin``, one per rank, when laid out for a mesh)
and ``toy.json`` (each tensor's dtype, shape and chunks: box, file and offset), written last:
the file that makes the folder a checkpoint. It reads and writes local folders and URLs alike
(``reshard.core.storage`` paths), and holds mesh layouts: the engine, staging and URL writing are
the core's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from reshard.core.boxes import Box
from reshard.core.catalog import Catalog, Chunk, TensorEntry
from reshard.core.dtypes import dtype_name, parse_dtype
from reshard.core.errors import CorruptCheckpointError, UsageError
from reshard.core.pieces import OutputFile, Piece
from reshard.core.regions import StoredRegion
from reshard.core.target import Target
from reshard.pipeline.options import OutputOption, WriterOptions

INDEX = "toy.json"


def _positive(level: int) -> None:
    if level < 1:
        raise UsageError(f"{LEVEL.named} {level}: a toy level is 1 or more")


LEVEL: OutputOption[int | None] = OutputOption(
    "toy_level", "--toy-level", "How loud a {takes:toy_level} output is (toy.json records it).", default=None,
    type=Optional[int], metavar="N", check=_positive)


class ToyFormat:
    name = "toy"

    def detect(self, path: Any) -> bool:
        return path.is_dir() and (path / INDEX).is_file()

    def read(self, path: Any) -> Catalog:
        path = Path(path) if isinstance(path, str) else path
        try:
            index = json.loads((path / INDEX).read_text())["tensors"]
        except (OSError, ValueError, KeyError) as e:
            raise CorruptCheckpointError(f"{path / INDEX}: not a toy index ({e})") from None
        catalog = Catalog(format=self.name, path=path)
        for name, t in index.items():
            shape, dtype = tuple(t["shape"]), parse_dtype(t["dtype"])
            chunks = [Chunk(Box(tuple(c["offsets"]), tuple(c["sizes"])),
                            StoredRegion(path / c["file"], int(c["offset"]), dtype, tuple(c["sizes"])))
                      for c in t["chunks"]]
            catalog.tensors[name] = TensorEntry(name, shape, dtype, chunks)
        return catalog

    def writer(self, dst: Path, options: WriterOptions | None = None) -> ToyWriter:
        return ToyWriter((options or WriterOptions()).value(LEVEL))


class ToyWriter:
    output_is_dir = True

    def __init__(self, level: int | None = None) -> None:
        self.level = level

    def layout(self, target: Target) -> list[OutputFile]:
        names = ["data.bin"] if target.world_size == 1 else [f"data-{r}.bin" for r in range(target.world_size)]
        files = [OutputFile(n) for n in names]
        for t in target.tensors.values():
            for box, rank in zip(t.boxes, t.ranks):
                files[rank].segments.append(Piece(t.name, box, t.dtype))
        return [f for f in files if f.segments] or files[:1]

    def finish(self, staging: Path, target: Target, files: list[OutputFile]) -> None:
        index: dict[str, Any] = {name: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "chunks": []}
                                 for name, t in target.tensors.items()}
        for file in files:
            for at, seg in zip(file.offsets(), file.segments):
                index[seg.name]["chunks"].append({"offsets": list(seg.box.offsets), "sizes": list(seg.box.sizes),
                                                  "file": file.relpath, "offset": at})
        (staging / INDEX).write_text(json.dumps({"tensors": index, **({"level": self.level} if self.level else {})}))

    def notices(self, target: Target) -> list[str]:
        return [f"toy holds tensors only: {len(target.objects)} objects not written"] if target.objects else []
