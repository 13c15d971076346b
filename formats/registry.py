"""Every format reshard knows, in one table: how to import it, what it recognizes (in words,
for the error that lists them), whether ``--to`` offers it, and which output names are its.

A format is one package plus one ``FormatEntry`` here (or ``register_format`` for one that
lives elsewhere): detection, ``--to``, default output names, the ``--help`` of ``convert``
and the error listing what reshard reads all come from this table. Format modules are
imported on first use, so ``reshard --help`` and a DCP-only conversion do not pay for
formats they never touch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from reshard.core.errors import CheckpointNotFoundError, UnsupportedFormatError, UsageError
from reshard.core.storage import RemotePath

if TYPE_CHECKING:
    from reshard.pipeline.options import OutputOption
    from reshard.pipeline.protocol import Format

__all__ = ["FormatEntry", "FORMATS", "register_format", "get_format", "detect_format", "write_names",
           "format_for_destination", "default_suffix", "taking", "format_options", "remote_holds", "remote_writes",
           "format_entry", "declared_options",
           "mesh_writer", "mesh_formats", "shown_name", "all_suffixes", "FOREIGN_SUFFIXES", "load_target"]


@dataclass(frozen=True)
class FormatEntry:
    """One format, and what it can do: the core asks these, never for a format by name."""

    name: str
    target: str  # "module:Class", imported on first use
    holds: str  # what ``detect`` recognizes, in words
    writes: bool = False  # offered by ``--to``
    suffixes: tuple[str, ...] = ()  # a destination whose name ends so is this format
    default_suffix: str = ""  # of a default output name, for single-file outputs
    # "module:NAME" of each output option its writer takes (``OutputOption``: declared where the
    # format or feature lives; flag, keyword argument and help come from the declaration)
    options: tuple[str, ...] = ()
    # read from (and, when it writes, written to) fsspec URLs: ``reshard.core.storage``, ``reshard.pipeline.sinks.RemoteSink``
    remote: bool = False
    mesh_writer: str | None = None  # the format that writes this one laid out for a mesh; None: whole tensors only
    file_output: bool = False  # one file, unless a mesh or shards are asked (then a folder)
    folder_suffix: str = ""  # a folder output's name ends so (``ckpt.zarr``)
    label: str = ""  # the word a default folder name ends with (default: the name)
    default: bool = False  # the format of a DST without a known suffix; its default names need no label
    # "module:function" (catalog, options, keep) -> (catalog, keep) turning the catalog into what
    # this output holds (names, config, side files): the HF export's key maps, model section,
    # config.json, merged adapter and FP8 weights.
    prepare: str | None = None
    model_sections: bool = False  # read(path, model_index=i) picks one model of several (and its optimizer)


# Suffixes of files reshard does not write: a DST named so is a mistake, not a DCP folder name.
FOREIGN_SUFFIXES = frozenset({
    ".onnx", ".gguf", ".ggml", ".h5", ".hdf5", ".keras", ".tflite", ".pb", ".npz", ".npy", ".json", ".txt", ".msgpack",
    ".engine", ".trt", ".mlmodel", ".tar", ".gz", ".tgz", ".zip", ".pkl", ".pickle"})


_MAX_SHARD_SIZE = "reshard.pipeline.options:MAX_SHARD_SIZE"  # taken by several formats


# Detection order matters: a DCP folder may also contain other files; an HF folder with both
# safetensors and .bin weights (the Hub often keeps both) is read as safetensors, as
# transformers loads it; a folder of per-rank torch files is tried before a single torch file.
FORMATS: list[FormatEntry] = [
    # Megatron-Core's torch_dist is a DCP folder with metadata.json and common.pt beside it.
    FormatEntry("megatron", "reshard.formats.megatron.format:MegatronFormat", "a Megatron-Core torch_dist iter_N folder"),
    FormatEntry("dcp", "reshard.formats.dcp.format:DCPFormat", "a DCP folder with .metadata", writes=True, remote=True,
                mesh_writer="dcp", default=True),
    FormatEntry("accelerate", "reshard.formats.accelerate.format:AccelerateFormat", "an accelerate save_state folder",
                model_sections=True),
    FormatEntry("zarr", "reshard.formats.zarr.format:ZarrFormat", "a zarr v3 store with zarr.json", writes=True,
                suffixes=(".zarr",), default_suffix=".zarr", options=(_MAX_SHARD_SIZE, "reshard.formats.zarr.options:COMPRESS"),
                remote=True, mesh_writer="zarr", folder_suffix=".zarr"),
    # before torch-ranks: DeepSpeed's per-rank *_optim_states.pt are no DTensor rank files.
    FormatEntry("deepspeed", "reshard.formats.deepspeed.format:DeepSpeedFormat", "a DeepSpeed global_stepN folder"),
    # before safetensors (its model_{rank}.safetensors are one item's ranks, not a sharded folder)
    # and torch-ranks (it leaves that format's rank<r>.pt and checkpoint_<r>.pt sets alone).
    FormatEntry("torch-checkpointing", "reshard.formats.torch_checkpointing.format:TorchCheckpointingFormat",
                "a torch_checkpointing folder with metadata.pkl (or its <item>_<rank>.pt files)", writes=True,
                mesh_writer="torch-checkpointing", options=("reshard.formats.torch_checkpointing.write_options:DEVICE_TYPE",)),
    FormatEntry("safetensors", "reshard.formats.safetensors.format:SafetensorsFormat",
                "*.safetensors or a folder of them", writes=True, suffixes=(".safetensors",),
                default_suffix=".safetensors", options=(_MAX_SHARD_SIZE,), remote=True, file_output=True),
    FormatEntry("hf-bin", "reshard.formats.hf.bin:HFBinFormat",
                "an HF folder with pytorch_model.bin or a *.bin.index.json"),
    FormatEntry("torch-ranks", "reshard.formats.torch.rank_folder:TorchRanksFormat", "a folder of per-rank torch files",
                mesh_writer="torch-ranks", label="torch"),
    # .ckpt: Lightning's torch.save files
    FormatEntry("torch", "reshard.formats.torch.save:TorchSaveFormat", "a torch .pt/.pth/.bin file", writes=True,
                suffixes=(".pt", ".pth", ".bin", ".ckpt"), default_suffix=".pt", remote=True, mesh_writer="torch-ranks",
                file_output=True),
    # A write target only (an HF model folder); HF folders are detected as safetensors.
    FormatEntry("hf", "reshard.formats.hf.format:HFFormat", "", writes=True,
                options=(_MAX_SHARD_SIZE, "reshard.features.hf_options:HF_ASSETS", "reshard.features.hf_options:WEIGHTS_ONLY",
                         "reshard.features.hf_options:ARCHITECTURE_CHECK", "reshard.features.hf_options:MERGE_LORA",
                         "reshard.features.quantize.options:QUANTIZE"),
                remote=True, prepare="reshard.features.hf_export:prepare_hf"),
]
_cache: dict[str, Format] = {}


def register_format(entry: FormatEntry, *, before: str | None = None) -> None:
    """Add a format (detected before ``before``, else last); it joins ``--to`` when it writes."""
    if any(e.name == entry.name for e in FORMATS):
        raise UsageError(f"a format named {entry.name!r} is already registered")
    at = next((i for i, e in enumerate(FORMATS) if e.name == before), len(FORMATS))
    FORMATS.insert(at, entry)


def write_names() -> tuple[str, ...]:
    """What ``--to`` offers (torch-ranks is what ``--to torch --to-mesh`` writes)."""
    return tuple(e.name for e in FORMATS if e.writes)


def _entry(name: str) -> FormatEntry | None:
    return next((e for e in FORMATS if e.name == name), None)


def format_entry(name: str) -> FormatEntry:
    entry = _entry(name)
    if entry is None:
        raise UsageError(f"unknown format {name!r}; choose one of: {', '.join(write_names())}")
    return entry


def load_target(target: str) -> Any:
    """What a ``"module:attribute"`` of the table names, imported on first use."""
    module, attribute = target.split(":")
    return getattr(importlib.import_module(module), attribute)


def get_format(name: str) -> Format:
    entry = format_entry(name)
    if name not in _cache:
        _cache[name] = load_target(entry.target)()
    return _cache[name]


def mesh_writer(name: str) -> str:
    """The format that writes ``name`` laid out for a mesh; a usage error when it holds whole
    tensors only."""
    writer = format_entry(name).mesh_writer
    if writer is None:
        raise UsageError(f"--to {name} holds whole tensors; --to-mesh lays out {mesh_formats()}")
    return writer


def mesh_formats() -> str:
    """The ``--to`` formats that hold a mesh layout, in words."""
    return ", ".join(f"{e.name} (one file per rank)" if e.mesh_writer != e.name else e.name
                     for e in FORMATS if e.writes and e.mesh_writer)


def shown_name(name: str) -> str:
    """The ``--to`` a writer's format is asked by (``torch`` for the per-rank files of ``--to
    torch --to-mesh``)."""
    entry = format_entry(name)
    if entry.writes:
        return name
    return next((e.name for e in FORMATS if e.writes and e.mesh_writer == name), name)


def all_suffixes() -> tuple[str, ...]:
    return tuple(s for e in FORMATS for s in e.suffixes)


def detect_format(path: Path | RemotePath) -> Format:
    """The format of the checkpoint at ``path``, by the first entry whose ``detect`` accepts
    it. A ``RemotePath`` is offered to every entry too, so a checkpoint of a format reshard
    cannot read from a URL is refused by name rather than taken for another one."""
    remote = isinstance(path, RemotePath)
    if not isinstance(path, RemotePath):
        path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such file or directory")
    for entry in list(FORMATS):
        fmt = get_format(entry.name)
        try:
            found = fmt.detect(cast(Path, path))  # a RemotePath stands in for a Path (reshard.core.storage)
        except (TypeError, OSError):  # a reader that needs a local file (open(), mmap) cannot look at a URL
            if not remote:
                raise
            found = False
        if found and remote and not entry.remote:
            raise UnsupportedFormatError(f"{path}: {entry.holds} is read from local files only; copy it here first "
                                         f"(reshard reads {remote_holds()} from URLs)")
        if found:
            return fmt
    holds = remote_holds() if remote else ", ".join(e.holds for e in FORMATS if e.holds)
    raise UnsupportedFormatError(f"{path}: not a checkpoint reshard recognizes (expected {holds})")


def remote_holds() -> str:
    """What reshard reads from fsspec URLs, in words."""
    return ", ".join(e.holds for e in FORMATS if e.remote and e.holds)


def remote_writes() -> tuple[str, ...]:
    """The ``--to`` formats that can be written to an fsspec URL."""
    return tuple(e.name for e in FORMATS if e.writes and e.remote)


def format_for_destination(dst: Path, shown: str | None = None) -> str:
    """``--to`` when only DST is given: by suffix, else the default format (a DCP folder); a
    suffix of some other tool's file is refused rather than becoming a folder of that name."""
    suffix = dst.suffix.lower()
    if suffix in FOREIGN_SUFFIXES:
        named = ", ".join(s for e in FORMATS if e.writes for s in e.suffixes)
        raise UsageError(f"{shown or dst}: reshard does not write {dst.suffix} files; name a {named} output, a folder "
                         "without a suffix (DCP), or give --to")
    found = next((e.name for e in FORMATS if e.writes and suffix in e.suffixes), None)
    return found or next(e.name for e in FORMATS if e.default)


def declared_options() -> dict[str, OutputOption[Any]]:
    """Every output option a registered format takes, by name (each declaration imported on
    first use; they are small modules, so ``--help`` can list them)."""
    found: dict[str, OutputOption[Any]] = {}
    for entry in FORMATS:
        for declared in map(load_target, entry.options):
            if found.setdefault(declared.name, declared) is not declared:
                raise UsageError(f"two output options are named {declared.name!r} (format {entry.name}); "
                                 "a format takes a shared one by naming its declaration")
    return found


def taking(option_name: str) -> list[str]:
    """The formats whose writers take output option ``option_name``, by name."""
    return sorted(e.name for e in FORMATS if option_name in format_options(e.name))


def format_options(name: str) -> tuple[str, ...]:
    """The names of the output options format ``name``'s writer takes."""
    entry = _entry(name)
    return tuple(load_target(t).name for t in entry.options) if entry is not None else ()


def default_suffix(name: str) -> str:
    """The suffix of a default single-file output name of format ``name``."""
    entry = _entry(name)
    return entry.default_suffix if entry is not None else ""
