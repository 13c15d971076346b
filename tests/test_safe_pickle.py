from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from reshard.core.errors import CorruptCheckpointError, UnsafeCheckpointError
from reshard.safe_pickle.unpickler import safe_loads
from tests.dist import HANG_GUARD


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_code_in_a_pickle_is_refused_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = pickle.dumps({"x": _Evil(marker)})
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system"):
        safe_loads(data, {}, origin="evil.pkl")
    assert not marker.exists()


def test_plain_containers_load_and_garbage_is_corrupt() -> None:
    value = {"a": [1, 2.5, (3, None)], "b": {"c": True}, "s": {1, 2}}
    assert safe_loads(pickle.dumps(value), {}, origin="ok.pkl") == value
    with pytest.raises(CorruptCheckpointError, match="bad.pkl"):
        safe_loads(b"\x80\x04not a pickle", {}, origin="bad.pkl")


def test_protocol_2_bytes_and_sets_load_as_torch_save_writes_them(tmp_path: Path) -> None:
    """torch.save pickles with protocol 2: bytes become _codecs.encode(str, "latin1"), b""
    becomes __builtin__.bytes(), sets __builtin__.set. A real torch.save file, read by our reader."""
    import torch
    from reshard.formats.torch.zip import read_torch_zip

    value = {"b": b"abc\x00\xff", "e": b"", "ba": bytearray(b"xy"), "s": {1, 2}, "fs": frozenset([3]), "w": torch.ones(2)}
    path = tmp_path / "objects.pt"
    torch.save(value, path)
    got = read_torch_zip(path)
    assert {k: got[k] for k in value if k != "w"} == {k: v for k, v in value.items() if k != "w"}
    assert type(got["b"]) is bytes and type(got["ba"]) is bytearray


@pytest.mark.parametrize("payload", [
    b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00abcX\x0a\x00\x00\x00zlib_codec\x86R.",  # another codec
    b"\x80\x02c__builtin__\nbytes\nJ\x00\xca\x9a;\x85R.",  # bytes(10**9): an allocation, not data
])
def test_protocol_2_helpers_take_data_only(payload: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match="only"):
        safe_loads(payload, {}, origin="x.pkl")


# ---------------------------------------------------------------------------------- harmless values


def test_common_values_are_built_as_their_own_types() -> None:
    """What Megatron, fairseq, torchtitan and friends keep beside tensors, from data only."""
    import argparse
    import collections
    import datetime
    import io
    import random

    import numpy as np

    from reshard.core.values import difference
    from reshard.safe_pickle.value_types import VALUE_GLOBALS

    rs = np.random.RandomState(3)
    rs.randn(5)
    value = {
        "bio": io.BytesIO(b"state\x00bytes"), "args": argparse.Namespace(lr=0.1, layers=[1, 2]),
        "arr": np.arange(12, dtype=np.float32).reshape(3, 4), "fortran": np.asfortranarray(np.arange(6).reshape(2, 3)),
        "objects": np.array(["a", None, 3], dtype=object), "big_endian": np.dtype(">i4"),
        "dates": np.array([1, 2], dtype="M8[ns]"), "scalar": np.float64(2.5), "text": np.array(["ab", "c"]),
        "numpy_rng": np.random.get_state(), "od": collections.OrderedDict(a=1), "dd": collections.defaultdict(list, a=[1]),
        "dq": collections.deque([1, 2], maxlen=5), "cnt": collections.Counter("aab"), "py_rng": random.getstate(),
        "when": datetime.datetime(2024, 5, 1, tzinfo=datetime.timezone.utc), "delta": datetime.timedelta(days=2),
    }
    for protocol in (2, 4):
        got = safe_loads(pickle.dumps(value, protocol=protocol), VALUE_GLOBALS, origin="v.pkl")
        assert difference(got, value) is None
        assert got["bio"].getvalue() == value["bio"].getvalue() and got["dd"].default_factory is list
        assert got["fortran"].flags.f_contiguous and got["dq"].maxlen == 5
    rngs = {"rs": rs, "gen": np.random.default_rng(5), "seq": np.random.SeedSequence(7)}
    got = safe_loads(pickle.dumps(rngs, protocol=2), VALUE_GLOBALS, origin="rng.pkl")
    assert difference(got["rs"].get_state(), rs.get_state()) is None
    assert got["gen"].bit_generator.state == rngs["gen"].bit_generator.state
    assert got["gen"].random() == np.random.default_rng(5).random()  # the same stream continues
    assert (got["seq"].entropy, got["seq"].pool.tolist()) == (7, rngs["seq"].pool.tolist())


class _Reduce:
    def __init__(self, func: object, args: tuple, state: object = None) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


@pytest.mark.parametrize("case", ["structured_dtype_out_of_bounds", "ndarray_allocates",
                                  "reconstruct_allocates", "array_bytes_short", "mt19937_pos", "counter_from_list",
                                  "defaultdict_factory"])
def test_numpy_and_collections_take_data_only(case: str) -> None:
    """numpy trusts its pickles; reshard does not: each of these is refused before numpy sees it."""
    import collections

    import numpy as np
    from numpy._core.multiarray import _reconstruct
    from numpy.random._pickle import __bit_generator_ctor as bit_generator_ctor

    from reshard.safe_pickle.value_types import VALUE_GLOBALS

    bad_dtype = _Reduce(np.dtype, ("V8", False, True), (3, "|", None, ("a",), {"a": (np.dtype("O"), 1000)}, 8, 1, 63))
    mt = np.random.MT19937(0)
    state = mt.state
    state["state"]["pos"] = 10**6
    payload = {
        # A field past the itemsize: numpy writes the objects outside the buffer (segfault).
        "structured_dtype_out_of_bounds": _Reduce(_reconstruct, (np.ndarray, (0,), b"b"), (1, (2,), bad_dtype, False, [None,
                                                                                                                       None])),
        "ndarray_allocates": _Reduce(np.ndarray, ((1 << 40,), "b")),
        "reconstruct_allocates": _Reduce(_reconstruct, (np.ndarray, (1 << 40,), b"b")),
        "array_bytes_short": _Reduce(_reconstruct, (np.ndarray, (0,), b"b"), (1, (1 << 30,), np.dtype("f8"), False, b"")),
        "mt19937_pos": _Reduce(bit_generator_ctor, ("MT19937",), (state, None)),  # reads past the key on a draw
        "counter_from_list": _Reduce(collections.Counter, (["a"] * 3,)),
        "defaultdict_factory": _Reduce(collections.defaultdict, (np.ndarray,)),
    }[case]
    with pytest.raises(CorruptCheckpointError, match="x.pkl: cannot be unpickled"):
        safe_loads(pickle.dumps(payload, protocol=2), VALUE_GLOBALS, origin="x.pkl")


def test_the_numpy_payload_is_live(tmp_path: Path) -> None:
    """Positive control for the structured-dtype case: plain pickle crashes the interpreter."""
    import subprocess
    import sys

    code = ("import pickle, numpy as np\nfrom numpy._core.multiarray import _reconstruct\n"
            "class R:\n    def __init__(s, f, a, st): s.f, s.a, s.st = f, a, st\n    def __reduce__(s): return (s.f, s.a, s.st)\n"
            "d = R(np.dtype, ('V8', False, True), (3, '|', None, ('a',), {'a': (np.dtype('O'), 1000)}, 8, 1, 63))\n"
            "pickle.loads(pickle.dumps(R(_reconstruct, (np.ndarray, (0,), b'b'), (1, (4096,), d, False, [None] * 4096))))\n"
            "print('survived')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD)
    assert proc.returncode == -11 and "survived" not in proc.stdout  # SIGSEGV


def test_a_global_cannot_be_changed_by_build() -> None:
    """BUILD on a class or function the pickle names would set attributes on it for every later
    load in the process; every global handed out is sealed."""
    import argparse

    from reshard.safe_pickle.value_types import VALUE_GLOBALS

    for target in (b"cargparse\nNamespace\n", b"c_codecs\nencode\n", b"ccollections\nCounter\n"):
        payload = b"\x80\x02" + target + b"N}X\x07\x00\x00\x00__new__K\x01s\x86b."  # BUILD (None, {"__new__": 1})
        with pytest.raises(CorruptCheckpointError, match="cannot be unpickled"):
            safe_loads(payload, VALUE_GLOBALS, origin="x.pkl")
    assert argparse.Namespace.__new__ is object.__new__


# ---------------------------------------------------------------------------------- opt-in and placeholders


def _pickled_unknown() -> bytes:
    """A pickle naming a class and a function of a module that exists only while it is written."""
    import sys
    import types

    module = types.ModuleType("no_such_pkg.conf")
    config = type("Config", (), {"__module__": module.__name__})
    make = types.FunctionType((lambda x: x).__code__, {}, "make")
    make.__module__, make.__qualname__ = module.__name__, "make"
    module.Config, module.make = config, make
    call = _Reduce(make, (7,))
    cfg = config()
    cfg.lr = 0.1
    sys.modules.update({"no_such_pkg": types.ModuleType("no_such_pkg"), "no_such_pkg.conf": module})
    try:
        return pickle.dumps({"cfg": cfg, "cls": config, "call": call}, protocol=2)
    finally:
        del sys.modules["no_such_pkg"], sys.modules["no_such_pkg.conf"]


def test_a_class_nobody_allowed_is_named_with_the_way_to_opt_in() -> None:
    from reshard.safe_pickle.value_types import VALUE_GLOBALS

    with pytest.raises(UnsafeCheckpointError) as e:
        safe_loads(_pickled_unknown(), VALUE_GLOBALS, origin="ckpt.pt", stand_ins=True)
    assert str(e.value) == (
        "ckpt.pt: refers to no_such_pkg.conf.Config, which is not on reshard's allow-list of checkpoint types; refusing "
        "to load it (it could run code). If the file is trusted, pass --allow-class no_such_pkg.conf.Config "
        "(reshard.allow_classes() in Python) to read it as inert data: its code is never run.")


def test_allowed_classes_are_inert_and_pickle_back_under_their_names() -> None:
    import pickletools
    import sys

    from reshard.formats.torch.zip_write import torch_pickle

    from reshard.safe_pickle.inert import Inert
    from reshard.safe_pickle.unpickler import allow_classes, allowed_classes
    from reshard.safe_pickle.value_types import VALUE_GLOBALS

    assert allowed_classes() == frozenset()
    with allow_classes(["no_such_pkg.conf.Config", "no_such_pkg.conf:make"]):
        assert allowed_classes() == {"no_such_pkg.conf.Config", "no_such_pkg.conf.make"}
        got = safe_loads(_pickled_unknown(), VALUE_GLOBALS, origin="ckpt.pt", stand_ins=True)
        again = safe_loads(_pickled_unknown(), VALUE_GLOBALS, origin="ckpt.pt", stand_ins=True)
    assert allowed_classes() == frozenset() and "no_such_pkg" not in sys.modules
    cfg = got["cfg"]
    assert isinstance(cfg, Inert) and (cfg.how, cfg.args, cfg.state) == ("new", (), {"lr": 0.1})
    assert got["cls"] is type(cfg) and got["call"].how == "call" and got["call"].args == (7,)
    assert got == again  # values compare as data
    data = torch_pickle(got)
    names = [arg for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"]
    assert names == ["no_such_pkg.conf Config", "no_such_pkg.conf make"]
    with allow_classes(["no_such_pkg.conf.Config", "no_such_pkg.conf.make"]):
        assert safe_loads(data, VALUE_GLOBALS, origin="out.pt", stand_ins=True) == got
    with pytest.raises(UnsafeCheckpointError, match="refers to no_such_pkg.conf.Config"):  # closed: refused again
        safe_loads(data, VALUE_GLOBALS, origin="out.pt", stand_ins=True)


def test_code_execution_primitives_cannot_be_allowed() -> None:
    from reshard.core.errors import UsageError
    from reshard.safe_pickle.unpickler import allow_classes, refusal_message

    for name in ("os.system", "posix.system", "builtins.eval", "subprocess.Popen", "torch.load", "importlib.import_module"):
        with pytest.raises(UsageError, match="can run code when loaded"):
            allow_classes([name])
    with pytest.raises(UsageError, match="expected a name such as module.ClassName"):
        allow_classes(["Config"])
    assert "--allow-class" not in refusal_message("x.pt", "posix.system", opt_in=True)


def test_deferred_placeholders_absorb_everything_and_call_nothing(tmp_path: Path) -> None:
    from reshard.safe_pickle.inert import Refused, is_refused
    from reshard.safe_pickle.unpickler import safe_loads_deferred
    from reshard.safe_pickle.value_types import VALUE_GLOBALS

    marker = tmp_path / "pwned"
    value = {"x": _Evil(marker), "ok": [1, {2}], "inside": [_Reduce(bytearray, (_Evil(marker),))]}
    got = safe_loads_deferred(pickle.dumps(value, protocol=2), VALUE_GLOBALS, origin="p.pkl")
    assert got.refused in (("posix.system",), ("os.system",))
    assert isinstance(got.value["x"], Refused) and got.value["ok"] == [1, {2}]
    assert is_refused(got.value["inside"][0])  # an allowed function handed a placeholder returns it
    assert not marker.exists()
    many = b"\x80\x02(" + b"".join(b"cmod%d\nC\n" % i for i in range(300)) + b"l."
    with pytest.raises(UnsafeCheckpointError, match="mod256.C"):
        safe_loads_deferred(many, {}, origin="many.pkl")
