"""Element types by torch's names, without importing torch.

A catalog, a plan and a byte copy need a dtype's name and width, never torch itself, and
``import torch`` is a second of every command's start-up (``reshard inspect`` of a DCP
directory is a tenth of that otherwise). ``DType`` is that name and width; ``.torch`` gives
the torch dtype where a tensor is made or cast, importing torch then.

Every ``DType`` is interned: one object per dtype, so ``is``, ``==`` and hashing are identity.
Comparing one with a ``torch.dtype`` is a bug (always unequal), so it raises instead.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard, final

import numpy as np

from reshard.core.errors import UnsupportedFormatError, UsageError

if TYPE_CHECKING:
    import torch

__all__ = ["DType", "by_name", "of", "is_dtype", "parse_dtype", "dtype_name", "DTYPES", "COMPUTE_DTYPES"]


@final
class DType:
    """One tensor element type: torch's canonical name (``bfloat16``), its width in bytes
    and its kind (``f`` float, ``c`` complex, ``i`` signed, ``u`` unsigned, ``b`` bool, ``q``
    quantized, ``x`` raw bits)."""

    __slots__ = ("name", "itemsize", "kind", "_torch")

    def __init__(self, name: str, itemsize: int, kind: str) -> None:
        self.name, self.itemsize, self.kind = name, itemsize, kind
        self._torch: Any = None

    @property
    def is_floating_point(self) -> bool:
        return self.kind == "f"

    @property
    def is_complex(self) -> bool:
        return self.kind == "c"

    @property
    def torch(self) -> torch.dtype:
        """The torch dtype (imports torch: only where a tensor is made or cast)."""
        found = self._torch
        if found is None:
            import torch

            found = getattr(torch, self.name, None)
            if found is None:
                raise UnsupportedFormatError(f"{self.name} tensors need torch {SINCE.get(self.name, 'newer than this')} or "
                                             f"newer (this is torch {torch.__version__}): upgrade torch to read them as tensors")
            self._torch = found
        return found

    @property
    def bytes_dtype(self) -> np.dtype:
        """A numpy dtype of the same width, for moving this dtype's bytes (numpy has no
        bfloat16 or float8; a copy only needs the width)."""
        return _BYTES[self.itemsize]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return self is other
        if _is_torch_dtype(other):
            raise TypeError(f"comparing reshard dtype {self.name} with {other}: use .torch or dtypes.of()")
        return NotImplemented

    def __hash__(self) -> int:
        return id(self)

    def __reduce__(self) -> tuple:
        return by_name, (self.name,)  # interned again on unpickling (worker processes)

    def __repr__(self) -> str:
        return f"torch.{self.name}"  # as torch prints its dtypes: messages read the same either way

    __str__ = __repr__


_BYTES: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64),
                          16: np.dtype(np.complex128)}  # moved by assignment, never arithmetic: bit for bit

# torch's dtypes as torch 2.15 names them (tests/test_dtypes.py checks this table against the
# installed torch): canonical name, width, kind, aliases.
_TABLE: list[tuple[str, int, str, tuple[str, ...]]] = [
    ("float64", 8, "f", ("double",)), ("float32", 4, "f", ("float",)), ("float16", 2, "f", ("half",)),
    ("bfloat16", 2, "f", ()), ("float8_e4m3fn", 1, "f", ()), ("float8_e4m3fnuz", 1, "f", ()),
    ("float8_e5m2", 1, "f", ()), ("float8_e5m2fnuz", 1, "f", ()), ("float8_e8m0fnu", 1, "f", ()),
    ("float4_e2m1fn_x2", 1, "f", ()),
    ("complex128", 16, "c", ("cdouble",)), ("complex64", 8, "c", ("cfloat",)), ("complex32", 4, "c", ("chalf",)),
    ("bcomplex32", 4, "c", ()),
    ("int64", 8, "i", ("long",)), ("int32", 4, "i", ("int",)), ("int16", 2, "i", ("short",)), ("int8", 1, "i", ()),
    *((f"int{n}", 1, "i", ()) for n in range(1, 8)),
    ("uint64", 8, "u", ()), ("uint32", 4, "u", ()), ("uint16", 2, "u", ()), ("uint8", 1, "u", ()),
    ("uint1", 1, "u", ("bit",)), *((f"uint{n}", 1, "u", ()) for n in range(2, 8)),
    ("bool", 1, "b", ()),
    ("qint32", 4, "q", ()), ("qint8", 1, "q", ()), ("quint8", 1, "q", ()), ("quint4x2", 1, "q", ()),
    ("quint2x4", 1, "q", ()),
    ("bits16", 2, "x", ()), ("bits8", 1, "x", ()), ("bits1x8", 1, "x", ()), ("bits2x4", 1, "x", ()),
    ("bits4x2", 1, "x", ()),
]

# dtypes newer than reshard's torch floor (2.9): the release that added each. A checkpoint holding
# one is read and copied byte for byte by any torch; only making its tensors needs that release.
SINCE: dict[str, str] = {"bcomplex32": "2.14"}

# Every name torch gives a dtype (aliases included) -> its DType.
DTYPES: dict[str, DType] = {}
for _name, _size, _kind, _aliases in _TABLE:
    DTYPES[_name] = DType(_name, _size, _kind)
    DTYPES.update({alias: DTYPES[_name] for alias in _aliases})

# The floats a model computes in: what an HF config.json's ``dtype`` may say (float8 and packed
# bytes are stored, never computed in).
COMPUTE_DTYPES = tuple(DTYPES[n] for n in ("float16", "bfloat16", "float32", "float64"))


def _is_torch_dtype(x: object) -> TypeGuard[torch.dtype]:
    torch = sys.modules.get("torch")  # not imported: nothing can be a torch dtype
    return torch is not None and isinstance(x, torch.dtype)


def is_dtype(x: object) -> bool:
    """Whether ``x`` is a dtype: reshard's ``DType`` or a ``torch.dtype``."""
    return isinstance(x, DType) or _is_torch_dtype(x)


def by_name(name: str) -> DType:
    """The dtype torch names ``name`` (``float32``, ``half``); KeyError when none."""
    return DTYPES[name]


_OF_TORCH: dict[Any, DType] = {}


def of(dtype: DType | torch.dtype) -> DType:
    """``dtype`` as a ``DType``: for tensors a reader or a user hands over."""
    if isinstance(dtype, DType):
        return dtype
    found = _OF_TORCH.get(dtype)
    if found is None:
        if not _is_torch_dtype(dtype):
            raise TypeError(f"not a dtype: {dtype!r}")
        found = _OF_TORCH[dtype] = DTYPES[str(dtype).removeprefix("torch.")]
    return found


_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64", "fp8": "float8_e4m3fn"}


def parse_dtype(name: str | DType | torch.dtype | None) -> DType | None:
    """A dtype as a user gives it: ``bf16``, ``bfloat16``, ``torch.float16``, or a dtype."""
    if name is None:
        return None
    if isinstance(name, DType) or _is_torch_dtype(name):
        return of(name)
    key = str(name).strip().lower().removeprefix("torch.")
    dtype = DTYPES.get(_ALIASES.get(key, key))
    if dtype is None:
        raise UsageError(f"unknown dtype {name!r}; use a torch dtype name such as bfloat16, float16, float32")
    return dtype


def dtype_name(dtype: DType) -> str:
    """``float32``: the name reports and JSON use."""
    return dtype.name
