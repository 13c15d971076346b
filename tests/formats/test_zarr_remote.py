"""Stores behind fsspec URLs: memory:// (an object store's semantics: no rename) and
file:// (a local folder), read and written end to end through ``reshard.convert``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import reshard
from reshard.core.errors import OutputExistsError, UsageError
from reshard.pipeline import sinks
from reshard.pipeline.replace import CLAIM_NAME, claim_bytes

zarr = pytest.importorskip("zarr")
fsspec = pytest.importorskip("fsspec")


@pytest.fixture
def src(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {"model.w": torch.randn(9, 4), "model.b": torch.arange(5), "h": torch.randn(3, 2).to(torch.bfloat16),
               "s": torch.tensor(1.5)}
    torch.save({**tensors, "step": 3}, tmp_path / "src.pt")
    return tmp_path / "src.pt", tensors


def test_memory_url_write_then_read(src, tmp_path: Path) -> None:
    path, tensors = src
    url = "memory://reshard-test/a.zarr"
    for compress in (False, True):  # chunks of at most 40 bytes: several, the edge ones padded
        r = reshard.convert(path, url, compress=compress, max_shard_size=40, overwrite=compress, quiet=True)
        assert r.dst == url and r.format == "zarr"
        fs = fsspec.filesystem("memory")
        meta = json.loads(fs.cat_file("/reshard-test/a.zarr/model.w/zarr.json"))
        assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [2, 4]
        assert [c["name"] for c in meta["codecs"]] == (["bytes", "zstd"] if compress else ["bytes"])
        # zarr-python reads the arrays of native dtypes straight from the URL
        assert np.array_equal(zarr.open_array(f"{url}/model.w", mode="r")[...], tensors["model.w"].numpy())
        catalog = reshard.formats.zarr.format.ZarrFormat().read(url)  # chunks fetched through fsspec
        assert catalog.objects == {"step": 3} and catalog.path == url
        back = tmp_path / f"back{int(compress)}.pt"
        reshard.convert(url, back, quiet=True)  # memory:// source -> local file
        loaded = torch.load(back, weights_only=True)
        assert loaded["step"] == 3
        for name, t in tensors.items():
            assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    with pytest.raises(OutputExistsError, match="overwrite=True"):
        reshard.convert(path, url, quiet=True)
    with pytest.raises(UsageError, match="not per-rank torch files"):  # no marker could say they are all there
        reshard.convert(path, "memory://reshard-test/b", to="torch", to_mesh="2", quiet=True)
    with pytest.raises(UsageError, match="explicit DST"):
        reshard.convert(url, quiet=True)


def test_unfinished_remote_write_is_no_store(src, monkeypatch) -> None:
    path, _ = src
    url = "memory://reshard-test/broken.zarr"
    real = sinks._Upload.write_at
    calls: list[str] = []

    def failing(upload, offset, data):
        if upload.url not in calls:
            calls.append(upload.url)
        if len(calls) == 2:
            raise OSError("connection reset")
        return real(upload, offset, data)

    monkeypatch.setattr(sinks._Upload, "write_at", failing)
    with pytest.raises(OSError, match="connection reset"):
        reshard.convert(path, url, max_shard_size=40, quiet=True)
    fs = fsspec.filesystem("memory")
    assert not fs.exists("/reshard-test/broken.zarr/zarr.json")  # readers see no store
    assert fs.find("/reshard-test/broken.zarr") == []  # what was put is deleted again
    with pytest.raises(reshard.ReshardError, match="no zarr.json at the root|no such file"):
        reshard.formats.zarr.format.ZarrFormat().read(url)
    monkeypatch.setattr(sinks._Upload, "write_at", real)
    # killed outright (no cleanup): a chunk without the root zarr.json is no store, and the next
    # write refuses it until overwrite, which clears what the killed write's claim names
    fs.pipe_file("/reshard-test/broken.zarr/model.w/c/0/0", b"x" * 8)
    fs.pipe_file(f"/reshard-test/broken.zarr/{CLAIM_NAME}", claim_bytes(["model.w/c/0/0"]))
    with pytest.raises(reshard.ReshardError, match="no zarr.json at the root"):
        reshard.formats.zarr.format.ZarrFormat().read(url)
    with pytest.raises(OutputExistsError, match="unfinished write"):
        reshard.convert(path, url, quiet=True)
    fs.pipe_file("/reshard-test/broken.zarr/model.w/c/0/1", b"x" * 8)  # not in the claim: not reshard's
    with pytest.raises(OutputExistsError, match=r"did not write \(model.w/c/0/1\)"):
        reshard.convert(path, url, overwrite=True, quiet=True)
    fs.rm_file("/reshard-test/broken.zarr/model.w/c/0/1")
    reshard.convert(path, url, overwrite=True, quiet=True)
    assert fs.exists("/reshard-test/broken.zarr/zarr.json")


def test_file_urls_are_local_folders(src, tmp_path: Path) -> None:
    path, tensors = src
    store = tmp_path / "f.zarr"
    reshard.convert(f"file://{path}", f"file://{store}", to_mesh="2", quiet=True)
    assert (store / "zarr.json").is_file() and not list(tmp_path.glob(".f.zarr.reshard-*"))  # staged, renamed
    assert json.loads((store / "model.w" / "zarr.json").read_text())["chunk_grid"]["configuration"]["chunk_shape"] == [5, 4]
    reshard.convert(f"file://{store}", "memory://reshard-test/f.zarr", overwrite=True, quiet=True)
    reshard.convert("memory://reshard-test/f.zarr", tmp_path / "back", to="dcp", quiet=True)
    assert reshard.verify(tmp_path / "back", path).equal
