"""HF folders whose weights are ``.bin`` torch files: one ``pytorch_model.bin`` or shards with
``pytorch_model.bin.index.json``, zip or legacy, exported with ``--to hf`` and loaded by
transformers with identical logits.

transformers 5 writes safetensors whatever ``safe_serialization`` says, so the ``.bin``
folders come from huggingface_hub's ``save_torch_state_dict(safe_serialization=False)``,
the writer transformers 4 used: ``pytorch_model-0000i-of-0000n.bin`` plus the index."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from reshard.formats.registry import detect_format, get_format
from safetensors.torch import save_file

import reshard
from reshard.core.errors import CorruptCheckpointError, UnsafeCheckpointError, UsageError
from tests.hf_models import hf_logits, save_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    src = save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", tie=True)
    return src, hf_logits(src)


def _bin_folder(src: Path, out: Path, *, max_shard_size: str, legacy: bool = False) -> Path:
    from transformers import LlamaForCausalLM

    out.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    save_torch_state_dict(LlamaForCausalLM.from_pretrained(src).state_dict(), out, safe_serialization=False,
                          max_shard_size=max_shard_size)
    if legacy:  # as torch < 1.6 wrote them, which older Hub models still are
        for f in out.glob("*.bin"):
            torch.save(torch.load(f, weights_only=True), f, _use_new_zipfile_serialization=False)
    return out


@pytest.mark.parametrize("kind", ["single", "indexed", "indexed-legacy"])
def test_bin_folder_to_hf_gives_identical_logits(tiny, kind: str, tmp_path: Path) -> None:
    src, logits = tiny
    folder = _bin_folder(src, tmp_path / "bin", max_shard_size="5GB" if kind == "single" else "20KB",
                         legacy=kind.endswith("legacy"))
    names = sorted(p.name for p in folder.glob("pytorch_model*"))
    assert names == ["pytorch_model.bin"] if kind == "single" else len(names) > 3 and "pytorch_model.bin.index.json" in names
    assert torch.equal(hf_logits(folder), logits)  # control: transformers reads the fixture itself
    assert detect_format(folder).name == "hf-bin"
    cat = reshard.inspect(folder)
    assert cat.facts.hf_config == json.loads((src / "config.json").read_text())
    out = reshard.convert(folder, tmp_path / "out", to="hf", quiet=True).dst
    assert torch.equal(hf_logits(out), logits)
    assert json.loads((out / "generation_config.json").read_text()) == json.loads((src / "generation_config.json").read_text())
    if kind == "indexed":  # the index file itself names the checkpoint too
        assert detect_format(folder / "pytorch_model.bin.index.json").name == "hf-bin"
        assert set(reshard.inspect(folder / "pytorch_model.bin.index.json").tensors) == set(cat.tensors)


def _two_shards(folder: Path) -> Path:
    folder.mkdir()
    save_torch_state_dict({"a": torch.ones(64), "b": torch.zeros(64)}, folder, safe_serialization=False,
                          max_shard_size=300)
    assert len(list(folder.glob("*.bin"))) == 2
    return folder


def _edit_index(folder: Path, weight_map: dict) -> None:
    index = json.loads((folder / "pytorch_model.bin.index.json").read_text())
    index["weight_map"] = weight_map
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))


def test_the_index_is_checked_like_a_safetensors_index(tmp_path: Path) -> None:
    good = _two_shards(tmp_path / "good")
    files = json.loads((good / "pytorch_model.bin.index.json").read_text())["weight_map"]
    first, second = files["a"], files["b"]
    torch.save({"a": torch.ones(2)}, tmp_path / "outside.bin")
    for case, weight_map, error, message in [
        ("escape", {"a": "../outside.bin", "b": second}, UnsafeCheckpointError, "is not a plain path inside"),
        ("swapped", {"a": second, "b": first}, CorruptCheckpointError, "the index maps tensor 'b' here but the file"),
        ("missing", {"a": first, "b": "pytorch_model-00009-of-00009.bin"}, CorruptCheckpointError, "is missing"),
    ]:
        folder = Path(shutil.copytree(good, tmp_path / case))
        _edit_index(folder, weight_map)
        with pytest.raises(error, match=message):
            reshard.inspect(folder)
    twice = Path(shutil.copytree(good, tmp_path / "twice"))
    torch.save({"a": torch.ones(64), "b": torch.zeros(64)}, twice / second)  # b's file also holds a
    _edit_index(twice, {"a": first, "b": second})
    with pytest.raises(CorruptCheckpointError, match=rf"{second}: holds tensor 'a', which the index maps to another file"):
        reshard.inspect(twice)


def test_safetensors_weights_take_precedence_and_bin_is_read_only(tmp_path: Path) -> None:
    """The Hub often keeps both; transformers loads the safetensors, and so does reshard."""
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    assert detect_format(tmp_path).name == "hf-bin"
    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    assert detect_format(tmp_path).name == "safetensors"
    with pytest.raises(UsageError, match="hf-bin is read only"):
        get_format("hf-bin").writer(tmp_path / "out")
