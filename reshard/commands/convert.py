"""``reshard.convert``: any checkpoint to any format, streamed, written atomically."""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from reshard.core.catalog import Catalog, pick_objects
from reshard.core.conventions import Layout, detect_layout, layout_notices
from reshard.core.dtypes import parse_dtype
from reshard.core.errors import OutputExistsError, ReshardError, SourceChangedError, UsageError, option
from reshard.core.fd_pool import FdPool
from reshard.core.gc_pause import paused_gc
from reshard.core.log import log_notices
from reshard.core.pieces import OutputFile
from reshard.core.sharding import MeshSpec, parse_mesh
from reshard.core.sizes import format_size, preview
from reshard.core.storage import RemotePath, is_url
from reshard.core.target import Target
from reshard.features.hf_options import MERGE_LORA
from reshard.features.provenance import carried_notice, carry_hf_configs
from reshard.features.quantize.options import QUANTIZE
from reshard.formats.options import ConvertOptions
from reshard.formats.registry import (
    all_suffixes,
    declared_options,
    format_entry,
    format_for_destination,
    format_options,
    get_format,
    load_target,
    mesh_writer,
    remote_writes,
    shown_name,
    taking,
)
from reshard.pipeline.engine import Engine, EngineStats
from reshard.pipeline.mesh_report import mesh_summary
from reshard.pipeline.mesh_target import mesh_target
from reshard.pipeline.parallel import Workers, current_workers, mark_shared, split_files, world
from reshard.pipeline.placements import load_placement_plan
from reshard.pipeline.plan import DtypeKeep, Plan, full_target, make_plan, model_section
from reshard.pipeline.protocol import Writer
from reshard.pipeline.sinks import FolderSink, OutputSink, RemoteSink, StagedSink
from reshard.pipeline.staging import refuse_taken
from reshard.sources.reading import given_config, given_layout, local_path, resolve_source

__all__ = ["ConvertResult", "convert", "build_target", "write_output", "default_destination", "source_files"]


@dataclass
class ConvertResult:
    """What ``reshard.convert`` wrote (or, with ``dry_run``, would write): the output, its
    format, how many tensors and bytes of tensor data, how long it took, how many bytes moved
    as stored runs (kernel copies, or a worker's bounded buffer), and what the user should know
    (``notices``: dropped per-rank state, objects a format cannot hold...). ``files`` lists the
    output's data files and sizes; ``ranks``, for a mesh, each target rank's bytes. ``src`` and
    ``dst`` are paths, or the URL strings of remote stores."""

    src: Path | str
    dst: Path | str
    format: str
    tensors: int
    bytes: int
    seconds: float
    kernel_bytes: int = 0
    notices: list[str] = field(default_factory=list)
    dry_run: bool = False
    files: list[tuple[str, int]] = field(default_factory=list)
    ranks: dict[str, Any] | None = None

    def __repr__(self) -> str:
        """One screen, whatever the checkpoint's size: counts and the first few files and notices."""
        return (f"ConvertResult({str(self.src)!r} -> {str(self.dst)!r}, format={self.format!r}, {self.tensors} tensors, "
                f"{format_size(self.bytes)} in {self.seconds:.2f}s{', dry run' if self.dry_run else ''}, "
                f"files={preview([p for p, _ in self.files])}, notices={preview(self.notices, 2)})")

    def to_json(self) -> dict[str, Any]:
        return {"src": str(self.src), "dst": str(self.dst), "format": self.format, "tensors": self.tensors,
                "bytes": self.bytes, "seconds": round(self.seconds, 3), "kernel_bytes": self.kernel_bytes,
                "notices": list(self.notices), "dry_run": self.dry_run,
                "files": [{"path": p, "bytes": n} for p, n in self.files], "target": self.ranks}


def default_destination(src: Path, to: str, *, sharded: bool = False, mesh_label: str | None = None,
                        dtype: str | None = None) -> Path:
    """A new path beside ``src`` named after what changes (``ckpt_4x8``, ``ckpt_bfloat16``,
    ``ckpt_3_torch``, ``ckpt.safetensors``, ``ckpt_hf``); never ``src`` itself, and two
    different conversions of one source never default to the same name. How each format's
    outputs are named is its registry entry's (one file, a folder suffix, a label)."""
    stem = src.name
    for suffix in all_suffixes():
        stem = stem.removesuffix(suffix)
    parts = [stem] + ([mesh_label] if mesh_label else []) + ([dtype] if dtype else [])
    entry = format_entry(to)
    if entry.file_output and mesh_label is None and not sharded:
        name = "_".join(parts) + entry.default_suffix
    elif entry.folder_suffix:
        name = "_".join(parts) + entry.folder_suffix
    elif entry.default and len(parts) > 1:
        name = "_".join(parts)
    else:  # a folder: say which format when nothing else does, and never collide with the default format's
        name = "_".join(parts + [entry.label or entry.name])
    dst = src.with_name(name)
    if dst.resolve() == src.resolve():
        dst = dst.with_name(f"{stem}_converted{dst.suffix}")
    return dst


def source_files(catalog: Catalog) -> dict[Path, tuple[int, int]]:
    """(size, mtime) of every file tensor bytes come from, to detect a source changing under us.
    Chunks name their file (``path``) without being located or read."""
    out = {}
    for t in catalog.tensors.values():
        for path in t.source_paths():
            if path not in out:
                st = os.stat(path)
                out[path] = (st.st_size, st.st_mtime_ns)
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
    options: ConvertOptions | None = None,
    **given: Any,
) -> ConvertResult:
    """Convert checkpoint ``src`` into ``dst`` (format ``to``, or guessed from ``dst``).

    The options are what ``ConvertOptions`` takes (its fields, and the output options the
    formats declare: ``compress``, ``quantize``...), given as keyword arguments or as one value
    (``options=``, with keyword arguments overriding its fields).

    Lossless unless asked otherwise: names, dtypes and every bit of every tensor are kept;
    objects travel where the target can hold them (``ConvertResult.notices`` says what
    could not). With ``to_mesh`` (``"8"``, ``"4x8"``, ``"dp_shard=4,tp=2"``) the output is laid
    out for that device mesh: each tensor stored as the target ranks' shards under
    ``placements`` (``fsdp``, ``hsdp``, ``fsdp+tp`` or a PLAN.json). Peak memory is bounded
    by ``max_memory``, not by the checkpoint size. The output appears atomically;
    ``fsync=True`` also makes it durable against power loss. Within a process group the ranks
    share the work and write one output.

    >>> reshard.convert("ckpt/", "model.safetensors", only="model", dtype="bfloat16")
    >>> reshard.convert("ckpt/", to="dcp", to_mesh="4x8")  # writes ckpt_4x8/ beside ckpt/
    >>> reshard.convert("ckpt/", to="hf", dtype="bfloat16")  # ckpt_hf/, for from_pretrained

    ``keymap`` (a preset such as ``hf-to-titan`` or a JSON map) renames tensors on the way; a
    SRC that is not a local path but an ``owner/name`` Hub repo id is downloaded first.
    ``only="model"`` keeps the model's tensors (into a torch or safetensors file under their
    own FQNs, so ``model.load_state_dict`` takes them); ``exclude`` drops tensors and objects
    whose names match any of the globs. ``layout`` overrides the detected layout convention
    (``reshard.core.conventions``: which names are parameters, optimizer state, per-rank state).
    ``config`` (a config.json, an HF folder or a Hub repo id) says what model the tensors are
    (head counts and family for key maps; the config.json of ``to="hf"``); ``hf_assets`` (a
    folder or repo id) gives an HF export its tokenizer, chat template and generation config;
    ``weights_only`` writes an HF export's safetensors without any config. For serving, an
    HF export takes ``merge_lora`` (a PEFT LoRA adapter folder or repo id, merged while the
    weights stream: ``reshard.features.lora``), ``quantize="fp8"`` (block-scaled float8_e4m3fn weights:
    ``reshard.features.quantize``) and ``keep_dtype`` (regexes of output names ``dtype`` leaves alone):

    >>> reshard.convert("base/", "served/", to="hf", merge_lora="adapter/", dtype="bfloat16",
    ...                 keep_dtype=["norm"], quantize="fp8")

    ``dry_run`` plans
    and checks everything a conversion would (names, placements, files, sizes per rank) and
    writes nothing.
    """
    start = time.perf_counter()
    opts = ConvertOptions.of(given, options)  # checked: the keyword arguments over ``options``'s fields
    # One descriptor per source file for the whole call: the readers that plan (a DCP record's
    # header, sniffed and parsed) and the engine that copies share it (reshard.core.fd_pool).
    reads = FdPool(os.O_RDONLY)
    try:
        with opts.allowing(), reads.lending():  # allow_classes: for this call only (objects may be read until it returns)
            return _convert(src, dst, opts, start, reads)
    finally:
        reads.close()


def _convert(src: str | os.PathLike, dst: str | os.PathLike | None, opts: ConvertOptions, start: float,
             reads: FdPool | None = None) -> ConvertResult:
    dst_path = local_path(dst) if dst is not None else None
    given_src = local_path(src)
    if dst_path is not None and not opts.dry_run:  # a taken name fails before anything is read
        _refuse_taken(dst_path, opts.overwrite, (given_src,) if given_src is not None and given_src.exists() else ())
    source = resolve_source(src, opts.source)
    remote_dst = str(dst) if dst is not None and dst_path is None else None  # an fsspec URL (reshard.pipeline.sinks)
    catalog = source.catalog
    before = source_files(catalog) if source.path is not None else {}
    # the files the source reads, beside its path: a shard an index names, a snapshot link's blob
    sources = (source.path, *before) if source.path is not None else ()
    if dst_path is not None and not opts.dry_run:
        _refuse_taken(dst_path, opts.overwrite, sources)
    to = opts.to
    if to is None:
        named_as = dst_path if dst_path is not None else Path(remote_dst.split("://", 1)[1]) if remote_dst else None
        to = format_for_destination(named_as if named_as is not None else Path(), shown=remote_dst)
    if remote_dst is not None:
        _refuse_overlap(src, remote_dst, opts.storage_options)
    with paused_gc():  # 100k+ tensors: entries, pieces and boxes by the hundred thousand, no cycles
        catalog, to, target, spec = build_target(catalog, to, opts)
    if remote_dst is not None and to not in remote_writes():
        entry = format_entry(to)
        what = entry.holds.removeprefix("a folder of ") if not entry.writes and entry.holds else to
        raise UsageError(f"{remote_dst}: reshard writes {', '.join(remote_writes())} to URLs, not {what}; "
                         "write a local DST and upload it")
    cast = str(parse_dtype(opts.dtype)).removeprefix("torch.") if opts.dtype is not None else None
    if dst_path is None and remote_dst is None:
        if source.beside is None:
            raise UsageError(f"{src}: a remote source needs an explicit DST (a path or URL)")
        dst_path = default_destination(source.beside, to, sharded=opts.shard_bytes is not None,
                                       mesh_label=spec.label if spec else None, dtype=cast)
        if not opts.dry_run:
            _refuse_taken(dst_path, opts.overwrite, sources, named=False)
    out = dst_path if dst_path is not None else remote_dst
    assert out is not None  # the DST given, or its default
    check_output_options(Path(out), to, opts)
    writer = get_format(to).writer(out, opts.for_writer())
    with paused_gc():
        files = writer.layout(target)
        plan = make_plan(catalog, files)
    notices = target.notices + list(writer.notices(target))

    def result(seconds: float, kernel_bytes: int = 0, dry: bool = False, ranks: dict | None = None) -> ConvertResult:
        if world()[0] == 0:  # the same notices on every rank of a torchrun job: said once
            log_notices(notices)
        return ConvertResult(src=source.location, dst=out, format=to, tensors=len(target.tensors), bytes=plan.total_bytes,
                             seconds=seconds, kernel_bytes=kernel_bytes, notices=notices, dry_run=dry,
                             files=[(f.relpath or Path(str(out)).name, f.size) for f in files], ranks=ranks)

    if opts.dry_run:
        ranks = mesh_summary(target, detect_layout(catalog)) if target.mesh is not None else None
        return result(time.perf_counter() - start, dry=True, ranks=ranks)
    sink: OutputSink
    if remote_dst is not None:  # object stores have no rename: data first, the file that makes a checkpoint last
        if world()[1] > 1:
            raise UsageError(f"{remote_dst}: a URL output is written by one process; run it without torchrun")
        sink = RemoteSink(remote_dst, opts.storage_options, is_dir=writer.output_is_dir, overwrite=opts.overwrite,
                          marker=getattr(writer, "marker", None))
    else:
        assert dst_path is not None  # not a URL: a local DST
        sink = StagedSink(dst_path, is_dir=writer.output_is_dir, overwrite=opts.overwrite, sources=sources, fsync=opts.fsync,
                          check=lambda: _check_unchanged(before))
    shown = Path(str(out)).name
    stats = write_output(plan, writer, target, files, sink, current_workers() if remote_dst is None else None, opts,
                         desc=f"{source.label} → {shown}", reads=reads)
    return result(time.perf_counter() - start, stats.kernel_bytes)


def _refuse_taken(dst: Path, overwrite: bool, sources: tuple[Path, ...], *, named: bool = True) -> None:
    """``staging.refuse_taken`` before the work; an output the user did not name (the default
    beside the source) replaces only a folder reshard wrote, never a file there, which may be
    the user's. In a torchrun job rank 0 decides (the ranks may see the shared folder at
    different moments) and every rank raises its answer before any has written, which rank 0
    alone prints."""
    workers = current_workers()
    refused: ReshardError | None = None
    if workers is None or workers.rank == 0:
        try:
            refuse_taken(dst, overwrite, sources)
            if overwrite and not named and (dst.is_symlink() or (dst.exists() and not dst.is_dir())):
                raise OutputExistsError(f"{dst}: the default output name is taken by a file, which --overwrite replaces "
                                        "only when you name it: give it as DST to replace it")
        except (OutputExistsError, UsageError) as e:
            refused = e
    if workers is not None:
        refused = workers.share(refused)
    if refused is not None:
        raise mark_shared(refused) from None


def _refuse_overlap(src: str | os.PathLike, url: str, storage_options: dict | None) -> None:
    """A URL output that is, holds or sits inside a URL source would delete the source's files
    before they are read (there is no staging to write into first): refused, as a local DST
    inside its SRC is."""
    if not is_url(str(src)) or str(src).startswith("file://"):
        return
    a, b = RemotePath.from_url(str(src), storage_options), RemotePath.from_url(url, storage_options)
    if a.protocol == b.protocol and (a.is_relative_to(b) or b.is_relative_to(a)):
        raise UsageError(f"{url}: the output would overwrite or sit inside the source {src}; pick another URL")


def check_output_options(dst: Path, to: str, opts: ConvertOptions) -> None:
    """Refuse what only DST shows to be a surprise: a sharded output named as one file. (Options
    its format does not take were refused by ``build_target`` before anything was read; what
    needs no output, when the options were built: ``ConvertOptions``.)"""
    entry = format_entry(to)
    if opts.shard_bytes is not None and entry.file_output and dst.suffix in entry.suffixes:
        raise UsageError(f"{dst}: a sharded {to} output is a folder (shards + index); give DST without "
                         f"{dst.suffix}, e.g. {dst.with_suffix('')}")


def _refuse_options_not_taken(to: str, opts: ConvertOptions, names: list[str]) -> None:
    """An output option given for a format whose writer does not take it: refused, naming the
    formats that take it (their registry entries say so)."""
    fmt = shown_name(to)
    for name in names:
        if name not in format_options(fmt):
            *rest, last = taking(name)
            formats = f"{', '.join(rest)} and {last}" if rest else last
            raise UsageError(f"{declared_options()[name].named} applies to {formats} outputs, not {fmt}")


def excluded(catalog: Catalog, globs: str | Sequence[str] | None) -> Catalog:
    """``catalog`` without the tensors and objects whose names match any of ``globs``."""
    patterns = [globs] if isinstance(globs, str) else list(globs or [])
    if not patterns:
        return catalog
    gone = [n for n in (*catalog.tensors, *catalog.objects) if any(fnmatch.fnmatchcase(n, g) for g in patterns)]
    if not gone:
        raise UsageError(f"{option('--exclude ' + ' '.join(patterns), f'exclude={patterns!r}')} matches nothing in "
                         f"{catalog.path}; try `reshard inspect` for names")
    drop = set(gone)
    return replace(catalog, tensors={n: t for n, t in catalog.tensors.items() if n not in drop},
                   objects=pick_objects(catalog.objects, [n for n in catalog.objects if n not in drop]),
                   paths={n: p for n, p in catalog.paths.items() if n not in drop})


def build_target(catalog: Catalog, to: str, opts: ConvertOptions) -> tuple[Catalog, str, Target, MeshSpec | None]:
    """What ``to`` will hold: the catalog renamed by ``keymap`` (and made what the output holds
    by its registry entry's ``prepare``: HF model tensors for ``hf``), the writer's format name,
    the target, and the mesh. Every check that can refuse the
    conversion runs here, before a byte is written; local and URL conversions share it."""
    mesh, placements, dtype, only, keymap = opts.to_mesh, opts.placements, opts.dtype, opts.only, opts.keymap
    layout, config = opts.layout, opts.config
    # Before anything is read for it (an HF export reads configs, adapters): options this output does not take.
    _refuse_options_not_taken(to, opts, opts.output_options_set())
    prepare = format_entry(to).prepare
    keep = DtypeKeep(opts.keep_dtype)
    catalog = given_layout(catalog, layout)
    # What the source's layout calls a parameter decides the output when anything but a plain
    # copy is asked for: then refuse an ambiguous one before anything else, and say which one
    # was used and why.
    decides = mesh is not None or dtype is not None or only is not None or keymap is not None or prepare is not None
    told = detect_layout(catalog) if decides else None  # the layout the notices name
    if told is not None:
        catalog = replace(catalog, notices=[*catalog.notices, *layout_notices(told)])
    catalog = given_config(catalog, config)  # what model these tensors are: key maps and the HF export read it
    catalog = excluded(catalog, opts.exclude)
    if dtype is not None or opts.value(MERGE_LORA) is not None or opts.value(QUANTIZE) is not None:
        # FP8 / MXFP4 weights: dequantized with their scales, never cast or computed on without them
        from reshard.features.dequantize import dequantized  # a feature's module only when asked (start-up)

        catalog = dequantized(catalog)
    if keymap is not None:  # lazily renamed entries; the source's real files are unchanged
        from reshard.features.keymap.lookup import load_keymap  # a feature's module only when asked (start-up)

        catalog = load_keymap(keymap).apply(catalog)
    if prepare is not None:  # what this output holds, by its own rules (the HF export: reshard.features.hf_export)
        catalog, keep = load_target(prepare)(catalog, opts, keep)
    else:  # an HF source's config.json travels as objects, for a later --to hf
        carried = carry_hf_configs(catalog)
        if carried and only is None:  # --only keeps a section, which these are not in
            catalog = replace(catalog, notices=[*catalog.notices, carried_notice(carried)])
    if keep.patterns and not any(keep(n) for n in catalog.tensors):
        raise UsageError(f"{option('--keep-dtype ' + ' '.join(keep.patterns), f'keep_dtype={list(keep.patterns)!r}')} "
                         f"matches no tensor of the output; try `reshard inspect` for names")
    spec = parse_mesh(mesh) if mesh is not None else None
    conventions = detect_layout(catalog, refuse_ambiguous=decides)
    if spec is None:
        one_file = format_entry(to).file_output
        if only is None and one_file and conventions.convention.one_file is not None:  # the tool's own one-file export
            only, said = conventions.convention.one_file
            catalog = replace(catalog, notices=[*catalog.notices, said])
        if only == "model" and one_file:  # a file of the model's own state dict
            catalog, only = model_section(catalog, conventions), None
            conventions = detect_layout(catalog, "state-dict")
        return catalog, to, full_target(catalog, dtype=parse_dtype(dtype), only=only, layout=_as_told(conventions, told),
                                        keep=keep), None
    writes = mesh_writer(to)
    target = mesh_target(catalog, spec, load_placement_plan(placements, spec), dtype=parse_dtype(dtype),
                         only=only, keep_per_rank=opts.keep_per_rank, layout=_as_told(conventions, told), keep=keep)
    return catalog, writes, target, spec


def _as_told(layout: Layout, told: Layout | None) -> Layout:
    """``layout``, called in messages by the source's layout the user was told about: a model
    section or an HF export is a plain state dict of that checkpoint, not another layout."""
    return layout if told is None or told.name == layout.name else layout.labelled(told.label)


def write_output(plan: Plan, writer: Writer, target: Target, files: list[OutputFile], sink: OutputSink,
                 group: Workers | None, opts: ConvertOptions, *, desc: str, reads: FdPool | None = None) -> EngineStats:
    """Write ``files`` through ``sink`` and make them an output (or nothing). Under torchrun
    (``group``) each rank writes its share of the files into rank 0's staging folder, and rank
    0 alone opens the sink, finishes and commits; an error on any rank is raised on all.
    ``reads``: the source descriptors planning opened, for the engine to copy through."""
    rank = group.rank if group is not None else 0
    engine = Engine(opts.budget, workers=opts.workers, progress=not opts.quiet and rank == 0, desc=desc, fsync=opts.fsync,
                    reads=reads)
    if group is None:
        try:
            sink.open()
            stats = engine.run(plan, sink, digests=True)
            sink.commit(writer, target, files, stats.digests)
        finally:
            sink.abort()  # nothing left to undo once committed
        return stats
    assert isinstance(sink, StagedSink)  # a URL output is written by one process
    error: BaseException | None = None
    stats = EngineStats()
    try:
        if rank == 0:  # rank 0 owns the staging folder and the lock
            try:
                sink.open()
            except BaseException as e:  # noqa: BLE001 - re-raised on every rank by group.check
                error = e
        group.check(error)
        # Each rank hashes what it wrote, so rank 0 does not read every byte back alone.
        staging = Path(group.share(str(sink.root)))
        mine = sink if rank == 0 else FolderSink(staging, sink.is_dir, fsync=opts.fsync)
        try:
            stats = engine.run(plan.subset(split_files(files, group.world_size)[rank]), mine, digests=True)
        except BaseException as e:  # noqa: BLE001 - re-raised on every rank by group.check
            error = e
        group.check(error)
        known = {rel: d for part in group.gather(stats.digests) for rel, d in part.items()}
        if rank == 0:
            try:
                sink.commit(writer, target, files, known)
            except BaseException as e:  # noqa: BLE001 - re-raised on every rank by group.check
                error = e
        group.check(error)
    finally:
        if rank == 0:
            sink.abort()
    return stats
