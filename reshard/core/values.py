"""Equality of stored values as a checkpoint tool must mean it: the same type and the same bits.

Python's ``==`` says ``0.0 == -0.0``, ``1 == 1.0 == True`` and ``(1, 2) == [1, 2]`` is False
but ``{"a": 1} == OrderedDict(a=1)`` is True; for a checkpoint those are different values (a
step counter that became a float, a sign bit lost on the way). Here two objects are equal
when they have the same type, the same structure and, for floats, the same bits (so a NaN
equals a NaN with the same payload, and ``-0.0`` differs from ``0.0``). A dtype is a dtype
whether a reader gave reshard's ``DType`` or torch's ``torch.dtype``. ``difference`` says
where and how they first differ, for messages; ``tensor_digest`` streams a stored tensor's
bytes through SHA-256 so copies on many ranks are compared without holding any of them.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from reshard.core import dtypes
from reshard.core.boxes import Box, c_order_slabs, full_box
from reshard.core.catalog import ChunkData, TensorEntry
from reshard.core.chunk_reads import read_box
from reshard.core.dtypes import DType

if TYPE_CHECKING:
    import torch

__all__ = ["difference", "same_value", "same_values", "tensor_digest", "tensor_bits_differ"]

_SHOWN = 60
_DIGEST_SLAB = 8 << 20


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _same_dtype(x: Any, y: Any) -> bool:
    try:
        return dtypes.of(x) is dtypes.of(y)
    except KeyError:  # a torch dtype newer than reshard's table
        return x is y


def _tensor_difference(x: torch.Tensor, y: torch.Tensor) -> str | None:
    if x.dtype != y.dtype:
        return f"tensor dtype {x.dtype} vs {y.dtype}"
    if tuple(x.shape) != tuple(y.shape):
        return f"tensor shape {list(x.shape)} vs {list(y.shape)}"
    if tensor_bits_differ(x, y):
        return "tensor values differ"
    return None


def tensor_bits_differ(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape differ in any bit (NaN payloads, signs)."""
    import torch

    if x.numel() == 0:
        return False
    bx = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    by = y.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return not torch.equal(bx, by)


def _numpy_difference(x: Any, y: Any) -> str | None:
    if x.dtype != y.dtype or x.shape != y.shape:
        return f"array {x.dtype} {list(x.shape)} vs {y.dtype} {list(y.shape)}"
    if x.dtype.hasobject:
        return None if all(difference(a, b) is None for a, b in zip(x.ravel().tolist(), y.ravel().tolist())) \
            else "array values differ"
    return None if x.tobytes() == y.tobytes() else "array values differ"


def difference(x: Any, y: Any, where: str = "") -> str | None:
    """None when ``x`` and ``y`` are the same value (type, structure, bits); otherwise where
    (``[key][0]``) and how they first differ, in words."""
    torch = sys.modules.get("torch")  # not imported: no value here is a tensor
    at = f" at {where}" if where else ""
    if dtypes.is_dtype(x) and dtypes.is_dtype(y):  # a DType from one reader, a torch.dtype from another
        return None if _same_dtype(x, y) else f"{x!r} vs {y!r}{at}"
    if type(x) is not type(y):
        return f"{type(x).__name__} {_short(x)} vs {type(y).__name__} {_short(y)}{at}"
    if torch is not None and isinstance(x, torch.Tensor):
        why = _tensor_difference(x, y)
        return f"{why}{at}" if why else None
    if isinstance(x, float):
        return None if _float_bits(x) == _float_bits(y) else f"{x!r} vs {y!r}{at}"
    if isinstance(x, complex):
        same = _float_bits(x.real) == _float_bits(y.real) and _float_bits(x.imag) == _float_bits(y.imag)
        return None if same else f"{x!r} vs {y!r}{at}"
    if isinstance(x, Mapping):
        if list(x) != list(y):
            missing, extra = [k for k in x if k not in y], [k for k in y if k not in x]
            if missing or extra:
                return f"keys differ{at}: only in A {_short(missing)}, only in B {_short(extra)}"
            return f"key order differs{at}"
        for k in x:
            why = difference(x[k], y[k], f"{where}[{k!r}]")
            if why:
                return why
        return None
    if isinstance(x, (list, tuple)):
        if len(x) != len(y):
            return f"{type(x).__name__} of {len(x)} vs {len(y)} items{at}"
        for i, (a, b) in enumerate(zip(x, y)):
            why = difference(a, b, f"{where}[{i}]")
            if why:
                return why
        return None
    if type(x).__module__ == "numpy" and hasattr(x, "dtype") and hasattr(x, "tobytes"):
        why = _numpy_difference(x, y)
        return f"{why}{at}" if why else None
    if isinstance(x, (set, frozenset)):
        return None if x == y else f"{_short(x)} vs {_short(y)}{at}"
    if hasattr(x, "__dict__") and not isinstance(x, type):
        return difference(vars(x), vars(y), f"{where}.__dict__" if where else "__dict__")
    try:
        same = bool(x == y)
    except Exception:  # noqa: BLE001 - an object without a usable ==: compare what it shows
        same = repr(x) == repr(y)
    return None if same else f"{_short(x)} vs {_short(y)}{at}"


def same_value(x: Any, y: Any) -> bool:
    return difference(x, y) is None


def tensor_digest(data: ChunkData, shape: tuple[int, ...], dtype: DType) -> str:
    """SHA-256 of a stored tensor's C-order bytes, read in slabs of a few MiB."""
    import torch

    h = hashlib.sha256()
    for slab in c_order_slabs(full_box(shape), dtype.itemsize, _DIGEST_SLAB):
        t = data.read(slab)
        if t.numel():
            # the ignore: numpy's stubs give an ndarray the buffer protocol on Python 3.12+ only
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    h.update(repr((tuple(shape), f"torch.{dtypes.of(dtype).name}", math.prod(shape))).encode())  # as written before DType
    return h.hexdigest()


def same_values(a: TensorEntry, b: TensorEntry, max_bytes: int) -> bool:
    """Bit equality of two tensors, compared in row blocks so memory stays under ``max_bytes``."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.shape:
        return torch.equal(read_box(a, Box((), ())).view(-1), read_box(b, Box((), ())).view(-1))
    row = max(1, a.nbytes // max(1, a.shape[0]))
    step = max(1, max_bytes // (2 * row))
    for start in range(0, a.shape[0], step):
        box = Box((start,) + (0,) * (len(a.shape) - 1), (min(step, a.shape[0] - start),) + a.shape[1:])
        x, y = read_box(a, box), read_box(b, box)
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True
