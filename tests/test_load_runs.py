"""The load's byte paths: runs read straight into tensors (``runtime.runs``), and rank 0's
messages (``runtime.scatter``): large slabs alone, small ones packed, casts and strided
targets through scratch. One 3-rank save, one 2-rank world loading it every way."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import reshard
from reshard.core.boxes import Box, c_order_slabs
from reshard.core.errors import CorruptCheckpointError
from reshard.runtime import runs as runs_module
from reshard.runtime.load_plan import LoadPlan, TransferItem
from reshard.runtime.runs import RunReader, byte_view
from reshard.runtime.scatter import message_bytes, messages
from tests.dist import run_world

# ------------------------------------------------------------------------------- pure parts


def test_run_reader_joins_neighbours_reads_on_after_short_reads_and_refuses_a_short_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "data.bin"
    data = bytes(range(256)) * 4096  # 1 MiB
    f.write_bytes(data)
    out = torch.zeros(1000, dtype=torch.uint8)
    view = byte_view(out)
    assert view is not None and byte_view(out.view(10, 100).t()) is None and byte_view(torch.empty(0)) is None
    # two runs 50 bytes apart (read as one call), one far away (a call of its own), given out of order
    runs = [(0, 600_000, view[700:1000]), (0, 100, view[0:300]), (0, 450, view[300:700])]
    calls = []
    real = os.preadv

    def short(fd: int, buffers: list, offset: int) -> int:  # at most 7 bytes a call, as a slow file may give
        calls.append(offset)
        first = buffers[0][:7]
        return real(fd, [first], offset)

    reader = RunReader([f])
    try:
        monkeypatch.setattr(runs_module.os, "preadv", lambda fd, b, o: calls.append(o) or real(fd, b, o))
        assert reader.read(runs) == 1000
        assert calls == [100, 600_000]
        assert bytes(out[:300]) == data[100:400] and bytes(out[300:700]) == data[450:850]
        assert bytes(out[700:]) == data[600_000:600_300]
        out.zero_()
        monkeypatch.setattr(runs_module.os, "preadv", short)
        assert reader.read(runs) == 1000
        assert bytes(out[:300]) == data[100:400] and bytes(out[700:]) == data[600_000:600_300]
        with pytest.raises(CorruptCheckpointError, match=f"{f}: file ends at byte {len(data)}, expected data up to byte "
                                                         f"{len(data) + 100}"):
            reader.read([(0, len(data) - 200, view[:300])])
    finally:
        reader.close()


def test_a_send_from_the_page_cache_is_the_file_as_it_lies_and_refuses_a_short_file(tmp_path: Path) -> None:
    from reshard.runtime.scatter import _SendBuffer

    f = tmp_path / "data.bin"
    data = bytes(range(256)) * 64
    f.write_bytes(data)
    buf = _SendBuffer(16, torch.device("cpu"))
    sent = buf.map(f, 5000, 3000)  # not at a page boundary
    assert bytes(sent.numpy()) == data[5000:8000]
    buf.wait()  # the sends are done: the mapping goes once nothing holds it
    with pytest.raises(CorruptCheckpointError, match=f"{f}: file ends at byte {len(data)}, expected data up to byte "
                                                     f"{len(data) + 100}"):
        buf.map(f, len(data) - 200, 300)


def _item(name: str, shape: tuple[int, ...], dtype: torch.dtype, boxes: list[tuple[Box, tuple[int, ...]]],
          broadcast: bool = False) -> TransferItem:
    return TransferItem(name, name, shape, dtype, tuple(boxes), broadcast)


def _cut(box: Box, cuts: tuple[int, ...]) -> list[Box]:
    rows = [box.offsets[0], *[c for c in cuts if box.offsets[0] < c < box.ends[0]], box.ends[0]] if box.ndim else []
    return [Box((a, *box.offsets[1:]), (b - a, *box.sizes[1:])) for a, b in zip(rows, rows[1:])] or [box]


def test_messages_send_large_slabs_alone_and_pack_small_ones() -> None:
    big = TransferItem("big", "big", (2000, 600), torch.float32, ((Box((0, 0), (1000, 600)), (0,)),
                                                                 (Box((1000, 0), (1000, 600)), (1, 2))), False, (500, 1500))
    small = [_item(f"w{i}", (10, 3), torch.bfloat16 if i % 2 else torch.float32,
                   [(Box((0, 0), (5, 3)), (0,)), (Box((5, 0), (5, 3)), (1,))]) for i in range(5)]
    both = _item("rep", (7,), torch.float64, [(Box((0,), (7,)), (0, 1, 2))], broadcast=True)
    twice = _item("hsdp", (4, 4), torch.float32, [(Box((0, 0), (2, 4)), (0, 2)), (Box((2, 0), (2, 4)), (1, 3))])
    items = [small[0], big, *small[1:], both, twice]
    for slab_bytes, alone in ((1 << 30, 1 << 20), (4096, 1024)):
        plan = LoadPlan(items, slab_bytes)
        cap = message_bytes(plan)
        assert cap == min(16 << 20, slab_bytes // 4)
        sent = list(messages(plan))
        assert sent == list(messages(plan))  # the same cut on every rank, every time
        slabs = [(p.item.target, p.slab, m.to) for m in sent for p in m.parts]
        want = [(i.target, s, None if i.broadcast else tuple(r for r in ranks if r)) for i in items
                for box, ranks in i.boxes if ranks != (0,) for piece in _cut(box, i.cuts)
                for s in c_order_slabs(piece, i.dtype.itemsize, cap)]
        assert sorted(slabs, key=repr) == sorted(want, key=repr)  # each slab once; rank 0's own never sent
        for m in sent:
            sizes = [p.nbytes for p in m.parts]
            assert all(p.at % 64 == 0 and p.at + p.nbytes <= m.nbytes for p in m.parts)
            assert len(m.parts) == 1 or max(sizes) < alone
            assert m.nbytes <= cap
        if slab_bytes == 1 << 30:  # the five small ones to rank 1 in one message, the large one alone
            packed = [m for m in sent if m.to == (1,)]
            assert [[p.item.target for p in m.parts] for m in packed] == [["w0", "w1", "w2", "w3", "w4"]]
            # cut where a stored chunk starts (row 1500): each piece one run of one file
            assert [(m.to, m.parts[0].slab) for m in sent if m.parts[0].item.target == "big"] == [
                ((1, 2), Box((1000, 0), (500, 600))), ((1, 2), Box((1500, 0), (500, 600)))]


# ---------------------------------------------------------------------------- the worlds

ROWS = 6003  # "big": 6003 x 300 fp32 saved by 3 ranks; rank 1's box on 2 ranks is two pieces of 1.2 and 2.4 MB


def _values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    out = {"big": torch.randn(ROWS, 300, generator=g), "bf": torch.randn(50, 7, generator=g).bfloat16(),
           "col": torch.randn(6, 9, generator=g), "scalar": torch.tensor(3.5), "rep": torch.randn(5, 3, generator=g)}
    out.update({f"w{i}": torch.randn(10 + i, 4, generator=g) for i in range(6)})
    return out


def _save(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {k: v if k in ("scalar", "rep") else distribute_tensor(v, mesh, [Shard(0)]) for k, v in _values().items()}
    dcp.save(state, checkpoint_id=root)


def _targets(mesh: Any, cast: bool) -> dict[str, torch.Tensor]:
    """What each name loads into: Shard(0) DTensors, ``col`` on Shard(1) (no part of it is one
    run), a transposed plain tensor, a 0-d one; ``cast``: half of them in other dtypes."""
    from torch.distributed.tensor import Shard, distribute_tensor

    out: dict[str, torch.Tensor] = {}
    for k, v in _values().items():
        dtype = {"big": torch.bfloat16, "w1": torch.float64, "w4": torch.float16, "col": torch.float64}.get(k, v.dtype) \
            if cast else v.dtype
        zero = torch.zeros(v.shape, dtype=dtype)
        if k == "rep":
            out[k] = torch.zeros(3, 5, dtype=dtype).t()
        elif k == "scalar":
            out[k] = zero
        else:
            out[k] = distribute_tensor(zero, mesh, [Shard(1 if k == "col" else 0)])
    return out


def _local_numel(t: torch.Tensor) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).numel()


def _load_every_way(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from reshard.runtime import scatter

    mapped = []
    real_map = scatter._SendBuffer.map
    scatter._SendBuffer.map = lambda self, *a: mapped.append(a) or real_map(self, *a)  # type: ignore[method-assign]
    mesh = init_device_mesh("cpu", (world,))
    values = _values()
    for cast in (False, True):
        for mode in ("rank0", "parallel"):
            for budget in ("1GiB", "64KiB"):
                mapped.clear()
                state = _targets(mesh, cast)
                res = reshard.load_state_dict(state, root, mode=mode, max_memory=budget)
                if rank == 0 and mode == "rank0" and budget == "1GiB":  # "big"'s two pieces from the page cache
                    assert [n for _, _, n in mapped] == [1000 * 300 * 4, 2001 * 300 * 4], mapped
                assert res.mode == mode and res.missing == [] and res.unexpected == []
                for k, t in state.items():
                    got = t.full_tensor() if hasattr(t, "full_tensor") else t
                    assert got.dtype == t.dtype and torch.equal(got, values[k].to(t.dtype)), (cast, mode, budget, k)
                mine = sum(_local_numel(t) * values[k].element_size() for k, t in state.items())
                if rank or mode == "parallel":
                    assert res.bytes == mine, (cast, mode, budget, res.bytes, mine)
                else:
                    assert res.bytes == sum(v.nbytes for v in values.values())
    # A name tied to a stored one (the same memory, as tied embeddings are) loads with it.
    for mode in ("rank0", "parallel"):
        state = _targets(mesh, False)
        state["head"] = state["w5"]
        res = reshard.load_state_dict(state, root, mode=mode)
        assert res.missing == [] and torch.equal(state["head"].full_tensor(), values["w5"]), mode
    dist.barrier()


def test_loads_onto_two_ranks_every_way(tmp_path: Path) -> None:
    """A 3-rank save loaded onto 2 ranks in both modes, at two budgets, into tensors of the
    stored dtypes (runs; messages straight into place) and of others (casts through scratch)."""
    root = tmp_path / "ckpt"
    run_world(_save, 3, str(root))
    run_world(_load_every_way, 2, str(root))
