"""``--quantize nvfp4``: compressed-tensors' ``NVFP4A16`` preset, NVIDIA's 4-bit float weights
(activations stay 16-bit), which vLLM runs on Blackwell's FP4 cores and emulates elsewhere.

Each linear weight ``<m>.weight`` [out, in] becomes

* ``<m>.weight_packed`` uint8 [out, in / 2]: FP4 E2M1 values, two per byte, the first in the
  low nibble (sign in bit 3; a negative value that rounds to zero is -0, as compressed-tensors
  packs it), rounded half to even on the E2M1 grid;
* ``<m>.weight_scale`` float8_e4m3fn [out, in / 16]: one scale per 16 values,
  ``fp8(global * amax(|group|) / 6)`` (0.125 where that is 0);
* ``<m>.weight_global_scale`` float32 [1]: ``448 * 6 / amax(|W|)``, where W is the matrix a
  serving engine fuses the weight into (q/k/v, gate/up share one), computed in the weight's dtype.

A value is ``fp4(w / (scale / global))``. A weight whose input dim is not a multiple of 16 stays
in the compute dtype (listed in ``ignore``): its last group would be partial, which compressed-
tensors refuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from reshard.core import dtypes
from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Chunk, TensorEntry
from reshard.core.regions import Banded
from reshard.features.quantize.compressed_tensors import FP8_MAX, Once, args, ct_config, row_bands
from reshard.features.quantize.scheme import Weight, checked_finite

if TYPE_CHECKING:
    import torch

__all__ = ["Nvfp4", "GROUP"]

GROUP = 16
FP4_MAX = 6.0
_FP8, _UINT8, _FLOAT32 = (dtypes.by_name(n) for n in ("float8_e4m3fn", "uint8", "float32"))
_ZERO_SCALE = 0.125  # compressed-tensors' eps for an fp8 scale
# |x| above each bound moves one E2M1 code up (0, 0.5, 1, 1.5, 2, 3, 4, 6): ties go to the even code
_UP = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _rows(band: Box, i: int) -> str:
    return f"rows {band.offsets[0]}-{band.offsets[0] + band.sizes[0] - 1}"


def global_scale(weight: Weight) -> torch.Tensor:
    """``[1]`` float32: 448 * 6 over the largest |value| of the weight and its fused partners,
    divided in the weight's dtype as compressed-tensors' ``generate_gparam`` does."""
    import torch

    d = weight.dtype.torch
    amax = torch.zeros((), dtype=d)
    for entry in weight.partners or (weight.entry,):
        for band in row_bands(entry.shape, weight.dtype.itemsize):
            part = weight.box(band, entry).abs().amax()
            checked_finite(part, entry.name, partial(_rows, band))
            amax = torch.maximum(amax, part)
    amax = torch.clamp(amax.reshape(1), min=torch.finfo(d).tiny)
    return torch.nan_to_num(FP8_MAX * FP4_MAX / amax, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32)


def _group_scales(w: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """float32 scales (fp8 values) of ``w``'s groups of 16: ``[rows, cols / 16]``."""
    import torch

    amax = w.unflatten(-1, (-1, GROUP)).abs().amax(dim=-1)
    scale = gs * (amax / torch.tensor(FP4_MAX, dtype=w.dtype))
    scale = torch.clamp(scale, -FP8_MAX, FP8_MAX).to(_FP8.torch).to(torch.float32)
    return torch.where(scale == 0, torch.tensor(_ZERO_SCALE), scale)


@dataclass(frozen=True)
class _Cols:
    """A box of a tensor laid out per weight column (``per`` columns of the weight per column of
    the tensor): the whole groups of the weight it needs."""

    weight: Weight
    per: int

    def groups(self, box: Box) -> tuple[Box, int, int]:
        """The weight's box of whole groups covering ``box``, and where ``box`` starts and ends in
        it (in the tensor's columns)."""
        (r0, c0), (nr, nc) = box.offsets, box.sizes
        lo, hi = c0 * self.per // GROUP * GROUP, -(-(c0 + nc) * self.per // GROUP) * GROUP
        start = (c0 * self.per - lo) // self.per
        return Box((r0, lo), (nr, hi - lo)), start, start + nc


@dataclass(frozen=True)
class _Packed(Banded):
    """The packed FP4 values of any box of ``weight_packed``."""

    weight: Weight
    gs: Once
    out_dtype = "uint8"

    def _band(self, box: Box) -> torch.Tensor:
        import torch

        need, a, b = _Cols(self.weight, 2).groups(box)
        w = self.weight.box(need)
        gs = self.gs()
        effective = (_group_scales(w, gs) / gs).repeat_interleave(GROUP, dim=1)
        x = (w / effective).abs()
        code = torch.zeros(x.shape, dtype=torch.uint8)
        for bound, inclusive in _UP:
            code += (x >= bound) if inclusive else (x > bound)
        code |= torch.signbit(w).to(torch.uint8) << 3
        packed = code[:, 0::2] | (code[:, 1::2] << 4)
        return packed[:, a:b]


@dataclass(frozen=True)
class _Scales(Banded):
    """The fp8 group scales of any box of ``weight_scale``."""

    weight: Weight
    gs: Once
    out_dtype = "float8_e4m3fn"

    def _band(self, box: Box) -> torch.Tensor:
        need, a, b = _Cols(self.weight, GROUP).groups(box)
        return _group_scales(self.weight.box(need), self.gs())[:, a:b].to(_FP8.torch)


class Nvfp4:
    name = "nvfp4"
    summary = ("compressed-tensors NVFP4A16: FP4 e2m1 weights packed two per byte, an fp8 scale per 16 values "
               "and a global scale")
    done = "FP4 e2m1 packed two per byte with an fp8 weight_scale per 16 values and a weight_global_scale (NVFP4A16)"
    skipped_key = "ignore"
    partial_note = ""

    def refuses(self, name: str, shape: tuple[int, ...]) -> str | None:
        return None if shape[1] % GROUP == 0 else \
            f"input dims not multiples of {GROUP} (a partial group, which compressed-tensors refuses)"

    def tensors(self, weight: Weight) -> dict[str, TensorEntry]:
        rows, cols = weight.entry.shape
        fused = ("nvfp4-global", *(e.name for e in weight.partners or (weight.entry,)))
        gs = weight.shared.setdefault(fused, Once(lambda: global_scale(weight)))  # once per fused set
        base = weight.name.removesuffix(".weight")
        packed, scale, glob = (f"{base}.weight_packed", f"{base}.weight_scale", f"{base}.weight_global_scale")
        return {packed: TensorEntry(packed, (rows, cols // 2), _UINT8,
                                    [Chunk(full_box((rows, cols // 2)), _Packed(weight, gs))]),
                scale: TensorEntry(scale, (rows, cols // GROUP), _FP8,
                                   [Chunk(full_box((rows, cols // GROUP)), _Scales(weight, gs))]),
                glob: TensorEntry(glob, (1,), _FLOAT32, [Chunk(full_box((1,)), gs)])}

    def config(self, skipped: Mapping[str, tuple[int, ...]], quantized: int) -> dict[str, Any]:
        return ct_config("NVFP4A16", "nvfp4-pack-quantized",
                         args(num_bits=4, strategy="tensor_group", dynamic=False, group_size=GROUP,
                              scale_dtype="torch.float8_e4m3fn"), None, skipped, quantized)
