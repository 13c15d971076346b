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
    help="Convert and reshard PyTorch checkpoints (DCP, safetensors, HF, torch.save, per-rank files, zarr) onto any mesh.",
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
    src: Annotated[str, typer.Argument(help="Checkpoint to read (never modified): a path, a Hub repo id, or a zarr URL.")],
    dst: Annotated[Optional[str], typer.Argument(help="Output path or zarr URL (memory://, s3://...); default: beside SRC, named after the target.")] = None,
    to: Annotated[Optional[str], typer.Option("--to", help="dcp, safetensors, torch (with --to-mesh: one file per rank), hf or zarr; default from DST's suffix, else dcp.")] = None,
    to_mesh: ToMesh = None,
    placements: Placements = None,
    keep_per_rank: Annotated[bool, typer.Option(
        "--keep-per-rank", help="With --to-mesh on another rank count: carry per-rank state (RNG, data loader) as is instead of dropping it.")] = False,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Cast floating-point tensors, e.g. bfloat16.")] = None,
    only: Annotated[Optional[str], typer.Option("--only", help="Keep one section: model, optim, or any name prefix.")] = None,
    keymap: Annotated[Optional[str], typer.Option("--keymap", help="Rename tensors: titan-to-hf, hf-to-titan, hf-unfuse, hf-fuse, strip-wrappers, or a MAP.json.")] = None,
    max_memory: MaxMemory = "1GiB",
    max_shard_size: Annotated[Optional[str], typer.Option("--max-shard-size", help="Split safetensors output into files of at most this size.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace DST if it exists (only once the new output is complete).")] = False,
    fsync: Annotated[bool, typer.Option("--fsync", help="Sync the output to disk before it appears (durable across power loss; slower).")] = False,
    compress: Annotated[bool, typer.Option("--compress", help="zstd-compress zarr chunks (smaller, slower; default off).")] = False,
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
        keep_per_rank=keep_per_rank, keymap=keymap, compress=compress,
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
    quick: Annotated[bool, typer.Option(
        "--quick", help="Check one output folder against its .reshard-manifest.json (sizes, SHA-256); no source needed.")] = False,
    debug: Debug = False,
) -> None:
    """Compare two checkpoints tensor by tensor. Exit 0 when equal, 1 when they differ.

    With --quick DIR: check every file of a folder reshard wrote against its manifest."""
    _debug["on"] |= debug
    import reshard

    if quick:
        if b is not None or atol is not None or rtol is not None:
            raise UsageError("verify --quick checks one folder against its manifest: reshard verify --quick DIR")
        from reshard.verify import verify_manifest

        result = verify_manifest(a)
    elif b is None:
        raise UsageError("verify needs two checkpoints: reshard verify A B (or one folder: reshard verify --quick DIR)")
    else:
        result = reshard.verify(a, b, atol=atol, rtol=rtol, max_memory=max_memory)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=1))
    else:
        for d in result.differences:
            typer.echo(f"DIFF {d.name}: {d.kind}: {d.detail}")
        for note in result.notes:
            typer.echo(f"note: {note}")
        verdict = "equal" if result.equal else f"{len(result.differences)} differences"
        if quick:
            verdict = "intact" if result.equal else f"{len(result.differences)} file(s) differ from the manifest"
        typer.echo(f"{verdict} ({result.compared} {'files checked' if quick else 'tensors compared'})")
    if not result.equal:
        raise typer.Exit(1)


@app.command()
def push(
    folder: Annotated[Path, typer.Argument(help="HF model folder to upload (from `reshard convert SRC --to hf`).")],
    repo_id: Annotated[str, typer.Argument(help="Hub model repo, owner/name; created if it does not exist.")],
    private: Annotated[bool, typer.Option("--private", help="Create the repo private.")] = False,
    revision: Annotated[Optional[str], typer.Option("--revision", help="Branch to push to (created if needed).")] = None,
    commit_message: Annotated[Optional[str], typer.Option("--commit-message", help="Message of the upload commit.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the folder and list what would be sent; no network.")] = False,
    debug: Debug = False,
) -> None:
    """Check an HF model folder (index, headers, tied weights, config.json) and upload it to the Hub."""
    _debug["on"] |= debug
    from reshard.hub import push as push_folder
    from reshard.sizes import format_size

    result = push_folder(folder, repo_id, private=private, revision=revision, commit_message=commit_message,
                         dry_run=dry_run)
    width = max(len(name) for name, _ in result.files)
    verb = "would upload" if dry_run else "uploaded"
    typer.echo(f"{verb} {len(result.files)} files ({format_size(result.bytes)}) to {repo_id}"
               f"{'@' + revision if revision else ''}:")
    for name, size in result.files:
        typer.echo(f"  {name:<{width}}  {format_size(size)}")
    for notice in result.notices:
        _say(f"notice: {notice}")
    if result.url:
        typer.echo(result.url)


ModelPreset = Annotated[str, typer.Option("--config", help="Model config preset: tiny, small or 100m.")]
GlobalBatch = Annotated[int, typer.Option("--global-batch", help="Samples per step over all ranks (divisible by the rank count).")]
TrainDevice = Annotated[str, typer.Option("--device", help="auto (GPUs with NCCL when each rank has one), cpu or cuda.")]


@app.command()
def train(
    mesh: Annotated[str, typer.Option("--mesh", help="Data-parallel mesh: N (FSDP), RxS or dp_replicate=R,dp_shard=S (HSDP).")],
    nproc: Annotated[Optional[int], typer.Option("--nproc", help="Ranks to spawn (default: the mesh's size); leave out under torchrun.")] = None,
    steps: Annotated[int, typer.Option("--steps", help="Train until this step (a resumed run continues from its checkpoint's step).")] = 10,
    ckpt_dir: Annotated[Optional[Path], typer.Option("--ckpt-dir", help="Save DCP checkpoints here as step-N/.")] = None,
    save_every: Annotated[int, typer.Option("--save-every", help="Save every K steps (and at the last step); 0: last step only.")] = 0,
    resume: Annotated[Optional[Path], typer.Option("--resume", help="Checkpoint to resume from, in any format and from any mesh (or a --ckpt-dir: its latest step).")] = None,
    config: ModelPreset = "tiny",
    tie_embeddings: Annotated[bool, typer.Option("--tie-embeddings", help="Share the embedding with the output projection.")] = False,
    global_batch: GlobalBatch = 12,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (linear warmup, then cosine).")] = 3e-3,
    warmup: Annotated[int, typer.Option("--warmup", help="Warmup steps.")] = 2,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the initial weights and the synthetic data.")] = 0,
    mixed_precision: Annotated[bool, typer.Option("--mixed-precision", help="bf16 parameters in compute, fp32 gradient reduction.")] = False,
    keymap: Annotated[Optional[str], typer.Option("--keymap", help="Rename the --resume checkpoint's tensors first, e.g. hf-to-titan.")] = None,
    device: TrainDevice = "auto",
    debug: Debug = False,
) -> None:
    """Train the project's Llama-style model with FSDP2 on synthetic data (spawns --nproc ranks, or runs under torchrun)."""
    _debug["on"] |= debug
    from reshard.train.launch import launch
    from reshard.train.loop import TrainConfig

    cfg = TrainConfig(mesh=mesh, model=config, tie_embeddings=tie_embeddings, steps=steps, global_batch=global_batch,
                      lr=lr, warmup=warmup, seed=seed, mixed_precision=mixed_precision,
                      ckpt_dir=str(ckpt_dir) if ckpt_dir else None, save_every=save_every,
                      resume=str(resume) if resume else None, keymap=keymap)
    result = launch(cfg, nproc, device=device)
    if os.environ.get("RANK", "0") == "0" and result.losses:
        last = max(result.losses)
        _say(f"trained steps {result.start_step + 1}..{result.end_step}; loss {result.losses[last]:.6f} at step {last}")


@app.command()
def validate(
    from_mesh: Annotated[str, typer.Option("--from-mesh", help="Mesh the checkpoint is trained and saved on.")],
    to_mesh: Annotated[str, typer.Option("--to-mesh", help="Mesh every converted checkpoint is resumed on.")],
    steps: Annotated[int, typer.Option("--steps", help="Steps before the checkpoint, and again after resuming.")] = 3,
    via: Annotated[str, typer.Option("--via", help="Conversion paths, comma-separated: dcp,safetensors,torch,zarr.")] = "dcp,safetensors,torch,zarr",
    config: ModelPreset = "tiny",
    global_batch: GlobalBatch = 12,
    rtol: Annotated[float, typer.Option("--rtol", help="Largest relative loss difference after resume that still matches.")] = 1e-4,
    workdir: Annotated[Optional[Path], typer.Option("--workdir", help="Keep the checkpoints and conversions here (default: a temp dir).")] = None,
    device: TrainDevice = "cpu",
    as_json: AsJson = False,
    debug: Debug = False,
) -> None:
    """Train, save, convert through each path, resume on another mesh, and compare with an uninterrupted run.

    Exit 0 when every path is bit-exact and its losses match; 1 when any does not."""
    _debug["on"] |= debug
    from reshard.validate import format_table
    from reshard.validate import validate as run_validate

    paths = tuple(p.strip() for p in via.split(",") if p.strip())
    result = run_validate(from_mesh, to_mesh, steps, paths, model=config, global_batch=global_batch, rtol=rtol,
                          workdir=workdir, device=device)
    typer.echo(json.dumps(result.to_json(), indent=1) if as_json else format_table(result))
    if not result.ok:
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
    _debug["on"] = os.environ.get("RESHARD_DEBUG") == "1"  # per call: main() may run many times in one process
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
    """The console script. Every output is complete, renamed into place and closed when
    ``main`` returns, so the process leaves at once: tearing down an interpreter with torch
    loaded takes a noticeable fraction of a small conversion's time."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
