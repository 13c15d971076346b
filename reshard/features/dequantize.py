"""Quantized checkpoints: pair each quantized weight with its scales, and dequantize on read.

A quantized weight is low-precision values plus a scale tensor beside it; ``--dtype`` casting
the values alone gives numbers off by the scale, and carries the scales as if they were
weights. So a cast first replaces each pair by one float32 tensor whose chunks compute
``values * scale`` for whatever box is asked (only the values and scales covering that box
are read), and the engine's single cast to the target dtype follows. The schemes, as data,
with what transformers 5.23 does with each:

* ``fp8-block``: ``<m>.weight`` float8 + ``<m>.weight_scale_inv`` of shape
  ``[..., ceil(out/bo), ceil(in/bi)]``, one scale per ``bo x bi`` block, the edge blocks partial
  (DeepSeek-V3/R1, Qwen3-FP8: ``quant_method: fp8``, ``weight_block_size``, 128x128 when
  absent); ``weight_scale`` of compressed-tensors' ``block`` (``block_structure``) and
  ``group`` (``1 x group_size``) strategies likewise. transformers:
  integrations/finegrained_fp8.py ``_dequantize_fp8_weight`` (repeat the scales over rows,
  cut to the weight, multiply per column block). Scales may be float, float8_e8m0fnu or uint8
  E8M0 exponents (``2 ** (byte - 127)``, as ``Fp8Dequantize._dequantize_one`` reads them).
* ``fp8-channel``: compressed-tensors ``weight_scale`` ``[out, 1]``; ``fp8-tensor``: a scale
  of one element. compressed-tensors ``dequantize``: ``x_q.to(scale.dtype) * scale``.
* ``mxfp4``: gpt-oss experts ``<p>_blocks`` uint8 ``[E, out, G, 16]`` (FP4 E2M1 values, two
  per byte, low nibble first) + ``<p>_scales`` uint8 ``[E, out, G]`` (E8M0, bias 127), one
  scale per 32 values; the result is ``<p>`` ``[E, G * 32, out]``: transformers'
  integrations/mxfp4.py ``convert_moe_packed_tensors`` (``FP4_VALUES``, ``ldexp``, then
  ``transpose(1, 2)``, the layout of ``GptOssExperts.gate_up_proj`` / ``down_proj``).

Activation scales (``input_scale``, ``activation_scale``) mean nothing once the weights are
plain, so they go too, as does ``quantization_config`` from the carried config.json.
"""

from __future__ import annotations

import functools
import json
import math
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.core import dtypes
from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Catalog, Chunk, TensorEntry, object_loader, pick_objects
from reshard.core.chunk_reads import read_box
from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError, UsageError
from reshard.core.regions import BAND_BYTES, fill_in_bands
from reshard.features.provenance import CONFIG_OBJECT, hf_configs

if TYPE_CHECKING:
    import torch

__all__ = ["QuantScheme", "SUPPORTED_METHODS", "quant_method", "find_quantized", "unpaired", "dequantized"]

SUPPORTED_METHODS = ("fp8", "compressed-tensors", "mxfp4")
_FP8 = tuple(dtypes.by_name(n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"))
_UINT8, _FLOAT32 = dtypes.by_name("uint8"), dtypes.by_name("float32")
_FP8_SCALES = ("weight_scale_inv", "weight_scale")  # finegrained fp8 (DeepSeek); compressed-tensors
_ACTIVATION_SCALES = ("input_scale", "activation_scale")
_DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config.weight_block_size
_MX_GROUP = 32  # values per MXFP4 scale: 16 bytes of two nibbles
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@functools.cache
def _fp4_pairs() -> torch.Tensor:
    """Both values of every byte (low nibble first): one gather per byte unpacks it."""
    import torch

    values = torch.tensor(_FP4_VALUES)
    return torch.stack([values[torch.arange(256) & 0xF], values[torch.arange(256) >> 4]], dim=-1)


@dataclass(frozen=True)
class QuantScheme:
    """One quantized weight: ``weight`` values times ``scale`` per ``block`` (elements per scale
    along the last dims; ``()`` for one scale) give ``output`` of ``shape``."""

    kind: str  # "fp8-block" | "fp8-channel" | "fp8-tensor" | "mxfp4"
    weight: str
    scale: str
    block: tuple[int, ...]
    output: str
    shape: tuple[int, ...]

    @property
    def label(self) -> str:
        """The scheme in a few words: ``fp8-block 128x128``, ``fp8-channel``, ``mxfp4``."""
        return f"{self.kind} {self.block[0]}x{self.block[1]}" if self.kind == "fp8-block" else self.kind


def _sibling(name: str, suffix: str) -> str:
    """``a.weight`` -> ``a.<suffix>``; a weight not named ``weight`` (grouped experts'
    ``gate_up_proj``) -> ``gate_up_proj_<suffix>``, as transformers' ``Fp8Quantize`` names it."""
    if name == "weight" or name.endswith(".weight"):
        return name[: -len("weight")] + suffix
    return f"{name}_{suffix.removeprefix('weight_')}"


def _quant_config(catalog: Catalog) -> dict[str, Any] | None:
    config, _ = hf_configs(catalog)
    qc = config.get("quantization_config") if config else None
    return qc if isinstance(qc, dict) else None


def quant_method(catalog: Catalog) -> str | None:
    """``quantization_config.quant_method`` of the carried HF config, if any."""
    method = (_quant_config(catalog) or {}).get("quant_method")
    return str(method) if method is not None else None


def _unsupported(qc: dict[str, Any] | None) -> str | None:
    """Why reshard cannot dequantize what ``qc`` describes, or None."""
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method not in SUPPORTED_METHODS:
        return f"quant_method {method!r}"
    if method == "compressed-tensors":
        if qc.get("format") == "dense":  # nothing stored quantized (an export whose weights all stayed as they were)
            return None
        if qc.get("format") not in (None, "float-quantized", "naive-quantized"):
            return f"compressed-tensors format {qc.get('format')!r}"
        for group in (qc.get("config_groups") or {}).values():
            w = group.get("weights") if isinstance(group, dict) else None
            if isinstance(w, dict) and (w.get("type") != "float" or w.get("num_bits") != 8):
                return f"compressed-tensors {w.get('type')} {w.get('num_bits')}-bit weights"
    return None


def _is_nvfp4(qc: dict[str, Any]) -> bool:
    """compressed-tensors' NVFP4 (what ``--quantize nvfp4`` writes): packed FP4 weights."""
    groups = (qc.get("config_groups") or {}).values()
    weights = [w for g in groups if isinstance(g, dict) and isinstance(w := g.get("weights"), dict)]
    return qc.get("quant_method") == "compressed-tensors" and (
        str(qc.get("format")).startswith("nvfp4") or any(w.get("type") == "float" and w.get("num_bits") == 4 for w in weights))


def _undequantizable(path: Path, qc: dict[str, Any], why: str) -> str:
    """The refusal of ``--dtype`` on a quantization reshard does not dequantize: what it does
    with that checkpoint instead (NVFP4 it also writes), and what to do."""
    copy = "convert without --dtype to copy it as it is"
    if _is_nvfp4(qc):
        return (f"{path}: NVFP4 weights ({why} in config.json's quantization_config) cannot be dequantized: reshard "
                f"writes NVFP4 (--quantize nvfp4) and copies NVFP4 checkpoints as they are, but does not dequantize them; "
                f"{copy}")
    return (f"{path}: {why} (quantization_config in config.json) cannot be dequantized by reshard, which dequantizes "
            f"fp8 (DeepSeek), compressed-tensors FP8 and mxfp4 checkpoints and copies others as they are; {copy}")


def _block(value: Any, field: str, source: Path) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(type(v) is int and v > 0 for v in value)):
        raise CorruptCheckpointError(f"{source}: config's quantization_config {field} {value!r} is not two positive "
                                     "integers (rows and columns per scale)")
    return value[0], value[1]


def _blocks(qc: dict[str, Any] | None, source: Path) -> list[tuple[int, int]]:
    """The FP8 block shapes ``qc`` allows (compressed-tensors may have several groups)."""
    if qc is None or qc.get("quant_method") == "fp8":
        size = (qc or {}).get("weight_block_size", _DEFAULT_BLOCK)  # null: per-tensor scales
        return [_block(size, "weight_block_size", source)] if size is not None else []
    out = []
    for group in (qc.get("config_groups") or {}).values():
        w = group.get("weights") if isinstance(group, dict) else None
        if isinstance(w, dict) and w.get("strategy") == "block":
            out.append(_block(w.get("block_structure"), "block_structure", source))
        elif isinstance(w, dict) and w.get("strategy") == "group":
            out.append(_block([1, w.get("group_size")], "group_size", source))
    return out


def _fp8_kind(shape: tuple[int, ...], scale: tuple[int, ...],
              blocks: list[tuple[int, int]]) -> tuple[str, tuple[int, ...]] | None:
    """The scheme a scale of shape ``scale`` gives values of ``shape`` (blocks first: a weight
    smaller than one block has a 1x1 grid, which is still a block)."""
    for bo, bi in blocks if len(shape) >= 2 else []:
        if scale == shape[:-2] + (-(-shape[-2] // bo), -(-shape[-1] // bi)):
            return "fp8-block", (bo, bi)
    if len(shape) >= 2 and scale == shape[:-1] + (1,):
        return "fp8-channel", (1, shape[-1])
    if math.prod(scale) == 1:
        return "fp8-tensor", ()
    return None


@dataclass(frozen=True)
class _Problem:
    name: str
    why: str
    missing: bool  # the scale is absent (not just of the wrong shape)


def _pair_fp8(name: str, t: TensorEntry, tensors: dict[str, TensorEntry],
              blocks: list[tuple[int, int]]) -> QuantScheme | _Problem:
    scale = next((n for n in (_sibling(name, x) for x in _FP8_SCALES) if n in tensors), None)
    if scale is None:
        return _Problem(name, f"its scale {_sibling(name, _FP8_SCALES[0])!r} is not in the checkpoint", True)
    s = tensors[scale]
    kind = _fp8_kind(t.shape, s.shape, blocks) if s.dtype.is_floating_point or s.dtype is _UINT8 else None
    if kind is None:
        return _Problem(name, f"its scale {scale!r} ({s.dtype}, {list(s.shape)}) fits no scheme for {list(t.shape)} "
                              f"(blocks {blocks or 'none'} by quantization_config)", False)
    return QuantScheme(kind[0], name, scale, kind[1], name, t.shape)


def _pair_mxfp4(name: str, t: TensorEntry, tensors: dict[str, TensorEntry]) -> QuantScheme | _Problem:
    base = name.removesuffix("_blocks")
    scale = base + "_scales"
    s = tensors.get(scale)
    if s is None:
        return _Problem(name, f"its scales {scale!r} are not in the checkpoint", True)
    if len(t.shape) != 4 or t.shape[-1] != _MX_GROUP // 2 or s.shape != t.shape[:-1] or s.dtype is not _UINT8:
        return _Problem(name, f"its scales {scale!r} ({s.dtype}, {list(s.shape)}) do not fit MXFP4 blocks "
                              f"{list(t.shape)} ([E, out, G, 16] with uint8 scales [E, out, G])", False)
    if base in tensors:
        return _Problem(name, f"it would dequantize to {base!r}, which the checkpoint already holds", False)
    e, o, g, _ = t.shape
    return QuantScheme("mxfp4", name, scale, (_MX_GROUP,), base, (e, g * _MX_GROUP, o))


def _scan(catalog: Catalog) -> tuple[dict[str, QuantScheme], list[tuple[str, str]]]:
    """(schemes by weight name, [(tensor, what is wrong)] for quantized tensors reshard cannot pair)."""
    tensors, qc = catalog.tensors, _quant_config(catalog)
    blocks = _blocks(qc, catalog.path)
    found: dict[str, QuantScheme] = {}
    problems: list[_Problem] = []
    for name, t in tensors.items():
        if t.dtype in _FP8:
            pair = _pair_fp8(name, t, tensors, blocks)
        elif name.endswith("_blocks") and t.dtype is _UINT8:
            pair = _pair_mxfp4(name, t, tensors)
        else:
            continue
        if isinstance(pair, QuantScheme):
            found[name] = pair
        else:
            problems.append(pair)
    quantized = bool(found) or any(not p.missing for p in problems) or qc is not None
    # A float8 tensor alone, in a checkpoint with no scales and no quantization_config, is plain data.
    out = [(p.name, p.why) for p in problems if quantized or not p.missing]
    if quantized:
        for name, t in tensors.items():
            weight = _scale_owner(name, t)
            if weight is not None and weight not in tensors:
                out.append((name, f"it is the scale of {weight!r}, which is not in the checkpoint"))
    return found, out


def _scale_owner(name: str, t: TensorEntry) -> str | None:
    """The quantized tensor a scale's name belongs to, or None for names that are no scale."""
    for suffix in _FP8_SCALES:
        if name == suffix or name.endswith("." + suffix):
            return name[: -len(suffix)] + "weight"
    if name.endswith("_scale_inv"):  # grouped experts: gate_up_proj_scale_inv
        return name.removesuffix("_scale_inv")
    if name.endswith("_scales") and t.dtype is _UINT8:
        return name.removesuffix("_scales") + "_blocks"
    return None


def find_quantized(catalog: Catalog) -> dict[str, QuantScheme]:
    """Every quantized weight whose scale is there and fits, by stored weight name."""
    return _scan(catalog)[0]


def unpaired(catalog: Catalog) -> list[str]:
    """Quantized tensors a cast would separate from their scale: values whose scale is missing
    (``--exclude``) or does not fit, and scales whose values are missing."""
    return [name for name, _ in _scan(catalog)[1]]


def _scale_values(t: torch.Tensor) -> torch.Tensor:
    import torch

    if t.dtype == torch.uint8:  # E8M0 exponents stored as bytes
        return (t.to(torch.float32) - 127.0).exp2()
    return t.to(torch.float32)


# Every value of each FP8 format as torch converts it: a gather from 256 entries is about 3x
# faster than torch's per-element conversion on CPU, and gives the same bits (NaNs included).
@functools.cache
def _fp8_tables() -> dict[torch.dtype, torch.Tensor]:
    import torch

    return {d.torch: torch.arange(256, dtype=torch.uint8).view(d.torch).to(torch.float32) for d in _FP8}


_BAND_BYTES = BAND_BYTES  # float32 bytes dequantized at a time


def _fp8_to_float32(t: torch.Tensor) -> torch.Tensor:
    import torch

    table = _fp8_tables().get(t.dtype)
    if table is None:
        return t.to(torch.float32)
    return table.index_select(0, t.reshape(-1).view(torch.uint8).to(torch.int32)).reshape(t.shape)


@dataclass(frozen=True)
class _Fp8Values:
    """``weight * scale`` in float32 for any box: reads the box's values and the scales of the
    blocks it touches; the scales are repeated over rows only, then applied per column block."""

    weight: TensorEntry
    scale: TensorEntry
    block: tuple[int, ...]  # (rows, cols) per scale; () for one scale

    def read(self, box: Box) -> torch.Tensor:
        import torch

        out = torch.empty(box.sizes, dtype=torch.float32)
        self.read_into(box, out)
        return out

    def read_into(self, box: Box, out: torch.Tensor) -> None:
        """Dequantize ``box`` into ``out`` (contiguous, of the box's sizes, any floating dtype:
        the float32 products are rounded into it), a band of rows at a time, so no temporary
        is as large as the box: the engine passes its slab buffer, in the target dtype."""
        fill_in_bands(out, box, 4, _BAND_BYTES, self._band)

    def _band(self, box: Box) -> torch.Tensor:
        out = _fp8_to_float32(read_box(self.weight, box))
        if box.numel == 0:
            return out
        if not self.block:
            return out.mul_(_scale_values(read_box(self.scale, full_box(self.scale.shape))).reshape(()))
        (bo, bi), lead = self.block, len(box.sizes) - 2
        (r0, c0), (nr, nc) = box.offsets[lead:], box.sizes[lead:]
        g0r, g0c = r0 // bo, c0 // bi
        grid = Box(box.offsets[:lead] + (g0r, g0c), box.sizes[:lead] + (-(-(r0 + nr) // bo) - g0r, -(-(c0 + nc) // bi) - g0c))
        scales = _scale_values(read_box(self.scale, grid))
        rows = scales.repeat_interleave(bo, dim=-2)[..., r0 - g0r * bo: r0 - g0r * bo + nr, :]
        if c0 % bi == 0 and nc % bi == 0:  # whole column blocks: one broadcast multiply
            out.view(*out.shape[:-1], nc // bi, bi).mul_(rows.unsqueeze(-1))
            return out
        for j in range(grid.sizes[-1]):
            a, b = max(c0, (g0c + j) * bi) - c0, min(c0 + nc, (g0c + j + 1) * bi) - c0
            out[..., a:b].mul_(rows[..., j: j + 1])
        return out


@dataclass(frozen=True)
class _Mxfp4Values:
    """gpt-oss MXFP4 experts dequantized for a box of ``[E, in, out]``: reads the bytes of the
    box's values (whole groups of 16 bytes) and their scales, never the whole tensor."""

    blocks: TensorEntry  # [E, out, G, 16]
    scales: TensorEntry  # [E, out, G]

    def read(self, box: Box) -> torch.Tensor:
        import torch

        (e0, i0, o0), (ne, ni, no) = box.offsets, box.sizes
        if box.numel == 0:
            return torch.empty(box.sizes, dtype=torch.float32)
        g0, g1 = i0 // _MX_GROUP, -(-(i0 + ni) // _MX_GROUP)
        raw = read_box(self.blocks, Box((e0, o0, g0, 0), (ne, no, g1 - g0, _MX_GROUP // 2)))
        lo = i0 - g0 * _MX_GROUP  # first wanted value among those read
        b0, b1 = lo // 2, -(-(lo + ni) // 2)
        raw = raw.reshape(ne, no, -1)[..., b0:b1]
        values = _fp4_pairs()[raw.to(torch.int32)].reshape(ne, no, 2 * (b1 - b0))[..., lo - 2 * b0: lo - 2 * b0 + ni]
        exps = read_box(self.scales, Box((e0, o0, g0), (ne, no, g1 - g0))).to(torch.int32) - 127
        for j in range(g1 - g0):
            a, b = max(i0, (g0 + j) * _MX_GROUP) - i0, min(i0 + ni, (g0 + j + 1) * _MX_GROUP) - i0
            values[..., a:b] = torch.ldexp(values[..., a:b], exps[..., j: j + 1])
        return values.transpose(-1, -2)


def _entry(s: QuantScheme, tensors: dict[str, TensorEntry]) -> TensorEntry:
    w, sc = tensors[s.weight], tensors[s.scale]
    data = _Mxfp4Values(w, sc) if s.kind == "mxfp4" else _Fp8Values(w, sc, s.block)
    return TensorEntry(s.output, s.shape, _FLOAT32, [Chunk(full_box(s.shape), data)])


def _without_quantization(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != "quantization_config"}


def _refusal(catalog: Catalog, problems: list[tuple[str, str]]) -> str:
    name, why = problems[0]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (f"{catalog.path}: cannot cast quantized tensor {name!r}{more}: {why}; keep each weight with its scale "
            "(check --exclude / --only) so --dtype dequantizes it, or convert without --dtype to copy the "
            "quantized bytes as they are")


def dequantized(catalog: Catalog) -> Catalog:
    """``catalog`` with every quantized weight replaced by a float32 tensor read lazily as
    values times scales (under its output name), scales and activation scales removed, and no
    ``quantization_config`` in the carried config. The catalog itself when nothing is quantized.

    Raises ``UsageError`` when a weight and its scale were separated (``unpaired``) and
    ``UnsupportedFormatError`` for a quantization reshard does not dequantize (GPTQ, AWQ...).
    """
    qc = _quant_config(catalog)
    why = _unsupported(qc)
    if why is not None:
        assert qc is not None  # _unsupported finds a reason only in a config
        raise UnsupportedFormatError(_undequantizable(catalog.path, qc, why))
    schemes, problems = _scan(catalog)
    if problems:
        raise UsageError(_refusal(catalog, problems))
    if not schemes and qc is None:
        return catalog
    scales = {s.scale for s in schemes.values()}
    fp8 = any(s.kind != "mxfp4" for s in schemes.values()) or (qc or {}).get("quant_method") in ("fp8", "compressed-tensors")
    activations = {n for n in catalog.tensors if fp8 and _is_activation_scale(n)}
    tensors: dict[str, TensorEntry] = {}
    for name, entry in catalog.tensors.items():
        if name in scales or name in activations:
            continue
        s = schemes.get(name)
        tensors[s.output if s else name] = _entry(s, catalog.tensors) if s else entry
    paths = {}
    for name, path in catalog.paths.items():
        s = schemes.get(name)
        if s is not None and s.output != name:  # MXFP4: ("...", "gate_up_proj_blocks") -> ("...", "gate_up_proj")
            paths[s.output] = path[:-1] + (str(path[-1]).removesuffix("_blocks"),)
        elif name in tensors or name in catalog.objects:
            paths[name] = path
    objects = pick_objects(catalog.objects, list(catalog.objects))
    if CONFIG_OBJECT in objects:
        load = object_loader(catalog.objects, CONFIG_OBJECT)
        objects.set_lazy(CONFIG_OBJECT, lambda: _config_json(load()))
    facts = catalog.facts.copy()
    if isinstance(facts.hf_config, dict):
        facts.hf_config = _without_quantization(facts.hf_config)
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(Counter(s.label for s in schemes.values()).items()))
    notice = (f"dequantized {kinds} weights to float32 before the cast ({len(scales)} scale and {len(activations)} "
              "activation-scale tensors dropped, quantization_config removed from the config)" if schemes else
              "quantization_config removed from the config: no quantized weight is left to dequantize")
    return replace(catalog, tensors=tensors, objects=objects, paths=paths, facts=facts,
                   notices=[*catalog.notices, notice])


def _is_activation_scale(name: str) -> bool:
    return any(name == a or name.endswith(("." + a, "_" + a)) for a in _ACTIVATION_SCALES)


def _config_json(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    return json.dumps(_without_quantization(json.loads(raw)), sort_keys=True)
