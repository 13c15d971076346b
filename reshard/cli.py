"""The ``reshard`` command line: a thin layer over the Python API.

Logic lives in the API; this file parses options, prints, and maps outcomes to exit codes:
0 ok, 1 a check found differences, 2 bad input or usage (one line on stderr, no traceback
unless ``--debug`` or RESHARD_DEBUG=1). Nothing here imports torch at module level, so
``reshard --help`` and usage errors answer at once. Every ``--json`` output is one object
with ``"schema": 1`` and ``"command"`` (docs/cli.md, reshard/cli_schema.json).
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

from reshard.conventions import CONVENTIONS  # plain data: no torch import
from reshard.errors import ReshardError, UsageError, speaking_cli
from reshard.log import LOGGER, to_stderr

SCHEMA_VERSION = 1


class _Command(TyperCommand):
    """typer writes required arguments as ``{SRC}`` in usage lines; the docs and every other
    tool write ``SRC``."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in super().collect_usage_pieces(ctx)]

    def format_help(self, ctx: Any, formatter: Any) -> None:
        """Option help that lists formats or key maps says what the registry and the presets
        hold now (``{write_formats}``, ``{keymap_presets}``)."""
        import re

        from reshard.formats.registry import taking, write_names
        from reshard.keymap.presets import PRESET_NAMES

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

_debug = {"on": os.environ.get("RESHARD_DEBUG") == "1"}
_allowed_by_options: list[Any] = []


def _debug_logging(value: bool) -> bool:
    if value:
        LOGGER.setLevel(logging.DEBUG)
    return value


Debug = Annotated[bool, typer.Option("--debug", help="Show the full traceback on errors, and debug detail.",
                                     callback=_debug_logging)]
def _quiet_logging(value: bool) -> bool:
    if value:
        from reshard.log import quiet

        quiet()
    return value


Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or notices (errors still print).",
                                     callback=_quiet_logging)]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON object (schema 1, see docs/cli.md).")]


def _storage_options(value: Optional[str]) -> Optional[str]:
    """``--storage-options JSON`` refused early when it is not a JSON object; each command
    passes it to its own options (``_store``), never as process-wide state."""
    if value is not None:
        from reshard.storage import parse_storage_options

        parse_storage_options(value)
    return value


def _store(value: Optional[str]) -> dict[str, Any] | None:
    from reshard.storage import parse_storage_options

    return parse_storage_options(value) or None


StorageOptions = Annotated[Optional[str], typer.Option(
    "--storage-options", metavar="JSON", callback=_storage_options,
    help="fsspec options for s3://, gs://, az://, hf:// URLs, e.g. '{\"endpoint_url\": \"http://localhost:9000\"}' "
         "(credentials also from the store's own environment: AWS_*, FSSPEC_S3_ENDPOINT_URL...).")]
MaxMemory = Annotated[str, typer.Option(
    "--max-memory", help="Memory budget for tensor data: 512MiB, 2GiB (or 512M, 2G: binary); 2GB = 2*10^9 bytes.")]
ToMesh = Annotated[Optional[str], typer.Option(
    "--to-mesh", help="Target device mesh: 8, 4x8, dp_replicate=4,dp_shard=8, dp_shard=4,tp=2.")]
Placements = Annotated[Optional[str], typer.Option(
    "--placements", help="With --to-mesh: fsdp (1-D default), hsdp (2-D default), fsdp+tp (default for dp_shard=S,tp=T), or a "
        "PLAN.json.")]
LayoutOption = Annotated[Optional[str], typer.Option(
    "--layout", help="The tool whose names the checkpoint follows, when detection is wrong: "
    f"{', '.join(c.name for c in CONVENTIONS)} (docs/formats.md).")]
AllowClass = Annotated[Optional[list[str]], typer.Option(
    "--allow-class", metavar="MODULE.NAME", help="Read objects of this class in a trusted torch file as inert data (repeatable; "
    "its code is never run), like torch's add_safe_globals.")]
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
    from reshard.report import compact_json

    doc = {"schema": SCHEMA_VERSION, "command": command, **payload}
    typer.echo(compact_json(doc) if compact else json.dumps(doc, indent=1))


def _allow(names: list[str] | None) -> None:
    """Allow the classes of ``--allow-class`` until ``main`` returns (objects of a DCP
    checkpoint are unpickled late, when the command first asks for them)."""
    if names:
        from reshard.safe_pickle.unpickler import allow_classes

        _allowed_by_options.append(allow_classes(names))


def _check_memory(max_memory: str) -> None:
    from reshard.options import MIN_MEMORY, check_budget

    check_budget(max_memory, MIN_MEMORY)


def _version(value: bool) -> None:
    if value:
        from reshard import __version__

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
def inspect(
    src: Src,
    as_json: AsJson = False,
    to_mesh: ToMesh = None,
    placements: Placements = None,
    layout: LayoutOption = None,
    allow_class: AllowClass = None,
    storage_options: StorageOptions = None,
    debug: Debug = False,
) -> None:
    """Show what a checkpoint holds: every tensor's shape, dtype, bytes and chunks, the objects, and the layout.

    With --to-mesh, also the bytes each rank of that mesh would hold (parameters, optimizer state), the
    imbalance, and the tensors that do not divide evenly."""
    _debug["on"] |= debug
    _allow(allow_class)
    import reshard
    from reshard.report import catalog_json, catalog_table

    catalog = reshard.inspect(src, layout=layout, storage_options=_store(storage_options))
    summary = None
    if to_mesh is not None:
        from reshard.mesh.report import summarize_for_mesh

        summary = summarize_for_mesh(catalog, to_mesh, placements)
    elif placements is not None:
        raise UsageError("--placements needs --to-mesh")
    if as_json:
        big = sum(t.chunk_count for t in catalog.tensors.values()) > 10_000
        out = catalog_json(catalog, chunks_as_text=big)
        if summary is not None:
            out["target"] = summary
        _emit_json("inspect", out, compact=big)
        return
    typer.echo(catalog_table(catalog))
    if summary is not None:
        from reshard.mesh.report import mesh_table

        typer.echo("\n" + mesh_table(summary))


@app.command(cls=_Command, epilog=_examples(
    ("ckpt_4x8/: DCP for a 4x8 HSDP mesh", "reshard convert ckpt/ --to-mesh 4x8"),
    ("the model's own state dict", "reshard convert ckpt/ model.safetensors --only model"),
    ("an HF folder from_pretrained loads, with its tokenizer",
     "reshard convert ckpt/ out/ --to hf --config cfg/ --hf-assets tok/"),
    ("the same in bfloat16", "reshard convert ckpt/ out_bf16/ --to hf --config cfg/ --dtype bfloat16")))
def convert(
    src: Src,
    dst: Annotated[Optional[str], typer.Argument(metavar="DST", help="Output path or URL (s3://, gs://, memory://...: DCP, "
        "safetensors, hf or zarr); default: beside SRC, named after the target.")] = None,
    to: Annotated[Optional[str], typer.Option("--to", help="Output format: {write_formats} (torch with --to-mesh: one file per "
        "rank); default from DST's suffix, else dcp.")] = None,
    to_mesh: ToMesh = None,
    placements: Placements = None,
    keep_per_rank: Annotated[bool, typer.Option(
        "--keep-per-rank", help="With --to-mesh on another rank count: carry per-rank state (RNG, data loader) as is instead of "
            "dropping it.")] = False,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Cast parameters and their optimizer moments (state shaped like "
        "its parameter; never step or other values), e.g. bfloat16.")] = None,
    only: Annotated[Optional[str], typer.Option("--only", help="Keep one part: model (into a .pt/.safetensors file: the model's "
        "own keys), optim, or any name prefix.")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option("--exclude", help="Drop tensors and objects whose names match this glob "
        "(repeatable).")] = None,
    layout: LayoutOption = None,
    keymap: Annotated[Optional[str], typer.Option("--keymap", help="Rename tensors: {keymap_presets}, or a MAP.json.")] = None,
    config: Annotated[Optional[str], typer.Option("--config", help="The model's config: a config.json, an HF folder or a Hub "
        "repo id (head counts for key maps; config.json of --to hf).")] = None,
    hf_assets: Annotated[Optional[str], typer.Option("--hf-assets", help="With --to {takes:hf_assets}: copy the tokenizer, chat "
        "template and generation config of this folder or Hub repo id.")] = None,
    weights_only: Annotated[bool, typer.Option("--weights-only", help="With --to {takes:weights_only}: write the safetensors "
        "only, without config.json (not loadable by from_pretrained as is).")] = False,
    no_architecture_check: Annotated[bool, typer.Option("--no-architecture-check", help="With --to {takes:architecture_check}: "
        "write the export even if it is not the model its config.json describes (the model card says it was not "
            "checked).")] = False,
    merge_lora: Annotated[Optional[str], typer.Option("--merge-lora", metavar="ADAPTER", help="With --to {takes:merge_lora}: "
        "merge this PEFT LoRA adapter (folder or Hub repo id) into the weights, W + scaling * (B @ A) in float32, "
            "streamed.")] = None,
    keep_dtype: Annotated[Optional[list[str]], typer.Option("--keep-dtype", metavar="REGEX", help="With --dtype or --quantize: "
        "tensors whose output name matches this regex keep their source dtype (repeatable).")] = None,
    quantize: Annotated[Optional[str], typer.Option("--quantize", metavar="fp8", help="With --to {takes:quantize}: store linear "
        "weights as float8_e4m3fn with float32 scales per 128x128 block (DeepSeek-V3's format, for vLLM, SGLang, "
            "transformers).")] = None,
    max_memory: MaxMemory = "1GiB",
    max_shard_size: Annotated[Optional[str], typer.Option("--max-shard-size", help="Largest file of an output "
        "({takes:max_shard_size}; HF-style shards: default 5GB for hf).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Plan and check everything, print what would be written, write "
        "nothing.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace DST if it exists (only once the new output is "
        "complete).")] = False,
    fsync: Annotated[bool, typer.Option("--fsync", help="Sync the output to disk before it appears (durable across power loss; "
        "slower).")] = False,
    compress: Annotated[bool, typer.Option("--compress", help="zstd-compress the chunks of a {takes:compress} output (smaller, "
        "slower; default off).")] = False,
    allow_class: AllowClass = None,
    as_json: AsJson = False,
    quiet: Quiet = False,
    storage_options: StorageOptions = None,
    debug: Debug = False,
) -> None:
    """Convert a checkpoint to another format or mesh, streaming under --max-memory; bit-exact unless --dtype."""
    _debug["on"] |= debug
    _allow(allow_class)
    _check_memory(max_memory)
    import reshard
    from reshard.options import ConvertOptions
    from reshard.parallel import torchrun_group
    from reshard.sizes import format_size, plural

    options = ConvertOptions(
        to=to, mesh=to_mesh, placements=placements, dtype=dtype, only=only, exclude=exclude, keymap=keymap,
        layout=layout, config=config, hf_assets=hf_assets, weights_only=weights_only,
        architecture_check=not no_architecture_check, merge_lora=merge_lora, keep_dtype=keep_dtype, quantize=quantize,
        max_memory=max_memory,
        max_shard_size=max_shard_size, compress=compress, keep_per_rank=keep_per_rank, overwrite=overwrite,
        quiet=quiet or as_json, fsync=fsync, dry_run=dry_run, storage_options=_store(storage_options))
    with torchrun_group() as rank:  # under torchrun the ranks split the work; rank 0 reports
        result = reshard.convert(src, dst, options)
    if rank != 0:
        return
    if as_json:
        _emit_json("convert", result.to_json())
        return
    if dry_run:
        from reshard.report import dry_run_table

        typer.echo(dry_run_table(result))
    if quiet:
        return
    verb = "would write" if dry_run else "wrote"
    _say(f"{verb} {result.dst} ({result.format}, {plural(result.tensors, 'tensor')}, {format_size(result.bytes)})"
         + ("" if dry_run else f" in {result.seconds:.1f}s"))


@app.command(cls=_Command, epilog=_examples(
    ("exit 0 equal, 1 different", "reshard verify ckpt/ full.pt"),
    ("a --dtype cast, within tolerance", "reshard verify ckpt/ out_bf16/ --atol 1e-2 --rtol 1e-2"),
    ("across a rename", "reshard verify titan_ckpt/ hf_out/ --keymap titan-to-hf --only model"),
    ("every file against its manifest", "reshard verify --quick ckpt_4x8/")))
def verify(
    a: Annotated[str, typer.Argument(metavar="A", help="First checkpoint (any format; a path, URL or Hub repo id).")],
    b: Annotated[Optional[str], typer.Argument(metavar="B", help="Second checkpoint (any format).")] = None,
    atol: Annotated[Optional[float], typer.Option("--atol", help="Absolute tolerance for floating/complex values (default: "
        "exact, bit for bit).")] = None,
    rtol: Annotated[Optional[float], typer.Option("--rtol", help="Relative tolerance for floating/complex values (default: "
        "exact).")] = None,
    keymap: Annotated[Optional[str], typer.Option("--keymap", help="Rename A's tensors first (e.g. titan-to-hf), to compare "
        "across a rename.")] = None,
    only: Annotated[Optional[str], typer.Option("--only", help="Compare one part of both: model (each side's model tensors by "
        "FQN), optim, or a name prefix.")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick", help="Check one output folder against its .reshard-manifest.json (sizes, SHA-256); no source "
            "needed.")] = False,
    max_memory: MaxMemory = "1GiB",
    allow_class: AllowClass = None,
    as_json: AsJson = False,
    quiet: Quiet = False,
    storage_options: StorageOptions = None,
    debug: Debug = False,
) -> None:
    """Compare two checkpoints tensor by tensor: exit 0 when equal, 1 when they differ.

    Exact by default (names, nesting, dtypes, bits; objects by type and value); --atol/--rtol loosen floating
    and complex values only. With --quick DIR: check every file of a folder reshard wrote against its manifest."""
    _debug["on"] |= debug
    _allow(allow_class)
    import reshard

    if quick:
        if b is not None or atol is not None or rtol is not None or keymap is not None or only is not None:
            raise UsageError("verify --quick checks one folder against its manifest: reshard verify --quick DIR")
        from reshard.verify import verify_manifest

        result = verify_manifest(a)
    elif b is None:
        raise UsageError("verify needs two checkpoints: reshard verify A B (or one folder: reshard verify --quick DIR)")
    else:
        _check_memory(max_memory)
        result = reshard.verify(a, b, atol=atol, rtol=rtol, max_memory=max_memory, keymap=keymap, only=only,
                                storage_options=_store(storage_options),
                                progress=not (quiet or as_json))
    if as_json:
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
def push(
    folder: Annotated[Path, typer.Argument(metavar="FOLDER", help="HF model folder to upload (from `reshard convert SRC --to "
        "hf`).")],
    repo_id: Annotated[str, typer.Argument(metavar="REPO_ID", help="Hub model repo, owner/name; created if it does not exist.")],
    private: Annotated[bool, typer.Option("--private", help="Create the repo private.")] = False,
    revision: Annotated[Optional[str], typer.Option("--revision", help="Branch to push to (created if needed).")] = None,
    commit_message: Annotated[Optional[str], typer.Option("--commit-message", help="Message of the upload commit.")] = None,
    token: Annotated[Optional[str], typer.Option("--token", help="Hugging Face token (default: HF_TOKEN or `hf auth "
        "login`).")] = None,
    create_pr: Annotated[bool, typer.Option("--create-pr", help="Open a pull request instead of committing to the "
        "branch.")] = False,
    include: Annotated[Optional[list[str]], typer.Option("--include", help="Upload only files matching this glob "
        "(repeatable).")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option("--exclude", help="Do not upload files matching this glob "
        "(repeatable).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the folder and list what would be sent; no network.")] = False,
    no_architecture_check: Annotated[bool, typer.Option("--no-architecture-check", help="Push even if the weights are not the "
        "model config.json describes.")] = False,
    as_json: AsJson = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Check an HF model folder (index, headers, tied weights, config.json, the architecture) and upload it to the Hub."""
    _debug["on"] |= debug
    from reshard.hub import push as push_folder
    from reshard.sizes import format_size, plural

    result = push_folder(folder, repo_id, private=private, revision=revision, commit_message=commit_message,
                         dry_run=dry_run, token=token, create_pr=create_pr, include=include, exclude=exclude,
                         architecture_check=not no_architecture_check)
    if as_json:
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


ModelPreset = Annotated[str, typer.Option("--config", help="Model config preset: tiny, small or 100m.")]
GlobalBatch = Annotated[int, typer.Option("--global-batch", help="Samples per step over all ranks (divisible by the rank "
    "count).")]
TrainDevice = Annotated[str, typer.Option("--device", help="auto (GPUs with NCCL when each rank has one), cpu or cuda.")]


@app.command(cls=_Command, epilog=_examples(
    ("spawns 2 gloo ranks on CPU", "reshard train --to-mesh 2 --steps 4 --ckpt-dir runs/a"),
    ("continue on 3 ranks", "reshard train --to-mesh 3 --steps 8 --resume runs/a --ckpt-dir runs/a"),
    ("", "torchrun --nproc_per_node 8 -m reshard train --to-mesh 2x4 --config 100m")))
def train(
    mesh: Annotated[Optional[str], typer.Option("--to-mesh", help="Data-parallel mesh to train on: N (FSDP), RxS or "
        "dp_replicate=R,dp_shard=S (HSDP).")] = None,
    nproc: Annotated[Optional[int], typer.Option("--nproc", help="Ranks to spawn (default: the mesh's size); leave out under "
        "torchrun.")] = None,
    steps: Annotated[int, typer.Option("--steps", help="Train until this step (a resumed run continues from its checkpoint's "
        "step).")] = 10,
    ckpt_dir: Annotated[Optional[Path], typer.Option("--ckpt-dir", help="Save DCP checkpoints here as step-N/.")] = None,
    save_every: Annotated[int, typer.Option("--save-every", help="Save every K steps (and at the last step); 0: last step "
        "only.")] = 0,
    resume: Annotated[Optional[Path], typer.Option("--resume", help="Checkpoint to resume from, in any format and from any mesh "
        "(or a --ckpt-dir: its latest step).")] = None,
    config: ModelPreset = "tiny",
    tie_embeddings: Annotated[bool, typer.Option("--tie-embeddings", help="Share the embedding with the output "
        "projection.")] = False,
    global_batch: GlobalBatch = 12,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (linear warmup, then cosine).")] = 3e-3,
    warmup: Annotated[int, typer.Option("--warmup", help="Warmup steps.")] = 2,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the initial weights and the synthetic data.")] = 0,
    mixed_precision: Annotated[bool, typer.Option("--mixed-precision", help="bf16 parameters in compute, fp32 gradient "
        "reduction.")] = False,
    keymap: Annotated[Optional[str], typer.Option("--keymap", help="Rename the --resume checkpoint's tensors first, e.g. "
        "hf-to-titan.")] = None,
    device: TrainDevice = "auto",
    as_json: AsJson = False,
    quiet: Quiet = False,
    debug: Debug = False,
    former_mesh: Annotated[Optional[str], typer.Option("--mesh", hidden=True)] = None,  # --to-mesh's former name
) -> None:
    """Train the project's Llama-style model with FSDP2 on synthetic data (spawns --nproc ranks, or runs under torchrun)."""
    _debug["on"] |= debug
    if mesh is not None and former_mesh is not None and mesh != former_mesh:
        raise UsageError(f"--to-mesh {mesh} and --mesh {former_mesh} disagree; --mesh is --to-mesh's former name")
    mesh = mesh or former_mesh
    if mesh is None:
        raise UsageError("train needs --to-mesh: the mesh to train on (N, RxS or dp_replicate=R,dp_shard=S)")
    from reshard.train.launch import launch
    from reshard.train.loop import TrainConfig

    cfg = TrainConfig(mesh=mesh, model=config, tie_embeddings=tie_embeddings, steps=steps, global_batch=global_batch,
                      lr=lr, warmup=warmup, seed=seed, mixed_precision=mixed_precision,
                      ckpt_dir=str(ckpt_dir) if ckpt_dir else None, save_every=save_every,
                      resume=str(resume) if resume else None, keymap=keymap, log=not (quiet or as_json))
    result = launch(cfg, nproc, device=device)
    if os.environ.get("RANK", "0") != "0":
        return
    if as_json:
        _emit_json("train", result.to_json())
    elif result.losses and not quiet:
        last = max(result.losses)
        _say(f"trained steps {result.start_step + 1}..{result.end_step}; loss {result.losses[last]:.6f} at step {last}")


@app.command(cls=_Command, epilog=_examples(
    ("every path, bit-exact and resumed", "reshard validate --from-mesh 2 --to-mesh 3"),
    ("", "reshard validate --from-mesh 1x2 --to-mesh 4 --via dcp,safetensors --json")))
def validate(
    from_mesh: Annotated[str, typer.Option("--from-mesh", help="Mesh the checkpoint is trained and saved on.")],
    to_mesh: Annotated[str, typer.Option("--to-mesh", help="Mesh every converted checkpoint is resumed on.")],
    steps: Annotated[int, typer.Option("--steps", help="Steps before the checkpoint, and again after resuming.")] = 3,
    via: Annotated[str, typer.Option("--via", help="Conversion paths, comma-separated: "
        "dcp,safetensors,torch,zarr.")] = "dcp,safetensors,torch,zarr",
    config: ModelPreset = "tiny",
    global_batch: GlobalBatch = 12,
    rtol: Annotated[float, typer.Option("--rtol", help="Largest relative loss difference after resume that still "
        "matches.")] = 1e-4,
    workdir: Annotated[Optional[Path], typer.Option("--workdir", help="Keep the checkpoints and conversions here (default: a "
        "temp dir).")] = None,
    device: TrainDevice = "auto",
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
    if as_json:
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
    _debug["on"] = os.environ.get("RESHARD_DEBUG") == "1"  # per call: main() may run many times in one process
    try:
        with speaking_cli(), to_stderr(logging.DEBUG if _debug["on"] else logging.INFO):
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
    finally:
        while _allowed_by_options:
            _allowed_by_options.pop().close()


def _error(e: BaseException, line: str, *, trace: bool = True) -> int:
    """Say ``line`` (after the traceback, with --debug) and exit 2. On a rank other than 0 of a
    torchrun job, an error rank 0 says too (a usage error, one the ranks shared) is not said
    again: once per job, not once per rank."""
    from reshard.parallel import said_by_rank_0

    if said_by_rank_0(e) and not _debug["on"]:
        return 2
    if trace and _debug["on"]:
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
    from reshard.gc_pause import freeze_on_resume

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
