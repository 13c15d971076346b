from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch
from reshard.formats.torch.zip import read_torch_zip
from reshard.formats.torch.zip_write import PieceRef, torch_save_segments

from reshard.core.boxes import full_box
from reshard.core.pieces import Piece
from reshard.core.regions import StoredRegion


def _write(path: Path, segments, tensors: dict[str, torch.Tensor]) -> None:
    with open(path, "wb") as f:
        for seg in segments:
            if isinstance(seg, bytes):
                f.write(seg)
            else:
                f.write(tensors[seg.name][seg.box.as_slices()].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def test_reads_what_torch_saves(tmp_path: Path) -> None:
    value = {
        "w": torch.randn(3, 4),
        "bf": torch.randn(5).to(torch.bfloat16),
        "f8": torch.randn(4).to(torch.float8_e4m3fn),
        "view": torch.arange(12.0).reshape(3, 4).t(),
        "param": torch.nn.Parameter(torch.ones(2)),
        "meta": {"step": 7, "betas": (0.9, 0.95), "names": ["a", "b"]},
    }
    torch.save(value, tmp_path / "x.pt")
    got = read_torch_zip(tmp_path / "x.pt")
    for k in ("w", "bf", "f8", "view", "param"):
        assert isinstance(got[k], StoredRegion)
        assert torch.equal(got[k].read(full_box(got[k].shape)).contiguous().view(torch.uint8),
                           value[k].detach().contiguous().view(torch.uint8)), k
    assert got["meta"] == value["meta"]


def test_written_archive_loads_with_torch_and_mmap(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).to(torch.float8_e5m2)}
    pieces = {str(i): Piece(n, full_box(t.shape), t.dtype) for i, (n, t) in enumerate(tensors.items())}
    tree = {"model": {n: PieceRef(k, p.dtype, p.box.sizes) for k, p in pieces.items() for n in [p.name]}, "step": 3}
    _write(tmp_path / "y.pt", torch_save_segments(tree, pieces), tensors)
    for mmap in (False, True):
        out = torch.load(tmp_path / "y.pt", weights_only=True, mmap=mmap)
        assert out["step"] == 3
        for n, t in tensors.items():
            assert torch.equal(out["model"][n].view(torch.uint8), t.view(torch.uint8))
    with zipfile.ZipFile(tmp_path / "y.pt") as z:  # a well-formed zip for other tools too
        offsets = [i.header_offset for i in z.infolist()]
        assert offsets == sorted(offsets)


def test_meta_loads_find_every_storage(tmp_path: Path) -> None:
    """torch.load onto the meta device computes where each storage starts, assuming torch's
    writer's layout (storages in the order the pickle first uses them, a data descriptor after
    each non-empty payload): the places it computes must be where the bytes are. Keys given in
    another order than the tree uses them, and an empty storage, are laid out that way too."""
    tensors = {"a": torch.randn(3, 5), "e": torch.empty(0), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2)}
    keys = {"a": "2", "e": "0", "b": "3", "c": "1"}
    pieces = {keys[n]: Piece(n, full_box(t.shape), t.dtype) for n, t in tensors.items()}
    tree = {"x": {"c": PieceRef("1", torch.float32, (2,)), "a": PieceRef("2", torch.float32, (3, 5))},
            "y": [PieceRef("0", torch.float32, (0,)), PieceRef("3", torch.int64, (7,))]}
    _write(tmp_path / "m.pt", torch_save_segments(tree, pieces), tensors)
    raw = (tmp_path / "m.pt").read_bytes()
    meta = torch.load(tmp_path / "m.pt", map_location="meta", weights_only=True)
    found = {"c": meta["x"]["c"], "a": meta["x"]["a"], "e": meta["y"][0], "b": meta["y"][1]}
    for name, t in found.items():
        at, n = t.untyped_storage()._checkpoint_offset, tensors[name].nbytes
        assert raw[at:at + n] == tensors[name].numpy().tobytes(), name
    with zipfile.ZipFile(tmp_path / "m.pt") as z:
        assert z.read("archive/data.pkl")[:2] == b"\x80\x02"  # literal records read back with their CRCs
        assert [i.filename.rsplit("/", 1)[-1] for i in z.infolist() if "/data/" in i.filename] == ["0", "1", "2", "3"]


def test_zip64_record_past_4gib(tmp_path: Path) -> None:
    """A >4 GiB tensor record needs zip64 fields; written sparse, so the test costs no disk."""
    n = (1 << 32) + 64
    piece = Piece("big", full_box((n,)), torch.uint8)
    segments = torch_save_segments({"big": PieceRef("0", torch.uint8, (n,))}, {"0": piece})
    path = tmp_path / "big.pt"
    with open(path, "wb") as f:
        at = 0
        for seg in segments:
            if isinstance(seg, bytes):
                os.pwrite(f.fileno(), seg, at)
                at += len(seg)
            else:
                os.pwrite(f.fileno(), b"\x07", at + n - 1)  # last byte; the rest is a hole
                at += n
    try:
        out = torch.load(path, weights_only=True, mmap=True)
    except RuntimeError as e:  # pragma: no cover - filesystems without sparse files / mmap
        pytest.skip(f"cannot map a sparse 4 GiB file here: {e}")
    assert out["big"].shape == (n,) and int(out["big"][-1]) == 7 and int(out["big"][0]) == 0
    assert read_torch_zip(path)["big"].shape == (n,)


def test_objects_keep_their_types_when_tensors_inside_are_read_or_stored(tmp_path: Path) -> None:
    """Tensors inside a defaultdict, a deque, a Namespace or a numpy object array are read from
    the file (``materialize``) and stored again (``torch_save_bytes``, for DCP byte objects)
    without the containers losing their type, factory or maxlen."""
    import argparse
    import collections

    import numpy as np
    from reshard.formats.torch.zip import load_object_blob, materialize
    from reshard.formats.torch.zip_write import torch_save_bytes

    from reshard.core.values import difference

    cells = np.empty(2, dtype=object)
    cells[0], cells[1] = torch.ones(2), "x"
    value = {"dd": collections.defaultdict(list, a=[torch.arange(3)]), "dq": collections.deque([torch.zeros(2)], maxlen=4),
             "ns": argparse.Namespace(t=torch.full((2,), 7.0)), "cells": cells, "cnt": collections.Counter(a=2)}
    torch.save(value, tmp_path / "o.pt")
    read = materialize(read_torch_zip(tmp_path / "o.pt"), lambda r: r.read_all())
    assert difference(read, value) is None
    assert read["dd"].default_factory is list and read["dq"].maxlen == 4
    blob = torch_save_bytes(read)
    (tmp_path / "blob").write_bytes(blob)
    assert difference(torch.load(tmp_path / "blob", weights_only=False), value) is None
    assert difference(load_object_blob(tmp_path / "blob", 0, len(blob), lambda r: r.read_all()), value) is None
