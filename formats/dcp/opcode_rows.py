"""Pickle opcodes for many entries of one shape, assembled with array operations.

``.metadata`` of a mesh layout has one storage entry per chunk, hundreds of thousands of
them, each the same opcodes around a few values (a memo reference, a chunk's offsets, a
record's offset and length). Written one by one in Python they cost more than the rest of
the conversion. Here an entry is a row of byte slots, each slot a pick from a table of byte
strings (or an integer's opcode); rows are laid end to end and every slot of every row is
copied into place by ``columns.copy_runs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reshard.core.columns import copy_runs

__all__ = ["Slot", "table_slot", "int_slot", "join_rows"]

_INT_WIDTH = 10  # the longest integer opcode written here: LONG1, its length byte and 8 bytes


@dataclass(frozen=True)
class Slot:
    """One slot of every row: ``length[i]`` bytes from ``pool[at[i]:]`` (0: the row has none)."""

    pool: np.ndarray
    at: np.ndarray
    length: np.ndarray


def table_slot(table: list[bytes], pick: np.ndarray) -> Slot:
    """Each row's ``table[pick[i]]`` (``pick[i] == -1``: nothing)."""
    lengths = np.array([len(b) for b in table] + [0], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.int64)
    pool = np.frombuffer(b"".join(table), dtype=np.uint8)
    return Slot(pool, starts[pick], lengths[pick])


def int_slot(values: np.ndarray) -> Slot:
    """Each row's integer as the pickler writes it: BININT1 (K), BININT2 (M), BININT (J) or LONG1."""
    v = values.astype(np.int64)
    n = len(v)
    codes = np.zeros((n, _INT_WIDTH), dtype=np.uint8)
    raw = v.astype("<i8").view(np.uint8).reshape(n, 8)
    length = np.empty(n, dtype=np.int64)
    small, short = (v >= 0) & (v < 256), (v >= 256) & (v < 65536)
    word = ~small & ~short & (v >= -(2**31)) & (v < 2**31)
    big = ~(small | short | word)
    codes[small, 0], codes[small, 1], length[small] = ord("K"), raw[small, 0], 2
    codes[short, 0], codes[short, 1:3], length[short] = ord("M"), raw[short, :2], 3
    codes[word, 0], codes[word, 1:5], length[word] = ord("J"), raw[word, :4], 5
    if big.any():  # as the pickler's LONG1: the fewest two's-complement bytes that hold the value
        k = np.full(n, 8, dtype=np.int64)
        for width in range(7, 4, -1):
            fits = (v >= -(2 ** (8 * width - 1))) & (v < 2 ** (8 * width - 1))
            k[fits] = width
        codes[big, 0], codes[big, 1] = 0x8A, k[big]
        codes[big, 2:10] = raw[big]
        length[big] = 2 + k[big]
    return Slot(codes.reshape(-1), np.arange(n, dtype=np.int64) * _INT_WIDTH, length)


def join_rows(slots: list[Slot]) -> bytes:
    """Every row's slots in order, rows end to end."""
    lengths = np.stack([s.length for s in slots], axis=1)
    flat = lengths.reshape(-1)
    dst = (np.cumsum(flat) - flat).reshape(lengths.shape)
    out = np.empty(int(flat.sum()), dtype=np.uint8)
    for i, s in enumerate(slots):
        copy_runs(out, dst[:, i], s.pool, s.at, s.length)
    return out.tobytes()
