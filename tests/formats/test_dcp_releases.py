"""Checkpoints written by every torch release reshard supports (tests/data/compat/torch-*, each
made by that release itself with scripts/make_compat_fixtures.py), read exactly: each DCP writer
variant, HuggingFaceStorageWriter's output, the ``_experimental`` checkpointer's per-rank files
and the torch.save file convert to what that torch's
``get_state_dict(full_state_dict=True)`` gave, tensor for tensor and object for object;
non-contiguous and channels_last tensors (torch 2.15 records their strides) to the tensors saved;
``load_model`` resumes each release's 2-rank checkpoint on 3 FSDP2 ranks. Every release also
loaded reshard's own DCP output (reshard-mesh3) equal to its source when its fixtures were made,
and reshard still writes that output byte for byte. A ``.metadata`` with what reshard does not
know is refused by name."""

from __future__ import annotations

import importlib.util
import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from reshard.formats.dcp.metadata import NewerFormatError
from safetensors.torch import load_file

import reshard
from reshard.core.torch_support import FLOOR, NEWEST_TESTED, TESTED, release
from tests.dist import HANG_GUARD, run_world
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as run_cli

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "tests" / "data" / "compat"
RELEASES = sorted((p for p in COMPAT.glob("torch-*") if p.is_dir()), key=lambda p: release(p.name[6:]) or (0, 0))
DCP_VARIANTS = ("dcp_default", "dcp_per_item", "dcp_safetensors", "dcp_zstd")
HF_VARIANTS = ("hf_sharded", "hf_consolidated")
EXPERIMENTAL = "experimental_sync"  # torch.distributed.checkpoint._experimental: torch.save per rank


def _script():
    spec = importlib.util.spec_from_file_location("make_compat_fixtures", ROOT / "scripts" / "make_compat_fixtures.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _same(got: object, want: object, where: str) -> None:
    """Bit-equal tensors of the same dtype and shape; equal objects of the same type."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, (where, got.dtype, want.dtype, got.shape, want.shape)
        a, b = got.contiguous().reshape(-1), want.contiguous().reshape(-1)
        assert a.view(torch.uint8).equal(b.view(torch.uint8)), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(map(str, got)) == sorted(map(str, want)), (where, list(got), list(want))
        by_name = {str(k): v for k, v in got.items()}
        for k, v in want.items():
            _same(by_name[str(k)], v, f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), where
        for i, (x, y) in enumerate(zip(got, want)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_fixtures_cover_every_release_pyproject_accepts() -> None:
    """The floor pyproject declares, every release named tested, and the newest: each has its
    fixtures, written by that release (its manifest says so), with every writer variant."""
    have = {p.name[6:] for p in RELEASES}
    assert set(TESTED) <= have, sorted(set(TESTED) - have)
    floor = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert floor and floor.group(1) == FLOOR
    assert any(release(v) == release(FLOOR) for v in have) and any(release(v) == release(NEWEST_TESTED) for v in have)
    for folder in RELEASES:
        manifest = _manifest(folder)
        assert manifest["torch"].split("+")[0] == folder.name[6:], manifest["torch"]
        assert set(DCP_VARIANTS + HF_VARIANTS + (EXPERIMENTAL,)) <= set(manifest["written"]), (folder.name, manifest["skipped"])
        for name in manifest["written"]:
            assert (folder / name).exists(), (folder.name, name)


@pytest.mark.parametrize("folder", RELEASES, ids=lambda p: p.name)
def test_every_variant_converts_to_torchs_full_state_dict(folder: Path, tmp_path: Path) -> None:
    full = torch.load(folder / "full_state_dict.pt", weights_only=True)
    for name in (*DCP_VARIANTS, EXPERIMENTAL, "full_state_dict.pt"):
        out = tmp_path / f"{name}.out.pt"
        reshard.convert(folder / name, out)
        _same(torch.load(out, weights_only=True), full, f"{folder.name}/{name}")
    for name in HF_VARIANTS:
        out = tmp_path / f"{name}.safetensors"
        reshard.convert(folder / name, out)
        _same(load_file(out), full["model"], f"{folder.name}/{name}")
        reshard.convert(folder / name, tmp_path / f"{name}.pt")
        _same(torch.load(tmp_path / f"{name}.pt", weights_only=True), full["model"], f"{folder.name}/{name} as torch")
    saved = load_file(folder / "strided.safetensors")
    for name in ("strided", "strided.pt"):
        out = tmp_path / f"{name}.safetensors"
        reshard.convert(folder / name, out)
        _same(load_file(out), saved, f"{folder.name}/{name}")


def test_torch_2_15_records_strides_and_reshard_checks_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2.15's TensorProperties has a sixth field, the tensor's strides; the bytes come from each
    record (which carries its own strides), so the tensors read back as saved (above). Strides
    that do not fit the tensor are refused, not ignored."""
    from reshard.formats.dcp.metadata import read_metadata_file
    from torch.distributed.checkpoint.metadata import TensorProperties

    folder = COMPAT / "torch-2.15.0" / "strided"
    index = read_metadata_file(folder / ".metadata", folder)
    assert set(index.tensors) == {"transposed", "channels_last", "offset_view", "plain"}
    assert b"channels_last" in (folder / ".metadata").read_bytes()

    own = TensorProperties.__getstate__  # 5 fields before torch 2.15, 6 from it on
    monkeypatch.setattr(TensorProperties, "__getstate__", lambda self: (*own(self)[:5], (1, 2, 3, 4, 5, 6, 7)))
    folder = _rewritten(tmp_path, lambda meta: None)
    monkeypatch.undo()
    proc = run_cli("inspect", folder)
    assert_one_line_error(proc, "strides (1, 2, 3, 4, 5, 6, 7) do not fit shape")


def _rewritten(tmp_path: Path, change) -> Path:
    """The 2.13.0 default fixture with ``change(metadata)`` applied, pickled as torch pickles it."""
    folder = tmp_path / "ckpt"
    shutil.copytree(COMPAT / "torch-2.13.0" / "dcp_default", folder)
    with open(folder / ".metadata", "rb") as f:
        meta = pickle.load(f)  # our own fixture, written by torch 2.13 (this test trusts it)
    change(meta)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    return folder


def _extra_metadata_field(meta) -> None:
    meta.checksum_algorithm = "xxh3"


def _extra_tensor_field(meta) -> None:
    next(iter(meta.state_dict_metadata.values())).quantization = "nf4"


def _newer_dcp_version(meta) -> None:
    meta.version = "2.0.0"


@pytest.mark.parametrize("change,needle", [
    (_extra_metadata_field, "Metadata has field 'checksum_algorithm'"),
    (_extra_tensor_field, "TensorStorageMetadata has field 'quantization'"),
    (_newer_dcp_version, "DCP format version '2.0.0'"),
], ids=["metadata-field", "tensor-field", "dcp-version"])
def test_a_newer_format_is_named_not_read(tmp_path: Path, change, needle: str) -> None:
    folder = _rewritten(tmp_path, change)
    proc = run_cli("convert", folder, tmp_path / "out.pt")
    assert_one_line_error(proc, str(folder / ".metadata"), needle, "written by a torch newer than reshard",
                          f"to {NEWEST_TESTED}", "upgrade reshard")
    assert not (tmp_path / "out.pt").exists() and not list(tmp_path.glob(".out.pt*"))
    with pytest.raises(NewerFormatError):
        reshard.inspect(folder)


def test_tensor_properties_of_unknown_length_are_a_newer_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A seventh field after 2.15's six (pickled as torch's own ``__getstate__`` would)."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    own = TensorProperties.__getstate__
    monkeypatch.setattr(TensorProperties, "__getstate__", lambda self: (*own(self)[:5], None, "a new field"))
    folder = _rewritten(tmp_path, lambda meta: None)
    monkeypatch.undo()
    proc = run_cli("inspect", folder)
    assert_one_line_error(proc, "TensorProperties has 7 fields", "written by a torch newer than reshard")


def test_a_dcp_class_reshard_does_not_know_is_a_newer_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A class of torch's DCP package that reshard's allow-list lacks is a newer torch's, as a
    new field is: the refusal says so and to upgrade reshard, not that the file could run code
    (nor to pass --allow-class, which the DCP reader does not take: it builds no stand-ins)."""
    import torch.distributed.checkpoint.metadata as dcp_metadata

    class StorageLayout:  # as a torch newer than reshard might add and pickle into .metadata
        pass

    StorageLayout.__module__, StorageLayout.__qualname__ = dcp_metadata.__name__, "StorageLayout"
    monkeypatch.setattr(dcp_metadata, "StorageLayout", StorageLayout, raising=False)
    folder = _rewritten(tmp_path, lambda meta: setattr(meta, "storage_meta", StorageLayout()))
    monkeypatch.undo()
    klass = "torch.distributed.checkpoint.metadata.StorageLayout"
    for extra in ((), ("--allow-class", klass)):
        proc = run_cli("inspect", folder, *extra)
        assert_one_line_error(proc, str(folder / ".metadata"), klass, "written by a torch newer than reshard",
                              f"to {NEWEST_TESTED}", "upgrade reshard")
        assert "run code" not in proc.stderr and "--allow-class" not in proc.stderr, proc.stderr
    with pytest.raises(NewerFormatError):
        reshard.inspect(folder)


def test_every_release_loads_reshards_dcp_output() -> None:
    """Each release's own ``dcp_to_torch_save`` read reshard-mesh3 (``--to-mesh 3`` of the 2.13.0
    fixture) equal to its source when its fixtures were made; reshard still writes exactly those
    bytes today, so the verdicts hold for this reshard's writer (if this fails after a writer
    change, rerun scripts/compat.sh --fixtures for every release)."""
    script = _script()
    digest = script.folder_digest(COMPAT / "reshard-mesh3")
    for folder in RELEASES:
        manifest = _manifest(folder)
        assert manifest["loads_reshard_mesh3"] == "equal", (folder.name, manifest["loads_reshard_mesh3"])
        assert manifest["reshard_mesh3_sha256"] == digest, folder.name


def test_reshard_still_writes_reshard_mesh3(tmp_path: Path) -> None:
    script = _script()
    out = tmp_path / "mesh3"
    reshard.convert(COMPAT / "torch-2.13.0" / "dcp_default", out, to_mesh="3")
    assert script.folder_digest(out) == script.folder_digest(COMPAT / "reshard-mesh3")


def _resume_every_release(rank: int, world: int, folders: list[str]) -> None:
    """One 3-rank world loads every release's 2-rank checkpoint (imports cost more than loads)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    tiny = _script().Tiny
    mesh = init_device_mesh("cpu", (world,))
    for folder in map(Path, folders):
        full = torch.load(folder / "full_state_dict.pt", weights_only=True)
        for name in ("dcp_default", "dcp_safetensors"):
            torch.manual_seed(99)  # other values than the checkpoint's
            model = tiny()
            for sub in (model.embed, model.proj, model.head):
                fully_shard(sub, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=0.5)
            result = reshard.load_model(model, folder / name, optimizer=opt, progress=False)
            assert result.missing == [] and result.unexpected == [], (result.missing, result.unexpected)
            msd, osd = get_state_dict(model, opt)
            got = {"model": {k: v.full_tensor() for k, v in msd.items()},
                   "optim": {"state": {fqn: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in st.items()}
                                       for fqn, st in osd["state"].items()},
                             "param_groups": osd["param_groups"]}}
            _same(got, full, f"{folder.name}/{name} on {world} ranks")


def test_load_model_resumes_every_release_on_three_ranks() -> None:
    run_world(_resume_every_release, 3, [str(p) for p in RELEASES], timeout=HANG_GUARD)
