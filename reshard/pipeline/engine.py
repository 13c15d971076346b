"""The engine: executes a plan, streaming every piece into its output file under a budget.

Two ways a piece gets its bytes:

* Stored runs. When every source part of a piece is a contiguous byte range both in its
  source file and in the piece, and no cast is needed (the usual dim-0 shards), the bytes
  move as they are stored. The thread that schedules locates each piece's sources (reading
  record headers) while the workers copy, and gathers the runs of consecutive pieces into
  one file as one job (``_KernelRuns``), where runs adjacent in both files become one. A
  large run whose offsets in both files are page-aligned is copied by the kernel
  (``os.copy_file_range``, as ``cp`` does: no user-space buffer, and a file system that
  shares extents clones it); the others are read into the worker's buffer, many runs to a
  buffer, and written from it with one ``pwrite`` per stretch without a gap
  (``_copy_steps``). The kernel copies a run whose offsets sit at different places in a
  page slowly, and a buffer lets two workers share one output file: one reads while the
  other writes (numbers at ``_RUN_BUFFER``). Writes into one file, and kernel copies, hold
  the file's lock: ext4 (like most file systems) serializes writes to one file on its inode
  lock, and a second writer spins on it in the kernel (measured: 13% of a 2-worker run's CPU
  samples in ``rwsem_spin_on_owner``).
* Slabs. Otherwise the piece is cut into C-order slabs small enough that every worker's
  slab plus the source reads behind it stay inside ``max_memory``; each slab is assembled
  from its sources (cast on the way) and written at its offset. A tensor larger than the
  budget is therefore moved in pieces, never whole. Each worker assembles its slabs in one
  buffer it keeps, and stored runs are read straight into it.

Pieces are independent, so a thread pool overlaps reads, casts and writes (all release the
GIL): casts and writes into several files gain from more workers, and so do stored runs into
one file, one worker reading while another writes (docs/benchmarks.md has the measurements
behind the default). Progress is counted in
bytes (``reshard.pipeline.progress``: a bar on a terminal, a line every 10 s in a log).

Every output goes through this one loop (``_schedule``) and one budget rule
(``Engine._workers_for``); where the bytes land is a sink's business (``reshard.pipeline.sinks``).
Local files take pieces at any offset, in any order; an upload to an object store takes a
file front to back from one worker, and so does a file whose stored form is made from all of
its bytes at once (``OutputFile.encode``: zarr's zstd), assembled in memory first.
"""

from __future__ import annotations

import errno
import math
import os
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from reshard.core.boxes import Box, c_order_slabs, contiguous_range
from reshard.core.dtypes import DType
from reshard.core.errors import CorruptCheckpointError, UsageError, option
from reshard.core.fd_pool import FdPool
from reshard.core.gc_pause import without_gc
from reshard.core.pieces import OutputFile, Piece
from reshard.core.regions import StoredRegion, as_region, read_exact, read_into
from reshard.core.sizes import format_size
from reshard.core.storage import RemotePath
from reshard.pipeline import gather
from reshard.pipeline.assemble import as_bytes, assemble_any, contiguous_in, moves_bytes
from reshard.pipeline.byte_runs import Gathered
from reshard.pipeline.manifest import FileDigest, file_digest
from reshard.pipeline.plan import Plan, Source
from reshard.pipeline.progress import Progress
from reshard.pipeline.sinks import FolderSink, Sink, SinkFile

__all__ = ["Engine", "EngineStats", "REMOTE_WORKERS"]

_KERNEL_STEP = 1 << 30
_FALLBACK_STEP = 8 << 20
_kernel_copy_works = hasattr(os, "copy_file_range")


@dataclass
class EngineStats:
    """Bytes moved each way: ``kernel_bytes`` as they are stored (stored runs: no slab
    assembled, no cast), by ``copy_file_range`` or, ``run_buffer_bytes`` of them, read into a
    worker's buffer and written from it (``_copy_steps``); ``buffered_bytes`` in slabs."""

    kernel_bytes: int = 0
    buffered_bytes: int = 0
    run_buffer_bytes: int = 0
    digests: dict[str, FileDigest] = field(default_factory=dict)  # relpath -> size and SHA-256, when asked
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, kernel: int = 0, buffered: int = 0, run_buffer: int = 0) -> None:
        """Workers report from several threads; ``+=`` on a field is not atomic."""
        with self._lock:
            self.kernel_bytes += kernel
            self.buffered_bytes += buffered
            self.run_buffer_bytes += run_buffer


def _kernel_copy(src_fd: int, src_off: int, dst_fd: int, dst_off: int, n: int, src_path: Path) -> None:
    global _kernel_copy_works
    while n > 0 and _kernel_copy_works:
        try:
            k = os.copy_file_range(src_fd, dst_fd, min(n, _KERNEL_STEP), src_off, dst_off)
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                _kernel_copy_works = False  # this kernel or filesystem pair cannot; copy below
                break
            raise
        if k == 0:
            raise CorruptCheckpointError(f"{src_path}: ends before byte {src_off + n} (truncated while reading?)")
        src_off, dst_off, n = src_off + k, dst_off + k, n - k
    while n > 0:
        step = min(n, _FALLBACK_STEP)
        os.pwrite(dst_fd, read_exact(src_fd, step, src_off, src_path), dst_off)
        src_off, dst_off, n = src_off + step, dst_off + step, n - step


def _bounding_box(boxes: list[Box]) -> Box:
    lo = [min(b.offsets[d] for b in boxes) for d in range(boxes[0].ndim)]
    hi = [max(b.offsets[d] + b.sizes[d] for b in boxes) for d in range(boxes[0].ndim)]
    return Box(tuple(lo), tuple(h - low for low, h in zip(lo, hi)))


@dataclass
class _RowGroup:
    """Pieces of one tensor sharing their rows, written as one job (``Engine._jobs``): their
    bounding box, each chunk they read once, and the bytes of a block of rows."""

    items: list[tuple[str, int, Piece]]
    box: Box
    sources: list[Source]
    block_bytes: int


def _merged_sources(pieces: list[Piece], plan: Plan, box: Box) -> list[Source]:
    """Each chunk the pieces read, once, with its part of ``box``."""
    chunks = {s.chunk.box.offsets: s.chunk for p in pieces for s in plan.sources[p]}  # one tensor's: boxes differ
    return [Source(c, part) for c in chunks.values() if (part := c.box.intersect(box)) is not None]


def _literal_runs(f: OutputFile) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of the file's literal bytes (headers, pickles), adjacent ones joined."""
    run: list[bytes] = []
    start = at = 0
    for seg in f.segments:
        if isinstance(seg, Piece):
            if run:
                yield start, b"".join(run)
                run = []
            at += seg.nbytes
            start = at
        else:
            run.append(seg)
            at += len(seg)
    if run:
        yield start, b"".join(run)


class _MemoryFile:
    """A file assembled whole in memory before it is encoded (``OutputFile.encode``)."""

    fd: int | None = None

    def __init__(self, size: int) -> None:
        self.buf = np.zeros(size, dtype=np.uint8)  # zeros: the tail a zarr edge chunk is padded with

    def write_at(self, offset: int, data: memoryview | bytes) -> None:
        view = np.frombuffer(data, dtype=np.uint8)
        self.buf[offset:offset + view.size] = view

    def written(self, offset: int, nbytes: int) -> None:
        pass


class _Stopped(Exception):
    """A job cut short because the run failed elsewhere (that error is the one raised)."""


@dataclass(frozen=True)
class _WholeFile:
    """A file written by one job, front to back: every file of a sink that uploads, and a
    file to be encoded whole. ``steps``: (offset, literal bytes, a gathered window or a
    piece), in file order, covering the file up to its zero tail."""

    file: OutputFile
    steps: list[tuple[int, bytes | gather.Window | Piece]]

    @property
    def relpath(self) -> str:
        return self.file.relpath


_Run = tuple[Path, int, int, int]  # (source file, offset there, offset in the output file, bytes)


@dataclass
class _KernelRuns:
    """Stored runs into the local file ``relpath`` for ``pieces`` pieces, as one job: their
    runs, and the file's lock (held for each write and kernel copy: one writer per file)."""

    relpath: str
    lock: threading.Lock
    runs: list[_Run] = field(default_factory=list)
    pieces: int = 0
    nbytes: int = 0

    def add(self, offset: int, copies: list[tuple[StoredRegion, int, int, int]]) -> None:
        """One piece at ``offset`` of the file, as ``Engine._kernel_plan`` gives its copies."""
        self.runs += [(region.path, src_off, offset + at, n) for region, src_off, at, n in copies]
        self.pieces += 1
        self.nbytes += sum(n for *_, n in copies)

    def merged(self) -> list[_Run]:
        """The runs in file order, each run that continues the previous one in both files (the
        next record of a source that lands right after it) joined to it: one copy."""
        out: list[_Run] = []
        for path, src, dst, n in sorted(self.runs, key=lambda run: run[2]):
            if out and out[-1][0] == path and out[-1][1] + out[-1][3] == src and out[-1][2] + out[-1][3] == dst:
                out[-1] = (path, out[-1][1], out[-1][2], out[-1][3] + n)
            else:
                out.append((path, src, dst, n))
        return out


@dataclass(frozen=True)
class _Buffered:
    """Runs read into a worker's buffer and written from it: ``reads`` (source file, offset
    there, offset in the buffer, bytes) and ``writes`` (offset in the output file, offset in
    the buffer, bytes), one write per stretch of the file the runs fill without a gap."""

    reads: list[tuple[Path, int, int, int]]
    writes: list[tuple[int, int, int]]
    nbytes: int


def _kernel_copies_well(src_off: int, dst_off: int, n: int) -> bool:
    """Whether the kernel copies this run: a run of ``_KERNEL_MIN`` or more whose offsets are
    page-aligned in both files. A file system that shares extents (XFS, btrfs) then clones
    it instead of copying, and on ext4 the kernel copies it page against page, about as fast
    as one worker reads and writes it (two overlapping their reads and writes are a third
    faster: numbers at ``_RUN_BUFFER``), with no memory. Smaller aligned runs join their
    neighbours' writes instead of a copy each."""
    return _kernel_copy_works and n >= _KERNEL_MIN and src_off % _PAGE == 0 and dst_off % _PAGE == 0


def _copy_steps(runs: list[_Run], buffer: int) -> Iterator[_Run | _Buffered]:
    """``runs`` (file order, as ``_KernelRuns.merged`` gives them) as the steps that copy them:
    a run the kernel copies well, alone, or runs gathered into a buffer of up to ``buffer``
    bytes (a run longer than what is left is split across buffers). ``buffer`` 0: every run
    is a kernel copy."""
    reads: list[tuple[Path, int, int, int]] = []
    writes: list[tuple[int, int, int]] = []
    used = 0
    for path, src, dst, n in runs:
        if not buffer or _kernel_copies_well(src, dst, n):
            if reads:
                yield _Buffered(reads, writes, used)
                reads, writes, used = [], [], 0
            yield path, src, dst, n
            continue
        while n:
            take = min(n, buffer - used)
            reads.append((path, src, used, take))
            if writes and writes[-1][0] + writes[-1][2] == dst:
                writes[-1] = (writes[-1][0], writes[-1][1], writes[-1][2] + take)
            else:
                writes.append((dst, used, take))
            used, src, dst, n = used + take, src + take, dst + take, n - take
            if used == buffer:
                yield _Buffered(reads, writes, used)
                reads, writes, used = [], [], 0
    if reads:
        yield _Buffered(reads, writes, used)


Job = gather.Window | _RowGroup | tuple[str, int, Piece] | _WholeFile | _KernelRuns


def _digest(sink: Sink, relpath: str) -> FileDigest:
    path = sink.local_path(relpath)
    assert path is not None  # digests are asked of local files only
    return file_digest(path)


def _relpaths(job: Job) -> list[str]:
    """The file of each piece (or window, or whole file) of ``job``: what it leaves to do in
    each file is counted in these."""
    if isinstance(job, _RowGroup):
        return [rel for rel, _, _ in job.items]
    if isinstance(job, _KernelRuns):
        return [job.relpath] * job.pieces
    return [job[0] if isinstance(job, tuple) else job.relpath]


class _Scratch(threading.local):
    """One buffer per worker thread that slabs are assembled in, reused from slab to slab.

    A fresh buffer per slab is fresh pages: above glibc's mmap threshold (which the CLI keeps
    low, so freed slabs go back to the system) each one is mapped, faulted in and zeroed by
    the kernel, then unmapped, which measured as much time as the copy itself. A worker holds
    at most one slab at a time, so keeping it costs no memory beyond the budget."""

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.uint8)

    def take(self, nbytes: int) -> np.ndarray:
        if self.buf.size < nbytes:
            self.buf = np.empty(0, dtype=np.uint8)  # let the old one go before the new one
            self.buf = np.empty(nbytes, dtype=np.uint8)
        return self.buf[:nbytes]


def _import_torch() -> None:
    import torch  # noqa: F401


_ZERO_STEP = 8 << 20  # zeros written to an upload per write
_DECODE_COPIES = 3  # compressed bytes, decoded chunk, and the kept copy slabs are cut from
# A worker's share of the budget for a window of gathered runs (``reshard.pipeline.gather``): the
# window, what is read for it (twice the window: tiny pieces lie a little apart in their
# files) and the copy of one length class on its way into place (at most the window). Past a
# few MiB a larger write gains nothing.
_WINDOW_SHARE = 4
_WINDOW_MAX = 8 << 20
_JOBS_IN_FLIGHT = 4  # per worker: enough queued that no worker waits for the next job
# Stored runs into one file gathered into one job (``_KernelRuns``) up to this many bytes: the
# first copy starts after a few dozen pieces located.
_KERNEL_BATCH = 64 << 20
# A worker's buffer for stored runs (``_copy_steps``), at most its share of the budget; below
# ``_RUN_BUFFER_MIN`` of a share the runs are all kernel copies, which need no memory. Measured
# on the 2-core VM (2026-11-28, medians of 6 alternating runs): the 900 runs of the benchmark's
# DCP -> safetensors (1.5 GB, 1 KiB to 10 MiB each, no offset page-aligned in either file)
# replayed into one file took 0.63 s by copy_file_range; read into a 4 MiB buffer and written
# (``sinks._WRITE_STEP`` at a time) 0.49 s on one thread and 0.35 s on two, one reading while
# the other writes (buffers of 2 and 8 MiB: 0.36 s). One 403 MB run: by the kernel 0.13 s
# page-aligned, 0.16 s not; read and written 0.12 s on one thread, 0.08-0.09 s on two.
_RUN_BUFFER = 4 << 20
_RUN_BUFFER_MIN = 64 << 10
# A run at least this large, page-aligned in both files, stays a kernel copy (``_kernel_copies_well``).
_KERNEL_MIN = 1 << 20
_PAGE = 4096


# An object store answers each request after tens of milliseconds whatever its size: reading
# one, a worker mostly waits, so more of them keep more requests in flight (the budget is
# shared out among them as for local reads).
REMOTE_WORKERS = 16


def _in_order(jobs: list[Job], order: dict[str, int] | None) -> list[Job]:
    """With ``order`` (hashing as files finish), ``jobs`` file by file, whole files and
    windows first in each; else as they are."""
    if order is None:
        return jobs
    return sorted(jobs, key=lambda job: (order[_relpaths(job)[0]], not isinstance(job, (gather.Window, _WholeFile))))


def _schedule(jobs: Iterable[Job], workers: int, do: Callable[[Job], None], stop: threading.Event, where: str) -> None:
    """Every job done by ``workers`` threads: the one loop behind every output (local files,
    uploads, zarr stores). A bounded window of jobs is in flight: a future per piece up front
    costs about 2 KiB each, gigabytes for a checkpoint of 100k tensors on many ranks. The
    first error stops the rest (``stop``: workers check it between slabs) and is raised; a
    write error without a file name names ``where``."""
    with ThreadPoolExecutor(workers) as pool:
        pending: deque[Future] = deque()
        try:
            for job in jobs:
                if len(pending) >= _JOBS_IN_FLIGHT * workers:
                    pending.popleft().result()
                pending.append(pool.submit(do, job))
            while pending:
                pending.popleft().result()
        except OSError as e:
            stop.set()
            pool.shutdown(cancel_futures=True)
            if e.filename is None and e.errno is not None:  # a full disk or I/O error on write: say where
                raise OSError(e.errno, e.strerror, where) from e
            raise
        except BaseException:  # Ctrl-C lands here: workers stop at their next slab
            stop.set()
            pool.shutdown(cancel_futures=True)
            raise


class Engine:
    """Executes a plan under ``max_memory``, writing through a sink (``reshard.pipeline.sinks``)."""

    def __init__(self, max_memory: int, *, workers: int | None = None, progress: bool = True,
                 desc: str = "writing", fsync: bool = False, reads: FdPool | None = None) -> None:
        self.max_memory = max_memory
        self.fsync = fsync
        self.reads = reads  # the caller's read descriptors (planning opened the sources through them), else our own
        # A worker per core, up to 4: measured on 2 cores (docs/benchmarks.md, 2026-11-28), 2
        # workers were 11-13% faster than 1 writing several files, and a quarter faster writing
        # one file's stored runs through their buffers (one reads while the other writes); 3 and
        # 4 gained nothing over 2.
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        self._workers_given = workers is not None
        self.show_progress = progress
        self.desc = desc
        self._stop = threading.Event()
        self._active_workers, self._slab_memory = self.workers, max_memory
        self._run_buffer = 0  # a worker's buffer for stored runs (``_copy_steps``), set by ``run``
        self._scratch = _Scratch()
        self._torch_ready = False

    def _import_torch_for(self, dtype: DType, sources: list[Source], bar: Progress) -> None:
        """torch imported before the first piece that needs it (a cast, a computed source), as
        start-up: seconds on a loaded machine that the progress rate must not count as work."""
        if self._torch_ready or moves_bytes(dtype, sources):
            return
        with bar.starting_up():
            _import_torch()
        self._torch_ready = True

    def _workers_for(self, plan: Plan, sink: Sink) -> tuple[int, int]:
        """(workers, memory for their slabs): one rule for every sink.

        An object store answers each request after tens of milliseconds, so a source or an
        output behind one gets ``REMOTE_WORKERS`` (unless workers were given); an upload is
        written by one worker, so never more workers than files. Where source chunks must be
        decoded whole (compressed zarr), each worker may hold one: its compressed bytes, the
        decoded chunk and the copy it is cut from, ``_DECODE_COPIES`` times the chunk, set
        aside before slabs are sized; a chunk that leaves its worker less than that
        (``_DECODE_COPIES + 1`` chunks in all) is refused, naming the budget it needs. A file
        encoded whole (``OutputFile.encode``) takes itself and its encoded form per worker,
        beside a slab as large."""
        workers, memory = self.workers, self.max_memory
        if (plan.remote or sink.remote) and not self._workers_given:
            workers = max(workers, REMOTE_WORKERS)
        if not sink.random_access:
            workers = max(1, min(workers, len(plan.files)))
        whole = plan.decoded_chunk_bytes
        if whole:
            need = (_DECODE_COPIES + 1) * whole
            if need > memory:
                raise UsageError(f"the source has compressed chunks of {format_size(whole)}, each decoded whole; that "
                                 f"needs {option('--max-memory ', 'max_memory=')}{-(-need // (1 << 20))}MiB or more "
                                 f"(it is {format_size(memory)})")
            workers = max(1, min(workers, memory // need))
            memory -= workers * _DECODE_COPIES * whole
        encoded = max((f.size for f in plan.files if f.encode is not None), default=0)
        if encoded:
            workers = max(1, min(workers, memory // (3 * encoded)))
            memory = max(memory - workers * 2 * encoded, encoded)
        return workers, memory

    def _slab_bytes(self, piece: Piece, sources: list[Source]) -> int:
        src_item = max(((r.dtype.itemsize if (r := as_region(s.chunk.data)) is not None else 8) for s in sources),
                       default=8)
        item = piece.dtype.itemsize
        # Per slab a worker holds the slab, plus source reads of up to twice its element count.
        elems = self._slab_memory // (self._active_workers * (item + 2 * src_item))
        return max(item, elems * item)

    def _kernel_plan(self, piece: Piece, sources: list[Source]) -> list[tuple[StoredRegion, int, int, int]] | None:
        """(region, source offset, offset in piece, length) per source, if all can be kernel-copied."""
        out = []
        for s in sources:
            data = as_region(s.chunk.data)
            if data is None or data.dtype != piece.dtype or isinstance(data.path, RemotePath):
                return None  # a remote source is read in ranges, not kernel-copied
            src = data.byte_range(s.box.shifted(s.chunk.box.offsets))
            dst = contiguous_range(s.box.shifted(piece.box.offsets), piece.box.sizes)
            if src is None or dst is None:
                return None
            out.append((data, src[0], dst[0] * piece.dtype.itemsize, src[1]))
        return out

    def _copy_piece(self, out: SinkFile, offset: int, piece: Piece, sources: list[Source], fds: FdPool,
                    stats: EngineStats, bar: Progress) -> None:
        """``piece`` into ``out`` at ``offset``, slab by slab in this worker's scratch (kernel
        copies are ``_KernelRuns`` jobs)."""
        self._import_torch_for(piece.dtype, sources, bar)
        at = offset
        slab_bytes = self._slab_bytes(piece, sources)
        scratch = self._scratch.take(slab_bytes)
        for slab in c_order_slabs(piece.box, piece.dtype.itemsize, slab_bytes):
            if self._stop.is_set():  # the run failed or was interrupted: no point finishing this piece
                return
            parts = [s for s in sources if s.box.intersect(slab) is not None]
            data = as_bytes(contiguous_in(assemble_any(slab, piece.dtype, parts, fds, scratch), scratch))
            out.write_at(at, data)
            at += data.nbytes
            stats.add(buffered=data.nbytes)
            bar.update(data.nbytes)
        out.written(offset, piece.nbytes)

    def _copy_runs(self, job: _KernelRuns, sink: Sink, fds: FdPool, stats: EngineStats, bar: Progress) -> None:
        """A ``_KernelRuns`` job, step by step (``_copy_steps``): a run the kernel copies well
        by the kernel; the others read into this worker's buffer, then written. The file's
        lock is held for each write and kernel copy, not for the reads, so one worker reads
        while another writes."""
        with sink.file(job.relpath) as out:
            assert out.fd is not None  # a random-access sink's files are local
            for step in _copy_steps(job.merged(), self._run_buffer):
                if self._stop.is_set():
                    return
                if isinstance(step, _Buffered):
                    # the ignore: numpy's stubs give an ndarray the buffer protocol on Python 3.12+ only
                    buf = memoryview(self._scratch.take(step.nbytes))  # type: ignore[arg-type]
                    for path, src_off, at, n in step.reads:
                        with fds.use(path) as src_fd:
                            read_into(src_fd, buf[at:at + n], src_off, path)
                    with job.lock:
                        for dst_off, at, n in step.writes:
                            out.write_at(dst_off, buf[at:at + n])
                    for dst_off, _, n in step.writes:
                        out.written(dst_off, n)
                    stats.add(kernel=step.nbytes, run_buffer=step.nbytes)
                    bar.update(step.nbytes)
                    continue
                path, src_off, dst_off, n = step
                with job.lock, fds.use(path) as src_fd:
                    _kernel_copy(src_fd, src_off, out.fd, dst_off, n, path)
                out.written(dst_off, n)
                stats.add(kernel=n)
                bar.update(n)

    def _kernel_jobs(self, jobs: Iterable[Job], plan: Plan) -> Iterator[Job]:
        """``jobs`` in their order, each piece's sources located here (in the scheduling thread,
        while the workers copy what came before); pieces the kernel can copy leave as
        ``_KernelRuns``, consecutive ones into the same file together, up to ``_KERNEL_BATCH``
        bytes."""
        locks: dict[str, threading.Lock] = {}
        batch: _KernelRuns | None = None
        for job in jobs:
            copies = self._kernel_plan(job[2], plan.sources[job[2]]) if isinstance(job, tuple) else None
            if batch is not None and (copies is None or _relpaths(job)[0] != batch.relpath
                                      or batch.nbytes >= _KERNEL_BATCH):
                yield batch
                batch = None
            if copies is None or not isinstance(job, tuple):
                yield job
                continue
            rel, offset, _ = job
            if batch is None:
                batch = _KernelRuns(rel, locks.setdefault(rel, threading.Lock()))
            batch.add(offset, copies)
        if batch is not None:
            yield batch

    def _jobs(self, work: list[tuple[str, int, Piece]], plan: Plan) -> list[_RowGroup | tuple[str, int, Piece]]:
        """``work`` as jobs, in its order: one piece each, except pieces of one tensor that
        share their rows and differ in later dims (the column shards of a ``Shard(1)`` or TP
        plan, replicas in several files), which become one job reading the rows of their
        bounding box once. Alone, each of k column shards reads whole rows of a row-major
        source for its 1/k of the columns: k times the bytes. Pieces the kernel copies, and
        groups whose bounding box is mostly gaps or too wide for a slab, stay alone."""
        rows: dict[tuple, list[tuple[str, int, Piece]]] = {}
        for item in work:
            box = item[2].box
            # Only a piece narrower than its tensor past dim 0 can share its rows with another.
            if box.ndim >= 2 and box.numel and box.sizes[1:] != plan.sources.shape_of(item[2].name)[1:]:
                rows.setdefault((item[2].name, item[2].dtype, box.offsets[0], box.sizes[0]), []).append(item)
        grouped: dict[int, _RowGroup] = {}  # id(piece) -> its group, when grouped
        for items in rows.values():
            if len(items) < 2:  # most pieces: nothing shares their rows, so no source is located here
                continue
            items = [it for it in items if self._kernel_plan(it[2], plan.sources[it[2]]) is None]
            group = self._row_group(items, plan) if len(items) > 1 else None
            if group is not None:
                grouped.update({id(p): group for _, _, p in items})
        jobs: list[_RowGroup | tuple[str, int, Piece]] = []
        emitted: set[int] = set()
        for item in work:
            group = grouped.get(id(item[2]))
            if group is None:
                jobs.append(item)
            elif id(group) not in emitted:
                emitted.add(id(group))
                jobs.append(group)
        return jobs

    def _row_group(self, items: list[tuple[str, int, Piece]], plan: Plan) -> _RowGroup | None:
        """``items`` as one job, unless their bounding box is mostly gaps or a row of it is
        wider than half a slab."""
        pieces = [p for _, _, p in items]
        box = _bounding_box([p.box for p in pieces])
        sources = _merged_sources(pieces, plan, box)
        block_bytes = self._slab_bytes(pieces[0], sources) // 2
        row = math.prod(box.sizes[1:]) * pieces[0].dtype.itemsize
        if 2 * sum(p.box.numel for p in pieces) < box.numel or row > block_bytes:
            return None
        return _RowGroup(items, box, sources, block_bytes)

    def _fill_rows(self, group: _RowGroup, sink: Sink, fds: FdPool, stats: EngineStats, bar: Progress) -> None:
        """One job of ``_jobs``: the bounding box of its pieces assembled a block of rows at a
        time (half a slab, so the pieces' copies fit in the other half), and each piece's
        columns of the block written where those rows sit in its file."""
        items, sources = group.items, group.sources
        dtype = items[0][2].dtype
        self._import_torch_for(dtype, sources, bar)
        item = dtype.itemsize
        split = -(-group.block_bytes // 64) * 64  # aligned for any dtype's view
        scratch = self._scratch.take(split + group.block_bytes)
        rows, cols_buf = scratch[:split], scratch[split:]  # the block; a piece's part of it
        for block in c_order_slabs(group.box, item, group.block_bytes):
            if self._stop.is_set():
                return
            data = assemble_any(block, dtype, [s for s in sources if s.box.intersect(block) is not None], fds, rows)
            for rel, off, piece in items:
                cols = tuple(slice(o - b, o - b + n) for o, n, b in zip(piece.box.offsets[1:], piece.box.sizes[1:],
                                                                         block.offsets[1:]))
                part = as_bytes(contiguous_in(data[(slice(None),) + cols], cols_buf))
                row_bytes = math.prod(piece.box.sizes[1:]) * item
                with sink.file(rel) as out:
                    out.write_at(off + (block.offsets[0] - piece.box.offsets[0]) * row_bytes, part)
                stats.add(buffered=part.nbytes)
                bar.update(part.nbytes)
        for rel, off, piece in items:
            with sink.file(rel) as out:
                out.written(off, piece.nbytes)

    def _fill_window(self, window: gather.Window, gathered: Gathered, out: SinkFile, fds: FdPool, stats: EngineStats,
                     bar: Progress, window_bytes: int) -> None:
        """One window of a gathered file (``reshard.pipeline.gather``), in this worker's scratch."""
        if self._stop.is_set():
            return
        scratch = self._scratch.take(3 * window_bytes)
        offset, data = gather.assemble_window(window, gathered, fds, scratch, 2 * window_bytes)
        out.write_at(offset, as_bytes(data))
        out.written(offset, window.nbytes)
        stats.add(buffered=window.piece_bytes)
        bar.update(window.piece_bytes)

    def _write_whole(self, job: _WholeFile, sink: Sink, plan: Plan, fds: FdPool, stats: EngineStats, bar: Progress,
                     window_bytes: int) -> None:
        """A file front to back by this worker: streamed into an upload, or assembled in
        memory and encoded (``OutputFile.encode``) into any sink."""
        f = job.file
        with sink.file(f.relpath) as target:
            out = _MemoryFile(f.size) if f.encode is not None else target
            for offset, step in job.steps:
                if self._stop.is_set():  # leave by an exception, so an upload is discarded, not completed
                    raise _Stopped
                if isinstance(step, bytes):
                    out.write_at(offset, step)
                elif isinstance(step, gather.Window):
                    assert plan.gathered is not None  # windows come from it
                    self._fill_window(step, plan.gathered, out, fds, stats, bar, window_bytes)
                else:
                    self._copy_piece(out, offset, step, plan.sources[step], fds, stats, bar)
            if self._stop.is_set():
                raise _Stopped
            if isinstance(out, _MemoryFile):
                data = f.encode(as_bytes(out.buf)) if f.encode is not None else b""
                del out
                target.write_at(0, data)
                target.written(0, len(data))
            elif f.zero_tail and not sink.random_access:  # an upload's zero tail; a local file has it from its size
                at, end = f.size - f.zero_tail, f.size
                zeros = bytes(min(_ZERO_STEP, f.zero_tail))
                while at < end:
                    n = min(len(zeros), end - at)
                    target.write_at(at, memoryview(zeros)[:n])
                    at += n

    def _whole_files(self, files: list[OutputFile], work: list[tuple[str, int, Piece]], plan: Plan,
                     window_bytes: int) -> list[_WholeFile]:
        """``files`` as ``_WholeFile`` jobs: each one's literals, gathered windows and pieces
        (of ``work``) in file order."""
        steps: dict[str, list[tuple[int, bytes | gather.Window | Piece]]] = {f.relpath: [] for f in files}
        for rel, off, piece in work:
            if rel in steps:
                steps[rel].append((off, piece))
        gathered = plan.gathered.files if plan.gathered is not None else {}
        for f in files:
            mine = steps[f.relpath]
            if f.relpath in gathered:  # its windows write its literals too
                runs = gathered[f.relpath]
                mine += [(int(runs.dst[w.first]), w) for w in gather.windows(f.relpath, runs, window_bytes)]
            else:
                mine += list(_literal_runs(f))
            mine.sort(key=lambda step: step[0])
        return [_WholeFile(f, steps[f.relpath]) for f in files]

    def _fill(self, job: Job, sink: Sink, plan: Plan, fds: FdPool, stats: EngineStats, bar: Progress,
              window_bytes: int) -> None:
        """One job of ``run``, whatever its kind."""
        if isinstance(job, _WholeFile):
            self._write_whole(job, sink, plan, fds, stats, bar, window_bytes)
        elif isinstance(job, _KernelRuns):
            self._copy_runs(job, sink, fds, stats, bar)
        elif isinstance(job, gather.Window):
            assert plan.gathered is not None  # windows come from it
            with sink.file(job.relpath) as target:
                self._fill_window(job, plan.gathered, target, fds, stats, bar, window_bytes)
        elif isinstance(job, _RowGroup):
            self._fill_rows(job, sink, fds, stats, bar)
        else:
            rel, off, piece = job
            with sink.file(rel) as target:
                self._copy_piece(target, off, piece, plan.sources[piece], fds, stats, bar)

    @without_gc  # a chunk located per piece makes objects by the hundred thousand (reshard/core/gc_pause.py)
    def run(self, plan: Plan, out: Sink | Path, output_is_dir: bool = True, *, digests: bool = False) -> EngineStats:
        """Write every file of ``plan`` through ``out``: a sink (``reshard.pipeline.sinks``), or a
        local path (a folder with ``output_is_dir``, else the file itself).

        ``digests``: also hash every file of a local folder for the manifest, each as soon as
        its last piece is written, while it is in the page cache and while later files are
        still being copied (the pieces then go file by file instead of biggest first)."""
        sink = out if not isinstance(out, Path) else FolderSink(out, output_is_dir, fsync=self.fsync)
        workers, self._slab_memory = self._workers_for(plan, sink)
        self._active_workers = workers
        # In the worker's scratch, within its share of the budget (as its slabs are).
        share = self._slab_memory // workers
        self._run_buffer = min(_RUN_BUFFER, share) if share >= _RUN_BUFFER_MIN else 0
        stats, fds = EngineStats(), self.reads or FdPool(os.O_RDONLY)
        digests = digests and sink.is_dir and sink.random_access
        hashing = ThreadPoolExecutor(self.workers) if digests else None
        hashed: dict[str, Future] = {}
        bar = Progress(plan.total_bytes, self.desc, enabled=self.show_progress)
        try:
            gathered = plan.gathered.files if plan.gathered is not None else {}
            work = [(f.relpath, off, p) for f, off, p in plan.pieces(gathered=False)]
            order = {f.relpath: i for i, f in enumerate(plan.files)}
            window_bytes = max(1 << 16, min(_WINDOW_MAX, self._slab_memory // (workers * _WINDOW_SHARE)))
            whole = [f for f in plan.files if f.encode is not None or not sink.random_access]
            files = sorted(self._whole_files(whole, work, plan, window_bytes), key=lambda job: -job.file.size)
            jobs: list[Job] = list(files)
            sink.prepare([(f.relpath, 0 if f.encode is not None else f.size) for f in plan.files])
            if sink.random_access:  # every other file: literals now, pieces and windows in any order
                whole_paths = {f.relpath for f in whole}
                for f in plan.files:
                    if f.relpath not in whole_paths and f.relpath not in gathered:
                        with sink.file(f.relpath) as target:
                            for offset, data in _literal_runs(f):
                                target.write_at(offset, data)
                work = [w for w in work if w[0] not in whole_paths]
                if digests:
                    work.sort(key=lambda w: (order[w[0]], -w[2].nbytes))
                else:  # big pieces first, so the pool does not end on one long tail
                    work.sort(key=lambda w: -w[2].nbytes)
                jobs += [w for rel, runs in gathered.items() if rel not in whole_paths
                         for w in gather.windows(rel, runs, window_bytes)]
                with fds.lending():  # locating the chunks of pieces that may share their rows
                    jobs += self._jobs(work, plan)
            left = Counter(rel for job in jobs for rel in _relpaths(job))  # pieces to do, per file
            lock = threading.Lock()

            def fill(job: Job) -> None:
                with fds.lending():
                    self._fill(job, sink, plan, fds, stats, bar, window_bytes)
                if hashing is not None:  # digests asked for
                    with lock:
                        for rel in _relpaths(job):
                            left[rel] -= 1
                            if left[rel] == 0:
                                hashed[rel] = hashing.submit(_digest, sink, rel)

            if hashing is not None:  # files of literal bytes only are complete already
                hashed.update({f.relpath: hashing.submit(_digest, sink, f.relpath)
                               for f in plan.files if not left[f.relpath]})
            with fds.lending():  # the kernel copies' sources are located as jobs are handed out
                _schedule(self._kernel_jobs(_in_order(jobs, order if digests else None), plan), workers, fill,
                          self._stop, str(sink.where))
            stats.digests = {rel: fut.result() for rel, fut in hashed.items()}
            sink.sync()
        finally:
            if hashing is not None:
                hashing.shutdown(cancel_futures=True)
            bar.close()
            if fds is not self.reads:  # the caller closes its own when its call ends
                fds.close()
            sink.close()
        return stats
