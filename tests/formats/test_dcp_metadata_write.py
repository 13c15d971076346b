"""Our hand-emitted ``.metadata`` pickle is read by torch as its own classes, equal to what
torch's dataclasses would have pickled, and writing it does not import torch's DCP package."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import reshard
from tests.dist import HANG_GUARD


def test_torch_reads_our_metadata_as_its_own(fsdp2_dcp, tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    reshard.convert(fsdp2_dcp[0], tmp_path / "out", to_mesh="2x2", quiet=True)
    ours = FileSystemReader(str(tmp_path / "out")).read_metadata()
    assert isinstance(ours, Metadata) and ours.version == "1.0.0" and isinstance(ours.storage_meta, StorageMeta)
    # Rebuild the same metadata from torch's real classes and compare field by field.
    sdm, storage = {}, {}
    for name, md in ours.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            sdm[name] = BytesStorageMetadata()
            continue
        assert isinstance(md, TensorStorageMetadata) and isinstance(md.properties, TensorProperties)
        assert md.properties.memory_format == torch.contiguous_format and md.properties.layout == torch.strided
        chunks = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in md.chunks]
        sdm[name] = TensorStorageMetadata(TensorProperties(dtype=md.properties.dtype), md.size, chunks)
    for index, info in ours.storage_data.items():
        assert isinstance(index, MetadataIndex) and isinstance(info, _StorageInfo)
        storage[MetadataIndex(index.fqn, index.offset, index.index)] = _StorageInfo(info.relative_path, info.offset, info.length)
    real = Metadata(sdm, planner_data=ours.planner_data, storage_data=storage, storage_meta=StorageMeta(), version="1.0.0")
    again = pickle.loads(pickle.dumps(real))
    assert again.state_dict_metadata == ours.state_dict_metadata
    assert again.storage_data == ours.storage_data and again.planner_data == ours.planner_data
    assert ours.planner_data["optim.state.embed.weight.exp_avg"] == ("optim", "state", "embed.weight", "exp_avg")


def test_writing_dcp_does_not_import_torch_dcp(fsdp2_dcp, tmp_path: Path) -> None:
    code = ("import sys, reshard; reshard.convert(sys.argv[1], sys.argv[2], quiet=True); "
            "print('torch.distributed.checkpoint' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(fsdp2_dcp[0]), str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=HANG_GUARD)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_metadata_of_many_chunks_says_where_each_record_is(tmp_path: Path, monkeypatch) -> None:
    """Thousands of chunks (more than one SETITEMS batch, several assembly blocks), replicas
    spread over ranks, objects after the tensors: torch reads every tensor's chunks and every
    record where the files the writer laid out have them."""
    import random

    from reshard.formats.dcp import metadata_write
    from reshard.formats.dcp.format import DCPWriter
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from reshard.core import dtypes
    from reshard.core.boxes import Box
    from reshard.core.catalog import Catalog, Chunk, TensorEntry
    from reshard.core.pieces import Piece, segment_size
    from reshard.core.sharding import parse_mesh
    from reshard.pipeline.mesh_target import mesh_target
    from reshard.pipeline.placements import load_placement_plan

    monkeypatch.setattr(metadata_write, "_ROWS_AT_ONCE", 777)
    rng = random.Random(3)
    tensors = {}
    for i in range(900):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.choice([0, 1, 2, 2, 3])))
        dtype = dtypes.by_name(rng.choice(["float32", "bfloat16", "int8"]))
        tensors[f"layers.{i}.w"] = TensorEntry(f"layers.{i}.w", shape, dtype, [Chunk(Box((0,) * len(shape), shape), None)])
    catalog = Catalog("test", tmp_path, tensors, {"step": 5, "note": "x"})
    mesh = parse_mesh("2x2")
    target = mesh_target(catalog, mesh, load_placement_plan(None, mesh))
    writer = DCPWriter()
    files = writer.layout(target)
    writer.finish(tmp_path, target, files)
    meta = FileSystemReader(str(tmp_path)).read_metadata()

    records = {}  # (name, offsets) -> (relpath, start, length), from the files as laid out
    for f in files:
        segments, offsets = list(f.segments), f.offsets()  # a SegmentTable read as a list reads as one
        sizes = [segment_size(seg) for seg in segments]
        assert offsets[-1] + sizes[-1] == f.size and offsets == list(np.cumsum([0] + sizes[:-1]))
        for k, seg in enumerate(segments):
            if isinstance(seg, Piece):
                start, end = offsets[k - 1], offsets[k + 1] + len(segments[k + 1])  # its archive: head, piece, tail
                records[(seg.name, seg.box.offsets)] = (f.relpath, start, end - start)
    assert sum(len(t.boxes) for t in target.tensors.values()) > 1554  # two blocks of 777, a SETITEMS batch of 1000
    for name, t in target.tensors.items():
        md = meta.state_dict_metadata[name]
        assert md.properties.dtype == t.dtype.torch and tuple(md.size) == t.shape, name
        assert [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks] == [(b.offsets, b.sizes) for b in t.boxes], name
        for j, b in enumerate(t.boxes):
            info = meta.storage_data[MetadataIndex(name, b.offsets, j)]
            assert (info.relative_path, info.offset, info.length) == records[(name, b.offsets)], (name, j)
    for name in ("step", "note"):
        assert isinstance(meta.state_dict_metadata[name], BytesStorageMetadata)
        info = meta.storage_data[MetadataIndex(name)]
        assert info.relative_path == "__0_0.distcp" and info.length > 0
    assert len(meta.storage_data) == len(records) + 2
    assert meta.planner_data["layers.7.w"] == ("layers.7.w",)


def test_integers_are_written_as_the_pickler_writes_them() -> None:
    from reshard.formats.dcp.metadata_write import _Opcodes
    from reshard.formats.dcp.opcode_rows import int_slot, join_rows

    values = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**39 - 1, 2**39, 2**55, 2**63 - 1,
              -1, -(2**31), -(2**31) - 1, -(2**40), -(2**63)]
    codes = join_rows([int_slot(np.array(values, dtype=np.int64))])
    assert codes == b"".join(_Opcodes._int(v) for v in values)
    for v in values:
        assert pickle.loads(b"\x80\x02" + _Opcodes._int(v) + b".") == v
