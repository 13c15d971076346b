"""Smoke test of scripts/bench.py: a tiny checkpoint, one run per row, table and JSON out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_make_bench_ckpt_dims_shard_unevenly() -> None:
    sys.path.insert(0, str(SCRIPTS))
    try:
        from make_bench_ckpt import WORLD_SIZE, solve_dims, tensor_shapes, total_bytes
    finally:
        sys.path.remove(str(SCRIPTS))
    for size_mb in (8, 1536):
        dims = solve_dims(size_mb)
        assert abs(total_bytes(dims) / 2**20 - size_mb) / size_mb < 0.1
        rows = {shape[0] for shape in tensor_shapes(dims).values()}
        assert any(n % WORLD_SIZE for n in rows), "some tensors must shard unevenly"


@pytest.mark.timeout(300)
def test_bench_runs_and_prints_table(tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench.py"), "--size-mb", "8", "--repeats", "1",
         "--ckpt", str(tmp_path / "ckpt_8"), "--json", str(out_json), "--no-load"],
        capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for needle in ("WARM cache", "import torch", "cp -r", "reshard -> safetensors", "reshard -> torch",
                   "torch dcp_to_torch", "DCP -> safetensors work / cp wall =",
                   "peak RSS above import torch ="):
        assert needle in out, f"{needle!r} missing from:\n{out}"
    report = json.loads(out_json.read_text())
    rows = {r["name"]: r for r in report["rows"]}
    for name in ("import torch", "cp -r", "reshard -> safetensors", "reshard -> torch"):
        assert rows[name]["error"] is None, rows[name]["error"]
        assert rows[name]["peak_rss_mib"] > 0 and rows[name]["wall_s"] > 0
    # the scratch outputs are gone; only the cached checkpoint and its marker remain
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "ckpt_8", "ckpt_8.marker.json"]
