"""Which format a path holds, and the format object for a ``--to`` name.

Format modules are imported on first use, so ``reshard --help`` and a DCP-only conversion do
not pay for optional libraries (zarr) they never touch.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from reshard.errors import CheckpointNotFoundError, UnsupportedFormatError, UsageError
from reshard.protocol import Format

__all__ = ["get_format", "detect_format", "FORMAT_NAMES", "format_for_destination"]

# Detection order matters: a DCP folder may also contain other files; an HF folder with both
# safetensors and .bin weights (the Hub often keeps both) is read as safetensors, as
# transformers loads it; a folder of per-rank torch files is tried before a single torch file.
_FORMATS: dict[str, str] = {
    # Megatron-Core's torch_dist is a DCP folder with metadata.json and common.pt beside it.
    "megatron": "reshard.formats.megatron:MegatronFormat",
    "dcp": "reshard.formats.dcp.format:DCPFormat",
    "accelerate": "reshard.formats.accelerate:AccelerateFormat",  # save_state: model + optimizer DCP folders (read only)
    "zarr": "reshard.formats.zarr.format:ZarrFormat",  # a folder with zarr.json at its root
    # global_stepN/ (or its parent, through latest) and ds_to_universal folders (read only);
    # before torch-ranks: its per-rank *_optim_states.pt are no DTensor rank files.
    "deepspeed": "reshard.formats.deepspeed.format:DeepSpeedFormat",
    "safetensors": "reshard.formats.safetensors.format:SafetensorsFormat",
    "hf-bin": "reshard.formats.hf.bin:HFBinFormat",  # pytorch_model.bin or *.bin.index.json (read only)
    "torch-ranks": "reshard.formats.torch.rank_folder:TorchRanksFormat",
    "torch": "reshard.formats.torch.save:TorchSaveFormat",
    # A write target only (an HF model folder); HF folders are detected as safetensors.
    "hf": "reshard.formats.hf.format:HFFormat",
}
FORMAT_NAMES = tuple(_FORMATS)
# What ``--to`` offers (torch-ranks is what ``--to torch --to-mesh`` writes; hf-bin is read only).
WRITE_NAMES = ("dcp", "safetensors", "torch", "hf", "zarr")
_cache: dict[str, Format] = {}


def get_format(name: str) -> Format:
    if name not in _FORMATS:
        raise UsageError(f"unknown format {name!r}; choose one of: {', '.join(WRITE_NAMES)}")
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
        f"{path}: not a checkpoint reshard recognizes (expected a DCP folder with .metadata, an accelerate "
        "save_state folder, "
        "*.safetensors or a folder of them, an HF folder with pytorch_model.bin or a *.bin.index.json, a torch "
        ".pt/.pth/.bin file, a folder of per-rank torch files, a zarr v3 store with zarr.json, a DeepSpeed "
        "global_stepN folder or a Megatron-Core torch_dist iter_N folder)"
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
