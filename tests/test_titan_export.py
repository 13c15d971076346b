"""Real torchtitan checkpoints (tests/data/torchtitan, written by torchtitan 0.3.0 itself) to
Hugging Face and back: the export loads in transformers with torchtitan's own logits, equals
torchtitan's own ``StateDictAdapter.to_hf`` bit for bit, and HF -> titan -> HF is exact."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.hf_models import assert_checked, assert_refused_without_keymap
from tests.test_cli import reshard

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

DATA = Path(__file__).parent / "data" / "torchtitan"
MODELS = ["llama3", "qwen3_moe"]


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(f))
    return out


@pytest.mark.parametrize("name", MODELS)
def test_torchtitan_checkpoint_exports_to_transformers(name: str, tmp_path: Path) -> None:
    ckpt, config = DATA / name / "checkpoint" / "step-2", DATA / name / "config.json"
    reference = torch.load(DATA / name / "reference.pt", weights_only=True)
    out = tmp_path / "hf"

    # A config only: head counts, experts and the family come from it and the checkpoint.
    proc = reshard("convert", ckpt, out, "--to", "hf", "--config", config)
    assert proc.returncode == 0, proc.stderr
    assert "titan-to-hf" in proc.stderr
    assert_checked(proc.stderr, "Qwen3MoeForCausalLM" if name == "qwen3_moe" else "LlamaForCausalLM")
    assert_refused_without_keymap(ckpt, config, tmp_path)

    exported = _hf_tensors(out)
    assert exported.keys() == reference["hf_state_dict"].keys()  # freqs_cis and optimizer state left out
    for key, tensor in reference["hf_state_dict"].items():  # torchtitan's own adapter, bit for bit
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model(reference["tokens"]).logits
    torch.testing.assert_close(logits, reference["logits"], atol=1e-5, rtol=0)
    assert reshard("verify", "--quick", out).returncode == 0

    # verify across the rename: equal, then one flipped element is found and measured.
    same = reshard("verify", ckpt, out, "--keymap", "titan-to-hf", "--only", "model")
    assert same.returncode == 0, same.stdout + same.stderr
    flipped = tmp_path / "flipped"
    shutil.copytree(out, flipped)
    victim = "model.layers.1.post_attention_layernorm.weight"
    tensors = _hf_tensors(flipped)
    tensors[victim][3] += 0.5
    for f in flipped.glob("*.safetensors"):
        f.unlink()
    safetensors_torch.save_file(tensors, flipped / "model.safetensors", metadata={"format": "pt"})
    differ = reshard("verify", ckpt, flipped, "--keymap", "titan-to-hf", "--only", "model")
    assert differ.returncode == 1, differ.stdout + differ.stderr
    lines = [line for line in differ.stdout.splitlines() if line.startswith("DIFF")]
    assert len(lines) == 1 and victim in lines[0] and "1 of" in lines[0] and "max abs diff 0.5" in lines[0], differ.stdout

    # HF -> titan (the 0.3 names this checkpoint uses) -> HF: exact, and the titan side equals the original.
    titan, again = tmp_path / "titan", tmp_path / "hf_again"
    assert reshard("convert", out, titan, "--keymap", "hf-to-titan-0.3", "--config", config, "--quiet").returncode == 0
    back = reshard("verify", ckpt, titan, "--only", "model")
    assert back.returncode == 0, back.stdout
    assert reshard("convert", titan, again, "--to", "hf", "--config", config, "--quiet").returncode == 0
    round_trip = reshard("verify", out, again)
    assert round_trip.returncode == 0, round_trip.stdout
