"""Every serialization torch's DCP writes, read exactly or refused with one line.

The fixtures come from torch's own writers (tests/dcp_variants.py: one 2-rank gloo world for
the distributed variants, the rest in this process). A variant torch reads correctly is
compared with torch's own reading (``dcp_to_torch_save``); one torch cannot read, or reads
wrong (SAFETENSORS serialization, ``use_collectives=False``), with torch's reading of the same
state dict saved the default way; HF writer output with the state dict itself. Comparisons
are bit for bit, objects included. Each reader rule is then tested on an edited real fixture.
"""

from __future__ import annotations

import pickle
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from reshard.formats.dcp.format import DCPFormat
from reshard.formats.registry import detect_format

import reshard
from reshard.core.boxes import Box
from reshard.core.catalog import ObjectTable
from tests.dcp_variants import MULTICHUNK_FULL, source_state_dict, write_variants
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as cli

# variant -> the variant whose dcp_to_torch_save output is the reference (itself when torch reads it right)
TORCH_REFERENCE = {
    **{v: v for v in ("default", "per_item_files", "threads3", "async_thread", "async_process", "zstd",
                      "zstd_per_item_files", "torch_save_to_dcp", "no_dist", "no_flatten", "noncontig",
                      "noncontig_zstd", "multichunk_default")},
    "safetensors_fmt": "default",  # torch's readers unpickle the safetensors header and fail
    "no_collectives": "default",  # torch's readers read __0.metadata only: rank 1's rows are garbage
}
HF_READ = ("hf_sharded", "hf_consolidated", "hf_single")
REFUSED = {
    "zstd_safetensors_fmt": (".distcp: ", "is an empty zstd frame: torch wrote this checkpoint with ZStandard and "
                             "SerializationFormat.SAFETENSORS together"),
    "multichunk_safetensors_fmt": ("__0_0.distcp (safetensors data at byte 0): .metadata places chunk (0, 0) of 'st' "
                                   "here, but only its chunk at (2, 0) is stored",),
    "hf_sharded_full_sd": ("-model-00001-of-00001.safetensors: starts with a zip archive (torch.save data)",),
    # Both ranks write this one file at once: which bytes survive is a race, the refusal is not.
    "hf_rank0_2ranks": ("hf_rank0_2ranks/model-00001-of-00001.safetensors: ",),
    "noncontig_safetensors_fmt": ("noncontig_safetensors_fmt: not a checkpoint reshard recognizes",),
}


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp_variants")
    write_variants(root)
    return root


@pytest.fixture(scope="module")
def torch_reading(variants: Path, tmp_path_factory: pytest.TempPathFactory):
    """variant -> what torch's dcp_to_torch_save makes of it, computed once."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out, cache = tmp_path_factory.mktemp("torch_reading"), {}

    def read(name: str) -> dict:
        if name not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp_to_torch_save(variants / name, out / f"{name}.pt")
            cache[name] = torch.load(out / f"{name}.pt", weights_only=True)
        return cache[name]

    return read


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(ours, ref, where: str = "") -> None:
    """Equal structure and types; tensors of equal dtype and shape, bit for bit."""
    assert type(ours) is type(ref), (where, type(ours), type(ref))
    if isinstance(ref, torch.Tensor):
        assert (ours.dtype, ours.shape) == (ref.dtype, ref.shape), where
        assert torch.equal(_bits(ours), _bits(ref)), where
    elif isinstance(ref, dict):
        assert set(ours) == set(ref), (where, sorted(map(str, ours)), sorted(map(str, ref)))
        for k in ref:
            assert_same(ours[k], ref[k], f"{where}.{k}")
    elif isinstance(ref, (list, tuple)):
        assert len(ours) == len(ref), where
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert ours == ref, (where, ours, ref)


def _convert(src: Path, dst: Path, **kw) -> dict:
    reshard.convert(src, dst, quiet=True, max_memory="64KiB", **kw)  # model.big (128 KiB) in several slabs
    return torch.load(dst, weights_only=True)


@pytest.mark.parametrize("variant", list(TORCH_REFERENCE))
def test_variant_reads_as_torch_does(variant: str, variants: Path, torch_reading, tmp_path: Path) -> None:
    assert_same(_convert(variants / variant, tmp_path / "x.pt"), torch_reading(TORCH_REFERENCE[variant]))


def test_references_hold_the_saved_values(torch_reading) -> None:
    """The reference itself: torch's reading of the default save is the source state dict, the
    DTensor whole, int keys as strings and the empty dict gone (as every DCP round trip does)."""
    src = source_state_dict()
    ref = torch_reading("default")
    assert_same(ref["model"], src["model"])
    assert_same(ref["optimizer"]["state"]["5"], src["optimizer"]["state"][5])
    assert ref["edge"]["tuple_with_tensor"][1] == 3 and "empty_dict" not in ref["edge"]
    assert torch.equal(torch_reading("multichunk_default")["st"], MULTICHUNK_FULL)


def test_safetensors_serialized_chunks_are_kernel_copied(variants: Path, tmp_path: Path) -> None:
    """Chunks of the blob are raw elements at known offsets, like any other DCP chunk."""
    result = reshard.convert(variants / "safetensors_fmt", tmp_path / "x.pt", quiet=True)
    assert result.kernel_bytes == result.bytes > 0


@pytest.mark.parametrize("variant", HF_READ)
def test_hf_writer_output_reads_as_saved(variant: str, variants: Path, tmp_path: Path) -> None:
    model = source_state_dict()["model"]
    if variant == "hf_consolidated":  # floats only: torch's consolidation cannot size ints or complex
        model = {k: v for k, v in model.items() if k not in ("cplx", "scalar_i64")}
        assert (variants / variant / "sharded").is_dir()  # left behind by torch; must not confuse us
    assert_same(_convert(variants / variant, tmp_path / "x.pt"), {f"model.{k}": v for k, v in model.items()})


def test_hf_shards_become_one_tensor_with_a_chunk_per_file(variants: Path) -> None:
    cat = detect_format(variants / "hf_sharded").read(variants / "hf_sharded")
    sharded = cat.tensors["model.sharded"]
    assert sharded.shape == (5, 3) and sorted(c.box.offsets for c in sharded.chunks) == [(0, 0), (3, 0)]
    assert not any(k.startswith("DCP_") for k in (cat.facts.safetensors_metadata or {}))  # not carried on


@pytest.mark.parametrize("variant", list(REFUSED))
def test_variant_is_refused_with_one_line(variant: str, variants: Path, tmp_path: Path) -> None:
    proc = cli("convert", variants / variant, tmp_path / "x.pt", "--quiet")
    assert_one_line_error(proc, *REFUSED[variant])
    assert not (tmp_path / "x.pt").exists()


def test_no_collectives_folder_is_detected_and_merged(variants: Path) -> None:
    src = variants / "no_collectives"
    assert not (src / ".metadata").exists() and detect_format(src).name == "dcp"
    cat = DCPFormat().read(src)
    assert sorted(c.box.offsets for c in cat.tensors["model.sharded"].chunks) == [(0, 0), (3, 0)]


# ------------------------------------------------------------------ rules, on edited fixtures


def _copy(variants: Path, name: str, tmp: Path) -> Path:
    return Path(shutil.copytree(variants / name, tmp / name))


def _edit_metadata(meta_path: Path, edit) -> None:
    meta = pickle.loads(meta_path.read_bytes())  # torch's own fixture: trusted
    edit(meta)
    meta_path.write_bytes(pickle.dumps(meta))


def _info(meta, fqn: str, offset: tuple[int, ...] | None = None):
    return next(v for k, v in meta.storage_data.items() if k.fqn == fqn and (offset is None or tuple(k.offset) == offset))


def _refused(src: Path, *needles: str) -> None:
    proc = cli("convert", src, src.parent / "out.pt", "--quiet")
    assert_one_line_error(proc, *needles)


def test_a_record_overlapping_another_is_refused(variants: Path, tmp_path: Path) -> None:
    src = _copy(variants, "default", tmp_path)

    def grow(meta) -> None:  # a record reaches one byte into the next record of its file
        infos = sorted((v for v in meta.storage_data.values()), key=lambda v: (v.relative_path, v.offset))
        a, b = next((a, b) for a, b in zip(infos, infos[1:]) if a.relative_path == b.relative_path)
        a.length = b.offset - a.offset + 1

    _edit_metadata(src / ".metadata", grow)
    _refused(src, ".distcp: the torch.save archive of ", "overlaps the torch.save archive of ")


def test_a_record_reaching_into_the_safetensors_header_is_refused(variants: Path, tmp_path: Path) -> None:
    src = _copy(variants, "safetensors_fmt", tmp_path)

    def grow(meta) -> None:  # the last object before the blob runs 16 bytes into the blob's header
        objects = [v for k, v in meta.storage_data.items() if k.offset is None]
        blob = next(v for k, v in meta.storage_data.items() if k.offset is not None
                    and v.relative_path in {o.relative_path for o in objects})
        last = max((o for o in objects if o.relative_path == blob.relative_path), key=lambda v: v.offset)
        last.length = blob.offset - last.offset + 16

    _edit_metadata(src / ".metadata", grow)
    _refused(src, ".distcp: the torch.save archive of object ", "overlaps the safetensors header at byte ")


def test_a_record_pointing_into_the_safetensors_header_is_refused(variants: Path, tmp_path: Path) -> None:
    src = _copy(variants, "safetensors_fmt", tmp_path)

    def move(meta) -> None:  # an object's record moved 8 bytes into the blob of its file
        obj = _info(meta, "extra.lr")
        obj.offset = next(v.offset for k, v in meta.storage_data.items() if k.offset is not None
                          and v.relative_path == obj.relative_path) + 8

    _edit_metadata(src / ".metadata", move)
    _refused(src, ".distcp: object 'extra.lr' at byte ", "is neither a torch.save archive nor a safetensors header")


def _blob_file(src: Path, fqn: str, offset: tuple[int, ...]) -> Path:
    meta = pickle.loads((src / ".metadata").read_bytes())
    return src / _info(meta, fqn, offset).relative_path


def test_a_chunk_the_blob_does_not_hold_is_refused(variants: Path, tmp_path: Path) -> None:
    """DCP_SHARDING_INFO must name the chunk .metadata places there (torch's multichunk loss
    is the real case: test_variant_is_refused_with_one_line)."""
    src = _copy(variants, "safetensors_fmt", tmp_path)
    data = _blob_file(src, "model.sharded", (3, 0))
    old = b'\\"model.sharded\\": {\\"saved_offsets\\": [3, 0]}'
    assert data.read_bytes().count(old) == 1
    data.write_bytes(data.read_bytes().replace(old, old.replace(b"[3, 0]", b"[4, 0]")))
    _refused(src, f"{data.name} (safetensors data at byte ", ".metadata places chunk (3, 0) of 'model.sharded' here, "
             "but only its chunk at (4, 0) is stored")


def test_a_blob_tensor_of_another_dtype_is_refused(variants: Path, tmp_path: Path) -> None:
    src = _copy(variants, "safetensors_fmt", tmp_path)
    data = _blob_file(src, "model.sharded", (3, 0))
    old = b'"model.sharded":{"dtype":"F32"'
    assert data.read_bytes().count(old) == 1
    data.write_bytes(data.read_bytes().replace(old, old.replace(b"F32", b"I32")))
    _refused(src, "'model.sharded' is stored as torch.int32 [2, 3], .metadata says torch.float32 [2, 3]")


def test_a_truncated_file_is_refused(variants: Path, tmp_path: Path) -> None:
    src = _copy(variants, "safetensors_fmt", tmp_path)
    data = _blob_file(src, "model.sharded", (3, 0))
    data.write_bytes(data.read_bytes()[:-10])
    _refused(src, data.name, "(truncated?)")


def test_zstd_without_zstandard_names_the_extra(variants: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard now raises ImportError
    _refused(variants / "zstd", ".distcp: is zstd-compressed (DCP's ZStandard extension), which needs the zstd extra: "
             "pip install 'reshard[zstd]'")


def test_unknown_transforms_are_refused(variants: Path, tmp_path: Path) -> None:
    src = _copy(variants, "zstd", tmp_path)
    _edit_metadata(src / ".metadata", lambda meta: setattr(_info(meta, "extra.lr"), "transform_descriptors", ["stream.gzip/1"]))
    _refused(src, "object 'extra.lr' at byte ", "is stored through transforms ['stream.gzip/1']; reshard reads only")


def test_a_zstd_frame_cut_short_is_refused_when_read(variants: Path, tmp_path: Path) -> None:
    src = _copy(variants, "zstd", tmp_path)
    _edit_metadata(src / ".metadata", lambda meta: setattr(_info(meta, "model.big", (0, 0)), "length",
                                                           _info(meta, "model.big", (0, 0)).length - 5))
    _refused(src, "'model.big' chunk (0, 0): zstd frame runs past the end of its record (truncated?)")


def test_zstd_chunks_serve_any_box_in_any_order(variants: Path) -> None:
    data = DCPFormat().read(variants / "zstd").tensors["model.big"].chunks[0].data
    big = source_state_dict()["model"]["big"]
    for box in (Box((200, 0), (10, 128)), Box((0, 0), (5, 128)), Box((3, 5), (70, 9)), Box((255, 127), (1, 1))):
        assert torch.equal(data.read(box), big[box.as_slices()]), box


def test_objects_are_read_only_when_asked_for(variants: Path, tmp_path: Path, torch_reading) -> None:
    """An object blob the allow-list refuses stops a conversion that keeps it, not one that keeps the model."""
    import io

    src = _copy(variants, "default", tmp_path)
    buf = io.BytesIO()
    torch.save({"x": pickle.PickleBuffer}, buf)  # a class the allow-list does not know
    meta = pickle.loads((src / ".metadata").read_bytes())
    info = _info(meta, "extra.lr")
    at = (src / info.relative_path).stat().st_size
    with open(src / info.relative_path, "ab") as f:
        f.write(buf.getvalue())
    info.offset, info.length = at, len(buf.getvalue())
    (src / ".metadata").write_bytes(pickle.dumps(meta))

    assert isinstance(DCPFormat().read(src).objects, ObjectTable)
    model = _convert(src, tmp_path / "model.pt", only="model")
    assert_same(model, torch_reading("default")["model"])
    _refused(src, info.relative_path, "not on reshard's allow-list")


def test_an_object_retyping_a_storage_is_refused(variants: Path, tmp_path: Path) -> None:
    """A byte object whose second tensor (int16) names the first one's float32 storage, as
    torch.save would not write it: torch's DCP reader gives the second float32 [1, 2, 3, 4];
    reshard refuses it, naming both, plain or zstd-compressed."""
    import io

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.fixtures import onto, save_editing_refs, torch_reading_of_retyped

    a, b = torch.tensor([1.0, 2, 3, 4]), torch.tensor([5, 6, 7, 8], dtype=torch.int16)
    buf = io.BytesIO()
    save_editing_refs((a, b), buf, onto(b, a))
    for variant in ("default", "zstd"):
        src = _copy(variants, variant, tmp_path)
        meta = pickle.loads((src / ".metadata").read_bytes())
        info = _info(meta, "extra.lr")
        blob = buf.getvalue()
        if info.transform_descriptors:
            import zstandard

            blob = zstandard.ZstdCompressor().compress(blob)
        at = (src / info.relative_path).stat().st_size
        with open(src / info.relative_path, "ab") as f:
            f.write(blob)
        info.offset, info.length = at, len(blob)
        (src / ".metadata").write_bytes(pickle.dumps(meta))
        def torch_reads(variant: str = variant) -> torch.Tensor:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    dcp_to_torch_save(src, tmp_path / f"{variant}.pt")
                except BaseException as e:  # noqa: BLE001 - dcp's CheckpointException: the rank's error inside
                    raise RuntimeError(str(e)) from None
            return torch.load(tmp_path / f"{variant}.pt", weights_only=True)["extra"]["lr"][1]

        theirs = torch_reading_of_retyped(torch_reads)
        assert theirs is None or (theirs.dtype == torch.float32 and theirs.tolist() == [1, 2, 3, 4])
        _refused(src, "tensors 'extra.lr.0' and 'extra.lr.1' share a storage with different dtypes ('extra.lr.0' "
                      "float32, 'extra.lr.1' int16)")


# ------------------------------------------------------- use_collectives=False, edited


def test_a_missing_rank_metadata_is_refused(variants: Path, tmp_path: Path) -> None:
    src = _copy(variants, "no_collectives", tmp_path)
    (src / "__1.metadata").unlink()
    _refused(src, "no_collectives: has per-rank metadata (use_collectives=False) for ranks [0] but no __1.metadata")


def test_ranks_disagreeing_on_a_tensor_are_refused(variants: Path, tmp_path: Path) -> None:
    src = _copy(variants, "no_collectives", tmp_path)
    _edit_metadata(src / "__1.metadata", lambda meta: setattr(meta.state_dict_metadata["model.w"], "size", torch.Size([7, 6])))
    _refused(src, "__1.metadata: 'model.w' is torch.float32 [7, 6] here but torch.float32 [7, 5] in __0.metadata")


def _record_bytes(src: Path, rank: int, fqn: str, offset: tuple[int, ...] | None) -> tuple[Path, int, int]:
    info = _info(pickle.loads((src / f"__{rank}.metadata").read_bytes()), fqn, offset)
    return src / info.relative_path, info.offset, info.length


def test_replicated_values_that_differ_between_ranks_are_refused(variants: Path, tmp_path: Path) -> None:
    src = _copy(variants, "no_collectives", tmp_path)
    path, at, n = _record_bytes(src, 1, "model.w", (0, 0))  # rank 1's copy: one element changed
    data = bytearray(path.read_bytes())
    value = (torch.arange(35, dtype=torch.float32).reshape(7, 5) / 4)[6, 4].numpy().tobytes()
    assert data[at:at + n].count(value) == 1
    k = data.index(value, at)
    data[k] ^= 1
    path.write_bytes(bytes(data))
    _refused(src, "__1_0.distcp: 'model.w' differs from the copy in __0_0.distcp")

    src = _copy(variants, "no_collectives", tmp_path / "obj")
    path, at, n = _record_bytes(src, 1, "extra.lr", None)  # rank 1's copy of an object: 0.1 -> 0.2
    data = bytearray(path.read_bytes())
    data[at:at + n] = data[at:at + n].replace(torch.tensor(0.1, dtype=torch.float64).numpy().tobytes()[::-1],
                                              torch.tensor(0.2, dtype=torch.float64).numpy().tobytes()[::-1])
    path.write_bytes(bytes(data))
    _refused(src, "__1_0.distcp: object 'extra.lr' differs from the copy in __0_0.distcp")
