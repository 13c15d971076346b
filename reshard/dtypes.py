"""dtype names as users type them (``bf16``, ``bfloat16``, ``torch.float16``) and as we print them."""

from __future__ import annotations

import torch

from reshard._torch_compat import TORCH_DTYPES
from reshard.errors import UsageError

__all__ = ["parse_dtype", "dtype_name"]

_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32", "fp64": "float64", "double": "float64", "fp8": "float8_e4m3fn"}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    key = name.strip().lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    dtype = TORCH_DTYPES.get(key)
    if dtype is None:
        raise UsageError(f"unknown dtype {name!r}; use a torch dtype name such as bfloat16, float16, float32")
    return dtype


_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: asked once per tensor of a report; ``str()`` of a
    torch dtype is a few microseconds, so the names are kept."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name
