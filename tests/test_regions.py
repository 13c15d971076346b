from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reshard.boxes import Box
from reshard.errors import CorruptCheckpointError
from reshard.regions import StoredRegion


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
