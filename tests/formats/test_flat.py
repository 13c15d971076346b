"""A run of a tensor's flat elements as boxes: every element once, each box one contiguous run
of the flat order, and the stored bytes behind each box exactly that run of the file."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from reshard.formats.deepspeed.flat import FlatBuffer, flat_boxes, fragment_chunks

from reshard.core.boxes import Box, contiguous_range, tiles_exactly
from reshard.core.catalog import TensorEntry
from reshard.core.chunk_reads import read_box
from reshard.core.errors import CorruptCheckpointError
from reshard.core.regions import StoredRegion


def _flat_indices(shape: tuple[int, ...], box: Box) -> list[int]:
    grid = torch.arange(max(1, math.prod(shape))).reshape(shape) if shape else torch.tensor(0)
    return grid[box.as_slices()].reshape(-1).tolist() if shape else [0]


@pytest.mark.parametrize("shape", [(), (7,), (5, 3), (4, 3, 5), (2, 3, 1, 4), (3, 0, 2), (1, 1, 6)])
def test_flat_boxes_cover_a_run_once_in_flat_order(shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    rng = random.Random(0)
    ranges = {(0, n), (0, 0), (n, n)} | {tuple(sorted((rng.randint(0, n), rng.randint(0, n)))) for _ in range(40)}
    for start, stop in sorted(ranges):
        pieces = list(flat_boxes(shape, start, stop))
        seen = []
        for box, first in pieces:
            run = contiguous_range(box, shape)
            assert run is not None and run[1] == box.numel, (shape, start, stop, box)  # one run of the file
            assert _flat_indices(shape, box) == list(range(first, first + box.numel))
            seen += _flat_indices(shape, box)
        assert seen == list(range(start, stop)), (shape, start, stop)
        assert len(pieces) <= max(1, 2 * len(shape) - 1)
    if n:
        assert tiles_exactly(shape, [b for b, _ in flat_boxes(shape, 0, n)]) is None
    with pytest.raises(ValueError):
        list(flat_boxes(shape, 0, n + 1))


def _stored(tmp_path: Path, values: torch.Tensor, name: str) -> StoredRegion:
    path = tmp_path / name
    pad = b"\x07" * 12  # the run does not start at byte 0, as inside a torch.save archive
    path.write_bytes(pad + values.numpy().tobytes())
    return StoredRegion(path, len(pad), values.dtype, tuple(values.shape))


def test_fragments_of_a_flat_buffer_read_back_exactly(tmp_path: Path) -> None:
    """Two ranks' buffers, each of two parts (ZeRO sub-groups), holding a [6, 5] tensor's
    elements 0..17 and 18..29 from arbitrary buffer positions: the chunks are plain stored
    regions, and reading the tensor through them gives it back bit for bit."""
    full = torch.randn(6, 5)
    flat = full.reshape(-1)
    a = torch.cat([torch.zeros(3), flat[:10]])
    b = torch.cat([flat[10:18], torch.zeros(2)])
    c = torch.cat([torch.zeros(4), flat[18:]])
    rank0 = FlatBuffer((_stored(tmp_path, a, "a"), _stored(tmp_path, b, "b")), "rank0")
    rank1 = FlatBuffer((_stored(tmp_path, c, "c"),), "rank1")
    chunks = fragment_chunks((6, 5), 0, 18, rank0, 3) + fragment_chunks((6, 5), 18, 30, rank1, 4)
    assert all(isinstance(ch.data, StoredRegion) for ch in chunks)
    assert tiles_exactly((6, 5), [ch.box for ch in chunks]) is None
    entry = TensorEntry("w", (6, 5), torch.float32, chunks)
    assert torch.equal(read_box(entry, Box((0, 0), (6, 5))), full)
    assert torch.equal(read_box(entry, Box((1, 2), (4, 2))), full[1:5, 2:4])
    with pytest.raises(CorruptCheckpointError, match="rank1: needs elements"):
        fragment_chunks((6, 5), 18, 30, rank1, 5)  # one element past the end: a truncated partition
