"""``--quantize fp8``: block-scaled FP8 weights for inference engines, written while streaming.

The format is DeepSeek-V3's, which transformers (``FineGrainedFP8Config``), vLLM and SGLang
read: each 2-D linear weight ``<m>.weight`` becomes ``float8_e4m3fn`` with a float32
``<m>.weight_scale_inv`` of shape ``(rows / 128, cols / 128)``, one scale per 128x128 block,
and ``config.json`` gets

    quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

A block's scale is ``amax(|block|) / 448`` (448: float8_e4m3fn's largest value; a block of
zeros gets 1) and its values are ``(block / scale).to(float8_e4m3fn)``, computed in float32
from the weight's float32 values (merged, dequantized or as stored: never rounded to
``--dtype`` first). Embeddings, the output head, norms and router gates stay in the compute
dtype (as DeepSeek-V3 ships them), and so does every tensor ``--keep-dtype`` names; their
modules are listed in ``modules_to_not_convert``.

So do weights with a dim that is not a multiple of 128, decided before anything is written:
readers disagree on their partial edge blocks. DeepSeek-V3's reference and llama.cpp's converter
take a ceil grid, but transformers' dequantizing load derives the block from the shapes (200
rows / 2 scale rows = 100) and gets those weights wrong, and a fused MoE expert tensor (Mixtral,
Qwen3-MoE: ``gate_up_proj``) has another grid than its experts' ceil grids stacked.
llm-compressor refuses such layers for the same reason. An expert's module is listed with its
``experts`` parent, so the fused experts module is not converted either.

Both tensors are computed for whatever box the engine asks: a box's values need the scales of
the blocks it touches, which need those blocks' rows whole; the scales of a row of blocks are
computed once per tensor and kept (one float per 16,384 weights).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from reshard.core import dtypes
from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Chunk, TensorEntry
from reshard.core.chunk_reads import float32_box
from reshard.core.regions import BAND_BYTES, Banded
from reshard.features.quantize.scheme import Weight, checked_finite

if TYPE_CHECKING:
    import torch

__all__ = ["DeepSeekFp8", "BLOCK", "FP8_MAX", "PARTIAL", "scale_name"]

BLOCK = 128
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
PARTIAL = f"dims not multiples of {BLOCK}"
_FP8 = dtypes.by_name("float8_e4m3fn")
_FLOAT32 = dtypes.by_name("float32")
_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")


def scale_name(name: str) -> str:
    """``<m>.weight`` -> ``<m>.weight_scale_inv``."""
    return name + "_scale_inv"


def _block(i: int, r0: int, nr: int, cols: int, j: int) -> str:
    """Block ``(i, j)`` and the rows and columns it covers (the last ones partial)."""
    return f"block ({i}, {j}) (rows {r0}-{r0 + nr - 1}, columns {j * BLOCK}-{min(cols, (j + 1) * BLOCK) - 1})"


@dataclass
class _Blocks:
    """One weight's 128x128 blocks: their scales, a row of blocks at a time, computed once."""

    source: TensorEntry
    _rows: dict[int, torch.Tensor] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def grid(self) -> tuple[int, int]:
        rows, cols = self.source.shape
        return -(-rows // BLOCK), -(-cols // BLOCK)

    def scales(self, first: int, count: int) -> torch.Tensor:
        """Scales of block rows ``[first, first + count)``: ``[count, ceil(cols / 128)]``."""
        import torch

        return torch.stack([self._row(i) for i in range(first, first + count)]) if count else \
            torch.empty((0, self.grid[1]), dtype=torch.float32)

    def _row(self, i: int) -> torch.Tensor:
        found = self._rows.get(i)
        if found is not None:
            return found
        import torch

        rows, cols = self.source.shape
        r0, nr = i * BLOCK, min(BLOCK, rows - i * BLOCK)
        amax = torch.empty(self.grid[1], dtype=torch.float32)
        step = max(1, BAND_BYTES // (4 * BLOCK * BLOCK)) * BLOCK  # columns read at a time: whole blocks
        for c0 in range(0, cols, step):
            nc = min(step, cols - c0)
            w = float32_box(self.source, Box((r0, c0), (nr, nc))).abs_()
            for j in range(-(-nc // BLOCK)):
                amax[c0 // BLOCK + j] = w[:, j * BLOCK: (j + 1) * BLOCK].amax()
        checked_finite(amax, self.source.name, partial(_block, i, r0, nr, cols), "an FP8 block scale", "the whole block")
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        with self._lock:
            self._rows[i] = scale
        return scale


@dataclass(frozen=True)
class _Values(Banded):
    """The FP8 values of any box: its float32 rows divided by their blocks' scales."""

    blocks: _Blocks
    out_dtype = "float8_e4m3fn"

    def _band(self, box: Box) -> torch.Tensor:
        import torch

        w = float32_box(self.blocks.source, box)
        if box.numel == 0:
            return w.to(_FP8.torch)
        (r0, c0), (nr, nc) = box.offsets, box.sizes
        g0 = r0 // BLOCK
        scales = self.blocks.scales(g0, -(-(r0 + nr) // BLOCK) - g0)
        per_row = scales.repeat_interleave(BLOCK, dim=0)[r0 - g0 * BLOCK: r0 - g0 * BLOCK + nr]
        out = torch.empty(box.sizes, dtype=_FP8.torch)
        for j in range(c0 // BLOCK, -(-(c0 + nc) // BLOCK)):
            a, b = max(c0, j * BLOCK) - c0, min(c0 + nc, (j + 1) * BLOCK) - c0
            out[:, a:b] = (w[:, a:b] / per_row[:, j: j + 1]).to(_FP8.torch)
        return out


@dataclass(frozen=True)
class _Scales:
    """The float32 ``weight_scale_inv`` grid, any box of it."""

    blocks: _Blocks

    def read(self, box: Box) -> torch.Tensor:
        (g0, c0), (ng, nc) = box.offsets, box.sizes
        return self.blocks.scales(g0, ng)[:, c0: c0 + nc].contiguous()


def _modules(names: list[str]) -> list[str]:
    """The modules of ``names``, and the ``experts`` module of any expert among them (which
    transformers fuses into one module of stacked weights)."""
    out = {n.removesuffix(".weight") for n in names}
    return sorted(out | {m.group(1) for n in names if (m := _EXPERT.match(n))})


class DeepSeekFp8:
    """``--quantize fp8``: the format of the module docstring."""

    name = "fp8"
    summary = (f"float8_e4m3fn with float32 weight_scale_inv per {BLOCK}x{BLOCK} block (DeepSeek-V3's format, "
               "for vLLM, SGLang, transformers)")
    done = f"float8_e4m3fn with float32 weight_scale_inv per {BLOCK}x{BLOCK} block (from their float32 values)"
    skipped_key = "modules_to_not_convert"
    partial_note = (f"their partial {BLOCK}x{BLOCK} blocks are dequantized differently by transformers than by "
                    "DeepSeek-V3's rule and llama.cpp, so they stay as they are")

    def refuses(self, name: str, shape: tuple[int, ...]) -> str | None:
        return None if all(d % BLOCK == 0 for d in shape) else PARTIAL

    def tensors(self, weight: Weight) -> dict[str, TensorEntry]:
        entry = weight.entry
        blocks = _Blocks(entry)
        grid = blocks.grid
        return {weight.name: TensorEntry(weight.name, entry.shape, _FP8, [Chunk(full_box(entry.shape), _Values(blocks))]),
                scale_name(weight.name): TensorEntry(scale_name(weight.name), grid, _FLOAT32,
                                                     [Chunk(full_box(grid), _Scales(blocks))])}

    def config(self, skipped: Mapping[str, tuple[int, ...]], quantized: int) -> dict[str, Any]:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": _modules(list(skipped))}
