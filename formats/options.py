"""The options of one conversion: how its source is read (``SourceOptions``), what it makes
(format, mesh, dtype, which part), how the work runs (budget, workers, progress), and the
output options the registry's formats declare (``OutputOption``: ``--compress`` of zarr,
``--quantize`` of an HF export...), one frozen value built once, by the CLI from its flags
and by ``reshard.convert`` from its keyword arguments.

It sits beside the registry, above the pipeline, because only the registry knows which
output options exist: a format adds one by declaring it in its own module and naming it in
its entry, and this class, the command line and the messages take it from there. A value is
checked when it is built, so the API and the CLI refuse the same things with the same
message, before any source is opened.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from reshard.formats.registry import declared_options

from reshard.core.dtypes import parse_dtype
from reshard.core.errors import UsageError, option
from reshard.core.sharding import parse_mesh
from reshard.core.sizes import parse_size
from reshard.pipeline.options import OutputOption, SourceOptions, WriterOptions, check_budget, former_keyword, shard_bytes

__all__ = ["ConvertOptions"]

T = TypeVar("T")


@dataclass(frozen=True)
class _Conversion(SourceOptions):
    to: str | None = None  # output format; default from DST's suffix, else dcp
    to_mesh: str | None = None  # "8", "4x8", "dp_shard=4,tp=2": lay the output out for this mesh (--to-mesh)
    placements: str | None = None  # fsdp, hsdp, fsdp+tp or a PLAN.json (with to_mesh)
    dtype: Any = None  # cast floating-point tensors (a name, a torch dtype or a reshard DType); never integer state
    only: str | None = None  # "model", "optim" or a name prefix
    exclude: str | tuple[str, ...] | list[str] | None = None  # globs of names to leave out
    keep_dtype: str | tuple[str, ...] | list[str] | None = None  # regexes of output names dtype= (or a cast) leaves alone
    max_memory: str | int = "1GiB"  # the budget for tensor data in flight
    keep_per_rank: bool = False  # carry per-rank state onto another rank count as it is
    overwrite: bool = False  # replace an existing output
    quiet: bool = False  # no progress
    workers: int | None = None  # copy threads (default: up to 4)
    fsync: bool = False  # durable against power loss when it appears
    dry_run: bool = False  # plan and check everything, write nothing
    output: dict[str, Any] = field(default_factory=dict)  # the output options given (OutputOption), by name

    _what: ClassVar[str] = "conversion"


class ConvertOptions(_Conversion):
    """The options of ``reshard.convert``. Output options are keyword arguments like the
    others (``ConvertOptions(to="zarr", compress=True)``) and are read with ``value``."""

    def __init__(self, **given: Any) -> None:
        if "mesh" in given:  # the name before the keyword matched its flag, --to-mesh
            given["to_mesh"] = former_keyword("reshard.convert", "mesh", "to_mesh", given.pop("mesh"), given.get("to_mesh"))
        declared = declared_options()
        output = dict(given.pop("output", None) or {})
        output.update({name: given.pop(name) for name in [n for n in given if n in declared]})
        unknown = sorted(set(output) - set(declared))
        if unknown:
            raise UsageError(f"unknown {self._what} option {unknown[0]!r}; the options are {', '.join(self.accepted())}")
        super().__init__(**given, output=output)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_budget(self.max_memory)
        declared = declared_options()
        for name, value in self.output.items():
            check = declared[name].check
            if check is not None and value is not None:
                check(value)
        if self.dtype is not None:
            parse_dtype(self.dtype)
        if self.to_mesh is not None:
            parse_mesh(self.to_mesh)
        elif self.placements is not None:
            raise UsageError(f"{option('--placements', 'placements=')} needs {option('--to-mesh', 'to_mesh=')}")
        elif self.keep_per_rank:
            raise UsageError(f"{option('--keep-per-rank', 'keep_per_rank=True')} applies with {option('--to-mesh', 'to_mesh=')} "
                             "(per-rank state is kept as is otherwise)")
        casting = [o for o in declared.values() if o.casts]
        if self.keep_dtype and self.dtype is None and not any(self.value(o) is not None for o in casting):
            raise UsageError(f"{option('--keep-dtype', 'keep_dtype=')} applies with {option('--dtype', 'dtype=')} "
                             f"{''.join(f'or {o.named} ' for o in casting)}(nothing is cast otherwise)")

    @classmethod
    def accepted(cls) -> list[str]:
        """Every keyword this class takes: its fields and the declared output options."""
        return sorted({f.name for f in fields(cls) if f.name != "output"} | set(declared_options()))

    @classmethod
    def of(cls, given: dict[str, Any], base: ConvertOptions | None = None) -> ConvertOptions:
        unknown = sorted(set(given) - set(cls.accepted()) - {"mesh"})  # mesh=: to_mesh='s former name
        if unknown:
            raise UsageError(f"unknown {cls._what} option {unknown[0]!r}; the options are {', '.join(cls.accepted())}")
        if base is None:
            return cls(**given)
        declared = declared_options()
        kept = {f.name: getattr(base, f.name) for f in fields(base)}
        output = {**base.output, **{k: v for k, v in given.items() if k in declared}}
        return cls(**{**kept, **{k: v for k, v in given.items() if k not in declared}, "output": output})

    def value(self, declared: OutputOption[T]) -> T:
        """The value of output option ``declared``: as given, else its default."""
        return self.for_writer().value(declared)

    def output_options_set(self) -> list[str]:
        """The output options this conversion asks for (given, and not their defaults)."""
        declared = declared_options()
        return [name for name, value in self.output.items() if value != declared[name].default]

    def for_writer(self) -> WriterOptions:
        """What a format's writer is told."""
        return WriterOptions(budget=self.budget, given=dict(self.output))

    @property
    def budget(self) -> int:
        return parse_size(self.max_memory)

    @property
    def shard_bytes(self) -> int | None:
        return shard_bytes(self.for_writer())
