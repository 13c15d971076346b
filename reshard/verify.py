"""``reshard.verify``: compare two checkpoints in any formats, tensor by tensor, in slabs.

Exact by default: same names, dtypes, shapes and bits (NaNs compare by their bits, so a
conversion that keeps them is "equal"). With ``atol``/``rtol`` values are compared in float64
and dtypes may differ, for checking a ``--dtype`` cast. Memory stays within ``max_memory``
whatever the tensor sizes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reshard.boxes import c_order_slabs, full_box
from reshard.catalog import Catalog, TensorEntry
from reshard.dtypes import dtype_name
from reshard.engine import assemble
from reshard.formats.registry import detect_format
from reshard.plan import sources_for
from reshard.sizes import parse_size

__all__ = ["verify", "verify_manifest", "VerifyResult", "Difference"]


@dataclass(frozen=True)
class Difference:
    name: str
    kind: str  # "only in A", "only in B", "dtype", "shape", "values", "object"; quick: "size", "checksum", "missing", "extra"
    detail: str


@dataclass
class VerifyResult:
    a: Path
    b: Path
    compared: int = 0
    differences: list[Difference] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.differences

    def to_json(self) -> dict[str, Any]:
        return {
            "a": str(self.a), "b": str(self.b), "equal": self.equal, "compared": self.compared,
            "differences": [d.__dict__ for d in self.differences], "notes": self.notes,
        }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _compare(a: TensorEntry, b: TensorEntry, atol: float | None, rtol: float | None, budget: int) -> str | None:
    exact = atol is None and rtol is None
    item = max(a.dtype.itemsize, b.dtype.itemsize) if exact else 8
    worst = 0.0
    mismatched = 0
    for slab in c_order_slabs(full_box(a.shape), item, max(item, budget // 6)):
        ta = assemble(slab, a.dtype, sources_for(a, slab))
        tb = assemble(slab, b.dtype, sources_for(b, slab))
        if exact:
            diff = _bits(ta) != _bits(tb)
            if diff.any():
                mismatched += int(diff.reshape(-1, a.dtype.itemsize).any(dim=1).sum())
        else:
            da, db = ta.double(), tb.double()
            close = torch.isclose(da, db, rtol=rtol or 0.0, atol=atol or 0.0, equal_nan=True)
            if not close.all():
                mismatched += int((~close).sum())
            finite = torch.isfinite(da) & torch.isfinite(db)
            if finite.any():
                worst = max(worst, float((da - db).abs()[finite].max()))
    if mismatched:
        extra = f", max |a-b| {worst:.3g}" if not exact else ""
        return f"{mismatched} of {full_box(a.shape).numel} elements differ{extra}"
    return None


def verify(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    max_memory: str | int = "1GiB",
) -> VerifyResult:
    """Compare checkpoints ``a`` and ``b``; ``result.equal`` is True when they match."""
    a, b = Path(a), Path(b)
    ca: Catalog = detect_format(a).read(a)
    cb: Catalog = detect_format(b).read(b)
    budget = parse_size(max_memory)
    result = VerifyResult(a, b)
    for name in sorted(set(ca.tensors) - set(cb.tensors)):
        result.differences.append(Difference(name, "only in A", f"tensor missing from {b}"))
    for name in sorted(set(cb.tensors) - set(ca.tensors)):
        result.differences.append(Difference(name, "only in B", f"tensor missing from {a}"))
    exact = atol is None and rtol is None
    for name in sorted(set(ca.tensors) & set(cb.tensors)):
        ta, tb = ca.tensors[name], cb.tensors[name]
        result.compared += 1
        if ta.shape != tb.shape:
            result.differences.append(Difference(name, "shape", f"{list(ta.shape)} vs {list(tb.shape)}"))
            continue
        if exact and ta.dtype != tb.dtype:
            result.differences.append(Difference(name, "dtype", f"{dtype_name(ta.dtype)} vs {dtype_name(tb.dtype)}"))
            continue
        problem = _compare(ta, tb, atol, rtol, budget)
        if problem:
            result.differences.append(Difference(name, "values", problem))
    for name in sorted(set(ca.objects) & set(cb.objects)):
        if not _same_object(ca.objects[name], cb.objects[name]):
            result.differences.append(Difference(name, "object", f"{ca.objects[name]!r} vs {cb.objects[name]!r}"))
    only_objects = set(ca.objects) ^ set(cb.objects)
    if only_objects:
        result.notes.append(f"{len(only_objects)} non-tensor objects exist on one side only (not compared): "
                            + ", ".join(sorted(only_objects)[:5]) + (" ..." if len(only_objects) > 5 else ""))
    return result


def verify_manifest(folder: str | os.PathLike) -> VerifyResult:
    """``verify --quick``: check a folder against the manifest reshard wrote into it (sizes and
    SHA-256 of every file), without the source and without parsing any tensor. Each file whose
    bytes changed, that is missing or that was added is one Difference named by its path;
    no manifest, or a malformed one, raises a ReshardError."""
    from reshard.manifest import MANIFEST_NAME, check_manifest

    folder = Path(folder)
    checked, problems = check_manifest(folder)
    result = VerifyResult(folder, folder / MANIFEST_NAME, compared=checked)
    result.differences = [Difference(p.relpath, p.kind, p.detail) for p in problems]
    return result


def _same_object(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if type(x) is not type(y):
        return False
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same_object(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same_object(p, q) for p, q in zip(x, y))
    if isinstance(x, float) and x != x and y != y:
        return True
    return x == y
