"""A toy format, as a contributor would add one: this module plus one registry entry (see
tests/formats/test_toy_format.py). A ``NAME.toy/`` folder holds ``data.bin`` (each tensor's
C-order bytes, one after another) and ``toy.json`` (each tensor's dtype, shape and offset)."""

from __future__ import annotations

import json
from pathlib import Path

from reshard.boxes import full_box
from reshard.catalog import Catalog, Chunk, Target, TensorEntry
from reshard.dtypes import dtype_name, parse_dtype
from reshard.errors import CorruptCheckpointError
from reshard.options import ConvertOptions
from reshard.pieces import OutputFile, Piece
from reshard.regions import StoredRegion


class ToyFormat:
    name = "toy"

    def detect(self, path: Path) -> bool:
        return path.is_dir() and (path / "toy.json").is_file()

    def read(self, path: Path) -> Catalog:
        path = Path(path)
        try:
            index = json.loads((path / "toy.json").read_text())["tensors"]
        except (OSError, ValueError, KeyError) as e:
            raise CorruptCheckpointError(f"{path / 'toy.json'}: not a toy index ({e})") from None
        catalog = Catalog(format=self.name, path=path)
        for name, t in index.items():
            shape, dtype = tuple(t["shape"]), parse_dtype(t["dtype"])
            region = StoredRegion(path / "data.bin", int(t["offset"]), dtype, shape)
            catalog.tensors[name] = TensorEntry(name, shape, dtype, [Chunk(full_box(shape), region)])
        return catalog

    def writer(self, dst: Path, options: ConvertOptions | None = None) -> ToyWriter:
        return ToyWriter()  # no format-specific options: its registry entry declares none


class ToyWriter:
    output_is_dir = True
    finish_rewrites_data = False

    def layout(self, target: Target) -> list[OutputFile]:
        data = OutputFile("data.bin")
        for t in target.tensors.values():
            data.segments.append(Piece(t.name, t.boxes[0], t.dtype))
        return [data]

    def finish(self, staging: Path, target: Target, files: list[OutputFile]) -> None:
        offsets = {seg.name: at for at, seg in zip(files[0].offsets(), files[0].segments)}
        index = {name: {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": offsets[name]}
                 for name, t in target.tensors.items()}
        (staging / "toy.json").write_text(json.dumps({"tensors": index}))

    def notices(self, target: Target) -> list[str]:
        return [f"toy holds tensors only: {len(target.objects)} objects not written"] if target.objects else []
