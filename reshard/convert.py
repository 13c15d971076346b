"""``reshard.convert``: any checkpoint to any format, streamed, written atomically."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from reshard.catalog import Catalog, Target
from reshard.dtypes import parse_dtype
from reshard.engine import Engine, EngineStats
from reshard.errors import SourceChangedError, UsageError
from reshard.formats.base import Writer
from reshard.formats.pieces import FileLayout
from reshard.formats.registry import detect_format, format_for_destination, get_format
from reshard.formats.zarr_store import is_url
from reshard.layout import MeshSpec, parse_mesh
from reshard.mesh_target import mesh_target
from reshard.parallel import Workers, join_workers, split_files
from reshard.placements import load_placement_plan
from reshard.plan import Plan, full_target, make_plan
from reshard.regions import StoredRegion
from reshard.sizes import parse_size
from reshard.staging import StagedOutput

__all__ = ["ConvertResult", "convert", "build_target", "write_output", "default_destination", "source_files"]

_SUFFIX = {"safetensors": ".safetensors", "torch": ".pt", "zarr": ".zarr"}
# Formats that can hold a mesh layout, and the writer that does it.
_MESH_FORMATS = {"dcp": "dcp", "torch": "torch-ranks", "torch-ranks": "torch-ranks", "zarr": "zarr"}


@dataclass
class ConvertResult:
    src: Path
    dst: Path
    format: str
    tensors: int
    bytes: int
    seconds: float
    kernel_bytes: int = 0
    notices: list[str] = field(default_factory=list)


def default_destination(src: Path, to: str, *, sharded: bool = False, mesh_label: str | None = None) -> Path:
    """A new path beside ``src`` named after the target (``ckpt_4x8``); never ``src`` itself."""
    stem = src.name
    for suffix in (".safetensors", ".pt", ".pth", ".bin", ".zarr"):
        stem = stem.removesuffix(suffix)
    if mesh_label is not None:
        dst = src.with_name(f"{stem}_{mesh_label}" + (".zarr" if to == "zarr" else ""))
    else:
        suffix = "" if sharded else _SUFFIX.get(to, "")
        dst = src.with_name(f"{stem}{suffix}" if suffix else f"{stem}_{to}")
    if dst.resolve() == src.resolve():
        dst = dst.with_name(f"{stem}_converted{dst.suffix}")
    return dst


def source_files(catalog: Catalog) -> dict[Path, tuple[int, int]]:
    """(size, mtime) of every file tensor bytes come from, to detect a source changing under us."""
    out = {}
    for t in catalog.tensors.values():
        for c in t.chunks:
            if isinstance(c.data, StoredRegion) and c.data.path not in out:
                st = os.stat(c.data.path)
                out[c.data.path] = (st.st_size, st.st_mtime_ns)
    return out


def _check_unchanged(before: dict[Path, tuple[int, int]]) -> None:
    for path, (size, mtime) in before.items():
        st = os.stat(path)
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            raise SourceChangedError(f"{path}: changed while it was being converted; output discarded, rerun when it is stable")


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike | None = None,
    *,
    to: str | None = None,
    mesh: str | None = None,
    placements: str | None = None,
    dtype: str | torch.dtype | None = None,
    only: str | None = None,
    max_memory: str | int = "1GiB",
    max_shard_size: str | int | None = None,
    overwrite: bool = False,
    quiet: bool = False,
    workers: int | None = None,
    fsync: bool = False,
    keep_per_rank: bool = False,
    keymap: str | None = None,
    compress: bool = False,
) -> ConvertResult:
    """Convert checkpoint ``src`` into ``dst`` (format ``to``, or guessed from ``dst``).

    Lossless unless asked otherwise: names, dtypes and every bit of every tensor are kept;
    objects travel where the target can hold them (``ConvertResult.notices`` says what
    could not). With ``mesh`` (``"8"``, ``"4x8"``, ``"dp_shard=4,tp=2"``) the output is laid
    out for that device mesh: each tensor stored as the target ranks' shards under
    ``placements`` (``fsdp``, ``hsdp``, ``fsdp+tp`` or a PLAN.json). Peak memory is bounded
    by ``max_memory``, not by the checkpoint size. The output appears atomically;
    ``fsync=True`` also makes it durable against power loss. Under torchrun the ranks share
    the work and write one output.

    >>> reshard.convert("ckpt/", "model.safetensors", only="model", dtype="bfloat16")
    >>> reshard.convert("ckpt/", to="dcp", mesh="4x8")  # writes ckpt_4x8/ beside ckpt/
    >>> reshard.convert("ckpt/", to="hf", dtype="bfloat16")  # ckpt_hf/, for from_pretrained

    ``keymap`` (a preset such as ``hf-to-titan`` or a JSON map) renames tensors on the way; a
    SRC that is not a local path but an ``owner/name`` Hub repo id is downloaded first.
    """
    start = time.perf_counter()
    if is_url(src) or is_url(dst):  # zarr stores behind fsspec URLs: no local staging (zarr_remote)
        from reshard.formats.zarr_remote import convert_url

        return convert_url(src, dst, to=to, mesh=mesh, placements=placements, dtype=dtype, only=only,
                           max_memory=max_memory, overwrite=overwrite, quiet=quiet, compress=compress,
                           keep_per_rank=keep_per_rank, keymap=keymap, max_shard_size=max_shard_size)
    src = Path(src)
    from reshard.hub import hub_source

    src, beside = hub_source(src)  # a Hub repo id: its cached snapshot; outputs go to the cwd
    budget = parse_size(max_memory)
    shard_size = parse_size(max_shard_size) if max_shard_size is not None else None
    fmt = detect_format(src)
    catalog = fmt.read(src)
    before = source_files(catalog)
    if to is None:
        to = format_for_destination(Path(dst)) if dst is not None else "dcp"
    catalog, to, target, spec = build_target(catalog, to, mesh=mesh, placements=placements, dtype=dtype, only=only,
                                             keep_per_rank=keep_per_rank, keymap=keymap, budget=budget)
    out_fmt = get_format(to)
    dst = Path(dst) if dst is not None else default_destination(
        beside, to, sharded=shard_size is not None, mesh_label=spec.label if spec else None)
    if compress and to != "zarr":
        raise UsageError("--compress applies to zarr output only (--to zarr)")
    writer = out_fmt.writer(dst, max_shard_size=shard_size, **({"compress": True} if compress else {}))
    files = writer.layout(target)
    plan = make_plan(catalog, files)
    group = join_workers()
    try:
        stats = write_output(plan, writer, target, files, dst, before, group, sources=(src,), label=src.name,
                             budget=budget, workers=workers, progress=not quiet, overwrite=overwrite, fsync=fsync)
    finally:
        if group is not None:
            group.close()
    return ConvertResult(
        src=src, dst=dst, format=to, tensors=len(target.tensors), bytes=plan.total_bytes,
        seconds=time.perf_counter() - start, kernel_bytes=stats.kernel_bytes,
        notices=target.notices + list(writer.notices(target)),
    )


def build_target(catalog: Catalog, to: str, *, mesh: str | None, placements: str | None, dtype: str | None,
                 only: str | None, keep_per_rank: bool, keymap: str | None, budget: int,
                 ) -> tuple[Catalog, str, Target, MeshSpec | None]:
    """What ``to`` will hold: the catalog renamed by ``keymap`` (and cut to HF model tensors for
    ``hf``), the writer's format name, the target, and the mesh. Every check that can refuse the
    conversion runs here, before a byte is written; local and URL conversions share it."""
    if placements is not None and mesh is None:
        raise UsageError("--placements needs --to-mesh")
    if keymap is not None:  # lazily renamed entries; the source's real files are unchanged
        from reshard.keymap import load_keymap

        catalog = load_keymap(keymap).apply(catalog)
    if to == "hf":  # model tensors under HF names, with config.json (reshard.formats.hf)
        from reshard.formats.hf import export_catalog

        catalog = export_catalog(catalog, max_memory=budget)
    else:  # an HF source's config.json travels as objects, for a later --to hf
        from reshard.provenance import carry_hf_configs

        carry_hf_configs(catalog)
    spec = parse_mesh(mesh) if mesh is not None else None
    if spec is None:
        return catalog, to, full_target(catalog, dtype=parse_dtype(dtype), only=only), None
    if to not in _MESH_FORMATS:
        raise UsageError(f"--to {to} holds whole tensors; --to-mesh lays out dcp, torch (one file per rank) or zarr")
    target = mesh_target(catalog, spec, load_placement_plan(placements, spec), dtype=parse_dtype(dtype),
                         only=only, keep_per_rank=keep_per_rank)
    return catalog, _MESH_FORMATS[to], target, spec


def write_output(plan: Plan, writer: Writer, target: Target, files: list[FileLayout], dst: Path,
                 before: dict[Path, tuple[int, int]], group: Workers | None, *, sources: tuple[Path, ...], label: str,
                 budget: int, workers: int | None, progress: bool, overwrite: bool, fsync: bool) -> EngineStats:
    """Stage, write and commit a local output; under torchrun each rank writes its share of
    the files and rank 0 stages, finishes and commits. ``sources``: local paths DST must not
    overwrite; ``before``: their files' sizes and mtimes, checked again before the commit."""
    rank = group.rank if group is not None else 0
    engine = Engine(budget, workers=workers, progress=progress and rank == 0, desc=f"{label} → {dst.name}", fsync=fsync)
    staged = StagedOutput(dst, is_dir=writer.output_is_dir, overwrite=overwrite, sources=sources, fsync=fsync)
    # Files for the manifest are hashed as the engine finishes them (in the page cache, while
    # later files copy), unless the writer's finish rewrites them (zarr pads and compresses).
    hash_early = writer.output_is_dir and not getattr(writer, "finish_rewrites_data", False)
    if group is None:
        with staged as out:
            stats = engine.run(plan, out.staging, writer.output_is_dir, digests=hash_early)
            writer.finish(out.staging, target, files)
            _check_unchanged(before)
            out.commit(stats.digests)
        return stats
    error: BaseException | None = None
    stats, entered = EngineStats(), False
    try:
        if rank == 0:  # rank 0 owns the staging folder and the lock
            try:
                staged.__enter__()
                entered = True
            except BaseException as e:  # noqa: BLE001 - re-raised on every rank by group.check
                error = e
        group.check(error)
        staging = Path(group.share(str(staged.staging)))
        try:  # each rank hashes what it wrote, so rank 0 does not read every byte back alone
            stats = engine.run(plan.subset(split_files(files, group.world_size)[rank]), staging,
                               writer.output_is_dir, digests=hash_early)
        except BaseException as e:  # noqa: BLE001 - re-raised on every rank by group.check
            error = e
        group.check(error)
        known = {rel: d for part in group.gather(stats.digests) for rel, d in part.items()}
        if rank == 0:
            try:
                writer.finish(staging, target, files)
                _check_unchanged(before)
                staged.commit(known)
            except BaseException as e:  # noqa: BLE001 - re-raised on every rank by group.check
                error = e
        group.check(error)
    finally:
        if entered:
            staged.__exit__(None, None, None)
    return stats
