from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import reshard
from reshard.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError
from reshard.formats.dcp import DCPFormat
from tests.fixtures import full_tensor


def test_reads_fsdp2_checkpoint_exactly(fsdp2_dcp, fsdp2_reference) -> None:
    cat = DCPFormat().read(fsdp2_dcp[0])
    assert set(cat.tensors) == set(fsdp2_reference)
    for name, ref in fsdp2_reference.items():
        assert torch.equal(full_tensor(cat.tensors[name]), ref), name
    # Uneven shards over 3 ranks: 11 rows -> 4, 4, 3; the empty shard of head.weight stores nothing.
    assert [c.box.sizes[0] for c in cat.tensors["model.embed.weight"].chunks] == [4, 4, 3]
    assert len(cat.tensors["model.head.weight"].chunks) == 2
    assert cat.objects["extra.step"] == 2 and cat.objects["optim.param_groups.0.betas"] == (0.9, 0.999)
    assert cat.paths["optim.state.embed.weight.exp_avg"] == ("optim", "state", "embed.weight", "exp_avg")
    assert cat.attrs["source_world_size"] == 3


def test_written_dcp_loads_with_torch(fsdp2_dcp, fsdp2_reference, tmp_path: Path) -> None:
    out = tmp_path / "out"
    reshard.convert(fsdp2_dcp[0], out, to="dcp", max_memory="4KiB", quiet=True)
    # torch's own loader, into a state dict we allocate (what a training job does)...
    sd = {name: torch.empty_like(ref) for name, ref in fsdp2_reference.items()}
    dcp.load(sd, checkpoint_id=out)
    for name, ref in fsdp2_reference.items():
        assert torch.equal(sd[name], ref), name
    # ...and torch's converter, which rebuilds the nesting from our planner data.
    dcp_to_torch_save(out, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert torch.equal(full["model"]["embed.weight"], fsdp2_reference["model.embed.weight"])
    assert full["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert full["extra"]["note"] == "tiny"


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _rewrite_metadata(ckpt: Path, edit) -> None:
    meta = pickle.loads((ckpt / ".metadata").read_bytes())  # our own test fixture, trusted
    edit(meta)
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))


def test_hostile_and_broken_metadata(fsdp2_dcp, tmp_path: Path) -> None:
    fmt = DCPFormat()
    marker = tmp_path / "pwned"
    evil = _copy(fsdp2_dcp[0], tmp_path / "a")
    (evil / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*system"):
        fmt.read(evil)
    assert not marker.exists()

    overlap = _copy(fsdp2_dcp[0], tmp_path / "b")

    def grow(meta) -> None:
        c = meta.state_dict_metadata["model.embed.weight"].chunks[0]
        c.sizes = torch.Size([5, 6])

    _rewrite_metadata(overlap, grow)
    with pytest.raises(CorruptCheckpointError, match="embed.weight.*overlap"):
        fmt.read(overlap)

    escape = _copy(fsdp2_dcp[0], tmp_path / "c")

    def outside(meta) -> None:
        key = next(iter(meta.storage_data))
        meta.storage_data[key].relative_path = "../../etc/passwd"

    _rewrite_metadata(escape, outside)
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint"):
        fmt.read(escape)

    truncated = _copy(fsdp2_dcp[0], tmp_path / "d")
    data = truncated / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:200])
    with pytest.raises(CorruptCheckpointError, match="__1_0.distcp"):
        fmt.read(truncated)

    missing = _copy(fsdp2_dcp[0], tmp_path / "e")
    (missing / "__2_0.distcp").unlink()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        fmt.read(missing)

    with pytest.raises(CheckpointNotFoundError):
        fmt.read(tmp_path / "nothing")
