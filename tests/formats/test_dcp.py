from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from reshard.formats.dcp.format import DCPFormat
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import reshard
from reshard.core.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError
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
    assert cat.facts.source_world_size == 3


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


def _plain_training_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """A model and a plain AdamW whose ``state`` is keyed by int ids {0, 1, 4, 5} (params 2 and
    3 get no gradient), as ``torch.save({"model": ..., "optimizer": opt.state_dict()})`` keeps it."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 3), "frozen": torch.nn.Linear(3, 3), "b": torch.nn.Linear(3, 2)})
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model["b"](model["a"](torch.randn(2, 4))).sum().backward()
    opt.step()
    return model, opt, {"model": model.state_dict(), "optimizer": opt.state_dict()}


def test_int_keyed_dicts_are_written_as_torch_writes_them(tmp_path: Path) -> None:
    """torch's readers see what torch's own dcp.save of the same dict gives them (str keys);
    reshard's reader gives back the int keys, so optimizer.load_state_dict works after the hop."""
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    model, opt, state = _plain_training_state()
    assert sorted(state["optimizer"]["state"]) == [0, 1, 4, 5]
    torch.save(state, tmp_path / "src.pt")
    reshard.convert(tmp_path / "src.pt", tmp_path / "ours", quiet=True)
    torch_save_to_dcp(tmp_path / "src.pt", tmp_path / "theirs")
    for name in ("ours", "theirs"):
        dcp_to_torch_save(tmp_path / name, tmp_path / f"{name}.pt")
    ours, theirs = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("ours", "theirs"))
    assert sorted(ours["optimizer"]["state"]) == sorted(theirs["optimizer"]["state"]) == ["0", "1", "4", "5"]
    assert reshard.verify(tmp_path / "ours.pt", tmp_path / "theirs.pt").equal  # structure, types and bits
    reshard.convert(tmp_path / "ours", tmp_path / "back.pt", quiet=True)
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert sorted(back["optimizer"]["state"]) == [0, 1, 4, 5]
    assert reshard.verify(tmp_path / "src.pt", tmp_path / "back.pt").equal
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
    fresh.load_state_dict(back["optimizer"])
    assert fresh.param_groups[0]["lr"] == 0.01 and fresh.param_groups[0]["betas"] == (0.8, 0.9)
    assert torch.equal(fresh.state[model["b"].bias]["exp_avg"], opt.state[model["b"].bias]["exp_avg"])


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


def test_records_found_by_offsets_read_like_records_found_by_index(fsdp2_dcp, tmp_path: Path) -> None:
    """torch names each record's chunk (MetadataIndex.index) and the columns are matched with
    array operations; records without a usable index (other writers, older torch), or in
    another order, take the general path: both give the same chunks, bytes and files."""
    from dataclasses import replace

    from reshard.formats.dcp.index import load_dcp_index

    ckpt = _copy(fsdp2_dcp[0], tmp_path)

    def unindexed(meta) -> None:
        items = list(meta.storage_data.items())[::-1]
        meta.storage_data = {replace(k, index=None if i % 2 else 10**6): v for i, (k, v) in enumerate(items)}

    _rewrite_metadata(ckpt, unindexed)
    a, b = load_dcp_index(fsdp2_dcp[0]), load_dcp_index(ckpt)
    assert list(a.tensors) == list(b.tensors) and a.objects == b.objects
    for name in a.tensors:
        ta, tb = a.table(name), b.table(name)
        assert [(box, rec) for box, rec in ta] == [(box, rec) for box, rec in tb], name
    cat = DCPFormat().read(ckpt)
    for name, entry in DCPFormat().read(fsdp2_dcp[0]).tensors.items():
        assert torch.equal(full_tensor(cat.tensors[name]), full_tensor(entry)), name


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


def test_chunk_tables_at_once_equal_tables_one_by_one(fsdp2_dcp) -> None:
    """``_StorageRecords.tables`` (every tensor's fast-path checks in array operations) gives
    what ``table`` gives tensor by tensor, on FSDP2's own 3-rank save, including a tensor whose
    records contradict its chunks, which it hands to ``table``'s general path."""
    import numpy as np
    from reshard.formats.dcp import metadata as M
    from reshard.formats.dcp.metadata_pickle import TensorStorageMetadata, unpickled_metadata

    root = fsdp2_dcp[0]
    meta = unpickled_metadata(root / ".metadata")
    entries = [(name, list(md.chunks), len(md.size), name) for name, md in meta.state_dict_metadata.items()
               if type(md) is TensorStorageMetadata]
    assert any(len(chunks) == 3 for _, chunks, _, _ in entries)

    def columns(t: M.ChunkTable) -> list:
        return [t.offsets.tolist(), t.sizes.tolist(), t.file.tolist(), t.start.tolist(), t.length.tolist()]

    for swap in (False, True):
        records = M._StorageRecords(dict(meta.storage_data), root / ".metadata", M._Files(root, []))
        if swap:  # two records of one tensor claim each other's chunk: the offsets then disagree
            name = next(n for n, chunks, _, _ in entries if len(chunks) == 3)
            a, b = records.by_name[name][:2].tolist()
            records.hints[[a, b]] = records.hints[[b, a]]
        together = records.tables(entries)
        assert list(together) == [e[0] for e in entries]
        for name, chunks, ndim, where in entries:
            try:
                alone = records.table(name, chunks, ndim, where)
            except Exception as e:  # noqa: BLE001 - the same refusal either way
                with pytest.raises(type(e)):
                    records.tables([(name, chunks, ndim, where)])
                continue
            assert columns(together[name]) == columns(alone), name
            assert isinstance(together[name].offsets, np.ndarray)
