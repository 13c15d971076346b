"""What a key map does to stored chunks: box arithmetic where it can, a lazy row gather where not.

* Cutting a fused tensor into parts, or gluing parts into a fused tensor, moves no data: a
  chunk of the fused tensor that overlaps a part becomes a chunk of the part with its box
  re-based (and its bytes reached through a narrower ``StoredRegion`` when they are one run of
  the file, so the engine can still kernel-copy them).
* The q/k RoPE permutation reorders rows inside each attention head. ``RowGather`` is a
  ``ChunkData`` that, asked for a box, reads just the source rows that box needs (in runs at
  most twice the box), so memory stays bounded by the box, never by the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Chunk, ChunkData, TensorEntry
from reshard.core.errors import UsageError
from reshard.core.regions import StoredRegion, as_region

if TYPE_CHECKING:
    import torch

__all__ = ["read_box", "float32_box", "part_chunks", "shifted_chunks", "index_chunks", "stacked_chunks", "RowGather", "rope_rows",
           "gathered_entry"]


def read_box(entry: TensorEntry, box: Box) -> torch.Tensor:
    """The global ``box`` of ``entry``, assembled from whichever chunks overlap it."""
    import torch

    out = torch.empty(box.sizes, dtype=entry.dtype.torch)
    for chunk in entry.chunks:
        part = chunk.box.intersect(box)
        if part is not None:
            out[part.shifted(box.offsets).as_slices()] = chunk.data.read(part.shifted(chunk.box.offsets))
    return out


def float32_box(entry: TensorEntry, box: Box) -> torch.Tensor:
    """``box`` of ``entry`` as float32: a tensor computed in one chunk (a LoRA merge, a
    dequantized weight) is read as its float32 values, never rounded to the entry's dtype first."""
    import torch

    chunks = entry.chunks
    if len(chunks) == 1 and chunks[0].box == full_box(entry.shape):
        return chunks[0].data.read(box).to(torch.float32)
    return read_box(entry, box).to(torch.float32)


@dataclass(frozen=True)
class _Offset:
    """The part of ``data`` that starts ``delta`` elements into it, per dimension."""

    data: ChunkData
    delta: tuple[int, ...]

    def read(self, box: Box) -> torch.Tensor:
        return self.data.read(Box(tuple(o + d for o, d in zip(box.offsets, self.delta)), box.sizes))


def _narrowed(data: ChunkData, delta: tuple[int, ...], sizes: tuple[int, ...]) -> ChunkData:
    region = as_region(data)
    if not any(delta) and region is not None and region.shape == sizes:
        return region
    if region is not None and region.strides is None:
        run = region.byte_range(Box(delta, sizes))
        if run is not None:
            return StoredRegion(region.path, run[0], region.dtype, sizes)
    return _Offset(data, delta)


def part_chunks(entry: TensorEntry, dim: int, start: int, size: int) -> list[Chunk]:
    """Chunks of the slice ``[start, start + size)`` along ``dim`` of ``entry``, re-based to 0."""
    window = Box(tuple(start if d == dim else 0 for d in range(len(entry.shape))),
                 tuple(size if d == dim else s for d, s in enumerate(entry.shape)))
    out = []
    for chunk in entry.chunks:
        part = chunk.box.intersect(window)
        if part is None:
            continue
        delta = tuple(p - c for p, c in zip(part.offsets, chunk.box.offsets))
        out.append(Chunk(part.shifted(window.offsets), _narrowed(chunk.data, delta, part.sizes)))
    return out


def shifted_chunks(entry: TensorEntry, dim: int, start: int) -> list[Chunk]:
    """``entry``'s chunks placed ``start`` elements along ``dim`` inside a larger tensor."""
    out = []
    for c in entry.chunks:
        offsets = tuple(o + start if d == dim else o for d, o in enumerate(c.box.offsets))
        out.append(Chunk(Box(offsets, c.box.sizes), c.data))
    return out


@dataclass(frozen=True)
class _Squeezed:
    """``data`` read with one more dim of size 1 at ``dim`` than the boxes asked of it have."""

    data: ChunkData
    dim: int
    at: int  # the index along ``dim`` inside ``data``

    def read(self, box: Box) -> torch.Tensor:
        inner = Box(box.offsets[:self.dim] + (self.at,) + box.offsets[self.dim:],
                    box.sizes[:self.dim] + (1,) + box.sizes[self.dim:])
        return self.data.read(inner).squeeze(self.dim)


@dataclass(frozen=True)
class _Unsqueezed:
    """``data`` read through boxes with an extra dim of size 1 at ``dim``."""

    data: ChunkData
    dim: int

    def read(self, box: Box) -> torch.Tensor:
        inner = Box(box.offsets[:self.dim] + box.offsets[self.dim + 1:], box.sizes[:self.dim] + box.sizes[self.dim + 1:])
        return self.data.read(inner).unsqueeze(self.dim)


def index_chunks(entry: TensorEntry, dim: int, index: int) -> list[Chunk]:
    """Chunks of ``entry[..., index, ...]`` (``index`` along ``dim``, that dim dropped): one
    expert of a grouped MoE tensor, made of the parts of the stored chunks that hold it."""
    out = []
    for chunk in entry.chunks:
        lo, n = chunk.box.offsets[dim], chunk.box.sizes[dim]
        if not lo <= index < lo + n:
            continue
        box = Box(chunk.box.offsets[:dim] + chunk.box.offsets[dim + 1:], chunk.box.sizes[:dim] + chunk.box.sizes[dim + 1:])
        out.append(Chunk(box, _Squeezed(chunk.data, dim, index - lo)))
    return out


def stacked_chunks(entry: TensorEntry, dim: int, index: int) -> list[Chunk]:
    """``entry``'s chunks as index ``index`` along a new dim ``dim`` of a stacked tensor."""
    return [Chunk(Box(c.box.offsets[:dim] + (index,) + c.box.offsets[dim:], c.box.sizes[:dim] + (1,) + c.box.sizes[dim:]),
                  _Unsqueezed(c.data, dim)) for c in entry.chunks]


def rope_rows(rows: int, heads: int, *, to_halves: bool) -> torch.Tensor:
    """Source row of every output row for the q/k RoPE permutation of ``heads`` heads.

    Meta/torchtitan rotate interleaved pairs (rows 0,1 of a head are one complex number); HF
    Llama rotates the first half of a head against the second. transformers'
    ``convert_llama_weights_to_hf.py`` turns one into the other with
    ``w.view(n, hd // 2, 2, dim).transpose(1, 2).reshape(n * hd, dim)``; this is that map
    written as row indices (``to_halves=False`` gives its inverse).
    """
    import torch

    if heads <= 0 or rows % heads or (rows // heads) % 2:
        raise UsageError(f"RoPE permutation: {rows} rows do not split into {heads} heads of an even size; "
                         "check n_heads / n_kv_heads in the key map's params or the model config")
    hd = rows // heads
    idx = torch.arange(rows).view(heads, hd // 2, 2)
    fwd = idx.transpose(1, 2).reshape(rows)  # output row r holds source row fwd[r]
    return fwd if to_halves else torch.argsort(fwd)


@dataclass(frozen=True)
class RowGather:
    """``source`` with its dim-0 rows reordered: output row ``r`` is source row ``rows[r]``."""

    source: TensorEntry
    rows: torch.Tensor

    def read(self, box: Box) -> torch.Tensor:
        import torch

        if box.numel == 0:
            return torch.empty(box.sizes, dtype=self.source.dtype.torch)
        want = self.rows[box.offsets[0] : box.offsets[0] + box.sizes[0]]
        order = torch.argsort(want)
        sorted_rows = want[order].tolist()
        out = torch.empty(box.sizes, dtype=self.source.dtype.torch)
        # Runs of needed source rows whose gaps are at most one row: read each run whole and
        # keep the rows wanted; a run reads at most about twice the rows it serves.
        i = 0
        while i < len(sorted_rows):
            j = i
            while j + 1 < len(sorted_rows) and sorted_rows[j + 1] - sorted_rows[j] <= 2:
                j += 1
            lo, hi = sorted_rows[i], sorted_rows[j] + 1
            span = read_box(self.source, Box((lo,) + box.offsets[1:], (hi - lo,) + box.sizes[1:]))
            picks = torch.tensor(sorted_rows[i : j + 1]) - lo
            out[order[i : j + 1]] = span.index_select(0, picks)
            i = j + 1
        return out


def gathered_entry(name: str, source: TensorEntry, rows: torch.Tensor) -> TensorEntry:
    """``source`` under ``name``, rows reordered on read; one chunk covering the tensor."""
    return TensorEntry(name, source.shape, source.dtype, [Chunk(full_box(source.shape), RowGather(source, rows))])
