"""Writing an output file's byte runs (``byte_runs.FileRuns``) a window at a time.

A window is a span of adjacent runs of one file: its literal bytes come from the plan's pool,
its pieces' bytes from their source files, each source read in as few spans as the memory
allows (the runs of tiny pieces lie close together in their files, so one read usually holds
hundreds), then the window is written with one write. Runs are copied into place by
length class, each class in one array operation: no Python per piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reshard.core.columns import copy_runs
from reshard.core.fd_pool import FdPool
from reshard.core.regions import read_into
from reshard.pipeline.byte_runs import FileRuns, Gathered

__all__ = ["Window", "windows", "assemble_window"]

_ALWAYS_SPLIT = 1 << 16  # a hole this large between two runs of a source is never read through


@dataclass(frozen=True)
class Window:
    """Runs ``[first, end)`` of the file ``relpath``, written as one buffer."""

    relpath: str
    first: int
    end: int
    nbytes: int  # the window's size in the file
    piece_bytes: int  # bytes of pieces in it


def windows(relpath: str, runs: FileRuns, limit: int) -> list[Window]:
    """``runs`` cut into windows of adjacent runs of about ``limit`` bytes (more where one run
    is larger)."""
    if not len(runs.dst):
        return []
    end = runs.dst + runs.length
    hole = np.r_[True, runs.dst[1:] != end[:-1]]
    region = np.cumsum(hole) - 1
    region_start = runs.dst[hole][region]
    block = (runs.dst - region_start) // max(1, limit)
    cut = np.flatnonzero(hole | np.r_[True, block[1:] != block[:-1]])
    bounds = np.r_[cut, len(runs.dst)]
    piece = np.where(runs.src >= 0, runs.length, 0)
    piece_sums = np.add.reduceat(piece, cut)
    out = []
    for (a, b), n in zip(zip(bounds[:-1].tolist(), bounds[1:].tolist()), piece_sums.tolist()):
        out.append(Window(relpath, a, b, int(end[b - 1] - runs.dst[a]), int(n)))
    return out


def assemble_window(window: Window, gathered: Gathered, fds: FdPool, scratch: np.ndarray, read_limit: int
                    ) -> tuple[int, np.ndarray]:
    """``window`` assembled in ``scratch`` (uint8: the window, then what is read for it, up to
    ``read_limit`` bytes; fresh memory past that): its offset in the file and its bytes."""
    runs = gathered.files[window.relpath]
    a, b = window.first, window.end
    start = int(runs.dst[a])
    out = scratch[:window.nbytes] if len(scratch) >= window.nbytes else np.empty(window.nbytes, dtype=np.uint8)
    spare = scratch[window.nbytes:]
    dst = runs.dst[a:b] - start
    src, src_off, length = runs.src[a:b], runs.src_off[a:b], runs.length[a:b]
    literal = src < 0
    copy_runs(out, dst[literal], gathered.pool, src_off[literal], length[literal])
    for f in np.unique(src[~literal]).tolist():
        mine = src == f
        path = gathered.paths[f]
        with fds.use(path) as src_fd:
            data, at = _read_spans(src_fd, path, src_off[mine], length[mine], read_limit, spare)
        copy_runs(out, dst[mine], data, at, length[mine])
    return start, out


def _read_spans(fd: int, path: Path, offsets: np.ndarray, lengths: np.ndarray, limit: int, into: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """Bytes holding every run ``[offsets[i], offsets[i] + lengths[i])`` of one source file,
    read in spans (runs whose holes are small read as one) into ``into`` where they fit, and
    where each run is in them. The spans hold at most ``limit`` bytes, or the runs themselves
    where they need more."""
    order = np.argsort(offsets, kind="stable")
    lo, hi = offsets[order], offsets[order] + lengths[order]
    reach = np.maximum.accumulate(hi)
    holes = np.r_[lo[1:] - reach[:-1], 0]  # after each run, before the next (<= 0: they touch or overlap)
    split = holes > _ALWAYS_SPLIT
    total = int(reach[-1] - lo[0] - holes[split].sum())
    if total > limit:  # leave out the largest holes until the spans fit
        rest = np.flatnonzero(~split & (holes > 0))
        by_size = rest[np.argsort(-holes[rest], kind="stable")]
        need = np.searchsorted(np.cumsum(holes[by_size]), total - limit) + 1
        split[by_size[:need]] = True
    first = np.r_[0, np.flatnonzero(split[:-1]) + 1]
    last = np.r_[first[1:], len(lo)] - 1
    span_lo, span_hi = lo[first], reach[last]
    at_span = np.r_[0, np.cumsum(span_hi - span_lo)]
    size = int(at_span[-1])
    data = into[:size] if len(into) >= size else np.empty(size, dtype=np.uint8)
    view = memoryview(data)  # type: ignore[arg-type]  # numpy's stubs give an ndarray the buffer protocol on Python 3.12+ only
    for s, e, where in zip(span_lo.tolist(), span_hi.tolist(), at_span[:-1].tolist()):
        read_into(fd, view[where:where + e - s], s, path)
    span_of = np.repeat(np.arange(len(first)), last - first + 1)
    at = np.empty(len(offsets), dtype=np.int64)
    at[order] = at_span[span_of] + (lo - span_lo[span_of])
    return data, at
