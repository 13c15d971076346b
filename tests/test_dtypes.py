from __future__ import annotations

import pytest
import torch

from reshard.dtypes import dtype_name, parse_dtype
from reshard.errors import UsageError


def test_names_and_aliases() -> None:
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("torch.float16") is torch.float16
    assert parse_dtype("float8_e4m3fn") is torch.float8_e4m3fn and parse_dtype(None) is None
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(UsageError, match="float7"):
        parse_dtype("float7")
