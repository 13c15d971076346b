"""The built-in example checkpoint for tests, written by torch itself (`scripts/example.py`
makes the README's example with `reshard train` instead).

``save_fsdp2_dcp`` trains a tiny model wrapped with FSDP2 (``fully_shard``) for two AdamW
steps on a gloo world and saves model + optimizer + extra objects with ``dcp.save``, exactly
as torchtitan-style trainers do. Shapes are chosen so that 3 ranks shard them unevenly and
some ranks hold empty shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

__all__ = ["TinyNet", "save_fsdp2_dcp", "full_reference"]


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)  # 11 rows over 3 ranks: 4, 4, 3
        self.proj = torch.nn.Linear(6, 7)  # 7 rows: 3, 3, 1
        self.head = torch.nn.Linear(7, 2, bias=False)  # 2 rows over 3 ranks: 1, 1, empty
        self.norm = torch.nn.LayerNorm(7)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.proj(self.embed(tokens)))))


def _save_worker(rank: int, world_size: int, out: str, ref: str) -> None:
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    # torch warns that a wrapped Linear returns a view (its matmul reshapes 3-D input), in
    # case the caller modifies it in place; this model never does.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    torch.manual_seed(0)
    model = TinyNet()
    mesh = init_device_mesh("cpu", (world_size,))
    for sub in (model.embed, model.proj, model.head):
        fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(rank))
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    extra = {"step": 2, "note": "tiny", "scale": torch.tensor([1.5, 2.5])}
    dcp.save({"model": msd, "optim": osd, "extra": extra}, checkpoint_id=out)
    # The reference full tensors, gathered by torch itself, to compare outputs against.
    full: dict[str, Any] = {}
    for k, v in msd.items():
        full[f"model.{k}"] = v.full_tensor() if isinstance(v, DTensor) else v
    # torch types "state" as any optimizer state value; an optimizer's is param -> {name: value}
    for pid, st in cast("dict[str, dict[str, Any]]", osd["state"]).items():
        for k, v in st.items():
            full[f"optim.state.{pid}.{k}"] = v.full_tensor() if isinstance(v, DTensor) else v
    full["extra.scale"] = extra["scale"]
    if rank == 0:
        torch.save({"tensors": full, "param_groups": osd["param_groups"]}, ref)
    dist.barrier()


def save_fsdp2_dcp(out: Path, world_size: int = 3) -> Path:
    """Write a DCP checkpoint at ``out`` and the gathered reference at ``out``.ref.pt."""
    from reshard.runtime.world import run_world

    ref = out.with_name(out.name + ".ref.pt")
    run_world(_save_worker, world_size, str(out), str(ref))
    return ref


def full_reference(ref: Path) -> dict[str, torch.Tensor]:
    return torch.load(ref, weights_only=True)["tensors"]
