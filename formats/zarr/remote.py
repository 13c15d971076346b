"""Writing a zarr store behind an fsspec URL (``memory://``, ``s3://``...): the remote sink of
``reshard.convert``, which plans, checks and names the output exactly as for a local one.

Object stores have no rename, so the local recipe (stage in a hidden sibling, rename when
complete) cannot apply. Instead every chunk is put first, streamed from the source under the
memory budget, then every array's ``zarr.json``, and the root ``zarr.json`` last: until that
last put, readers (ours, zarr-python, tensorstore) find no store at the URL. ``file://`` URLs
are local folders and take the local, atomic path.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from reshard.formats.zarr.chunks import compress as zstd
from reshard.formats.zarr.format import ZarrWriter, write_metadata
from reshard.formats.zarr.meta import ZARR_JSON
from reshard.formats.zarr.store import RemoteStore

from reshard.errors import OutputExistsError, option
from reshard.gc_pause import without_gc
from reshard.options import ConvertOptions
from reshard.pieces import OutputFile
from reshard.remote_output import slabs_of
from reshard.storage import forget_cached
from reshard.target import Target

__all__ = ["write_url"]

_ZERO_STEP = 8 << 20


def _put_chunk(store: RemoteStore, key: str, layout: OutputFile, full: int, plan: Any, slab: int, compressed: bool) -> int:
    """One chunk object: streamed (multipart on object stores) when raw, whole when zstd."""
    if compressed:
        buf, at = bytearray(full), 0
        for seg in layout.segments:
            for part in slabs_of(seg, plan, slab):
                buf[at:at + part.nbytes] = part
                at += part.nbytes
        store.put(key, zstd(buf))
        return full
    written = 0
    with store.open_write(key) as f:
        for seg in layout.segments:
            for part in slabs_of(seg, plan, slab):
                f.write(part)
                written += part.nbytes
        zeros = bytes(min(_ZERO_STEP, full - written))
        while written < full:  # the edge chunk's padding
            n = min(len(zeros), full - written)
            f.write(zeros[:n])
            written += n
    return full


@without_gc
def write_url(url: str, plan: Any, target: Target, writer: ZarrWriter, files: list[OutputFile], options: ConvertOptions) -> int:
    """Write ``plan`` (laid out by ``writer`` as ``files``) as a zarr store at ``url``; returns bytes put.
    Memory: each worker holds one slab (raw) or one chunk and its zstd form (compressed)."""
    max_memory, overwrite, workers = options.budget, options.overwrite, options.workers
    store = RemoteStore(url, options.storage_options)
    forget_cached(store.remote)
    if store.size(ZARR_JSON) is not None or store.listing(""):
        if not overwrite:
            what = "a zarr store" if store.size(ZARR_JSON) is not None else "data (an unfinished write?)"
            raise OutputExistsError(f"{url} already holds {what}; pass {option('--overwrite', 'overwrite=True')} to replace it")
        store.remove()
    arrays = writer.arrays(target)
    by_key = {f.relpath: f for f in files}
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
