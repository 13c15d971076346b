"""Inputs for the safetensors tests: reference tensors of every dtype safetensors stores, a
stand-in for the engine that writes a writer's layout, and hand-made broken files."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from reshard.core.boxes import full_box
from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError
from reshard.core.facts import Facts
from reshard.core.pieces import OutputFile, Piece
from reshard.core.target import Target, TargetTensor

__all__ = ["reference", "raw_bytes", "same", "whole_target", "write_layout", "raw_file", "BROKEN"]


def _bytes_as(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs and all) of ``dtype``, so comparisons are bit for bit."""
    n = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).view(dtype).reshape(shape).clone()


def reference() -> dict[str, torch.Tensor]:
    """Standalone tensors (no shared storage) covering dtypes, 0-d, empty and 3-d shapes."""
    gen = torch.Generator().manual_seed(0)
    out = {
        "f32": torch.randn(2, 3, generator=gen),
        "bf16": torch.randn(4, 5, generator=gen).to(torch.bfloat16),
        "f16": torch.randn(7, generator=gen).to(torch.float16),
        "f64": torch.randn(3, 1, generator=gen, dtype=torch.float64),
        "i64": torch.randint(-(2**40), 2**40, (5,), generator=gen),
        "i32": torch.randint(-100, 100, (2, 2), generator=gen, dtype=torch.int32),
        "i16": torch.randint(-100, 100, (3,), generator=gen, dtype=torch.int16),
        "i8": torch.randint(-100, 100, (3,), generator=gen, dtype=torch.int8),
        "u8": torch.randint(0, 255, (9,), generator=gen, dtype=torch.uint8),
        "flag": torch.rand(6, generator=gen) > 0.5,
        "c64": torch.randn(2, generator=gen, dtype=torch.complex64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "cube": torch.arange(4 * 5 * 6, dtype=torch.float32).reshape(4, 5, 6),
        "layers.0.w": torch.randn(3, 4, generator=gen),
    }
    for dtype, shape in [
        (torch.float8_e4m3fn, (4, 4)), (torch.float8_e5m2, (3,)), (torch.float8_e8m0fnu, (2, 3)),
        (torch.float8_e4m3fnuz, (2,)), (torch.float4_e2m1fn_x2, (2, 3)),
        (torch.uint16, (3,)), (torch.uint32, (2,)), (torch.uint64, (2,)),
    ]:
        out[str(dtype).removeprefix("torch.")] = _bytes_as(dtype, shape, gen)
    return out


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (torch.equal lacks float8/float4 kernels and calls NaN != NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw_bytes(a), raw_bytes(b))


def whole_target(tensors: dict[str, torch.Tensor], objects: dict | None = None,
                 paths: dict | None = None, facts: Facts | None = None) -> Target:
    return Target(
        tensors={n: TargetTensor(n, tuple(t.shape), t.dtype, [full_box(t.shape)], [0]) for n, t in tensors.items()},
        objects=objects or {}, paths=paths or {}, facts=facts or Facts(),
    )


def write_layout(writer: Any, target: Target, dst: Path, tensors: dict[str, torch.Tensor]) -> list[OutputFile]:
    """What the engine does, minus budgets: every segment in order, then ``finish``."""
    files = writer.layout(target)
    if writer.output_is_dir:
        dst.mkdir(parents=True)
    for f in files:
        path = dst / f.relpath if f.relpath else dst
        with open(path, "wb") as out:
            for seg in f.segments:
                if isinstance(seg, Piece):
                    part = tensors[seg.name][seg.box.as_slices()].to(seg.dtype.torch)
                    out.write(raw_bytes(part).numpy().tobytes())
                else:
                    out.write(seg)
    writer.finish(dst, target, files)
    return files


def raw_file(path: Path, header: Any, data: bytes = b"", length: int | None = None) -> Path:
    """A safetensors file from a header (dict, or raw bytes) and data, length forced if given;
    ``header=None`` writes ``data`` alone (files too short to hold a length)."""
    if header is None:
        path.write_bytes(data)
        return path
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)
    return path


def _t(dtype: str, shape: list, offsets: list) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


# id -> (header, data, forced length, error type, message after "<path>: ", real safetensors rejects it)
BROKEN: dict[str, tuple[Any, bytes, int | None, type, str, bool]] = {
    "too-short": (None, b"\x05\x00\x00", None, CorruptCheckpointError, "3 bytes, too short", True),
    "header-over-100MB": (b"{}", b"", 100_000_001, CorruptCheckpointError,
                          "header length 100000001 exceeds safetensors' limit of 100000000", True),
    "header-past-eof": (b"{}", b"", 64, CorruptCheckpointError, "header length 64 runs past the end", True),
    "bad-json": (b'{"w": {"dtype": ', b"", None, CorruptCheckpointError, "header is not valid JSON", True),
    "not-utf8": (b'{"\xff": 1}', b"", None, CorruptCheckpointError, "header is not valid UTF-8", True),
    "not-object": (b"[1, 2]", b"", None, CorruptCheckpointError, "header must be a JSON object, not list", True),
    "deep-nesting": (b'{"w":' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"", None, CorruptCheckpointError,
                     "header is not valid JSON", True),
    "nan-token": (b'{"w": NaN}', b"", None, CorruptCheckpointError, "header is not valid JSON", True),
    "unknown-dtype": ({"w": _t("F128", [1], [0, 16])}, bytes(16), None, CorruptCheckpointError,
                      "tensor 'w' has unknown dtype 'F128'", True),
    "overlap": ({"a": _t("F32", [2], [0, 8]), "b": _t("F32", [2], [4, 12])}, bytes(12), None,
                CorruptCheckpointError, "tensor 'b' data_offsets [4, 12] overlap tensor 'a' (ends at 8)", True),
    "offsets-reversed": ({"w": _t("F32", [1], [8, 4])}, bytes(8), None, CorruptCheckpointError,
                         "tensor 'w' data_offsets [8, 4] end before they begin", True),
    "hole": ({"a": _t("F32", [1], [0, 4]), "b": _t("F32", [1], [8, 12])}, bytes(12), None,
             CorruptCheckpointError, "data bytes 4..8 belong to no tensor (hole before 'b')", True),
    "not-starting-at-0": ({"w": _t("F32", [1], [4, 8])}, bytes(8), None, CorruptCheckpointError,
                          "data bytes 0..4 belong to no tensor", True),
    "trailing-bytes": ({"w": _t("F32", [1], [0, 4])}, bytes(6), None, CorruptCheckpointError,
                       "2 bytes after the last tensor", True),
    "truncated-data": ({"w": _t("F32", [4], [0, 16])}, bytes(10), None, CorruptCheckpointError,
                       "tensors need 16 data bytes, file holds 10 after the header (truncated?)", True),
    "size-mismatch": ({"w": _t("F32", [2, 3], [0, 12])}, bytes(12), None, CorruptCheckpointError,
                      "tensor 'w' data_offsets [0, 12] hold 12 bytes but shape [2, 3] of F32 needs 24", True),
    "negative-dim": ({"w": _t("F32", [2, -1], [0, 0])}, b"", None, CorruptCheckpointError,
                     "tensor 'w' shape [2, -1] must be a list of non-negative integers", True),
    "float-dim": ({"w": _t("F32", [1.0], [0, 4])}, bytes(4), None, CorruptCheckpointError,
                  "tensor 'w' shape [1.0] must be a list", True),
    "three-offsets": ({"w": _t("F32", [1], [0, 4, 5])}, bytes(4), None, CorruptCheckpointError,
                      "tensor 'w' data_offsets [0, 4, 5] must be [begin, end]", True),
    "shape-overflow": ({"w": _t("F32", [2**62, 4], [0, 4])}, bytes(4), None, CorruptCheckpointError,
                       f"tensor 'w' shape [{2**62}, 4] of F32 overflows 64-bit sizes", True),
    "f4-half-byte": ({"w": _t("F4", [3], [0, 2])}, bytes(2), None, CorruptCheckpointError,
                     "does not end on a byte boundary", True),
    "metadata-int": ({"__metadata__": {"x": 1}}, b"", None, CorruptCheckpointError,
                     "__metadata__ value for 'x' must be a string, not int", True),
    "metadata-list": ({"__metadata__": ["x"]}, b"", None, CorruptCheckpointError,
                      "__metadata__ must be an object of strings, not list", True),
    # Stricter than the Rust core, which keeps the last of two equal names.
    "duplicate-name": (b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                       b'"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x", None,
                       CorruptCheckpointError, "header names 'w' twice", False),
    # Valid safetensors, but torch has no 6-bit float.
    "f6-no-torch-dtype": ({"w": _t("F6_E2M3", [4], [0, 3])}, bytes(3), None, UnsupportedFormatError,
                          "tensor 'w' has dtype F6_E2M3, which torch cannot hold", False),
}
