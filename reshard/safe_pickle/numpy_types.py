"""numpy values in pickles (arrays, scalars, dtypes, RNG states), built from data only.

numpy's own unpickling trusts its input: ``dtype.__setstate__`` accepts a structured dtype
whose field lies past its itemsize, and an object array of that dtype then writes outside its
buffer (a segfault here, found while writing this module); ``np.ndarray(shape)`` allocates
uninitialised memory of any size; an MT19937 state with ``pos`` past 624 reads past its key
on the next draw. So nothing a pickle names reaches numpy unchecked:

* ``numpy.dtype(...)`` takes a type string only and always makes a copy, as numpy's own
  pickles ask (BUILD never reaches a descriptor numpy shares); its BUILD state must be the
  one numpy itself writes for that type and byte order (datetime units included), so
  structured and subarray dtypes are refused;
* ``_reconstruct`` returns an empty array; BUILD must give a shape, one of those dtypes and
  exactly shape x itemsize bytes (or as many objects, which come from the same unpickler);
* scalars take exactly ``itemsize`` bytes; RNG states are checked before numpy's setters.

These BUILD checks need the pure-Python unpickler (the C one calls ``__setstate__`` itself):
``safe_pickle`` switches to it when a pickle names numpy. numpy is imported only then.
"""

from __future__ import annotations

import math
import re
from functools import cache
from typing import Any

from reshard.safe_pickle.inert import Sealed

__all__ = ["NUMPY_NAMES", "numpy_globals", "numpy_build"]

_MULTIARRAY = ("numpy.core.multiarray", "numpy._core.multiarray")
_NUMERIC = ("numpy.core.numeric", "numpy._core.numeric")
_RANDOM = "numpy.random._pickle"
_BIT_GENERATORS = {"numpy.random._mt19937": "MT19937", "numpy.random._pcg64": "PCG64",
                   "numpy.random._philox": "Philox", "numpy.random._sfc64": "SFC64"}
_TYPE_STRING = re.compile(r"[A-Za-z]{1,2}[0-9]{0,7}")
_MAX_POOL = 1024  # SeedSequence pool words; numpy's default is 4

NUMPY_NAMES: frozenset[tuple[str, str]] = frozenset(
    [(m, "_reconstruct") for m in _MULTIARRAY] + [(m, "scalar") for m in _MULTIARRAY]
    + [(m, "_frombuffer") for m in _NUMERIC]
    + [("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.random", "__RandomState_ctor"),
       (_RANDOM, "__randomstate_ctor"), (_RANDOM, "__generator_ctor"), (_RANDOM, "__bit_generator_ctor"),
       ("numpy.random._pcg64", "PCG64DXSM"), ("numpy.random.bit_generator", "SeedSequence"),
       ("numpy.random.bit_generator", "__pyx_unpickle_SeedSequence")]
    + list(_BIT_GENERATORS.items())
)


def _named(label: str, **attrs: Any) -> type:
    """A sealed class that only names something (ndarray, a bit generator): a pickle may pass
    it to the builders below, never call it (``np.ndarray(shape)`` allocates any size)."""

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"{label} may not be called from a pickle")

    return Sealed(label, (), {"__new__": __new__, "__module__": __name__, "__qualname__": label, **attrs})


def _data(raw: Any, what: str) -> bytes:
    if isinstance(raw, str):  # Python 2 pickles store bytes as latin-1 text
        raw = raw.encode("latin1")
    if not isinstance(raw, (bytes, bytearray)):
        raise ValueError(f"{what}: expected stored bytes, got {type(raw).__name__}")
    return bytes(raw)


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > 64 or not all(type(n) is int and n >= 0 for n in value):
        raise ValueError(f"{what}: shape {value!r} is not a tuple of sizes")
    return value


@cache
def numpy_globals() -> dict[tuple[str, str], Any]:
    import numpy as np

    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray  # type: ignore[no-redef]

    ndarray_name = _named("numpy.ndarray")
    seed_name = _named("numpy.random.bit_generator.SeedSequence")
    generators = {name: getattr(np.random, name) for name in ("MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64")}
    generator_names = {name: _named(f"numpy.random.{name}", bit_generator=name) for name in generators}

    def dtype(obj: Any, align: Any = False, copy: Any = False) -> Any:
        if not isinstance(obj, str) or not _TYPE_STRING.fullmatch(obj) or align not in (0, 1, False, True):
            raise ValueError(f"numpy.dtype({obj!r}, {align!r}): only a plain type string is accepted")
        out = np.dtype(obj, bool(align), True)  # a copy, as numpy's own pickles ask: BUILD never reaches a shared one
        if out.itemsize == 0:
            raise ValueError(f"numpy.dtype({obj!r}): unsized types are not accepted")
        return out

    def reconstruct(cls: Any, shape: Any, typecode: Any) -> Any:
        if cls is not ndarray_name or _shape(shape, "_reconstruct") != (0,):
            raise ValueError("numpy _reconstruct: only the empty ndarray numpy's pickles start from is accepted")
        return np.empty((0,), np.int8)

    def scalar(dt: Any, raw: Any = None) -> Any:
        if not isinstance(dt, np.dtype):
            raise ValueError("numpy scalar: the first argument is not a dtype")
        if dt.hasobject:
            return multiarray.scalar(dt, raw)
        raw = _data(raw, "numpy scalar")
        if len(raw) != dt.itemsize:
            raise ValueError(f"numpy scalar of {dt} holds {len(raw)} bytes, expected {dt.itemsize}")
        return multiarray.scalar(dt, raw)

    def frombuffer(buf: Any, dt: Any, shape: Any, order: Any) -> Any:
        raw = _data(buf, "numpy _frombuffer")
        if not isinstance(dt, np.dtype) or dt.hasobject or order not in ("C", "F"):
            raise ValueError("numpy _frombuffer: bad dtype or order")
        if len(raw) != math.prod(_shape(shape, "_frombuffer")) * dt.itemsize:
            raise ValueError(f"numpy _frombuffer: {len(raw)} bytes for shape {shape} of {dt}")
        return np.frombuffer(raw, dtype=dt).reshape(shape, order=order)

    def bit_generator(name: Any = "MT19937") -> Any:
        key = getattr(name, "bit_generator", name)
        if not isinstance(key, str) or key not in generators:
            raise ValueError(f"numpy bit generator {name!r} is not one numpy ships")
        return generators[key]()

    def wrap(kind: type) -> Any:
        def ctor(name: Any = "MT19937", ctor: Any = None) -> Any:
            if ctor not in (None, bit_generator):
                raise ValueError("numpy RNG: an unknown bit generator constructor")
            return kind(name if isinstance(name, np.random.BitGenerator) else bit_generator(name))
        return ctor

    def seed_sequence(cls: Any, checksum: Any, state: Any) -> Any:
        if cls is not seed_name:
            raise ValueError("numpy __pyx_unpickle_SeedSequence: not a SeedSequence")
        out = np.random.SeedSequence(0)  # a valid one; BUILD (checked) gives it its real state
        if state is not None:
            numpy_build(out, state)
        return out

    table: dict[tuple[str, str], Any] = {("numpy", "ndarray"): ndarray_name, ("numpy", "dtype"): dtype,
                                         ("numpy.random", "__RandomState_ctor"): lambda: np.random.RandomState(0),
                                         (_RANDOM, "__randomstate_ctor"): wrap(np.random.RandomState),
                                         (_RANDOM, "__generator_ctor"): wrap(np.random.Generator),
                                         (_RANDOM, "__bit_generator_ctor"): bit_generator,
                                         ("numpy.random.bit_generator", "SeedSequence"): seed_name,
                                         ("numpy.random.bit_generator", "__pyx_unpickle_SeedSequence"): seed_sequence,
                                         ("numpy.random._pcg64", "PCG64DXSM"): generator_names["PCG64DXSM"]}
    table.update({(m, "_reconstruct"): reconstruct for m in _MULTIARRAY})
    table.update({(m, "scalar"): scalar for m in _MULTIARRAY})
    table.update({(m, "_frombuffer"): frombuffer for m in _NUMERIC})
    table.update({(m, n): generator_names[n] for m, n in _BIT_GENERATORS.items()})
    return table


# ---------------------------------------------------------------------------------- BUILD


def numpy_build(inst: Any, state: Any) -> bool:
    """Apply BUILD ``state`` to a numpy object after checking it; False when ``inst`` is not
    numpy's (the caller builds it the usual way). Raises ValueError for a state numpy would
    accept but reshard does not trust."""
    if not type(inst).__module__.startswith("numpy"):
        return False
    import numpy as np

    if isinstance(inst, np.dtype):
        _check_dtype(inst, state)
    elif isinstance(inst, np.ndarray) and type(inst) is np.ndarray:
        _check_array(state)
    elif isinstance(inst, np.random.SeedSequence):
        _check_seed_sequence(state)
    elif isinstance(inst, np.random.BitGenerator):
        _check_bit_generator(type(inst).__name__, state[0] if isinstance(state, tuple) and len(state) == 2 else state)
        if isinstance(state, tuple) and len(state) == 2 and not isinstance(state[1], (np.random.SeedSequence, type(None))):
            raise ValueError("numpy bit generator: the seed sequence is not a SeedSequence")
    elif isinstance(inst, np.random.RandomState):
        _check_random_state(state)
    elif isinstance(inst, np.random.Generator):
        if not isinstance(state, dict):
            raise ValueError("numpy Generator: unexpected state")
        _check_bit_generator(type(inst.bit_generator).__name__, state)
    else:
        raise ValueError(f"a pickle may not set the state of numpy's {type(inst).__name__}")
    inst.__setstate__(state)
    return True


def _check_dtype(dt: Any, state: Any) -> None:
    import numpy as np

    if not isinstance(state, tuple) or len(state) not in (8, 9) or state[1] not in ("<", ">", "|"):
        raise ValueError(f"numpy dtype {dt}: unexpected state")
    want = dt
    if len(state) == 9 and dt.kind in "mM":  # datetime64 / timedelta64 carry their unit here
        meta = state[8]
        unit = meta[1] if isinstance(meta, tuple) and len(meta) == 2 and isinstance(meta[1], tuple) else ()
        if len(unit) != 4 or not isinstance(unit[0], bytes) or not unit[0].isalpha() or type(unit[1]) is not int \
                or not 0 < unit[1] < 2**31:
            raise ValueError(f"numpy dtype {dt}: unexpected datetime unit {meta!r}")
        want = np.dtype(f"{dt.char}8[{unit[1]}{unit[0].decode()}]" if unit[0] != b"generic" else f"{dt.char}8")
    if state[1] in "<>":
        want = want.newbyteorder(state[1])
    if want.__reduce__()[2] != state:
        raise ValueError(f"numpy dtype {dt}: fields, subarrays or metadata (structured dtypes) are not read")


def _check_array(state: Any) -> None:
    import numpy as np

    if isinstance(state, tuple) and len(state) == 5 and state[0] == 1:
        state = state[1:]
    if not isinstance(state, tuple) or len(state) != 4:
        raise ValueError("numpy array: unexpected state")
    shape, dt, fortran, raw = state
    n = math.prod(_shape(shape, "numpy array"))
    if not isinstance(dt, np.dtype) or fortran not in (0, 1, False, True):
        raise ValueError("numpy array: unexpected dtype or order")
    if dt.hasobject:
        if not isinstance(raw, list) or len(raw) != n:
            raise ValueError(f"numpy object array of shape {shape} needs {n} items")
    elif len(_data(raw, "numpy array")) != n * dt.itemsize:
        raise ValueError(f"numpy array of shape {shape} and {dt} holds {len(raw)} bytes, expected {n * dt.itemsize}")


def _check_seed_sequence(state: Any) -> None:
    """(entropy, n_children_spawned, pool, pool_size, spawn_key), accepted only when numpy
    derives the very same pool from them (so no field can disagree with another)."""
    import numpy as np

    if not isinstance(state, tuple) or len(state) != 5:
        raise ValueError("numpy SeedSequence: unexpected state")
    entropy, spawned, pool, size, key = state
    ints = (type(entropy) is int and entropy >= 0) or (isinstance(entropy, (tuple, list)) and
                                                       all(type(e) is int and e >= 0 for e in entropy))
    if not ints or type(spawned) is not int or spawned < 0 or type(size) is not int or not 4 <= size <= _MAX_POOL \
            or not isinstance(key, tuple) or not all(type(k) is int and k >= 0 for k in key):
        raise ValueError("numpy SeedSequence: unexpected fields")
    if not isinstance(pool, np.ndarray) or pool.dtype != np.uint32 or pool.shape != (size,):
        raise ValueError("numpy SeedSequence: the pool is not uint32 of pool_size words")
    ref = np.random.SeedSequence(entropy, spawn_key=key, pool_size=size, n_children_spawned=spawned)
    if not np.array_equal(ref.pool, pool):
        raise ValueError("numpy SeedSequence: the pool does not follow from the entropy")


_POSITIONS = {"MT19937": ("state", "pos", 624), "Philox": (None, "buffer_pos", 4)}


def _check_bit_generator(name: str, state: Any) -> None:
    """Indexes into fixed buffers are the fields numpy does not bound; the rest it checks."""
    if not isinstance(state, dict) or state.get("bit_generator") != name:
        raise ValueError(f"numpy {name}: unexpected state")
    if name in _POSITIONS:
        where, field, top = _POSITIONS[name]
        inner = state.get(where) if where else state
        pos = inner.get(field) if isinstance(inner, dict) else None
        if type(pos) is not int or not 0 <= pos <= top:
            raise ValueError(f"numpy {name}: {field} {pos!r} lies outside 0..{top}")


def _check_random_state(state: Any) -> None:
    if isinstance(state, tuple) and len(state) in (3, 5) and state[0] == "MT19937":  # get_state(legacy=True)
        if type(state[2]) is not int or not 0 <= state[2] <= 624:
            raise ValueError(f"numpy RandomState: pos {state[2]!r} lies outside 0..624")
        return
    if not isinstance(state, dict):
        raise ValueError("numpy RandomState: unexpected state")
    _check_bit_generator(str(state.get("bit_generator")), state)
