"""Stores reshard did not write: zarr-python's (zstd, nested groups, missing chunks,
fill values) and tensorstore's (bfloat16, transpose, big-endian, gzip, crc32c); hostile
compressed chunks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reshard.formats.zarr.chunks import compress
from reshard.formats.zarr.format import ZarrFormat

import reshard
from reshard.core.boxes import Box
from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError
from reshard.core.pieces import OutputFile
from reshard.pipeline.engine import Engine
from reshard.pipeline.sinks import FolderSink
from tests.fixtures import full_tensor

zarr = pytest.importorskip("zarr")
ts = pytest.importorskip("tensorstore")


def test_reads_a_zarr_python_store(tmp_path: Path) -> None:
    root = zarr.open_group(tmp_path / "zp.zarr", mode="w")
    w = np.arange(70, dtype=np.float32).reshape(7, 10)
    a = root.create_group("model").create_group("layers.0").create_array("w", shape=(7, 10), chunks=(3, 4), dtype="float32")
    a[...] = w  # zstd, zarr-python's default compressor
    z = root.create_array("zeros", shape=(5,), chunks=(2,), dtype="int64", fill_value=0)
    z[...] = 0  # all fill: zarr-python writes no chunk at all
    f = root.create_array("filled", shape=(4,), chunks=(2,), dtype="int32", fill_value=7)
    f[:2] = [1, 2]  # the second chunk is never written and reads as 7
    root.attrs["note"] = "kept"  # zarr-python's own attribute API
    catalog = ZarrFormat().read(tmp_path / "zp.zarr")
    assert set(catalog.tensors) == {"model.layers.0.w", "zeros", "filled"}
    assert catalog.paths["model.layers.0.w"] == ("model", "layers.0", "w")  # dots in a node name
    assert torch.equal(full_tensor(catalog.tensors["model.layers.0.w"]), torch.from_numpy(w))
    assert torch.equal(full_tensor(catalog.tensors["zeros"]), torch.zeros(5, dtype=torch.int64))
    assert torch.equal(full_tensor(catalog.tensors["filled"]), torch.tensor([1, 2, 7, 7], dtype=torch.int32))
    assert catalog.facts.zarr_attributes == {"note": "kept"}
    # a sub-box that crosses chunks, through a real conversion
    reshard.convert(tmp_path / "zp.zarr", tmp_path / "out.safetensors", quiet=True)
    from safetensors.torch import load_file

    assert np.array_equal(load_file(tmp_path / "out.safetensors")["model.layers.0.w"].numpy(), w)


def test_reads_tensorstore_codecs(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    bf = torch.randn(6, 5, generator=gen).to(torch.bfloat16)
    c64 = torch.randn(4, 3, dtype=torch.complex64, generator=gen)
    cases = {
        "bf": (bf, [{"name": "transpose", "configuration": {"order": [1, 0]}},
                    {"name": "bytes", "configuration": {"endian": "big"}}, {"name": "gzip"}, {"name": "crc32c"}]),
        "c": (c64, [{"name": "bytes", "configuration": {"endian": "big"}}, {"name": "blosc"}]),
        "i": (torch.arange(9, dtype=torch.int32), [{"name": "bytes", "configuration": {"endian": "little"}},
                                                    {"name": "zstd"}]),
    }
    for name, (t, codecs) in cases.items():
        arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "t.zarr" / name)},
                       "metadata": {"shape": list(t.shape), "data_type": str(t.dtype).removeprefix("torch."),
                                    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4] + list(t.shape[1:])}},
                                    "codecs": codecs}}, create=True).result()
        arr[...] = t.view(torch.int16).numpy().view(arr.dtype.numpy_dtype) if t.dtype == torch.bfloat16 else t.numpy()
    (tmp_path / "t.zarr" / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group"}))
    catalog = ZarrFormat().read(tmp_path / "t.zarr")
    for name, (t, _) in cases.items():
        got = full_tensor(catalog.tensors[name])
        assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name
        chunk = catalog.tensors[name].chunks[-1]  # a sub-box of a decoded edge chunk
        part = chunk.data.read(Box((0,) * t.dim(), (1,) + chunk.box.sizes[1:]))
        assert torch.equal(part.view(torch.uint8), t[chunk.box.offsets[0]:chunk.box.offsets[0] + 1].view(torch.uint8))


def test_hostile_compressed_chunks(tmp_path: Path) -> None:
    torch.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, tmp_path / "src.pt")
    store = tmp_path / "z.zarr"
    reshard.convert(tmp_path / "src.pt", store, compress=True, quiet=True)
    chunk = store / "w" / "c" / "0" / "0"
    good = chunk.read_bytes()
    chunk.write_bytes(good[: len(good) // 2])  # truncated zstd frame
    catalog = ZarrFormat().read(store)  # metadata is fine; the damage shows when read
    with pytest.raises(CorruptCheckpointError, match=r"w/c/0/0: zstd decoding failed"):
        full_tensor(catalog.tensors["w"])
    import numcodecs

    chunk.write_bytes(numcodecs.Zstd().encode(bytes(40)))  # a valid frame of the wrong size
    with pytest.raises(CorruptCheckpointError, match="zstd frame holds 40 bytes, a chunk has 48"):
        full_tensor(ZarrFormat().read(store).tensors["w"])
    meta_path = store / "w" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["codecs"] = [{"name": "sharding_indexed", "configuration": {}}]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(UnsupportedFormatError, match="sharding_indexed"):
        ZarrFormat().read(store)


def test_compression_without_numcodecs_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from reshard.formats.zarr.chunks import compress

    from reshard.core.errors import UsageError

    monkeypatch.setitem(sys.modules, "numcodecs", None)  # as if zarr-python were not installed
    with pytest.raises(UsageError, match=r"pip install numcodecs"):
        compress(b"abc")


def test_compressed_chunks_fit_the_memory_budget(tmp_path: Path) -> None:
    """A compressed chunk is compressed and decoded whole: written under --max-memory 1MiB,
    every chunk (shards of --to-mesh too) holds at most 128 KiB, an eighth (so a reader with
    the same budget decodes on two workers), and zarr-python reads the store; a foreign store whose compressed chunks pass a
    quarter of the budget (each is held
    compressed, decoded and copied while slabs are cut from it) is refused with the budget it
    needs, and that budget is enough."""
    w = torch.arange(600 * 1000, dtype=torch.float32).reshape(600, 1000)  # 2.4 MB
    torch.save({"w": w, "b": torch.arange(7)}, tmp_path / "src.pt")
    for mesh in (None, "2"):
        store = tmp_path / f"z{mesh}.zarr"
        result = reshard.convert(tmp_path / "src.pt", store, compress=True, to_mesh=mesh, max_memory="1MiB", quiet=True)
        meta = json.loads((store / "w" / "zarr.json").read_text())
        chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
        assert np.prod(chunk) * 4 <= 128 * 1024 and (mesh is None or 300 % chunk[0] == 0), chunk  # shards: whole chunks
        assert any("smaller than their shards" in n for n in result.notices) == (mesh is not None)
        np.testing.assert_array_equal(zarr.open_group(store, mode="r")["w"][...], w.numpy())
    # Chunks are compressed by several workers when the budget holds each one's chunk, its
    # compressed form and a slab, by one when it does not; raw chunks take no such share.
    cores = min(os.cpu_count() or 1, 4)

    def workers(chunk: int, compressed: bool = True) -> tuple[int, int]:
        files = [OutputFile("c", [b"x" * chunk], encode=compress if compressed else None)]
        plan = SimpleNamespace(files=files, remote=False, decoded_chunk_bytes=0)
        return Engine(1 << 20, progress=False)._workers_for(plan, FolderSink(tmp_path))  # type: ignore[arg-type]

    assert workers(128 << 10) == (min(cores, 2), (1 << 20) - min(cores, 2) * (256 << 10))
    assert workers(600 << 10) == (1, 600 << 10)
    assert workers(1 << 10, compressed=False) == (cores, 1 << 20)

    big = zarr.open_group(tmp_path / "big.zarr", mode="w").create_array("w", shape=(600, 1000), chunks=(600, 1000),
                                                                        dtype="float32")
    big[...] = w.numpy()  # one 2.4 MB chunk, zstd
    with pytest.raises(reshard.ReshardError, match=r"decoded whole; that needs max_memory=10MiB"):
        reshard.convert(tmp_path / "big.zarr", tmp_path / "out.pt", max_memory="5MiB", quiet=True)
    reshard.convert(tmp_path / "big.zarr", tmp_path / "out.pt", max_memory="10MiB", quiet=True)
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["w"], w)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(["float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                             "complex64", "complex128", "int8", "uint8", "int64", "bool"]),
       value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-300, 300),
                       st.sampled_from(["NaN", "Infinity", "-Infinity", 0.0, -0.0, 0, True, False])),
       imag=st.floats(allow_nan=False, allow_infinity=False, width=32))
def test_fill_values_are_the_bytes_torch_makes_of_them(name: str, value: object, imag: float) -> None:
    """``fill_bytes`` converts without torch where numpy rounds as torch does; whatever the
    path, the bytes are torch's own for that value, and what does not fit is refused."""
    from reshard.formats.zarr.meta import fill_bytes

    from reshard.core import dtypes

    dtype = dtypes.by_name(name)
    json_value = [value, imag] if dtype.is_complex else value
    specials = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}
    number = specials.get(value, value) if isinstance(value, str) else value
    numeric = dtype.is_floating_point or dtype.is_complex
    if dtype.kind == "b":
        fits = type(number) is bool
    else:
        fits = type(number) in (int, float) and (numeric or type(number) is int)
    if isinstance(value, str) and not numeric:
        fits = False
    if fits and dtype.kind in "iu":  # in range, as zarr requires (torch would wrap -1 into a uint8)
        info = np.iinfo(name)
        fits = info.min <= number <= info.max
    try:
        expected = None
        if fits:
            scalar = complex(number, imag) if dtype.is_complex else number
            expected = torch.tensor(scalar, dtype=dtype.torch).reshape(1).view(torch.uint8).numpy().tobytes()
    except (RuntimeError, OverflowError):
        expected = None
    if expected is None:
        with pytest.raises(CorruptCheckpointError, match="fill_value"):
            fill_bytes(dtype, json_value, "a")
    else:
        assert fill_bytes(dtype, json_value, "a") == expected
