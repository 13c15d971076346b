"""Objects as JSON that reads back as the same value: the same types and the same bits.

safetensors ``__metadata__`` holds strings and zarr attributes hold JSON, so the objects a
checkpoint keeps beside its tensors (a step, a config, an optimizer's hyperparameters) travel
there as JSON. Plain JSON turns tuples into lists and int keys into strings, and has no token
for inf or NaN; a few single-key tagged objects keep each such value exact:

- ``{"__tuple__": [...]}``, ``{"__bytes__": "<hex>"}``, and ``{"__dict__": [[key, value], ...]}``
  for a dict whose keys are not all strings (or a real dict whose one key is a tag name);
- ``{"__float__": "inf" | "-inf" | "nan"}``, and any other NaN (a payload, a sign bit) as its
  64 bits, ``{"__float__": "0xfff8000000000123"}``. Finite floats are JSON numbers, which
  Python writes and reads back bit for bit (``-0.0`` included);
- ``{"__dtype__": "bfloat16"}``: a torch dtype, read back as ``reshard.core.dtypes.DType``.

Anything else is refused (``Unencodable``), never written as something close: subclasses
(an OrderedDict, a Counter or an IntEnum would come back as their base type), sets, complex
numbers, tensors, classes, ints too long for Python to read back as text. Stores written before
NaN bits and dtypes were tagged read as they did: their ``"nan"`` is the canonical quiet NaN.
"""

from __future__ import annotations

import math
import re
import struct
from typing import Any

from reshard.core import dtypes

__all__ = ["Unencodable", "encode_value", "decode_value"]

_TAGS = ("__tuple__", "__dict__", "__float__", "__bytes__", "__dtype__")
_QUIET_NAN_BITS = 0x7FF8000000000000  # float("nan") in CPython, what "nan" always read back as
_NAMED_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": struct.unpack("<d", struct.pack("<Q", _QUIET_NAN_BITS))[0]}
_BITS = re.compile(r"0x[0-9a-f]{16}")
# Python refuses to read an int of more than 4300 digits from text (sys.int_info.default_max_str_digits).
_MAX_INT_BITS = 14_000


class Unencodable(TypeError):
    """A value (or a value inside it) that tagged JSON cannot hold exactly."""


def _bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def _encode_float(v: float) -> Any:
    if math.isfinite(v):
        return v
    if math.isinf(v):
        return {"__float__": repr(v)}
    bits = _bits(v)
    return {"__float__": "nan" if bits == _QUIET_NAN_BITS else f"0x{bits:016x}"}


def encode_value(v: Any) -> Any:
    """``v`` as JSON-ready data that ``decode_value`` turns back into a value of the same
    types and bits; raises Unencodable for anything it could not give back exactly."""
    if v is None or type(v) in (bool, str):
        return v
    if type(v) is int:
        if v.bit_length() > _MAX_INT_BITS:
            raise Unencodable(f"int of {v.bit_length()} bits")
        return v
    if type(v) is float:
        return _encode_float(v)
    if type(v) is list:
        return [encode_value(x) for x in v]
    if type(v) is tuple:
        return {"__tuple__": [encode_value(x) for x in v]}
    if type(v) is bytes:
        return {"__bytes__": v.hex()}
    if type(v) is dict:
        if all(type(k) is str for k in v) and not (len(v) == 1 and next(iter(v)) in _TAGS):
            return {k: encode_value(x) for k, x in v.items()}
        return {"__dict__": [[encode_value(k), encode_value(x)] for k, x in v.items()]}
    if dtypes.is_dtype(v):
        try:
            return {"__dtype__": dtypes.of(v).name}
        except KeyError:  # a torch dtype newer than reshard's table
            raise Unencodable(f"dtype {v}") from None
    raise Unencodable(type(v).__name__)


def _decode_float(body: Any) -> float:
    if isinstance(body, str) and body in _NAMED_FLOATS:
        return _NAMED_FLOATS[body]
    if isinstance(body, str) and _BITS.fullmatch(body):
        value = struct.unpack("<d", struct.pack("<Q", int(body, 16)))[0]
        if math.isnan(value):  # other floats are written as numbers or names
            return value
    raise ValueError(f"malformed __float__ value {body!r}")


def decode_value(v: Any) -> Any:
    """Inverse of ``encode_value``; raises ValueError on data it could not have written."""
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if not isinstance(v, dict):
        return v
    if len(v) != 1 or next(iter(v)) not in _TAGS:
        return {k: decode_value(x) for k, x in v.items()}
    tag, body = next(iter(v.items()))
    if tag == "__float__":
        return _decode_float(body)
    if tag == "__bytes__" and isinstance(body, str):
        return bytes.fromhex(body)
    if tag == "__tuple__" and isinstance(body, list):
        return tuple(decode_value(x) for x in body)
    if tag == "__dict__" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
        return {_hashable(decode_value(k)): decode_value(x) for k, x in body}
    if tag == "__dtype__" and isinstance(body, str) and body in dtypes.DTYPES:
        return dtypes.by_name(body)
    raise ValueError(f"malformed {tag} value {body!r}")


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise ValueError(f"dict key {key!r} is not hashable") from None
    return key
