"""One JSON object per command, versioned (schema 1) and valid against reshard/cli/schema.json;
and the CLI basics a first hour trips over: --version, examples in every --help, usage lines,
no torch import for help."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist import HANG_GUARD
from tests.schema import check
from tests.test_cli import reshard as run_cli

COMMANDS = ("inspect", "convert", "verify", "push", "train", "validate")


def _json(*args: object) -> dict:
    proc = run_cli(*args, "--json")
    assert proc.returncode in (0, 1), proc.stderr
    return check(json.loads(proc.stdout))


def test_every_reporting_command_prints_schema_1(fsdp2_dcp, tmp_path: Path) -> None:
    src = fsdp2_dcp[0]
    doc = _json("inspect", src, "--to-mesh", "2x2")
    assert doc["command"] == "inspect" and doc["layout"]["name"] == "torch-optim" and len(doc["target"]["ranks"]) == 4
    names = [t["name"] for t in doc["tensors"]]
    assert doc["attrs"]["source_world_size"] == 3 and names == sorted(names)
    out = _json("convert", src, tmp_path / "m.pt", "--only", "model")
    assert out["command"] == "convert" and out["dst"] == str(tmp_path / "m.pt") and out["files"][0]["path"] == "m.pt"
    plan = _json("convert", src, "--to-mesh", "4", "--dry-run")
    assert plan["dry_run"] and len(plan["target"]["ranks"]) == 4 and not Path(plan["dst"]).exists()
    same = _json("verify", src, tmp_path / "m.pt", "--only", "model")
    assert same["equal"] and same["compared"] == 6 and not same["quick"]
    diff = _json("verify", src, tmp_path / "m.pt")
    assert not diff["equal"] and {d["kind"] for d in diff["differences"]} >= {"only_in_a"}
    run_cli("convert", src, tmp_path / "hf", "--to", "hf", "--weights-only", "--quiet")
    quick = _json("verify", "--quick", tmp_path / "hf")
    assert quick["equal"] and quick["quick"]


def test_push_and_train_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.hf_models import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "tiny", tie=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    push = _json("push", folder, "someone/tiny", "--dry-run", "--create-pr")
    assert push["dry_run"] and push["url"] is None and any(f["path"] == "config.json" for f in push["files"])
    train = _json("train", "--to-mesh", "1", "--steps", "1", "--device", "cpu")
    assert train["end_step"] == 1 and list(train["losses"]) == ["1"]


def test_version_help_examples_and_usage_lines() -> None:
    from reshard import __version__

    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"reshard {__version__}"
    for command in COMMANDS:
        text = run_cli(command, "--help").stdout
        assert "Examples:" in text and text.count("reshard ") >= 3, command
        assert "{" not in text.split("\n\n")[0 if text.startswith("Usage") else 1], command  # "SRC", not "{SRC}"
    assert "Usage: reshard convert [OPTIONS] SRC [DST]" in " ".join(run_cli("convert", "--help").stdout.split())
    assert "--install-completion" in run_cli("--help").stdout


def test_help_and_usage_errors_do_not_import_torch() -> None:
    code = ("import sys\nfrom reshard.cli.app import main\nrc = main(sys.argv[1:])\n"
            "print('torch' in sys.modules, rc)")
    for argv in (["--help"], ["convert", "--help"], ["convert", "--bogus"], ["verify"]):
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=HANG_GUARD)
        assert proc.stdout.strip().splitlines()[-1].startswith("False"), (argv, proc.stdout[-200:])
    bare = "import sys, reshard, reshard.pipeline.options, reshard.formats.registry; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True, timeout=HANG_GUARD)
    assert proc.stdout.strip() == "False", proc.stderr[-500:]


def test_byte_paths_do_not_import_torch(fsdp2_dcp, fsdp2_reference, tmp_path: Path) -> None:
    """Reading metadata and moving bytes need no torch (its import is most of a command's
    start-up): inspect, verify (bit for bit) and conversions without a cast run on numpy, in
    any direction between DCP, safetensors, torch files and zarr (compressed too), onto any
    mesh. What they write is then read back by the outside readers, in this process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    src = fsdp2_dcp[0]
    code = ("import sys\nfrom reshard.cli.app import main\nrc = main(sys.argv[1:])\n"
            "print('torch' in sys.modules, rc)")
    commands = [
        ["inspect", src], ["inspect", src, "--json"],
        ["convert", src, tmp_path / "all.safetensors"],
        ["convert", src, tmp_path / "mesh3", "--to-mesh", "3"],
        ["verify", "--quick", tmp_path / "mesh3"],
        ["verify", src, tmp_path / "mesh3"],  # every bit, on numpy
        ["convert", tmp_path / "all.safetensors", tmp_path / "all.pt"],
        ["inspect", tmp_path / "all.pt"],
        ["convert", tmp_path / "all.pt", tmp_path / "back.safetensors"],
        ["convert", tmp_path / "all.safetensors", tmp_path / "all.zarr"],
        ["inspect", tmp_path / "all.zarr"],
        ["convert", tmp_path / "all.zarr", tmp_path / "zarr.safetensors"],
        ["convert", tmp_path / "all.safetensors", tmp_path / "packed.zarr", "--compress"],
        ["convert", tmp_path / "packed.zarr", tmp_path / "packed", "--to-mesh", "2"],
        ["convert", tmp_path / "packed", tmp_path / "packed.safetensors"],
    ]
    for argv in commands:
        argv = [str(a) for a in argv]
        proc = subprocess.run([sys.executable, "-c", code, *argv, "--quiet"] if argv[0] == "convert" else
                              [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=HANG_GUARD)
        assert proc.stdout.strip().splitlines()[-1] == "False 0", (argv, proc.stdout[-300:], proc.stderr[-500:])

    for name in ("all.safetensors", "back.safetensors", "zarr.safetensors", "packed.safetensors"):
        out = load_file(tmp_path / name)
        assert set(out) == set(fsdp2_reference), name
        assert all(torch.equal(out[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
                   for n, t in fsdp2_reference.items()), name
    sd = {n: torch.empty_like(t) for n, t in fsdp2_reference.items()}
    dcp.load(sd, checkpoint_id=tmp_path / "mesh3")
    assert all(torch.equal(sd[n], t) for n, t in fsdp2_reference.items())


def test_repr_and_help_of_the_api(fsdp2_dcp) -> None:
    import pydoc

    import reshard

    catalog = reshard.inspect(fsdp2_dcp[0])
    assert len(repr(catalog).splitlines()) <= 12 and "layout torch-optim" in repr(catalog)
    assert catalog._repr_html_().startswith("<p><b>reshard Catalog</b>") and "model.embed.weight" in catalog.table()
    text = pydoc.render_doc(reshard, renderer=pydoc.plaintext)
    for name in ("inspect", "convert", "verify", "load_model", "load_state_dict", "push"):
        assert name in dir(reshard) and f"{name}(" in text, name
    for result in (reshard.ConvertResult, reshard.VerifyResult, reshard.PushResult, reshard.LoadResult):
        assert result.__doc__ and not result.__doc__.startswith(f"{result.__name__}("), result  # not dataclass's stub


def test_compact_json_writes_chunk_columns_exactly_as_json_would(tmp_path: Path) -> None:
    """Big checkpoints' chunk lists are written from their columns as text: the result is the
    same JSON, byte for byte, as json.dumps of the plain lists, for sharded, scalar, empty and
    uneven tensors, and names that look like JSON."""
    import torch

    import reshard
    from reshard.commands.inspect import catalog_json, compact_json

    state = {"w": torch.zeros(7, 3), 'odd "name",[]': torch.zeros(5), "scalar": torch.tensor(2.0),
             "empty": torch.zeros(0, 4)}
    torch.save(state, tmp_path / "a.pt")
    reshard.convert(tmp_path / "a.pt", tmp_path / "dcp", to_mesh="3", quiet=True)
    for src in (tmp_path / "a.pt", tmp_path / "dcp"):
        catalog = reshard.inspect(src)
        plain = json.dumps(catalog_json(catalog), separators=(",", ":"))
        assert compact_json(catalog_json(catalog, chunks_as_text=True)) == plain
    assert len(json.loads(plain)["tensors"][-1]["chunks"]) == 3  # "w", 3 shards: the check saw several
