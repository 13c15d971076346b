"""load_model on 2-D meshes: tensor parallelism under FSDP2, what torchtitan builds for large
runs. ``fully_shard`` over a column-parallel weight shards its rows twice, and the outer shard
is a ``_StridedShard``: a rank's rows are not where a plain ``Shard(0)`` would put them, and in
general not one run. Checkpoints are written by torch's ``dcp.save`` of ``get_state_dict``;
every parameter and Adam moment loaded through reshard (both modes) must equal the full
tensors of the run that saved it. Dims are chosen to split unevenly (14 rows over 2x2).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import reshard
from tests.dist import HANG_GUARD, run_world


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(9, 6)
        self.up = torch.nn.Linear(6, 14)  # column parallel: rows over tp, then again over dp (strided)
        self.down = torch.nn.Linear(14, 6)  # row parallel: columns over tp, rows over dp
        self.head = torch.nn.Linear(6, 3, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(self.embed(tokens)))))


def _model(shape: tuple[int, ...], seed: int) -> MLP:
    """``(dp,)``: FSDP2 alone; ``(dp, tp)``: TP inside FSDP2, as torchtitan's ``parallelize`` does;
    ``(replicate, shard, tp)``: HSDP over TP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = MLP()
    if len(shape) == 1:
        fully_shard(model, mesh=init_device_mesh("cpu", shape))
        return model
    if len(shape) == 3:  # HSDP x TP: replicas of an FSDP group, each over a TP group
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["replicate", "shard"])
        return model
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def _trained(shape: tuple[int, ...]) -> tuple[MLP, torch.optim.Optimizer]:
    model = _model(shape, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.arange(12).remainder(9).view(2, 6)
    for _ in range(2):
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _full(model: MLP, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and moment as a full tensor (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": v for k, v in msd.items()}
    out.update({f"optim.{fqn}.{key}": v for fqn, s in osd["state"].items() for key, v in s.items()})
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in out.items()}


def _save(model: MLP, opt: torch.optim.Optimizer, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)


def _check_load(shape: tuple[int, ...], source: Path, want: dict[str, torch.Tensor], mode: str) -> None:
    model = _model(shape, seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    result = reshard.load_model(model, source, optimizer=opt, mode=mode, progress=False, max_memory="1KiB")
    assert result.missing == [] and result.unexpected == [], (result.missing, result.unexpected)
    got = _full(model, opt)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), (shape, mode, name)
    assert opt.param_groups[0]["lr"] == 1e-2


def _four_ranks(rank: int, world: int, tmp: str) -> None:
    from torch.distributed.tensor import DTensor

    tmp_path = Path(tmp)
    model, opt = _trained((2, 2))
    strided = [n for n, p in model.named_parameters() if "Strided" in str(p.placements)]
    assert strided == ["up.weight", "up.bias"], [(n, p.placements) for n, p in model.named_parameters()]
    assert isinstance(model.up.weight, DTensor)
    want_2d = _full(model, opt)
    _save(model, opt, tmp_path / "tp_fsdp")
    if rank == 0:
        torch.save(want_2d, tmp_path / "tp_fsdp.pt")

    flat, flat_opt = _trained((4,))
    want_1d = _full(flat, flat_opt)
    _save(flat, flat_opt, tmp_path / "fsdp")
    dist.barrier()

    for mode in ("rank0", "parallel"):
        _check_load((2, 2), tmp_path / "tp_fsdp", want_2d, mode)  # 2x2 -> 2x2
        _check_load((2, 2), tmp_path / "fsdp", want_1d, mode)  # 1-D FSDP -> 2x2 TP+FSDP
        _check_split_rows(tmp_path / "tp_fsdp", want_2d["model.up.weight"], mode)
        _check_load((2, 1, 2), tmp_path / "tp_fsdp", want_2d, mode)  # 2x2 -> HSDP x TP (3-D mesh)


def _check_split_rows(source: Path, full: torch.Tensor, mode: str) -> None:
    """A strided shard left alone by the second mesh dim holds two runs of rows per rank
    (rows [0:4) and [7:11) of 14 on dp rank 0): both are filled, nothing else."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2))
    placements = (_StridedShard(0, split_factor=2), Replicate())
    rows = [0, 1, 2, 3, 7, 8, 9, 10] if mesh.get_coordinate()[0] == 0 else [4, 5, 6, 11, 12, 13]
    def dtensor(local: torch.Tensor) -> DTensor:
        return DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride(), run_check=False)

    assert torch.equal(dtensor(full[rows]).full_tensor(), full)  # torch puts these rows there too
    local = torch.zeros(len(rows), 6)
    target = dtensor(local)
    result = reshard.load_state_dict({"up.weight": target}, source, mode=mode, strict=False, progress=False)
    assert result.loaded == ["up.weight"], result.loaded
    assert torch.equal(local, full[rows]), (mode, mesh.get_coordinate())


def _three_ranks(rank: int, world: int, tmp: str) -> None:
    want = torch.load(Path(tmp) / "tp_fsdp.pt", weights_only=True)
    for mode in ("rank0", "parallel"):
        _check_load((3,), Path(tmp) / "tp_fsdp", want, mode)  # 2x2 TP+FSDP -> 1x3 FSDP


def test_tp_fsdp_checkpoints_load_across_2d_and_1d_meshes(tmp_path: Path) -> None:
    run_world(_four_ranks, 4, str(tmp_path), timeout=HANG_GUARD)
    run_world(_three_ranks, 3, str(tmp_path), timeout=HANG_GUARD)
