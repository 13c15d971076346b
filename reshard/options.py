"""Every option of a conversion, in one frozen value built once (by the CLI from its flags, by
``reshard.convert`` from its keyword arguments) and handed down: the planning stages, the
engine and each format's writer read the fields they need from it.

A value is checked when it is built (sizes and the budget's floor, dtype and mesh names,
options that need another), so the API and the CLI refuse the same things with the same
message, each naming the option as its caller wrote it, before any source is opened.

Which options a format's writer uses beyond the common ones is declared in its registry entry
(``FormatEntry.options``); asking another format for one is refused, naming the formats
that take it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from reshard.errors import UsageError, option
from reshard.sizes import parse_size

__all__ = ["ConvertOptions", "FORMAT_OPTIONS", "MIN_MEMORY", "check_budget"]

MIN_MEMORY = 1 << 20  # the command line's floor: a smaller --max-memory is a slip (512 meaning 512MiB)


def check_budget(max_memory: str | int, floor: int = 1) -> int:
    """``max_memory`` in bytes; a usage error below ``floor`` (the API moves data even in a
    few bytes, as the tests do to force slabs; the CLI asks for ``MIN_MEMORY``)."""
    from reshard.sizes import format_size

    budget = parse_size(max_memory)
    if budget < floor:
        raise UsageError(f"{option(f'--max-memory {max_memory}', f'max_memory={max_memory!r}')}: {format_size(budget)} is "
                         f"too small to work in; give at least {format_size(floor)}, e.g. 512MiB")
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


@dataclass(frozen=True)
class ConvertOptions:
    to: str | None = None  # output format; default from DST's suffix, else dcp
    mesh: str | None = None  # "8", "4x8", "dp_shard=4,tp=2": lay the output out for this mesh
    placements: str | None = None  # fsdp, hsdp, fsdp+tp or a PLAN.json (with mesh)
    dtype: Any = None  # cast floating-point tensors (a name, a torch dtype or a reshard DType); never integer state
    only: str | None = None  # "model", "optim" or a name prefix
    exclude: str | tuple[str, ...] | list[str] | None = None  # globs of names to leave out
    keymap: Any = None  # a preset name, a JSON path or dict, or a map
    layout: str | None = None  # the convention the names follow, when detection is wrong
    config: str | os.PathLike | None = None  # the model's config.json / HF folder / repo id
    hf_assets: str | os.PathLike | None = None  # tokenizer and friends for to="hf"
    weights_only: bool = False  # to="hf" without config.json
    architecture_check: bool = True  # to="hf": refuse an export that is not the model its config.json describes
    merge_lora: str | os.PathLike | None = None  # to="hf": a PEFT LoRA adapter folder or repo id, merged in
    keep_dtype: str | tuple[str, ...] | list[str] | None = None  # regexes of output names dtype= leaves alone
    quantize: str | None = None  # to="hf": "fp8" (block-scaled float8_e4m3fn, DeepSeek-V3's format)
    max_memory: str | int = "1GiB"  # the budget for tensor data in flight
    max_shard_size: str | int | None = None  # largest output file (safetensors, hf, zarr)
    compress: bool = False  # zstd zarr chunks
    keep_per_rank: bool = False  # carry per-rank state onto another rank count as it is
    overwrite: bool = False  # replace an existing output
    quiet: bool = False  # no progress
    workers: int | None = None  # copy threads (default: up to 4)
    fsync: bool = False  # durable against power loss when it appears
    dry_run: bool = False  # plan and check everything, write nothing
    storage_options: dict[str, Any] | None = None  # fsspec arguments for URL sources and outputs

    def __post_init__(self) -> None:
        check_budget(self.max_memory)
        if self.max_shard_size is not None:
            parse_size(self.max_shard_size)
        if self.dtype is not None:
            from reshard.dtypes import parse_dtype

            parse_dtype(self.dtype)
        if self.mesh is not None:
            from reshard.mesh.sharding import parse_mesh

            parse_mesh(self.mesh)
        elif self.placements is not None:
            raise UsageError(f"{option('--placements', 'placements=')} needs {option('--to-mesh', 'mesh=')}")
        elif self.keep_per_rank:
            raise UsageError(f"{option('--keep-per-rank', 'keep_per_rank=True')} applies with {option('--to-mesh', 'mesh=')} "
                             "(per-rank state is kept as is otherwise)")
        if self.keep_dtype and self.dtype is None and self.quantize is None:
            raise UsageError(f"{option('--keep-dtype', 'keep_dtype=')} applies with {option('--dtype', 'dtype=')} "
                             f"or {option('--quantize', 'quantize=')} (nothing is cast otherwise)")

    @classmethod
    def of(cls, given: dict[str, Any]) -> ConvertOptions:
        """From keyword arguments; an unknown name is a usage error that lists the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise UsageError(f"unknown conversion option {unknown[0]!r}; the options are {', '.join(sorted(known))}")
        return cls(**given)

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
