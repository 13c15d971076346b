"""``--quantize fp8-block``: compressed-tensors' ``FP8_BLOCK`` preset, the block-scaled FP8 of
DeepSeek-V3 in compressed-tensors' own layout, which vLLM runs with its block kernels.

Each linear weight ``<m>.weight`` becomes ``float8_e4m3fn`` with ``<m>.weight_scale``
[out / 128, in / 128] in the weight's dtype, one scale per 128x128 block: ``amax(|block|) / 448``
(the dtype's eps for a block of zeros); activations are quantized per group of 128 at run time.
A weight with a dim that is not a multiple of 128 stays in the compute dtype (listed in
``ignore``): vLLM refuses a fused layer whose parts do not fill whole blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reshard.core import dtypes
from reshard.core.boxes import full_box
from reshard.core.catalog import Chunk, TensorEntry
from reshard.features.quantize.compressed_tensors import EXPERT, Fp8GridValues, Once, args, ct_config, fp8_grid_scales
from reshard.features.quantize.scheme import Weight

__all__ = ["Fp8Block", "BLOCK"]

BLOCK = 128
# transformers (5.24) cannot load block-scaled experts into the fused experts module it builds
# (Qwen3-MoE, Mixtral: "CompressedTensorsDequantize on tensors destined for ...experts.down_proj"),
# neither from model_free_ptq's output nor from reshard's: they stay in the compute dtype.
EXPERTS = "MoE experts (transformers cannot load block-scaled experts into its fused experts module)"
_FP8 = dtypes.by_name("float8_e4m3fn")


class Fp8Block:
    name = "fp8-block"
    summary = "compressed-tensors FP8_BLOCK: float8_e4m3fn weights with a scale per 128x128 block"
    done = f"float8_e4m3fn with a weight_scale per {BLOCK}x{BLOCK} block (compressed-tensors FP8_BLOCK)"
    skipped_key = "ignore"
    partial_note = ""

    def refuses(self, name: str, shape: tuple[int, ...]) -> str | None:
        if EXPERT.match(name):
            return EXPERTS
        return None if all(d % BLOCK == 0 for d in shape) else \
            f"dims not multiples of {BLOCK} (vLLM refuses a fused layer whose parts are not whole blocks)"

    def tensors(self, weight: Weight) -> dict[str, TensorEntry]:
        rows, cols = shape = weight.entry.shape
        scales = Once(lambda: fp8_grid_scales(weight, BLOCK, BLOCK))
        grid = (rows // BLOCK, cols // BLOCK)
        scale = weight.name + "_scale"
        values = Fp8GridValues(weight, scales, BLOCK, BLOCK)
        return {weight.name: TensorEntry(weight.name, shape, _FP8, [Chunk(full_box(shape), values)]),
                scale: TensorEntry(scale, grid, weight.dtype, [Chunk(full_box(grid), scales)])}

    def config(self, skipped: Mapping[str, tuple[int, ...]], quantized: int) -> dict[str, Any]:
        return ct_config("FP8_BLOCK", "float-quantized",
                         args(num_bits=8, strategy="block", dynamic=False, block_structure=[BLOCK, BLOCK]),
                         args(num_bits=8, strategy="group", dynamic=True, group_size=BLOCK), skipped, quantized)
