"""Array helpers for planning in columns (``byte_runs``, the DCP writer and locator)."""

from __future__ import annotations

import numpy as np

__all__ = ["unique_rows", "ranges", "copy_runs"]

_FEW = 8  # fewer runs of one length than this are copied one by one

# Odd 64-bit multipliers: a row's hash is its values' wrapping dot product with them.
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x94D049BB133111EB, 0xBF58476D1CE4E5B9],
                dtype=np.uint64)


def unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, inverse) of the distinct rows of an integer ``[n, k]`` array, as
    ``np.unique(rows, axis=0, return_index=True, return_inverse=True)`` gives them up to the
    groups' order: ``rows[first[inverse]] == rows``. Rows are hashed to one integer and the
    groups checked row by row (a collision falls back to ``np.unique``): a sort of one column,
    not of ``k``."""
    n, k = rows.shape
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    mix = np.resize(_MIX, k) + np.arange(k, dtype=np.uint64) * np.uint64(2)
    h = (rows.astype(np.uint64) * mix).sum(axis=1, dtype=np.uint64)
    h ^= h >> np.uint64(29)
    _, first, inverse = np.unique(h, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    if not (rows[first[inverse]] == rows).all():
        _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
    return first.astype(np.int64), inverse.astype(np.int64)


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts)])``, without the loop."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - (ends - counts), counts)


def copy_runs(out: np.ndarray, dst: np.ndarray, src: np.ndarray, src_at: np.ndarray, lengths: np.ndarray) -> None:
    """``out[dst[i]:dst[i] + lengths[i]] = src[src_at[i]:src_at[i] + lengths[i]]`` for every i:
    runs of one length in one fancy-indexed copy of fixed-size windows of both arrays."""
    if not len(lengths):
        return
    if len(lengths) < _FEW:
        for d, s, n in zip(dst.tolist(), src_at.tolist(), lengths.tolist()):
            out[d:d + n] = src[s:s + n]
        return
    classes, which = np.unique(lengths, return_inverse=True)
    which = which.reshape(-1)
    for c, n in enumerate(classes.tolist()):
        sel = np.flatnonzero(which == c)
        if n == 0:
            continue
        if len(sel) < _FEW:
            for d, s in zip(dst[sel].tolist(), src_at[sel].tolist()):
                out[d:d + n] = src[s:s + n]
            continue
        target = np.lib.stride_tricks.sliding_window_view(out, n, writeable=True)
        sources, which_src = np.unique(src_at[sel], return_inverse=True)
        if len(sources) <= _FEW:  # the same bytes to many places (a header repeated per chunk): no gathered copy
            for k, at in enumerate(sources.tolist()):
                target[dst[sel[which_src.reshape(-1) == k]]] = src[at:at + n]
            continue
        target[dst[sel]] = np.lib.stride_tricks.sliding_window_view(src, n)[src_at[sel]]
