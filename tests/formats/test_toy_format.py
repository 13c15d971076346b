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
                                writes=True, suffixes=(".toy",), mesh_writer="toy", remote=True,
                                options=("tests.formats.toy_format:LEVEL",)), before="torch")


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


def test_a_format_declares_its_own_option_in_its_module(toy_registered, fsdp2_dcp, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """``--toy-level`` is declared in tests/formats/toy_format.py and named by the entry alone:
    the command line offers it (with the entry's formats in its help), the API takes it as a
    keyword argument, the writer gets its value, its own check refuses a bad one, and other
    formats refuse it naming toy, as they refuse --compress naming zarr."""
    import json

    from reshard.formats.options import ConvertOptions

    assert main(["convert", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--toy-level N" in help_text and "How loud a toy output is" in help_text
    src = str(fsdp2_dcp[0])
    assert main(["convert", src, str(tmp_path / "cli.toy"), "--only", "model", "--toy-level", "3", "--quiet"]) == 0
    assert json.loads((tmp_path / "cli.toy" / "toy.json").read_text())["level"] == 3
    reshard.convert(src, tmp_path / "api.toy", only="model", toy_level=2, quiet=True)
    assert json.loads((tmp_path / "api.toy" / "toy.json").read_text())["level"] == 2
    assert ConvertOptions(toy_level=2).output == {"toy_level": 2} and "toy_level" in ConvertOptions.accepted()
    capsys.readouterr()
    assert main(["convert", src, str(tmp_path / "zero.toy"), "--toy-level", "0", "--quiet"]) == 2
    assert "--toy-level 0: a toy level is 1 or more" in capsys.readouterr().err
    assert main(["convert", src, str(tmp_path / "d"), "--to", "dcp", "--toy-level", "3", "--quiet"]) == 2
    assert "--toy-level applies to toy outputs, not dcp" in capsys.readouterr().err
    with pytest.raises(reshard.ReshardError, match="toy_level= applies to toy outputs, not safetensors"):
        reshard.convert(src, tmp_path / "s.safetensors", toy_level=3)
    assert not (tmp_path / "d").exists() and not (tmp_path / "zero.toy").exists()


def test_without_its_entry_the_option_is_gone(fsdp2_dcp, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The option lives in the toy's module: with no registry entry naming it, nothing offers it."""
    from reshard.formats.options import ConvertOptions

    assert main(["convert", "--help"]) == 0
    assert "--toy-level" not in capsys.readouterr().out
    with pytest.raises(reshard.ReshardError, match="unknown conversion option 'toy_level'"):
        ConvertOptions.of({"toy_level": 2})


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
        result = reshard.convert(fsdp2_dcp[0], url, to="toy", to_mesh="3", only="model", quiet=True)
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
