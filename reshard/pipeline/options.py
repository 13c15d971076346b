"""How a source is read, how a load runs, and what a format's writer is told: frozen values,
each built once (by the CLI from its flags, by the API from its keyword arguments) and handed
down.

``SourceOptions`` says how a source is opened and named (storage options, layout, allowed
classes, config, key map); ``convert``, ``verify``, ``inspect`` and the load functions all take
it, and ``LoadOptions`` (here) and ``ConvertOptions`` (``reshard.formats.options``, beside the
registry that knows every output option) are ``SourceOptions`` with what their call adds
(``.source`` hands the source's part down alone).

An option only some outputs take is an ``OutputOption``, declared where the format or feature
that uses it lives (``--max-shard-size`` here, as three formats take it); a format's writer
gets ``WriterOptions``: the budget and the values given.

A value is checked when it is built (sizes and the budget's floor, layout and class names,
options that need another), so the API and the CLI refuse the same things with the same
message, each naming the option as its caller wrote it, before any source is opened.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Generic, Optional, TypeVar, cast

from reshard.core.errors import UsageError, option
from reshard.core.sizes import format_size, parse_size

__all__ = ["SourceOptions", "LoadOptions", "OutputOption", "WriterOptions", "MAX_SHARD_SIZE", "MIN_MEMORY", "LOAD_MODES",
           "check_budget", "shard_bytes", "former_keyword",
           "FORMER_KEYWORDS_REMOVED_IN"]

MIN_MEMORY = 1 << 20  # the command line's floor: a smaller --max-memory is a slip (512 meaning 512MiB)
LOAD_MODES = ("auto", "rank0", "parallel")


def check_budget(max_memory: str | int, floor: int = 1) -> int:
    """``max_memory`` in bytes; a usage error below ``floor`` (the API moves data even in a
    few bytes, as the tests do to force slabs; the CLI asks for ``MIN_MEMORY``)."""
    given = option(f"--max-memory {max_memory}", f"max_memory={max_memory!r}")
    try:
        budget = parse_size(max_memory)
    except UsageError as e:
        raise UsageError(f"{given}: {e}") from None
    if budget < floor:
        raise UsageError(f"{given}: {format_size(budget)} is too small to work in; give at least {format_size(floor)}, "
                         "e.g. 512MiB")
    return budget

# The release that stops taking the keywords renamed in 0.2 (mesh= is to_mesh=, source_options=
# is options=), and the other former spellings kept meanwhile (the hidden --mesh and --config
# flags of train and validate, reshard.cli.flags; the layouts' former names,
# reshard.core.conventions): each former name's warning or notice says it.
FORMER_KEYWORDS_REMOVED_IN = "0.4"


def former_keyword(function: str, former: str, now: str, former_value: Any, value: Any, *,
                   removed_in: str = FORMER_KEYWORDS_REMOVED_IN) -> Any:
    """``value``, or ``former_value`` when the caller used a keyword's former name (still
    taken, with a ``DeprecationWarning`` naming the new one and the release that removes the
    old): every public function takes its inputs, then its options by the same names."""
    if former_value is None:
        return value
    if value is not None and value != former_value:
        raise UsageError(f"{now}={value!r} and {former}={former_value!r} disagree; {former}= is {now}='s former name")
    warnings.warn(f"{function}({former}=...) is now {function}({now}=...); {former}= is removed in reshard {removed_in}",
                  DeprecationWarning, stacklevel=3)
    return former_value


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
            # Imported when used: the command line builds its flags from this module, and
            # `reshard --help` imports neither numpy (the conventions) nor the unpickler.
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


# ------------------------------------------------------------------ options only some outputs take

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class OutputOption(Generic[T]):
    """An option only some outputs take, declared once where the format or feature that uses
    it lives; a registry entry lists the declarations its writer takes. The command line's
    flag, the API's keyword argument, the check of its value and every message that names it
    come from this one value."""

    name: str  # the keyword argument of reshard.convert and ConvertOptions
    flag: str  # the command line's flag
    help: str  # {takes:NAME} in it: the formats whose entries take it, filled in when help is shown
    default: T
    type: Any = Optional[str]  # as typer reads the flag: bool is a switch
    metavar: str | None = None
    api: str = ""  # as an API caller writes it in messages (default "NAME=")
    from_flag: Callable[[Any], T] | None = None  # the flag's value -> the option's (--no-architecture-check -> False)
    check: Callable[[Any], object] | None = None  # refuses a bad value (a UsageError) when the options are built (never None)
    casts: bool = False  # it changes dtypes, so --keep-dtype applies with it
    after: str | None = None  # in `convert --help`, the row of this field comes before it (default: the last)

    @property
    def named(self) -> str:
        """The option as its caller writes it (``--compress`` / ``compress=True``)."""
        return option(self.flag, self.api or f"{self.name}=")


@dataclass(frozen=True)
class WriterOptions:
    """What a format's writer is told: the conversion's budget, and the values of the output
    options given (a writer reads those its registry entry takes, ``value``)."""

    budget: int = 1 << 30
    given: Mapping[str, Any] = field(default_factory=dict)

    def value(self, declared: OutputOption[T]) -> T:
        return cast(T, self.given.get(declared.name, declared.default))


def shard_bytes(options: WriterOptions) -> int | None:
    """``MAX_SHARD_SIZE`` in bytes, when given."""
    size = options.value(MAX_SHARD_SIZE)
    return parse_size(size) if size is not None else None


# The largest file of an output: declared here, as several formats take it (their entries say which).
MAX_SHARD_SIZE: OutputOption[str | int | None] = OutputOption(
    "max_shard_size", "--max-shard-size", "Largest file of an output ({takes:max_shard_size}; HF-style shards: default "
    "5GB for hf).", default=None, check=parse_size, after="max_memory")
