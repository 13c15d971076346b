"""``reshard.convert``: any checkpoint to any format, streamed, written atomically."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from reshard.catalog import Catalog
from reshard.dtypes import parse_dtype
from reshard.engine import Engine
from reshard.errors import SourceChangedError, UsageError
from reshard.formats.registry import detect_format, format_for_destination, get_format
from reshard.plan import full_target, make_plan
from reshard.regions import StoredRegion
from reshard.sizes import parse_size
from reshard.staging import StagedOutput

__all__ = ["convert", "ConvertResult", "default_destination", "source_files"]

_SUFFIX = {"safetensors": ".safetensors", "torch": ".pt", "zarr": ".zarr"}


@dataclass
class ConvertResult:
    src: Path
    dst: Path
    format: str
    tensors: int
    bytes: int
    seconds: float
    kernel_bytes: int = 0
    notices: list[str] = field(default_factory=list)


def default_destination(src: Path, to: str, *, sharded: bool = False) -> Path:
    """A new path beside ``src`` named after the target; never ``src`` itself."""
    stem = src.name
    for suffix in (".safetensors", ".pt", ".pth", ".bin", ".zarr"):
        stem = stem.removesuffix(suffix)
    suffix = "" if sharded else _SUFFIX.get(to, "")
    dst = src.with_name(f"{stem}{suffix}" if suffix else f"{stem}_{to}")
    if dst.resolve() == src.resolve():
        dst = src.with_name(f"{stem}_converted{suffix}")
    return dst


def source_files(catalog: Catalog) -> dict[Path, tuple[int, int]]:
    """(size, mtime) of every file tensor bytes come from, to detect a source changing under us."""
    out = {}
    for t in catalog.tensors.values():
        for c in t.chunks:
            if isinstance(c.data, StoredRegion) and c.data.path not in out:
                st = os.stat(c.data.path)
                out[c.data.path] = (st.st_size, st.st_mtime_ns)
    return out


def _check_unchanged(before: dict[Path, tuple[int, int]]) -> None:
    for path, (size, mtime) in before.items():
        st = os.stat(path)
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            raise SourceChangedError(f"{path}: changed while it was being converted; output discarded, rerun when it is stable")


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike | None = None,
    *,
    to: str | None = None,
    mesh: str | None = None,
    placements: str | None = None,
    dtype: str | torch.dtype | None = None,
    only: str | None = None,
    max_memory: str | int = "1GiB",
    max_shard_size: str | int | None = None,
    overwrite: bool = False,
    quiet: bool = False,
    workers: int | None = None,
    fsync: bool = False,
) -> ConvertResult:
    """Convert checkpoint ``src`` into ``dst`` (format ``to``, or guessed from ``dst``).

    Lossless unless asked otherwise: names, dtypes and every bit of every tensor are kept;
    objects travel where the target can hold them (``ConvertResult.notices`` says what
    could not). Peak memory is bounded by ``max_memory``, not by the checkpoint size. The
    output appears atomically; ``fsync=True`` also makes it durable against power loss.

    >>> reshard.convert("ckpt/", "model.safetensors", only="model", dtype="bfloat16")
    """
    start = time.perf_counter()
    src = Path(src)
    if mesh is not None or placements is not None:
        raise UsageError("--to-mesh/--placements are not available in this version; convert without them")
    budget = parse_size(max_memory)
    shard_size = parse_size(max_shard_size) if max_shard_size is not None else None
    fmt = detect_format(src)
    catalog = fmt.read(src)
    before = source_files(catalog)
    if to is None:
        to = format_for_destination(Path(dst)) if dst is not None else "dcp"
    out_fmt = get_format(to)
    dst = Path(dst) if dst is not None else default_destination(src, to, sharded=shard_size is not None)
    target = full_target(catalog, dtype=parse_dtype(dtype), only=only)
    writer = out_fmt.writer(dst, max_shard_size=shard_size)
    files = writer.layout(target)
    plan = make_plan(catalog, files)
    engine = Engine(budget, workers=workers, progress=not quiet, desc=f"{src.name} → {dst.name}", fsync=fsync)
    with StagedOutput(dst, is_dir=writer.output_is_dir, overwrite=overwrite, sources=(src,), fsync=fsync) as out:
        stats = engine.run(plan, out.staging, writer.output_is_dir)
        writer.finish(out.staging, target, files)
        _check_unchanged(before)
        out.commit()
    return ConvertResult(
        src=src, dst=dst, format=to, tensors=len(target.tensors), bytes=plan.total_bytes,
        seconds=time.perf_counter() - start, kernel_bytes=stats.kernel_bytes,
        notices=list(writer.notices(target)),
    )
