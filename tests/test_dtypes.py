from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from reshard.core import dtypes
from reshard.core.dtypes import DTYPES, dtype_name, parse_dtype
from reshard.core.errors import UnsupportedFormatError, UsageError
from reshard.core.torch_support import release


def test_names_and_aliases() -> None:
    assert parse_dtype("bf16") is dtypes.by_name("bfloat16") and parse_dtype("torch.float16").torch is torch.float16
    assert parse_dtype("float8_e4m3fn").torch is torch.float8_e4m3fn and parse_dtype(None) is None
    assert parse_dtype(torch.bfloat16) is dtypes.by_name("bfloat16") and parse_dtype("half").name == "float16"
    assert dtype_name(dtypes.of(torch.bfloat16)) == "bfloat16"
    with pytest.raises(UsageError, match="float7"):
        parse_dtype("float7")


def test_table_is_torchs_own() -> None:
    """Every name torch gives a dtype, with its width and kind, and nothing torch lacks."""
    theirs = {n: d for n in dir(torch) if isinstance(d := getattr(torch, n, None), torch.dtype)}
    assert set(theirs) <= set(DTYPES), set(theirs) - set(DTYPES)
    # what this torch lacks is what a newer release added (dtypes.SINCE), and nothing else
    assert set(DTYPES) - set(theirs) == {n for n, v in dtypes.SINCE.items() if release(torch.__version__) < release(v)}
    for name, td in theirs.items():
        ours = DTYPES[name]
        assert ours.torch is td and dtypes.of(td) is ours and ours.itemsize == td.itemsize, name
        if ours.kind in "fcbiu":  # quantized and bits dtypes answer neither question
            assert (ours.is_floating_point, ours.is_complex) == (td.is_floating_point, td.is_complex), name
        assert ours.bytes_dtype.itemsize == td.itemsize


def test_a_dtype_newer_than_this_torch_says_which_release_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = dtypes.DType("bcomplex32", 4, "c")  # an uninterned copy: the interned one may have found torch's
    monkeypatch.delattr(torch, "bcomplex32", raising=False)
    with pytest.raises(UnsupportedFormatError, match="bcomplex32 tensors need torch 2.14 or newer"):
        _ = fresh.torch


def test_interned_and_guarded() -> None:
    bf16 = dtypes.by_name("bfloat16")
    assert pickle.loads(pickle.dumps(bf16)) is bf16 and {bf16: 1}[dtypes.of(torch.bfloat16)] == 1
    assert bf16 != dtypes.by_name("float16") and str(bf16) == "torch.bfloat16"
    with pytest.raises(TypeError, match="torch.bfloat16"):
        _ = bf16 == torch.bfloat16  # a silent False here would be a bug in the caller
    assert np.zeros(3, bf16.bytes_dtype).nbytes == 6
