"""``--quantize fp8-dynamic``: compressed-tensors' ``FP8_DYNAMIC`` preset, the FP8 format most
models on the Hub ship and vLLM runs natively.

Each linear weight ``<m>.weight`` [out, in] becomes ``float8_e4m3fn`` with ``<m>.weight_scale``
[out, 1] in the weight's dtype, one scale per output channel: ``amax(|row|) / 448`` (the dtype's
eps for a row of zeros); activations are quantized per token at run time, so nothing is
calibrated. Any shape quantizes: a scale per row has no partial blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reshard.core import dtypes
from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Chunk, TensorEntry
from reshard.core.regions import Banded
from reshard.features.quantize.compressed_tensors import Once, args, ct_config, fp8_grid_scales, fp8_values
from reshard.features.quantize.scheme import Weight

if TYPE_CHECKING:
    import torch

__all__ = ["Fp8Dynamic"]

_FP8 = dtypes.by_name("float8_e4m3fn")


@dataclass(frozen=True)
class _Values(Banded):
    """The FP8 values of any box: its rows divided by their scales, in the weight's dtype."""

    weight: Weight
    scales: Once
    out_dtype = "float8_e4m3fn"

    def _band(self, box: Box) -> torch.Tensor:
        (r0, _), (nr, _) = box.offsets, box.sizes
        return fp8_values(self.weight.box(box), self.scales()[r0: r0 + nr])


class Fp8Dynamic:
    name = "fp8-dynamic"
    summary = "compressed-tensors FP8_DYNAMIC: float8_e4m3fn weights with a scale per output channel, activations per token"
    done = "float8_e4m3fn with a weight_scale per output channel (compressed-tensors FP8_DYNAMIC)"
    skipped_key = "ignore"
    partial_note = ""

    def refuses(self, name: str, shape: tuple[int, ...]) -> str | None:
        return None

    def tensors(self, weight: Weight) -> dict[str, TensorEntry]:
        rows, _ = shape = weight.entry.shape
        scales = Once(lambda: fp8_grid_scales(weight, 1, None))  # [out, 1]
        scale = weight.name + "_scale"
        return {weight.name: TensorEntry(weight.name, shape, _FP8, [Chunk(full_box(shape), _Values(weight, scales))]),
                scale: TensorEntry(scale, (rows, 1), weight.dtype, [Chunk(full_box((rows, 1)), scales)])}

    def config(self, skipped: Mapping[str, tuple[int, ...]], quantized: int) -> dict[str, Any]:
        return ct_config("FP8_DYNAMIC", "float-quantized",
                         args(num_bits=8, strategy="channel", dynamic=False),
                         args(num_bits=8, strategy="token", dynamic=True), skipped, quantized)
