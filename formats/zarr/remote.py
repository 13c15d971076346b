"""Conversions from and to zarr stores behind fsspec URLs (``memory://``, ``s3://``...).

Object stores have no rename, so the local recipe (stage in a hidden sibling, rename when
complete) cannot apply. Instead every chunk is put first, streamed from the source under the
memory budget, then every array's ``zarr.json``, and the root ``zarr.json`` last: until that
last put, readers (ours, zarr-python, tensorstore) find no store at the URL. ``file://`` URLs
are local folders and take the local, atomic path (``reshard.convert``).

This is orchestration (catalog → target → plan → bytes), kept beside the zarr format because
only zarr has remote stores; ``reshard.convert`` hands URLs here with one dispatch.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from reshard.catalog import Catalog, Target
from reshard.errors import OutputExistsError, UsageError
from reshard.formats.pieces import FileLayout, Piece
from reshard.formats.zarr.format import ZarrFormat, ZarrWriter, write_metadata
from reshard.formats.zarr.chunks import compress as zstd
from reshard.formats.zarr.meta import ZARR_JSON
from reshard.formats.zarr.store import RemoteStore, is_url

__all__ = ["convert_url", "write_url", "is_url"]

_ZERO_STEP = 8 << 20


def _local(location: Any) -> Path | None:
    """The local path a location names (plain path or ``file://`` URL), None for remote URLs."""
    if location is None or not is_url(location):
        return None if location is None else Path(location)
    return Path(str(location)[len("file://"):]) if str(location).startswith("file://") else None


def _slabs(piece: Piece, sources: list, slab_bytes: int) -> Any:
    """The piece's bytes in C-order slabs of at most ``slab_bytes`` (the engine's own helpers)."""
    from reshard.boxes import c_order_slabs
    from reshard.engine import assemble

    for slab in c_order_slabs(piece.box, piece.dtype.itemsize, slab_bytes):
        t = assemble(slab, piece.dtype, [s for s in sources if s.box.intersect(slab) is not None])
        flat = t.contiguous().reshape(-1)
        yield memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _put_chunk(store: RemoteStore, key: str, layout: FileLayout, full: int, plan: Any, slab: int, compressed: bool) -> int:
    """One chunk object: streamed (multipart on object stores) when raw, whole when zstd."""
    if compressed:
        buf, at = bytearray(full), 0
        for seg in layout.segments:
            for part in _slabs(seg, plan.sources[seg], slab) if isinstance(seg, Piece) else [memoryview(seg)]:
                buf[at:at + part.nbytes] = part
                at += part.nbytes
        store.put(key, zstd(buf))
        return full
    written = 0
    with store.open_write(key) as f:
        for seg in layout.segments:
            for part in _slabs(seg, plan.sources[seg], slab) if isinstance(seg, Piece) else [memoryview(seg)]:
                f.write(part)
                written += part.nbytes
        zeros = bytes(min(_ZERO_STEP, full - written))
        while written < full:  # the edge chunk's padding
            n = min(len(zeros), full - written)
            f.write(zeros[:n])
            written += n
    return full


def write_url(url: str, plan: Any, target: Target, writer: ZarrWriter, *, max_memory: int,
              overwrite: bool = False, workers: int | None = None) -> int:
    """Write ``plan`` (laid out by ``writer``) as a zarr store at ``url``; returns bytes put.
    Memory: each worker holds one slab (raw) or one chunk and its zstd form (compressed)."""
    store = RemoteStore(url)
    if store.size(ZARR_JSON) is not None or store.listing(""):
        if not overwrite:
            what = "a zarr store" if store.size(ZARR_JSON) is not None else "data (an unfinished write?)"
            raise OutputExistsError(f"{url} already holds {what}; pass --overwrite to replace it")
        store.remove()
    arrays = writer.arrays(target)
    by_key = {f.relpath: f for f in plan.files}
    jobs = [(key, by_key[key], a.meta.chunk_nbytes) for a in arrays for key, _ in a.chunks()]
    largest = max((full for _, _, full in jobs), default=1)
    n = workers or max(1, min(4, os.cpu_count() or 1))
    if writer.compress:  # a chunk, its zstd frame and a slab per worker
        n = max(1, min(n, max_memory // max(1, 3 * largest)))
    slab = max(1 << 16, max_memory // (3 * n))
    with ThreadPoolExecutor(n) as pool:
        sizes = list(pool.map(lambda j: _put_chunk(store, j[0], j[1], j[2], plan, slab, writer.compress), jobs))
    write_metadata(store, target, arrays)
    return sum(sizes)


def _catalog(src: Any) -> Catalog:
    local = _local(src)
    if local is None:
        return ZarrFormat().read(str(src))
    from reshard.formats.registry import detect_format

    return detect_format(local).read(local)


def convert_url(src: Any, dst: Any, *, to: str | None = None, mesh: str | None = None, placements: str | None = None,
                dtype: Any = None, only: str | None = None, max_memory: str | int = "1GiB", overwrite: bool = False,
                quiet: bool = False, compress: bool = False, keep_per_rank: bool = False,
                keymap: str | None = None, max_shard_size: str | int | None = None,
                exclude: Any = None, layout: str | None = None, config: Any = None, hf_assets: Any = None,
                weights_only: bool = False) -> Any:
    """``reshard.convert`` where SRC or DST is a URL. Remote DST: a zarr store, written as
    above. Remote SRC with local DST: any format, staged and renamed as usual."""
    from reshard.convert import ConvertResult, build_target, convert, write_output
    from reshard.plan import make_plan
    from reshard.sizes import parse_size

    start = time.perf_counter()
    src_path, dst_path = _local(src), _local(dst)
    common = dict(to=to, mesh=mesh, placements=placements, dtype=dtype, only=only, max_memory=max_memory,
                  overwrite=overwrite, quiet=quiet, keep_per_rank=keep_per_rank, keymap=keymap,
                  exclude=exclude, layout=layout, config=config, hf_assets=hf_assets, weights_only=weights_only)
    if src_path is not None and (dst is None or dst_path is not None):  # file:// on both sides
        return convert(src_path, dst_path, compress=compress, max_shard_size=max_shard_size, **common)
    if dst is None:
        raise UsageError(f"{src}: a remote source needs an explicit DST (a path or URL)")
    if dst_path is None and (to or "zarr") != "zarr":
        raise UsageError(f"{dst}: a URL destination is a zarr store; use --to zarr or a local DST")
    to = to or ("zarr" if dst_path is None else None)
    if to is None:
        from reshard.formats.registry import format_for_destination

        to = format_for_destination(dst_path)
    if compress and to != "zarr":
        raise UsageError("--compress applies to zarr output only")
    budget = parse_size(max_memory)
    shard = parse_size(max_shard_size) if max_shard_size is not None else None
    catalog, to, target, _ = build_target(_catalog(src), to, mesh=mesh, placements=placements, dtype=dtype, only=only,
                                          keep_per_rank=keep_per_rank, keymap=keymap, budget=budget,
                                          exclude=exclude, layout=layout, config=config, hf_assets=hf_assets, weights_only=weights_only)
    if dst_path is None:
        writer = ZarrWriter(compress=compress, chunk_bytes=shard)
        plan = make_plan(catalog, writer.layout(target))
        write_url(str(dst), plan, target, writer, max_memory=budget, overwrite=overwrite)
        notices = writer.notices(target)
    else:  # a remote source into a local output: staged and committed as any conversion
        from reshard.formats.registry import get_format

        out = get_format(to).writer(dst_path, max_shard_size=shard, **({"compress": True, "max_memory": budget} if compress else {}))
        files = out.layout(target)
        plan = make_plan(catalog, files)
        write_output(plan, out, target, files, dst_path, {}, None, sources=(), label=str(src), budget=budget,
                     workers=None, progress=not quiet, overwrite=overwrite, fsync=False)
        notices = list(out.notices(target))
    return ConvertResult(src=src, dst=dst if dst_path is None else dst_path, format=to, tensors=len(target.tensors),
                         bytes=plan.total_bytes, seconds=time.perf_counter() - start,
                         notices=target.notices + notices)

