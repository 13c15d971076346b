"""Our hand-emitted ``.metadata`` pickle is read by torch as its own classes, equal to what
torch's dataclasses would have pickled, and writing it does not import torch's DCP package."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import torch

import reshard


def test_torch_reads_our_metadata_as_its_own(fsdp2_dcp, tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
        TensorStorageMetadata,
    )

    reshard.convert(fsdp2_dcp[0], tmp_path / "out", mesh="2x2", quiet=True)
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
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
