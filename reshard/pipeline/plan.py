"""Plans: which source bytes fill which target piece, decided before anything is written.

``full_target`` says what a whole-tensor output holds (names, dtypes, one box per tensor);
``make_plan`` pairs every piece of the writer's file layout with the source chunk boxes that
overlap it. The plan is a plain value: tests inspect it, ``reshard inspect`` can print it, and
the engine only executes it. Files of many small pieces whose bytes are stored runs are
planned in columns as well (``reshard.pipeline.byte_runs``: ``Plan.gathered``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace

import numpy as np

from reshard.core.boxes import Box, full_box
from reshard.core.catalog import (
    Catalog,
    Chunk,
    IndexedTensorEntry,
    NestedPath,
    ObjectTable,
    TensorEntry,
    object_loader,
    pick_objects,
)
from reshard.core.conventions import PARAM, Layout, detect_layout
from reshard.core.dtypes import DType
from reshard.core.errors import UsageError, option
from reshard.core.pieces import OutputFile, Piece, SegmentTable, segment_size
from reshard.core.sizes import plural
from reshard.core.storage import RemotePath
from reshard.core.target import Target, TargetTensor
from reshard.pipeline.byte_runs import Gathered, LayoutColumns, gather_plan

__all__ = ["Plan", "PieceSources", "Source", "Casting", "DtypeKeep", "full_target", "make_plan", "model_section", "select",
           "sources_for", "covered_elements"]


@dataclass(frozen=True)
class Source:
    """Part ``box`` (global coordinates) of a piece comes from ``chunk``."""

    chunk: Chunk
    box: Box


class PieceSources(Mapping[Piece, list[Source]]):
    """Each piece of a plan and the stored chunk parts it is made of, worked out when asked:
    held as lists for every piece of a checkpoint of 100k tensors on many ranks, they were
    hundreds of MiB. ``make_plan`` has checked every piece before this exists."""

    def __init__(self, tensors: Mapping[str, TensorEntry], pieces: Iterable[Piece] | Callable[[], Iterable[Piece]]) -> None:
        self._tensors = tensors
        self._given = pieces
        self._known: dict[Piece, None] | None = None
        self._listing = threading.Lock()  # the engine's workers may ask first at the same time

    @property
    def _pieces(self) -> dict[Piece, None]:
        """The plan's pieces, listed the first time something asks which they are (a layout
        in columns makes a ``Piece`` per segment only then)."""
        if self._known is None:
            with self._listing:
                if self._known is None:
                    self._known = dict.fromkeys(self._given() if callable(self._given) else self._given)
        return self._known

    def __getitem__(self, piece: Piece) -> list[Source]:
        if piece not in self._pieces:
            raise KeyError(piece)
        return sources_for(self._tensors[piece.name], piece.box)

    def __iter__(self) -> Iterator[Piece]:
        return iter(self._pieces)

    def __len__(self) -> int:
        return len(self._pieces)

    def __contains__(self, piece: object) -> bool:
        return piece in self._pieces

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The global shape of tensor ``name``."""
        return self._tensors[name].shape

    def subset(self, pieces: Iterable[Piece]) -> PieceSources:
        return PieceSources(self._tensors, (p for p in pieces if p in self._pieces))

    def largest_decoded_chunk(self) -> int:
        """Bytes of the largest source chunk these pieces read that is decoded whole
        (compressed zarr), 0 when none is."""
        return max((_decoded_bytes(s) for piece in self for s in self[piece]), default=0)


def _decoded_bytes(source: Source) -> int:
    return getattr(source.chunk.data, "decoded_bytes", 0)


@dataclass
class Plan:
    files: list[OutputFile]
    sources: PieceSources
    decoded_chunk_bytes: int = 0  # the largest source chunk decoded whole (compressed zarr), 0 if none
    remote: bool = False  # the sources are read from an object store (request latency, not CPU, bounds a worker)
    # Files of many small pieces as runs of bytes, written a window at a time (``reshard.pipeline.gather``);
    # their pieces are left out of ``pieces(gathered=False)``.
    gathered: Gathered | None = None

    @property
    def total_bytes(self) -> int:
        return sum(_piece_bytes(f) for f in self.files)

    def subset(self, indices: list[int]) -> Plan:
        """The plan for some of the files only (one rank's share under torchrun)."""
        files = [self.files[i] for i in indices]
        sources = self.sources.subset(seg for f in files for seg in f.segments if isinstance(seg, Piece))
        gathered = self.gathered.subset({f.relpath for f in files}) if self.gathered is not None else None
        return Plan(files, sources, sources.largest_decoded_chunk() if self.decoded_chunk_bytes else 0, self.remote,
                    gathered)

    def pieces(self, gathered: bool = True) -> Iterable[tuple[OutputFile, int, Piece]]:
        """(file, byte offset in file, piece) for every piece, in file order; with
        ``gathered=False``, only those ``gathered`` does not write."""
        for f in self.files:
            skip = self.gathered.segments.get(f.relpath) if self.gathered is not None and not gathered else None
            if isinstance(f.segments, SegmentTable):
                keep = f.segments.kind < 0
                if skip is not None:
                    keep[skip] = False
                offsets = f.segments.offsets()
                for k in np.flatnonzero(keep).tolist():
                    yield f, int(offsets[k]), f.segments[k]
                continue
            left = None if skip is None else set(skip.tolist())
            for k, (off, seg) in enumerate(zip(f.offsets(), f.segments)):
                if isinstance(seg, Piece) and (left is None or k not in left):
                    yield f, off, seg


def _piece_bytes(f: OutputFile) -> int:
    if isinstance(f.segments, SegmentTable):
        return int(f.segments.sizes[f.segments.kind < 0].sum())
    return sum(segment_size(s) for s in f.segments if isinstance(s, Piece))


def select(catalog: Catalog, only: str | None, layout: Layout | None = None) -> tuple[list[str], list[str]]:
    """Tensor and object names kept by ``--only model|optim|PREFIX`` (the model and the
    optimizer found by the checkpoint's layout, whatever its tool calls their sections)."""
    tensors, objects = list(catalog.tensors), list(catalog.objects)
    if only:
        layout = layout or detect_layout(catalog)
        tensors = [n for n in tensors if layout.in_section(n, only)]
        objects = [n for n in objects if layout.in_section(n, only)]
        if not tensors and not objects:
            raise UsageError(f"{option(f'--only {only!r}', f'only={only!r}')} matches nothing in {catalog.path} "
                             f"(layout {layout.name}); try `reshard inspect` for names")
    return tensors, objects


class DtypeKeep:
    """Tensors ``--dtype`` leaves in their own dtype: those whose output name matches a
    ``--keep-dtype`` regex (``re.search``), and ``fixed`` names whose dtype is decided already
    (FP8 values and their scales, ``reshard.features.quantize``)."""

    def __init__(self, patterns: str | list[str] | tuple[str, ...] | None = None, fixed: Iterable[str] = ()) -> None:
        self.patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns or ())
        try:
            self._compiled = [re.compile(p) for p in self.patterns]
        except re.error as e:
            raise UsageError(f"{option('--keep-dtype', 'keep_dtype=')} {e.pattern!r} is not a regular expression: {e}") from None
        self.fixed = frozenset(fixed)
        self.kept: list[str] = []  # names --keep-dtype kept from a cast, in order

    def __call__(self, name: str) -> bool:
        """Whether ``--keep-dtype`` names ``name``."""
        return any(p.search(name) for p in self._compiled)

    def notice(self) -> list[str]:
        if not self.kept:
            return []
        shown = ", ".join(self.kept[:5]) + (f" and {len(self.kept) - 5} more" if len(self.kept) > 5 else "")
        return [f"kept {len(self.kept)} tensors in their source dtype ({option('--keep-dtype', 'keep_dtype=')} "
                f"{' '.join(self.patterns)}): {shown}"]


class Casting:
    """``--dtype`` for one catalog: parameters and their moments (the optimizer tensors shaped
    like their parameter) are cast; every other optimizer value (``step``, NAdam's
    ``mu_product`` whatever its shape), integer tensors and non-model state are not, nor what
    ``keep`` names."""

    def __init__(self, catalog: Catalog, to: DType | None, layout: Layout, keep: DtypeKeep | None = None) -> None:
        self.to, self.layout, self.keep = to, layout, keep
        self.param_shapes = layout.param_shapes(catalog.tensors) if to is not None else {}
        self.cast: dict[str, int] = {}  # role -> tensors cast
        self.kept: dict[str, int] = {}  # role -> floating tensors left in their dtype
        self.kept_names: list[str] = []

    def dtype(self, name: str, entry: TensorEntry) -> DType:
        if self.to is None or not entry.dtype.is_floating_point:
            return entry.dtype
        if self.keep is not None and (name in self.keep.fixed or self.keep(name)):
            if name not in self.keep.fixed and entry.dtype != self.to:
                self.keep.kept.append(name)
            return entry.dtype
        casts = self.layout.casts(name, entry.shape, self.param_shapes)
        tally = self.cast if casts else self.kept
        role = self.layout.role(name)
        tally[role] = tally.get(role, 0) + 1
        if not casts:
            self.kept_names.append(name)
        return self.to if casts else entry.dtype

    def notice(self) -> list[str]:
        """What ``--dtype`` cast and which floating tensors it left alone, by role, naming the
        first few left (steps last: everyone expects those)."""
        if self.to is None:
            return []

        def words(tally: dict[str, int]) -> str:
            return ", ".join(plural(k, _ROLE_WORDS.get(r, r)) for r, k in tally.items()) or "nothing"

        to = str(self.to).removeprefix("torch.")
        line = f"cast to {to} under layout {self.layout.label}: {words(self.cast)}"
        keep = self.keep.notice() if self.keep else []
        if not self.kept:
            return [line, *keep]
        names = sorted(self.kept_names, key=lambda n: self.layout.place(n).key == "step")
        more = len(names) - _NAMED
        named = ", ".join(names[:_NAMED]) + (f" and {more} more" if more > 0 else "")
        return [f"{line}; kept as saved: {words(self.kept)} ({named}; optimizer steps, optimizer values not shaped "
                "like their parameter, state that is neither model nor optimizer)", *keep]


_NAMED = 3  # tensors a --dtype notice names of those it left as saved


# Nouns, counted with plural(): a model tensor may be a buffer, so never "parameters".
_ROLE_WORDS = {"param": "model tensor", "optim_state": "optimizer tensor", "optim_group": "optimizer hyper-parameter",
               "per_rank": "per-rank tensor", "other": "other tensor"}


def full_target(catalog: Catalog, *, dtype: DType | None = None, only: str | None = None,
                layout: Layout | None = None, keep: DtypeKeep | None = None) -> Target:
    """Every selected tensor stored whole, in one box, in the file of rank 0; ``keep``: what
    ``dtype`` leaves alone."""
    layout = layout or detect_layout(catalog)
    tensors, objects = select(catalog, only, layout)
    casting = Casting(catalog, dtype, layout, keep)
    out = {}
    for name in tensors:
        t = catalog.tensors[name]
        out[name] = TargetTensor(name, t.shape, casting.dtype(name, t), [full_box(t.shape)], [0])
    return Target(
        tensors=out,
        objects=pick_objects(catalog.objects, objects),
        paths={n: p for n, p in catalog.paths.items() if n in out or n in objects},
        facts=catalog.facts.copy(),
        notices=[*catalog.notices, *casting.notice()],
        renamed_from={n: s for n, s in catalog.renamed_from.items() if n in out},
    )


def model_section(catalog: Catalog, layout: Layout) -> Catalog:
    """The model's own state dict out of a training checkpoint: every parameter under its FQN
    (``model.`` or whatever section prefix the tool used dropped), nothing else; for ``--only
    model`` into a file that ``model.load_state_dict`` should take as it is."""
    names = {n: p for n in (*catalog.tensors, *catalog.objects) if (p := layout.place(n)).role == PARAM and p.fqn}
    if not names:
        asked = option("--only model", "only='model'")
        raise UsageError(f"{asked}: {catalog.path} holds no model tensors (layout {layout.name})")
    heads = {catalog.nested_path(n)[0] for n, p in names.items() if p.prefix}
    fqn = {n: p.fqn for n, p in names.items() if p.fqn}  # every name's (names holds those with one)

    def path(name: str) -> NestedPath:
        nested = catalog.nested_path(name)
        if names[name].prefix and len(nested) > 1 and nested[0] in heads:
            return nested[1:]
        return (fqn[name],) if names[name].prefix else nested

    tensors = {fqn[n]: catalog.tensors[n].renamed(fqn[n]) for n in names if n in catalog.tensors}
    objects = ObjectTable({fqn[n]: object_loader(catalog.objects, n) for n in names if n in catalog.objects})
    paths = {fqn[n]: path(n) for n in names if n in catalog.paths}
    containers = {k[1:]: v for k, v in (catalog.facts.containers or {}).items() if k[:1] and k[0] in heads}
    facts = catalog.facts.but(containers=containers) if heads else catalog.facts.copy()
    facts.layout = None  # the section is the whole checkpoint now
    return replace(catalog, tensors=tensors, objects=objects, paths=paths, facts=facts)


def sources_for(entry: TensorEntry, box: Box) -> list[Source]:
    """The stored chunks of ``entry`` that overlap ``box``, with the overlapping part. A tensor
    saved by many ranks is searched in its columns (one array operation, not a loop over
    every chunk for every piece of the output)."""
    if isinstance(entry, IndexedTensorEntry) and entry.chunk_count > 16:
        offsets, sizes = entry.columns
        lo = np.maximum(offsets, np.asarray(box.offsets, dtype=np.int64))
        hi = np.minimum(offsets + sizes, np.asarray(box.ends, dtype=np.int64))
        hits = np.flatnonzero((hi > lo).all(axis=1)) if box.ndim else np.arange(len(offsets))
        return [Source(entry.chunk(i), Box(tuple(o), tuple(z)))
                for i, o, z in zip(hits.tolist(), lo[hits].tolist(), (hi - lo)[hits].tolist())]
    out = []
    for chunk in entry.chunks:
        part = chunk.box.intersect(box)
        if part is not None:
            out.append(Source(chunk, part))
    return out


def covered_elements(entry: TensorEntry, box: Box) -> int:
    """How many elements of ``box`` the stored chunks of ``entry`` hold (``box.numel`` when
    they cover it: chunks do not overlap), from the chunks' boxes alone: no chunk is built."""
    offsets, sizes = entry.columns
    lo = np.maximum(offsets, np.asarray(box.offsets, dtype=np.int64))
    hi = np.minimum(offsets + sizes, np.asarray(box.ends, dtype=np.int64))
    return int(np.clip(hi - lo, 0, None).prod(axis=1).sum())


def make_plan(catalog: Catalog, files: list[OutputFile]) -> Plan:
    """The plan for the writer's ``files``, every piece checked to be covered by stored chunks
    before anything is written. Pieces ``byte_runs`` gathers are checked by their pattern;
    the others one by one, in file order."""
    gathered = gather_plan(catalog, files, LayoutColumns.of_files(files))
    plan = Plan(files, PieceSources(catalog.tensors, lambda: (p for _, _, p in plan.pieces())), 0,
                isinstance(catalog.path, RemotePath), gathered)
    decoded = 0  # found on the way, so the engine need not work out every piece's sources again
    for _, _, seg in plan.pieces(gathered=False):
        sources = sources_for(catalog.tensors[seg.name], seg.box)
        covered = sum(s.box.numel for s in sources)
        if covered != seg.box.numel:
            raise UsageError(f"{catalog.path}: {seg.name!r} box {seg.box} is only {covered}/{seg.box.numel} covered by stored "
                             f"chunks")
        decoded = max(decoded, max(map(_decoded_bytes, sources), default=0))
    plan.decoded_chunk_bytes = decoded
    return plan
