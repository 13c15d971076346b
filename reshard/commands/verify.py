"""``reshard.verify``: compare two checkpoints in any formats, tensor by tensor, in slabs.

"Equal" is the promise a conversion keeps, so it must never be said of different data: exact
by default (names, nesting, container types, dtypes, shapes, every bit; objects by type and
value, floats by their bits). A tolerance (``atol``/``rtol``, for checking a ``--dtype``
cast) loosens floating and complex values only; integers, bools and objects stay exact.
Every difference says what differs and, for values, how many elements and by how much.
Memory stays within ``max_memory`` whatever the tensor sizes.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from reshard.core.boxes import c_order_slabs, full_box
from reshard.core.catalog import Catalog, TensorEntry, pick_objects
from reshard.core.conventions import detect_layout
from reshard.core.dtypes import DType, dtype_name
from reshard.core.errors import UsageError, option
from reshard.core.gc_pause import without_gc
from reshard.core.regions import as_tensor
from reshard.core.sizes import parse_size, plural
from reshard.core.structure import container_steps, describe_steps
from reshard.core.values import difference
from reshard.features.architecture import check_architecture
from reshard.features.keymap.lookup import load_keymap
from reshard.features.provenance import carry_hf_configs, hf_configs
from reshard.pipeline.assemble import assemble, assemble_bytes, moves_bytes
from reshard.pipeline.manifest import MANIFEST_NAME, check_manifest
from reshard.pipeline.options import SourceOptions, former_keyword
from reshard.pipeline.plan import model_section, select, sources_for
from reshard.pipeline.progress import Progress
from reshard.sources.reading import given_config, given_layout, local_path, read_catalog

if TYPE_CHECKING:
    import torch

__all__ = ["verify", "verify_manifest", "VerifyResult", "Difference"]


@dataclass(frozen=True)
class Difference:
    """One way the two sides differ. ``kind`` is one of ``only_in_a``, ``only_in_b``,
    ``structure`` (nesting or container type), ``dtype``, ``shape``, ``values``, ``object``;
    for ``verify --quick``: ``size``, ``checksum``, ``missing``, ``unlisted_weights`` (a weights file
    the manifest does not list that loaders would take), ``architecture``."""

    name: str
    kind: str
    detail: str


@dataclass
class VerifyResult:
    """What ``reshard.verify`` found. ``ok``: no difference under the comparison asked for
    (the exit code). ``equal``: bit for bit, which a comparison with a tolerance never claims;
    ``within_tolerance`` says what it does claim (None when no tolerance was given)."""

    a: Path
    b: Path
    compared: int = 0
    differences: list[Difference] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    atol: float | None = None
    rtol: float | None = None

    @property
    def tolerant(self) -> bool:
        return self.atol is not None or self.rtol is not None

    @property
    def ok(self) -> bool:
        return not self.differences

    @property
    def equal(self) -> bool:
        return self.ok and not self.tolerant

    @property
    def within_tolerance(self) -> bool | None:
        return self.ok if self.tolerant else None

    def verdict(self) -> str:
        """``equal``, ``within atol=0.01, rtol=0`` or ``3 differences``: what the CLI prints."""
        if not self.ok:
            return plural(len(self.differences), "difference")
        if not self.tolerant:
            return "equal"
        given = ", ".join(f"{k}={v:g}" for k, v in (("atol", self.atol), ("rtol", self.rtol)) if v is not None)
        return f"within {given} (not compared bit for bit)"

    def to_json(self) -> dict[str, Any]:
        return {
            "a": str(self.a), "b": str(self.b), "equal": self.equal, "within_tolerance": self.within_tolerance,
            "atol": self.atol, "rtol": self.rtol, "compared": self.compared,
            "differences": [d.__dict__ for d in self.differences], "notes": self.notes,
        }


def _bits(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def _flat(x: np.ndarray) -> np.ndarray:
    """A slab's bytes (an array of its dtype's width, maybe strided) as one C-order row."""
    return np.ascontiguousarray(x).reshape(-1)


def _differing(xa: np.ndarray, xb: np.ndarray) -> np.ndarray:
    """Per element, whether any bit differs: widths up to 8 bytes are unsigned integers, so
    ``!=`` compares bits (NaN payloads, signed zeros); 16-byte elements as two words each."""
    if xa.dtype.itemsize <= 8:
        return xa != xb
    words = xa.dtype.itemsize // 8
    return (xa.view(np.uint64).reshape(-1, words) != xb.view(np.uint64).reshape(-1, words)).any(axis=1)


def _kind(dtype: DType) -> str:
    """How a dtype compares under a tolerance: floats and complex by value, the rest exactly."""
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point and dtype.itemsize >= 1 and "float4" not in str(dtype):
        return "float"
    return "exact"


def _wide(t: torch.Tensor) -> torch.Tensor:
    """Values in a type that holds every value of the stored one exactly (complex as
    (real, imag) pairs along a last dim)."""
    import torch

    if t.dtype.is_complex:
        return torch.view_as_real(t.to(torch.complex128))
    return t.double()


@dataclass
class _Tally:
    """Differing elements of one tensor, and how large the differences are."""

    count: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    nonfinite: int = 0

    def add(self, wa: torch.Tensor, wb: torch.Tensor, differ: torch.Tensor) -> None:
        """``wa``/``wb``: widened values; ``differ``: one flag per element of the tensor."""
        import torch

        self.count += int(differ.sum())
        if wa.dim() > differ.dim():  # complex: the magnitude of the difference per element
            delta = torch.linalg.vector_norm(wa - wb, dim=-1)
            ref = torch.linalg.vector_norm(wb, dim=-1)
        else:
            delta, ref = (wa - wb).abs(), wb.abs()
        finite = torch.isfinite(delta) & differ
        self.nonfinite += int((differ & ~finite).sum())
        if finite.any():
            self.max_abs = max(self.max_abs, float(delta[finite].max()))
            rel = delta[finite & (ref > 0)] / ref[finite & (ref > 0)]
            if rel.numel():
                self.max_rel = max(self.max_rel, float(rel.max()))

    def describe(self, total: int, numeric: bool) -> str:
        text = f"{self.count} of {total} elements differ"
        if numeric:
            text += f" (max abs diff {self.max_abs:.6g}, max rel diff {self.max_rel:.6g}"
            text += f"; {self.nonfinite} differ by NaN or inf)" if self.nonfinite else ")"
        return text


def _compare(a: TensorEntry, b: TensorEntry, atol: float | None, rtol: float | None, budget: int,
             bar: Progress | None = None) -> str | None:
    """Exact: every bit, per element (NaNs equal only to the same NaN; -0.0 differs from 0.0).
    With a tolerance: floating and complex values within ``atol + rtol * |b|`` (NaN equals
    NaN), complex by real and imaginary part; integers and bools still exactly."""
    kinds = {_kind(a.dtype), _kind(b.dtype)}
    tolerant = (atol is not None or rtol is not None) and kinds in ({"float"}, {"complex"})
    numeric = kinds <= {"float", "complex"} and len(kinds) == 1
    item = 16 if tolerant or numeric else max(a.dtype.itemsize, b.dtype.itemsize)
    tally = _Tally()
    for slab in c_order_slabs(full_box(a.shape), item, max(item, budget // 8)):
        sa, sb = sources_for(a, slab), sources_for(b, slab)
        if bar is not None:
            bar.update(slab.numel * (a.dtype.itemsize + b.dtype.itemsize))
        if not tolerant and moves_bytes(a.dtype, sa) and moves_bytes(b.dtype, sb):
            # Stored bytes on both sides, compared bit for bit without torch (the usual case: a
            # conversion checked against its source); torch only to describe what differs.
            xa, xb = _flat(assemble_bytes(slab, a.dtype, sa)), _flat(assemble_bytes(slab, b.dtype, sb))
            differs = _differing(xa, xb).reshape(slab.sizes)
            if not differs.any():
                continue
            import torch

            differ = torch.from_numpy(differs)
            if numeric:
                tally.add(_wide(as_tensor(xa.reshape(slab.sizes), a.dtype)),
                          _wide(as_tensor(xb.reshape(slab.sizes), b.dtype)), differ)
            else:
                tally.count += int(differs.sum())
            continue
        import torch

        ta, tb = assemble(slab, a.dtype, sa), assemble(slab, b.dtype, sb)
        if tolerant:
            wa, wb = _wide(ta), _wide(tb)
            close = torch.isclose(wa, wb, rtol=rtol or 0.0, atol=atol or 0.0, equal_nan=True)
            differ = ~close.all(dim=-1) if a.dtype.is_complex else ~close
        else:
            differ = (_bits(ta) != _bits(tb)).reshape(-1, a.dtype.itemsize).any(dim=1).reshape(slab.sizes)
            if not differ.any():
                continue
            if numeric:
                wa, wb = _wide(ta), _wide(tb)
        if not differ.any():
            continue
        if numeric:
            tally.add(wa, wb, differ)
        else:
            tally.count += int(differ.sum())
    return tally.describe(full_box(a.shape).numel, numeric) if tally.count else None


def _structure(catalog: Catalog, name: str) -> tuple[tuple[str, str | int], ...]:
    """Where ``name`` sits in the nested state dict, each step tagged with the container it
    steps through (``dict`` / ``list`` / ``tuple``; an int key of a dict stays an int)."""
    return container_steps(catalog.nested_path(name), catalog.facts.containers or {})


def _part(catalog: Catalog, only: str) -> Catalog:
    """One part of a checkpoint for ``verify --only``: the model under its own FQNs (so a
    training checkpoint compares with its HF export), or the names in a section."""
    layout = detect_layout(catalog)
    if only == "model":
        return model_section(catalog, layout)
    tensors, objects = select(catalog, only, layout)
    return replace(catalog, tensors={n: catalog.tensors[n] for n in tensors},
                   objects=pick_objects(catalog.objects, objects))


def _check_tolerance(value: float | None, name: str) -> None:
    if value is not None and not (value >= 0 and math.isfinite(value)):
        raise UsageError(f"{option(f'--{name} {value}', f'{name}={value!r}')}: a tolerance must be a finite number >= 0")


@without_gc
def verify(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    max_memory: str | int = "1GiB",
    keymap: Any = None,
    only: str | None = None,
    progress: bool = False,
    storage_options: dict[str, Any] | None = None,
    options: SourceOptions | None = None,
    source_options: SourceOptions | None = None,
) -> VerifyResult:
    """Compare checkpoints ``a`` and ``b``; ``result.ok`` is True when they match (``equal``:
    bit for bit; ``within_tolerance`` when ``atol``/``rtol`` were given).

    Exact by default: the same names, nesting, container types, dtypes, shapes and bits (a
    NaN equals only a NaN with the same bits; ``-0.0`` differs from ``0.0``), and objects of
    the same type and value (floats by their bits). ``atol``/``rtol`` compare floating and
    complex tensors by value (in float64, complex by real and imaginary part, NaN equal to
    NaN, dtypes may differ, as after a ``--dtype`` cast); integer and bool tensors and all
    objects are still compared exactly.

    ``keymap`` (a preset such as ``titan-to-hf`` or a JSON map) renames ``a``'s tensors before
    the comparison, to compare a training checkpoint with its HF export; head counts come from
    ``a``'s own config, else ``b``'s. ``only`` compares one part of both (``model``: each side's
    model tensors under their FQNs, whatever the section is called; ``optim``; or a prefix).

    ``options`` (a ``SourceOptions``; ``source_options=`` is its former name) says how both
    are read (``storage_options``, ``allow_classes``, for this call only) and describes ``a``,
    the side its ``keymap`` renames: ``layout`` and ``config`` (the model, for the key map's
    head counts) are ``a``'s.
    """
    _check_tolerance(atol, "atol")
    _check_tolerance(rtol, "rtol")
    given = {k: v for k, v in (("keymap", keymap), ("storage_options", storage_options)) if v is not None}
    opts = SourceOptions.of(given, former_keyword("reshard.verify", "source_options", "options", source_options, options))
    with opts.allowing():
        return _verify(a, b, atol, rtol, parse_size(max_memory), only, progress, opts)


def _verify(a: str | os.PathLike, b: str | os.PathLike, atol: float | None, rtol: float | None, budget: int,
            only: str | None, progress: bool, opts: SourceOptions) -> VerifyResult:
    ca: Catalog = given_config(given_layout(read_catalog(a, opts), opts.layout), opts.config)
    cb: Catalog = read_catalog(b, opts)
    a, b = ca.path, cb.path
    if opts.keymap is not None:
        if hf_configs(ca)[0] is None and hf_configs(cb)[0] is not None:  # the export's config says what model it is
            ca.facts.hf_config = hf_configs(cb)[0]
        ca = load_keymap(opts.keymap).apply(ca)
    for catalog in (ca, cb):  # an HF folder's config travels as objects in every conversion of it
        carry_hf_configs(catalog)
    if only is not None:
        ca, cb = _part(ca, only), _part(cb, only)
    result = VerifyResult(a, b, atol=atol, rtol=rtol)
    for what, left, right, side in (("tensor", ca.tensors, cb.tensors, "a"), ("object", ca.objects, cb.objects, "a"),
                                    ("tensor", cb.tensors, ca.tensors, "b"), ("object", cb.objects, ca.objects, "b")):
        other = b if side == "a" else a
        for name in sorted(set(left) - set(right)):
            result.differences.append(Difference(name, f"only_in_{side}", f"{what} missing from {other}"))
    for name in sorted((set(ca.tensors) & set(cb.tensors)) | (set(ca.objects) & set(cb.objects))):
        sa, sb = _structure(ca, name), _structure(cb, name)
        if sa != sb:
            result.differences.append(Difference(name, "structure", f"nested as {describe_steps(sa)} vs {describe_steps(sb)}"))
    common = sorted(set(ca.tensors) & set(cb.tensors))
    total = sum(ca.tensors[n].nbytes + cb.tensors[n].nbytes for n in common)
    with Progress(total, f"comparing {Path(str(a)).name} with {Path(str(b)).name}", enabled=progress) as bar:
        for name in common:
            _compare_tensor(result, name, ca.tensors[name], cb.tensors[name], atol, rtol, budget, bar)
    for name in sorted(set(ca.objects) & set(cb.objects)):
        why = difference(ca.objects[name], cb.objects[name])
        if why:
            result.differences.append(Difference(name, "object", why))
    return result


def _compare_tensor(result: VerifyResult, name: str, ta: TensorEntry, tb: TensorEntry, atol: float | None,
                    rtol: float | None, budget: int, bar: Progress) -> None:
    result.compared += 1
    if ta.shape != tb.shape:
        result.differences.append(Difference(name, "shape", f"{list(ta.shape)} vs {list(tb.shape)}"))
        return
    comparable = (atol is not None or rtol is not None) and _kind(ta.dtype) == _kind(tb.dtype) != "exact"
    if ta.dtype != tb.dtype and not comparable:
        result.differences.append(Difference(name, "dtype", f"{dtype_name(ta.dtype)} vs {dtype_name(tb.dtype)}"))
        return
    problem = _compare(ta, tb, atol, rtol, budget, bar)
    if problem:
        result.differences.append(Difference(name, "values", problem))


def verify_manifest(folder: str | os.PathLike) -> VerifyResult:
    """``verify --quick``: check a folder against the manifest reshard wrote into it (sizes and
    SHA-256 of every file), without the source and without parsing any tensor. Each file whose
    bytes changed or that is missing is one Difference named by its path, and so is a weights
    file added since that loaders would take instead of or beside the manifest's
    (``model.safetensors`` beside an index: ``reshard.pipeline.manifest.LOADED_BY_NAME``); any other file
    added after the conversion (a tokenizer or README copied in) is not a failure of what
    reshard wrote, and is named in ``notes``. No manifest, or a malformed one, raises a ReshardError."""
    local = local_path(folder)
    if local is None:
        raise UsageError(f"{folder}: verify --quick checks a local folder's manifest; an output at a URL has none "
                         "(object stores, docs/recipes/object-stores.md): compare it with its source, reshard verify SRC URL")
    folder = local
    checked, problems = check_manifest(folder)
    result = VerifyResult(folder, folder / MANIFEST_NAME, compared=checked)
    added = [p.relpath for p in problems if p.kind == "not_in_manifest"]
    result.differences = [Difference(p.relpath, p.kind, p.detail) for p in problems if p.kind != "not_in_manifest"]
    if added:
        result.notes.append(f"{len(added)} file(s) not in manifest (added after the conversion, not checked): "
                            + ", ".join(added[:5]) + (" ..." if len(added) > 5 else ""))
    if not result.differences:
        _check_hf_architecture(folder, result)
    return result


def _check_hf_architecture(folder: Path, result: VerifyResult) -> None:
    """An intact HF folder is also the model its config.json describes: its tensors loaded on
    the meta device into the architecture transformers builds (``reshard.features.architecture``)."""
    config_path = folder / "config.json"
    if not config_path.is_file() or not any(folder.glob("*.safetensors")):
        return

    try:
        config = json.loads(config_path.read_text())
    except ValueError as e:
        result.differences.append(Difference("config.json", "architecture", f"not valid JSON ({e})"))
        return
    if not isinstance(config, dict):
        result.differences.append(Difference("config.json", "architecture", "not a JSON object"))
        return
    check = check_architecture(config, read_catalog(folder).tensors)
    if check.checked and not check.ok:
        result.differences.append(Difference("config.json", "architecture",
                                             f"not the {check.architecture} it describes: {check.problems()}"))
    else:
        result.notes.append(check.notice())
