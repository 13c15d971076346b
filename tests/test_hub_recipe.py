"""docs/recipes/hub-export.md says what a user meets: every ``--quantize`` scheme reshard writes,
each in a command that runs (tests/test_docs_commands.py runs them), what transformers needs
installed to load each export, in the words of the installed transformers' own error, and when
``--config`` is needed (a checkpoint that records no model config), in the words of reshard's
refusal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from reshard.features.quantize.registry import SCHEMES
from tests.hf_models import save_hf_names_dcp, save_tiny_llama
from tests.test_cli import reshard as run_cli
from tests.test_docs_commands import ROOT, doc_commands, skip_reason

RECIPE = ROOT / "docs" / "recipes" / "hub-export.md"


def _text() -> str:
    """The recipe with its line breaks and markup folded away, as a reader reads it."""
    return " ".join(RECIPE.read_text().replace("`", "").split())


def test_every_quantize_scheme_is_in_a_command_that_runs() -> None:
    runs = [c.text for c in doc_commands(RECIPE) if skip_reason(c) is None]
    for name in SCHEMES:
        assert any(re.search(rf"--quantize {re.escape(name)}(\s|$)", c) for c in runs), name


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recipe")
    src = save_tiny_llama(root / "llama", tie=False)
    out = {}
    for scheme in ("fp8", "fp8-dynamic"):
        out[scheme] = root / scheme
        assert run_cli("convert", src, out[scheme], "--to", "hf", "--quantize", scheme, "--quiet").returncode == 0
    out["plain"] = src
    return out


@pytest.mark.parametrize("scheme, module, check", [
    ("fp8", "transformers.quantizers.quantizer_finegrained_fp8", "is_accelerate_available"),
    ("fp8-dynamic", "transformers.quantizers.quantizer_compressed_tensors", "is_compressed_tensors_available"),
])
def test_what_each_reader_needs_is_in_transformers_own_words(exports: dict[str, Path], scheme: str, module: str,
                                                            check: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """from_pretrained of the export, where the package its quantizer needs is missing (as on
    a machine without it): the ImportError it raises is the one the recipe quotes."""
    import importlib

    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(importlib.import_module(module), check, lambda *a, **k: False)
    with pytest.raises(ImportError) as e:
        AutoModelForCausalLM.from_pretrained(exports[scheme])
    said = " ".join(str(e.value).replace("`", "").split())
    assert said in _text(), said
    monkeypatch.undo()
    assert AutoModelForCausalLM.from_pretrained(exports[scheme]) is not None  # with it installed, it loads


def test_when_config_is_needed_is_said_with_the_refusal(tmp_path: Path) -> None:
    """A DCP of HF names saved by the user's own loop records no config: --to hf is refused,
    the recipe quotes the refusal and says --config fixes it, and its command with --config
    works (the docs runner runs it on the same kind of checkpoint)."""
    src = save_tiny_llama(tmp_path / "llama", tie=False)
    run = save_hf_names_dcp(src, tmp_path / "hf-run" / "step-500")
    proc = run_cli("convert", run, tmp_path / "out", "--to", "hf")
    assert proc.returncode == 2
    refusal = " ".join(proc.stderr.split(f"{run} ", 1)[1].split(":", 1)[0].split())
    assert refusal == "records no model config, so transformers could not load the export", proc.stderr
    assert refusal in _text()
    assert any("--config" in c.text.split() and c.text.startswith("reshard convert hf-run/")
               for c in doc_commands(RECIPE) if skip_reason(c) is None)
    assert run_cli("convert", run, tmp_path / "out", "--to", "hf", "--config", src, "--quiet").returncode == 0
    got, want = _tensors(tmp_path / "out"), _tensors(src)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {n: t for f in sorted(folder.glob("*.safetensors")) for n, t in load_file(f).items()}
