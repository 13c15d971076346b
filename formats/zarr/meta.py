"""zarr v3 metadata (``zarr.json``) as plain JSON, read and written by us, not by zarr-python.

Why by hand: the checkpoints we move are mostly bfloat16 and float8, and zarr-python does not
know those data types, so it can neither write nor open such arrays. The zarr v3 spec names
them through extension data types (``bfloat16``, ``float8_e4m3fn``, ``float8_e5m2`` ...);
tensorstore, the main outside reader (JAX, Orbax), knows these names and reads our arrays with
the right dtype. The metadata is small JSON, so reading it ourselves also lets us validate every
field before trusting it (shapes, chunk grid, codecs) and name the file and field that is wrong.

torch dtypes with no zarr name (complex32, bit-packed types) are stored as raw bits (``r16``
...) and the torch name is kept in the array's ``reshard.dtype`` attribute, so reshard reads
them back exactly; other readers see the raw bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reshard.core import dtypes
from reshard.core.boxes import Box
from reshard.core.dtypes import DType
from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError

__all__ = [
    "ZARR_JSON", "DTYPE_ATTR", "MAX_JSON_SIZE", "ArrayMeta", "zarr_dtype_name", "parse_json",
    "parse_array_meta", "array_meta_json", "group_meta_json", "fill_bytes",
]

ZARR_JSON = "zarr.json"
DTYPE_ATTR = "reshard.dtype"
MAX_JSON_SIZE = 100_000_000  # as safetensors bounds its header: a hostile file must not exhaust memory

# zarr v3 core data types and the extension names tensorstore reads; all equal torch's names.
_NAMED = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
]
_BY_NAME: dict[str, DType] = {n: dtypes.by_name(n) for n in _NAMED}
_NAME_OF: dict[DType, str] = {dt: n for n, dt in _BY_NAME.items()}
_TORCH_NAMES: dict[str, DType] = {dt.name: dt for dt in dtypes.DTYPES.values()}


def zarr_dtype_name(dtype: DType) -> str:
    """The ``data_type`` we write: the zarr / extension name, else raw bits of the same size."""
    return _NAME_OF.get(dtype) or f"r{dtype.itemsize * 8}"


def _fill_json(dtype: DType) -> Any:
    name = _NAME_OF.get(dtype)
    if name is None:
        return [0] * dtype.itemsize  # raw bits: one integer per byte
    if name == "bool":
        return False
    if dtype.is_complex:
        return [0.0, 0.0]
    return 0.0 if dtype.is_floating_point else 0


# Dtypes numpy converts a Python float (or complex) to exactly as torch does: one IEEE
# rounding from double. The others (bfloat16, float16, float8) go through torch.
_NUMPY_EXACT = frozenset({"float32", "float64", "complex64", "complex128"})
# Dtypes whose +0.0 is all zero bits: a zero fill (what writers use) needs no torch either.
_ZERO_IS_ZEROS = frozenset({"float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                            "float8_e5m2fnuz"})


def fill_bytes(dtype: DType, value: Any, where: str) -> bytes:
    """The bytes of the one element a ``fill_value`` stands for (what missing chunks read as)."""
    bad = CorruptCheckpointError(f"{where}: fill_value {value!r} is not a valid {dtype} value")
    if isinstance(value, list) and dtype not in _NAME_OF:  # raw bits
        if len(value) != dtype.itemsize or not all(type(b) is int and 0 <= b < 256 for b in value):
            raise bad
        return bytes(value)
    if isinstance(value, str) and value.startswith("0x"):  # bit pattern, as the spec allows for floats
        try:
            return int(value, 16).to_bytes(dtype.itemsize, "little")
        except (ValueError, OverflowError):
            raise bad from None
    specials = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

    def scalar(v: Any) -> Any:
        if isinstance(v, str) and v in specials and (dtype.is_floating_point or dtype.is_complex):
            return specials[v]
        if type(v) is bool and dtype.kind == "b":
            return v
        if type(v) in (int, float) and dtype.kind != "b":
            if not (dtype.is_floating_point or dtype.is_complex) and type(v) is not int:
                raise bad
            return v
        raise bad

    if dtype.is_complex:
        if not isinstance(value, list) or len(value) != 2:
            raise bad
        number: Any = complex(scalar(value[0]), scalar(value[1]))
    else:
        number = scalar(value)
    if dtype.kind == "b":
        return b"\x01" if number else b"\x00"
    if dtype.kind in "iu":
        try:
            return number.to_bytes(dtype.itemsize, "little", signed=dtype.kind == "i")
        except OverflowError:
            raise bad from None
    if dtype.name in _NUMPY_EXACT:
        return np.array(number, dtype=dtype.name).tobytes()
    if dtype.name in _ZERO_IS_ZEROS and number == 0 and math.copysign(1.0, number) > 0:
        return bytes(dtype.itemsize)
    import torch

    try:
        return torch.tensor(number, dtype=dtype.torch).reshape(1).view(torch.uint8).numpy().tobytes()
    except (RuntimeError, OverflowError):
        raise bad from None


# The top-level fields the zarr v3 spec defines, per node type. Any other field is an
# extension: the spec (and zarr-python) refuse a node whose unknown field is not an object
# saying ``"must_understand": false`` (zarr-python refuses any extra field of a group, too).
_SPEC_FIELDS = {
    "array": frozenset({"zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding",
                        "fill_value", "codecs", "attributes", "storage_transformers", "dimension_names"}),
    "group": frozenset({"zarr_format", "node_type", "attributes"}),
}


def _check_extensions(doc: dict[str, Any], where: str) -> None:
    kind = doc.get("node_type")
    known = _SPEC_FIELDS.get(kind) if isinstance(kind, str) else None
    if known is None:
        return  # not a node: the reader refuses its node_type
    for key, value in doc.items():
        if kind == "group" and key == "consolidated_metadata" and value is None:
            continue  # early zarr-python 3 wrote it so; it says nothing
        if key not in known and not (isinstance(value, dict) and value.get("must_understand") is False):
            raise UnsupportedFormatError(
                f"{where}: field {key!r} is a zarr extension reshard does not implement and it does not say "
                '"must_understand": false; the zarr v3 spec requires refusing it'
            )


def parse_json(raw: bytes, where: str) -> dict[str, Any]:
    if len(raw) > MAX_JSON_SIZE:
        raise CorruptCheckpointError(f"{where}: larger than {MAX_JSON_SIZE} bytes; not zarr metadata")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: not a JSON object")
    if doc.get("zarr_format") != 3:
        raise UnsupportedFormatError(f"{where}: zarr_format is {doc.get('zarr_format')!r}; reshard reads zarr v3 stores")
    _check_extensions(doc, where)
    return doc


@dataclass(frozen=True)
class ArrayMeta:
    """One array's metadata, validated. ``key_prefix``/``separator`` give its chunk keys."""

    shape: tuple[int, ...]
    dtype: DType
    chunk_shape: tuple[int, ...]
    codecs: list[dict[str, Any]]
    fill: bytes | None  # one element's bytes; None in layouts we write (the reader always has one)
    key_prefix: str  # "c" for the default encoding, "" for v2
    separator: str
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(-(-n // c) for n, c in zip(self.shape, self.chunk_shape))

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunk_shape) * self.dtype.itemsize

    def chunk_key(self, coords: tuple[int, ...]) -> str:
        parts = [self.key_prefix] if self.key_prefix else []
        parts += [str(c) for c in coords] or ([] if self.key_prefix else ["0"])
        return self.separator.join(parts)

    def chunk_box(self, coords: tuple[int, ...]) -> Box:
        """The part of the array chunk ``coords`` holds (edge chunks are clipped)."""
        offs = tuple(i * c for i, c in zip(coords, self.chunk_shape))
        return Box(offs, tuple(min(c, n - o) for c, n, o in zip(self.chunk_shape, self.shape, offs)))


def _ints(value: Any, where: str, what: str, minimum: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int and v >= minimum for v in value):
        raise CorruptCheckpointError(f"{where}: {what} must be a list of integers >= {minimum}, got {value!r}")
    return tuple(value)


def _dtype(doc: dict[str, Any], attributes: dict[str, Any], where: str) -> DType:
    name = doc.get("data_type")
    stored = attributes.get(DTYPE_ATTR)
    if isinstance(name, str) and name in _BY_NAME:
        dtype = _BY_NAME[name]
        if stored is not None and stored != name:
            raise CorruptCheckpointError(f"{where}: data_type {name!r} contradicts attribute {DTYPE_ATTR}={stored!r}")
        return dtype
    if isinstance(name, str) and name[:1] == "r" and name[1:].isdigit():
        found = _TORCH_NAMES.get(stored) if isinstance(stored, str) else None
        if found is None:
            raise UnsupportedFormatError(f"{where}: raw data type {name!r} without a torch dtype in {DTYPE_ATTR}")
        if int(name[1:]) != found.itemsize * 8:
            raise CorruptCheckpointError(f"{where}: data_type {name!r} does not have the size of {stored}")
        return found
    raise UnsupportedFormatError(f"{where}: data_type {name!r} has no torch equivalent")


def _key_encoding(value: Any, where: str) -> tuple[str, str]:
    if not isinstance(value, dict) or value.get("name") not in ("default", "v2"):
        raise UnsupportedFormatError(f"{where}: chunk_key_encoding {value!r} is not 'default' or 'v2'")
    config = value.get("configuration") or {}
    default = "/" if value["name"] == "default" else "."
    sep = config.get("separator", default) if isinstance(config, dict) else None
    if sep not in ("/", "."):
        raise CorruptCheckpointError(f"{where}: chunk key separator {sep!r} is not '/' or '.'")
    return ("c" if value["name"] == "default" else ""), sep


def parse_array_meta(doc: dict[str, Any], where: str) -> ArrayMeta:
    """Validate an array's ``zarr.json``: everything a reader relies on, before any chunk is read."""
    attributes = doc.get("attributes") or {}
    if not isinstance(attributes, dict):
        raise CorruptCheckpointError(f"{where}: attributes is not an object")
    shape = _ints(doc.get("shape"), where, "shape", 0)
    grid = doc.get("chunk_grid")
    if not isinstance(grid, dict) or grid.get("name") != "regular" or not isinstance(grid.get("configuration"), dict):
        raise UnsupportedFormatError(f"{where}: chunk_grid {grid!r} is not a regular grid")
    chunks = _ints(grid["configuration"].get("chunk_shape"), where, "chunk_shape", 1)
    if len(chunks) != len(shape):
        raise CorruptCheckpointError(f"{where}: chunk_shape {list(chunks)} does not match shape {list(shape)}")
    if doc.get("storage_transformers"):
        raise UnsupportedFormatError(f"{where}: storage transformers are not supported")
    codecs = doc.get("codecs")
    if not isinstance(codecs, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in codecs):
        raise CorruptCheckpointError(f"{where}: codecs must be a list of {{'name': ...}} objects")
    dtype = _dtype(doc, attributes, where)
    prefix, sep = _key_encoding(doc.get("chunk_key_encoding"), where)
    fill = fill_bytes(dtype, doc.get("fill_value"), where)
    return ArrayMeta(shape, dtype, chunks, codecs, fill, prefix, sep, attributes)


def array_meta_json(shape: tuple[int, ...], dtype: DType, chunk_shape: tuple[int, ...],
                    codecs: list[dict[str, Any]], attributes: dict[str, Any]) -> bytes:
    """An array's ``zarr.json`` as zarr-python and tensorstore write it (default chunk keys)."""
    doc = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": zarr_dtype_name(dtype),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": _fill_json(dtype),
        "codecs": codecs,
        "attributes": {DTYPE_ATTR: dtype.name, **attributes},
    }
    return json.dumps(doc, indent=2, allow_nan=False).encode()


def group_meta_json(attributes: dict[str, Any]) -> bytes:
    doc = {"zarr_format": 3, "node_type": "group", "attributes": attributes}
    return json.dumps(doc, indent=2, allow_nan=False).encode()

