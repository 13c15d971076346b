"""One engine behind every output: local folders, object-store uploads and zarr stores (raw or
compressed) are scheduled by the same function and written through the sink interface
(``reshard.pipeline.sinks``), every byte of every data file accounted for there, and each output read
back by the outside library that reads its format."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import reshard
from reshard.pipeline import engine, sinks

fsspec = pytest.importorskip("fsspec")
zarr = pytest.importorskip("zarr")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Calls of the engine's scheduling function (with the sink each run wrote through) and the
    bytes each kind of sink file took, by file: ``write_at``, and kernel copies into a local
    sink file's descriptor."""
    seen: dict[str, Any] = {"schedules": [], "local": Counter(), "upload": Counter(), "sinks": []}
    real_schedule, real_run = engine._schedule, engine.Engine.run
    real_local, real_upload = sinks._LocalFile.write_at, sinks._Upload.write_at

    def run(self, plan, out, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen["sinks"].append(type(out).__name__)
        return real_run(self, plan, out, *args, **kwargs)

    def schedule(jobs, workers, do, stop, where):  # type: ignore[no-untyped-def]
        seen["schedules"].append(where)
        return real_schedule(jobs, workers, do, stop, where)

    def local(f, offset, data):  # type: ignore[no-untyped-def]
        seen["local"][str(Path(f"/proc/self/fd/{f.fd}").resolve())] += memoryview(data).nbytes
        return real_local(f, offset, data)

    def upload(f, offset, data):  # type: ignore[no-untyped-def]
        seen["upload"][f.url] += memoryview(data).nbytes
        return real_upload(f, offset, data)

    real_kernel = engine._kernel_copy

    def kernel(src_fd, src_off, dst_fd, dst_off, n, src_path):  # type: ignore[no-untyped-def]  # into a sink file's fd
        seen["local"][str(Path(f"/proc/self/fd/{dst_fd}").resolve())] += n
        return real_kernel(src_fd, src_off, dst_fd, dst_off, n, src_path)

    monkeypatch.setattr(engine, "_kernel_copy", kernel)
    monkeypatch.setattr(engine, "_schedule", schedule)
    monkeypatch.setattr(engine.Engine, "run", run)
    monkeypatch.setattr(sinks._LocalFile, "write_at", local)
    monkeypatch.setattr(sinks._Upload, "write_at", upload)
    return seen


def _source(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    tensors = {"model.w": torch.randn(37, 11), "model.b": torch.randn(11), "model.e": torch.randn(5, 3, 7),
               "step": torch.tensor(7)}
    path = tmp_path / "src.pt"
    torch.save(tensors, path)
    return path, tensors


def _metadata(name: str) -> bool:
    return name in ("zarr.json", ".reshard-manifest.json")


def _reset(seen: dict[str, Any]) -> None:
    seen["schedules"].clear()
    seen["sinks"].clear()
    seen["local"].clear()
    seen["upload"].clear()


def test_local_remote_and_zarr_outputs_share_the_schedule_and_the_sink(tmp_path: Path, counted: dict[str, Any]) -> None:
    src, tensors = _source(tmp_path)
    memfs = fsspec.filesystem("memory")

    # a local DCP folder laid out for 3 ranks, cast on the way (the int step kernel-copied into the sink file's fd)
    out = tmp_path / "dcp3"
    reshard.convert(src, out, to_mesh="3", dtype="bfloat16", quiet=True, max_memory="4KiB")
    assert counted["sinks"] == ["StagedSink"] and counted["schedules"] == [str(out)]
    data_files = {p.name: p.stat().st_size for p in out.glob("*.distcp")}
    assert len(data_files) == 3 and {Path(p).name: n for p, n in counted["local"].items()} == data_files
    state = {n: torch.zeros_like(t, dtype=torch.bfloat16 if t.is_floating_point() else t.dtype) for n, t in tensors.items()}
    dcp.load(state, checkpoint_id=str(out))
    for name, t in tensors.items():
        assert torch.equal(state[name], t.to(torch.bfloat16) if t.is_floating_point() else t), name

    # sharded safetensors at a URL: each object uploaded front to back through the sink
    _reset(counted)
    url = "memory://sinks-test/st"
    reshard.convert(src, url, to="safetensors", max_shard_size="1KiB", quiet=True)
    assert counted["sinks"] == ["RemoteSink"] and [str(w) for w in counted["schedules"]] == [url]
    shards = {f"memory:/{k}": memfs.size(k) for k in memfs.find("/sinks-test/st") if k.endswith(".safetensors")}
    assert len(shards) > 1 and dict(counted["upload"]) == shards
    index = json.loads(memfs.cat_file("/sinks-test/st/model.safetensors.index.json"))
    loaded: dict[str, torch.Tensor] = {}
    for shard in set(index["weight_map"].values()):
        loaded.update(safetensors_torch.load(memfs.cat_file(f"/sinks-test/st/{shard}")))
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[n], t) for n, t in tensors.items())

    # zarr, raw and compressed, at a URL and in a local folder: padding and zstd on the way through the same sinks
    for compress in (False, True):
        for where in ("memory://sinks-test/z.zarr", tmp_path / f"z{int(compress)}.zarr"):
            _reset(counted)
            reshard.convert(src, where, compress=compress, max_shard_size="256B", overwrite=True, quiet=True)
            assert len(counted["schedules"]) == 1
            if isinstance(where, Path):
                assert counted["sinks"] == ["StagedSink"]
                chunks = {str(p.relative_to(where)): p.stat().st_size for p in where.rglob("*")
                          if p.is_file() and not _metadata(p.name)}
                # by the path inside the staging folder, a sibling of the output
                written = {"/".join(Path(p).parts[len(where.parts):]): n for p, n in counted["local"].items()}
                if not compress:  # an edge chunk's zero tail is made by sizing the file, not written
                    for rel, size in chunks.items():
                        tail = size - written[rel]
                        assert tail >= 0 and not any((where / rel).read_bytes()[size - tail:]), rel
                        written[rel] = size
            else:
                assert counted["sinks"] == ["RemoteSink"]
                chunks = {k: memfs.size(k) for k in memfs.find("/sinks-test/z.zarr") if not _metadata(k.rsplit("/", 1)[-1])}
                written = {url.removeprefix("memory:/"): n for url, n in counted["upload"].items()}
            assert len(chunks) > 4 and written == chunks, (compress, where)
            if compress:  # zstd frames, smaller than the raw chunks they hold
                assert sum(chunks.values()) < 256 * len(chunks)
            group = zarr.open_group(str(where), mode="r")
            for name, t in tensors.items():
                assert np.array_equal(group[name][...], t.numpy()), (compress, where, name)
