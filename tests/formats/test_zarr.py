"""zarr v3 stores: a real FSDP2 DCP checkpoint through ``--to zarr`` and back, checked with
tensorstore (the JAX world's reader) alone, torch's ``dcp.load`` and safetensors' ``load_file``;
mesh chunking; every torch dtype bit for bit; objects; parallel writes on a gloo world;
hostile stores."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from reshard.formats.zarr import grid as zarr_grid
from reshard.formats.zarr.format import ZarrFormat, ZarrWriter

import reshard
from reshard.core.boxes import full_box
from reshard.core.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedFormatError
from reshard.core.facts import Facts
from reshard.core.target import Target, TargetTensor
from tests.dist import run_world
from tests.fixtures import full_tensor
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as cli

ts = pytest.importorskip("tensorstore")


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes: equal bytes is the bit-for-bit equality we promise (NaNs included)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def ts_read(path: Path) -> np.ndarray:
    """Read one array with tensorstore alone (no reshard code involved)."""
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}).result().read().result()


def test_fsdp2_dcp_to_zarr_read_by_tensorstore_alone(fsdp2_dcp, fsdp2_reference, tmp_path: Path) -> None:
    store = tmp_path / "ckpt.zarr"
    result = reshard.convert(fsdp2_dcp[0], store, quiet=True)  # --to zarr from the suffix
    assert result.format == "zarr" and result.notices == []
    for name, ref in fsdp2_reference.items():
        arr = ts_read(store / name)
        assert arr.dtype.name == str(ref.dtype).removeprefix("torch.") and arr.shape == tuple(ref.shape), name
        assert np.ascontiguousarray(arr).tobytes() == raw(ref), name
    # --dtype bfloat16: tensorstore sees the zarr extension type bfloat16, values are the exact cast
    # (of parameters and the moments shaped like them; AdamW's step and other state keep theirs).
    bf16 = tmp_path / "bf16.zarr"
    reshard.convert(fsdp2_dcp[0], bf16, dtype="bfloat16", quiet=True)
    for name, ref in fsdp2_reference.items():
        cast = name.startswith("model.") or (name.startswith("optim.state.") and not name.endswith(".step"))
        want = ref.to(torch.bfloat16) if ref.is_floating_point() and cast else ref
        arr = ts_read(bf16 / name)
        assert arr.dtype.name == str(want.dtype).removeprefix("torch."), name
        assert np.ascontiguousarray(arr).tobytes() == raw(want), name
    assert json.loads((bf16 / "model.embed.weight" / "zarr.json").read_text())["data_type"] == "bfloat16"
    # Objects and nesting travel in the root group's attributes, as plain JSON where it can.
    attrs = json.loads((store / "zarr.json").read_text())["attributes"]
    assert attrs["reshard.objects"]["extra.step"] == 2 and attrs["reshard.objects"]["extra.note"] == "tiny"
    back = reshard.inspect(store)
    assert back.format == "zarr" and set(back.tensors) == set(fsdp2_reference)
    assert back.objects["optim.param_groups.0.betas"] == (0.9, 0.999)
    assert back.paths["optim.state.embed.weight.exp_avg"] == ("optim", "state", "embed.weight", "exp_avg")
    # `reshard inspect --json` on a store, through the real CLI.
    proc = cli("inspect", store, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["format"] == "zarr"
    embed = next(t for t in report["tensors"] if t["name"] == "model.embed.weight")
    assert embed["dtype"] == "float32" and embed["chunks"] == [{"offsets": [0, 0], "sizes": [11, 6]}]


def test_to_mesh_4_chunks_are_dim0_shards(fsdp2_dcp, fsdp2_reference, tmp_path: Path) -> None:
    store = tmp_path / "m4.zarr"
    reshard.convert(fsdp2_dcp[0], store, to_mesh="4", quiet=True)
    sharded = 0
    for name, ref in fsdp2_reference.items():
        meta = json.loads((store / name / "zarr.json").read_text())
        chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
        if meta["attributes"]["reshard.mesh.placements"] == ["Shard(0)"]:
            n = ref.shape[0]
            assert chunk == [math.ceil(n / 4), *ref.shape[1:]], name  # torch.chunk: ceil(n/4) rows
            files = [p for p in (store / name / "c").rglob("*") if p.is_file()]
            assert len(files) == math.ceil(n / chunk[0]), name  # empty trailing shards store nothing
            sharded += 1
        else:
            assert meta["attributes"]["reshard.mesh.placements"] == ["Replicate()"], name
            assert chunk == list(ref.shape), name  # a replicated tensor is one chunk
        assert np.ascontiguousarray(ts_read(store / name)).tobytes() == raw(ref), name  # padding is right
    assert sharded > 10
    assert json.loads((store / "zarr.json").read_text())["attributes"]["reshard.mesh"] == {"shape": [4], "names": ["dp_shard"]}
    assert reshard.inspect(store).facts.source_world_size == 4


def test_zarr_to_dcp_and_safetensors_exact(fsdp2_dcp, fsdp2_reference, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    chunked = tmp_path / "m3.zarr"
    reshard.convert(fsdp2_dcp[0], chunked, to_mesh="3", compress=True, quiet=True)
    codecs = json.loads((chunked / "model.embed.weight" / "zarr.json").read_text())["codecs"]
    assert [c["name"] for c in codecs] == ["bytes", "zstd"]
    for name in ("model.embed.weight", "optim.state.head.weight.exp_avg"):  # zstd, as tensorstore reads it
        assert np.ascontiguousarray(ts_read(chunked / name)).tobytes() == raw(fsdp2_reference[name])
    out = tmp_path / "dcp"
    reshard.convert(chunked, out, to="dcp", max_memory="4KiB", quiet=True)
    sd = {name: torch.empty_like(ref) for name, ref in fsdp2_reference.items()}
    dcp.load(sd, checkpoint_id=out)  # torch's own loader
    for name, ref in fsdp2_reference.items():
        assert raw(sd[name]) == raw(ref), name
    assert reshard.inspect(out).objects["extra.step"] == 2
    st = tmp_path / "all.safetensors"
    reshard.convert(chunked, st, quiet=True)
    loaded = load_file(st)
    assert set(loaded) == set(fsdp2_reference)
    for name, ref in fsdp2_reference.items():
        assert raw(loaded[name]) == raw(ref), name


DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu,
    torch.complex64, torch.complex128, torch.complex32,
]


@pytest.mark.parametrize("compress", [False, True])
def test_every_dtype_round_trips_bit_for_bit(compress: bool, tmp_path: Path, monkeypatch) -> None:
    import zarr

    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for dt in DTYPES:  # random bit patterns: NaNs, infs and subnormals included
        name = str(dt).removeprefix("torch.")
        bits = torch.randint(0, 2 if dt == torch.bool else 256, (7, 3 * dt.itemsize), dtype=torch.uint8, generator=gen)
        tensors[name] = bits.bool() if dt == torch.bool else bits.view(dt)
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    tensors["empty"] = torch.empty(0, 3)
    torch.save(tensors, tmp_path / "src.pt")
    monkeypatch.setattr(zarr_grid, "CHUNK_BYTES", 24)  # several chunks per tensor, padded edge chunks
    store = tmp_path / "dt.zarr"
    reshard.convert(tmp_path / "src.pt", store, compress=compress, quiet=True)
    catalog = reshard.inspect(store)
    for name, ref in tensors.items():
        meta = json.loads((store / name / "zarr.json").read_text())
        assert meta["attributes"]["reshard.dtype"] == str(ref.dtype).removeprefix("torch."), name
        assert catalog.tensors[name].dtype.torch == ref.dtype and raw(full_tensor(catalog.tensors[name])) == raw(ref), name
        if ref.dtype == torch.complex32:
            assert meta["data_type"] == "r32"  # no zarr name: raw bits + reshard.dtype
            continue
        assert np.ascontiguousarray(ts_read(store / name)).tobytes() == raw(ref), name  # tensorstore
        if meta["data_type"] in ("bool", "float32", "float64", "int64", "uint16", "complex64", "complex128"):
            assert zarr.open_array(store / name, mode="r")[...].tobytes() == raw(ref), name  # zarr-python
    assert len(catalog.tensors["float32"].chunks) > 1
    back = tmp_path / "back.pt"
    reshard.convert(store, back, quiet=True)
    loaded = torch.load(back, weights_only=True)
    assert all(raw(loaded[n]) == raw(t) and loaded[n].dtype == t.dtype for n, t in tensors.items())


def test_objects_json_cannot_hold_travel_safely(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    t = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    target = Target(
        tensors={"w": TargetTensor("w", (2, 3), torch.int32, [full_box((2, 3))], [0])},
        objects={"plain": {"lr": 0.1, "inf": float("inf"), "key": (1, 2)}, "held": {"mask": torch.tensor([True, False])}},
        paths={"w": ("model", "w")}, facts=Facts(hf_config={"hidden": 8}),
    )
    store = tmp_path / "o.zarr"
    store.mkdir()
    (store / "w" / "c" / "0").mkdir(parents=True)
    (store / "w" / "c" / "0" / "0").write_bytes(raw(t))  # what the engine would write
    ZarrWriter().finish(store, target, ZarrWriter().layout(target))
    attrs = json.loads((store / "zarr.json").read_text())["attributes"]
    assert attrs["reshard.pickled_objects"] == ["held"] and "held" not in attrs["reshard.objects"]
    back = reshard.inspect(store)
    assert back.objects["plain"] == {"lr": 0.1, "inf": float("inf"), "key": (1, 2)}
    assert torch.equal(back.objects["held"]["mask"], torch.tensor([True, False]))
    assert back.paths["w"] == ("model", "w") and back.facts.hf_config == {"hidden": 8}
    assert torch.equal(full_tensor(back.tensors["w"]), t)
    torch.save({"held": Evil()}, store / ".reshard-objects.pt")  # a hostile objects file
    with pytest.raises(UnsafeCheckpointError):
        reshard.inspect(store)
    assert not (tmp_path / "pwned").exists()


def _parallel(rank: int, world_size: int, src: str, out: str) -> None:
    reshard.convert(src, f"{out}/par.zarr", to_mesh="3", quiet=True)
    reshard.convert(src, f"{out}/parz.zarr", compress=True, quiet=True)


def test_ranks_write_disjoint_chunks_rank0_finishes(fsdp2_dcp, tmp_path: Path, monkeypatch) -> None:
    """Two gloo ranks split the chunk files; rank 0 pads and compresses chunks the other rank
    wrote and writes the metadata: the store is byte-identical to a one-process conversion."""
    src = str(fsdp2_dcp[0])
    reshard.convert(src, tmp_path / "one.zarr", to_mesh="3", quiet=True)
    reshard.convert(src, tmp_path / "onez.zarr", compress=True, quiet=True)
    run_world(_parallel, 2, src, str(tmp_path))
    for a, b in (("one.zarr", "par.zarr"), ("onez.zarr", "parz.zarr")):
        files = {p.relative_to(tmp_path / a): p.read_bytes() for p in (tmp_path / a).rglob("*") if p.is_file()}
        other = {p.relative_to(tmp_path / b): p.read_bytes() for p in (tmp_path / b).rglob("*") if p.is_file()}
        assert files.keys() == other.keys() and all(files[k] == other[k] for k in files), b
    assert not list(tmp_path.glob(".par*"))


def _store(tmp_path: Path, fsdp2_dcp) -> Path:
    store = tmp_path / "h.zarr"
    reshard.convert(fsdp2_dcp[0], store, only="model", quiet=True)
    return store


def test_hostile_stores_are_refused_with_the_file_named(fsdp2_dcp, tmp_path: Path) -> None:
    store = _store(tmp_path, fsdp2_dcp)
    chunk = store / "model.embed.weight" / "c" / "0" / "0"
    data = chunk.read_bytes()
    chunk.write_bytes(data[:-5])  # truncated chunk file
    with pytest.raises(CorruptCheckpointError, match=r"model\.embed\.weight/c/0/0: 259 bytes, expected 264"):
        ZarrFormat().read(store)
    assert_one_line_error(cli("inspect", store), "c/0/0", "truncated")
    chunk.write_bytes(data)
    meta_path = store / "model.embed.weight" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"] = [12, 6]  # shape that disagrees with the stored chunk
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [12, 6]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CorruptCheckpointError, match="expected 288"):
        ZarrFormat().read(store)
    for field, value, error, match in [
        ("chunk_grid", {"name": "regular", "configuration": {"chunk_shape": [0, 6]}}, CorruptCheckpointError, "chunk_shape"),
        ("shape", [11], CorruptCheckpointError, "does not match shape"),
        ("data_type", "float128", UnsupportedFormatError, "no torch equivalent"),
        ("codecs", [{"name": "bytes"}, {"name": "lz5"}], UnsupportedFormatError, "codec 'lz5'"),
        ("fill_value", "zero", CorruptCheckpointError, "fill_value"),
        ("zarr_format", 2, UnsupportedFormatError, "zarr v3"),
    ]:
        bad = dict(json.loads(json.dumps(meta)), shape=[11, 6])
        bad["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": [11, 6]}}
        bad[field] = value
        meta_path.write_text(json.dumps(bad))
        with pytest.raises(error, match=match):
            ZarrFormat().read(store)
    meta["shape"] = [11, 6]
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [11, 6]
    meta["attributes"]["reshard.dtype"] = "bfloat16"  # contradicts data_type float32
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CorruptCheckpointError, match="contradicts"):
        ZarrFormat().read(store)
    meta_path.write_text("{not json")
    assert_one_line_error(cli("inspect", store), "model.embed.weight/zarr.json", "not valid JSON")
    (store / "zarr.json").unlink()  # an unfinished write: no root metadata, no store
    assert_one_line_error(cli("inspect", store), "h.zarr")


def test_extension_fields_are_refused_unless_must_understand_is_false(tmp_path: Path) -> None:
    """The zarr v3 spec: a node whose zarr.json holds a field reshard does not implement is
    refused unless that field is an object saying ``"must_understand": false``; zarr-python
    refuses the same arrays, and reads the ignorable one as reshard does."""
    import zarr
    from safetensors.torch import load_file
    from zarr.errors import MetadataValidationError, UnknownCodecError

    store = tmp_path / "store.zarr"
    arr = zarr.create_array(store, shape=(3, 4), dtype="float32", chunks=(2, 4))
    arr[...] = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5
    doc = json.loads((store / "zarr.json").read_text())
    for ext in ({"must_understand": True}, {"note": "no must_understand"}, 7):
        (store / "zarr.json").write_text(json.dumps(dict(doc, my_ext=ext)))
        assert_one_line_error(cli("convert", store, tmp_path / "out.safetensors"), f"{store}/zarr.json", "'my_ext'",
                              '"must_understand": false')
        with pytest.raises(MetadataValidationError, match="my_ext"):
            zarr.open_array(store, mode="r")
    assert not (tmp_path / "out.safetensors").exists()
    (store / "zarr.json").write_text(json.dumps(dict(doc, my_ext={"must_understand": False, "x": 1})))
    assert cli("convert", store, tmp_path / "out.safetensors").returncode == 0
    want = zarr.open_array(store, mode="r")[...]
    assert load_file(tmp_path / "out.safetensors")["store"].numpy().tobytes() == want.tobytes()
    # An unknown codec is refused even when it says it may be ignored: zarr-python refuses it too.
    codecs = doc["codecs"] + [{"name": "my_codec", "must_understand": False}]
    (store / "zarr.json").write_text(json.dumps(dict(doc, codecs=codecs)))
    assert_one_line_error(cli("inspect", store), "codec 'my_codec'", "must_understand")
    with pytest.raises(UnknownCodecError, match="my_codec"):
        zarr.open_array(store, mode="r")
    # A group's extension fields follow the same rule.
    group = tmp_path / "g.zarr"
    zarr.open_group(group, mode="w").create_array("w", data=np.ones(2, dtype=np.float32))
    root = json.loads((group / "zarr.json").read_text())
    (group / "zarr.json").write_text(json.dumps(dict(root, my_ext={"must_understand": True})))
    assert_one_line_error(cli("inspect", group), f"{group}/zarr.json", "'my_ext'")
    (group / "zarr.json").write_text(json.dumps(dict(root, my_ext={"must_understand": False})))
    assert set(reshard.inspect(group).tensors) == {"w"}
