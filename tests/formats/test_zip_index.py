"""Our zip index agrees with zipfile on archives torch writes, and refuses broken ones."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest
import torch
from reshard.formats.torch.zip_index import ZipIndex

from reshard.core.errors import CorruptCheckpointError


def _index(path: Path, start: int = 0, length: int | None = None) -> ZipIndex:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        return ZipIndex(fd, start, size - start if length is None else length, str(path), path)
    finally:
        os.close(fd)


def test_matches_zipfile_on_torch_archives(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"a": torch.arange(5000.0), "b": torch.ones(3, dtype=torch.bfloat16), "n": 3}, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        index = ZipIndex(fd, 0, path.stat().st_size, str(path), path)
        with zipfile.ZipFile(path) as z:
            assert sorted(index.entries) == sorted(z.namelist())
            for info in z.infolist():
                entry = index.entries[info.filename]
                assert (entry.header_offset, entry.size) == (info.header_offset, info.file_size)
                assert index.read(entry) == z.read(info.filename)
    finally:
        os.close(fd)


def test_an_archive_inside_a_bigger_file(tmp_path: Path) -> None:
    buf = io.BytesIO()
    torch.save(torch.arange(10), buf)
    blob = buf.getvalue()
    path = tmp_path / "blobs"
    path.write_bytes(b"junk" * 100 + blob + b"tail")
    index = _index(path, 400, len(blob))
    assert any(n.endswith("data.pkl") for n in index.entries)


def test_broken_archives(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"a": torch.arange(100.0)}, path)
    data = path.read_bytes()
    for broken in (data[:-30], data[: len(data) // 2], b"PK\x03\x04" + b"\0" * 100, data.replace(b"PK\x01\x02", b"XX\x01\x02",
                                                                                                 1)):
        path.write_bytes(broken)
        with pytest.raises(CorruptCheckpointError):
            index = _index(path)
            for entry in index.entries.values():
                index.read(entry)
