"""torchtitan's checkpoint layout, saved the way its CheckpointManager saves it (torch's own
state-dict helpers, flattened optimizer state keyed by FQN, lr_scheduler / dataloader /
train_state sections, model under ``model.`` or at the top level) by FSDP2 on 2 gloo ranks,
then resumed on 3: ``load_model`` restores weights, moments, step and lr exactly; ``--to-mesh 3``
shards every optimizer tensor like its parameter, and torch's ``dcp.load`` on a live 3-rank
model reads the result exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import reshard
from reshard.cli.example import TinyNet
from reshard.pipeline.mesh_report import summarize_for_mesh
from tests.dist import HANG_GUARD, run_world

LR = 0.0123  # what the scheduler left in the optimizer: a value no fresh optimizer has
_SPELLINGS = ("model", "top")  # model tensors under model. (torchtitan <= 0.1) or at the top level


def _fsdp(world: int, seed: int) -> TinyNet:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = TinyNet()
    mesh = init_device_mesh("cpu", (world,))
    for sub in (model.embed, model.proj, model.head):
        fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _titan_state(model: torch.nn.Module, opt: torch.optim.Optimizer, sched, rank: int, spelling: str) -> dict:
    """What torchtitan's CheckpointManager hands dcp.save (components/checkpoint.py)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    rest = {
        "optimizer": osd,
        "lr_scheduler": sched.state_dict(),
        "dataloader": {f"dp_rank_{rank}": {"sample": 5 + rank}},
        "train_state": {"step": 2, "ntokens_seen": 40},
    }
    return {"model": msd, **rest} if spelling == "model" else {**msd, **rest}


def _save(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    model = _fsdp(world, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: LR / 0.05 if step else 1.0)
    for _ in range(2):
        tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(rank))
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(LR)
    for spelling in _SPELLINGS:
        dcp.save(_titan_state(model, opt, sched, rank, spelling), checkpoint_id=Path(root) / spelling)
    full = {f"model.{k}": v.full_tensor() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _, osd = get_state_dict(model, opt)
    for fqn, state in osd["state"].items():
        full.update({f"optim.{fqn}.{k}": v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()})
    if rank == 0:
        torch.save({"tensors": full, "lr": opt.param_groups[0]["lr"]}, Path(root) / "ref.pt")
    dist.barrier()


def _check(model: torch.nn.Module, opt: torch.optim.Optimizer, ref: dict, where: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    full = ref["tensors"]
    for k, v in model.state_dict().items():
        assert torch.equal(v.full_tensor(), full[f"model.{k}"]), (where, k)
    _, osd = get_state_dict(model, opt)
    assert len(osd["state"]) == 6
    for fqn, state in osd["state"].items():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, (where, fqn)
        for k, v in state.items():
            got = v.full_tensor() if hasattr(v, "full_tensor") else v
            assert got.dtype == full[f"optim.{fqn}.{k}"].dtype and torch.equal(got, full[f"optim.{fqn}.{k}"]), (where, fqn, k)
    assert opt.param_groups[0]["lr"] == ref["lr"] and opt.param_groups[0]["betas"] == (0.8, 0.95), where


def _resume(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    ref = torch.load(Path(root) / "ref.pt", weights_only=True)
    for spelling in _SPELLINGS:
        for mode in ("rank0", "parallel"):
            model = _fsdp(world, 1234)
            opt = torch.optim.AdamW(model.parameters(), lr=0.5)
            result = reshard.load_model(model, Path(root) / spelling, optimizer=opt, mode=mode, progress=False)
            assert result.missing == [] and result.unexpected == []
            _check(model, opt, ref, f"load_model {spelling} {mode}")
    # torch's own reader, on the output laid out for 3 ranks: same names, every shard in place.
    model = _fsdp(world, 1234)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model(torch.randint(0, 11, (4, 5))).square().mean().backward()  # optimizer state to overwrite
    opt.step()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt, options=options)}
    dcp.load(state, checkpoint_id=Path(root) / "model_3")
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optimizer"], options=options)
    _check(model, opt, ref, "dcp.load of --to-mesh 3")


@pytest.fixture(scope="module")
def titan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("titan")
    run_world(_save, 2, str(root), timeout=HANG_GUARD)
    return root


def test_layout_is_detected_and_optimizer_state_follows_its_parameter(titan: Path) -> None:
    for spelling, layout in (("model", "torchtitan"), ("top", "torchtitan-flat")):
        cat = reshard.inspect(titan / spelling)
        from reshard.core.conventions import detect_layout

        found = detect_layout(cat)
        assert found.name == layout and found.groups == "fqn"
        assert found.place("optimizer.state.embed.weight.exp_avg").fqn == "embed.weight"
        assert found.role("dataloader.dp_rank_1.sample") == "per_rank"
        summary = summarize_for_mesh(cat, "3", None)
        for row in summary["ranks"]:
            # Each rank holds the moments of exactly its parameter shards (2 x the bytes) plus the
            # six replicated 0-d steps: the optimizer is sharded like the model, not whole on one rank.
            assert row["optim"] == 2 * row["params"] + 6 * 4, row
        assert summary["imbalance"] < 1.3


def test_resume_on_three_ranks_restores_everything(titan: Path) -> None:
    out = reshard.convert(titan / "model", titan / "model_3", to_mesh="3", quiet=True)
    assert any("dataloader.dp_rank_0.sample" in n for n in out.notices)  # per-rank state named, not carried
    cat = reshard.inspect(titan / "model_3")
    for name, entry in cat.tensors.items():
        if name.startswith("optimizer.state.") and entry.shape:
            fqn = name.removeprefix("optimizer.state.").rpartition(".")[0]
            assert [c.box for c in entry.chunks] == [c.box for c in cat.tensors[f"model.{fqn}"].chunks], name
    assert cat.objects["optimizer.param_groups.embed.weight.lr"] == pytest.approx(LR)
    run_world(_resume, 3, str(titan), timeout=HANG_GUARD)
