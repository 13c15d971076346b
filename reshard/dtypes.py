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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
