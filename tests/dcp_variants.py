"""DCP checkpoints in every serialization torch writes, each made by torch's own writer.

``write_variants(root)`` writes one folder per variant under ``root``: the distributed ones in a
single 2-rank gloo world (ranks pay seconds to start; each save costs milliseconds), the rest
in this process with ``no_dist=True``. ``source_state_dict`` is what every variant saved, with
the DTensor as its full tensor. Adapted from the byte-by-byte survey of torch 2.13's writers;
names match its variants.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from tests.dist import HANG_GUARD

__all__ = ["WORLD_VARIANTS", "LOCAL_VARIANTS", "source_state_dict", "write_variants", "MULTICHUNK_FULL"]

WORLD_VARIANTS = (
    "default", "per_item_files", "threads3", "async_thread", "async_process", "safetensors_fmt", "zstd",
    "zstd_per_item_files", "zstd_safetensors_fmt", "no_collectives", "multichunk_default",
    "multichunk_safetensors_fmt", "hf_sharded", "hf_sharded_full_sd", "hf_consolidated", "hf_rank0_2ranks",
)
LOCAL_VARIANTS = ("torch_save_to_dcp", "no_dist", "no_flatten", "noncontig", "noncontig_zstd", "hf_single",
                  "noncontig_safetensors_fmt")
MULTICHUNK_FULL = torch.arange(18, dtype=torch.float32).reshape(6, 3)


def _sharded_full() -> torch.Tensor:
    return torch.arange(15, dtype=torch.float32).reshape(5, 3) + 100


def _tiny_full() -> torch.Tensor:
    return torch.tensor([[1.0, 2.0, 3.0]])


def source_state_dict(sharded: torch.Tensor | None = None, tiny: torch.Tensor | None = None, *,
                      tensors_only: bool = False) -> dict:
    """Every dtype class, a 0-d tensor, a tensor big enough to be read in several slabs, a
    DTensor with an empty shard (one row on two ranks), int dict keys, tuples, lists with
    tensors and dicts, None, text, an empty dict and list."""
    model = {
        "w": torch.arange(35, dtype=torch.float32).reshape(7, 5) / 4,
        "bf": torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16),
        "cplx": torch.tensor([1 + 2j, -3 + 0.5j, 0j, 4 - 4j], dtype=torch.complex64),
        "scalar_i64": torch.tensor(42, dtype=torch.int64),
        "big": torch.arange(1 << 15, dtype=torch.float32).reshape(256, 128).sin(),
        "sharded": _sharded_full() if sharded is None else sharded,
        "tiny": _tiny_full() if tiny is None else tiny,
    }
    if tensors_only:
        return {"model": model}
    return {
        "model": model,
        "optimizer": {
            "state": {0: {"exp_avg": torch.full((2, 2), 0.5), "step": torch.tensor(3.0)},
                      5: {"exp_avg": torch.tensor([7.0, 8.0, 9.0]), "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 5]}],
        },
        "extra": {"lr": 0.1},
        "edge": {"empty_dict": {}, "empty_list": [], "tuple_with_tensor": (torch.tensor([1.0, 2.0]), 3),
                 "list_of_tensors": [torch.tensor([10.0]), torch.tensor([20.0])],
                 "list_with_dict": [{"a": torch.tensor([30.0])}, "s"], "none": None, "text": "hello"},
    }


def _floats(sd: dict) -> dict:
    """The model's float tensors: HF consolidation sizes elements with torch.finfo (ints crash, complex is cut)."""
    return {"model": {k: v for k, v in sd["model"].items() if k not in ("cplx", "scalar_i64")}}


def _writers():
    from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    st = SerializationFormat.SAFETENSORS
    return {
        "default": lambda p: FileSystemWriter(p),
        "per_item_files": lambda p: FileSystemWriter(p, single_file_per_rank=False),
        "threads3": lambda p: FileSystemWriter(p, thread_count=3),
        "safetensors_fmt": lambda p: FileSystemWriter(p, serialization_format=st),
        "zstd": lambda p: FileSystemWriter(p, _extensions=[ZStandard()]),
        "zstd_per_item_files": lambda p: FileSystemWriter(p, single_file_per_rank=False, _extensions=[ZStandard()]),
        "zstd_safetensors_fmt": lambda p: FileSystemWriter(p, _extensions=[ZStandard()], serialization_format=st),
        "hf_sharded": lambda p: HuggingFaceStorageWriter(p, save_distributed=True, enable_consolidation=False),
        "hf_consolidated": lambda p: HuggingFaceStorageWriter(p, save_distributed=True, enable_consolidation=True),
        "hf_rank0_2ranks": lambda p: HuggingFaceStorageWriter(p),
    }


def _multichunk(rank: int):
    """A ShardedTensor of which rank 0 holds two chunks (rows 0-1 and 2-3), rank 1 one."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    rows = [(0, 2), (2, 4)] if rank == 0 else [(4, 6)]
    shards = [Shard(MULTICHUNK_FULL[a:b].clone(), ShardMetadata([a, 0], [b - a, 3], f"rank:{rank}/cpu")) for a, b in rows]
    return init_from_local_shards(shards, list(MULTICHUNK_FULL.shape))


def _world(rank: int, world_size: int, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the PROCESS async executor starts its own group
    mesh = init_device_mesh("cpu", (world_size,))
    sd = source_state_dict(distribute_tensor(_sharded_full(), mesh, [Shard(0)]),
                           distribute_tensor(_tiny_full(), mesh, [Shard(0)]))
    writers = _writers()
    for name in WORLD_VARIANTS:
        p = os.path.join(root, name)
        if name.startswith("multichunk"):
            writer = writers["safetensors_fmt" if name.endswith("safetensors_fmt") else "default"](p)
            dcp.save({"st": _multichunk(rank)}, storage_writer=writer)
        elif name == "async_thread":
            dcp.async_save(sd, storage_writer=writers["default"](p)).result()
        elif name == "async_process":
            dcp.async_save(sd, storage_writer=writers["default"](p),
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS).result(timeout=HANG_GUARD)
        elif name == "no_collectives":
            dcp.save(sd, storage_writer=writers["default"](p), use_collectives=False)
        elif name == "hf_consolidated":
            dcp.save(_floats(sd), storage_writer=writers[name](p))
        elif name in ("hf_sharded", "hf_rank0_2ranks"):
            dcp.save({"model": sd["model"]}, storage_writer=writers[name](p))
        elif name == "hf_sharded_full_sd":
            dcp.save(sd, storage_writer=writers["hf_sharded"](p))
        else:
            dcp.save(sd, storage_writer=writers[name](p))
        dist.barrier()


def _noncontig() -> dict:
    return {"t_transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
            "t_offset_view": torch.arange(10, dtype=torch.int32)[2:6]}


def _local(root: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    writers = _writers()
    torch.save(source_state_dict(), root / "torch_save_to_dcp.pt")
    torch_save_to_dcp(root / "torch_save_to_dcp.pt", root / "torch_save_to_dcp")
    dcp.save(source_state_dict(), checkpoint_id=root / "no_dist", no_dist=True)
    dcp.save(source_state_dict(), checkpoint_id=root / "no_flatten", no_dist=True,
             planner=DefaultSavePlanner(flatten_state_dict=False))
    dcp.save(_noncontig(), checkpoint_id=root / "noncontig", no_dist=True)
    dcp.save(_noncontig(), storage_writer=writers["zstd"](root / "noncontig_zstd"), no_dist=True)
    dcp.save(source_state_dict(tensors_only=True), storage_writer=writers["hf_rank0_2ranks"](root / "hf_single"), no_dist=True)
    try:  # torch refuses non-contiguous tensors here, after creating the data file
        dcp.save(_noncontig(), storage_writer=writers["safetensors_fmt"](root / "noncontig_safetensors_fmt"), no_dist=True)
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise


def write_variants(root: Path) -> None:
    from tests.dist import run_world

    run_world(_world, 2, str(root))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _local(root)
