"""What ``reshard inspect`` prints: a readable table, or the JSON of the contract (schema 1,
docs/cli.md). Tensors are listed by name, whatever order the files keep them in."""

from __future__ import annotations

import html as h
import json
import os
import re
import uuid
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from reshard.core.catalog import Catalog, ObjectTable
from reshard.core.conventions import AmbiguousLayoutError, detect_layout
from reshard.core.dtypes import dtype_name
from reshard.core.gc_pause import without_gc
from reshard.core.sizes import format_size, plural
from reshard.features.dequantize import find_quantized
from reshard.pipeline.mesh_report import mesh_table

if TYPE_CHECKING:
    from reshard.pipeline.options import SourceOptions

__all__ = ["inspect", "CatalogReport", "catalog_json", "compact_json", "ChunkBoxesText", "catalog_table", "catalog_repr",
           "dry_run_table", "format_name", "summary_line"]


def _jsonable(value: Any) -> Any:
    """Values as JSON has them; anything else (numpy, custom objects) as its repr."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def _layout(catalog: Catalog) -> dict[str, Any]:
    """The layout and why; an ambiguous one is shown (name None, the reason says what to pass),
    since inspecting is how a user finds out which ``--layout`` to give."""
    try:
        found = detect_layout(catalog)
    except AmbiguousLayoutError as e:
        return {"name": None, "writer": None, "param_groups": None, "reason": str(e), "unexplained": []}
    return {"name": found.name, "writer": found.convention.writer, "param_groups": found.groups
            if found.convention.optimizer is not None else None, "reason": found.reason,
            "unexplained": list(found.unexplained)}


_SHOWN = 160


def format_name(catalog: Catalog) -> str:
    """``hf`` for an HF model folder (safetensors or .bin weights beside a config.json)."""
    return "hf" if catalog.facts.hf_config is not None and catalog.format in ("safetensors", "hf-bin") \
        else catalog.format


def source_mesh(catalog: Catalog) -> dict[str, Any] | None:
    """The mesh the checkpoint was saved on, one shape whatever the reader recorded."""
    mesh = catalog.facts.source_mesh
    if mesh is None:
        return None
    if isinstance(mesh, dict):
        return {"shape": list(mesh.get("shape", [])), "names": list(mesh["names"]) if mesh.get("names") else None}
    names = catalog.facts.source_mesh_dim_names
    return {"shape": list(mesh), "names": list(names) if names else None}


def _one_line(value: Any) -> str:
    """``repr(value)`` on one line (numpy and torch break long reprs over several)."""
    return re.sub(r"\s*\n\s*", " ", repr(value))


def _short(value: Any) -> str:
    text = _one_line(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 1] + "…"


def _quantized(catalog: Catalog) -> tuple[dict[str, str], dict[str, str]]:
    """(weight name -> its scheme, scale name -> the weight it scales) of a quantized release."""
    schemes = find_quantized(catalog)
    return {n: s.label for n, s in schemes.items()}, {s.scale: s.weight for s in schemes.values()}


class ChunkBoxesText:
    """A tensor's chunk list, kept as its columns until ``compact_json`` writes it as text.

    A 2048-rank checkpoint has millions of chunks: as JSON objects (a dict and two lists
    each) they cost more time and memory than reading the metadata did. Written from the
    columns with one C-level %-format per tensor, they cost a tenth."""

    __slots__ = ("offsets", "sizes")

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray) -> None:
        self.offsets, self.sizes = offsets, sizes

    def text(self) -> str:
        """Exactly what ``json.dumps(..., separators=(",", ":"))`` writes for the list."""
        n, ndim = self.offsets.shape
        if not n:
            return "[]"
        ints = ",".join(["%d"] * ndim)
        one = '{"offsets":[' + ints + '],"sizes":[' + ints + "]}"
        values = np.concatenate([self.offsets, self.sizes], axis=1).ravel().tolist()
        return "[" + ",".join([one] * n) % tuple(values) + "]"

    def as_list(self) -> list[dict[str, list[int]]]:
        return [{"offsets": o, "sizes": z} for o, z in zip(self.offsets.tolist(), self.sizes.tolist())]


@without_gc  # 100k tensors' dicts and lists: no cycles, and the collector's passes cost more than the encoding
def compact_json(doc: Any) -> str:
    """``doc`` as JSON without indentation, with ``ChunkBoxesText`` values written as text."""
    texts: list[str] = []
    token = f"@chunks-{uuid.uuid4().hex}@"

    def placeholder(value: Any) -> str:
        if isinstance(value, ChunkBoxesText):
            texts.append(value.text())
            return token
        raise TypeError(f"{type(value).__name__} is not JSON serializable")

    parts = json.dumps(doc, separators=(",", ":"), default=placeholder).split(f'"{token}"')
    out = [parts[0]]
    for text, part in zip(texts, parts[1:]):
        out += [text, part]
    return "".join(out)


@without_gc
def catalog_json(catalog: Catalog, *, chunks_as_text: bool = False) -> dict[str, Any]:
    """The contract's JSON of ``catalog``; ``chunks_as_text``: chunk lists as ``ChunkBoxesText``
    for ``compact_json`` (the CLI's way for big checkpoints), else plain lists."""
    attrs: dict[str, Any] = {}
    schemes, scales = _quantized(catalog)
    if catalog.facts.source_world_size is not None:
        attrs["source_world_size"] = catalog.facts.source_world_size
    if (mesh := source_mesh(catalog)) is not None:
        attrs["source_mesh"] = mesh
    if catalog.facts.source_placements is not None:
        attrs["source_placements"] = _jsonable(catalog.facts.source_placements)
    return {
        "format": format_name(catalog),
        "path": str(catalog.path),
        "layout": _layout(catalog),
        "tensors": [
            {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": dtype_name(t.dtype),
                "bytes": t.nbytes,
                "chunks": boxes if chunks_as_text else boxes.as_list(),
                **({"quantized": schemes[t.name]} if t.name in schemes else {}),
                **({"scale_of": scales[t.name]} if t.name in scales else {}),
            }
            for t in sorted(catalog.tensors.values(), key=lambda t: t.name)
            for boxes in (ChunkBoxesText(*t.columns),)
        ],
        "objects": [{"name": n, "type": type(v).__name__, "value": _jsonable(v)} for n, v in catalog.objects.items()],
        "total_bytes": catalog.total_bytes,
        "notices": list(catalog.notices),
        "attrs": attrs,
    }


@without_gc
def catalog_header(catalog: Catalog) -> list[str]:
    """What the checkpoint is, in a few lines: format, size, layout, the mesh it was saved on."""
    lines = [summary_line(catalog)]
    layout = _layout(catalog)
    if layout["name"] is None:
        lines.append(f"layout: ambiguous: {layout['reason']}")
    else:
        lines.append(f"layout: {layout['name']} ({layout['writer']}): {layout['reason']}")
        if layout["unexplained"]:
            lines.append(f"  not model or optimizer state: {', '.join(layout['unexplained'][:8])}"
                         + (f" and {len(layout['unexplained']) - 8} more" if len(layout["unexplained"]) > 8 else ""))
    if catalog.facts.source_world_size is not None:
        lines.append(f"world size: {catalog.facts.source_world_size}")
    if (mesh := source_mesh(catalog)) is not None:
        lines.append("mesh: " + (", ".join(f"{n}={s}" for n, s in zip(mesh["names"], mesh["shape"])) if mesh["names"]
                                 else "x".join(map(str, mesh["shape"]))))
    return lines


def catalog_table(catalog: Catalog) -> str:
    schemes, scales = _quantized(catalog)

    def quant(name: str) -> str:
        return schemes.get(name) or (f"scale of {scales[name]}" if name in scales else "")

    rows = [(t.name, dtype_name(t.dtype), "x".join(map(str, t.shape)) or "scalar", format_size(t.nbytes),
             str(t.chunk_count), quant(t.name)) for t in sorted(catalog.tensors.values(), key=lambda t: t.name)]
    head = ("name", "dtype", "shape", "bytes", "chunks", "quantized" if schemes else "")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(6)]
    fmt = "  ".join(f"{{:<{w}}}" if i in (0, 1, 2, 5) else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = catalog_header(catalog)
    lines += ["", fmt.format(*head).rstrip()] + [fmt.format(*r).rstrip() for r in rows]
    if catalog.objects:
        lines += ["", f"objects ({len(catalog.objects)}):"]
        lines += [_short_line(n, v) for n, v in catalog.objects.items()]
    lines += [f"notice: {n}" for n in catalog.notices]
    return "\n".join(lines)


def _short_line(name: str, value: Any) -> str:
    line = f"  {name} = {_one_line(value)}"
    return line if len(line) <= _SHOWN else line[: _SHOWN - 1] + "…"


def summary_line(catalog: Catalog) -> str:
    return f"{catalog.path}: {format_name(catalog)}, {plural(len(catalog.tensors), 'tensor')}, {format_size(catalog.total_bytes)}"


def catalog_repr(catalog: Catalog, html: bool = False) -> str:
    """One screen: the summary, the layout, the largest tensors, how many objects."""
    biggest = sorted(catalog.tensors.values(), key=lambda t: -t.nbytes)[:8]
    rows = [(t.name, dtype_name(t.dtype), "x".join(map(str, t.shape)) or "scalar", format_size(t.nbytes)) for t in biggest]
    more = len(catalog.tensors) - len(rows)
    head = f"{summary_line(catalog)}; layout {_layout(catalog)['name'] or 'ambiguous'}; {len(catalog.objects)} objects"
    if html:
        cells = "".join(f"<tr><td><code>{h.escape(n)}</code></td><td>{d}</td><td>{s}</td><td>{b}</td></tr>"
                        for n, d, s, b in rows)
        tail = f"<p>... and {more} more tensors (<code>catalog.table()</code> lists all)</p>" if more > 0 else ""
        return (f"<p><b>reshard Catalog</b>: {h.escape(head)}</p><table><tr><th>largest tensors</th><th>dtype</th>"
                f"<th>shape</th><th>bytes</th></tr>{cells}</table>{tail}")
    lines = [f"<Catalog {head}>"] + [f"  {n}  {d}  {s}  {b}" for n, d, s, b in rows]
    if more > 0:
        lines.append(f"  ... and {more} more tensors (catalog.table() lists all)")
    return "\n".join(lines)


def dry_run_table(result: Any) -> str:
    """``convert --dry-run``: what would be written, file by file, and per target rank."""
    files = result.files
    lines = [f"dry run: {result.dst} ({result.format}) would hold {plural(result.tensors, 'tensor')}, "
             f"{format_size(result.bytes)} of tensor data in {plural(len(files), 'data file')}:"]
    lines += [f"  {path}  {format_size(size)}" for path, size in files[:10]]
    if len(files) > 10:
        lines.append(f"  ... and {len(files) - 10} more")
    if result.ranks is not None:
        lines += ["", mesh_table(result.ranks)]
    return "\n".join(lines)


@dataclass(repr=False, eq=False)
class CatalogReport(Catalog):
    """A catalog as ``reshard.inspect`` gives it: the same data, and the ways ``reshard
    inspect`` shows it (a summary as its repr, in notebooks too; ``table()``; ``to_json()``)."""

    @classmethod
    def of(cls, catalog: Catalog) -> CatalogReport:
        return cls(**{f.name: getattr(catalog, f.name) for f in fields(catalog)})

    def table(self) -> str:
        """Every tensor (name, dtype, shape, bytes, chunks) and object, as ``reshard inspect`` prints it."""
        return catalog_table(self)

    def to_json(self) -> dict[str, Any]:
        """What ``reshard inspect --json`` prints (without the schema header)."""
        return catalog_json(self)

    def __repr__(self) -> str:
        return catalog_repr(self)

    def _repr_html_(self) -> str:
        return catalog_repr(self, html=True)


def inspect(path: str | os.PathLike, *, options: SourceOptions | None = None, layout: str | None = None,
            storage_options: dict[str, Any] | None = None, source_options: SourceOptions | None = None) -> Catalog:
    """The catalog of checkpoint ``path`` (a path, a zarr URL, or a Hub repo id as ``convert``
    takes them): every tensor's shape, dtype and chunks, and the objects. Reads metadata only,
    never tensor data, and does not import torch: a tensor's ``dtype`` is a
    ``reshard.core.dtypes.DType`` (torch's name and width; ``.torch`` gives torch's dtype).
    ``layout`` names the tool whose conventions the checkpoint follows when detection gets it
    wrong (``reshard.core.conventions``); ``storage_options`` are fsspec arguments for a URL.
    ``options`` (a ``SourceOptions``; ``source_options=`` is its former name) gives these and
    the rest of how a source is read as one value: ``allow_classes`` also holds for the
    catalog's objects read later, ``config`` says what model it is, and ``keymap`` shows the
    names it renames them to.

    >>> cat = reshard.inspect("ckpt/")
    >>> cat                      # a one-screen summary; print(cat.table()) for every tensor
    >>> cat.tensors["model.embed.weight"].dtype.torch is torch.bfloat16
    """
    from reshard.pipeline.options import SourceOptions, former_keyword
    from reshard.sources.reading import given_config, given_layout, read_catalog

    given = {k: v for k, v in (("layout", layout), ("storage_options", storage_options)) if v is not None}
    opts = SourceOptions.of(given, former_keyword("reshard.inspect", "source_options", "options", source_options, options))
    with opts.allowing():
        catalog = given_config(given_layout(read_catalog(path, opts), opts.layout), opts.config)
        if opts.keymap is not None:
            from reshard.features.keymap.lookup import load_keymap

            catalog = load_keymap(opts.keymap).apply(catalog)
    if opts.allow_classes:  # objects are read when first asked for: the allowance goes with them
        catalog.objects = ObjectTable({name: _allowing(opts, catalog.objects, name) for name in catalog.objects})
    return CatalogReport.of(catalog)


def _allowing(opts: SourceOptions, objects: Any, name: str) -> Any:
    """A loader of ``objects[name]`` that reads it with ``opts.allow_classes`` allowed."""
    def load() -> Any:
        with opts.allowing():
            return objects[name]
    return load
