"""The ``reshard`` command line: a thin layer over the Python API.

Logic lives in the API; this file parses options, prints, and maps outcomes to exit codes:
0 ok, 1 a check found differences, 2 bad input or usage (one line on stderr, no traceback
unless ``--debug`` or RESHARD_DEBUG=1).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer

from reshard.errors import ReshardError, UsageError

app = typer.Typer(
    name="reshard",
    help="Convert and reshard PyTorch checkpoints: DCP, safetensors, torch.save, per-rank files.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_debug = {"on": os.environ.get("RESHARD_DEBUG") == "1"}

Debug = Annotated[bool, typer.Option("--debug", help="Show the full traceback on errors.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or notices.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
MaxMemory = Annotated[str, typer.Option("--max-memory", help="Memory budget for tensor data, e.g. 512MiB, 2GB.")]


def _say(msg: str) -> None:
    typer.echo(msg, err=True)


ToMesh = Annotated[Optional[str], typer.Option("--to-mesh", help="Target device mesh: 8, 4x8, dp_replicate=4,dp_shard=8, dp_shard=2,tp=2.")]
Placements = Annotated[Optional[str], typer.Option(
    "--placements", help="With --to-mesh: fsdp (1-D default), hsdp (2-D default), fsdp+tp, or a PLAN.json.")]


@app.command()
def inspect(
    src: Annotated[Path, typer.Argument(help="Checkpoint: DCP folder, .safetensors file or folder, .pt file...")],
    as_json: AsJson = False,
    to_mesh: ToMesh = None,
    placements: Placements = None,
    debug: Debug = False,
) -> None:
    """Show what a checkpoint holds: every tensor's shape, dtype, bytes and chunks, and the objects.

    With --to-mesh, also the bytes each rank of that mesh would hold (parameters, optimizer
    state), the imbalance, and the tensors that do not divide evenly."""
    _debug["on"] |= debug
    import reshard
    from reshard.report import catalog_json, catalog_table

    catalog = reshard.inspect(src)
    summary = None
    if to_mesh is not None:
        from reshard.mesh_report import summarize_for_mesh

        summary = summarize_for_mesh(catalog, to_mesh, placements)
    elif placements is not None:
        raise UsageError("--placements needs --to-mesh")
    if as_json:
        out = catalog_json(catalog)
        if summary is not None:
            out["target"] = summary
        typer.echo(json.dumps(out, indent=1))
        return
    typer.echo(catalog_table(catalog))
    if summary is not None:
        from reshard.mesh_report import mesh_table

        typer.echo("\n" + mesh_table(summary))


@app.command()
def convert(
    src: Annotated[Path, typer.Argument(help="Checkpoint to read (never modified).")],
    dst: Annotated[Optional[Path], typer.Argument(help="Output path; default: beside SRC, named after the target.")] = None,
    to: Annotated[Optional[str], typer.Option("--to", help="dcp, safetensors or torch (with --to-mesh: one file per rank); default from DST's suffix, else dcp.")] = None,
    to_mesh: ToMesh = None,
    placements: Placements = None,
    keep_per_rank: Annotated[bool, typer.Option(
        "--keep-per-rank", help="With --to-mesh on another rank count: carry per-rank state (RNG, data loader) as is instead of dropping it.")] = False,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Cast floating-point tensors, e.g. bfloat16.")] = None,
    only: Annotated[Optional[str], typer.Option("--only", help="Keep one section: model, optim, or any name prefix.")] = None,
    max_memory: MaxMemory = "1GiB",
    max_shard_size: Annotated[Optional[str], typer.Option("--max-shard-size", help="Split safetensors output into files of at most this size.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace DST if it exists (only once the new output is complete).")] = False,
    fsync: Annotated[bool, typer.Option("--fsync", help="Sync the output to disk before it appears (durable across power loss; slower).")] = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Convert a checkpoint to another format, streaming under --max-memory; bit-exact unless --dtype."""
    _debug["on"] |= debug
    import reshard
    from reshard.sizes import format_size

    result = reshard.convert(
        src, dst, to=to, mesh=to_mesh, placements=placements, dtype=dtype, only=only,
        max_memory=max_memory, max_shard_size=max_shard_size, overwrite=overwrite, quiet=quiet, fsync=fsync,
        keep_per_rank=keep_per_rank,
    )
    if not quiet and os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 reports
        for notice in result.notices:
            _say(f"notice: {notice}")
        _say(f"wrote {result.dst} ({result.format}, {result.tensors} tensors, "
             f"{format_size(result.bytes)}) in {result.seconds:.1f}s")


@app.command()
def verify(
    a: Annotated[Path, typer.Argument(help="First checkpoint (any format).")],
    b: Annotated[Optional[Path], typer.Argument(help="Second checkpoint (any format).")] = None,
    atol: Annotated[Optional[float], typer.Option("--atol", help="Absolute tolerance (default: exact, bit for bit).")] = None,
    rtol: Annotated[Optional[float], typer.Option("--rtol", help="Relative tolerance (default: exact).")] = None,
    as_json: AsJson = False,
    max_memory: MaxMemory = "1GiB",
    debug: Debug = False,
) -> None:
    """Compare two checkpoints tensor by tensor. Exit 0 when equal, 1 when they differ."""
    _debug["on"] |= debug
    import reshard

    if b is None:
        raise UsageError("verify needs two checkpoints: reshard verify A B")
    result = reshard.verify(a, b, atol=atol, rtol=rtol, max_memory=max_memory)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=1))
    else:
        for d in result.differences:
            typer.echo(f"DIFF {d.name}: {d.kind}: {d.detail}")
        for note in result.notes:
            typer.echo(f"note: {note}")
        verdict = "equal" if result.equal else f"{len(result.differences)} differences"
        typer.echo(f"{verdict} ({result.compared} tensors compared)")
    if not result.equal:
        raise typer.Exit(1)


def _command_name(argv: list[str]) -> str:
    names = [a for a in argv if not a.startswith("-")][:1]
    return f"reshard {names[0]}" if names else "reshard"


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app and turn every error into an exit code and one line.

    typer vendors click in a private module that moves between releases, so its parse
    errors are recognized by their public shape (``exit_code`` and ``format_message``),
    not by importing click's classes.
    """
    argv = sys.argv[1:] if argv is None else argv
    try:
        rv = app(args=argv, standalone_mode=False, prog_name="reshard")
        return rv if isinstance(rv, int) else 0
    except (typer.Abort, KeyboardInterrupt):
        _say("reshard: interrupted; no output was left behind")
        return 130
    except ReshardError as e:
        if _debug["on"]:
            traceback.print_exc()
        _say(f"reshard: error: {e}")
        return 2
    except OSError as e:
        if _debug["on"]:
            traceback.print_exc()
        _say(f"reshard: error: {e.filename or ''}{': ' if e.filename else ''}{e.strerror or e}")
        return 2
    except Exception as e:
        code = getattr(e, "exit_code", None)
        if type(e).__name__ == "Exit" and isinstance(code, int):
            return code
        if isinstance(code, int) and hasattr(e, "format_message"):  # option parsing: usage error
            if not e.format_message():  # bare `reshard`: the help was printed
                return 2
            _say(f"reshard: error: {e.format_message()} (see `{_command_name(argv)} --help`)")
            return 2
        # A bug, or an input we failed to validate: still one line.
        if _debug["on"]:
            traceback.print_exc()
        _say(f"reshard: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)")
        return 2


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
