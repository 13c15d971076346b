"""The safetensors header: an 8-byte little-endian length N, then N bytes of JSON naming every
tensor's dtype, shape and ``data_offsets`` inside the data that follows.

``read_header`` validates a header the way safetensors' Rust core does before it trusts one
(length limit, UTF-8 JSON object, known dtypes, sizes that match shape x dtype, offsets that
tile the data exactly once up to the end of the file), and is stricter in one place: a name
given twice is refused, where serde would silently keep the last one. Only the header is read;
tensor bytes are left on disk. ``header_bytes`` writes the header the way ``save_file`` does
(compact JSON, padded with spaces to a multiple of 8, tensors sorted by dtype then name), so
our output is byte-identical to safetensors' own for the same tensors and metadata.

A header need not start a file: DCP's safetensors serialization appends one safetensors blob
after a rank's pickled values in each ``.distcp`` file, so ``read_header`` takes the blob's
start and validates it as it would a file that begins there (its data must end the file).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.core import dtypes
from reshard.core.dtypes import DType
from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError
from reshard.core.regions import read_exact
from reshard.core.storage import close, handle_size, open_read

__all__ = [
    "MAX_HEADER_SIZE", "HeaderTensor", "Header", "read_header", "header_bytes", "unstorable",
    "file_order",
]

# safetensors refuses larger headers (MAX_HEADER_SIZE in its Rust core): a hostile length must
# not make us allocate gigabytes before any validation.
MAX_HEADER_SIZE = 100_000_000

# (code, torch dtype name, bits per element) in the order of safetensors' ``Dtype`` enum, which
# ``save_file`` sorts by (widest first) so every tensor starts aligned to its own element size.
_TABLE = [
    ("BOOL", "bool", 8), ("F4", "float4_e2m1fn_x2", 4), ("F6_E2M3", None, 6), ("F6_E3M2", None, 6),
    ("U8", "uint8", 8), ("I8", "int8", 8), ("F8_E5M2", "float8_e5m2", 8), ("F8_E4M3", "float8_e4m3fn", 8),
    ("F8_E8M0", "float8_e8m0fnu", 8), ("F8_E4M3FNUZ", "float8_e4m3fnuz", 8),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz", 8), ("I16", "int16", 16), ("U16", "uint16", 16),
    ("F16", "float16", 16), ("BF16", "bfloat16", 16), ("I32", "int32", 32), ("U32", "uint32", 32),
    ("F32", "float32", 32), ("C64", "complex64", 64), ("F64", "float64", 64), ("I64", "int64", 64),
    ("U64", "uint64", 64),
]
_DTYPES: dict[str, tuple[DType | None, int]] = {
    code: (dtypes.by_name(name) if name else None, bits) for code, name, bits in _TABLE
}
_CODES: dict[DType, str] = {dt: code for code, (dt, _) in _DTYPES.items() if dt is not None}
_RANK = {code: i for i, (code, _, _) in enumerate(_TABLE)}
# torch packs F4 two to a byte along the last dimension: header shape [..., 2k] is torch [..., k].
_PACKED = {"F4": 2}


def unstorable(dtype: DType, shape: tuple[int, ...]) -> str | None:
    """Why a tensor cannot go into a safetensors file, or None when it can."""
    code = _CODES.get(dtypes.of(dtype))
    if code is None:
        return f"safetensors has no dtype for {dtype}"
    if code in _PACKED and not shape:
        return f"safetensors stores {code} in pairs along the last dimension; a 0-d tensor has none"
    return None


def file_order(names_dtypes: list[tuple[str, DType]]) -> list[str]:
    """Names in the order ``save_file`` lays tensors out: widest dtype first, then by name."""
    return [n for n, _ in sorted(names_dtypes, key=lambda nd: (-_RANK[_CODES[dtypes.of(nd[1])]], nd[0]))]


@dataclass(frozen=True)
class HeaderTensor:
    name: str
    dtype: DType
    shape: tuple[int, ...]  # torch's shape (F4 counts packed pairs)
    begin: int  # relative to the start of the data, as in the header
    end: int


@dataclass(frozen=True)
class Header:
    path: Path
    data_start: int  # start + 8 + N: absolute offset of data_offsets 0 in the file
    metadata: dict[str, str]
    tensors: list[HeaderTensor]  # in file order


def _unicode(path: Path | str, s: str) -> str:
    """``s`` if it is valid Unicode text. Python's JSON decoder lets ``"\\ud800"`` escapes
    through as lone surrogates, which no UTF-8 writer can encode later; serde (the Rust core)
    rejects them as invalid JSON, and so do we."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise CorruptCheckpointError(f"{path}: header is not valid JSON (lone surrogate escape in {s!r})") from None
    return s


def _no_duplicates(path: Path | str):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise CorruptCheckpointError(f"{path}: header names {k!r} twice")
            out[_unicode(path, k)] = v
        return out

    return hook


def _reject_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0


def _parse_json(path: Path | str, raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{path}: header is not valid UTF-8 ({e})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates(path), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # deep nesting overflows the parser's stack
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{path}: header must be a JSON object, not {type(obj).__name__}")
    return obj


def _metadata(path: Path | str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{path}: __metadata__ must be an object of strings, not {type(value).__name__}")
    for k, v in value.items():
        if not isinstance(v, str):
            raise CorruptCheckpointError(f"{path}: __metadata__ value for {k!r} must be a string, not {type(v).__name__}")
        _unicode(path, v)
    return value


def _checked_bits(shape: list[int], bits: int) -> int | None:
    """Elements x bits as the Rust core computes them (u64, checked at every step), or None on
    overflow; stopping early also keeps a hostile million-dimension shape cheap."""
    n = 1
    for s in [*shape, bits]:
        n *= s
        if n >= 2**64:
            return None
    return n


def _torch_can_hold(shape: list[int]) -> bool:
    """Every size and contiguous stride fits torch's int64 (strides count empty dims as 1)."""
    stride = 1
    for s in reversed(shape):
        if s >= 2**63 or stride >= 2**63:
            return False
        stride *= max(s, 1)
    return True


def _tensor(path: Path | str, name: str, info: Any) -> HeaderTensor:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CorruptCheckpointError(f"{where} must be described by an object, not {type(info).__name__}")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if code not in _DTYPES:
        raise CorruptCheckpointError(f"{where} has unknown dtype {code!r}")
    if not (isinstance(shape, list) and all(_is_count(s) for s in shape)):
        raise CorruptCheckpointError(f"{where} shape {shape!r} must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise CorruptCheckpointError(f"{where} data_offsets {offsets!r} must be [begin, end], non-negative integers")
    begin, end = offsets
    if end < begin:
        raise CorruptCheckpointError(f"{where} data_offsets {offsets} end before they begin")
    dtype, bits = _DTYPES[code]
    nbits = _checked_bits(shape, bits)
    if nbits is None:
        raise CorruptCheckpointError(f"{where} shape {shape} of {code} overflows 64-bit sizes")
    if nbits % 8:
        raise CorruptCheckpointError(f"{where} shape {shape} of {code} does not end on a byte boundary")
    if end - begin != nbits // 8:
        raise CorruptCheckpointError(
            f"{where} data_offsets {offsets} hold {end - begin} bytes but shape {shape} of {code} needs {nbits // 8}"
        )
    if dtype is None:
        raise UnsupportedFormatError(f"{where} has dtype {code}, which torch cannot hold")
    if not _torch_can_hold(shape):  # valid for the Rust core when another dimension is 0
        raise UnsupportedFormatError(f"{where} shape {shape} has sizes or strides past 2**63-1, which torch cannot hold")
    pack = _PACKED.get(code, 1)
    if pack > 1 and (not shape or shape[-1] % pack):
        raise UnsupportedFormatError(f"{where} is {code} with shape {shape}: torch needs an even last dimension")
    torch_shape = tuple(shape[:-1]) + (shape[-1] // pack,) if pack > 1 else tuple(shape)
    return HeaderTensor(name, dtype, torch_shape, begin, end)


def _check_tiling(path: Path | str, tensors: list[HeaderTensor], data_len: int) -> None:
    at, last = 0, None
    for t in tensors:
        if t.begin < at:
            raise CorruptCheckpointError(
                f"{path}: tensor {t.name!r} data_offsets [{t.begin}, {t.end}] overlap tensor {last!r} (ends at {at})"
            )
        if t.begin > at:
            raise CorruptCheckpointError(
                f"{path}: data bytes {at}..{t.begin} belong to no tensor (hole before {t.name!r})"
            )
        at, last = t.end, t.name
    if at < data_len:
        raise CorruptCheckpointError(f"{path}: {data_len - at} bytes after the last tensor (data ends at {at} of {data_len})")
    if at > data_len:
        raise CorruptCheckpointError(
            f"{path}: tensors need {at} data bytes, file holds {data_len} after the header (truncated?)"
        )


def read_header(path: Path, start: int = 0) -> Header:
    """The validated header of the safetensors data at byte ``start`` of ``path`` (a whole
    file by default); raises CorruptCheckpointError naming the file and the field at the first
    inconsistency. The data must end exactly where the file does."""
    where = f"{path}" if start == 0 else f"{path} (safetensors data at byte {start})"
    fd = open_read(path)
    try:
        size = handle_size(fd) - start
        if size < 8:
            raise CorruptCheckpointError(f"{where}: {size} bytes, too short for a safetensors header length (truncated?)")
        prefix = bytes(read_exact(fd, 8, start, path))
        if prefix[:4] == b"PK\x03\x04":
            # DCP's HuggingFaceStorageWriter puts non-tensor values there, as torch.save zips.
            raise CorruptCheckpointError(
                f"{where}: starts with a zip archive (torch.save data), not a safetensors header; "
                "a writer stored non-tensor values in it, which safetensors cannot hold"
            )
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_SIZE:
            raise CorruptCheckpointError(f"{where}: header length {n} exceeds safetensors' limit of {MAX_HEADER_SIZE}")
        if 8 + n > size:
            raise CorruptCheckpointError(f"{where}: header length {n} runs past the end of the file ({size} bytes)")
        raw = bytes(read_exact(fd, n, start + 8, path))
    finally:
        close(fd)
    obj = _parse_json(where, raw)
    metadata = _metadata(where, obj.pop("__metadata__", None))
    tensors = sorted((_tensor(where, k, v) for k, v in obj.items()), key=lambda t: (t.begin, t.end))
    _check_tiling(where, tensors, size - 8 - n)
    return Header(path, start + 8 + n, metadata, tensors)


def header_bytes(tensors: list[tuple[str, DType, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """Length prefix and JSON header for ``tensors`` stored back to back in the given order."""
    head: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    at = 0
    for name, dtype, shape in tensors:
        code = _CODES[dtypes.of(dtype)]
        pack = _PACKED.get(code, 1)
        nbytes = math.prod(shape) * dtype.itemsize
        shown = list(shape[:-1]) + [shape[-1] * pack] if pack > 1 else list(shape)
        head[name] = {"dtype": code, "shape": shown, "data_offsets": [at, at + nbytes]}
        at += nbytes
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
