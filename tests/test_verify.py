from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

import reshard


def test_exact_tolerant_and_nan_aware(tmp_path: Path) -> None:
    base = {"a": torch.tensor([1.0, float("nan"), 3.0]), "b": torch.arange(6).reshape(2, 3)}
    save_file(base, tmp_path / "x.safetensors")
    torch.save(base, tmp_path / "same.pt")
    assert reshard.verify(tmp_path / "x.safetensors", tmp_path / "same.pt", max_memory="8").equal
    near = {"a": torch.tensor([1.0 + 1e-6, float("nan"), 3.0]), "b": torch.arange(6).reshape(2, 3), "c": torch.ones(1)}
    save_file(near, tmp_path / "near.safetensors")
    result = reshard.verify(tmp_path / "x.safetensors", tmp_path / "near.safetensors")
    assert {(d.name, d.kind) for d in result.differences} == {("a", "values"), ("c", "only in B")}
    tolerant = reshard.verify(tmp_path / "x.safetensors", tmp_path / "near.safetensors", atol=1e-5)
    assert [d.kind for d in tolerant.differences] == ["only in B"]
    save_file({"a": base["a"].double(), "b": base["b"]}, tmp_path / "wide.safetensors")
    kinds = [d.kind for d in reshard.verify(tmp_path / "x.safetensors", tmp_path / "wide.safetensors").differences]
    assert kinds == ["dtype"]
    assert reshard.verify(tmp_path / "x.safetensors", tmp_path / "wide.safetensors", atol=0.0).equal
