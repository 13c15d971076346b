"""Where each parameter's elements lie in DeepSpeed ZeRO's flat partitions: pure arithmetic
on shapes and partition lengths, checked the way DeepSpeed's own ``zero_to_fp32`` checks it.

* ZeRO-1/2, per param group: the group's parameters, flattened in ``param_shapes`` order
  (each followed by its ``param_alignment_paddings`` entry), form one buffer padded at the
  end to split into ``world`` equal partitions; rank ``r`` saves partition ``r`` (the last one
  without its padding). Parameters straddle partitions.
* ZeRO-3: every parameter is cut on its own into ``world`` pieces of ``ceil(numel / world)``
  elements (the last zero-padded); rank ``r``'s buffer is its piece of every parameter, in
  ``param_shapes`` order, across all its sub-groups.

The optimizer's moments follow the same layout as the fp32 master partitions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from reshard.core.errors import CorruptCheckpointError

__all__ = ["Fragment", "ZeroParam", "zero12_params", "zero3_params", "split_concatenated"]


@dataclass(frozen=True)
class Fragment:
    """Flat elements ``[begin, end)`` of a parameter, stored from element ``at`` of the flat
    buffer ``buffer`` (a (rank, group) key) of rank ``rank``."""

    rank: int
    buffer: tuple[int, int]
    begin: int
    end: int
    at: int


@dataclass
class ZeroParam:
    name: str
    shape: tuple[int, ...]
    group: int  # the optimizer param group (ZeRO-1/2) or flat sub-group (ZeRO-3) it trains in
    fragments: list[Fragment] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def zero12_params(param_shapes: Sequence[Mapping[str, tuple[int, ...]]], lengths: Sequence[Sequence[int]],
                  paddings: Sequence[Sequence[int]] | None, files: Sequence[str]) -> list[ZeroParam]:
    """ZeRO-1/2: ``lengths[r][g]`` is the saved partition length of rank ``r`` for group ``g``;
    ``files[r]`` names rank ``r``'s file in errors."""
    world = len(lengths)
    out: list[ZeroParam] = []
    for g, shapes in enumerate(param_shapes):
        starts = [sum(lengths[q][g] for q in range(r)) for r in range(world)]
        total = starts[-1] + lengths[-1][g]
        pads = list(paddings[g]) if paddings is not None and g < len(paddings) else [0] * len(shapes)
        if len(pads) != len(shapes):
            raise CorruptCheckpointError(f"{files[0]}: {len(pads)} parameter alignment paddings for the {len(shapes)} "
                                         f"parameters of group {g}")
        offset = 0
        for (name, shape), pad in zip(shapes.items(), pads):
            p = ZeroParam(name, tuple(shape), g)
            for r in range(world):
                lo, hi = max(offset, starts[r]), min(offset + p.numel, starts[r] + lengths[r][g])
                if lo < hi:
                    p.fragments.append(Fragment(r, (r, g), lo - offset, hi - offset, lo - starts[r]))
            offset += p.numel + pad
            out.append(p)
        # Partitions are padded to 2 * world elements (DeepSpeed's own check, zero_to_fp32).
        align = 2 * world
        if offset > total or math.ceil(offset / align) != math.ceil(total / align):
            r = next((r for r in range(1, world - 1) if lengths[r][g] != lengths[0][g]), world - 1)  # all but the last are equal
            raise CorruptCheckpointError(
                f"{files[r]}: the {world} partitions of param group {g} hold {total} elements, its parameters need "
                f"{offset} (a partition is truncated, or the files come from runs with different world sizes)")
    return out


def zero3_params(param_shapes: Sequence[Mapping[str, tuple[int, ...]]], lengths: Sequence[int],
                 group_ends: Sequence[int], files: Sequence[str]) -> list[ZeroParam]:
    """ZeRO-3: ``lengths[r]`` is the length of rank ``r``'s whole flat buffer (all sub-groups);
    ``group_ends`` are the buffer positions where each sub-group ends (the same on every rank)."""
    world = len(lengths)
    out: list[ZeroParam] = []
    at = 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            group = next((i for i, end in enumerate(group_ends) if at < end), len(group_ends) - 1)
            p = ZeroParam(name, tuple(shape), group)
            per = math.ceil(p.numel / world)
            for r in range(world):
                lo, hi = r * per, min(p.numel, (r + 1) * per)
                if lo < hi:
                    p.fragments.append(Fragment(r, (r, 0), lo, hi, at))
            at += per
            out.append(p)
    for r, n in enumerate(lengths):
        if n != at:
            raise CorruptCheckpointError(
                f"{files[r]}: holds a flat partition of {n} elements, but {world} ranks of these parameters need "
                f"{at} each (truncated, or saved with another world size)")
    return out


def split_concatenated(shape: tuple[int, ...], lengths: Sequence[int], name: str, files: Sequence[str]) -> list[Fragment]:
    """A parameter whose ranks' pieces, concatenated in rank order and cut to its size, make it
    up (DeepSpeed's frozen parameters): the fragments of each rank's piece ``(r, 0)``."""
    numel, start, out = math.prod(shape), 0, []
    for r, n in enumerate(lengths):
        lo, hi = start, min(numel, start + n)
        if lo < hi:
            out.append(Fragment(r, (r, 0), lo, hi, 0))
        start += n
    if start < numel:
        raise CorruptCheckpointError(f"{files[-1]}: the pieces of {name!r} hold {start} of its {numel} elements")
    return out
