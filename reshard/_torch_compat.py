"""Every private torch name reshard touches, in one place, so a torch upgrade breaks here.

Writing a file that ``torch.load(weights_only=True)`` reads means naming torch's tensor
rebuild function in the pickle, and reading DCP metadata means knowing its private storage
record type. Nothing else in reshard imports an underscored torch name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch._utils
import torch.serialization
from torch.distributed.checkpoint import filesystem as _dcp_filesystem
from torch.distributed.checkpoint import metadata as _dcp_metadata

__all__ = [
    "rebuild_tensor_v3",
    "DCPStorageInfo",
    "DCP_METADATA_GLOBALS",
    "TORCH_DTYPES",
]

# The function torch.save names for every tensor of a "new" dtype; torch.load accepts it for
# all dtypes, so our writer uses it uniformly.
rebuild_tensor_v3 = torch._utils._rebuild_tensor_v3

# DCP's per-chunk record (relative_path, offset, length, transform_descriptors).
DCPStorageInfo = _dcp_filesystem._StorageInfo

TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in dir(torch)
    if isinstance(getattr(torch, name, None), torch.dtype)
}

# The globals a DCP ``.metadata`` pickle may name, and nothing more.
DCP_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", cls): getattr(_dcp_metadata, cls)
        for cls in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "MetadataIndex",
            "_MEM_FORMAT_ENCODING",
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): DCPStorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): __import__("pathlib").PurePosixPath,
    ("pathlib", "WindowsPath"): __import__("pathlib").PureWindowsPath,
    ("pathlib", "PurePosixPath"): __import__("pathlib").PurePosixPath,
    **{("torch", name): dt for name, dt in TORCH_DTYPES.items()},
}
