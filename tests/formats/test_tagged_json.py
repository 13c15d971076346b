"""Tagged JSON (objects in safetensors metadata and zarr attributes): every value it takes
comes back with the same types and bits through real JSON text; everything else is refused;
what earlier versions wrote still reads."""

from __future__ import annotations

import collections
import datetime
import enum
import json
import struct

import numpy as np
import pytest
import torch

from reshard.core import dtypes
from reshard.core.tagged_json import Unencodable, decode_value, encode_value
from reshard.core.values import difference


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


def _exactly(x, y) -> bool:
    """Same type at every level and the same bits (reshard's own comparison of values)."""
    return type(x) is type(y) and difference(x, y) is None


_UTC2 = datetime.timezone(datetime.timedelta(hours=2), "CEST")


@pytest.mark.parametrize("value", [
    {3, 1, 2}, {"b", "a", (1, 2)}, set(), frozenset({1.5, None}), {"in": [frozenset()]},
    complex(1.0, -2.5), complex(_float(0xFFF8000000000123), float("-inf")), complex(-0.0, 0.0),
    bytearray(b"\x00\xffxy"), bytearray(),
    collections.OrderedDict([("b", 1), ("a", (2,))]), collections.OrderedDict([(1, "int key"), ("__set__", 2)]),
    collections.OrderedDict(), [collections.OrderedDict(x=collections.OrderedDict())],
    torch.Size([2, 3]), torch.Size([]), torch.device("cpu"), torch.device("cuda", 1), torch.device("meta"),
    np.float32(1.5), np.float32(_float(0xFFF8000000000123)), np.float16(-0.0), np.float64(0.1), np.int64(-7),
    np.uint8(255), np.bool_(True), np.complex64(1 - 2j), np.int8(-128), np.datetime64("2024-05-06T07:08", "ns"),
    np.timedelta64(5, "s"),
    datetime.datetime(2024, 5, 6, 7, 8, 9, 123456), datetime.datetime(2024, 5, 6, tzinfo=_UTC2),
    datetime.datetime(2024, 11, 3, 1, 30, fold=1, tzinfo=datetime.timezone.utc), datetime.date(2024, 5, 6),
    datetime.time(7, 8, 9, 10, tzinfo=datetime.timezone(-datetime.timedelta(minutes=90))),
    datetime.timedelta(days=-1, seconds=2, microseconds=3), datetime.timezone.utc, _UTC2,
], ids=lambda v: type(v).__name__)
def test_the_types_a_config_holds_come_back_as_themselves(value) -> None:
    """A safetensors output dropped these, a notice each (the README says objects travel in
    every output format): torch.Size, OrderedDict, numpy scalars, datetime, complex, set,
    bytearray; torch.device, frozenset and the rest of datetime with them."""
    back = _round_trip(value)
    assert _exactly(back, value), (back, value)
    if isinstance(value, collections.OrderedDict):
        assert list(back) == list(value)
    if isinstance(value, datetime.datetime):
        assert back.fold == value.fold and back.tzinfo == value.tzinfo
        assert (back.tzname(), type(back.tzinfo)) == (value.tzname(), type(value.tzinfo))


def test_a_set_is_written_the_same_whatever_the_hash_seed() -> None:
    """Sets iterate in hash order, which for strings changes from one process to the next:
    the output's bytes do not."""
    assert json.dumps(encode_value({"b", "a", "c"})) == json.dumps(encode_value({"c", "b", "a"})) \
        == '{"__set__": ["a", "b", "c"]}'


def test_dtypes_come_back_as_dtypes() -> None:
    assert _round_trip(torch.bfloat16) is dtypes.by_name("bfloat16")
    assert _round_trip([dtypes.by_name("float8_e4m3fn"), torch.float32]) == [dtypes.by_name("float8_e4m3fn"),
                                                                            dtypes.by_name("float32")]


class _Mode(enum.IntEnum):
    A = 1


class _Ratio(float):
    pass


class _Zone(datetime.tzinfo):
    def utcoffset(self, dt):
        return datetime.timedelta(hours=1)


@pytest.mark.parametrize("value, named", [
    (collections.Counter(a=2), "Counter"), (collections.defaultdict(list), "defaultdict"), (_Mode.A, "_Mode"),
    (_Ratio(0.5), "_Ratio"), (torch.ones(1), "Tensor"), (2**20_000, "int of 20001 bits"),
    ({"k": [collections.Counter()]}, "Counter"), (collections.deque([1]), "deque"), (np.ones(2), "ndarray"),
    (np.str_("x"), "str_"), (frozenset({1, (2, _Mode.A)}), "_Mode"), (datetime.datetime(2024, 1, 1, tzinfo=_Zone()), "_Zone"),
    (collections.OrderedDict(a=collections.deque()), "deque"),
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
    {"__set__": [[1]]}, {"__set__": "ab"}, {"__frozenset__": [{"a": 1}]}, {"__complex__": [1.0]},
    {"__complex__": [1.0, "x"]}, {"__bytearray__": "zz"}, {"__odict__": [[[1], 2]]}, {"__odict__": [1]},
    {"__size__": [1.5]}, {"__size__": [True]}, {"__device__": "no such device"}, {"__device__": 1},
    {"__numpy__": ["|O8", ""]}, {"__numpy__": ["<f4", "0000"]}, {"__numpy__": ["<U1", "00000000"]},
    {"__numpy__": ["not a dtype", ""]}, {"__numpy__": ["V4", "00000000"]},
    {"__datetime__": [2024, 13, 1, 0, 0, 0, 0, None, 0]}, {"__datetime__": [2024, 1, 1]},
    {"__date__": ["2024", 1, 1]}, {"__time__": [25, 0, 0, 0, None, 0]}, {"__timedelta__": [1e9, 0, 0]},
    {"__timezone__": [{"__timedelta__": [1, 0, 0]}, None]}, {"__timezone__": [3600, None]},
], ids=lambda v: json.dumps(v))
def test_what_it_could_not_have_written_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="malformed"):
        decode_value(bad)
