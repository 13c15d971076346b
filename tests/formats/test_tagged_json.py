"""Tagged JSON (objects in safetensors metadata and zarr attributes): every value it takes
comes back with the same types and bits through real JSON text; everything else is refused;
what earlier versions wrote still reads."""

from __future__ import annotations

import collections
import enum
import json
import struct

import pytest
import torch

from reshard.core import dtypes
from reshard.core.tagged_json import Unencodable, decode_value, encode_value


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def _same(x, y) -> bool:
    """Python's own view, made strict: same type at every level, floats by their bits."""
    if type(x) is not type(y):
        return False
    if type(x) is float:
        return struct.pack("<d", x) == struct.pack("<d", y)
    if type(x) in (list, tuple):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    if type(x) is dict:
        return len(x) == len(y) and all(_same(a, b) and _same(x[a], y[b]) for a, b in zip(x, y))
    return x == y


def _round_trip(value):
    return decode_value(json.loads(json.dumps(encode_value(value), allow_nan=False)))


@pytest.mark.parametrize("value", [
    _float(0xFFF8000000000123), _float(0x7FF0000000000001), _float(0xFFF8000000000000), float("nan"),
    -0.0, float("inf"), float("-inf"), 5e-324, 1.7976931348623157e308, 0.1,
    (1, 2.5, (None,)), [(), []], {"a": -0.0, "b": [True, 1, 1.0]}, {0: "int key", "0": "str key", (1, 2): 3},
    {_float(0xFFF8000000000123): 1}, {"__float__": "inf"}, {"__dtype__": "bfloat16"}, b"\x00\xff", "\ud800 lone",
    2**13_000, -(2**64), True,
], ids=lambda v: type(v).__name__)  # str() of a long int fails
def test_values_come_back_with_their_types_and_bits(value) -> None:
    assert _same(_round_trip(value), value)


def test_dtypes_come_back_as_dtypes() -> None:
    assert _round_trip(torch.bfloat16) is dtypes.by_name("bfloat16")
    assert _round_trip([dtypes.by_name("float8_e4m3fn"), torch.float32]) == [dtypes.by_name("float8_e4m3fn"),
                                                                            dtypes.by_name("float32")]


class _Mode(enum.IntEnum):
    A = 1


class _Ratio(float):
    pass


@pytest.mark.parametrize("value, named", [
    (collections.OrderedDict(a=1), "OrderedDict"), (collections.Counter(a=2), "Counter"),
    (collections.defaultdict(list), "defaultdict"), (_Mode.A, "_Mode"), (_Ratio(0.5), "_Ratio"),
    ({1, 2}, "set"), (1 + 2j, "complex"), (bytearray(b"x"), "bytearray"), (torch.ones(1), "Tensor"),
    (2**20_000, "int of 20001 bits"), ({"k": [collections.OrderedDict()]}, "OrderedDict"),
], ids=lambda v: v if isinstance(v, str) else type(v).__name__)
def test_what_would_come_back_as_something_else_is_refused(value, named: str) -> None:
    with pytest.raises(Unencodable, match=named):
        encode_value(value)


def test_what_earlier_versions_wrote_still_reads() -> None:
    old = {"x": {"__float__": "nan"}, "y": {"__float__": "-inf"}, "t": {"__tuple__": [1]}, "d": {"__dict__": [[1, 2]]}}
    back = decode_value(old)
    assert struct.pack("<d", back["x"]) == struct.pack("<Q", 0x7FF8000000000000)  # the canonical quiet NaN
    assert back["y"] == float("-inf") and back["t"] == (1,) and back["d"] == {1: 2}


@pytest.mark.parametrize("bad", [
    {"__float__": "0x3ff0000000000000"},  # 1.0: finite floats are written as numbers
    {"__float__": "0xfff8"}, {"__float__": "NaN"}, {"__dtype__": "float128"}, {"__dtype__": 3},
])
def test_what_it_could_not_have_written_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="malformed"):
        decode_value(bad)
