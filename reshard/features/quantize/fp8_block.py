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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reshard.core import dtypes
from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Chunk, TensorEntry
from reshard.core.regions import Banded
from reshard.features.quantize.compressed_tensors import EXPERT, Once, args, ct_config, fp8_grid_scales, fp8_values
from reshard.features.quantize.scheme import Weight

if TYPE_CHECKING:
    import torch

__all__ = ["Fp8Block", "BLOCK"]

BLOCK = 128
# transformers (5.24) cannot load block-scaled experts into the fused experts module it builds
# (Qwen3-MoE, Mixtral: "CompressedTensorsDequantize on tensors destined for ...experts.down_proj"),
# neither from model_free_ptq's output nor from reshard's: they stay in the compute dtype.
EXPERTS = "MoE experts (transformers cannot load block-scaled experts into its fused experts module)"
_FP8 = dtypes.by_name("float8_e4m3fn")


@dataclass(frozen=True)
class _Values(Banded):
    """The FP8 values of any box: each element divided by its block's scale."""

    weight: Weight
    scales: Once
    out_dtype = "float8_e4m3fn"

    def _band(self, box: Box) -> torch.Tensor:
        import torch

        (r0, c0), (nr, nc) = box.offsets, box.sizes
        rows = torch.arange(r0, r0 + nr) // BLOCK
        cols = torch.arange(c0, c0 + nc) // BLOCK
        return fp8_values(self.weight.box(box), self.scales()[rows[:, None], cols[None, :]])


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
        return {weight.name: TensorEntry(weight.name, shape, _FP8, [Chunk(full_box(shape), _Values(weight, scales))]),
                scale: TensorEntry(scale, grid, weight.dtype, [Chunk(full_box(grid), scales)])}

    def config(self, skipped: Mapping[str, tuple[int, ...]], quantized: int) -> dict[str, Any]:
        return ct_config("FP8_BLOCK", "float-quantized",
                         args(num_bits=8, strategy="block", dynamic=False, block_structure=[BLOCK, BLOCK]),
                         args(num_bits=8, strategy="group", dynamic=True, group_size=BLOCK), skipped, quantized)
