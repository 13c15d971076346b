"""Plans: which source bytes fill which target piece, decided before anything is written.

``full_target`` says what a whole-tensor output holds (names, dtypes, one box per tensor);
``make_plan`` pairs every piece of the writer's file layout with the source chunk boxes that
overlap it. The plan is a plain value: tests inspect it, ``reshard inspect`` can print it, and
the engine only executes it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from reshard.boxes import Box, full_box
from reshard.catalog import Catalog, Chunk, Target, TargetTensor, TensorEntry
from reshard.errors import UsageError
from reshard.formats.pieces import FileLayout, Piece

__all__ = ["Plan", "Source", "full_target", "make_plan", "select", "sources_for"]


@dataclass(frozen=True)
class Source:
    """Part ``box`` (global coordinates) of a piece comes from ``chunk``."""

    chunk: Chunk
    box: Box


@dataclass
class Plan:
    files: list[FileLayout]
    sources: dict[Piece, list[Source]] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.sources)

    def subset(self, indices: list[int]) -> Plan:
        """The plan for some of the files only (one rank's share under torchrun)."""
        files = [self.files[i] for i in indices]
        wanted = {seg for f in files for seg in f.segments if isinstance(seg, Piece)}
        return Plan(files, {p: s for p, s in self.sources.items() if p in wanted})

    def pieces(self) -> Iterable[tuple[FileLayout, int, Piece]]:
        """(file, byte offset in file, piece) for every piece, in file order."""
        for f in self.files:
            for off, seg in zip(f.offsets(), f.segments):
                if isinstance(seg, Piece):
                    yield f, off, seg


def _in_section(name: str, only: str) -> bool:
    return name == only or name.startswith(only + ".")


def select(catalog: Catalog, only: str | None) -> tuple[list[str], list[str]]:
    """Tensor and object names kept by ``--only model|optim|PREFIX``."""
    tensors, objects = list(catalog.tensors), list(catalog.objects)
    if only:
        tensors = [n for n in tensors if _in_section(n, only)]
        objects = [n for n in objects if _in_section(n, only)]
        if not tensors and not objects:
            raise UsageError(f"--only {only!r} matches nothing in {catalog.path}; try `reshard inspect` for names")
    return tensors, objects


def cast_dtype(dtype: torch.dtype, to: torch.dtype | None) -> torch.dtype:
    """``--dtype`` casts floating-point tensors only: integer and bool state keeps its type."""
    return to if to is not None and dtype.is_floating_point else dtype


def full_target(catalog: Catalog, *, dtype: torch.dtype | None = None, only: str | None = None) -> Target:
    """Every selected tensor stored whole, in one box, in the file of rank 0."""
    tensors, objects = select(catalog, only)
    out = {}
    for name in tensors:
        t = catalog.tensors[name]
        out[name] = TargetTensor(name, t.shape, cast_dtype(t.dtype, dtype), [full_box(t.shape)], [0])
    return Target(
        tensors=out,
        objects={n: catalog.objects[n] for n in objects},
        paths={n: p for n, p in catalog.paths.items() if n in out or n in objects},
        attrs=dict(catalog.attrs),
    )


def sources_for(entry: TensorEntry, box: Box) -> list[Source]:
    """The stored chunks of ``entry`` that overlap ``box``, with the overlapping part."""
    out = []
    for chunk in entry.chunks:
        part = chunk.box.intersect(box)
        if part is not None:
            out.append(Source(chunk, part))
    return out


def make_plan(catalog: Catalog, files: list[FileLayout]) -> Plan:
    plan = Plan(files)
    for f in files:
        for seg in f.segments:
            if not isinstance(seg, Piece):
                continue
            sources = sources_for(catalog.tensors[seg.name], seg.box)
            covered = sum(s.box.numel for s in sources)
            if covered != seg.box.numel:
                raise UsageError(f"{catalog.path}: {seg.name!r} box {seg.box} is only {covered}/{seg.box.numel} covered by stored chunks")
            plan.sources[seg] = sources
    return plan
