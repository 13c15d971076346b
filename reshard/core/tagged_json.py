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
- ``{"__dtype__": "bfloat16"}``: a torch dtype, read back as ``reshard.core.dtypes.DType``;
- what a config or a training state holds beside those, each read back as its own type:
  ``{"__set__": [...]}`` and ``{"__frozenset__": [...]}`` (items in a fixed order, so the
  bytes do not depend on the hash seed), ``{"__complex__": [real, imag]}`` (floats as above),
  ``{"__bytearray__": "<hex>"}``, ``{"__odict__": [[key, value], ...]}`` (an ``OrderedDict``),
  ``{"__size__": [2, 3]}`` and ``{"__device__": "cuda:1"}`` (``torch.Size``, ``torch.device``:
  reading them imports torch), ``{"__numpy__": ["<f4", "<hex>"]}`` (a numpy scalar: its dtype
  and its bytes), and ``datetime``'s ``__datetime__``, ``__date__``, ``__time__``,
  ``__timedelta__`` and ``__timezone__`` (their fields, fold and fixed-offset zone included).

Anything else is refused (``Unencodable``), never written as something close: other subclasses
(a Counter, a defaultdict or an IntEnum would come back as their base type), deques, numpy
arrays, tensors, classes, zones other than a fixed offset, ints too long for Python to read
back as text. Stores written before NaN bits and dtypes were tagged read as they did: their
``"nan"`` is the canonical quiet NaN.
"""

from __future__ import annotations

import collections
import datetime
import json
import math
import re
import struct
import sys
from typing import Any

import numpy as np

from reshard.core import dtypes

__all__ = ["Unencodable", "encode_value", "decode_value"]

# The tags of the types JSON has a form for but not the type (tuples, non-str keys, floats it
# has no token for, bytes, dtypes), then those of the values configs hold beside them.
_TAGS = ("__tuple__", "__dict__", "__float__", "__bytes__", "__dtype__", "__set__", "__frozenset__", "__complex__",
         "__bytearray__", "__odict__", "__size__", "__device__", "__numpy__", "__datetime__", "__date__", "__time__",
         "__timedelta__", "__timezone__")
_NUMPY_KINDS = "biufcmM"  # numpy scalars of these kinds are their bytes: bool, ints, floats, complex, times
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
    typed = _encode_typed(v)
    if typed is None:
        raise Unencodable(type(v).__name__)
    return typed


def _in_order(items: Any) -> list[Any]:
    """A set's items encoded, in the order of their JSON text: the same bytes in every process."""
    return sorted((encode_value(x) for x in items), key=lambda e: json.dumps(e, sort_keys=True))


def _zone(tz: Any) -> Any:
    if tz is None or type(tz) is datetime.timezone:
        return encode_value(tz)
    raise Unencodable(type(tz).__name__)  # a zone with rules (zoneinfo, pytz): not data JSON can hold


def _encode_typed(v: Any) -> dict[str, Any] | None:
    """The tagged form of the values configs hold beside plain JSON; None for another type."""
    t = type(v)
    if t is set or t is frozenset:
        return {"__set__" if t is set else "__frozenset__": _in_order(v)}
    if t is complex:
        return {"__complex__": [_encode_float(v.real), _encode_float(v.imag)]}
    if t is bytearray:
        return {"__bytearray__": v.hex()}
    if t is collections.OrderedDict:
        return {"__odict__": [[encode_value(k), encode_value(x)] for k, x in v.items()]}
    if t is datetime.timedelta:
        return {"__timedelta__": [v.days, v.seconds, v.microseconds]}
    if t is datetime.date:
        return {"__date__": [v.year, v.month, v.day]}
    if t is datetime.time:
        return {"__time__": [v.hour, v.minute, v.second, v.microsecond, _zone(v.tzinfo), v.fold]}
    if t is datetime.datetime:
        return {"__datetime__": [v.year, v.month, v.day, v.hour, v.minute, v.second, v.microsecond, _zone(v.tzinfo),
                                 v.fold]}
    if t is datetime.timezone:
        offset, *name = v.__getinitargs__()  # how pickle rebuilds one: the offset, and the name if one was given
        return {"__timezone__": [encode_value(offset), name[0] if name else None]}
    if isinstance(v, np.generic) and v.dtype.kind in _NUMPY_KINDS:
        return {"__numpy__": [v.dtype.str, v.tobytes().hex()]}
    torch = sys.modules.get("torch")  # not imported: nothing can be a torch.Size or a device
    if torch is not None and t is torch.Size:
        return {"__size__": list(v)}
    if torch is not None and t is torch.device:
        return {"__device__": str(v)}
    return None


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
    try:
        value = _decode_typed(tag, body)
    except (ValueError, TypeError, OverflowError, RuntimeError):  # a constructor's refusal (torch's is RuntimeError)
        value = None
    if value is None:
        raise ValueError(f"malformed {tag} value {body!r}")
    return value


def _ints(body: Any, n: int) -> list[int]:
    if not (isinstance(body, list) and len(body) == n and all(type(x) is int for x in body)):
        raise ValueError("not integers")
    return body


def _decode_zone(body: Any) -> datetime.timezone | None:
    zone = decode_value(body)
    if zone is not None and type(zone) is not datetime.timezone:
        raise ValueError("not a timezone")
    return zone


def _decode_typed(tag: str, body: Any) -> Any:
    """The value of one of ``_encode_typed``'s tags; None (or a constructor's error) for a body
    it could not have written."""
    if tag in ("__set__", "__frozenset__") and isinstance(body, list):
        items = [_hashable(decode_value(x)) for x in body]
        return set(items) if tag == "__set__" else frozenset(items)
    if tag == "__complex__" and isinstance(body, list) and len(body) == 2:
        real, imag = (decode_value(x) for x in body)
        return complex(real, imag) if type(real) is float and type(imag) is float else None
    if tag == "__bytearray__" and isinstance(body, str):
        return bytearray.fromhex(body)
    if tag == "__odict__" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
        return collections.OrderedDict((_hashable(decode_value(k)), decode_value(x)) for k, x in body)
    if tag == "__timedelta__":
        value = datetime.timedelta(*_ints(body, 3))
        return value if [value.days, value.seconds, value.microseconds] == body else None  # as written: normalized
    if tag == "__date__":
        return datetime.date(*_ints(body, 3))
    if tag == "__time__" and isinstance(body, list) and len(body) == 6:
        h, mi, sec, us, fold = _ints(body[:4] + body[5:], 5)
        return datetime.time(h, mi, sec, us, _decode_zone(body[4]), fold=fold)
    if tag == "__datetime__" and isinstance(body, list) and len(body) == 9:
        y, mo, d, h, mi, sec, us, fold = _ints(body[:7] + body[8:], 8)
        return datetime.datetime(y, mo, d, h, mi, sec, us, _decode_zone(body[7]), fold=fold)
    if tag == "__timezone__" and isinstance(body, list) and len(body) == 2 and isinstance(body[1], (str, type(None))):
        offset = decode_value(body[0])
        if type(offset) is not datetime.timedelta:
            return None
        return datetime.timezone(offset) if body[1] is None else datetime.timezone(offset, body[1])
    if tag == "__numpy__" and isinstance(body, list) and len(body) == 2 and all(isinstance(x, str) for x in body):
        dtype, raw = np.dtype(body[0]), bytes.fromhex(body[1])
        if dtype.str != body[0] or dtype.kind not in _NUMPY_KINDS or len(raw) != dtype.itemsize:
            return None
        return np.frombuffer(raw, dtype)[0]
    if tag == "__size__":
        import torch

        return torch.Size(_ints(body, len(body) if isinstance(body, list) else -1))
    if tag == "__device__" and isinstance(body, str):
        import torch

        return torch.device(body)
    return None


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise ValueError(f"dict key {key!r} is not hashable") from None
    return key
