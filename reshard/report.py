"""What ``reshard inspect`` prints: a readable table, or the JSON of the contract."""

from __future__ import annotations

from typing import Any

from reshard.catalog import Catalog
from reshard.dtypes import dtype_name
from reshard.sizes import format_size

__all__ = ["catalog_json", "catalog_table"]


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def catalog_json(catalog: Catalog) -> dict[str, Any]:
    return {
        "format": catalog.format,
        "path": str(catalog.path),
        "tensors": [
            {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": dtype_name(t.dtype),
                "bytes": t.nbytes,
                "chunks": [{"offsets": list(c.box.offsets), "sizes": list(c.box.sizes)} for c in t.chunks],
            }
            for t in catalog.tensors.values()
        ],
        "objects": [{"name": n, "type": type(v).__name__, "value": _jsonable(v)} for n, v in catalog.objects.items()],
        "total_bytes": catalog.total_bytes,
        "attrs": {k: _jsonable(v) for k, v in catalog.attrs.items() if k.startswith("source_")},
    }


def catalog_table(catalog: Catalog) -> str:
    rows = [(t.name, dtype_name(t.dtype), "x".join(map(str, t.shape)) or "scalar", format_size(t.nbytes), str(len(t.chunks)))
            for t in catalog.tensors.values()]
    head = ("name", "dtype", "shape", "bytes", "chunks")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(5)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 3 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [f"{catalog.path}: {catalog.format}, {len(catalog.tensors)} tensors, {format_size(catalog.total_bytes)}"]
    for key in ("source_world_size", "source_mesh"):
        if key in catalog.attrs:
            lines.append(f"{key.removeprefix('source_').replace('_', ' ')}: {catalog.attrs[key]}")
    lines += ["", fmt.format(*head)] + [fmt.format(*r) for r in rows]
    if catalog.objects:
        lines += ["", f"objects ({len(catalog.objects)}):"]
        lines += [f"  {n} = {v!r}"[:160] for n, v in catalog.objects.items()]
    return "\n".join(lines)
