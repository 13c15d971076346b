"""A toy quantization scheme, as a contributor would add one: this module plus one row in
reshard/features/quantize/registry.py (tests/test_quantize_seam.py adds the row). ``int8-row`` stores each
linear weight as int8 with a float32 ``weight_scale`` per row, ``amax(|row|) / 127``; the
driver chooses the weights, reads them in the export's dtype, writes the notice and the config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Chunk, TensorEntry
from reshard.features.quantize.scheme import Weight


@dataclass(frozen=True)
class _Values:
    weight: Weight

    def read(self, box: Box) -> torch.Tensor:
        rows = Box((box.offsets[0], 0), (box.sizes[0], self.weight.entry.shape[1]))
        scale = _scales(self.weight, rows)
        w = self.weight.box(box).float()
        return torch.round(w / scale).clamp(-127, 127).to(torch.int8)


@dataclass(frozen=True)
class _Scales:
    weight: Weight

    def read(self, box: Box) -> torch.Tensor:
        rows = Box((box.offsets[0], 0), (box.sizes[0], self.weight.entry.shape[1]))
        return _scales(self.weight, rows)


def _scales(weight: Weight, rows: Box) -> torch.Tensor:
    amax = weight.box(rows).float().abs().amax(dim=1, keepdim=True)
    return torch.where(amax > 0, amax / 127, torch.ones_like(amax))


class Int8Row:
    name = "int8-row"
    summary = "toy: int8 weights with a float32 scale per row"
    done = "int8 with a float32 weight_scale per row (toy)"
    skipped_key = "ignore"
    partial_note = ""

    def refuses(self, name: str, shape: tuple[int, ...]) -> str | None:
        return None

    def tensors(self, weight: Weight) -> dict[str, TensorEntry]:
        rows, cols = weight.entry.shape
        scale = weight.name + "_scale"
        return {weight.name: TensorEntry(weight.name, (rows, cols), torch.int8,
                                         [Chunk(full_box((rows, cols)), _Values(weight))]),
                scale: TensorEntry(scale, (rows, 1), torch.float32, [Chunk(full_box((rows, 1)), _Scales(weight))])}

    def config(self, skipped: Mapping[str, tuple[int, ...]], quantized: int) -> dict[str, Any]:
        return {"quant_method": "toy-int8-row", "ignore": sorted(n.removesuffix(".weight") for n in skipped)}
