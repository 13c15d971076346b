"""Real torch_checkpointing 0.1.1 folders (tests/data/torch_checkpointing: a 2-rank FSDP2 model with
uneven rows and an empty shard, AdamW after two steps, saved by torch_checkpointing itself under
torch 2.13 and 2.15, with its model in torch and in safetensors files, and without a resharder)
read as one checkpoint. Every output is judged by outside readers against the full state torch
gathered when it saved (``reference/``): the safetensors package, ``torch.load``, zarr-python,
torch's DCP reader, ``dcp.load`` on 3 gloo ranks and torch_checkpointing's own resharding loader.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from reshard.formats.registry import detect_format
from safetensors.torch import load_file
from safetensors.torch import save_file as save_safetensors

import reshard
from reshard.core.conventions import detect_layout
from reshard.core.errors import CorruptCheckpointError, NewerFormatError, UnsafeCheckpointError, UnsupportedFormatError
from reshard.core.regions import StoredRegion
from reshard.safe_pickle.unpickler import safe_loads
from tests.dist import HANG_GUARD, run_world
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as run_cli

DATA = Path(__file__).resolve().parents[1] / "data" / "torch_checkpointing"
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "fixtures"
VERSIONS = ("torch-2.13.0", "torch-2.15.0")
KINDS = ("torch", "safetensors", "plain")  # plain: saved without a resharder, no metadata.pkl
FOLDERS = [DATA / v / k for v in VERSIONS for k in KINDS]


def _ids(p: Path) -> str:
    return f"{p.parent.name}/{p.name}"


def _reference(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    ref = folder.parent / "reference"
    return load_file(ref / "model.safetensors"), torch.load(ref / "optim.pt", weights_only=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: Any, b: Any, where: str) -> None:
    """Bit equality of nested state: tensors by dtype, shape and bytes, containers by type and keys."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(_bits(a), _bits(b)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), (where, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def _no_tensor_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a float tensor's bytes fails: the checkpoint's tensors are all float32 (a DTensor's
    mesh keeps its rank order in an int tensor, which is metadata)."""
    for method in ("read", "read_from", "read_array", "read_all"):
        def refuse(region: StoredRegion, *args: Any, _method: Any = getattr(StoredRegion, method), **kwargs: Any) -> Any:
            assert not region.dtype.is_floating_point, f"read() read tensor data of {region}"
            return _method(region, *args, **kwargs)

        monkeypatch.setattr(StoredRegion, method, refuse)


@pytest.mark.parametrize("folder", FOLDERS, ids=_ids)
def test_folder_reads_as_its_reference(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref_model, ref_optim = _reference(folder)
    assert detect_format(folder).name == "torch-checkpointing"
    with monkeypatch.context() as m:
        if folder.name != "plain":  # only a save without a resharder proves replicas by their bytes
            _no_tensor_reads(m)
        cat = reshard.inspect(folder)
    assert cat.format == "torch-checkpointing" and cat.facts.source_world_size == 2
    want = {f"model.{k}" for k in ref_model} | {f"optim.state.{fqn}.{key}" for fqn, s in ref_optim["state"].items()
                                               for key in s}
    assert set(cat.tensors) == want
    assert {"step", "optim.param_groups.0.lr", "optim.param_groups.0.params"} <= set(cat.objects)
    assert cat.facts.source_mesh == (2,) and cat.facts.source_placements["model.head.weight"] == ["Shard(0)"]
    assert detect_layout(cat).name == "torch-optim"  # --only model, load_model(optimizer=) follow from it
    assert [len(cat.tensors[n].chunks) for n in ("model.emb.weight", "model.head.weight", "model.scale")] == [2, 1, 1]
    assert run_cli("inspect", folder).returncode == 0
    proc = run_cli("inspect", folder, "--json")
    assert proc.returncode == 0 and '"format": "torch-checkpointing"' in proc.stdout

    # --only model: the model's state dict, as torch gathered it.
    model = tmp_path / "model.safetensors"
    assert run_cli("convert", folder, model, "--only", "model", "--quiet").returncode == 0
    _same(load_file(model), ref_model, "model")

    # Everything, into each output format, read back by the library of that format.
    whole = tmp_path / "all.pt"
    assert run_cli("convert", folder, whole, "--quiet").returncode == 0
    got = torch.load(whole, weights_only=True)
    _same(got, {"model": ref_model, "optim": ref_optim, "step": 2}, "torch")

    flat = tmp_path / "all.safetensors"
    assert run_cli("convert", folder, flat, "--quiet").returncode == 0
    _same(load_file(flat), {n: _flat_ref(n, ref_model, ref_optim) for n in want}, "safetensors")

    zarr = pytest.importorskip("zarr")
    store = tmp_path / "all.zarr"
    assert run_cli("convert", folder, store, "--quiet").returncode == 0
    for name in want:
        ref = _flat_ref(name, ref_model, ref_optim)
        array = zarr.open_array(store / name, mode="r")[...]
        assert tuple(array.shape) == tuple(ref.shape) and array.tobytes() == ref.numpy().tobytes(), name

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp = tmp_path / "dcp"
    assert run_cli("convert", folder, dcp, "--quiet").returncode == 0
    dcp_to_torch_save(dcp, tmp_path / "dcp.pt")
    _same(torch.load(tmp_path / "dcp.pt", weights_only=True), {"model": ref_model, "optim": ref_optim, "step": 2}, "dcp")

    for other in (whole, dcp, DATA / VERSIONS[0] / "torch"):  # the same training under either torch
        proc = run_cli("verify", folder, other)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def _flat_ref(name: str, ref_model: dict, ref_optim: dict) -> torch.Tensor:
    if name.startswith("model."):
        return ref_model[name.removeprefix("model.")]
    fqn, _, key = name.removeprefix("optim.state.").rpartition(".")
    return ref_optim["state"][fqn][key]


# ------------------------------------------------------------------------------ three ranks


def _tiny(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(SCRIPTS))
    from make_torch_checkpointing import Tiny  # the model the fixtures were saved from

    torch.manual_seed(1234)  # not the saved values: every one must come from the checkpoint
    model = Tiny()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.emb, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.5)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _check(model: torch.nn.Module, opt: torch.optim.Optimizer, folder: str, where: str, groups: bool = True) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ref_model, ref_optim = _reference(Path(folder))
    msd, osd = get_state_dict(model, opt)
    _same({k: _full(v) for k, v in msd.items()}, ref_model, f"{where} model")
    _same({fqn: {k: _full(v) for k, v in s.items()} for fqn, s in osd["state"].items()}, ref_optim["state"],
          f"{where} optim")
    for key in ("lr", "weight_decay", "betas", "eps") if groups else ():
        assert opt.param_groups[0][key] == ref_optim["param_groups"][0][key], (where, key)


def _three_ranks(rank: int, world: int, folders: list[str], meshed: list[str]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch_checkpointing import CheckpointManager, ItemSpec, SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder

    for folder, out in zip(folders, meshed):
        # torch's dcp.load of reshard's --to-mesh 3 output
        model, opt = _tiny(world)
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=out)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        _check(model, opt, folder, f"dcp.load {out}")
        assert len(reshard.inspect(out).tensors["model.emb.weight"].chunks) == 3  # 3 + 3 + 1 rows

        # reshard.load_model from the folder itself, both ways of reading
        for mode in ("rank0", "parallel"):
            model, opt = _tiny(world)
            result = reshard.load_model(model, folder, optimizer=opt, mode=mode, progress=False)
            assert result.missing == [] and result.unexpected == [], (result.missing, result.unexpected)
            _check(model, opt, folder, f"load_model {mode} {folder}")

        # torch_checkpointing's own resharding load agrees (a folder saved with a resharder; on
        # more ranks than saved it reshards the tensors only, hyper-parameters stay as built)
        if Path(folder).name != "plain":
            model, opt = _tiny(world)
            msd, osd = get_state_dict(model, opt)
            manager = CheckpointManager(CheckpointManager.Config(
                save=SyncCheckpointSaverConfig(),
                items={"model": ItemSpec(resharder=DefaultResharder()), "optim": ItemSpec(resharder=DefaultResharder())}))
            manager.load(folder, into={"model": msd, "optim": osd})
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            _check(model, opt, folder, f"torch_checkpointing {folder}", groups=False)


def test_resumes_on_three_ranks(tmp_path: Path) -> None:
    pytest.importorskip("torch_checkpointing")
    meshed = []
    for i, folder in enumerate(FOLDERS):
        out = tmp_path / f"mesh3_{i}"
        assert run_cli("convert", folder, out, "--to-mesh", "3", "--quiet").returncode == 0
        meshed.append(str(out))
    run_world(_three_ranks, 3, [str(f) for f in FOLDERS], meshed, timeout=HANG_GUARD)


# ------------------------------------------------------------------------------ refusals


def _copy(tmp_path: Path, kind: str = "torch") -> Path:
    folder = tmp_path / kind
    shutil.copytree(DATA / VERSIONS[0] / kind, folder)
    return folder


def _rewrite(folder: Path, change: Callable[[dict], None]) -> Path:
    meta = folder / "metadata.pkl"
    d = safe_loads(meta.read_bytes(), {}, origin=meta)  # plain values only
    change(d)
    meta.write_bytes(pickle.dumps(d))
    return folder


def _emb(d: dict, item: str = "model") -> dict:
    return d["metadata"][item]["nested_path_to_metadata"]['["emb.weight"]'][0]["sharding_metadata"]


def _set_sharding_type(d: dict) -> None:
    _emb(d)["type"] = "FancyShardingMetadata"


NEWER = [  # (change, what the one line names)
    (lambda d: d.update(extra=1), "'extra'"),
    (lambda d: d.update(version="3.0"), "'3.0'"),
    (lambda d: d["metadata"]["model"]["rank_to_layout_info"].update(
        {0: {"file_path": "model_0.pt", "serialization_format": {"type": "ZipSerialization"}}}), "'ZipSerialization'"),
    (lambda d: d["metadata"]["model"]["rank_to_layout_info"].update(
        {0: {"file_path": "model_0.pt", "serialization_format": {"type": "TorchSerialization", "zstd": 3}}}), "'zstd'"),
    (lambda d: _emb(d)["data"].update(placements=[{"type": "Partial", "reduce_op": "sum"}]), "'Partial'"),
    (lambda d: _emb(d)["data"].update(dtype="torch.float128"), "'torch.float128'"),
    (lambda d: _emb(d)["data"]["mesh_spec"].update(mesh_layout=(1,)), "'mesh_layout'"),
    (lambda d: _emb(d)["data"].update(offsets=[0, 0]), "'offsets'"),
    (_set_sharding_type, "'FancyShardingMetadata'"),
]


@pytest.mark.parametrize("change,named", NEWER, ids=[n.strip("'") for _, n in NEWER])
def test_what_it_does_not_know_is_refused_as_newer(change: Callable[[dict], None], named: str, tmp_path: Path) -> None:
    folder = _rewrite(_copy(tmp_path), change)
    assert_one_line_error(run_cli("inspect", folder), "metadata.pkl", named, "upgrade reshard")
    with pytest.raises(NewerFormatError):
        reshard.inspect(folder)


REFUSED = [  # (change, error class, what the one line names)
    (lambda d: d.update(version="1.0"), UnsupportedFormatError, "version '1.0'"),
    (lambda d: d.pop("version"), UnsupportedFormatError, "version '1.0'"),  # the library's default
    (lambda d: _emb(d)["data"].update(placements=[{"type": "StridedShard", "dim": 0, "split_factor": 2}]),
     UnsupportedFormatError, "StridedShard"),
    (lambda d: _emb(d).update(type="default_tensor_v1"), UnsupportedFormatError, "default_tensor_v1"),
    (lambda d: d["metadata"]["model"]["rank_to_layout_info"].update(
        {1: {"file_path": "model_1.json", "serialization_format": {"type": "JsonSerialization", "cls": None}}}),
     UnsupportedFormatError, "JsonSerialization"),
    (lambda d: d["metadata"]["model"]["rank_to_layout_info"].update(
        {1: {"file_path": "../model_1.pt", "serialization_format": {"type": "TorchSerialization"}}}),
     CorruptCheckpointError, "'../model_1.pt'"),
    (lambda d: d["metadata"]["model"]["rank_to_layout_info"].update(
        {1: {"file_path": "optim_1.pt", "serialization_format": {"type": "TorchSerialization"}}}),
     CorruptCheckpointError, "'optim_1.pt'"),
    (lambda d: d["metadata"]["model"]["rank_to_layout_info"].pop(1), CorruptCheckpointError, "rank_to_layout_info"),
    (lambda d: _emb(d)["data"].update(global_shape=[8, 5]), CorruptCheckpointError, "model_0.pt"),
    (lambda d: _emb(d)["data"].update(dtype="torch.bfloat16"), CorruptCheckpointError, "bfloat16"),
    # the same shards on a mesh whose ranks are swapped (every tensor's: the pickle shares one
    # mesh_spec): each file holds the other rank's rows
    (lambda d: _emb(d)["data"]["mesh_spec"].update(mesh_data=(1, 0)), CorruptCheckpointError, "at (1,)"),
    (lambda d: _emb(d).update(type=None), NewerFormatError, "None"),
    (lambda d: d["metadata"]["model"]["nested_path_to_metadata"].pop('["proj.bias"]'), CorruptCheckpointError,
     "proj.bias"),
    (lambda d: _emb(d)["data"].pop("stride"), CorruptCheckpointError, "'stride'"),
    (lambda d: d.update(world_size=3), CorruptCheckpointError, "rank_to_layout_info"),
]


@pytest.mark.parametrize("change,error,named", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_what_it_cannot_place_is_refused_by_name(change: Callable[[dict], None], error: type, named: str,
                                                 tmp_path: Path) -> None:
    folder = _rewrite(_copy(tmp_path), change)
    assert_one_line_error(run_cli("inspect", folder), named)
    with pytest.raises(error):
        reshard.inspect(folder)


def test_files_that_disagree_with_the_metadata_are_refused(tmp_path: Path) -> None:
    # a safetensors rank file with a tensor metadata.pkl does not give it
    folder = _copy(tmp_path, "safetensors")
    part = load_file(folder / "model_1.safetensors")
    save_safetensors({**part, "extra.weight": torch.zeros(2)}, folder / "model_1.safetensors")
    assert_one_line_error(run_cli("inspect", folder), "model_1.safetensors", "'extra.weight'")
    # a missing rank file
    folder = _copy(tmp_path / "b")
    (folder / "optim_1.pt").unlink()
    assert_one_line_error(run_cli("inspect", folder), "optim_1.pt", "missing")
    # a file neither metadata.pkl nor the default names account for
    folder = _copy(tmp_path / "c")
    (folder / "notes.txt").write_text("hello")
    assert_one_line_error(run_cli("inspect", folder), "notes.txt", "cannot tell what it holds")
    # an item's files for too few ranks
    folder = _copy(tmp_path / "d")
    (folder / "step_1.pt").unlink()
    assert_one_line_error(run_cli("inspect", folder), "'step'", "2 ranks")


class _Boom:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_hostile_metadata_pkl_is_refused_without_running(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    marker = tmp_path / "ran"
    d = safe_loads((folder / "metadata.pkl").read_bytes(), {}, origin="metadata.pkl")
    d["metadata"]["model"]["rank_to_layout_info"][0] = _Boom(marker)
    (folder / "metadata.pkl").write_bytes(pickle.dumps(d))
    assert detect_format(folder).name == "torch-checkpointing"  # detection does not unpickle
    assert_one_line_error(run_cli("inspect", folder), "metadata.pkl", "system")
    with pytest.raises(UnsafeCheckpointError):
        reshard.inspect(folder)
    assert not marker.exists()


# ------------------------------------------------------------------------------ without a resharder


def test_a_folder_without_metadata_is_read_where_its_files_prove_it(tmp_path: Path) -> None:
    one = tmp_path / "one"  # one rank: every tensor whole
    one.mkdir()
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "lr": 0.5}, one / "model_0.pt")
    torch.save(7, one / "step_0.pt")
    cat = reshard.inspect(one)
    assert cat.format == "torch-checkpointing" and set(cat.tensors) == {"model.w"} and cat.objects["step"] == 7
    assert torch.equal(cat.tensors["model.w"].chunks[0].data.read_all(), torch.arange(6.0).reshape(2, 3))

    same = tmp_path / "same"  # two ranks, the same plain tensor: a replica, read once
    same.mkdir()
    for r in (0, 1):
        torch.save({"w": torch.ones(3), "seed": r}, same / f"model_{r}.pt")
    cat = reshard.inspect(same)
    assert len(cat.tensors["model.w"].chunks) == 1 and set(cat.objects) == {"model.seed.rank0", "model.seed.rank1"}

    differ = tmp_path / "differ"  # two ranks, different plain tensors: nothing says where each belongs
    differ.mkdir()
    for r in (0, 1):
        torch.save({"w": torch.full((3,), float(r))}, differ / f"model_{r}.pt")
    assert_one_line_error(run_cli("inspect", differ), "'model.w'", "without a resharder")
    with pytest.raises(UnsupportedFormatError):
        reshard.inspect(differ)

    gap = tmp_path / "gap"  # ranks 0 and 2: not one set of ranks
    gap.mkdir()
    for r in (0, 2):
        torch.save({"w": torch.ones(3)}, gap / f"model_{r}.pt")
    assert detect_format(tmp_path / "same").name == "torch-checkpointing"
    with pytest.raises(UnsupportedFormatError, match="not a checkpoint reshard recognizes"):
        detect_format(gap)


def test_other_per_rank_folders_keep_their_format(tmp_path: Path) -> None:
    for names in (("rank0.pt", "rank1.pt"), ("checkpoint_0.pt", "checkpoint_1.pt"), ("model_rank_0.pt", "model_rank_1.pt")):
        folder = tmp_path / names[0].split(".")[0]
        folder.mkdir()
        for name in names:
            torch.save({"w": torch.ones(2)}, folder / name)
        assert detect_format(folder).name == "torch-ranks", names


# ------------------------------------------------- found by the adversarial review of 2026-11-28

# --- torch_checkpointing reader: hostile metadata.pkl -----------------------------------------


def _group(shape: list[int]) -> list[dict]:
    return [{"ranks": (0,), "sharding_metadata": {"type": "DTensorShardingMetadata", "data": {
        "global_shape": shape, "dtype": "torch.float32", "stride": [1] * len(shape),
        "mesh_spec": {"device_type": "cpu", "mesh_shape": (1,), "mesh_data": (0,), "mesh_dim_names": None},
        "placements": [{"type": "Replicate"}]}}}]


def _tc_folder(folder: Path, items: dict, world: int = 1) -> Path:
    folder.mkdir()
    meta = {"version": "2.0", "world_size": world, "metadata": items}
    (folder / "metadata.pkl").write_bytes(pickle.dumps(meta))
    return folder


def test_tc_items_whose_names_collide_are_refused(tmp_path: Path) -> None:
    """Items 'model' (path x.y) and 'model.x' (path y) both make 'model.x.y': one tensor is
    silently dropped (exit 0). torch_checkpointing allows no '.' in an item key."""
    folder = _tc_folder(tmp_path / "tc", {
        "model": {"nested_path_to_metadata": {json.dumps(["x", "y"]): _group([2])}, "rank_to_layout_info": {0: None}},
        "model.x": {"nested_path_to_metadata": {json.dumps(["y"]): _group([3])}, "rank_to_layout_info": {0: None}}})
    torch.save({"x": {"y": torch.ones(2)}}, folder / "model_0.pt")
    torch.save({"y": torch.zeros(3)}, folder / "model.x_0.pt")
    assert_one_line_error(run_cli("inspect", folder), "metadata.pkl")


def test_tc_rank_keys_of_the_wrong_type_are_one_line(tmp_path: Path) -> None:
    folder = _tc_folder(tmp_path / "tc", {
        "model": {"nested_path_to_metadata": {json.dumps(["w"]): _group([2])},
                  "rank_to_layout_info": {"0": None, 1: None}}}, world=2)  # a str key beside an int one
    torch.save({"w": torch.ones(2)}, folder / "model_0.pt")
    torch.save({"w": torch.ones(2)}, folder / "model_1.pt")
    proc = run_cli("inspect", folder)
    assert "internal error" not in proc.stderr, proc.stderr
    assert_one_line_error(proc, "metadata.pkl", "rank_to_layout_info")


def test_tc_a_huge_world_size_is_refused_not_allocated(tmp_path: Path) -> None:
    """world_size 10**12 with two layouts: set(range(world_size)) is built before the layouts are
    compared (hangs, then runs out of memory). Run under a 2 GiB address-space allowance."""
    folder = _tc_folder(tmp_path / "tc", {
        "model": {"nested_path_to_metadata": {json.dumps(["w"]): _group([2])}, "rank_to_layout_info": {0: None}}},
        world=10**12)
    torch.save({"w": torch.ones(2)}, folder / "model_0.pt")
    code = ("import resource, sys, psutil\nimport reshard\nfrom reshard.core.errors import CorruptCheckpointError\n"
            "limit = psutil.Process().memory_info().vms + (2 << 30)\n"
            "resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))\n"
            "try:\n    reshard.inspect(sys.argv[1])\nexcept CorruptCheckpointError as e:\n    print('refused', e)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=HANG_GUARD)
    assert proc.returncode == 0 and proc.stdout.startswith("refused"), proc.stderr[-500:]
