"""What a quantization scheme is to reshard: which weights it can store, the tensors it writes
for each, and the ``quantization_config`` that tells readers so.

A scheme only describes. Choosing the weights (nn.Linear of the model the config describes,
not an embedding, head, norm or router gate, not named by ``--keep-dtype``), reading them in
the dtype the export would hold them in, the notice and the config.json are the driver's
(``reshard.features.quantize.weights.quantized``), shared by every scheme. Every tensor a scheme writes is
computed for whatever box the engine asks, as the weights stream, so the memory bound holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from reshard.core import dtypes
from reshard.core.boxes import Box
from reshard.core.catalog import TensorEntry
from reshard.core.chunk_reads import float32_box, read_box
from reshard.core.errors import UsageError

if TYPE_CHECKING:
    import torch

__all__ = ["Scheme", "Weight", "checked_finite"]


@dataclass(frozen=True)
class Weight:
    """One weight to quantize: its entry, the dtype the export would write it in (``--dtype``
    applied, or its own), and ``partners``: the weights a serving engine fuses with it into
    one matrix (q/k/v, gate/up), quantized in the same pass; a scheme whose scale spans a fused
    matrix (NVFP4's global scale) reads them, and keeps what it computes for the whole set in
    ``shared`` (one dict per export, so each fused set is read once for it)."""

    name: str
    entry: TensorEntry
    dtype: dtypes.DType
    partners: tuple[TensorEntry, ...] = ()
    shared: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def box(self, box: Box, entry: TensorEntry | None = None) -> torch.Tensor:
        """``box`` of this weight (or of a partner) in ``dtype``: what the export without
        quantization would hold there, rounded once (a merged or dequantized weight is
        computed in float32 and rounded from it, as the engine would)."""
        entry = entry or self.entry
        if entry.dtype.itemsize > 4:  # float64: float32 first would round twice
            return read_box(entry, box).to(self.dtype.torch)
        return float32_box(entry, box).to(self.dtype.torch)


def checked_finite(amax: torch.Tensor, name: str, where: Callable[[int], str], scale: str = "a quantization scale",
                   spread: str = "it") -> None:
    """Refuse a weight whose ``amax`` (one per scale) is not finite: no scale holds inf or NaN,
    and every reader would dequantize ``spread`` (what the scale covers) to NaN. ``where(i)``
    names the i-th scale's part of the weight. Met in a worker thread, so the message names
    both spellings of the option (errors.option cannot tell CLI from API there)."""
    import torch

    bad = ~torch.isfinite(amax.reshape(-1))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        what = "inf" if bool(torch.isinf(amax.reshape(-1)[i])) else "NaN"
        raise UsageError(f"{name}: {where(i)} holds {what}: {scale} cannot hold it (every reader would "
                         f"dequantize {spread} to NaN); fix the weights, or keep the module in the compute dtype with "
                         f"--keep-dtype {name} (keep_dtype=[{name!r}])")


class Scheme(Protocol):
    """One ``--quantize`` value. ``name`` is what users type; ``summary`` says in one line what
    it writes (``--help`` and errors show it), ``done`` the same for the notice after "quantized N
    linear weights to"; ``skipped_key`` is the config field that lists the modules left alone, and
    ``partial_note`` (or "") is said after the weights ``refuses`` named."""

    name: str
    summary: str
    done: str
    skipped_key: str
    partial_note: str

    def refuses(self, name: str, shape: tuple[int, ...]) -> str | None:
        """Why the 2-D weight ``name`` of ``shape`` stays in the compute dtype (a dim that is no
        multiple of the block: readers would disagree on it), or None. Decided before anything
        is written."""
        ...

    def tensors(self, weight: Weight) -> dict[str, TensorEntry]:
        """What replaces ``weight.name`` in the output: the quantized values and their scales,
        each computed for any box the engine asks."""
        ...

    def config(self, skipped: Mapping[str, tuple[int, ...]], quantized: int) -> dict[str, Any]:
        """``quantization_config`` for config.json; ``skipped``: the floating ``.weight``
        tensors left unquantized, with their shapes (the tied head, written once as the
        embeddings, included as ``lm_head.weight``); ``quantized``: how many weights are."""
        ...
