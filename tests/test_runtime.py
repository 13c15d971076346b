"""reshard.load_model / load_state_dict into live models, on real gloo worlds.

The source is the session's FSDP2 + AdamW DCP saved by torch on 3 ranks (uneven and empty
shards), or reshard's conversions of it. Every check compares full tensors with the reference
torch gathered when it saved. Worlds cost ~2 s per rank to start on two cores, so each
checks many things:

* 2 ranks: FSDP2 in ``rank0`` mode with a tiny budget (many slabs), DDP (broadcast path),
  then mismatches on every rank with the model untouched, ``strict=False``, shape and
  missing-source errors, and a training step after the load.
* 3 ranks: a model-only safetensors file in ``rank0`` (auto, only rank 0 can see it) and
  ``parallel`` mode; an optimizer the file has no state for.
* 4 ranks: FSDP2 in ``parallel`` mode, a torch.save full file, a 2x2 HSDP mesh.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import reshard
from reshard.cli.example import TinyNet, full_reference
from reshard.core.errors import CheckpointNotFoundError, ReshardError, UsageError
from reshard.runtime.load import StateDictMismatchError
from tests.dist import HANG_GUARD, run_world

MISSING_SOURCE = "/nonexistent/reshard-test/model.safetensors"


# ----------------------------------------------------------------------- helpers (in ranks)


def _fsdp(mesh_shape: tuple[int, ...], model: torch.nn.Module | None = None) -> TinyNet:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1234)  # a different init from the checkpoint's (seed 0)
    model = model or TinyNet()
    names = ("dp_shard",) if len(mesh_shape) == 1 else ("dp_replicate", "dp_shard")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for name in ("embed", "proj", "head"):
        if hasattr(model, name):
            fully_shard(getattr(model, name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: _full(v).clone() for k, v in model.state_dict().items()}


def _check_model(model: torch.nn.Module, full: dict[str, torch.Tensor], names: list[str] | None = None) -> None:
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    sd = inner.state_dict()
    for k in names or list(sd):
        assert torch.equal(_full(sd[k]).cpu(), full[f"model.{k}"].cpu()), k


def _check_optim(model: torch.nn.Module, opt: torch.optim.Optimizer, full: dict[str, torch.Tensor]) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _, osd = get_state_dict(model, opt)
    assert len(osd["state"]) == 6
    for fqn, state in osd["state"].items():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        for k, v in state.items():
            assert torch.equal(_full(v).cpu(), full[f"optim.state.{fqn}.{k}"].cpu()), (fqn, k)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["weight_decay"] == 0.01


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    before = _snapshot(model)
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(7))
    model(tokens).square().mean().backward()
    opt.step()
    opt.zero_grad()
    after = _snapshot(model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(float(s["step"]) == 3.0 for s in opt.state.values())


def _error_on_every_rank(fn: Any, kind: type[BaseException]) -> str:
    """Run ``fn`` expecting ``kind``; the message must be the same on every rank."""
    with pytest.raises(kind) as e:
        fn()
    messages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, (type(e.value).__name__, str(e.value)))
    assert all(m == messages[0] for m in messages), messages
    return str(e.value)


class Drifted(TinyNet):
    """TinyNet that lost ``norm`` and gained ``scale``: one missing, two unexpected names."""

    def __init__(self) -> None:
        super().__init__()
        del self.norm
        self.scale = torch.nn.Parameter(torch.ones(3))


class Wider(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(12, 6)


# ------------------------------------------------------------------------------- worlds


def _two_ranks(rank: int, world: int, ckpt: str, ref: str) -> None:
    full = full_reference(Path(ref))
    cat = reshard.inspect(ckpt)
    model_optim_bytes = sum(t.nbytes for n, t in cat.tensors.items() if n.startswith(("model.", "optim.")))

    # FSDP2 over 2 ranks from a 3-rank save; a 200-byte budget cuts tensors into 50-byte slabs.
    model = _fsdp((world,))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    res = reshard.load_model(model, ckpt, opt, mode="rank0", max_memory="200B")
    _check_model(model, full)
    _check_optim(model, opt, full)
    assert res.mode == "rank0" and res.missing == [] and res.unexpected == []
    assert res.objects["extra.step"] == 2 and res.objects["extra.note"] == "tiny"
    local = sum(v.to_local().nbytes for v in model.state_dict().values())
    assert res.bytes == (model_optim_bytes if rank == 0 else local + 6 * 4 + sum(
        s[k].to_local().nbytes for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")))
    _train_step(model, opt)

    # DDP: every rank holds every tensor whole, so rank 0 broadcasts.
    ddp = torch.nn.parallel.DistributedDataParallel(TinyNet())
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=0.5)
    reshard.load_model(ddp, ckpt, ddp_opt, mode="rank0")
    _check_model(ddp, full)
    _check_optim(ddp, ddp_opt, full)
    _train_step(ddp, ddp_opt)

    # A model the checkpoint does not fit: one error, the same on every rank, nothing touched.
    drifted = _fsdp((world,), Drifted())
    before = _snapshot(drifted)
    for mode in ("rank0", "parallel"):
        msg = _error_on_every_rank(lambda: reshard.load_model(drifted, ckpt, mode=mode), StateDictMismatchError)
        assert msg == (
            f"{ckpt}: checkpoint does not match the state dict being loaded: 1 missing (in the state dict, not in "
            "the checkpoint): 'scale'; 2 unexpected (in the checkpoint, not in the state dict): 'model.norm.weight', "
            "'model.norm.bias'. Nothing was loaded. Pass keymap=... to rename the checkpoint's names, or "
            "strict=False to load the names that match")
    drifted_opt = torch.optim.AdamW(drifted.parameters())
    msg = _error_on_every_rank(lambda: reshard.load_model(drifted, ckpt, drifted_opt), StateDictMismatchError)
    assert "4 missing" in msg and "'optim.state.scale.exp_avg'" in msg and "8 unexpected" in msg
    after = _snapshot(drifted)
    assert all(torch.equal(before[k], after[k]) for k in before)
    res = reshard.load_model(drifted, ckpt, mode="rank0", strict=False)
    assert res.missing == ["scale"] and res.unexpected == ["model.norm.weight", "model.norm.bias"]
    _check_model(drifted, full, ["embed.weight", "proj.weight", "proj.bias", "head.weight"])
    assert torch.equal(_full(drifted.scale), before["scale"])

    # Shapes that differ fail even with strict=False; so does a source rank 0 cannot read.
    wider = _fsdp((world,), Wider())
    msg = _error_on_every_rank(lambda: reshard.load_model(wider, ckpt, mode="parallel", strict=False),
                               StateDictMismatchError)
    assert "'embed.weight' is [11, 6] in the checkpoint ('model.embed.weight') but [12, 6] here" in msg
    before = _snapshot(model)
    msg = _error_on_every_rank(lambda: reshard.load_model(model, MISSING_SOURCE, mode="rank0"), CheckpointNotFoundError)
    assert msg == f"{MISSING_SOURCE}: no such file or directory"
    _error_on_every_rank(lambda: reshard.load_model(model, ckpt, mode="broadcast"), UsageError)
    assert all(torch.equal(before[k], v) for k, v in _snapshot(model).items())


def _three_ranks(rank: int, world: int, st: str, ref: str) -> None:
    full = full_reference(Path(ref))

    # Only rank 0 can see the file: auto falls back to rank0 streaming.
    model = _fsdp((world,))
    res = reshard.load_model(model, st if rank == 0 else MISSING_SOURCE, mode="auto")
    assert res.mode == "rank0" and res.objects == {}
    _check_model(model, full)

    # Everyone sees it: auto reads in parallel; load_state_dict fills a nested state dict.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = _fsdp((world,))
    res = reshard.load_state_dict({"model": get_model_state_dict(model)}, st)
    assert res.mode == "parallel" and res.loaded[0] == "model.embed.weight"
    _check_model(model, full)

    # A model-only file and an optimizer: strict says it holds no optimizer state; strict=False
    # loads the model, lists the state as missing and leaves the optimizer's fresh state.
    model = _fsdp((world,))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    before = _snapshot(model)
    msg = _error_on_every_rank(lambda: reshard.load_model(model, st, opt, mode="rank0"), StateDictMismatchError)
    assert "holds no optimizer state (layout state-dict), but an optimizer was given" in msg and "load without optimizer=" in msg
    assert all(torch.equal(before[k], v) for k, v in _snapshot(model).items())
    res = reshard.load_model(model, st, opt, mode="rank0", strict=False)
    assert len(res.missing) == 18 and opt.param_groups[0]["lr"] == 0.5
    _check_model(model, full)
    tokens = torch.randint(0, 11, (2, 3))
    model(tokens).sum().backward()
    opt.step()


def _four_ranks(rank: int, world: int, ckpt: str, pt: str, ref: str) -> None:
    full = full_reference(Path(ref))
    for source, mode, mesh in ((ckpt, "parallel", (4,)), (pt, "rank0", (4,)), (ckpt, "rank0", (2, 2)),
                               (pt, "auto", (2, 2))):
        model = _fsdp(mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.5)
        res = reshard.load_model(model, source, opt, mode=mode, max_memory="1KiB")
        assert res.mode == ("parallel" if mode == "auto" else mode), (source, mode, mesh)
        _check_model(model, full)
        _check_optim(model, opt, full)
    _train_step(model, opt)


# -------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def conversions(fsdp2_dcp: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model-only safetensors file, torch.save full file) made from the session DCP."""
    out = tmp_path_factory.mktemp("runtime")
    st, pt = out / "model.safetensors", out / "full.pt"
    reshard.convert(fsdp2_dcp[0], st, only="model", quiet=True)
    reshard.convert(fsdp2_dcp[0], pt, quiet=True)
    return st, pt


def test_rank0_fsdp2_ddp_and_errors_on_two_ranks(fsdp2_dcp: tuple[Path, Path]) -> None:
    run_world(_two_ranks, 2, str(fsdp2_dcp[0]), str(fsdp2_dcp[1]), timeout=HANG_GUARD)


def test_safetensors_model_only_on_three_ranks(fsdp2_dcp: tuple[Path, Path], conversions: tuple[Path, Path]) -> None:
    run_world(_three_ranks, 3, str(conversions[0]), str(fsdp2_dcp[1]), timeout=HANG_GUARD)


def test_parallel_torch_save_and_hsdp_on_four_ranks(fsdp2_dcp: tuple[Path, Path],
                                                    conversions: tuple[Path, Path]) -> None:
    run_world(_four_ranks, 4, str(fsdp2_dcp[0]), str(conversions[1]), str(fsdp2_dcp[1]), timeout=HANG_GUARD)


def test_single_process_plain_model(fsdp2_dcp: tuple[Path, Path], conversions: tuple[Path, Path],
                                    fsdp2_reference: dict, tmp_path: Path) -> None:
    import safetensors.torch

    ckpt, full = fsdp2_dcp[0], fsdp2_reference
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    res = reshard.load_model(model, ckpt, opt, max_memory="64B")
    assert res.mode == "local" and res.bytes == sum(
        t.nbytes for n, t in reshard.inspect(ckpt).tensors.items() if n.startswith(("model.", "optim.")))
    _check_model(model, full)
    _check_optim(model, opt, full)

    # Cast as it arrives: a bf16 model from fp32 tensors.
    bf16 = TinyNet().to(torch.bfloat16)
    reshard.load_model(bf16, conversions[1])
    for k, v in bf16.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, full[f"model.{k}"].to(torch.bfloat16)), k

    # Wrapper noise in the names goes through a key map.
    wrapped = tmp_path / "wrapped.safetensors"
    safetensors.torch.save_file({f"_orig_mod.{k}": v.contiguous() for k, v in _snapshot(model).items()}, wrapped)
    with pytest.raises(StateDictMismatchError, match="6 missing"):
        reshard.load_model(TinyNet(), wrapped)
    fresh = TinyNet()
    reshard.load_model(fresh, wrapped, keymap="strip-wrappers")
    _check_model(fresh, full)

    # Errors name the file and what to do; a ReshardError, so the CLI prints one line.
    with pytest.raises(ReshardError, match=f"^{MISSING_SOURCE}: no such file or directory$"):
        reshard.load_model(TinyNet(), MISSING_SOURCE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_targets(fsdp2_dcp: tuple[Path, Path], fsdp2_reference: dict, tmp_path: Path) -> None:
    ckpt, full = fsdp2_dcp[0], fsdp2_reference
    model = TinyNet().cuda()
    reshard.load_model(model, ckpt, mode="parallel")  # no group: read straight into GPU memory
    assert model.embed.weight.is_cuda
    _check_model(model, full)
    # One NCCL rank in rank0 mode: pinned host slabs copied to the GPU as they go out.
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = TinyNet().cuda()
        opt = torch.optim.AdamW(model.parameters())
        res = reshard.load_model(model, ckpt, opt, mode="rank0", max_memory="256B")
        assert res.mode == "rank0" and model.embed.weight.is_cuda
        _check_model(model, full)
        _check_optim(model, opt, full)
    finally:
        dist.destroy_process_group()
    run_world(_cuda_gloo_ranks, 2, str(ckpt), str(fsdp2_dcp[1]), timeout=HANG_GUARD)


def _cuda_gloo_ranks(rank: int, world: int, ckpt: str, ref: str) -> None:
    """gloo carries host slabs; receivers move them to their GPU as they arrive."""
    full = full_reference(Path(ref))
    model = TinyNet().cuda()
    opt = torch.optim.AdamW(model.parameters())
    reshard.load_model(model, ckpt, opt, mode="rank0", max_memory="256B")
    assert model.embed.weight.is_cuda
    _check_model(model, full)
    _check_optim(model, opt, full)


def test_section_loads_another_section_as_the_model(tmp_path: Path) -> None:
    """``section="ema"``: a DCP of ``{"model", "ema", "optim"}`` (torch's dcp.save) loads its EMA
    copy into the model and says that the model section was not read."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model, ema = TinyNet(), TinyNet()
    dcp.save({"model": model.state_dict(), "ema": ema.state_dict(), "step": 3}, checkpoint_id=tmp_path / "ckpt")
    live = TinyNet()
    result = reshard.load_model(live, tmp_path / "ckpt", section="ema", progress=False)
    assert result.missing == [] and result.unexpected == []
    for k, v in live.state_dict().items():
        assert torch.equal(v, ema.state_dict()[k]), k
    assert any("section='ema'" in n and "not read" in n for n in result.notices), result.notices
    with pytest.raises(UsageError, match="its sections are ema, model"):
        reshard.load_model(TinyNet(), tmp_path / "ckpt", section="emma", progress=False)


class _Container(torch.optim.Optimizer):
    """torchtitan's OptimizersContainer in miniature: an Optimizer over every parameter whose
    own ``state`` stays empty, the real optimizers in ``.optimizers``."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]], {})


def test_an_optimizer_container_loads_into_the_optimizer_inside(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 4, 9]])).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "ckpt")

    live = TinyNet()
    inner = torch.optim.AdamW(live.parameters(), lr=0.5)
    result = reshard.load_model(live, tmp_path / "ckpt", optimizer=_Container([inner]), progress=False)
    assert any("AdamW inside _Container" in n for n in result.notices), result.notices
    names = dict(live.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(inner.state[names[name]]["exp_avg"], opt.state[p]["exp_avg"]), name
    assert inner.param_groups[0]["lr"] == 0.1
    two = _Container([torch.optim.AdamW([live.embed.weight]), torch.optim.AdamW([live.head.weight])])
    with pytest.raises(UsageError, match="of 2 optimizers"):
        reshard.load_model(live, tmp_path / "ckpt", optimizer=two, progress=False)
