"""Every option flag of the command line, in one table: one row per option (the field it
gives, its flag, type, default, help, and the commands that take it), as formats/registry.py
is one table of formats. The options only some outputs take are not rows here: each is
declared beside its format or feature (``reshard.pipeline.options.OutputOption``) and
``flags_of("convert")`` adds those the registry's formats take.

A command lists only its arguments; ``takes_flags(command)`` adds the table's rows for it as
typer options and hands the body one ``Given`` value, from which it builds its options
(``given.build(ConvertOptions)``) or the keyword arguments of the function it calls
(``given.kwargs(push)``): no flag is defined, or copied into an option, twice. Each row's
``field`` is a field of the command's options or a parameter of its function (``TARGETS``),
or one of the few that only steer the command line itself (``CLI_ONLY``); tests/test_cli_flags.py
holds the table to that. Help strings may name registry facts (``{write_formats}``,
``{takes:OPTION}``), filled in when help is shown (``reshard.cli.app._Command``).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import typer

from reshard.core.conventions import CONVENTIONS  # plain data: no torch import
from reshard.core.errors import UsageError
from reshard.core.log import log_notices
from reshard.features.hf_options import ARCHITECTURE_CHECK
from reshard.formats.registry import declared_options
from reshard.pipeline.options import FORMER_KEYWORDS_REMOVED_IN, OutputOption

__all__ = ["Flag", "FLAGS", "TARGETS", "CLI_ONLY", "Given", "takes_flags", "refresh_flags", "flags_of", "debug_on"]


@dataclass(frozen=True)
class Flag:
    field: str  # the option it gives: a field of the command's options or a parameter of its function (TARGETS)
    decls: tuple[str, ...]  # the flag, and its short form: ("--quiet", "-q")
    type: Any  # as typer reads it: bool is a switch, Optional[list[str]] repeatable
    help: str
    commands: tuple[str, ...]
    default: Any = None
    metavar: str | None = None
    value: Callable[[Any], Any] | None = None  # the flag's value -> the option's (--no-architecture-check -> False)
    callback: Callable[[Any], Any] | None = None  # run as typer parses it, before any command's work
    hidden: bool = False
    renames: str | None = None  # a former spelling: the field its value gives (said in a notice)

    @property
    def flag(self) -> str:
        return self.decls[0]

    @classmethod
    def declared(cls, declared: OutputOption[Any], commands: tuple[str, ...] = ("convert",), *,
                 help: str | None = None) -> Flag:
        """The row of an output option, from its declaration (``help``: another command's words
        for the same field)."""
        return cls(declared.name, (declared.flag,), declared.type, declared.help if help is None else help, commands,
                   default=False if declared.type is bool else None, metavar=declared.metavar, value=declared.from_flag)


# What a command's rows may give: the fields of its options, the parameters of the function it
# calls ("module:name", resolved only by the test), and CLI_ONLY.
TARGETS: dict[str, tuple[str, ...]] = {
    "inspect": ("reshard.pipeline.options:SourceOptions", "reshard.pipeline.mesh_report:summarize_for_mesh"),
    "convert": ("reshard.formats.options:ConvertOptions",),
    "verify": ("reshard.commands.verify:verify", "reshard.pipeline.options:SourceOptions"),
    "push": ("reshard.features.hub:push",),
    "train": ("reshard.train.loop:TrainConfig", "reshard.train.launch:launch"),
    "validate": ("reshard.commands.validate:validate",),
}
CLI_ONLY = frozenset({"as_json", "debug", "quiet", "quick", "former_mesh", "former_model"})

# --debug: per call of ``reshard.cli.app.main``, which resets it; the flag's callback turns it on.
debug_on: dict[str, bool] = {"on": False}


def _debug(value: bool) -> bool:
    if value:
        from reshard.core.log import LOGGER

        debug_on["on"] = True
        LOGGER.setLevel(logging.DEBUG)
    return value


def _quiet(value: bool) -> bool:
    if value:
        from reshard.core.log import quiet

        quiet()
    return value


def _storage_options_checked(value: Optional[str]) -> Optional[str]:
    """``--storage-options JSON`` refused as typer parses it when it is not a JSON object."""
    if value is not None:
        from reshard.core.storage import parse_storage_options

        parse_storage_options(value)
    return value


def _storage_options(value: Optional[str]) -> dict[str, Any] | None:
    from reshard.core.storage import parse_storage_options

    return parse_storage_options(value) or None


def _cli_budget(value: str) -> str:
    """The command line's floor under ``--max-memory`` (``MIN_MEMORY``: 512 meaning 512MiB is a slip)."""
    from reshard.pipeline.options import MIN_MEMORY, check_budget

    check_budget(value, MIN_MEMORY)
    return value


def _path_text(value: Optional[Path]) -> str | None:
    return str(value) if value else None


_ALL = ("inspect", "convert", "verify", "push", "train", "validate")
_WORKS = ("convert", "verify", "push", "train")  # commands that show progress

FLAGS: tuple[Flag, ...] = (
    # --- what a conversion makes
    Flag("to", ("--to",), Optional[str], "Output format: {write_formats} (torch with --to-mesh: one file per rank); default "
         "from DST's suffix, else dcp.", ("convert",)),
    Flag("to_mesh", ("--to-mesh",), Optional[str], "Target device mesh: 8, 4x8, dp_replicate=4,dp_shard=8, dp_shard=4,tp=2.",
         ("inspect", "convert")),
    Flag("to_mesh", ("--to-mesh",), Optional[str], "Data-parallel mesh to train on: N (FSDP), RxS or dp_replicate=R,dp_shard=S "
         "(HSDP).", ("train",)),
    Flag("from_mesh", ("--from-mesh",), str, "Mesh the checkpoint is trained and saved on.", ("validate",), default=...),
    Flag("to_mesh", ("--to-mesh",), str, "Mesh every converted checkpoint is resumed on.", ("validate",), default=...),
    Flag("placements", ("--placements",), Optional[str], "With --to-mesh: fsdp (1-D default), hsdp (2-D default), fsdp+tp "
         "(default for dp_shard=S,tp=T), or a PLAN.json.", ("inspect", "convert")),
    Flag("keep_per_rank", ("--keep-per-rank",), bool, "With --to-mesh on another rank count: carry per-rank state (RNG, data "
         "loader) as is instead of dropping it.", ("convert",), default=False),
    Flag("dtype", ("--dtype",), Optional[str], "Cast parameters and their optimizer moments (state shaped like its parameter; "
         "never step or other values), e.g. bfloat16.", ("convert",)),
    Flag("only", ("--only",), Optional[str], "Keep one part: model (into a .pt/.safetensors file: the model's own keys), optim, "
         "or any name prefix.", ("convert",)),
    Flag("only", ("--only",), Optional[str], "Compare one part of both: model (each side's model tensors by FQN), optim, or a "
         "name prefix.", ("verify",)),
    Flag("exclude", ("--exclude",), Optional[list[str]], "Drop tensors and objects whose names match this glob (repeatable).",
         ("convert",)),
    # --- how the source is read (SourceOptions)
    Flag("layout", ("--layout",), Optional[str], "The tool whose names the checkpoint follows, when detection is wrong: "
         f"{', '.join(c.name for c in CONVENTIONS)} (docs/formats.md).", ("inspect", "convert")),
    Flag("keymap", ("--keymap",), Optional[str], "Rename tensors: {keymap_presets}, or a MAP.json.", ("convert",)),
    Flag("keymap", ("--keymap",), Optional[str], "Rename A's tensors first (e.g. titan-to-hf), to compare across a rename.",
         ("verify",)),
    Flag("keymap", ("--keymap",), Optional[str], "Rename the --resume checkpoint's tensors first, e.g. hf-to-titan.",
         ("train",)),
    Flag("config", ("--config",), Optional[str], "The model's config: a config.json, an HF folder or a Hub repo id (head "
         "counts for key maps; config.json of --to hf).", ("convert",)),
    # --- an HF export (its own options are declared beside it: reshard.features.hf_options)
    Flag("keep_dtype", ("--keep-dtype",), Optional[list[str]], "With --dtype or --quantize: tensors whose output name matches "
         "this regex keep their source dtype (repeatable).", ("convert",), metavar="REGEX"),
    # --- comparing
    Flag("atol", ("--atol",), Optional[float], "Absolute tolerance for floating/complex values (default: exact, bit for bit).",
         ("verify",)),
    Flag("rtol", ("--rtol",), Optional[float], "Relative tolerance for floating/complex values (default: exact).",
         ("verify",)),
    Flag("quick", ("--quick",), bool, "Check one output folder against its .reshard-manifest.json (sizes, SHA-256); no source "
         "needed.", ("verify",), default=False),
    # --- how the work runs
    Flag("max_memory", ("--max-memory",), str, "Memory budget for tensor data: 512MiB, 2GiB (or 512M, 2G: binary); 2GB = "
         "2*10^9 bytes.", ("convert", "verify"), default="1GiB", value=_cli_budget),
    Flag("dry_run", ("--dry-run",), bool, "Plan and check everything, print what would be written, write nothing.",
         ("convert",), default=False),
    Flag("overwrite", ("--overwrite",), bool, "Replace DST if it is a file or a folder reshard wrote; nothing else is "
         "deleted (only once the new output is complete).", ("convert",), default=False),
    Flag("fsync", ("--fsync",), bool, "Sync the output to disk before it appears (durable across power loss; slower).",
         ("convert",), default=False),
    # --- pushing to the Hub
    Flag("private", ("--private",), bool, "Create the repo private.", ("push",), default=False),
    Flag("revision", ("--revision",), Optional[str], "Branch to push to (created if needed).", ("push",)),
    Flag("commit_message", ("--commit-message",), Optional[str], "Message of the upload commit.", ("push",)),
    Flag("token", ("--token",), Optional[str], "Hugging Face token (default: HF_TOKEN or `hf auth login`).", ("push",)),
    Flag("create_pr", ("--create-pr",), bool, "Open a pull request instead of committing to the branch.", ("push",),
         default=False),
    Flag("include", ("--include",), Optional[list[str]], "Upload only files matching this glob (repeatable).", ("push",)),
    Flag("exclude", ("--exclude",), Optional[list[str]], "Do not upload files matching this glob (repeatable).", ("push",)),
    Flag("dry_run", ("--dry-run",), bool, "Check the folder and list what would be sent; no network.", ("push",),
         default=False),
    Flag.declared(ARCHITECTURE_CHECK, ("push",), help="Push even if the weights are not the model config.json describes."),
    # --- training and validating
    Flag("nproc", ("--nproc",), Optional[int], "Ranks to spawn (default: the mesh's size); leave out under torchrun.",
         ("train",)),
    Flag("steps", ("--steps",), int, "Train until this step (a resumed run continues from its checkpoint's step).",
         ("train",), default=10),
    Flag("steps", ("--steps",), int, "Steps before the checkpoint, and again after resuming.", ("validate",), default=3),
    Flag("via", ("--via",), str, "Conversion paths, comma-separated: dcp,safetensors,torch,zarr.", ("validate",),
         default="dcp,safetensors,torch,zarr", value=lambda text: tuple(p.strip() for p in text.split(",") if p.strip())),
    Flag("ckpt_dir", ("--ckpt-dir",), Optional[Path], "Save DCP checkpoints here as step-N/.", ("train",), value=_path_text),
    Flag("save_every", ("--save-every",), int, "Save every K steps (and at the last step); 0: last step only.", ("train",),
         default=0),
    Flag("resume", ("--resume",), Optional[Path], "Checkpoint to resume from, in any format and from any mesh (or a "
         "--ckpt-dir: its latest step).", ("train",), value=_path_text),
    Flag("model", ("--model",), str, "Model config preset: tiny, small or 100m.", ("train", "validate"), default="tiny"),
    Flag("tie_embeddings", ("--tie-embeddings",), bool, "Share the embedding with the output projection.", ("train",),
         default=False),
    Flag("global_batch", ("--global-batch",), int, "Samples per step over all ranks (divisible by the rank count).",
         ("train", "validate"), default=12),
    Flag("lr", ("--lr",), float, "Peak learning rate (linear warmup, then cosine).", ("train",), default=3e-3),
    Flag("warmup", ("--warmup",), int, "Warmup steps.", ("train",), default=2),
    Flag("seed", ("--seed",), int, "Seed of the initial weights and the synthetic data.", ("train",), default=0),
    Flag("mixed_precision", ("--mixed-precision",), bool, "bf16 parameters in compute, fp32 gradient reduction.", ("train",),
         default=False),
    Flag("rtol", ("--rtol",), float, "Largest relative loss difference after resume that still matches.", ("validate",),
         default=1e-4),
    Flag("workdir", ("--workdir",), Optional[Path], "Keep the checkpoints and conversions here (default: a temp dir).",
         ("validate",)),
    Flag("device", ("--device",), str, "auto (GPUs with NCCL when each rank has one), cpu or cuda.", ("train", "validate"),
         default="auto"),
    # --- every command
    Flag("allow_classes", ("--allow-class",), Optional[list[str]], "Read objects of this class in a trusted torch file as inert "
         "data (repeatable; its code is never run), like torch's add_safe_globals.", ("inspect", "convert", "verify"),
         metavar="MODULE.NAME", value=lambda names: tuple(names or ())),
    Flag("as_json", ("--json",), bool, "Print one JSON object (schema 1, see docs/cli.md).", _ALL, default=False),
    Flag("quiet", ("--quiet", "-q"), bool, "No progress or notices (errors still print).", _WORKS, default=False,
         callback=_quiet),
    Flag("storage_options", ("--storage-options",), Optional[str], "fsspec options for s3://, gs://, az://, hf:// URLs, e.g. "
         "'{\"endpoint_url\": \"http://localhost:9000\"}' (credentials also from the store's own environment: AWS_*, "
         "FSSPEC_S3_ENDPOINT_URL...).", ("inspect", "convert", "verify"), metavar="JSON", callback=_storage_options_checked,
         value=_storage_options),
    Flag("debug", ("--debug",), bool, "Show the full traceback on errors, and debug detail.", _ALL, default=False,
         callback=_debug),
    # Former spellings, hidden: still taken until reshard 0.4 (FORMER_KEYWORDS_REMOVED_IN), with a notice naming
    # the flag that means the same in every command and the release that removes the former one.
    Flag("former_mesh", ("--mesh",), Optional[str], f"Former spelling of --to-mesh; removed in reshard "
         f"{FORMER_KEYWORDS_REMOVED_IN}.", ("train",), hidden=True, renames="to_mesh"),
    Flag("former_model", ("--config",), Optional[str], f"Former spelling of --model; removed in reshard "
         f"{FORMER_KEYWORDS_REMOVED_IN}.", ("train", "validate"), hidden=True, renames="model"),
)


def flags_of(command: str) -> list[Flag]:
    """The rows ``command`` takes, in its help's order: the table's, and for ``convert`` the
    output options the registry's formats declare, each below the row its declaration names
    (``after``), the others last among them."""
    rows = [f for f in FLAGS if command in f.commands]
    if command != "convert":
        return rows
    declared = list(declared_options().values())
    for d in (d for d in declared if d.after is not None):
        at = next((i + 1 for i, f in enumerate(rows) if f.field == d.after), len(rows))
        rows.insert(at, Flag.declared(d))
    names = {d.name for d in declared}
    last = max((i + 1 for i, f in enumerate(rows) if f.field in names), default=len(rows))
    for d in (d for d in declared if d.after is None):
        rows.insert(last, Flag.declared(d))
        last += 1
    return rows


_Options = TypeVar("_Options")


class Given:
    """What one command's flags say, by field, each converted to the option's value."""

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = values

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def build(self, cls: type[_Options], **override: Any) -> _Options:
        """``cls`` (a dataclass of options) from the flags that are its fields (and, for
        ``ConvertOptions``, the output options it ``accepted``)."""
        accepted = getattr(cls, "accepted", None)
        names = set(accepted()) if accepted else {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{**{k: v for k, v in self._values.items() if k in names}, **override})

    def kwargs(self, fn: Callable[..., Any], **override: Any) -> dict[str, Any]:
        """The flags that are ``fn``'s keyword parameters."""
        names = inspect.signature(fn).parameters
        return {**{k: v for k, v in self._values.items() if k in names}, **override}


_COMMANDS: list[tuple[str, Callable[..., Any], list[inspect.Parameter]]] = []  # what takes_flags wrapped
_signed_for: dict[str, tuple[int, ...]] = {}  # command -> the declared output options its signature has


def takes_flags(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give the decorated command (its own parameters: arguments, then ``given``) the table's
    flags for ``command`` as typer options, and call it with them as one ``Given``."""

    def wrap(body: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(body, eval_str=True).parameters.values() if p.name != "given"]

        def run(**kw: Any) -> Any:
            rows = flags_of(command)
            values = {f.field: (f.value(kw[f.field]) if f.value else kw[f.field]) for f in rows}
            for former in (f for f in rows if f.renames):
                _take_former(former, next(f for f in rows if f.field == former.renames), values)
            return body(**{p.name: kw[p.name] for p in own}, given=Given(values))

        run.__name__, run.__doc__ = body.__name__, body.__doc__
        _COMMANDS.append((command, run, own))
        _signed(command, run, own)
        return run
    return wrap


def _take_former(former: Flag, now: Flag, values: dict[str, Any]) -> None:
    """A value given under a flag's former spelling, as its field's, with a notice; refused
    when the current spelling says otherwise."""
    given = values.pop(former.field)
    if given is None:
        return
    current = values.get(now.field)
    if current not in (None, now.default) and current != given:
        raise UsageError(f"{now.flag} {current} and {former.flag} {given} disagree; {former.flag} is {now.flag}'s former name")
    values[now.field] = given
    log_notices([f"{former.flag} is now {now.flag} (one flag, one meaning in every command); {former.flag} is removed "
                 f"in reshard {FORMER_KEYWORDS_REMOVED_IN}"])


def refresh_flags() -> None:
    """Each command's options from the table and the registry as they are now (a format
    registered after import adds its options): typer reads them when the app is called. Only
    the declared output options can change after import, so a command is signed again only
    when they did: every run of the command line calls this."""
    for command, run, own in _COMMANDS:
        _signed(command, run, own)


def _signed(command: str, run: Callable[..., Any], own: list[inspect.Parameter]) -> None:
    declared = tuple(map(id, declared_options().values()))
    if _signed_for.get(command) == declared:
        return
    params = own + [inspect.Parameter(f.field, inspect.Parameter.KEYWORD_ONLY, annotation=_annotation(f),
                                      default=inspect.Parameter.empty if f.default is ... else f.default)
                    for f in flags_of(command)]
    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # read by typer
    _signed_for[command] = declared


def _annotation(f: Flag) -> Any:
    option = typer.Option(*f.decls, help=f.help or None, metavar=f.metavar, callback=f.callback, hidden=f.hidden)
    return Annotated[f.type, option]
