"""load_model into a model whose state dict hooks save its parameters under other names, as
torchtitan 0.3's ``FusedQKVLinear`` does (one ``wqkv`` parameter, saved as the stock ``wq`` /
``wk`` / ``wv``, gathered to Replicate; merged back by a load pre-hook). torch's
``get_state_dict`` cannot walk those names back to the module and raised AttributeError from
inside torch; load_model now loads such a model the way its trainer does: its own
``state_dict`` to fill, ``load_state_dict`` to apply, the optimizer keyed by parameter FQNs.

torchtitan itself does not install beside this project's test dependencies (it pins an older
datasets, which downgrades huggingface_hub and fsspec), so the module below reproduces its
hooks' behaviour on a small model; checkpoints saved on 2 FSDP2 ranks, loaded on 3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import reshard
from tests.dist import HANG_GUARD, run_world


class FusedQKV(torch.nn.Module):
    """q, k and v projections in one parameter, saved and loaded as three."""

    def __init__(self, dim: int = 6, q_out: int = 6, kv_out: int = 3) -> None:
        super().__init__()
        self.sizes = (q_out, kv_out, kv_out)
        self.wqkv = torch.nn.Linear(dim, sum(self.sizes), bias=False)
        self.register_state_dict_post_hook(self._split_on_save)
        self.register_load_state_dict_pre_hook(self._merge_on_load)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wqkv(x)

    @staticmethod
    def _split_on_save(module, state_dict, prefix, local_metadata) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        fused = state_dict.pop(f"{prefix}wqkv.weight")
        if isinstance(fused, DTensor):
            fused = fused.redistribute(fused.device_mesh, [Replicate()] * fused.device_mesh.ndim)
        for name, part in zip(("wq", "wk", "wv"), torch.split(fused, module.sizes, dim=0)):
            state_dict[f"{prefix}{name}.weight"] = part.contiguous()

    @staticmethod
    def _merge_on_load(module, state_dict, prefix, *args) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        keys = [f"{prefix}{n}.weight" for n in ("wq", "wk", "wv")]
        if all(k in state_dict for k in keys):
            parts = [state_dict.pop(k) for k in keys]
            if isinstance(parts[0], DTensor):
                parts = [t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim) for t in parts]
            state_dict[f"{prefix}wqkv.weight"] = torch.cat(parts, dim=0)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.qkv = FusedQKV()
        self.head = torch.nn.Linear(12, 2, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.qkv(self.embed(tokens)))


def _fsdp(world: int, seed: int) -> Net:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.qkv, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model: Net, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for fqn, p in model.named_parameters():
        out[fqn] = p.full_tensor()
        for key, v in opt.state[p].items():
            out[f"{fqn}.{key}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return out


def _save(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    model = _fsdp(world, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    for _ in range(2):
        tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(rank))
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with pytest.raises(AttributeError):  # what load_model used to raise from inside torch
        get_model_state_dict(model)
    # What torchtitan's CheckpointManager saves: the model's own state dict, the optimizer flattened by FQN.
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    dcp.save({"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt, options=options)},
             checkpoint_id=Path(root) / "ckpt")
    full = _full(model, opt)
    if rank == 0:
        torch.save({"full": full, "lr": opt.param_groups[0]["lr"]}, Path(root) / "ref.pt")
    dist.barrier()


def _resume(rank: int, world: int, root: str) -> None:
    ref = torch.load(Path(root) / "ref.pt", weights_only=True)
    for with_optimizer in (True, False):
        model = _fsdp(world, 1234)
        opt = torch.optim.AdamW(model.parameters(), lr=0.5) if with_optimizer else None
        result = reshard.load_model(model, Path(root) / "ckpt", optimizer=opt, progress=False)
        assert result.missing == [] and any("model's own state_dict" in n for n in result.notices), result
        for fqn, p in model.named_parameters():
            assert torch.equal(p.full_tensor(), ref["full"][fqn]), fqn
        if opt is None:
            continue
        got = _full(model, opt)
        assert set(got) == set(ref["full"])
        for name, want in ref["full"].items():
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
        assert opt.param_groups[0]["lr"] == ref["lr"]
        # and training goes on from there
        model(torch.randint(0, 11, (4, 5))).square().mean().backward()
        opt.step()


def test_a_model_that_renames_its_parameters_on_save_resumes_on_three_ranks(tmp_path: Path) -> None:
    run_world(_save, 2, str(tmp_path), timeout=HANG_GUARD)
    names = set(reshard.inspect(tmp_path / "ckpt").tensors)
    assert {"model.qkv.wq.weight", "optimizer.state.qkv.wqkv.weight.exp_avg"} <= names
    run_world(_resume, 3, str(tmp_path), timeout=HANG_GUARD)
