"""safetensors reader and writer, checked against the real ``safetensors`` and
``huggingface_hub`` libraries in both directions."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from reshard.formats.options import ConvertOptions
from reshard.formats.safetensors.format import INDEX_NAME, SafetensorsFormat
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Catalog
from reshard.core.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError, UsageError
from reshard.core.facts import Facts
from tests.formats.safetensors_cases import BROKEN, raw_file, reference, same, whole_target, write_layout

FMT = SafetensorsFormat()


def assert_catalog_holds(catalog: Catalog, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor read whole and in sub-boxes through the catalog equals the original."""
    assert set(catalog.tensors) == set(tensors)
    for name, ref in tensors.items():
        entry = catalog.tensors[name]
        assert (entry.shape, entry.dtype.torch) == (tuple(ref.shape), ref.dtype), name
        (chunk,) = entry.chunks
        assert chunk.box == full_box(ref.shape)
        assert same(chunk.data.read(chunk.box), ref), name
        if ref.ndim and ref.shape[0] > 1 and ref.numel():
            inner = Box((1,) + (0,) * (ref.ndim - 1), (ref.shape[0] - 1,) + tuple(ref.shape[1:]))
            assert same(chunk.data.read(inner), ref[inner.as_slices()]), name
        if ref.ndim >= 2 and min(ref.shape) > 1:  # not one byte run: a strided read
            corner = Box((1,) * ref.ndim, tuple(s - 1 for s in ref.shape))
            assert same(chunk.data.read(corner), ref[corner.as_slices()]), name


# ---------------------------------------------------------------------------------- reading


def test_reads_save_file_output_exactly(tmp_path: Path) -> None:
    ref = reference()
    save_file(ref, tmp_path / "m.safetensors", metadata={"format": "pt", "note": "hi"})
    catalog = FMT.read(tmp_path / "m.safetensors")
    assert catalog.format == "safetensors"
    assert_catalog_holds(catalog, ref)
    assert catalog.facts.safetensors_metadata == {"format": "pt", "note": "hi"}
    assert catalog.objects == {} and catalog.paths == {}


def test_read_touches_no_tensor_bytes(tmp_path: Path) -> None:
    """Data is read when a box is asked for, not at read(): change it in place in between."""
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(4)}, path)
    (chunk,) = FMT.read(path).tensors["w"].chunks
    raw = bytearray(path.read_bytes())
    raw[-16:] = torch.ones(4).numpy().tobytes()
    path.write_bytes(bytes(raw))
    assert torch.equal(chunk.data.read(chunk.box), torch.ones(4))


def test_reads_hub_sharded_folder(tmp_path: Path) -> None:
    ref = reference()
    save_torch_state_dict(ref, tmp_path, max_shard_size=200)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    assert_catalog_holds(FMT.read(tmp_path), ref)
    assert FMT.detect(tmp_path / INDEX_NAME)  # the index stands for its folder too
    assert_catalog_holds(FMT.read(tmp_path / INDEX_NAME), ref)


def test_model_safetensors_beside_an_index_of_other_files_is_refused(tmp_path: Path) -> None:
    """transformers loads model.safetensors before it looks for an index; reading the index
    instead would convert other weights than the folder loads as."""
    save_torch_state_dict(reference(), tmp_path, max_shard_size=200)
    save_file({"other": torch.ones(2)}, tmp_path / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match="holds both model.safetensors and model.safetensors.index.json "
                                                     "naming other files; transformers would load model.safetensors"):
        FMT.read(tmp_path)
    # An index that names model.safetensors itself is one consistent set.
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {"other": "model.safetensors"}}))
    for shard in tmp_path.glob("model-*.safetensors"):
        shard.unlink()
    assert_catalog_holds(FMT.read(tmp_path), {"other": torch.ones(2)})


def test_folder_without_index_reads_every_file(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, tmp_path / "one.safetensors")
    save_file({"b": torch.zeros(3)}, tmp_path / "two.safetensors")
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    catalog = FMT.read(tmp_path)
    assert_catalog_holds(catalog, {"a": torch.ones(2), "b": torch.zeros(3)})
    assert catalog.facts.hf_config == {"model_type": "llama", "hidden_size": 8}
    save_file({"a": torch.ones(1)}, tmp_path / "three.safetensors")
    with pytest.raises(CorruptCheckpointError, match=r"three\.safetensors: tensor 'a' is also stored in .*one"):
        FMT.read(tmp_path)


def test_detect(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, tmp_path / "m.safetensors")
    assert FMT.detect(tmp_path / "m.safetensors") and FMT.detect(tmp_path)
    assert not FMT.detect(tmp_path / "missing.safetensors")
    (tmp_path / "x.pt").write_bytes(b"")
    assert not FMT.detect(tmp_path / "x.pt")
    (tmp_path / ".metadata").write_bytes(b"")
    assert not FMT.detect(tmp_path)  # a DCP folder, whatever else lies in it
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not FMT.detect(empty)


def test_missing_source(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="nope.safetensors: no such file"):
        FMT.read(tmp_path / "nope.safetensors")
    with pytest.raises(CheckpointNotFoundError, match="no \\*.safetensors file or index"):
        FMT.read(tmp_path)


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_header(tmp_path: Path, case: str) -> None:
    header, data, length, error, message, rust_rejects = BROKEN[case]
    path = raw_file(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(error) as caught:
        FMT.read(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)
    if rust_rejects:  # the real library agrees the file is broken
        with pytest.raises(Exception):
            with safe_open(path, "pt") as f:
                [f.get_tensor(k) for k in f.keys()]


def _sharded(tmp_path: Path, weight_map: dict[str, str]) -> Path:
    save_file({"a": torch.ones(2), "c": torch.ones(1)}, tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path


@pytest.mark.parametrize(
    "weight_map, error, message",
    [
        ({"a": "../model-00001-of-00001.safetensors"}, UnsafeCheckpointError, "not a plain path inside"),
        ({"a": "/etc/passwd"}, UnsafeCheckpointError, "not a plain path inside"),
        ({"a": "..\\outside.safetensors"}, UnsafeCheckpointError, "not a plain path inside"),
        ({"a": "gone.safetensors"}, CorruptCheckpointError, "weight_map file 'gone.safetensors' is missing"),
        ({"a": 3}, CorruptCheckpointError, "weight_map file 3 is not a file name"),
    ],
)
def test_index_refuses_bad_paths(tmp_path: Path, weight_map: dict, error: type, message: str) -> None:
    folder = _sharded(tmp_path, weight_map)
    with pytest.raises(error, match=message) as caught:
        FMT.read(folder)
    assert str(caught.value).startswith(f"{folder / INDEX_NAME}: ")


def test_index_refuses_folder_links_out_but_reads_hub_cache_links(tmp_path: Path) -> None:
    """Hub cache snapshots link each file into ../../blobs: fine. A linked folder is not."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    save_file({"a": torch.ones(2)}, blobs / "0123abcd")
    (snapshot / "model-00001-of-00001.safetensors").symlink_to("../../blobs/0123abcd")
    (snapshot / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    assert_catalog_holds(FMT.read(snapshot), {"a": torch.ones(2)})
    (snapshot / "sub").symlink_to(blobs)
    (snapshot / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "sub/0123abcd"}}))
    with pytest.raises(UnsafeCheckpointError, match="lies in a folder that resolves outside the checkpoint"):
        FMT.read(snapshot)


@pytest.mark.parametrize(
    "weight_map, message",
    [
        ({n: "model-00001-of-00001.safetensors" for n in "abc"},
         "the index maps tensor 'b' here but the file does not hold it"),
        ({"a": "model-00001-of-00001.safetensors"}, "holds tensor 'c', which the index maps to another file or not"),
    ],
)
def test_index_and_files_must_agree(tmp_path: Path, weight_map: dict, message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=message):
        FMT.read(_sharded(tmp_path, weight_map))


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("reshard.objects", '{"x": {"__tuple__": 3}}', "'reshard.objects' is not valid (malformed __tuple__ value 3)"),
        ("reshard.objects", '{"x": {"__float__": "1e3"}}', "malformed __float__"),
        ("reshard.objects", '{"x": {"__dict__": [[[1], 2]]}}', "dict key [1] is not hashable"),
        ("reshard.objects", "[" * 100_000 + "]" * 100_000, "'reshard.objects' is not valid"),
        ("reshard.objects", "[1]", "'reshard.objects' is not an object keyed by name"),
        ("reshard.paths", '{"w": "model.w"}', "'reshard.paths' entry 'w' is not a list of keys"),
    ],
)
def test_bad_reshard_metadata(tmp_path: Path, key: str, value: str, message: str) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(1)}, path, metadata={key: value})
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{path}: __metadata__ ") + ".*" + re.escape(message)):
        FMT.read(path)


# ---------------------------------------------------------------------------------- writing


def test_single_file_is_byte_identical_to_save_file(tmp_path: Path) -> None:
    ref = reference()
    writer = FMT.writer(tmp_path / "ours.safetensors")
    assert not writer.output_is_dir
    write_layout(writer, whole_target(ref), tmp_path / "ours.safetensors", ref)
    save_file(ref, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    loaded = load_file(tmp_path / "ours.safetensors")
    assert set(loaded) == set(ref) and all(same(loaded[n], ref[n]) for n in ref)
    with safe_open(tmp_path / "ours.safetensors", "pt") as f:
        assert same(f.get_slice("cube")[1:3, :, 2:4], ref["cube"][1:3, :, 2:4])
        assert f.metadata() == {"format": "pt"}


def test_objects_and_paths_round_trip_exactly(tmp_path: Path) -> None:
    ref = {"model.w": torch.randn(3, 2), "optim.state.0.step": torch.tensor(4.0)}
    sched = {"lr": 1e-3, "betas": (0.9, 0.95), "by_id": {0: "a", 1: ("b", None)}, "on": True,
             "steps": [1, 2.0, -0.0], "inf": float("-inf"), "tag": {"__tuple__": [1]}, "raw": b"\x00\xff"}
    objects = {"extra.step": 7, "extra.sched": sched, "extra.nan": float("nan"),
               "extra.scale": torch.ones(2), "extra.cls": object()}
    paths = {"model.w": ("model", "w"), "optim.state.0.step": ("optim", "state", 0, "step"),
             "extra.sched": ("extra", "sched")}
    target = whole_target(ref, objects, paths, facts=Facts(safetensors_metadata={"author": "me"}))
    writer = FMT.writer(tmp_path / "m.safetensors")
    notices = writer.notices(target)
    assert notices == [
        f"object {n!r} holds a value of type {k}, which safetensors metadata cannot store; it is left out "
        "(write dcp or torch to keep it)" for n, k in [("extra.scale", "Tensor"), ("extra.cls", "object")]
    ]
    write_layout(writer, target, tmp_path / "m.safetensors", ref)
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert f.metadata()["format"] == "pt"
    catalog = FMT.read(tmp_path / "m.safetensors")
    assert_catalog_holds(catalog, ref)
    assert set(catalog.objects) == {"extra.step", "extra.sched", "extra.nan"}
    assert catalog.objects["extra.sched"] == sched and repr(catalog.objects["extra.sched"]) == repr(sched)
    assert type(catalog.objects["extra.step"]) is int and math.isnan(catalog.objects["extra.nan"])
    assert catalog.paths == paths
    assert catalog.facts.safetensors_metadata == {"author": "me", "format": "pt"}


def test_sharded_output_matches_huggingface_hub(tmp_path: Path) -> None:
    ref = reference()
    writer = FMT.writer(tmp_path / "ours", ConvertOptions(max_shard_size=200).for_writer())
    files = write_layout(writer, whole_target(ref, {"step": 3}), tmp_path / "ours", ref)
    assert len(files) > 2
    (tmp_path / "theirs").mkdir()
    save_torch_state_dict(ref, tmp_path / "theirs", max_shard_size=200)
    theirs = sorted(p.name for p in (tmp_path / "theirs").iterdir())
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == theirs
    index = json.loads((tmp_path / "ours" / INDEX_NAME).read_text())
    assert index == json.loads((tmp_path / "theirs" / INDEX_NAME).read_text())
    loaded = {}
    for name in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(tmp_path / "ours" / name))
        if name != files[0].relpath:  # the first shard differs only by the objects it carries
            assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes()
    assert set(loaded) == set(ref) and all(same(loaded[n], ref[n]) for n in ref)
    catalog = FMT.read(tmp_path / "ours")
    assert_catalog_holds(catalog, ref)
    assert catalog.objects == {"step": 3}


@pytest.mark.parametrize("max_shard_size, names", [
    (None, ["model.safetensors"]),  # huggingface_hub's convention: one shard, no index
    ("1GB", ["model.safetensors", INDEX_NAME]),  # asked for shards: always an index
])
def test_one_shard_folder(tmp_path: Path, max_shard_size: str | None, names: list[str]) -> None:
    ref = {"w": torch.randn(2, 2), "b": torch.zeros(0)}
    writer = FMT.writer(tmp_path / "out", ConvertOptions(max_shard_size=max_shard_size).for_writer())
    assert writer.output_is_dir
    write_layout(writer, whole_target(ref), tmp_path / "out", ref)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(names)
    assert_catalog_holds(FMT.read(tmp_path / "out"), ref)


def test_no_tensors_still_a_valid_file(tmp_path: Path) -> None:
    target = whole_target({}, {"epoch": 2})
    write_layout(FMT.writer(tmp_path / "out", ConvertOptions(max_shard_size=100).for_writer()), target, tmp_path / "out", {})
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["model.safetensors"]  # no empty index
    assert load_file(tmp_path / "out" / "model.safetensors") == {}
    assert FMT.read(tmp_path / "out").objects == {"epoch": 2}


def test_writer_refuses_what_safetensors_cannot_hold(tmp_path: Path) -> None:
    target = whole_target({"w": torch.zeros(4, 2)})
    target.tensors["w"].boxes = [Box((0, 0), (2, 2)), Box((2, 0), (2, 2))]
    target.tensors["w"].ranks = [0, 1]
    with pytest.raises(UsageError, match="safetensors holds whole tensors; 'w' is laid out as 2 boxes"):
        FMT.writer(tmp_path / "o.safetensors").layout(target)
    with pytest.raises(UsageError, match="'z': safetensors has no dtype for torch.complex128"):
        FMT.writer(tmp_path / "o.safetensors").layout(whole_target({"z": torch.zeros(2, dtype=torch.complex128)}))
    with pytest.raises(UsageError, match="'__metadata__': the header reserves this name"):
        FMT.writer(tmp_path / "o.safetensors").layout(whole_target({"__metadata__": torch.zeros(1)}))
    with pytest.raises(UsageError, match="size '0' must be positive"):
        FMT.writer(tmp_path / "o", ConvertOptions(max_shard_size="0").for_writer())


def test_an_empty_tensor_with_a_huge_dim_reads_as_safetensors_reads_it(tmp_path: Path) -> None:
    """Shape [2**63 - 1, 0] holds no element, so safetensors accepts it (found by the fuzzer,
    tests/test_fuzz.py); numpy cannot shape even an empty array that wide, so reshard read it
    with a ValueError. It reads as torch's empty tensor of that shape now, as safetensors gives."""
    import struct

    header = json.dumps({"e": {"dtype": "F32", "shape": [2**63 - 1, 0], "data_offsets": [0, 0]}}).encode()
    path = tmp_path / "wide.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with safe_open(str(path), "pt") as f:
        theirs = f.get_tensor("e")
    catalog = SafetensorsFormat().read(path)
    (chunk,) = catalog.tensors["e"].chunks
    ours = chunk.data.read_all()
    assert ours.shape == theirs.shape == (2**63 - 1, 0) and ours.dtype == theirs.dtype == torch.float32
