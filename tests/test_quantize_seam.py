"""Adding a quantization scheme takes one module (tests/toy_scheme.py) and one row in
reshard/features/quantize/registry.py: ``--quantize`` takes it, its errors list it, and the driver chooses
the weights, reads them, writes its tensors under the memory budget and its config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reshard.cli.app import main
from reshard.features.quantize import registry
from tests.hf_models import save_tiny_llama
from tests.toy_scheme import Int8Row


def test_a_scheme_is_one_module_and_one_registry_row(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    base = save_tiny_llama(tmp_path / "base", tie=False)
    assert main(["convert", str(base), str(tmp_path / "no"), "--to", "hf", "--quantize", "int8-row"]) == 2
    assert "'int8-row'" in capsys.readouterr().err  # not yet registered
    monkeypatch.setitem(registry.SCHEMES, "int8-row", Int8Row())  # the one row
    assert main(["convert", str(base), str(tmp_path / "no"), "--to", "hf", "--quantize", "int3"]) == 2
    assert "int8-row (toy: int8 weights with a float32 scale per row)" in capsys.readouterr().err
    out = tmp_path / "int8"
    # transformers knows no "toy-int8-row" quantizer: the architecture check cannot build the model
    assert main(["convert", str(base), str(out), "--to", "hf", "--quantize", "int8-row", "--no-architecture-check",
                 "--max-memory", "1MiB"]) == 0
    notices = capsys.readouterr().err
    assert "quantized 14 linear weights to int8 with a float32 weight_scale per row (toy)" in notices
    source = {}
    for f in base.glob("*.safetensors"):
        source.update(load_file(f))
    got = {}
    for f in out.glob("*.safetensors"):
        got.update(load_file(f))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "toy-int8-row" and {"lm_head", "model.embed_tokens"} <= set(qc["ignore"])
    name = "model.layers.1.mlp.down_proj.weight"
    assert got[name].dtype == torch.int8 and got[name + "_scale"].shape == (source[name].shape[0], 1)
    back = got[name].float() * got[name + "_scale"]
    assert (back - source[name]).abs().max() <= got[name + "_scale"].max() / 2 + 1e-7
    assert torch.equal(got["model.embed_tokens.weight"], source["model.embed_tokens.weight"])
