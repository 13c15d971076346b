from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reshard.core import dtypes
from reshard.core.boxes import Box
from reshard.core.errors import CorruptCheckpointError
from reshard.core.regions import StoredRegion


def _store(tmp_path: Path, t: torch.Tensor, lead: int = 13) -> Path:
    p = tmp_path / "raw.bin"
    p.write_bytes(b"x" * lead + t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e5m2])
def test_reads_any_sub_box_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    t = (torch.randn(6, 5, 4) * 10).to(dtype)
    region = StoredRegion(_store(tmp_path, t), 13, dtype, (6, 5, 4))
    for box in [Box((0, 0, 0), (6, 5, 4)), Box((2, 0, 0), (3, 5, 4)), Box((1, 2, 1), (4, 2, 2)),
                Box((5, 4, 3), (1, 1, 1)), Box((0, 0, 3), (6, 5, 1))]:
        assert torch.equal(region.read(box).view(torch.uint8), t[box.as_slices()].contiguous().view(torch.uint8))


def test_strided_storage_as_torch_saves_views(tmp_path: Path) -> None:
    base = torch.arange(24.0).reshape(4, 6)
    view = base.t()  # shape (6, 4), strides (1, 6)
    region = StoredRegion(_store(tmp_path, base, lead=0), 0, torch.float32, (6, 4), (1, 6))
    assert not region.is_contiguous
    assert torch.equal(region.read(Box((1, 1), (4, 2))), view[1:5, 1:3])
    assert region.byte_range(Box((0, 0), (1, 4))) is None


def test_truncated_file_is_reported(tmp_path: Path) -> None:
    p = _store(tmp_path, torch.zeros(10))
    region = StoredRegion(p, 13, torch.float32, (20,))
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        region.read(Box((0,), (20,)))


@pytest.mark.parametrize("min_span", [1, 64, 1 << 16])
def test_sparse_boxes_are_read_in_bounded_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 min_span: int) -> None:
    """Column shards and corners of a row-major tensor, random in place and size, come back
    exact whether the read may span 1 byte (one run at a time), a few rows, or 64 KiB; and no
    single read spans more than the box allows, so a column shard costs a few row-band reads."""
    import reshard.core.regions as regions

    monkeypatch.setattr(regions, "_MIN_SPAN", min_span)
    reads: list[int] = []
    real_read = regions._read_array

    def counting(fd: int, size: int, offset: int, path: Path) -> torch.Tensor:
        reads.append(size)
        return real_read(fd, size, offset, path)

    monkeypatch.setattr(regions, "_read_array", counting)
    gen = torch.Generator().manual_seed(min_span)
    t = torch.randn(37, 29, 11, generator=gen)
    region = StoredRegion(_store(tmp_path, t), 13, torch.float32, tuple(t.shape))
    for _ in range(40):
        sizes = tuple(int(torch.randint(1, n + 1, (1,), generator=gen)) for n in t.shape)
        offs = tuple(int(torch.randint(0, n - s + 1, (1,), generator=gen)) for n, s in zip(t.shape, sizes))
        box = Box(offs, sizes)
        reads.clear()
        assert torch.equal(region.read(box), t[box.as_slices()]), box
        assert max(reads) <= max(2 * box.numel * 4, min_span, box.sizes[-1] * 4), (box, max(reads))


def test_parts_stored_as_one_run_are_read_where_they_belong(tmp_path: Path, monkeypatch) -> None:
    """``bytes_of_run`` offers the part of a host tensor a box is, when it is one run of
    memory of the stored dtype; the runtime's ``read_box`` (a send buffer, a CPU parameter)
    then reads rows straight into it, and copies only what cannot be (a column block)."""
    import reshard.core.regions as regions
    from reshard.core.catalog import Chunk, TensorEntry
    from reshard.core.regions import bytes_of_run
    from reshard.runtime.transfer import OpenFiles, read_box

    out = torch.zeros(4, 6)
    view = bytes_of_run(out, Box((1, 0), (2, 6)), dtypes.of(torch.float32))
    assert view is not None and view.data_ptr() == out[1].data_ptr() and view.numel() == 48
    assert bytes_of_run(out, Box((1, 2), (2, 3)), dtypes.of(torch.float32)) is None  # two runs
    assert bytes_of_run(out, Box((1, 0), (2, 6)), dtypes.of(torch.bfloat16)) is None  # another dtype
    assert bytes_of_run(out.t(), Box((0, 0), (6, 1)), dtypes.of(torch.float32)) is None  # not contiguous

    fresh: list[int] = []
    real_read = regions._read_array
    monkeypatch.setattr(regions, "_read_array", lambda fd, n, off, path: fresh.append(n) or real_read(fd, n, off, path))
    t = torch.randn(10, 6)
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    entry = TensorEntry("w", (10, 6), torch.float32, [
        Chunk(Box((0, 0), (4, 6)), StoredRegion(_store(first, t[:4]), 13, torch.float32, (4, 6))),
        Chunk(Box((4, 0), (6, 6)), StoredRegion(_store(second, t[4:]), 13, torch.float32, (6, 6)))])
    files = OpenFiles()
    try:
        rows = torch.full((5, 6), float("nan"))
        read_box(rows, Box((2, 0), (5, 6)), entry, files)  # rows 2-6: a run of each file
        assert torch.equal(rows, t[2:7]) and fresh == []
        cols = torch.full((5, 2), float("nan"))
        read_box(cols, Box((2, 1), (5, 2)), entry, files)  # a column block: read, then copied
        assert torch.equal(cols, t[2:7, 1:3]) and fresh
    finally:
        files.close()
