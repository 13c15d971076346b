"""Every option of a conversion or a load, in one frozen value built once (by the CLI from its
flags, by ``reshard.convert`` / ``reshard.load_model`` from their keyword arguments) and handed
down: the planning stages, the engine and each format's writer read the fields they need from it.

``SourceOptions`` says how a source is opened and named (storage options, layout, allowed
classes, config, key map); ``convert``, ``verify``, ``inspect`` and the load functions all take
it, and ``ConvertOptions`` and ``LoadOptions`` are ``SourceOptions`` with what their call adds
(``.source`` hands the source's part down alone).

A value is checked when it is built (sizes and the budget's floor, dtype, mesh and layout names,
class names, options that need another), so the API and the CLI refuse the same things with the
same message, each naming the option as its caller wrote it, before any source is opened.

Which options a format's writer uses beyond the common ones is declared in its registry entry
(``FormatEntry.options``); asking another format for one is refused, naming the formats
that take it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, TypeVar

from reshard.core.errors import UsageError, option
from reshard.core.sizes import parse_size

__all__ = ["SourceOptions", "ConvertOptions", "LoadOptions", "FORMAT_OPTIONS", "MIN_MEMORY", "LOAD_MODES", "check_budget"]

MIN_MEMORY = 1 << 20  # the command line's floor: a smaller --max-memory is a slip (512 meaning 512MiB)
LOAD_MODES = ("auto", "rank0", "parallel")


def check_budget(max_memory: str | int, floor: int = 1) -> int:
    """``max_memory`` in bytes; a usage error below ``floor`` (the API moves data even in a
    few bytes, as the tests do to force slabs; the CLI asks for ``MIN_MEMORY``)."""
    from reshard.core.sizes import format_size

    given = option(f"--max-memory {max_memory}", f"max_memory={max_memory!r}")
    try:
        budget = parse_size(max_memory)
    except UsageError as e:
        raise UsageError(f"{given}: {e}") from None
    if budget < floor:
        raise UsageError(f"{given}: {format_size(budget)} is too small to work in; give at least {format_size(floor)}, "
                         "e.g. 512MiB")
    return budget

# Options only some formats' writers use: name -> (CLI flag, API argument).
FORMAT_OPTIONS = {
    "max_shard_size": ("--max-shard-size", "max_shard_size="),
    "compress": ("--compress", "compress=True"),
    "hf_assets": ("--hf-assets", "hf_assets="),
    "weights_only": ("--weights-only", "weights_only=True"),
    "architecture_check": ("--no-architecture-check", "architecture_check=False"),
    "merge_lora": ("--merge-lora", "merge_lora="),
    "quantize": ("--quantize", "quantize="),
}


_Options = TypeVar("_Options", bound="SourceOptions")


@dataclass(frozen=True, kw_only=True)
class SourceOptions:
    """How a source is opened and what its names are: shared by ``convert``, ``verify``,
    ``inspect``, ``load_model`` and ``load_state_dict`` (``ConvertOptions`` and ``LoadOptions``
    hold these fields too)."""

    storage_options: dict[str, Any] | None = None  # fsspec arguments for URL sources (and outputs)
    layout: str | None = None  # the convention the names follow, when detection is wrong
    allow_classes: str | tuple[str, ...] | list[str] = ()  # classes read as inert data, for this call only
    config: str | os.PathLike | None = None  # the model's config.json / HF folder / repo id
    keymap: Any = None  # a preset name, a JSON path or dict, or a map

    def __post_init__(self) -> None:
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise UsageError(f"{option('--storage-options', 'storage_options=')}: give a JSON object of fsspec options, "
                             """e.g. '{"anon": true}'""")
        if self.layout is not None:
            from reshard.core.conventions import convention_named

            convention_named(self.layout)
        names = (self.allow_classes,) if isinstance(self.allow_classes, str) else tuple(self.allow_classes or ())
        object.__setattr__(self, "allow_classes", names)
        if names:  # a malformed name, or one that can run code, is refused now
            from reshard.safe_pickle.unpickler import class_names

            class_names(names)

    @property
    def source(self) -> SourceOptions:
        """The source's part alone, to hand down where the source is opened."""
        return SourceOptions(**{f.name: getattr(self, f.name) for f in fields(SourceOptions)})

    def allowing(self) -> contextlib.AbstractContextManager[None]:
        """The classes of ``allow_classes`` allowed while the block runs, in this context only."""
        if not self.allow_classes:
            return contextlib.nullcontext()
        from reshard.safe_pickle.unpickler import allowing

        return allowing(self.allow_classes)

    @classmethod
    def of(cls: type[_Options], given: dict[str, Any], base: _Options | None = None) -> _Options:
        """From keyword arguments (over ``base``'s fields when given); an unknown name is a usage
        error that lists the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise UsageError(f"unknown {cls._what} option {unknown[0]!r}; the options are {', '.join(sorted(known))}")
        return cls(**given) if base is None else replace(base, **given)

    _what: ClassVar[str] = "source"  # what an unknown keyword argument is called an unknown option of


@dataclass(frozen=True)
class LoadOptions(SourceOptions):
    """The options of ``load_model`` and ``load_state_dict`` (their keyword arguments, as one
    value): how ranks read (``mode``), whether every name must match (``strict``), the budget,
    progress, and which part of the checkpoint is the model (``section``)."""

    mode: str = "auto"  # auto, rank0 (rank 0 reads and sends) or parallel (each rank reads its own)
    strict: bool = True  # every live tensor must be in the checkpoint, and the reverse
    max_memory: str | int = "1GiB"  # the budget for tensor data in flight, per rank
    progress: bool = True
    section: str | int | None = None  # one model of an accelerate folder (1), or a section to load as the model ("ema")

    _what: ClassVar[str] = "load"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in LOAD_MODES:
            raise UsageError(f"mode {self.mode!r} is not one of {', '.join(LOAD_MODES)}")
        check_budget(self.max_memory)
        if self.storage_options is not None:
            raise UsageError("storage_options=: load_model and load_state_dict read local paths; "
                             "copy a URL source to local storage first (or convert it there)")

    @property
    def budget(self) -> int:
        return parse_size(self.max_memory)


@dataclass(frozen=True)
class ConvertOptions(SourceOptions):
    to: str | None = None  # output format; default from DST's suffix, else dcp
    mesh: str | None = None  # "8", "4x8", "dp_shard=4,tp=2": lay the output out for this mesh
    placements: str | None = None  # fsdp, hsdp, fsdp+tp or a PLAN.json (with mesh)
    dtype: Any = None  # cast floating-point tensors (a name, a torch dtype or a reshard DType); never integer state
    only: str | None = None  # "model", "optim" or a name prefix
    exclude: str | tuple[str, ...] | list[str] | None = None  # globs of names to leave out
    hf_assets: str | os.PathLike | None = None  # tokenizer and friends for to="hf"
    weights_only: bool = False  # to="hf" without config.json
    architecture_check: bool = True  # to="hf": refuse an export that is not the model its config.json describes
    merge_lora: str | os.PathLike | None = None  # to="hf": a PEFT LoRA adapter folder or repo id, merged in
    keep_dtype: str | tuple[str, ...] | list[str] | None = None  # regexes of output names dtype= leaves alone
    quantize: str | None = None  # to="hf": a scheme of reshard.features.quantize.registry.SCHEMES (fp8, fp8-dynamic...)
    max_memory: str | int = "1GiB"  # the budget for tensor data in flight
    max_shard_size: str | int | None = None  # largest output file (safetensors, hf, zarr)
    compress: bool = False  # zstd zarr chunks
    keep_per_rank: bool = False  # carry per-rank state onto another rank count as it is
    overwrite: bool = False  # replace an existing output
    quiet: bool = False  # no progress
    workers: int | None = None  # copy threads (default: up to 4)
    fsync: bool = False  # durable against power loss when it appears
    dry_run: bool = False  # plan and check everything, write nothing

    _what: ClassVar[str] = "conversion"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_budget(self.max_memory)
        if self.max_shard_size is not None:
            parse_size(self.max_shard_size)
        if self.dtype is not None:
            from reshard.core.dtypes import parse_dtype

            parse_dtype(self.dtype)
        if self.mesh is not None:
            from reshard.core.sharding import parse_mesh

            parse_mesh(self.mesh)
        elif self.placements is not None:
            raise UsageError(f"{option('--placements', 'placements=')} needs {option('--to-mesh', 'mesh=')}")
        elif self.keep_per_rank:
            raise UsageError(f"{option('--keep-per-rank', 'keep_per_rank=True')} applies with {option('--to-mesh', 'mesh=')} "
                             "(per-rank state is kept as is otherwise)")
        if self.keep_dtype and self.dtype is None and self.quantize is None:
            raise UsageError(f"{option('--keep-dtype', 'keep_dtype=')} applies with {option('--dtype', 'dtype=')} "
                             f"or {option('--quantize', 'quantize=')} (nothing is cast otherwise)")

    @property
    def budget(self) -> int:
        return parse_size(self.max_memory)

    @property
    def shard_bytes(self) -> int | None:
        return parse_size(self.max_shard_size) if self.max_shard_size is not None else None

    def format_options_set(self) -> list[str]:
        """The format-specific options this conversion asks for."""
        defaults = {f.name: f.default for f in fields(self)}
        return [name for name in FORMAT_OPTIONS if getattr(self, name) != defaults[name]]


def named(name: str) -> str:
    """A format-specific option as the caller wrote it."""
    return option(*FORMAT_OPTIONS[name])
