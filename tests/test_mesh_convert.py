"""`--to-mesh`: a real FSDP2 DCP checkpoint laid out offline for other meshes, then loaded by
torch's own ``dcp.load`` into DTensors on a live gloo mesh of that shape. One 4-rank world
checks the 2x2 HSDP layout, the 1-D layout of 4, a PLAN.json with FSDP+TP placements, and
DTensor's own sharding against ours (uneven, empty and nested shards)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import reshard
from reshard.core.sharding import parse_mesh, parse_placement, rank_coordinate, shard_box
from reshard.core.sizes import format_size
from tests.dist import HANG_GUARD, run_world

# Shapes x placements x meshes DTensor must agree with us on: uneven dims, dims smaller
# than the mesh (empty shards), one dim sharded over both mesh dims, 0-size dims.
_RULE_CASES = [
    ((11, 6), ("Shard(0)",), (4,)),
    ((2, 7), ("Shard(0)",), (4,)),
    ((3,), ("Shard(0)",), (4,)),
    ((0, 5), ("Shard(0)",), (4,)),
    ((7, 5), ("Shard(1)",), (4,)),
    ((11, 6), ("Replicate()", "Shard(0)"), (2, 2)),
    ((11, 6), ("Shard(0)", "Shard(0)"), (2, 2)),
    ((5, 3), ("Shard(0)", "Shard(0)"), (2, 2)),
    ((1, 3), ("Shard(0)", "Shard(0)"), (2, 2)),
    ((9, 7), ("Shard(1)", "Shard(0)"), (2, 2)),
    ((9, 7), ("Shard(0)", "Shard(1)"), (2, 2)),
    ((3, 3), ("Replicate()", "Replicate()"), (2, 2)),
]

PLAN = {
    "mesh": ["dp_shard", "tp"],
    "placements": {
        "embed.weight": ["Shard(0)", "Shard(1)"],
        "proj.weight": ["Shard(0)", "Shard(0)"],
        "proj.bias": ["Shard(0)", "Shard(0)"],
        "head.weight": ["Replicate()", "Shard(1)"],
        "norm.*": ["Shard(0)", "Replicate()"],
    },
}


def _placements(names: list[str]) -> list:
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(p[1]) if p[0] == "Shard" else Replicate() for p in map(parse_placement, names)]


def _check_rules(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    meshes = {(4,): init_device_mesh("cpu", (4,)), (2, 2): init_device_mesh("cpu", (2, 2))}
    for shape, names, mesh_shape in _RULE_CASES:
        full = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float32)[: torch.Size(shape).numel()].reshape(shape)
        local = distribute_tensor(full, meshes[mesh_shape], _placements(list(names))).to_local()
        box = shard_box(shape, tuple(map(parse_placement, names)), mesh_shape, rank_coordinate(rank, mesh_shape))
        assert tuple(local.shape) == box.sizes, (shape, names, mesh_shape, rank, local.shape, box)
        assert torch.equal(local, full[box.as_slices()]), (shape, names, mesh_shape, rank)


def _load_and_check(rank: int, ckpt: str, mesh_shape: tuple, placements_of: dict, ref: dict, names: tuple | None = None) -> None:
    """dcp.load into DTensors of the given placements; every tensor exact; stored chunks are
    exactly the distinct local shards of the ranks."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    sd = {}
    for name, full in ref.items():
        if full.dim() == 0 or name not in placements_of:
            sd[name] = torch.zeros_like(full)
        else:
            sd[name] = distribute_tensor(torch.zeros_like(full), mesh, _placements(placements_of[name]))
    dcp.load(sd, checkpoint_id=ckpt)
    boxes = {}
    for name, full in ref.items():
        got = sd[name].full_tensor() if hasattr(sd[name], "full_tensor") else sd[name]
        assert torch.equal(got, full), f"{ckpt}: {name} differs after dcp.load"
        if hasattr(sd[name], "to_local"):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, sd[name].placements)
            boxes[name] = (tuple(offset), tuple(shape))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, boxes)
    if rank == 0:
        md = FileSystemReader(ckpt).read_metadata()
        for name in boxes:
            stored = {(tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[name].chunks}
            expected = {g[name] for g in gathered}
            assert stored == expected, f"{ckpt}: {name} stores {sorted(stored)}, the ranks hold {sorted(expected)}"


def _world(rank: int, world_size: int, out: str, ref_path: str) -> None:
    _check_rules(rank)
    ref = torch.load(ref_path, weights_only=True)["tensors"]
    sharded = [n for n, t in ref.items() if t.dim() > 0 and not n.startswith("extra.")]
    _load_and_check(rank, f"{out}/ckpt_2x2", (2, 2), {n: ["Replicate()", "Shard(0)"] for n in sharded}, ref)
    _load_and_check(rank, f"{out}/ckpt_4", (4,), {n: ["Shard(0)"] for n in sharded}, ref)
    plan = {}
    for n in sharded:
        fqn = n.removeprefix("model.").removeprefix("optim.state.")
        fqn = fqn if n.startswith("model.") else fqn.rpartition(".")[0]
        plan[n] = next(v for k, v in PLAN["placements"].items() if __import__("fnmatch").fnmatchcase(fqn, k))
    _load_and_check(rank, f"{out}/tp", (2, 2), plan, ref, names=("dp_shard", "tp"))


def test_to_mesh_loads_exactly_on_live_meshes(fsdp2_dcp, tmp_path: Path) -> None:
    src, ref = fsdp2_dcp
    out = tmp_path / "ckpts"
    out.mkdir()
    for p in src.iterdir():  # a copy, so that the default destination lands in tmp_path
        (out / "ckpt").mkdir(exist_ok=True)
        (out / "ckpt" / p.name).write_bytes(p.read_bytes())
    r = reshard.convert(out / "ckpt", to_mesh="2x2", quiet=True)
    assert r.dst == out / "ckpt_2x2" and r.format == "dcp"
    assert reshard.convert(out / "ckpt", to_mesh="4", quiet=True).dst == out / "ckpt_4"
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    reshard.convert(out / "ckpt", out / "tp", to_mesh="dp_shard=2,tp=2", placements=str(tmp_path / "plan.json"), quiet=True)
    # Each rank's data in its own file: rank r's file holds exactly the boxes assigned to r.
    assert sorted(p.name for p in (out / "ckpt_4").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    run_world(_world, 4, str(out), str(ref))


def test_cli_writes_beside_source_and_per_rank_torch_files(fsdp2_dcp, fsdp2_reference, tmp_path: Path) -> None:
    src = tmp_path / "run"
    src.mkdir()
    for p in fsdp2_dcp[0].iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    proc = subprocess.run([sys.executable, "-m", "reshard", "convert", str(src), "--to-mesh", "4"],
                          capture_output=True, text=True, timeout=HANG_GUARD)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run_4" / ".metadata").is_file()
    assert reshard.verify(src, tmp_path / "run_4").equal

    # Per-rank torch files: plain tensors any framework can torch.load, plus the layout record.
    reshard.convert(src, tmp_path / "ranks", to="torch", to_mesh="3", quiet=True)
    files = sorted((tmp_path / "ranks").glob("rank*.pt"))
    assert [f.name for f in files] == ["rank0.pt", "rank1.pt", "rank2.pt"]
    parts = [torch.load(f, weights_only=True) for f in files]
    rows = [p["model"]["embed.weight"].shape[0] for p in parts]
    assert rows == [4, 4, 3]
    assert torch.equal(torch.cat([p["model"]["embed.weight"] for p in parts]), fsdp2_reference["model.embed.weight"])
    assert json.loads(parts[2]["reshard_layout"])["tensors"]["model.head.weight"]["offsets"] == [2, 0]
    back = reshard.inspect(tmp_path / "ranks")
    assert back.format == "torch-ranks" and back.tensors["model.embed.weight"].shape == (11, 6)
    assert reshard.verify(tmp_path / "ranks", src).equal

    # inspect --to-mesh: per-rank bytes and the uneven warning, before anything is written.
    proc = subprocess.run([sys.executable, "-m", "reshard", "inspect", str(src), "--to-mesh", "4", "--json"],
                          capture_output=True, text=True, timeout=HANG_GUARD)
    target = json.loads(proc.stdout)["target"]
    assert len(target["ranks"]) == 4 and target["imbalance"] >= 1.0
    assert "model.head.weight" in target["uneven"]
    assert all(r["optim"] > 0 for r in target["ranks"][:2])


def test_torchrun_parallel_output_is_byte_identical(fsdp2_dcp, tmp_path: Path) -> None:
    """Ranks splitting the files of a DCP, and of a compressed zarr store (each rank pads and
    compresses its own chunks; rank 0 writes the metadata), write what one process writes."""
    src = fsdp2_dcp[0]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name, extra in (("two", []), ("two.zarr", ["--compress", "--max-shard-size", "2KiB"])):
        single = tmp_path / f"one{name.removeprefix('two')}"
        reshard.convert(src, single, to_mesh="2x2" if not extra else None, quiet=True, compress=bool(extra),
                        max_shard_size="2KiB" if extra else None)
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "-m", "reshard", "convert", str(src), str(tmp_path / name), *(["--to-mesh", "2x2"] if not extra else extra),
             "--quiet"], capture_output=True, text=True, timeout=HANG_GUARD, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        one = {str(p.relative_to(single)): p.read_bytes() for p in single.rglob("*") if p.is_file()}
        two = {str(p.relative_to(tmp_path / name)): p.read_bytes() for p in (tmp_path / name).rglob("*") if p.is_file()}
        assert len(one) > 4 and one.keys() == two.keys() and [k for k in one if one[k] != two[k]] == [], name
        assert not list(tmp_path.glob(f".{name}.reshard-*"))
    assert reshard.verify(src, tmp_path / "two.zarr").equal  # the compressed store holds the source
    # --overwrite of a folder holding a user's file: rank 0 decides, the job says it once, nothing goes
    (tmp_path / "two" / "mine.txt").write_text("mine")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "reshard", "convert", str(src), str(tmp_path / "two"), "--to-mesh", "2x2", "--overwrite", "--quiet"],
        capture_output=True, text=True, timeout=HANG_GUARD, env=env)
    assert proc.returncode != 0 and proc.stderr.count("did not write (mine.txt)") == 1, proc.stderr[-3000:]
    assert (tmp_path / "two" / "mine.txt").read_text() == "mine" and (tmp_path / "two" / ".metadata").exists()


def test_mesh_parsing_and_refusals(fsdp2_dcp, tmp_path: Path) -> None:
    import pytest

    from reshard.core.errors import UsageError

    assert parse_mesh("4x8").shape == (4, 8) and parse_mesh("4x8").names == ("dp_replicate", "dp_shard")
    named = parse_mesh("dp_replicate=4,dp_shard=8")
    assert named.shape == (4, 8) and named.named and named.world_size == 32
    assert parse_mesh("tp=2,dp_shard=3").names == ("tp", "dp_shard")
    for bad in ("", "4x", "0", "a=b", "dp=2,dp=2", "-1"):
        with pytest.raises(UsageError):
            parse_mesh(bad)
    src = fsdp2_dcp[0]
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps({"placements": {"nothing.*": ["Shard(0)"]}, "default": ["Shard(0)"]}))
    with pytest.raises(UsageError, match="match no tensor"):
        reshard.convert(src, tmp_path / "a", to_mesh="2", placements=str(plan), quiet=True)
    plan.write_text(json.dumps({"placements": {"*": ["Shard(1)"]}}))
    with pytest.raises(UsageError, match="does not fit"):
        reshard.convert(src, tmp_path / "b", to_mesh="2", placements=str(plan), quiet=True)
    plan.write_text(json.dumps({"mesh": ["dp_shard", "tp"], "placements": {"*": ["Shard(0)", "Shard(0)"]}}))
    with pytest.raises(UsageError, match="written for a mesh"):
        reshard.convert(src, tmp_path / "c", to_mesh="dp_replicate=2,dp_shard=2", placements=str(plan), quiet=True)
    with pytest.raises(UsageError, match="whole tensors"):
        reshard.convert(src, tmp_path / "d.safetensors", to_mesh="2", quiet=True)
    with pytest.raises(UsageError, match="1-D mesh"):
        reshard.convert(src, tmp_path / "e", to_mesh="2x2", placements="fsdp", quiet=True)
    assert not any(tmp_path.glob("[abcde]*")) and not any(tmp_path.glob(".*reshard-*"))


def _named_ranks(label: str) -> list[int]:
    """The ranks a row of the --to-mesh table names: ``0-1, 8-9, ..., 120-121 (every 8)``."""
    every = None
    if label.endswith(")"):
        label, _, step = label.rpartition(" (every ")
        every = int(step[:-1])
    runs = [tuple(map(int, part.split("-"))) if "-" in part else (int(part), int(part))
            for part in label.split(", ") if part != "..."]
    if every is not None:
        width = runs[0][1] - runs[0][0]
        runs = [(a, a + width) for a in range(runs[0][0], runs[-1][0] + 1, every)]
    return [r for a, b in runs for r in range(a, b + 1)]


def test_inspect_to_mesh_names_the_ranks_of_every_row(fsdp2_dcp, capsys) -> None:
    """Rows of ranks holding the same bytes say which ranks they are, on 2-D meshes too (the
    replicas of an HSDP mesh are not consecutive), as docs/cli.md shows them."""
    from reshard.cli.app import main

    for mesh, world, want in (("4x8", 32, "0-1, 8-9, 16-17, 24-25"), ("16x8", 128, "0-1, 8-9, ..., 120-121 (every 8)"),
                              ("128", 128, "11-127")):
        assert main(["inspect", str(fsdp2_dcp[0]), "--to-mesh", mesh, "--json"]) == 0
        per_rank = {r["rank"]: r["total"] for r in json.loads(capsys.readouterr().out)["target"]["ranks"]}
        assert main(["inspect", str(fsdp2_dcp[0]), "--to-mesh", mesh]) == 0
        table = capsys.readouterr().out.split("on mesh ", 1)[1].splitlines()
        assert table[1].split() == ["params", "optim", "other", "total", "ranks"]
        rows = table[2:table.index(next(line for line in table if line.startswith("largest rank")))]
        named = []
        for row in rows:
            total, label = row[36:46].strip(), row[48:]
            ranks = _named_ranks(label)
            assert {format_size(per_rank[r]) for r in ranks} == {total}, (mesh, row)
            named += ranks
        assert sorted(named) == list(range(world)), (mesh, rows)
        assert any(row.endswith(f"  {want}") for row in rows), (mesh, rows)


def test_inspect_to_mesh_with_equal_ranks_does_not_name_a_largest_and_a_smallest(fsdp2_dcp, capsys) -> None:
    """Every rank holding the same bytes printed "largest rank: 0 (...); smallest rank: 0 (...)":
    one rank both largest and smallest. It says what each rank holds instead; uneven ranks are
    still named."""
    from reshard.cli.app import main
    from reshard.pipeline.mesh_report import mesh_table

    assert main(["inspect", str(fsdp2_dcp[0]), "--to-mesh", "1"]) == 0
    out = capsys.readouterr().out
    total = format_size(reshard.inspect(fsdp2_dcp[0]).total_bytes)
    assert "largest rank" not in out and "smallest rank" not in out, out
    assert f"the one rank holds {total}; imbalance (max/mean): 1.000" in out.splitlines(), out
    row = {"params": 10, "optim": 20, "other": 0, "total": 30}
    summary = {"mesh": {"shape": [4], "names": ["dp_shard"]}, "ranks": [dict(row, rank=r) for r in range(4)],
               "imbalance": 1.0, "uneven": {}, "notices": []}
    lines = mesh_table(summary).splitlines()
    assert lines[-1] == "each of the 4 ranks holds 30 B; imbalance (max/mean): 1.000", lines
    summary["ranks"][3] = dict(row, total=40, rank=3)
    assert mesh_table(summary).splitlines()[-1].startswith("largest rank: 3 (40 B); smallest rank: 0 (30 B); ")
