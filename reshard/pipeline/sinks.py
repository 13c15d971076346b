"""Where the engine's bytes go: a sink, which also owns how an output becomes a checkpoint.

The engine (``reshard.pipeline.engine``) schedules every output the same way and hands bytes to a
sink through one small interface: ``prepare`` the files, then ``file(relpath)`` gives a
handle whose ``write_at`` takes bytes at an offset. Two kinds of storage, two ways in:

* ``FolderSink``: local files, made at their full size first, then written at any offset,
  in any order, by any worker (``random_access``); kernel copies go to the handle's ``fd``,
  the descriptor the file was made with (each file is opened once).
* ``RemoteSink``: objects behind an fsspec URL, each uploaded front to back by one worker
  (an object appears whole when its upload closes, multipart on S3 and GCS).

And two ways an output appears, each the sink's own business (``open``, ``commit``,
``abort``):

* ``StagedSink`` (local): a hidden sibling of the destination, renamed into place when
  complete (``reshard.pipeline.staging``).
* ``RemoteSink``: object stores have no rename, so the file that makes a folder a checkpoint
  (the writer's ``marker``: DCP ``.metadata``, a safetensors index, zarr's root
  ``zarr.json``) is put last and deleted first. A URL that holds anything is refused unless
  ``overwrite``; a failed or interrupted write deletes what it put (best effort: after a
  SIGKILL the keys stay, and the next write refuses them as an unfinished write until
  ``--overwrite``). Until the marker is put no reader (ours, torch's ``FsspecReader``,
  transformers, zarr-python) takes the URL for a checkpoint. What an object store cannot
  give, and reshard does not pretend to: an overwrite is not atomic (the old output keeps its
  objects until the first upload, then loses its markers; what the new output does not
  replace goes when it is complete), and two writers to one URL at once are not detected.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from reshard.core.errors import OutputExistsError, option
from reshard.core.fd_pool import FdPool
from reshard.core.sizes import format_size
from reshard.core.storage import RemotePath, forget_cached
from reshard.pipeline.manifest import MANIFEST_NAME, FileDigest, file_digest, manifest_bytes
from reshard.pipeline.replace import CLAIM_NAME, claim_bytes, refusal, remote_foreign
from reshard.pipeline.staging import StagedOutput

if TYPE_CHECKING:
    from reshard.core.pieces import OutputFile
    from reshard.core.target import Target
    from reshard.pipeline.protocol import Writer

__all__ = ["SinkFile", "Sink", "OutputSink", "FolderSink", "StagedSink", "RemoteSink", "MARKERS"]

# Files that make a folder a checkpoint whatever wrote it: put last and deleted first.
MARKERS = (".metadata", "model.safetensors.index.json")


class SinkFile(Protocol):
    """One output file as the engine writes it."""

    # A local file's descriptor (kernel copies land there), or None for an upload.
    fd: int | None

    def write_at(self, offset: int, data: memoryview | bytes) -> None:
        """``data`` at ``offset``; an upload takes offsets in order, with no gaps."""
        ...

    def written(self, offset: int, nbytes: int) -> None:
        """``[offset, offset + nbytes)`` is final: a durable sink may start writing it back."""
        ...


class Sink(Protocol):
    # Files are made at their full size by ``prepare`` and written at any offset by any
    # worker; else each file is written front to back, once, by one worker.
    random_access: bool
    # Each write waits on a store's round trip: more workers keep more requests in flight.
    remote: bool
    is_dir: bool  # a folder of files, or the output is one file (relpath "")
    where: Path | RemotePath  # the output, as messages name it

    def prepare(self, files: list[tuple[str, int]]) -> None:
        """Before any write: (relpath, size) of every file (size 0: written whole later)."""
        ...

    def file(self, relpath: str) -> Any:
        """A context manager giving the ``SinkFile`` of ``relpath``. For an upload, leaving it
        normally completes the object and leaving it by an exception discards it."""
        ...

    def local_path(self, relpath: str) -> Path | None:
        """Where a file can be read back (digests for the manifest), or None."""
        ...

    def sync(self) -> None:
        """After the last write: make the files durable when asked (``fsync``)."""
        ...

    def close(self) -> None:
        """Let go of what the writes held (open files), after ``sync`` or an error."""
        ...


class OutputSink(Sink, Protocol):
    """A sink that turns the files written into it into an output, or into nothing."""

    def open(self) -> None:
        """Claim the destination: refuse what is there (unless ``overwrite``), lock, stage."""
        ...

    def commit(self, writer: Writer, target: Target, files: list[OutputFile], digests: dict[str, FileDigest]) -> None:
        """Write what the writer makes last (``finish``) and make the output appear."""
        ...

    def abort(self) -> None:
        """Undo what ``open`` and the writes did, unless committed; safe to call twice."""
        ...


# The most bytes one ``pwrite`` of a local file takes. The kernel fills the page cache with
# folios as large as a write allows (ext4 has large folios since Linux 6.16), and on the
# benchmark VM (Linux 6.18, 2 cores, a Firecracker guest) writes of MiBs were often slow to
# fill them: the benchmark's DCP -> safetensors (1.5 GB, two workers writing from 4 MiB
# buffers, ``reshard.pipeline.engine``), the engine's wall over 4-5 alternating runs: 2.0-2.6 s in whole
# 4 MiB writes, 0.43-0.68 s in 1 MiB writes, 0.42-0.47 s in 512 KiB, 0.46-0.55 s in 256 KiB,
# 0.52-0.65 s in 128 KiB (each write also costs its own fixed share: a lock, a timestamp).
# ``cp``'s kernel copies write 64 KiB at a time.
_WRITE_STEP = 512 << 10


class _LocalFile:
    __slots__ = ("fd", "durable")

    def __init__(self, fd: int, durable: bool) -> None:
        self.fd: int | None = fd
        self.durable = durable

    def write_at(self, offset: int, data: memoryview | bytes) -> None:
        """``data`` at ``offset``, ``_WRITE_STEP`` bytes per ``pwrite``."""
        assert self.fd is not None
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = os.pwrite(self.fd, view[:_WRITE_STEP], offset)
            view, offset = view[n:], offset + n

    def written(self, offset: int, nbytes: int) -> None:
        """With fsync, start writing a finished range to disk now, in the background, so the
        final fsync has little left to wait for (disk writes overlap the rest of the copy)."""
        if self.durable and nbytes and self.fd is not None and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def _check_free_space(root: Path, need: int) -> None:
    """Fail now, not at 90%, when the output cannot fit in the free space where it goes."""
    where = root
    while not where.exists() and where != where.parent:
        where = where.parent
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: the output needs {format_size(need)}, "
                                    f"{format_size(free)} is free", str(root))


class FolderSink:
    """Files under ``root`` (a folder), or ``root`` itself (``is_dir=False``: one file)."""

    random_access = True
    remote = False

    def __init__(self, root: Path, is_dir: bool = True, *, fsync: bool = False) -> None:
        self.root, self.is_dir, self.fsync = Path(root), is_dir, fsync
        self.where: Path | RemotePath = self.root
        self._outs: FdPool | None = None
        self._paths: list[Path] = []

    def _path(self, relpath: str) -> Path:
        return self.root / relpath if self.is_dir else self.root

    def prepare(self, files: list[tuple[str, int]]) -> None:
        _check_free_space(self.root, sum(size for _, size in files))
        self._outs = FdPool(os.O_WRONLY)
        self._paths = [self._path(relpath) for relpath, _ in files]
        for (relpath, size), path in zip(files, self._paths):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                # Sized, not reserved: pwrite into posix_fallocate'd (unwritten) extents measured 6x
                # slower than into a sparse file on ext4. Free space was checked once, above.
                os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                raise
            self._outs.adopt(path, fd)  # the writes go through this descriptor: the file is opened once

    @contextmanager
    def file(self, relpath: str) -> Iterator[_LocalFile]:
        assert self._outs is not None, "prepare() first"
        with self._outs.use(self._path(relpath)) as fd:
            yield _LocalFile(fd, self.fsync)

    def local_path(self, relpath: str) -> Path | None:
        return self._path(relpath)

    def sync(self) -> None:
        if self._outs is not None and self.fsync:
            for path in self._paths:
                with self._outs.use(path) as fd:
                    os.fsync(fd)

    def close(self) -> None:
        if self._outs is not None:
            self._outs.close()
            self._outs = None


class StagedSink(FolderSink):
    """A local output written into a hidden sibling of ``dst`` and renamed into place when
    complete (``reshard.pipeline.staging``). ``check`` runs just before the rename (the source has
    not changed meanwhile)."""

    def __init__(self, dst: Path, *, is_dir: bool, overwrite: bool = False, sources: tuple[Path, ...] = (),
                 fsync: bool = False, check: Callable[[], None] | None = None) -> None:
        self.staged = StagedOutput(dst, is_dir=is_dir, overwrite=overwrite, sources=sources, fsync=fsync)
        super().__init__(self.staged.staging, is_dir, fsync=fsync)
        self.where = Path(dst)
        self.check = check

    def open(self) -> None:
        self.staged.open()

    def commit(self, writer: Writer, target: Target, files: list[OutputFile], digests: dict[str, FileDigest]) -> None:
        writer.finish(self.root, target, files)
        if self.check is not None:
            self.check()
        self.staged.commit(digests)

    def abort(self) -> None:
        self.close()
        self.staged.close()


class _Upload:
    """An object streamed front to back."""

    fd: int | None = None

    def __init__(self, stream: BinaryIO, url: str) -> None:
        self.stream, self.url, self.at = stream, url, 0
        self.sha256 = hashlib.sha256()  # hashed on the way: the manifest needs no second read of the store

    def write_at(self, offset: int, data: memoryview | bytes) -> None:
        if offset != self.at:
            raise AssertionError(f"{self.url}: an upload is written in order (at {self.at}, asked for {offset})")
        self.stream.write(data)
        self.sha256.update(data)
        self.at += memoryview(data).nbytes

    def digest(self) -> FileDigest:
        return FileDigest(self.at, self.sha256.hexdigest())

    def written(self, offset: int, nbytes: int) -> None:
        pass


class RemoteSink:
    """An output behind an fsspec URL (``s3://``, ``gs://``, ``memory://``...)."""

    random_access = False
    remote = True

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, is_dir: bool = True,
                 overwrite: bool = False, marker: str | None = None) -> None:
        """``marker``: the writer's (``Writer.marker``), put last, beside the ``MARKERS`` every
        reader knows."""
        self.root = RemotePath.from_url(url, storage_options)
        self.where: Path | RemotePath = self.root
        self.is_dir, self.overwrite, self.marker = is_dir, overwrite, marker
        self._put: list[RemotePath] = []
        self._digests: dict[str, FileDigest] = {}
        self._old: list[str] = []  # what a previous output there holds (store paths), retired as the new one comes
        self._old_one_file = False
        self._retired = False
        self._committed = False

    def _is_marker(self, key: str) -> bool:
        """Whether ``key`` (a store path under the URL) makes the URL a checkpoint."""
        return _is_marker(key.rsplit("/", 1)[-1]) or (self.marker is not None and key == self._dest(self.marker).path)

    def _dest(self, relpath: str) -> RemotePath:
        return self.root / relpath if relpath else self.root

    def open(self) -> None:
        """Refuse a URL that holds anything, unless ``overwrite`` and it is one object, or a
        prefix of what a previous reshard output wrote there (its manifest lists them;
        ``reshard.pipeline.replace``). Nothing is deleted here: an object store cannot rename,
        so the old output stays whole until the first new byte goes up, then loses its markers
        (no reader takes a mix of two outputs for a checkpoint), and what the new output does
        not replace goes once it is complete."""
        forget_cached(self.root)
        if not self.root.exists():
            return
        one_file = self.root.is_file()
        keys = [self.root.path] if one_file else sorted(self.root.fs.find(self.root.path, withdirs=False))
        if not keys:
            return
        if not self.overwrite:
            what = "a checkpoint" if one_file or any(self._is_marker(k) for k in keys) else "data (an unfinished write?)"
            raise OutputExistsError(f"{self.root} already holds {what}; pass {option('--overwrite', 'overwrite=True')} "
                                    "to replace it")
        if not one_file:
            manifest, claim = self._dest(MANIFEST_NAME), self._dest(CLAIM_NAME)
            foreign = remote_foreign([self._relative(k) for k in keys],
                                     manifest.fs.cat_file(manifest.path) if manifest.path in keys else None,
                                     claim.fs.cat_file(claim.path) if claim.path in keys else None, manifest.url)
            if foreign:
                raise refusal(self.root, foreign, "prefix")
        self._old, self._old_one_file = keys, one_file

    def _relative(self, key: str) -> str:
        """A store path under the URL, relative to it (as manifests and claims name files)."""
        return key.removeprefix(self.root.path.rstrip("/") + "/")

    def _old_names(self) -> list[str]:
        return [] if self._old_one_file else [self._relative(k) for k in self._old]

    def _retire(self) -> None:
        """Before the first new byte: the old output's markers go (or all of it, where a file
        replaces a folder or a folder a file), so no reader ever takes the mix for a checkpoint."""
        if self._retired:
            return
        self._retired = True
        if self._old_one_file:
            going = [] if not self.is_dir else self._old  # a file over a file: its upload replaces it
        elif not self.is_dir:
            going = self._old
        else:
            going = [k for k in self._old if self._is_marker(k)]
        for key in going:
            self.root.fs.rm_file(key)
        gone = set(going)
        self._old = [k for k in self._old if k not in gone]

    def prepare(self, files: list[tuple[str, int]]) -> None:
        """A folder's claim goes first: a write killed before its manifest is put is still
        known to be reshard's, and ``--overwrite`` may clear it (``reshard.pipeline.replace``)."""
        if self.is_dir:
            self._claim([*(rel for rel, _ in files), *self._old_names()])

    def _claim(self, names: list[str]) -> None:
        dest = self._dest(CLAIM_NAME)
        if not any(put.path == dest.path for put in self._put):
            self._put.append(dest)
        dest.fs.pipe_file(dest.path, claim_bytes(names))

    @contextmanager
    def file(self, relpath: str) -> Iterator[_Upload]:
        """On an error the upload is discarded, not closed: closing an fsspec file commits it
        (completes the multipart upload) with what it holds so far."""
        self._retire()
        dest = self._dest(relpath)
        self._put.append(dest)
        stream = dest.open("wb")
        upload = _Upload(stream, dest.url)
        try:
            yield upload
        except BaseException:
            discard = getattr(stream, "discard", None)
            if callable(discard):
                discard()
            else:  # a file with no way to abort (memory://): committed, then deleted by abort()
                stream.close()
            raise
        stream.close()
        self._digests[relpath] = upload.digest()

    def local_path(self, relpath: str) -> Path | None:
        return None

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass

    def commit(self, writer: Writer, target: Target, files: list[OutputFile], digests: dict[str, FileDigest]) -> None:
        """What the writer's ``finish`` makes, made in a local temp folder and put after the
        data: the marker files last, the writer's own ``marker`` the very last."""
        self._retire()
        if self.is_dir:
            last = self.marker
            with tempfile.TemporaryDirectory(prefix="reshard-finish-") as tmp:
                writer.finish(Path(tmp), target, files)
                made = [(p.relative_to(tmp).as_posix(), p) for p in Path(tmp).rglob("*") if p.is_file()]
                # the manifest, as a local folder output has: what a later --overwrite may replace
                listed = {**self._digests, **{rel: file_digest(p) for rel, p in made}}
                (Path(tmp) / MANIFEST_NAME).write_bytes(manifest_bytes(listed))
                made.append((MANIFEST_NAME, Path(tmp) / MANIFEST_NAME))
                self._claim([*self._digests, *(rel for rel, _ in made), *self._old_names()])
                for rel, p in sorted(made, key=lambda m: (m[0] == last, _is_marker(m[1].name), m[0])):
                    dest = self._dest(rel)
                    self._put.append(dest)
                    dest.fs.put_file(str(p), dest.path)
            written = {put.path for put in self._put}
            for key in self._old:  # the previous output's files the new one did not replace
                if key not in written:
                    self.root.fs.rm_file(key)
            claim = self._dest(CLAIM_NAME)
            claim.fs.rm_file(claim.path)  # the manifest, put before the markers, lists every file now
        self._committed = True

    def abort(self) -> None:
        """Delete what a failed write put, markers first (best effort: the store may be gone)."""
        if self._committed:
            return
        put, self._put = self._put, []
        claim = self._dest(CLAIM_NAME)
        # the previous output's files left (its markers gone) stay claimed, so --overwrite may clear them
        keep_claim = bool(self._old_names()) and any(d.path == claim.path for d in put)
        for dest in sorted(put, key=lambda d: not self._is_marker(d.path)):
            if keep_claim and dest.path == claim.path:
                continue
            try:
                dest.fs.rm_file(dest.path)
            except Exception:  # noqa: BLE001 - the original error is what the user needs
                pass


def _is_marker(name: str) -> bool:
    return name in MARKERS or name.endswith(".index.json")
