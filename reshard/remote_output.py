"""Writing an output behind an fsspec URL (``s3://``, ``gs://``, ``az://``, ``memory://``...):
DCP folders, safetensors files and folders, HF folders. Zarr stores have their own sink
(``formats/zarr/remote.py``), which this module's slab streaming also serves.

Object stores have no rename, so the local recipe (stage in a hidden sibling, rename when
complete) cannot apply. Instead:

1. A URL that already holds anything is refused, unless ``overwrite``: then the old output's
   marker (below) is deleted first and the rest after, so a half-deleted output never reads as
   a checkpoint.
2. Every data file is streamed to its final key, its slabs assembled under the memory budget
   by a few workers (multipart uploads on S3 and GCS: an object appears only when whole).
3. What the writer's ``finish`` makes (DCP ``.metadata``, a safetensors index, config.json)
   is made in a local temp folder and put after the data, the marker last: ``.metadata`` for
   DCP, the index for sharded safetensors. Until that put no reader (ours, torch's
   ``FsspecReader``, transformers) takes the URL for a checkpoint; reshard also refuses a
   folder of ``-NNNNN-of-NNNNN`` shards whose index is missing.

A failed or interrupted write deletes what it put (best effort; after a SIGKILL the keys stay,
and the next write to the URL refuses them as an unfinished write until ``--overwrite``).
What an object store cannot give, and reshard does not pretend to: an overwrite is not atomic
(the old output is gone before the new one is whole), and two writers to one URL at once are
not detected (there is no lock file to take).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from reshard.engine import REMOTE_WORKERS
from reshard.errors import OutputExistsError, option
from reshard.gc_pause import without_gc
from reshard.options import ConvertOptions
from reshard.pieces import OutputFile, Piece
from reshard.protocol import Writer
from reshard.storage import RemotePath, forget_cached
from reshard.target import Target

__all__ = ["write_remote", "slabs_of", "MARKERS"]

# The file that makes a folder a checkpoint, put last and deleted first.
MARKERS = (".metadata", "model.safetensors.index.json")


def slabs_of(segment: Any, plan: Any, slab_bytes: int) -> Iterator[memoryview]:
    """A file segment's bytes in C-order slabs of at most ``slab_bytes``: a ``Piece`` assembled
    from its sources (the engine's own helpers), literal header bytes as they are."""
    import torch

    if not isinstance(segment, Piece):
        yield memoryview(segment)
        return
    from reshard.boxes import c_order_slabs
    from reshard.engine import assemble

    sources = plan.sources[segment]
    for slab in c_order_slabs(segment.box, segment.dtype.itemsize, slab_bytes):
        t = assemble(slab, segment.dtype, [s for s in sources if s.box.intersect(slab) is not None])
        flat = t.contiguous().reshape(-1)
        # the ignore: numpy's stubs give an ndarray the buffer protocol on Python 3.12+ only
        yield memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")  # type: ignore[arg-type]


def _is_marker(name: str) -> bool:
    return name in MARKERS or name.endswith(".index.json")


def _clear(root: RemotePath, overwrite: bool) -> None:
    """Refuse a URL that holds anything, or (``overwrite``) empty it, markers first."""
    if not root.exists():
        return
    one_file = root.is_file()
    keys = [root.path] if one_file else sorted(root.fs.find(root.path, withdirs=False))
    if not keys:
        return
    if not overwrite:
        names = {k.rsplit("/", 1)[-1] for k in keys}
        what = "a checkpoint" if one_file or any(_is_marker(n) for n in names) else "data (an unfinished write?)"
        raise OutputExistsError(f"{root} already holds {what}; pass {option('--overwrite', 'overwrite=True')} to replace it")
    keys.sort(key=lambda k: not _is_marker(k.rsplit("/", 1)[-1]))
    for key in keys:
        root.fs.rm_file(key)


def _put_file(dest: RemotePath, file: OutputFile, plan: Any, slab_bytes: int) -> int:
    """Stream one file to ``dest``. On an error the upload is discarded, not closed: closing
    an fsspec file commits it (completes the multipart upload) with what it holds so far."""
    written = 0
    f = dest.open("wb")
    try:
        for seg in file.segments:
            for part in slabs_of(seg, plan, slab_bytes):
                f.write(part)
                written += part.nbytes
    except BaseException:
        discard = getattr(f, "discard", None)
        if callable(discard):
            discard()
        else:  # a file with no way to abort (memory://): committed, then deleted by the caller
            f.close()
        raise
    f.close()
    return written


@without_gc
def write_remote(url: str, plan: Any, target: Target, writer: Writer, files: list[OutputFile], options: ConvertOptions) -> int:
    """Write ``files`` (laid out by ``writer``) at ``url``; returns the data bytes put.
    Memory: each worker holds one slab and what the store buffers of a part upload."""
    root = RemotePath.from_url(url, options.storage_options)
    forget_cached(root)
    _clear(root, options.overwrite)
    n = options.workers or max(1, min(REMOTE_WORKERS, len(files)))  # each mostly waits on the store
    slab = max(1 << 16, options.budget // (3 * n))
    put: list[RemotePath] = []

    def one(file: OutputFile) -> int:
        dest = root / file.relpath if file.relpath else root
        put.append(dest)
        return _put_file(dest, file, plan, slab)

    try:
        with ThreadPoolExecutor(n) as pool:
            total = sum(pool.map(one, files))
        if writer.output_is_dir:
            with tempfile.TemporaryDirectory(prefix="reshard-finish-") as tmp:
                writer.finish(Path(tmp), target, files)
                made = sorted((p for p in Path(tmp).rglob("*") if p.is_file()), key=lambda p: (_is_marker(p.name), str(p)))
                for p in made:
                    dest = root / p.relative_to(tmp).as_posix()
                    put.append(dest)
                    dest.fs.put_file(str(p), dest.path)
    except BaseException:
        _forget(put)
        raise
    return total


def _forget(keys: list[RemotePath]) -> None:
    """Delete what a failed write put, markers first (best effort: the store may be gone)."""
    for dest in sorted(keys, key=lambda d: not _is_marker(d.name)):
        try:
            dest.fs.rm_file(dest.path)
        except Exception:  # noqa: BLE001 - the original error is what the user needs
            pass
