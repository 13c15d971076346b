from __future__ import annotations

import pickle
import re
import shutil
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from reshard.formats.registry import detect_format
from reshard.formats.torch import ranks as torch_ranks
from reshard.formats.torch.rank_folder import TorchRanksFormat
from reshard.formats.torch.ranks import rank_files
from reshard.formats.torch.save import TorchSaveFormat, TorchSaveWriter, build_tree, flatten_tree
from reshard.formats.torch.zip import DTensorRef, Record
from safetensors.torch import save_file

import reshard
from reshard.core.boxes import Box
from reshard.core.catalog import Catalog
from reshard.core.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedFormatError, UsageError
from reshard.core.regions import StoredRegion
from reshard.core.sharding import shard_box
from reshard.core.target import Target
from reshard.pipeline.plan import full_target
from tests.dist import HANG_GUARD, run_world
from tests.fixtures import TinyNet, full_tensor, onto, save_editing_refs, torch_reading_of_retyped
from tests.formats.test_dcp import _Evil
from tests.formats.test_torch_zip import _write
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as cli


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(got: Any, want: Any, where: str = "", ordered: bool = True) -> None:
    """Equal values, bit for bit, with the same container types (dict/list/tuple) and key order."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert torch.equal(_bits(got), _bits(want)), where
    elif isinstance(want, dict):
        keys = (list(got), list(want)) if ordered else (sorted(got, key=str), sorted(want, key=str))
        assert isinstance(got, dict) and keys[0] == keys[1], (where, *keys)
        for k in want:
            _same(got[k], want[k], f"{where}.{k}", ordered)
    elif isinstance(want, (list, tuple)) and not isinstance(want, torch.Size):
        assert type(got) is type(want) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}.{i}", ordered)
    else:
        assert got == want and type(got) is type(want), (where, got, want)


def _write_torch(catalog, dst: Path) -> None:
    """What the engine does for the torch writer: bytes as they are, pieces from the tensors."""
    files = TorchSaveWriter(dst).layout(full_target(catalog))
    assert [f.relpath for f in files] == [""]
    _write(dst, files[0].segments, {n: full_tensor(t) for n, t in catalog.tensors.items()})


# ---------------------------------------------------------------------------------- one file


def _zoo() -> dict:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "model": OrderedDict([
            ("layers.0.w", torch.randn(3, 5)),
            ("bf", torch.randn(7).to(torch.bfloat16)),
            ("f8", torch.randn(4).to(torch.float8_e4m3fn)),
            ("ids", torch.arange(5, dtype=torch.int64)),
            ("mask", torch.tensor([True, False, True])),
            ("scalar", torch.tensor(3.5)),
            ("empty", torch.empty(0, 3)),
            ("view", base.t()[1:5]),
            ("param", torch.nn.Parameter(torch.ones(2, 2))),
        ]),
        "optimizer": {  # a plain torch optimizer: int keys, params as ints
            "state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.randn(3, 5)}, 1: {"step": torch.tensor(2.0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0, 1]}],
        },
        "pairs": (torch.ones(2), torch.zeros(3)),
        "history": [torch.full((2,), 7.0), {"note": "x"}],
        "step": 12, "name": "run-1", "nothing": None, "extra": {},
    }


def test_reads_what_torch_saves(tmp_path: Path) -> None:
    value = _zoo()
    torch.save(value, tmp_path / "zoo.pt")
    cat = TorchSaveFormat().read(tmp_path / "zoo.pt")
    assert cat.format == "torch"
    assert list(cat.tensors)[:3] == ["model.layers.0.w", "model.bf", "model.f8"]
    for name in ("layers.0.w", "bf", "f8", "ids", "mask", "scalar", "empty", "view", "param"):
        _same(full_tensor(cat.tensors[f"model.{name}"]), value["model"][name].detach(), name)
    _same(full_tensor(cat.tensors["optimizer.state.0.exp_avg"]), value["optimizer"]["state"][0]["exp_avg"])
    _same(full_tensor(cat.tensors["pairs.1"]), value["pairs"][1])
    _same(full_tensor(cat.tensors["history.0"]), value["history"][0])
    assert cat.paths["model.layers.0.w"] == ("model", "layers.0.w")
    assert cat.paths["optimizer.state.0.step"] == ("optimizer", "state", 0, "step")
    assert cat.paths["optimizer.param_groups.0.betas"] == ("optimizer", "param_groups", 0, "betas")
    assert cat.objects["optimizer.param_groups.0.betas"] == (0.9, 0.95)
    assert cat.objects["optimizer.param_groups.0.params"] == [0, 1]
    assert cat.objects["history.1.note"] == "x" and cat.objects["extra"] == {}
    assert cat.objects["step"] == 12 and cat.objects["nothing"] is None
    assert cat.tensors["model.view"].chunks[0].data.strides is not None  # read in place, not copied


def test_written_file_loads_with_torch_exactly(tmp_path: Path) -> None:
    value = _zoo()
    torch.save(value, tmp_path / "zoo.pt")
    _write_torch(TorchSaveFormat().read(tmp_path / "zoo.pt"), tmp_path / "out.pt")
    want = {**value, "model": dict(value["model"])}
    want["model"]["param"] = want["model"]["param"].detach()
    for mmap in (False, True):
        _same(torch.load(tmp_path / "out.pt", weights_only=True, mmap=mmap), want)
    with zipfile.ZipFile(tmp_path / "out.pt") as z:
        assert z.namelist()[0] == "out/data.pkl"  # archive named after the file, as torch does


def test_hf_bin_with_tied_weights(tmp_path: Path) -> None:
    embed = torch.randn(10, 4)
    sd = OrderedDict([("model.embed_tokens.weight", embed), ("lm_head.weight", embed), ("model.norm.weight", torch.ones(4))])
    path = tmp_path / "pytorch_model.bin"
    torch.save(sd, path)
    assert detect_format(path).name == "torch"
    cat = reshard.inspect(path)
    assert list(cat.tensors) == list(sd)
    assert torch.equal(full_tensor(cat.tensors["lm_head.weight"]), embed)
    no_suffix = tmp_path / "checkpoint"
    shutil.copy(path, no_suffix)
    assert TorchSaveFormat().detect(no_suffix) and not TorchSaveFormat().detect(tmp_path)


def test_tree_round_trip_and_dcp_paths() -> None:
    tree = {"a": {0: {"x": 1}, 2: [3]}, "t": ("s", {"k": 2}), "l": [[1, {"z": 0}], 5]}
    flat = flatten_tree(tree, "mem")
    assert build_tree([v for v in flat.leaves.values()], flat.containers) == tree
    # Without container kinds (paths from DCP), int keys rebuild lists, gaps as None (DCP's rule).
    assert build_tree([(("o", "pg", 1, "lr"), 0.1), (("o", "pg", 0, "lr"), 0.2)]) == {"o": {"pg": [{"lr": 0.2}, {"lr": 0.1}]}}
    assert build_tree([(("l", 1), "b")]) == {"l": [None, "b"]}
    with pytest.raises(UsageError, match="collide"):
        build_tree([(("a",), 1), (("a", "b"), 2)])
    with pytest.raises(UnsupportedFormatError, match="both flatten to the name 'a.b'"):
        flatten_tree({"a.b": 1, "a": {"b": 2}}, "mem")


def test_objects_holding_tensors_are_written(tmp_path: Path) -> None:
    """Objects read from DCP byte items may hold in-memory tensors; they go in as storages."""
    cat = Catalog(format="dcp", path=tmp_path, objects={"extra.pair": (torch.arange(3), "x"), "extra.n": 1})
    _write_torch(cat, tmp_path / "o.pt")
    _same(torch.load(tmp_path / "o.pt", weights_only=True), {"extra.pair": (torch.arange(3), "x"), "extra.n": 1})


def test_writer_refuses_sharded_layout(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(4, 2)}, tmp_path / "w.pt")
    target = full_target(TorchSaveFormat().read(tmp_path / "w.pt"))
    target.tensors["w"].boxes = [Box((0, 0), (2, 2)), Box((2, 0), (2, 2))]
    with pytest.raises(UsageError, match="torch files hold whole tensors; 'w' is laid out as 2 boxes"):
        TorchSaveWriter(tmp_path / "o.pt").layout(target)


def test_malicious_pickle_is_refused_not_run(tmp_path: Path) -> None:
    """Refused when the object is asked for, not when the file is cataloged: the model's
    tensors stay readable, the payload never runs."""
    torch.save({"w": torch.ones(2)}, tmp_path / "good.pt")
    marker = tmp_path / "pwned"
    bad = tmp_path / "bad.pt"
    with zipfile.ZipFile(tmp_path / "good.pt") as src, zipfile.ZipFile(bad, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = pickle.dumps({"w": _Evil(str(marker))}) if info.filename.endswith("data.pkl") else src.read(info)
            dst.writestr(info.filename, data)
    cat = TorchSaveFormat().read(bad)
    assert list(cat.objects) == ["w"] and not cat.tensors
    with pytest.raises(UnsafeCheckpointError, match=r"bad\.pt: 'w' refers to (posix|os)\.system, which is not on "
                                                    r"reshard's allow-list.*re-save it with plain tensors"):
        cat.objects["w"]
    assert not marker.exists()


def test_broken_files_are_corrupt(tmp_path: Path) -> None:
    torch.save({"w": torch.randn(1000)}, tmp_path / "good.pt")
    data = (tmp_path / "good.pt").read_bytes()
    for name, content in [("half.pt", data[: len(data) // 2]), ("cut.pt", data[:-1]), ("text.pt", b"not a checkpoint")]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CorruptCheckpointError, match=rf"{name}: not a torch.save zip archive"):
            TorchSaveFormat().read(tmp_path / name)
    # Legacy (pre-1.6) files are read (tests/formats/test_torch_legacy.py); cut ones are corrupt.
    torch.save({"w": torch.ones(64)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    legacy = (tmp_path / "legacy.pt").read_bytes()
    for name, content, message in [("l1.pt", legacy[:-1], "runs past the end of the file"),
                                   ("l2.pt", legacy[:40], "cannot be unpickled"),
                                   ("l3.pt", pickle.dumps({"w": 1}, protocol=2), "not a legacy torch.save file")]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CorruptCheckpointError, match=rf"{name}: .*{message}"):
            TorchSaveFormat().read(tmp_path / name)


# ---------------------------------------------------------------------------------- shared storages


def test_tensors_sharing_a_storage_read_as_torch_reads_them(tmp_path: Path) -> None:
    """What torch.save writes for tensors on one storage: tied weights, views, float8 and
    uint16 views of a uint8 storage (v3 tensors on the untyped storage beside a ByteStorage
    reference), empty views of other dtypes (torch keeps no empty storage)."""
    w, raw, empty = torch.randn(3, 4), torch.arange(8, dtype=torch.uint8), torch.empty(0)
    value = {"w": w, "tied": w, "row": w[1], "t": w.t(), "u8": raw, "f8": raw.view(torch.float8_e4m3fn),
             "u16": raw[2:].view(torch.uint16), "e": empty, "e8": empty.view(torch.uint8)}
    torch.save(value, tmp_path / "shared.pt")
    theirs = torch.load(tmp_path / "shared.pt", weights_only=True)
    cat = TorchSaveFormat().read(tmp_path / "shared.pt")
    assert list(cat.tensors) == list(value)
    for name, want in theirs.items():
        _same(full_tensor(cat.tensors[name]), want, name)


def test_a_storage_retyped_by_a_later_reference_is_refused(tmp_path: Path) -> None:
    """torch.load types a storage by its first reference: in a file where 'b' (uint8) names
    the storage of 'a' (float32), torch reads 'b' as float32 [1, 2, 3, 4], or fails when 'b'
    is longer than that storage. reshard read 'b' as uint8 [0, 0, 128, 63], converted it with
    exit 0 and verified it "equal"; every reader now refuses the file, naming both tensors."""
    a = torch.tensor([1.0, 2, 3, 4])
    b, longer = torch.tensor([0, 0, 128, 63], dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    src, long_src = tmp_path / "m.pt", tmp_path / "long.pt"
    save_editing_refs({"a": a, "b": b}, src, onto(b, a))
    save_editing_refs({"a": a, "b": longer}, long_src, onto(longer, a))
    theirs = torch_reading_of_retyped(lambda: torch.load(src, weights_only=True)["b"])
    assert theirs is None or (theirs.dtype == torch.float32 and theirs.tolist() == [1, 2, 3, 4])
    try:  # torch <= 2.14 cannot grow the storage 'a' typed; 2.15 types each reference on its own
        longer_read = torch.load(long_src, weights_only=True)["b"]
    except RuntimeError as e:
        assert "resize" in str(e)
    else:
        assert longer_read.dtype == torch.uint8 and longer_read.view(torch.float32).tolist() == [1, 2, 3, 4]
    message = "tensors 'a' and 'b' share a storage with different dtypes ('a' float32, 'b' uint8)"
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"long.pt: {message}")):
        reshard.inspect(long_src)
    folder = tmp_path / "bin"  # an HF folder of .bin weights
    folder.mkdir()
    shutil.copy(src, folder / "pytorch_model.bin")
    assert detect_format(folder).name == "hf-bin"
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"pytorch_model.bin: {message}")):
        reshard.inspect(folder)
    save_file({"a": a, "b": b}, tmp_path / "before.safetensors")  # what reshard made of m.pt
    out = tmp_path / "out"
    out.mkdir()
    for args in (["convert", src, out / "m.safetensors"], ["convert", src, out / "m2.pt"],
                 ["convert", src, out / "m_dcp", "--to", "dcp"], ["verify", src, tmp_path / "before.safetensors"]):
        assert_one_line_error(cli(*args), f"m.pt: {message}")
    assert list(out.iterdir()) == []


def test_a_tensor_past_its_storage_as_first_referenced_is_refused(tmp_path: Path) -> None:
    """A storage's size is its first reference's too: 'a' claims 2 elements of the 4 stored,
    so 'b' (all 4) fails in torch.load (the record's size does not match, or with mmap the
    storage cannot grow); reshard read 'b' whole. A claim past the record itself is refused
    as before."""
    base = torch.tensor([1.0, 2, 3, 4])

    def claims(*numels: int):
        refs: list[tuple] = []

        def edit(pid: tuple, ptr: int, keys: dict) -> tuple:
            refs.append(pid)
            return (*pid[:4], numels[len(refs) - 1])
        return edit

    src = tmp_path / "short.pt"
    save_editing_refs({"a": base[:2], "b": base}, src, claims(2, 4))
    with pytest.raises(RuntimeError, match="does not match expected size"):
        torch.load(src, weights_only=True)
    with pytest.raises(RuntimeError, match="resize"):
        torch.load(src, weights_only=True, mmap=True)
    with pytest.raises(CorruptCheckpointError, match=re.escape(
            "short.pt: tensors 'a' and 'b' share a storage but 'b' (shape (4,)) reaches past it (8 bytes, as 'a' "
            "made it")):
        reshard.inspect(src)
    save_editing_refs({"a": base[:2], "b": base}, src, claims(4, 8))
    with pytest.raises(CorruptCheckpointError, match=r"short\.pt: storage data/0 claims 8 elements but holds 16 bytes"):
        reshard.inspect(src)


def test_a_bare_storage_is_refused(tmp_path: Path) -> None:
    """A storage saved by itself (not a tensor) was read as reshard's internal tuple and written
    out as that; it is refused, named."""
    torch.save({"w": torch.ones(2), "s": torch.arange(3.0).untyped_storage()}, tmp_path / "bare.pt")
    assert isinstance(torch.load(tmp_path / "bare.pt", weights_only=True)["s"], torch.storage.TypedStorage)
    with pytest.raises(UnsupportedFormatError, match=r"bare\.pt: 's' is a bare storage, not a tensor"):
        reshard.inspect(tmp_path / "bare.pt")


# ---------------------------------------------------------------------------------- rank files


class _Odd(torch.nn.Module):
    """Shapes that 2 ranks split unevenly: 7 rows -> 4, 3; 3 -> 2, 1; 1 -> 1, empty."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(5, 7)
        self.embed = torch.nn.Embedding(3, 4)
        self.gate = torch.nn.Parameter(torch.randn(1, 5))


def _save_worker(rank: int, world_size: int, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    root = Path(out)
    full = lambda v: v.full_tensor() if isinstance(v, DTensor) else v  # noqa: E731
    torch.manual_seed(0)
    # 1-D FSDP2 over 4 ranks: 11 rows -> 3,3,3,2; 7 -> 2,2,2,1; 2 -> 1,1,0,0 (empty shards).
    mesh = init_device_mesh("cpu", (world_size,))
    model = TinyNet()
    for sub in (model.embed, model.proj, model.head):
        fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(rank))).square().mean().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    # Beside the shards: state that differs per rank (a plain tensor, an object) and state
    # that does not (step), as real jobs save RNG states and data loader positions.
    per_rank = {"seed": torch.full((3,), float(rank)), "loader": {"pos": rank}}
    torch.save({"model": msd, "optim": osd, "step": 1, **per_rank}, root / "fsdp" / f"rank{rank}.pt")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root / "dcp")
    ref = {f"model.{k}": full(v) for k, v in msd.items()}
    ref.update({f"optim.state.{p}.{k}": full(v) for p, st in osd["state"].items() for k, v in st.items()})
    # 2-D HSDP (Replicate, Shard(0)), plus nested shards of one dim and of two dims.
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    odd = _Odd()
    fully_shard(odd, mesh=mesh2)
    sd2 = dict(odd.state_dict())
    big = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)  # same on every rank (seeded)
    sd2["nested"] = distribute_tensor(big, mesh2, [Shard(0), Shard(0)])  # 7 -> 4,3 -> 2,2,2,1
    sd2["grid"] = distribute_tensor(big, mesh2, [Shard(1), Shard(0)])
    sd2["rep"] = distribute_tensor(big[:2], mesh2, [Replicate(), Replicate()])
    torch.save(sd2, root / "hsdp" / f"model_world_size_4_rank_{rank}.pt")
    ref.update({f"hsdp.{k}": full(v) for k, v in sd2.items()})
    torch.save({"p": DTensor.from_local(torch.ones(3), mesh, [Partial()])}, root / "partial" / f"rank{rank}.pt")
    one = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("a", "b"))["b"]
    single = distribute_tensor(torch.arange(6.0), one, [Shard(0)])
    if rank == 1:
        torch.save({"w": single}, root / "one_rank.pt")
    # A mesh whose ranks run backwards: rank r holds shard world_size-1-r (torch 2.13 keeps the order
    # in _rank_map); placed in row-major order it would read each shard at another's offsets.
    from torch.distributed.device_mesh import DeviceMesh

    backwards = DeviceMesh("cpu", torch.arange(world_size).flip(0))
    torch.save({"w": distribute_tensor(torch.arange(8.0), backwards, [Shard(0)])}, root / "reordered" / f"rank{rank}.pt")
    ref.update(_save_verl(root / "verl", rank, world_size, mesh))
    # Rank files in which 'b' (int16) names the storage of 'a' (float32), as torch.save would not write them.
    a, b = torch.tensor([1.0, 2, 3, 4]), torch.tensor([5, 6, 7, 8], dtype=torch.int16)
    w = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    save_editing_refs({"w": w, "a": a, "b": b}, root / "retyped" / f"rank{rank}.pt", onto(b, a))
    if rank == 0:
        torch.save(ref, root / "ref.pt")
    dist.barrier()


def _save_verl(folder: Path, rank: int, world_size: int, mesh) -> dict[str, torch.Tensor]:
    """A checkpoint as verl's FSDPCheckpointManager saves it with FSDP2: model, optimizer and
    extra state (scheduler, RNG states), each torch.save'd by every rank."""
    import random

    import numpy as np
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(1)
    model = TinyNet()
    for sub in (model.embed, model.proj, model.head):
        fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=4)
    model(torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(rank))).square().mean().backward()
    opt.step()
    sched.step()
    np.random.seed(rank)
    random.seed(rank)
    rng = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}
    name = f"world_size_{world_size}_rank_{rank}.pt"
    torch.save(model.state_dict(), folder / f"model_{name}")
    torch.save(opt.state_dict(), folder / f"optim_{name}")
    torch.save({"lr_scheduler": sched.state_dict(), "rng": rng}, folder / f"extra_state_{name}")
    full = lambda v: v.full_tensor() if isinstance(v, DTensor) else v  # noqa: E731
    ref = {f"verl.model.{k}": full(v) for k, v in model.state_dict().items()}
    ref.update({f"verl.optim.state.{p}.{k}": full(v) for p, st in opt.state_dict()["state"].items() for k, v in st.items()})
    return ref


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """One 4-rank gloo world for every multi-rank check (ranks are slow to start)."""
    root = tmp_path_factory.mktemp("ranks")
    for sub in ("fsdp", "hsdp", "partial", "verl", "retyped", "reordered"):
        (root / sub).mkdir()
    run_world(_save_worker, 4, str(root), timeout=HANG_GUARD)
    return root, torch.load(root / "ref.pt", weights_only=True)


def test_reads_fsdp2_rank_files_exactly(saved) -> None:
    root, ref = saved
    assert detect_format(root / "fsdp").name == "torch-ranks"
    cat = TorchRanksFormat().read(root / "fsdp")
    for name, want in ref.items():
        if not name.startswith(("hsdp.", "verl.")):
            _same(full_tensor(cat.tensors[name]), want, name)
    assert [c.box.sizes[0] for c in cat.tensors["model.embed.weight"].chunks] == [3, 3, 3, 2]
    assert [c.box.offsets[0] for c in cat.tensors["model.proj.weight"].chunks] == [0, 2, 4, 6]
    assert len(cat.tensors["optim.state.head.weight.exp_avg"].chunks) == 2  # two empty shards store nothing
    assert cat.paths["optim.state.embed.weight.exp_avg"] == ("optim", "state", "embed.weight", "exp_avg")
    assert cat.objects["step"] == 1 and cat.objects["optim.param_groups.0.lr"] == 1e-2
    assert cat.facts.source_mesh == (4,) and cat.facts.source_world_size == 4
    assert cat.facts.source_placements["model.embed.weight"] == ["Shard(0)"]


def test_state_that_differs_per_rank_is_kept_per_rank(saved, tmp_path: Path) -> None:
    """Never one rank's copy standing for all: each rank's value under NAME.rank<r>, said."""
    root, _ = saved
    cat = TorchRanksFormat().read(root / "fsdp")
    for r in range(4):
        assert torch.equal(full_tensor(cat.tensors[f"seed.rank{r}"]), torch.full((3,), float(r)))
        assert cat.objects[f"loader.pos.rank{r}"] == r
        assert cat.paths[f"seed.rank{r}"] == ("seed", f"rank{r}")
    assert "seed" not in cat.tensors and "loader.pos" not in cat.objects
    assert any("seed, loader.pos" in n for n in cat.notices)
    out = reshard.convert(root / "fsdp", tmp_path / "full.pt", quiet=True)
    assert any("kept once per rank" in n for n in out.notices)
    full = torch.load(tmp_path / "full.pt", weights_only=True)  # an outside reader
    assert [full["seed"][f"rank{r}"].tolist() for r in range(4)] == [[float(r)] * 3 for r in range(4)]
    assert full["loader"]["pos"] == {f"rank{r}": r for r in range(4)} and full["step"] == 1
    relaid = reshard.convert(root / "fsdp", tmp_path / "three", to_mesh="3", quiet=True)
    assert any("dropped per-rank state" in n and "seed.rank3" in n for n in relaid.notices)


def test_reads_hsdp_and_nested_shards(saved) -> None:
    root, ref = saved
    cat = reshard.inspect(root / "hsdp")
    assert cat.format == "torch-ranks" and cat.facts.source_mesh == (2, 2)
    for name, t in cat.tensors.items():
        _same(full_tensor(t), ref[f"hsdp.{name}"], name)
    assert [c.box.sizes for c in cat.tensors["up.weight"].chunks] == [(4, 5), (3, 5)]  # replicas once
    assert len(cat.tensors["gate"].chunks) == 1
    assert [c.box.sizes[0] for c in cat.tensors["nested"].chunks] == [2, 2, 2, 1]
    assert [c.box.offsets for c in cat.tensors["grid"].chunks] == [(0, 0), (4, 0), (0, 3), (4, 3)]
    assert len(cat.tensors["rep"].chunks) == 1


def test_missing_rank_files_are_corrupt(saved, tmp_path: Path) -> None:
    root, _ = saved
    for gone, message in [(2, r"rank file\(s\) for rank \[2\] are missing"), (3, "lives on a mesh of 4 ranks")]:
        folder = tmp_path / f"without{gone}"
        shutil.copytree(root / "fsdp", folder)
        (folder / f"rank{gone}.pt").unlink()
        with pytest.raises(CorruptCheckpointError, match=message):
            TorchRanksFormat().read(folder)


def test_unplaceable_dtensors_are_refused(saved, tmp_path: Path, monkeypatch) -> None:
    root, _ = saved
    with pytest.raises(UnsupportedFormatError, match=r"'p'.*Partial placement"):
        TorchRanksFormat().read(root / "partial")
    with pytest.raises(UnsupportedFormatError, match=r"rank1\.pt: 'model\.embed\.weight' is one rank's shard of a DTensor"):
        TorchSaveFormat().read(root / "fsdp" / "rank1.pt")
    # A DTensor on a one-rank mesh is a whole tensor.
    _same(full_tensor(TorchSaveFormat().read(root / "one_rank.pt").tensors["w"]), torch.arange(6.0))
    with pytest.raises(UnsupportedFormatError, match=r"rank0\.pt: DTensor on a DeviceMesh with its own rank order"):
        TorchRanksFormat().read(root / "reordered")
    # _StridedShard (FSDP2 over TP) and non-default shard orders: files faked at the pickle level.
    local = StoredRegion(root / "one_rank.pt", 0, torch.float32, (2,))
    for placements, extra, message in [
        ((Record("_StridedShard", (), {"dim": 0, "split_factor": 2}),), {}, "_StridedShard"),
        ((Record("Shard", (), {"dim": 0}), Record("Shard", (), {"dim": 0})),
         {"shard_order": (Record("ShardOrderEntry", (0, (1, 0))),)}, "non-default order"),
    ]:
        mesh = (2,) * len(placements)
        trees = {r: {"x": DTensorRef(local, (4,), placements, mesh, None, extra=extra)} for r in range(2 ** len(placements))}
        monkeypatch.setattr(torch_ranks, "read_torch_file", lambda f: trees[int(f.stem[4:])])
        folder = tmp_path / message.replace(" ", "_")
        folder.mkdir()
        for r in trees:
            (folder / f"rank{r}.pt").write_bytes(b"")
        with pytest.raises(UnsupportedFormatError, match=message):
            TorchRanksFormat().read(folder)


def test_rank_files_retyping_a_storage_are_refused(saved) -> None:
    root, _ = saved
    # a DTensor inside: our own fixture
    theirs = torch_reading_of_retyped(lambda: torch.load(root / "retyped" / "rank1.pt", weights_only=False)["b"])
    assert theirs is None or (theirs.dtype == torch.float32 and theirs.tolist() == [1, 2, 3, 4])
    with pytest.raises(CorruptCheckpointError, match=re.escape("tensors 'a' and 'b' share a storage with different "
                                                               "dtypes ('a' float32, 'b' int16)")):
        TorchRanksFormat().read(root / "retyped")


def test_rank_file_names_and_detection(tmp_path: Path) -> None:
    for name in ("rank0.pt", "rank1.pt", "model_world_size_2_rank_0.bin", "model_world_size_2_rank_1.bin",
                 "crank3.pt", "notes.txt", "rank7.safetensors"):
        (tmp_path / name).write_bytes(b"")
    assert {k: sorted(v) for k, v in rank_files(tmp_path).items()} == {
        "rank{}.pt": [0, 1], "model_world_size_2_rank_{}.bin": [0, 1]}
    experimental, steps = tmp_path / "experimental", tmp_path / "steps"  # torch's _experimental checkpointer
    for folder, names in ((experimental, ("checkpoint_0.pt", "checkpoint_1.pt", "checkpoint_2.pt")),
                          (steps, ("checkpoint_1000.pt", "checkpoint_2000.pt"))):  # step numbers: not ranks
        folder.mkdir()
        for name in names:
            (folder / name).write_bytes(b"")
    assert {k: sorted(v) for k, v in rank_files(experimental).items()} == {"checkpoint_{}.pt": [0, 1, 2]}
    assert rank_files(steps) == {} and not TorchRanksFormat().detect(steps)
    assert TorchRanksFormat().detect(tmp_path)
    with pytest.raises(UnsupportedFormatError, match=r"model_world_size_2_rank_\*\.bin, rank\*\.pt; put each set"):
        TorchRanksFormat().read(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"")
    assert not TorchRanksFormat().detect(tmp_path)
    with pytest.raises(UsageError, match="need a mesh"):
        TorchRanksFormat().writer(tmp_path / "out").layout(Target({}, {}, {}, {}))


def test_plain_per_rank_tensors_are_not_guessed(tmp_path: Path) -> None:
    for r in range(2):  # e.g. tensor-parallel shards: same names, different data per rank
        torch.save({"w": torch.full((2, 3), float(r)), "step": 3}, tmp_path / f"mp_rank_{r:02d}.pt")
    with pytest.raises(UnsupportedFormatError, match="plain tensors, no DTensors"):
        reshard.inspect(tmp_path)


@pytest.mark.parametrize("n", range(0, 10))
@pytest.mark.parametrize("k", range(1, 6))
def test_shard_boxes_follow_torch_chunk(n: int, k: int) -> None:
    pieces = list(torch.arange(n).chunk(k)) if n else []
    boxes = [shard_box((n, 2), (("Shard", 0),), (k,), (i,)) for i in range(k)]
    for i, box in enumerate(boxes):
        want = pieces[i].tolist() if i < len(pieces) else []
        assert list(range(box.offsets[0], box.offsets[0] + box.sizes[0])) == want and box.sizes[1] == 2


# ---------------------------------------------------------------------------------- acceptance


def test_dcp_checkpoint_to_torch_file_loads_into_the_model(saved, tmp_path: Path) -> None:
    """reshard's DCP -> .pt equals torch's own dcp_to_torch_save, and loads into the model."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, ref = saved
    out = tmp_path / "full.pt"
    result = reshard.convert(root / "dcp", out, max_memory="4KiB", quiet=True)
    assert result.format == "torch" and result.notices == []
    dcp_to_torch_save(root / "dcp", tmp_path / "theirs.pt")
    theirs = torch.load(tmp_path / "theirs.pt", weights_only=True)
    for mmap in (False, True):
        ours = torch.load(out, weights_only=True, mmap=mmap)
        _same(ours, theirs, ordered=False)  # key order: ours keeps the trainer's (planner_data)
    model = TinyNet()
    model.load_state_dict(ours["model"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[f"model.{k}"]), k
    assert isinstance(ours["optim"]["param_groups"], list)
    assert torch.equal(ours["optim"]["state"]["embed.weight"]["exp_avg"], ref["optim.state.embed.weight.exp_avg"])
    # A per-rank folder converts to the same full file (keys in the order the trainer had them:
    # DCP's metadata lists AdamW's "step" last).
    reshard.convert(root / "fsdp", tmp_path / "from_ranks.pt", quiet=True)
    per_rank = {"seed": {f"rank{r}": torch.full((3,), float(r)) for r in range(4)},
                "loader": {"pos": {f"rank{r}": r for r in range(4)}}}
    _same(torch.load(tmp_path / "from_ranks.pt", weights_only=True), {**theirs, "step": 1, **per_rank}, ordered=False)


# ---------------------------------------------------------------------------------- objects


def _common_objects() -> dict:
    """What trainers keep beside tensors (Megatron/fairseq args, torchtitan's BytesIO train
    state, numpy and Python RNG states, collections), each read as data, not code."""
    import argparse
    import collections
    import datetime
    import io
    import random

    import numpy as np

    rs = np.random.RandomState(3)
    rs.randn(4)
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3)},
        "train_state": io.BytesIO(b"step=7\x00"),
        "args": argparse.Namespace(lr=0.1, layers=[1, 2], scale=torch.ones(2)),  # a tensor inside an object
        "np": {"arr": np.arange(12, dtype=np.float32).reshape(3, 4), "objects": np.array(["a", None, 3], dtype=object),
               "fortran": np.asfortranarray(np.arange(6).reshape(2, 3)), "dtype": np.dtype(">i4"),
               "dates": np.array([1, 2], dtype="M8[ns]"), "scalar": np.float64(2.5)},
        "rng": {"numpy": np.random.get_state(), "legacy": rs, "generator": np.random.default_rng(5),
                "python": random.getstate(), "torch": torch.get_rng_state()},
        "collections": {"od": collections.OrderedDict(b=1, a=2), "dd": collections.defaultdict(list, a=[1]),
                        "dq": collections.deque([1, 2], maxlen=5), "cnt": collections.Counter("aab")},
        "torch_values": {"size": torch.Size([2, 3]), "device": torch.device("cpu")},
        "when": datetime.datetime(2024, 5, 1, tzinfo=datetime.timezone.utc),
    }


def _same_objects(got: Any, want: Any) -> None:
    """``reshard.core.values.difference`` (type and value), plus what it cannot see: a BytesIO's
    contents, an RNG's state, a Namespace's tensor."""
    from reshard.core.values import difference

    def plain(v: Any) -> Any:
        if hasattr(v, "getvalue"):
            return ("BytesIO", v.getvalue(), v.tell())
        if hasattr(v, "get_state"):
            return ("RandomState", v.get_state())
        if hasattr(v, "bit_generator"):
            return ("Generator", v.bit_generator.state)
        return v

    from reshard.safe_pickle.walk import replace_in

    why = difference(replace_in(got, plain), replace_in(want, plain))
    assert why is None, why


def test_common_objects_round_trip_torch_dcp_torch(tmp_path: Path) -> None:
    value = _common_objects()
    torch.save(value, tmp_path / "in.pt")
    cat = TorchSaveFormat().read(tmp_path / "in.pt")
    assert list(cat.tensors) == ["model.w", "rng.torch"]  # the Namespace's tensor stays in its object
    _same_objects(cat.objects["args"], value["args"])
    reshard.convert(tmp_path / "in.pt", tmp_path / "dcp", quiet=True)
    reshard.convert(tmp_path / "dcp", tmp_path / "out.pt", quiet=True)
    back = torch.load(tmp_path / "out.pt", weights_only=False)  # our own output; numpy needs the full unpickler
    _same_objects(_sorted(back), _sorted(value))  # DCP stores a section's tensors before its objects
    assert back["rng"]["generator"].random() == value["rng"]["generator"].random()  # the stream goes on


def test_objects_nobody_allowed_fail_only_when_asked_for(tmp_path: Path) -> None:
    """A tensor-only conversion never reads the data loader's state; inspect and a full
    conversion still refuse it, naming the file and the class, and nothing runs."""
    import collections

    from tests.test_cli import assert_one_line_error
    from tests.test_cli import reshard as run_cli
    from tests.test_hostile import _Popen

    marker = tmp_path / "pwned"
    model = {"embed.weight": torch.randn(4, 3), "head.weight": torch.randn(2, 3)}
    hook = _Reduce(collections.deque, ([torch.ones(5), _Popen(marker)],))  # a tensor inside a refused object
    torch.save({"model": model, "optim": {"state": {}, "param_groups": [{"lr": 0.1}]}, "extra": {"loader": hook}},
               tmp_path / "ckpt.pt")
    cat = reshard.inspect(tmp_path / "ckpt.pt")
    assert set(cat.tensors) == {"model.embed.weight", "model.head.weight"}  # the deque's tensor is not one
    with pytest.raises(UnsafeCheckpointError, match=r"ckpt\.pt: 'extra\.loader' refers to subprocess\.Popen, which is not on"):
        cat.objects["extra.loader"]
    reshard.convert(tmp_path / "ckpt.pt", tmp_path / "model.pt", only="model", quiet=True)
    _same(torch.load(tmp_path / "model.pt", weights_only=True), model)
    with pytest.raises(UnsafeCheckpointError, match="subprocess.Popen"):
        reshard.convert(tmp_path / "ckpt.pt", tmp_path / "all.pt", quiet=True)
    assert_one_line_error(run_cli("inspect", tmp_path / "ckpt.pt"), "ckpt.pt: 'extra.loader' refers to subprocess.Popen")
    assert not marker.exists() and not (tmp_path / "all.pt").exists()


class _Reduce:
    def __init__(self, func: Any, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def _unimportable_module() -> Any:
    """A module that exists only while a test pickles with it: reading it back must not import."""
    import types

    module = types.ModuleType("no_such_pkg.conf")

    class Config:
        def __init__(self, lr: float, t: torch.Tensor) -> None:
            self.lr, self.t = lr, t

    Config.__module__, Config.__qualname__ = module.__name__, "Config"
    module.Config = Config
    return module


def save_unimportable(path: Path, value: Callable[[Any], Any]) -> Any:
    """``torch.save`` ``value(module)`` while ``_unimportable_module()`` is importable, then
    forget the module again; the module."""
    import sys

    module = _unimportable_module()
    present = {"no_such_pkg": type(sys)("no_such_pkg"), "no_such_pkg.conf": module}
    sys.modules.update(present)
    try:
        torch.save(value(module), path)
    finally:
        for name in present:
            del sys.modules[name]
    return module


def test_allowed_classes_round_trip_under_their_own_names(tmp_path: Path) -> None:
    import sys

    from reshard.formats.torch.zip import load_object_blob
    from reshard.formats.torch.zip_write import torch_save_bytes

    from reshard.safe_pickle.inert import Inert
    from reshard.safe_pickle.unpickler import allow_classes

    module = save_unimportable(tmp_path / "in.pt", lambda m: {"model": {"w": torch.ones(2)},
                                                               "extra": {"cfg": m.Config(0.1, torch.arange(3)), "cls": m.Config}})
    present = {"no_such_pkg": type(sys)("no_such_pkg"), "no_such_pkg.conf": module}
    with pytest.raises(UnsafeCheckpointError, match=r"pass --allow-class no_such_pkg\.conf\.Config .*never run"):
        reshard.inspect(tmp_path / "in.pt").objects["extra.cfg"]
    with allow_classes(["no_such_pkg.conf.Config"]):
        cat = reshard.inspect(tmp_path / "in.pt")
        cfg = cat.objects["extra.cfg"]
        assert isinstance(cfg, Inert) and cfg.state["lr"] == 0.1 and torch.equal(cfg.state["t"], torch.arange(3))
        reshard.convert(tmp_path / "in.pt", tmp_path / "out.pt", quiet=True)
        blob = torch_save_bytes(cfg)  # a DCP byte object, as the DCP writer stores objects
        (tmp_path / "blob").write_bytes(blob)
        assert load_object_blob(tmp_path / "blob", 0, len(blob), lambda r: r.read_all()) == cfg
    assert "no_such_pkg" not in sys.modules  # never imported
    sys.modules.update(present)  # where the input loads, the output loads
    try:
        out = torch.load(tmp_path / "out.pt", weights_only=False)
        obj = torch.load(tmp_path / "blob", weights_only=False)
    finally:
        for name in present:
            del sys.modules[name]
    assert type(out["extra"]["cfg"]) is module.Config and out["extra"]["cls"] is module.Config
    assert out["extra"]["cfg"].lr == 0.1 and torch.equal(out["extra"]["cfg"].t, torch.arange(3))
    assert type(obj) is module.Config and torch.equal(obj.t, torch.arange(3))


# ---------------------------------------------------------------------------------- verl


def test_reads_verl_checkpoint_folders_exactly(saved, tmp_path: Path) -> None:
    """verl's three sets of rank files are one catalog: model., optim., extra. sections, the
    verl layout recorded; a full file, a DCP round trip and the model alone are exact."""
    from reshard.core.conventions import OPTIM_STATE, PER_RANK, detect_layout

    root, ref = saved
    folder = root / "verl"
    cat = reshard.inspect(folder)
    assert cat.format == "torch-ranks" and cat.facts.layout == "verl" and cat.facts.source_world_size == 4
    for name, want in ref.items():
        if name.startswith("verl."):
            _same(full_tensor(cat.tensors[name[5:]]), want, name)
    assert cat.paths["optim.state.0.exp_avg"] == ("optim", "state", 0, "exp_avg")
    layout = detect_layout(cat)
    assert layout.name == "verl" and layout.role("optim.state.0.exp_avg") == OPTIM_STATE
    assert layout.role("extra.rng.numpy.rank2") == PER_RANK
    out = tmp_path / "full.pt"
    reshard.convert(folder, out, quiet=True)
    full = torch.load(out, weights_only=False)  # numpy RNG states inside: our own output
    for r in range(4):
        extra = torch.load(folder / f"extra_state_world_size_4_rank_{r}.pt", weights_only=False)
        _same_objects(full["extra"]["rng"]["numpy"][f"rank{r}"], extra["rng"]["numpy"])
        _same_objects(full["extra"]["lr_scheduler"], extra["lr_scheduler"])
        optim = torch.load(folder / f"optim_world_size_4_rank_{r}.pt", weights_only=False)
        assert full["optim"]["param_groups"] == optim["param_groups"]
    assert torch.equal(full["optim"]["state"][1]["exp_avg"], ref["verl.optim.state.1.exp_avg"])
    model = TinyNet()
    model.load_state_dict(full["model"])
    reshard.convert(folder, tmp_path / "dcp", quiet=True)
    reshard.convert(tmp_path / "dcp", tmp_path / "again.pt", quiet=True)
    _same_objects(_sorted(torch.load(tmp_path / "again.pt", weights_only=False)), _sorted(full))  # DCP orders tensors first
    reshard.convert(folder, tmp_path / "model.pt", only="model", quiet=True)
    assert list(torch.load(tmp_path / "model.pt", weights_only=True)) == list(model.state_dict())


def _sorted(value: Any) -> Any:
    if type(value) is dict:
        return {k: _sorted(value[k]) for k in sorted(value, key=str)}
    return value
