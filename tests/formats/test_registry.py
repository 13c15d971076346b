from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reshard.formats.registry import detect_format, format_for_destination, get_format
from safetensors.torch import save_file

from reshard.core.errors import CheckpointNotFoundError, UnsupportedFormatError, UsageError


def test_detects_each_format(fsdp2_dcp, tmp_path: Path) -> None:
    assert detect_format(fsdp2_dcp[0]).name == "dcp"
    save_file({"w": torch.zeros(2)}, tmp_path / "m.safetensors")
    assert detect_format(tmp_path / "m.safetensors").name == "safetensors"
    torch.save({"w": torch.zeros(2)}, tmp_path / "m.pt")
    assert detect_format(tmp_path / "m.pt").name == "torch"
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UnsupportedFormatError, match="notes.txt"):
        detect_format(tmp_path / "notes.txt")
    with pytest.raises(CheckpointNotFoundError):
        detect_format(tmp_path / "absent")


def test_destination_suffixes_and_names() -> None:
    assert [format_for_destination(Path(p)) for p in ("a.safetensors", "a.pt", "a.bin", "a.zarr", "out")] == [
        "safetensors", "torch", "torch", "zarr", "dcp"]
    with pytest.raises(UsageError, match="unknown format"):
        get_format("onnx")
