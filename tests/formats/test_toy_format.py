"""Adding a format takes one module (tests/formats/toy_format.py) and one registry entry:
detection, ``--to``, default names, ``convert --help`` and the list of what reshard reads all
follow from the entry, and every command works on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reshard.formats import registry
from reshard.formats.registry import FormatEntry, register_format
from safetensors.torch import load_file

import reshard
from reshard.cli.app import main


@pytest.fixture
def toy_registered(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(registry, "FORMATS", list(registry.FORMATS))  # the test's own copy of the table
    monkeypatch.setattr(registry, "_cache", dict(registry._cache))
    register_format(FormatEntry("toy", "tests.formats.toy_format:ToyFormat", "a toy folder with toy.json",
                                writes=True, suffixes=(".toy",), mesh_writer="toy", remote=True), before="torch")


def test_a_format_is_one_module_and_one_registry_line(toy_registered, fsdp2_dcp, fsdp2_reference, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    assert main(["convert", "--help"]) == 0
    assert "toy" in capsys.readouterr().out
    out = tmp_path / "model.toy"
    assert main(["convert", str(fsdp2_dcp[0]), str(out), "--only", "model", "--quiet"]) == 0
    assert (out / "toy.json").is_file() and (out / "data.bin").is_file()
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert "toy" in capsys.readouterr().out
    back = tmp_path / "back.safetensors"
    assert main(["convert", str(out), str(back), "--quiet"]) == 0
    theirs = load_file(back)  # safetensors' own reader
    model = {k.removeprefix("model."): v for k, v in fsdp2_reference.items() if k.startswith("model.")}
    assert len(theirs) == len(model) > 0
    assert theirs.keys() == {f"model.{k}" for k in model} or theirs.keys() == model.keys()
    for name, value in theirs.items():
        assert torch.equal(value, model[name.removeprefix("model.")]), name
    assert main(["convert", str(out), "--dry-run", "--quiet"]) == 0  # a default name beside it
    capsys.readouterr()  # an option its entry does not declare is refused, naming who takes it
    assert main(["convert", str(fsdp2_dcp[0]), str(tmp_path / "c.toy"), "--compress", "--quiet"]) == 2
    assert "--compress applies to zarr outputs, not toy" in capsys.readouterr().err
    (tmp_path / "junk").mkdir()
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "junk")]) == 2
    assert "a toy folder with toy.json" in capsys.readouterr().err


def _model(reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in reference.items() if k.startswith("model.")}


def test_a_format_that_holds_mesh_layouts_is_written_for_a_mesh_and_to_urls(toy_registered, fsdp2_dcp, fsdp2_reference,
                                                                              tmp_path: Path) -> None:
    """Its entry says it holds mesh layouts and is written to URLs: --to-mesh 3 to a local
    folder and to memory://, each read back exactly (3 ranks: uneven shards of the model)."""
    import fsspec

    want = _model(fsdp2_reference)
    local = tmp_path / "mesh.toy"
    assert main(["convert", str(fsdp2_dcp[0]), str(local), "--to-mesh", "3", "--only", "model", "--quiet"]) == 0
    assert sorted(p.name for p in local.glob("data-*.bin")) == ["data-0.bin", "data-1.bin", "data-2.bin"]
    url = "memory://toys/mesh.toy"
    try:
        result = reshard.convert(fsdp2_dcp[0], url, to="toy", mesh="3", only="model", quiet=True)
        assert result.format == "toy" and result.dst == url
        for src in (local, url):
            catalog = reshard.inspect(src)
            assert catalog.format == "toy" and len(catalog.tensors) == len(want)
            assert {len(t.chunks) for t in catalog.tensors.values() if t.shape and t.shape[0] >= 3} == {3}
            back = tmp_path / f"back_{len(list(tmp_path.iterdir()))}.safetensors"
            reshard.convert(src, back, quiet=True)
            theirs = load_file(back)  # safetensors' own reader
            assert theirs.keys() == want.keys()
            for name, value in want.items():
                assert torch.equal(theirs[name], value), name
    finally:
        fsspec.filesystem("memory").rm("/toys", recursive=True)
