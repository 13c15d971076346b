"""Which format a path holds, and the format object for a ``--to`` name.

Format modules are imported on first use, so ``reshard --help`` and a DCP-only conversion do
not pay for optional libraries (zarr) they never touch.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from reshard.errors import CheckpointNotFoundError, UnsupportedFormatError, UsageError
from reshard.formats.base import Format

__all__ = ["get_format", "detect_format", "FORMAT_NAMES", "format_for_destination"]

# Detection order matters: a DCP folder may also contain other files; a folder of per-rank
# torch files is tried before a single torch file.
_FORMATS: dict[str, str] = {
    "dcp": "reshard.formats.dcp:DCPFormat",
    "zarr": "reshard.formats.zarr:ZarrFormat",  # a folder with zarr.json at its root
    "safetensors": "reshard.formats.safetensors:SafetensorsFormat",
    "torch-ranks": "reshard.formats.torch_ranks:TorchRanksFormat",
    "torch": "reshard.formats.torch_save:TorchSaveFormat",
    # A write target only (an HF model folder); HF folders are detected as safetensors.
    "hf": "reshard.formats.hf:HFFormat",
}
FORMAT_NAMES = tuple(_FORMATS)
_cache: dict[str, Format] = {}


def get_format(name: str) -> Format:
    if name not in _FORMATS:
        raise UsageError(f"unknown format {name!r}; choose one of: {', '.join(FORMAT_NAMES)}")
    if name not in _cache:
        module, cls = _FORMATS[name].split(":")
        _cache[name] = getattr(importlib.import_module(module), cls)()
    return _cache[name]


def detect_format(path: Path) -> Format:
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such file or directory")
    for name in _FORMATS:
        fmt = get_format(name)
        if fmt.detect(path):
            return fmt
    raise UnsupportedFormatError(
        f"{path}: not a checkpoint reshard recognizes (expected a DCP folder with .metadata, "
        "*.safetensors or a folder of them, a torch .pt/.pth/.bin file, a folder of per-rank torch files, or a zarr v3 store with zarr.json)"
    )


def format_for_destination(dst: Path) -> str:
    """``--to`` when only DST is given: by suffix, else a DCP folder."""
    suffix = dst.suffix.lower()
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in (".pt", ".pth", ".bin"):
        return "torch"
    if suffix == ".zarr":
        return "zarr"
    return "dcp"
