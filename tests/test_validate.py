"""`reshard validate` end to end on real gloo worlds (issue 5, acceptance 1), and proof that it
can fail: one flipped element in one conversion turns that path, and the exit code, red."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import reshard
import reshard.commands.validate as validate_mod
from reshard.commands.validate import PathResult, ValidateResult, format_table, validate
from reshard.core.regions import StoredRegion, as_region
from tests.schema import check
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as run_cli


def test_validate_2_to_3_every_path_matches() -> None:
    proc = run_cli("validate", "--from-mesh", "2", "--to-mesh", "3", "--steps", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.split()[:1] in
            (["dcp"], ["safetensors"], ["torch"], ["zarr"])}
    assert set(rows) == {"dcp", "safetensors", "torch", "zarr"}
    assert all(r.count("bit-exact") == 2 and r.endswith("MATCH") for r in rows.values()), proc.stdout
    assert "DCP(2) -> DCP laid out for 3" in rows["dcp"] and "all 4 paths match" in proc.stdout


def test_validate_hsdp_to_4_reports_exact_state_and_fp32_noise(tmp_path: Path) -> None:
    proc = run_cli("validate", "--from-mesh", "1x2", "--to-mesh", "4", "--steps", "3", "--json",
                   "--workdir", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = check(json.loads(proc.stdout))
    assert doc["command"] == "validate" and doc["ok"] and sorted(doc["reference_losses"]) == ["1", "2", "3", "4", "5", "6"]
    assert [p["name"] for p in doc["paths"]] == ["dcp", "safetensors", "torch", "zarr"]
    for p in doc["paths"]:
        assert (p["status"], p["converted_exact"], p["loaded_exact"]) == ("match", True, True), p
        assert sorted(p["losses"]) == ["4", "5", "6"]
        assert p["max_rel_loss_diff"] < 1e-5  # measured ~1e-7: the order of fp32 reductions only
    # The kept checkpoint was saved on the 2-D mesh; the dcp path re-laid it for 4 ranks.
    assert reshard.inspect(tmp_path / "run_a" / "step-3").objects["train.step"] == 3
    assert (tmp_path / "dcp_4" / ".metadata").exists()


def _flip_one_element(ckpt: Path, name: str) -> None:
    """Flip the sign bit of the first element of tensor ``name`` where it is stored on disk."""
    region = as_region(reshard.inspect(ckpt).tensors[name].chunks[0].data)
    assert isinstance(region, StoredRegion) and region.dtype.itemsize == 4
    with open(region.path, "r+b") as f:
        f.seek(region.offset + 3)  # little-endian float32: the sign is in the last byte
        byte = f.read(1)[0]
        f.seek(region.offset + 3)
        f.write(bytes([byte ^ 0x80]))


def test_a_flipped_element_fails_its_path_and_the_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    real = validate_mod.convert_path

    def broken(name: str, ckpt: Path, workdir: Path, to_mesh: str) -> list[Path]:
        outputs = real(name, ckpt, workdir, to_mesh)
        if name == "torch":
            _flip_one_element(outputs[-1], "model.layers.0.attention.wq.weight")
        return outputs

    monkeypatch.setattr(validate_mod, "convert_path", broken)
    proc = run_cli("validate", "--from-mesh", "1", "--to-mesh", "2", "--steps", "1", "--via", "torch,dcp")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    torch_row = next(line for line in proc.stdout.splitlines() if line.startswith("torch "))
    assert "DIFFERS" in torch_row and torch_row.endswith("MISMATCH")
    assert "torch: torch_back: 1 difference from the checkpoint, first model.layers.0.attention.wq.weight: " \
           "values: 1 of 1024 elements differ" in proc.stdout
    assert next(line for line in proc.stdout.splitlines() if line.startswith("dcp ")).endswith("MATCH")
    assert "1 of 2 paths do not match" in proc.stdout


def test_an_unavailable_path_is_not_a_pass() -> None:
    rows = [PathResult("dcp", "DCP(2) -> DCP laid out for 3", status="match", converted_exact=True,
                       loaded_exact=True, max_loss_diff=4.8e-7, max_rel_loss_diff=1.2e-7),
            PathResult("zarr", "DCP(2) -> zarr -> DCP", status="unavailable",
                       detail="the zarr format is not available here: unknown format 'zarr'")]
    result = ValidateResult("2", "3", 3, "tiny", 1e-4, {1: 4.0}, rows)
    assert not result.ok and result.to_json()["ok"] is False
    table = format_table(result)
    assert "UNAVAILABLE" in table and "zarr: the zarr format is not available here" in table
    assert "1 of 2 paths do not match" in table
    assert not ValidateResult("2", "3", 3, "tiny", 1e-4, {}, []).ok


@pytest.mark.parametrize("args, needle", [
    (["--from-mesh", "2", "--to-mesh", "3", "--via", "dcp,hdf5"], "--via hdf5: choose among dcp, safetensors"),
    (["--from-mesh", "5", "--to-mesh", "3"], "--global-batch 12 does not split over 5 ranks"),
    (["--from-mesh", "2", "--to-mesh", "3", "--steps", "0"], "--steps must be at least 1"),
])
def test_bad_requests_exit_2_before_training(args: list[str], needle: str) -> None:
    assert_one_line_error(run_cli("validate", *args), needle)


def test_validate_api_refuses_an_empty_via() -> None:
    with pytest.raises(reshard.ReshardError, match="choose among"):
        validate("2", "3", via=())
