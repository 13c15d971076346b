"""The ``reshard`` command line: a thin layer over the Python API.

Logic lives in the API; this file parses options, prints, and maps outcomes to exit codes:
0 ok, 1 a check found differences, 2 bad input or usage (one line on stderr, no traceback
unless ``--debug`` or RESHARD_DEBUG=1). Nothing here imports torch at module level, so
``reshard --help`` and usage errors answer at once. Every ``--json`` output is one object
with ``"schema": 1`` and ``"command"`` (docs/cli.md, reshard/cli/schema.json).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperCommand

from reshard.cli.flags import Given, debug_on, refresh_flags, takes_flags
from reshard.core.errors import ReshardError, UsageError, speaking_cli
from reshard.core.log import to_stderr
from reshard.core.torch_support import note_newer_torch
from reshard.pipeline.options import SourceOptions

SCHEMA_VERSION = 1


class _Command(TyperCommand):
    """typer writes required arguments as ``{SRC}`` in usage lines; the docs and every other
    tool write ``SRC``."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in super().collect_usage_pieces(ctx)]

    def format_help(self, ctx: Any, formatter: Any) -> None:
        """Option help that lists formats or key maps says what the registry and the presets
        hold now (``{write_formats}``, ``{keymap_presets}``). A command's docstring is
        reflowed into its paragraphs: typer keeps a docstring's line breaks, which are where
        the source wraps, not where the terminal does."""
        import re

        if self.help:
            self.help = "\n\n".join(" ".join(p.split()) for p in self.help.split("\n\n"))

        from reshard.features.keymap.presets import PRESET_NAMES
        from reshard.formats.registry import taking, write_names

        values = {"{write_formats}": ", ".join(write_names()), "{keymap_presets}": ", ".join(PRESET_NAMES)}
        for param in self.params:
            template = getattr(param, "_help_template", None) or getattr(param, "help", None) or ""
            if "{" in template:
                param._help_template = template  # type: ignore[attr-defined]
                for key, value in values.items():
                    template = template.replace(key, value)
                # {takes:OPTION}: the formats whose registry entries take a format-specific option
                param.help = re.sub(r"\{takes:(\w+)\}", lambda m: _either(taking(m[1])), template)  # type: ignore[attr-defined]
        super().format_help(ctx, formatter)


def _either(names: list[str]) -> str:
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else "".join(names)


app = typer.Typer(
    name="reshard",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

Src = Annotated[str, typer.Argument(metavar="SRC", help="Checkpoint: a DCP folder, .safetensors/.pt file or folder, HF folder, "
    "zarr store, a URL of one (s3://, gs://, hf://...), or a Hub repo id.")]


def _examples(*examples: tuple[str, str]) -> str:
    """A command's epilog: each example's comment on a line of its own above it, so that piped
    help (80 columns) never wraps a comment in the middle."""
    return "Examples:\n\n" + "\n\n".join(f"  # {why}\n  {cmd}" if why else f"  {cmd}" for why, cmd in examples)


def _say(msg: str) -> None:
    typer.echo(msg, err=True)


def _emit_json(command: str, payload: dict[str, Any], *, compact: bool = False) -> None:
    """One object; ``compact`` (no indentation, chunk lists written from their columns) for
    big ones, which json encodes in C."""
    from reshard.commands.inspect import compact_json

    doc = {"schema": SCHEMA_VERSION, "command": command, **payload}
    typer.echo(compact_json(doc) if compact else json.dumps(doc, indent=1))


def _version(value: bool) -> None:
    if value:
        from reshard.core.version import __version__

        typer.echo(f"reshard {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print reshard's version and exit.")] = False,
) -> None:
    """Convert and reshard PyTorch checkpoints (DCP, safetensors, HF, torch.save, per-rank files, zarr) onto any
    mesh, streaming under a memory budget. Exit codes: 0 ok, 1 differences found, 2 bad input or usage."""


@app.command(cls=_Command, epilog=_examples(
    ("tensors, shapes, dtypes, objects, layout", "reshard inspect ckpt/"),
    ("bytes per rank of a 16x8 mesh, before you launch on it", "reshard inspect ckpt/ --to-mesh 16x8"),
    ("", "reshard inspect model.safetensors --json | jq '.total_bytes'")))
@takes_flags("inspect")
def inspect(src: Src, given: Given) -> None:
    """Show what a checkpoint holds: every tensor's shape, dtype, bytes and chunks, the objects, and the layout.

    With --to-mesh, the answer for that mesh instead: the bytes each rank would hold (parameters, optimizer
    state), the imbalance, and the tensors that do not divide evenly, under the checkpoint's summary."""
    from reshard.commands.inspect import catalog_header, catalog_json, catalog_table
    from reshard.commands.inspect import inspect as inspect_checkpoint

    catalog = inspect_checkpoint(src, options=given.build(SourceOptions))
    summary = None
    if given.to_mesh is not None:
        from reshard.pipeline.mesh_report import summarize_for_mesh

        summary = summarize_for_mesh(catalog, given.to_mesh, given.placements)
    elif given.placements is not None:
        raise UsageError("--placements needs --to-mesh")
    if given.as_json:
        big = sum(t.chunk_count for t in catalog.tensors.values()) > 10_000
        out = catalog_json(catalog, chunks_as_text=big)
        if summary is not None:
            out["target"] = summary
        _emit_json("inspect", out, compact=big)
        return
    if summary is None:
        typer.echo(catalog_table(catalog))
        return
    from reshard.pipeline.mesh_report import mesh_table

    # the per-rank answer asked for, not the tensor table first (84 rows for the README's example)
    typer.echo("\n".join(catalog_header(catalog)) + "\n\n" + mesh_table(summary))
    typer.echo("".join(f"\nnotice: {n}" for n in catalog.notices) + f"\nevery tensor and object: reshard inspect {src}")


@app.command(cls=_Command, epilog=_examples(
    ("ckpt_4x8/: DCP for a 4x8 HSDP mesh", "reshard convert ckpt/ --to-mesh 4x8"),
    ("the model's own state dict", "reshard convert ckpt/ model.safetensors --only model"),
    ("an HF folder from_pretrained loads, with its tokenizer",
     "reshard convert ckpt/ out/ --to hf --config cfg/ --hf-assets tok/"),
    ("the same in bfloat16", "reshard convert ckpt/ out_bf16/ --to hf --config cfg/ --dtype bfloat16")))
@takes_flags("convert")
def convert(
    src: Src,
    dst: Annotated[Optional[str], typer.Argument(metavar="DST", help="Output path or URL (s3://, gs://, memory://...: DCP, "
        "safetensors, hf or zarr); default: beside SRC, named after the target.")] = None,
    *,
    given: Given,
) -> None:
    """Convert a checkpoint to another format or mesh, streaming under --max-memory; bit-exact unless --dtype."""
    from reshard.commands.convert import convert as convert_checkpoint
    from reshard.core.sizes import format_size, plural
    from reshard.formats.options import ConvertOptions
    from reshard.pipeline.parallel import torchrun_group

    options = given.build(ConvertOptions, quiet=given.quiet or given.as_json)
    with torchrun_group() as rank:  # under torchrun the ranks split the work; rank 0 reports
        result = convert_checkpoint(src, dst, options=options)
    if rank != 0:
        return
    if given.as_json:
        _emit_json("convert", result.to_json())
        return
    if options.dry_run:
        from reshard.commands.inspect import dry_run_table

        typer.echo(dry_run_table(result))
    if given.quiet:
        return
    verb = "would write" if options.dry_run else "wrote"
    _say(f"{verb} {result.dst} ({result.format}, {plural(result.tensors, 'tensor')}, {format_size(result.bytes)})"
         + ("" if options.dry_run else f" in {result.seconds:.1f}s"))


@app.command(cls=_Command, epilog=_examples(
    ("exit 0 equal, 1 different", "reshard verify ckpt/ full.pt"),
    ("a --dtype cast, within tolerance", "reshard verify ckpt/ out_bf16/ --atol 1e-2 --rtol 1e-2"),
    ("across a rename", "reshard verify titan_ckpt/ hf_out/ --keymap titan-to-hf --only model"),
    ("every file against its manifest", "reshard verify --quick ckpt_4x8/")))
@takes_flags("verify")
def verify(
    a: Annotated[str, typer.Argument(metavar="A", help="First checkpoint (any format; a path, URL or Hub repo id).")],
    b: Annotated[Optional[str], typer.Argument(metavar="B", help="Second checkpoint (any format).")] = None,
    *,
    given: Given,
) -> None:
    """Compare two checkpoints tensor by tensor: exit 0 when equal, 1 when they differ.

    Exact by default (names, nesting, dtypes, bits; objects by type and value); --atol/--rtol loosen floating
    and complex values only. With --quick DIR: check every file of a folder reshard wrote against its manifest."""
    from reshard.commands.verify import verify as verify_checkpoints

    quick = given.quick
    if quick:
        if b is not None or any(v is not None for v in (given.atol, given.rtol, given.keymap, given.only)):
            raise UsageError("verify --quick checks one folder against its manifest: reshard verify --quick DIR")
        from reshard.commands.verify import verify_manifest

        result = verify_manifest(a)
    elif b is None:
        raise UsageError("verify needs two checkpoints: reshard verify A B (or one folder: reshard verify --quick DIR)")
    else:
        result = verify_checkpoints(a, b, **given.kwargs(verify_checkpoints, progress=not (given.quiet or given.as_json),
                                                     options=given.build(SourceOptions)))
    if given.as_json:
        _emit_json("verify", {**result.to_json(), "quick": quick})
    else:
        for d in result.differences:
            typer.echo(f"DIFF {d.name}: {d.kind}: {d.detail}")
        for note in result.notes:
            typer.echo(f"note: {note}")
        verdict = result.verdict()
        if quick:
            files = sum(d.kind != "architecture" for d in result.differences)
            verdict = "intact" if result.ok else "; ".join(
                ([f"{files} file(s) differ from the manifest"] if files else [])
                + (["not the model its config.json describes"] if files < len(result.differences) else []))
        typer.echo(f"{verdict} ({result.compared} {'files checked' if quick else 'tensors compared'})")
    if not result.ok:
        raise typer.Exit(1)


@app.command(cls=_Command, epilog=_examples(
    ("check the folder, list what would be sent", "reshard push out/ me/my-model --dry-run"),
    ("", "reshard push out/ me/my-model --private"),
    ("", "reshard push out/ org/model --create-pr --exclude 'README.md'")))
@takes_flags("push")
def push(
    folder: Annotated[Path, typer.Argument(metavar="FOLDER", help="HF model folder to upload (from `reshard convert SRC --to "
        "hf`).")],
    repo_id: Annotated[str, typer.Argument(metavar="REPO_ID", help="Hub model repo, owner/name; created if it does not exist.")],
    *,
    given: Given,
) -> None:
    """Check an HF model folder (index, headers, tied weights, config.json, the architecture) and upload it to the Hub."""
    from reshard.core.sizes import format_size, plural
    from reshard.features.hub import push as push_folder

    result = push_folder(folder, repo_id, **given.kwargs(push_folder))
    dry_run, create_pr, revision = given.dry_run, given.create_pr, given.revision
    if given.as_json:
        _emit_json("push", result.to_json())
        return
    width = max(len(name) for name, _ in result.files)
    verb = "would upload" if dry_run else "uploaded"
    where = f"a pull request on {repo_id}" if create_pr else f"{repo_id}{'@' + revision if revision else ''}"
    typer.echo(f"{verb} {plural(len(result.files), 'file')} ({format_size(result.bytes)}) to {where}:")
    for name, size in result.files:
        typer.echo(f"  {name:<{width}}  {format_size(size)}")
    if result.url:
        typer.echo(result.url)


@app.command(cls=_Command, epilog=_examples(
    ("spawns 2 gloo ranks on CPU", "reshard train --to-mesh 2 --steps 4 --ckpt-dir runs/a"),
    ("continue on 3 ranks", "reshard train --to-mesh 3 --steps 8 --resume runs/a --ckpt-dir runs/a"),
    ("", "torchrun --nproc_per_node 8 -m reshard train --to-mesh 2x4 --model 100m")))
@takes_flags("train")
def train(given: Given) -> None:
    """Train the project's Llama-style model with FSDP2 on synthetic data (spawns --nproc ranks, or runs under torchrun)."""
    mesh = given.to_mesh
    if mesh is None:
        raise UsageError("train needs --to-mesh: the mesh to train on (N, RxS or dp_replicate=R,dp_shard=S)")
    from reshard.train.launch import launch
    from reshard.train.loop import TrainConfig

    cfg = given.build(TrainConfig, to_mesh=mesh, log=not (given.quiet or given.as_json))
    result = launch(cfg, **given.kwargs(launch))
    if os.environ.get("RANK", "0") != "0":
        return
    if given.as_json:
        _emit_json("train", result.to_json())
    elif result.losses and not given.quiet:
        last = max(result.losses)
        _say(f"trained steps {result.start_step + 1}..{result.end_step}; loss {result.losses[last]:.6f} at step {last}")


@app.command(cls=_Command, epilog=_examples(
    ("every path, bit-exact and resumed", "reshard validate --from-mesh 2 --to-mesh 3"),
    ("", "reshard validate --from-mesh 1x2 --to-mesh 4 --via dcp,safetensors --json")))
@takes_flags("validate")
def validate(given: Given) -> None:
    """Train, save, convert through each path, resume on another mesh, and compare with an uninterrupted run.

    Exit 0 when every path is bit-exact and its losses match; 1 when any does not."""
    from reshard.commands.validate import format_table
    from reshard.commands.validate import validate as run_validate

    result = run_validate(**given.kwargs(run_validate))
    if given.as_json:
        _emit_json("validate", result.to_json())
    else:
        typer.echo(format_table(result))
    if not result.ok:
        raise typer.Exit(1)


def _command_name(argv: list[str]) -> str:
    """The command whose ``--help`` to point at: the one typed, when it is a command."""
    names = [a for a in argv if not a.startswith("-")][:1]
    known = {c.name for c in app.registered_commands} | {c.callback.__name__ for c in app.registered_commands if c.callback}
    return f"reshard {names[0]}" if names and names[0] in known else "reshard"


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app and turn every error into an exit code and one line.

    typer vendors click in a private module that moves between releases, so its parse
    errors are recognized by their public shape (``exit_code`` and ``format_message``),
    not by importing click's classes.
    """
    argv = sys.argv[1:] if argv is None else argv
    debug_on["on"] = os.environ.get("RESHARD_DEBUG") == "1"  # per call: main() may run many times in one process
    try:
        with speaking_cli(), to_stderr(logging.DEBUG if debug_on["on"] else logging.INFO):
            note_newer_torch()
            refresh_flags()
            rv = app(args=argv, standalone_mode=False, prog_name="reshard")
        if rv == 130:  # typer turns Ctrl-C into exit code 130 before we can see it
            _say("reshard: interrupted; no output was left behind")
        return rv if isinstance(rv, int) else 0
    except (typer.Abort, KeyboardInterrupt):
        _say("reshard: interrupted; no output was left behind")
        return 130
    except ReshardError as e:
        return _error(e, f"reshard: error: {e}")
    except OSError as e:
        return _error(e, f"reshard: error: {e.filename or ''}{': ' if e.filename else ''}{e.strerror or e}")
    except Exception as e:
        code = getattr(e, "exit_code", None)
        if type(e).__name__ == "Exit" and isinstance(code, int):
            return code
        if isinstance(code, int) and hasattr(e, "format_message"):  # option parsing: usage error
            if not e.format_message():  # bare `reshard`: the help was printed
                return 2
            return _error(e, f"reshard: error: {e.format_message()} (see `{_command_name(argv)} --help`)", trace=False)
        # A bug, or an input we failed to validate: still one line.
        return _error(e, f"reshard: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)")


def _error(e: BaseException, line: str, *, trace: bool = True) -> int:
    """Say ``line`` (after the traceback, with --debug) and exit 2. On a rank other than 0 of a
    torchrun job, an error rank 0 says too (a usage error, one the ranks shared) is not said
    again: once per job, not once per rank."""
    from reshard.pipeline.parallel import said_by_rank_0

    if said_by_rank_0(e) and not debug_on["on"]:
        return 2
    if trace and debug_on["on"]:
        traceback.print_exc()
    _say(line)
    return 2


def _collect_young_garbage_only() -> None:
    """Planning a checkpoint saved by hundreds of ranks makes millions of small objects (boxes,
    chunk readers), none in a reference cycle, and with the default thresholds the collector
    walks all of them again and again: 10 of 23 s of a 256-rank ``--dry-run``. Young objects
    are still collected; full passes become rare, and what a paused build made is frozen
    rather than walked once more (``gc_pause.freeze_on_resume``). Only the console script
    does this."""
    from reshard.core.gc_pause import freeze_on_resume

    gc.set_threshold(100_000, 50, 1000)
    freeze_on_resume()


def _return_large_blocks_to_the_system() -> None:
    """glibc serves blocks under its adaptive mmap threshold (up to 32 MiB) from the heap and
    keeps them after ``free``: decoded zarr chunks and read slabs of a few MiB each then pile
    up as resident memory the budget never counted. A fixed 4 MiB threshold hands them back
    on ``free``; measured on a zstd zarr -> safetensors run at --max-memory 160MiB, peak RSS
    fell from 465 to 307 MiB. Only the console script does this: a library must not change
    its host process's allocator."""
    try:
        import ctypes

        ctypes.CDLL(None).mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def entry() -> None:
    """The console script. Every output is complete, renamed into place and closed when
    ``main`` returns, so the process leaves at once: tearing down an interpreter with torch
    loaded takes a noticeable fraction of a small conversion's time."""
    _return_large_blocks_to_the_system()
    _collect_young_garbage_only()
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
