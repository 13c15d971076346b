"""``--quantize fp8-dynamic``: compressed-tensors' ``FP8_DYNAMIC`` preset, the FP8 format most
models on the Hub ship and vLLM runs natively.

Each linear weight ``<m>.weight`` [out, in] becomes ``float8_e4m3fn`` with ``<m>.weight_scale``
[out, 1] in the weight's dtype, one scale per output channel: ``amax(|row|) / 448`` (the dtype's
eps for a row of zeros); activations are quantized per token at run time, so nothing is
calibrated. Any shape quantizes: a scale per row has no partial blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reshard.core import dtypes
from reshard.core.boxes import full_box
from reshard.core.catalog import Chunk, TensorEntry
from reshard.features.quantize.compressed_tensors import Fp8GridValues, Once, args, ct_config, fp8_grid_scales
from reshard.features.quantize.scheme import Weight

__all__ = ["Fp8Dynamic"]

_FP8 = dtypes.by_name("float8_e4m3fn")


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
        values = Fp8GridValues(weight, scales, 1, None)
        return {weight.name: TensorEntry(weight.name, shape, _FP8, [Chunk(full_box(shape), values)]),
                scale: TensorEntry(scale, (rows, 1), weight.dtype, [Chunk(full_box((rows, 1)), scales)])}

    def config(self, skipped: Mapping[str, tuple[int, ...]], quantized: int) -> dict[str, Any]:
        return ct_config("FP8_DYNAMIC", "float-quantized",
                         args(num_bits=8, strategy="channel", dynamic=False),
                         args(num_bits=8, strategy="token", dynamic=True), skipped, quantized)
