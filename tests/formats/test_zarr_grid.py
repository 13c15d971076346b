"""Chunk shapes and chunk files for targets built by hand: shards cut in a trailing dim
(padding inside a chunk), nested shards that are not a regular grid, default chunking."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from reshard.formats.zarr.format import ZarrWriter
from reshard.formats.zarr.grid import chunk_segments, default_chunk_shape

import reshard
from reshard.core.boxes import Box, full_box
from reshard.core.facts import Facts
from reshard.core.pieces import Piece
from reshard.core.target import Target, TargetTensor
from reshard.pipeline.engine import Engine
from reshard.pipeline.plan import make_plan

ts = pytest.importorskip("tensorstore")


def _write(catalog: reshard.Catalog, target: Target, out: Path) -> ZarrWriter:
    """What convert does, with a hand-made target: layout, plan, engine, finish."""
    writer = ZarrWriter()
    files = writer.layout(target)
    out.mkdir()
    Engine(1 << 12, workers=2, progress=False).run(make_plan(catalog, files), out, True)
    writer.finish(out, target, files)
    return writer


def _ts(path: Path) -> np.ndarray:
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}).result().read().result()


def test_hand_built_shards_become_chunks(tmp_path: Path) -> None:
    w = torch.arange(50, dtype=torch.float32).reshape(5, 10)
    v = torch.arange(30, dtype=torch.int16).reshape(10, 3)
    torch.save({"w": w, "v": v}, tmp_path / "src.pt")
    catalog = reshard.inspect(tmp_path / "src.pt")
    # w: Shard(1) over 4 ranks -> columns 3, 3, 3, 1: the last chunk is padded inside each row.
    w_boxes = [Box((0, c), (5, n)) for c, n in ((0, 3), (3, 3), (6, 3), (9, 1))]
    # v: Shard(0) over a 2x2 mesh, nested -> rows 3, 2, 3, 2: no regular grid of shard size.
    v_boxes = [Box((o, 0), (n, 3)) for o, n in ((0, 3), (3, 2), (5, 3), (8, 2))]
    target = Target(
        tensors={"w": TargetTensor("w", (5, 10), torch.float32, w_boxes, [0, 1, 2, 3]),
                 "v": TargetTensor("v", (10, 3), torch.int16, v_boxes, [0, 1, 2, 3])},
        objects={}, paths={}, facts=Facts(), world_size=4,
    )
    writer = _write(catalog, target, tmp_path / "s.zarr")
    arrays = {a.name: a for a in writer.arrays(target)}
    assert arrays["w"].meta.chunk_shape == (5, 3) and arrays["w"].regular
    assert arrays["v"].meta.chunk_shape == (1, 3) and not arrays["v"].regular  # gcd of 3 and 5
    assert writer.notices(target) == ["'v': its shards are not a regular grid, so chunks of [1, 3] tile them"]
    edge = tmp_path / "s.zarr" / "w" / "c" / "0" / "3"
    assert edge.stat().st_size == 5 * 3 * 4  # stored at the full chunk shape
    stored = torch.frombuffer(bytearray(edge.read_bytes()), dtype=torch.float32).reshape(5, 3)
    assert torch.equal(stored[:, 0], w[:, 9]) and not stored[:, 1:].any()
    assert np.array_equal(_ts(tmp_path / "s.zarr" / "w"), w.numpy())
    assert np.array_equal(_ts(tmp_path / "s.zarr" / "v"), v.numpy())
    assert reshard.verify(tmp_path / "s.zarr", tmp_path / "src.pt").equal


def test_chunk_segments_leave_only_the_zero_tail_out() -> None:
    # Partial in dim 0 only: one piece, the tail added at finish.
    assert chunk_segments("a", torch.float32, Box((8, 0), (2, 4)), (3, 4)) == [Piece("a", Box((8, 0), (2, 4)), torch.float32)]
    # Partial in dims 0 and 1: one piece per stored row, zeros between rows, no zeros after.
    segs = chunk_segments("a", torch.int8, Box((3, 6), (2, 1)), (3, 3))
    assert segs == [Piece("a", Box((3, 6), (1, 1)), torch.int8), bytes(2), Piece("a", Box((4, 6), (1, 1)), torch.int8)]
    assert chunk_segments("a", torch.int8, Box((0,), (0,)), (1,)) == []


def test_default_chunks_split_leading_dims_into_even_parts() -> None:
    assert default_chunk_shape((100, 10), 4, 1000) == (25, 10)
    assert default_chunk_shape((101, 10), 4, 1000) == (21, 10)  # 5 even chunks, not 4 + a sliver
    assert default_chunk_shape((3, 1000), 4, 100) == (1, 25)
    assert default_chunk_shape((10,), 4) == (10,)  # small tensors: one chunk
    assert default_chunk_shape((0, 5), 4) == (1, 5)  # zarr chunk sizes are >= 1
    assert default_chunk_shape((), 4) == ()


def test_max_shard_size_caps_chunks(tmp_path: Path) -> None:
    torch.save({"w": torch.randn(10, 4)}, tmp_path / "src.pt")
    reshard.convert(tmp_path / "src.pt", tmp_path / "c.zarr", max_shard_size="64B", quiet=True)
    chunks = reshard.inspect(tmp_path / "c.zarr").tensors["w"].chunks
    assert [c.box.sizes[0] for c in chunks] == [4, 4, 2]  # 64-byte chunks of 16-byte rows
    assert (tmp_path / "c.zarr" / "w" / "c" / "2" / "0").stat().st_size == 64  # 4 rows, padded
    assert np.array_equal(_ts(tmp_path / "c.zarr" / "w"), torch.load(tmp_path / "src.pt")["w"].numpy())


def test_names_zarr_cannot_hold_are_refused(tmp_path: Path) -> None:
    for bad in ("a/b", "__x", "..", ".hidden", "zarr.json"):
        target = Target(tensors={bad: TargetTensor(bad, (1,), torch.float32, [full_box((1,))], [0])},
                        objects={}, paths={}, facts=Facts())
        with pytest.raises(reshard.ReshardError, match="cannot be a zarr array name"):
            ZarrWriter().layout(target)


def test_stores_with_more_chunks_than_the_soft_file_limit(tmp_path: Path) -> None:
    """The engine keeps every output and source file open; a store is a file per chunk."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"hard open-file limit {hard} leaves no room to test raising the soft one")
    torch.save({f"t{i}": torch.full((2,), i) for i in range(400)}, tmp_path / "many.pt")
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))
    try:
        reshard.convert(tmp_path / "many.pt", tmp_path / "many.zarr", quiet=True)
        reshard.convert(tmp_path / "many.zarr", tmp_path / "many.safetensors", quiet=True)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert reshard.verify(tmp_path / "many.safetensors", tmp_path / "many.pt").equal
