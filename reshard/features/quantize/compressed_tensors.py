"""What the compressed-tensors schemes share: the ``quantization_config`` vLLM, SGLang and
transformers parse, the arithmetic of its scales, and the refusal of a weight no scale can hold.

The config is the one compressed-tensors 0.19 writes for a preset scheme (llm-compressor's
``model_free_ptq``): one config group named after the preset, targeting ``Linear``, with every
field of ``QuantizationArgs``, status ``compressed`` and ``ignore`` listing the modules left in the
compute dtype by name. tests/test_quantize_ct.py checks it against compressed-tensors' own model
of it and against ``model_free_ptq``'s output.

The arithmetic is compressed-tensors' (``calculate_qparams``, ``_quantize``), op for op, in the
dtype the export would hold the weight in (bf16 weights give bf16 scales, computed in bf16), so
``reshard convert --to hf --quantize S`` writes what ``model_free_ptq`` writes for the same
export without ``--quantize``, bit for bit.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from reshard.core import dtypes
from reshard.core.boxes import Box
from reshard.core.regions import BAND_BYTES, Banded
from reshard.features.quantize.scheme import Weight, checked_finite

if TYPE_CHECKING:
    import torch

__all__ = ["EXPERT", "VERSION", "ct_config", "args", "ignored_modules", "Once", "FP8_MAX", "row_bands",
           "fp8_scales", "fp8_grid_scales", "fp8_values", "Fp8GridValues"]

VERSION = "0.19.0"  # the compressed-tensors release whose config and tensors these schemes write
EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")  # an expert's weight, and its fused experts module
FP8_MAX = 448.0  # float8_e4m3fn's largest value: q_max of an 8-bit float scheme
_FP8 = dtypes.by_name("float8_e4m3fn")


def args(*, num_bits: int, strategy: str, dynamic: bool, group_size: int | None = None,
         block_structure: list[int] | None = None, scale_dtype: str | None = None) -> dict[str, Any]:
    """One ``QuantizationArgs`` as compressed-tensors dumps it: symmetric floats, every field."""
    return {"actorder": None, "block_structure": block_structure, "dynamic": dynamic, "group_size": group_size,
            "num_bits": num_bits, "observer": None, "observer_kwargs": {}, "scale_dtype": scale_dtype,
            "strategy": strategy, "symmetric": True, "type": "float", "zp_dtype": None}


def ignored_modules(skipped: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The modules compressed-tensors must not treat as quantized: those of the 2-D weights left
    alone (a 1-D norm is no Linear, so no reader would), the tied head among them, and the
    ``experts`` module of any expert left alone (transformers and vLLM fuse experts into it)."""
    names = [n for n, shape in skipped.items() if len(shape) != 1]
    return sorted({n.removesuffix(".weight") for n in names} | {m.group(1) for n in names if (m := EXPERT.match(n))})


def ct_config(group: str, fmt: str, weights: dict[str, Any], inputs: dict[str, Any] | None,
              skipped: Mapping[str, tuple[int, ...]], quantized: int) -> dict[str, Any]:
    """``quantization_config`` for one preset ``group`` of compressed-tensors format ``fmt``:
    ``dense`` and no group format when no weight is quantized, as compressed-tensors says then."""
    return {"config_groups": {group: {"format": fmt if quantized else None, "input_activations": inputs,
                                      "output_activations": None, "targets": ["Linear"], "weights": weights}},
            "format": fmt if quantized else "dense", "global_compression_ratio": None, "ignore": ignored_modules(skipped),
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "transform_config": {}, "version": VERSION}


def row_bands(shape: tuple[int, ...], itemsize: int, multiple: int = 1) -> list[Box]:
    """Boxes of whole rows (a ``multiple`` of rows each) covering ``shape``, each about
    ``BAND_BYTES``: how a scale that needs whole rows reads a weight."""
    rows, cols = shape
    step = max(1, BAND_BYTES // max(1, cols * itemsize * multiple)) * multiple
    return [Box((r0, 0), (min(step, rows - r0), cols)) for r0 in range(0, rows, step)]


def fp8_scales(amax: torch.Tensor) -> torch.Tensor:
    """``calculate_qparams`` of a symmetric 8-bit float scheme: ``amax / 448`` in ``amax``'s
    dtype, that dtype's eps where it is 0."""
    import torch

    d = amax.dtype
    scale = amax / torch.tensor(FP8_MAX, dtype=d)
    return torch.where(scale == 0, torch.tensor(torch.finfo(d).eps, dtype=d), scale)


def fp8_grid_scales(weight: Weight, rows: int, cols: int | None) -> torch.Tensor:
    """compressed-tensors' scales of ``weight`` per block of ``rows`` x ``cols`` (``cols`` None:
    whole rows, one scale per output channel), ``[out / rows, in / cols]`` in the weight's dtype,
    read a band of whole block rows at a time; a block holding inf or NaN is refused, named."""
    import torch

    total = weight.entry.shape[1]
    width = cols or total
    parts = []
    for band in row_bands(weight.entry.shape, weight.dtype.itemsize, rows):
        nr = band.sizes[0]
        amax = weight.box(band).reshape(nr // rows, rows, total // width, width).abs().amax(dim=(1, 3))
        checked_finite(amax, weight.name, partial(_cell, band.offsets[0] // rows, amax.shape[1], cols is None))
        parts.append(amax)
    return fp8_scales(torch.cat(parts) if parts else torch.empty((0, total // width), dtype=weight.dtype.torch))


def _cell(first: int, per_row: int, channel: bool, i: int) -> str:
    """The i-th scale of a band whose first block row is ``first``: a row, or a block."""
    return f"row {first + i}" if channel else f"block ({first + i // per_row}, {i % per_row})"


def fp8_values(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``_quantize``: ``w / scale`` in ``w``'s dtype, clamped to the fp8 range, rounded to fp8."""
    import torch

    return torch.clamp(w / scale, -FP8_MAX, FP8_MAX).to(_FP8.torch)


@dataclass(frozen=True)
class Fp8GridValues(Banded):
    """The FP8 values of any box of ``weight``: each element divided by the scale of its
    ``rows`` x ``cols`` block of ``scales`` (``fp8_grid_scales`` with the same grid; ``cols``
    None: one scale per ``rows`` whole rows, ``[out / rows, 1]``)."""

    weight: Weight
    scales: Once
    rows: int
    cols: int | None
    out_dtype = "float8_e4m3fn"

    def _band(self, box: Box) -> torch.Tensor:
        import torch

        (r0, c0), (nr, nc) = box.offsets, box.sizes
        rows = torch.arange(r0, r0 + nr) // self.rows
        if self.cols is None:  # [nr, 1]: a scale per row of blocks, broadcast along it
            return fp8_values(self.weight.box(box), self.scales()[rows])
        cols = torch.arange(c0, c0 + nc) // self.cols
        return fp8_values(self.weight.box(box), self.scales()[rows[:, None], cols[None, :]])


class Once:
    """A tensor computed on first use, once, whichever engine thread asks first; as chunk data,
    any box of it (the scales a scheme writes beside its values)."""

    def __init__(self, compute: Callable[[], torch.Tensor]) -> None:
        self._compute: Callable[[], torch.Tensor] | None = compute
        self._value: torch.Tensor | None = None
        self._lock = threading.Lock()

    def __call__(self) -> torch.Tensor:
        with self._lock:
            if self._value is None:
                assert self._compute is not None
                self._value, self._compute = self._compute(), None
            return self._value

    def read(self, box: Box) -> torch.Tensor:
        return self()[box.as_slices()].contiguous()
