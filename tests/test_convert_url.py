"""One conversion path for local paths and URLs: ``file://`` is the same local path in every
respect (default output name, refusals, atomic write), and a remote zarr source or sink goes
through the same checks; ``--dry-run`` writes nothing anywhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import reshard
from reshard.cli.app import main
from reshard.core.errors import ReshardError

fsspec = pytest.importorskip("fsspec")


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _memory() -> list[str]:
    return sorted(fsspec.filesystem("memory").find("/"))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    src = tmp_path / "src" / "ckpt.pt"
    src.parent.mkdir()
    torch.save({"model": {"w": torch.randn(6, 4), "b": torch.randn(6)},
                "optim": {"state": {"w": {"exp_avg": torch.randn(6, 4), "step": torch.tensor(2.0)}},
                          "param_groups": [{"lr": 0.1, "params": ["w"]}]}}, src)
    return src


OPTIONS = [dict(to_mesh="2"), dict(dtype="bfloat16"), dict(to="zarr"), dict(to="safetensors"), dict(to_mesh="3", to="zarr")]
REFUSED = [dict(compress=True), dict(keep_per_rank=True), dict(to="dcp", max_shard_size="1MB"),
           dict(layout="no-such-layout"), dict(placements="fsdp")]


def _outcome(src: str | Path, **options) -> str:
    try:
        return str(Path(str(reshard.convert(src, dry_run=True, quiet=True, **options).dst)).name)
    except ReshardError as e:
        return f"{type(e).__name__}: {str(e).replace('file://', '')}"


def test_a_file_url_is_its_local_path_in_every_respect(ckpt: Path) -> None:
    url = f"file://{ckpt}"
    for options in OPTIONS + REFUSED:
        assert _outcome(ckpt, **options) == _outcome(url, **options), options
    assert _files(ckpt.parent) == ["ckpt.pt"]  # dry runs wrote nothing
    local = reshard.convert(ckpt, to_mesh="2", quiet=True)
    with pytest.raises(ReshardError, match="overwrite=True"):  # the same output, the same refusal
        reshard.convert(url, to_mesh="2", quiet=True)
    again = reshard.convert(url, to_mesh="2", quiet=True, overwrite=True, fsync=True)
    assert again.dst == local.dst and (Path(again.dst) / ".reshard-manifest.json").is_file()
    assert sorted(os.listdir(ckpt.parent)) == ["ckpt.pt", "ckpt_2"]  # no staging sibling left behind


def test_dry_run_writes_nothing_for_remote_sources_and_sinks(ckpt: Path, tmp_path: Path, capsys) -> None:
    url = "memory://reshard-url-test/store.zarr"
    before = _memory()
    result = reshard.convert(ckpt, url, dry_run=True, quiet=True)
    assert result.dry_run and result.dst == url and _memory() == before  # nothing put
    reshard.convert(ckpt, url, quiet=True, overwrite=True)
    out = tmp_path / "out.safetensors"
    assert main(["convert", url, str(out), "--dry-run"]) == 0
    assert not out.exists() and "dry run:" in capsys.readouterr().out
    assert main(["convert", url, str(out), "--dry-run", "--to-mesh", "2"]) == 2  # the same refusal as for a path
    assert "--to safetensors holds whole tensors" in capsys.readouterr().err
    # a remote source has no "beside" to name an output after
    assert main(["convert", url, "--to-mesh", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a remote source needs an explicit DST" in err[0]
    reshard.convert(url, out, quiet=True)
    from safetensors.torch import load_file

    assert set(load_file(out)) == {"model.w", "model.b", "optim.state.w.exp_avg", "optim.state.w.step"}
