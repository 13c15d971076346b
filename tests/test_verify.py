"""verify never says "equal" of different data: every dtype compared the way it is stored,
objects by type and bits, nesting and container types compared; checked against torch's own
equality (torch.equal) on files written by torch and safetensors themselves."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import reshard
from reshard.cli.app import main
from reshard.core.errors import UsageError


def test_exact_tolerant_and_nan_aware(tmp_path: Path) -> None:
    base = {"a": torch.tensor([1.0, float("nan"), 3.0]), "b": torch.arange(6).reshape(2, 3)}
    save_file(base, tmp_path / "x.safetensors")
    torch.save(base, tmp_path / "same.pt")
    assert reshard.verify(tmp_path / "x.safetensors", tmp_path / "same.pt", max_memory="8").equal
    near = {"a": torch.tensor([1.0 + 1e-6, float("nan"), 3.0]), "b": torch.arange(6).reshape(2, 3), "c": torch.ones(1)}
    save_file(near, tmp_path / "near.safetensors")
    result = reshard.verify(tmp_path / "x.safetensors", tmp_path / "near.safetensors")
    assert {(d.name, d.kind) for d in result.differences} == {("a", "values"), ("c", "only_in_b")}
    values = next(d for d in result.differences if d.kind == "values")
    assert values.detail.startswith("1 of 3 elements differ (max abs diff 9.53674e-07, max rel diff 9.53")
    tolerant = reshard.verify(tmp_path / "x.safetensors", tmp_path / "near.safetensors", atol=1e-5)
    assert [d.kind for d in tolerant.differences] == ["only_in_b"]
    save_file({"a": base["a"].double(), "b": base["b"]}, tmp_path / "wide.safetensors")
    kinds = [d.kind for d in reshard.verify(tmp_path / "x.safetensors", tmp_path / "wide.safetensors").differences]
    assert kinds == ["dtype"]
    assert reshard.verify(tmp_path / "x.safetensors", tmp_path / "wide.safetensors", atol=0.0).within_tolerance


def _verify_cli(tmp_path: Path, a: dict, b: dict, *options: str, save=torch.save) -> int:
    save(a, tmp_path / "a.pt")
    save(b, tmp_path / "b.pt")
    return main(["verify", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), *options])


@pytest.mark.parametrize("options", [[], ["--atol", "1e-6"], ["--rtol", "0"], ["--atol", "0", "--rtol", "0"]])
def test_tolerance_never_hides_imaginary_parts_integers_or_objects(tmp_path: Path, options: list[str], capsys) -> None:
    cases = [
        ({"c": torch.tensor([1 + 1j])}, {"c": torch.tensor([1 + 5j])}),  # A: the imaginary part
        ({"i": torch.tensor([2**60])}, {"i": torch.tensor([2**60 + 1])}),  # B: int64 past float64's 53 bits
        ({"u": torch.tensor([2**63], dtype=torch.uint64)}, {"u": torch.tensor([2**63 + 1], dtype=torch.uint64)}),
        ({"b": torch.tensor([True])}, {"b": torch.tensor([False])}),
        ({"x": 0.0}, {"x": -0.0}),  # objects: the sign bit
        ({"x": 1}, {"x": 1.0}),  # objects: the type
        ({"x": float("nan")}, {"x": struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]}),  # payload
        ({"a": {"b": torch.ones(1)}}, {"a.b": torch.ones(1)}),  # nesting
        ({"t": (torch.ones(1), 2)}, {"t": [torch.ones(1), 2]}),  # tuple vs list
        ({"s": {0: {"m": torch.ones(1)}}}, {"s": {"0": {"m": torch.ones(1)}}}),  # int key vs str key
        ({"w": torch.ones(1)}, {"w": torch.ones(1), "extra": 3}),  # an object on one side
    ]
    for a, b in cases:
        assert _verify_cli(tmp_path, a, b, *options) == 1, (a, b)
        assert "DIFF" in capsys.readouterr().out
    assert _verify_cli(tmp_path, {"c": torch.tensor([1 + 1j]), "x": -0.0}, {"c": torch.tensor([1 + 1j]), "x": -0.0},
                       *options) == 0


def test_tolerance_compares_complex_by_parts_and_casts_by_value(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"c": torch.tensor([1 + 1j, 2 - 3j]), "f": torch.tensor([1.0, 2.0])}, a)
    torch.save({"c": torch.tensor([1 + 1j, 2 - 3j], dtype=torch.complex128), "f": torch.tensor([1.0, 2.0]).bfloat16()}, b)
    assert not reshard.verify(a, b).equal
    close = reshard.verify(a, b, atol=0)
    assert close.ok and close.within_tolerance and not close.equal  # a tolerance never claims bit equality
    torch.save({"c": torch.tensor([1 + 1j, 2 - 3.01j]), "f": torch.tensor([1.0, 2.0])}, b)
    diff = reshard.verify(a, b, atol=1e-3).differences
    assert [(d.name, d.detail) for d in diff] == [("c",
                                                   "1 of 2 elements differ (max abs diff 0.00999999, max rel diff 0.00276711)")]
    assert reshard.verify(a, b, atol=0.02).within_tolerance
    with pytest.raises(UsageError, match="atol=-1.0: a tolerance must be a finite number >= 0"):
        reshard.verify(a, b, atol=-1.0)
    assert main(["verify", str(a), str(b), "--rtol", "nan"]) == 2


def test_structure_difference_names_both_nestings(tmp_path: Path) -> None:
    torch.save({"optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}}}, tmp_path / "a.pt")
    torch.save({"optimizer": {"state": [{"exp_avg": torch.ones(2)}]}}, tmp_path / "b.pt")
    (d,) = reshard.verify(tmp_path / "a.pt", tmp_path / "b.pt").differences
    assert (d.name, d.kind) == ("optimizer.state.0.exp_avg", "structure")
    assert d.detail == ("nested as dict['optimizer'] > dict['state'] > dict[0] > dict['exp_avg'] vs "
                        "dict['optimizer'] > dict['state'] > list[0] > dict['exp_avg']")


# ------------------------------------------------------------------ property: exact == torch.equal

_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.complex64, torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
           torch.uint16, torch.uint32, torch.uint64, torch.bool]


def _reference_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal, with the documented rule for the two cases where "equal" and "the same
    stored value" part ways: NaNs are equal when their bits are, and -0.0 differs from 0.0."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not (a.dtype.is_floating_point or a.dtype.is_complex):
        return torch.equal(a, b)
    ra, rb = (torch.view_as_real(a), torch.view_as_real(b)) if a.dtype.is_complex else (a, b)
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ra.element_size()]
    same_bits = ra.view(int_type) == rb.view(int_type)
    ra, rb = ra.double(), rb.double()
    special = (ra.isnan() & rb.isnan()) | ((ra == 0) & (rb == 0))
    return bool(torch.where(special, same_bits, ra == rb).all())


@st.composite
def _pairs(draw) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = draw(st.sampled_from(_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    n = torch.Size(shape).numel() * dtype.itemsize
    raw = draw(st.binary(min_size=n, max_size=n))
    if dtype == torch.bool:
        raw = bytes(x & 1 for x in raw)
    a = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)
    b = a.clone()
    flat = b.reshape(-1).view(torch.uint8)
    for _ in range(draw(st.integers(0, 2))):
        if flat.numel():
            i = draw(st.integers(0, flat.numel() - 1))
            flat[i] = draw(st.sampled_from([0x00, 0x80, 0xFF, 0x7F, 0x01]) if dtype != torch.bool else st.integers(0, 1))
    return a, b


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_pairs(), st.sampled_from(["torch", "safetensors"]))
def test_exact_verify_is_torch_equal(tmp_path: Path, pair: tuple[torch.Tensor, torch.Tensor], writer: str) -> None:
    a, b = pair
    if writer == "safetensors" and a.dtype in (torch.uint16, torch.uint32, torch.uint64, torch.complex128):
        writer = "torch"  # dtypes outside safetensors' list
    for side, t in (("a", a), ("b", b)):
        path = tmp_path / f"{side}.{'pt' if writer == 'torch' else 'safetensors'}"
        torch.save({"t": t}, path) if writer == "torch" else save_file({"t": t.contiguous()}, path)
    ext = "pt" if writer == "torch" else "safetensors"
    result = reshard.verify(tmp_path / f"a.{ext}", tmp_path / f"b.{ext}")
    assert result.equal == _reference_equal(a, b), (a, b, result.differences)


def test_a_tolerance_says_within_never_equal(tmp_path: Path, capsys) -> None:
    """fp32 against its bf16 cast with --atol: exit 0, "within atol=0.01", and JSON that does
    not claim "equal"; without a tolerance the same pair differs (exit 1)."""
    import json

    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    w = torch.linspace(-1, 1, 33)
    torch.save({"w": w}, a)
    torch.save({"w": w.bfloat16()}, b)
    assert main(["verify", str(a), str(b), "--atol", "1e-2"]) == 0
    out = capsys.readouterr().out
    assert "within atol=0.01" in out and "equal" not in out
    assert main(["verify", str(a), str(b), "--atol", "1e-2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["equal"], doc["within_tolerance"], doc["atol"], doc["rtol"]) == (False, True, 0.01, None)
    assert main(["verify", str(a), str(a), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["equal"], doc["within_tolerance"]) == (True, None)
    assert main(["verify", str(a), str(b)]) == 1


def test_a_dtype_object_is_a_dtype_whichever_reader_gave_it(tmp_path: Path, capsys) -> None:
    """torch.save files read as reshard's DType, DCP through torch as torch.dtype: the same
    dtype is equal either way, and every output hands torch.bfloat16 back to torch."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    torch.save({"w": torch.ones(2, dtype=torch.bfloat16), "dtype": torch.bfloat16,
                "cfg": {"dtypes": [torch.float32, torch.bfloat16]}}, tmp_path / "dt.pt")
    outs = ["dt_dcp", "dt.zarr", "dt.safetensors", "dt2.pt"]
    for out in outs:
        reshard.convert(tmp_path / "dt.pt", tmp_path / out, quiet=True)
        assert main(["verify", str(tmp_path / "dt.pt"), str(tmp_path / out)]) == 0, out
        assert main(["verify", str(tmp_path / out), str(tmp_path / "dt.pt")]) == 0, out
    assert main(["verify", str(tmp_path / "dt_dcp"), str(tmp_path / "dt.zarr")]) == 0
    state = {"dtype": None, "cfg": {"dtypes": None}}
    dcp.load(state, checkpoint_id=tmp_path / "dt_dcp", no_dist=True)  # torch's own reader
    assert state == {"dtype": torch.bfloat16, "cfg": {"dtypes": [torch.float32, torch.bfloat16]}}
    with safe_open(tmp_path / "dt.safetensors", "pt") as f:
        assert '"dtype":{"__dtype__":"bfloat16"}' in f.metadata()["reshard.objects"]
    for out in outs[1:]:
        back = tmp_path / (out if out.endswith(".pt") else f"{out}.back.pt")
        if not back.exists():
            reshard.convert(tmp_path / out, back, quiet=True)
        loaded = torch.load(back, weights_only=True)
        assert loaded["dtype"] is torch.bfloat16 and loaded["cfg"]["dtypes"] == [torch.float32, torch.bfloat16], out
    capsys.readouterr()
    torch.save({"w": torch.ones(2, dtype=torch.bfloat16), "dtype": torch.float32,
                "cfg": {"dtypes": [torch.float32, torch.bfloat16]}}, tmp_path / "dt32.pt")
    for out in outs:
        assert main(["verify", str(tmp_path / "dt32.pt"), str(tmp_path / out)]) == 1, out
        assert "DIFF dtype: object: torch.float32 vs torch.bfloat16" in capsys.readouterr().out, out
