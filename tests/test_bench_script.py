"""Smoke test of scripts/bench.py: a tiny checkpoint, one run per row, table and JSON out."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.dist import HANG_GUARD

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


def test_bench_runs_and_prints_table(tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench.py"), "--size-mb", "8", "--repeats", "1",
         "--ckpt", str(tmp_path / "ckpt_8"), "--json", str(out_json), "--no-load"],
        capture_output=True, text=True, timeout=HANG_GUARD,
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


# ------------------------------------------------------------------ pure parts of the bench scripts


@pytest.fixture()
def scripts(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The scripts folder importable (the bench scripts import each other by name)."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return SCRIPTS


def test_command_stdout_and_check(scripts: Path, tmp_path: Path) -> None:
    from bench_harness import Command, _failure, rss_probe, run_measured

    out = tmp_path / "out.txt"
    cmd = Command([sys.executable, "-c", "import sys; print('hello'); print('oops', file=sys.stderr)"], out,
                  stdout=out, check=lambda: None if out.read_text() == "hello\n" else "wrong text")
    res = run_measured(cmd.argv, tmp_path, tmp_path / "run.log", rss_probe(), cmd.stdout)
    assert res.returncode == 0 and res.maxrss_kib > 0
    assert out.read_text() == "hello\n" and "oops" in (tmp_path / "run.log").read_text()
    assert _failure(res, cmd) is None
    wrong = Command(cmd.argv, out, check=lambda: "it printed nothing useful")
    assert _failure(res, wrong) == "exit 0 but it printed nothing useful"


def test_acceptance_pair_runs_alternately_first(scripts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """cp and the reshard row it is held to run back to back, round after round (cp, reshard,
    cp, reshard...), before the other rows; the check line gives both walls and CPU seconds."""
    import bench
    from bench_harness import CP, Command, Context, Row, measure, rss_probe, summarize

    ctx = Context(tmp_path / "src", tmp_path / "scratch", sys.executable, (), "1MiB", rss_probe())
    (tmp_path / "src").mkdir()
    (tmp_path / "logs").mkdir()
    run = Command([sys.executable, "-c", "pass"], sources=())
    rows = [Row("other", lambda c: run), Row(CP, lambda c: run, kind="bytes"), Row(bench.RESHARD_ST, lambda c: run)]
    results = measure(rows, ctx, 3, tmp_path / "logs", paired=(CP, bench.RESHARD_ST))
    order = [line.split("]", 1)[1].split()[0] for line in capsys.readouterr().err.splitlines()]
    assert order == ["cp", "reshard"] * 3 + ["other"] * 3
    assert [m.name for m in results] == ["other", CP, bench.RESHARD_ST] and all(len(m.cpus) == 3 for m in results)
    check = next(c for c in bench.acceptance(summarize(results)) if c["name"] == "DCP -> safetensors wall / cp wall")
    assert "3 alternating rounds" in check["text"] and " cpu " in check["text"] and "cp wall" in check["text"]


def test_scale_growth_and_prediction(scripts: Path) -> None:
    from bench_scale import growth_exponent, predict_peak_mib

    assert growth_exponent(1e5, 2.0, 4e5, 8.0) == pytest.approx(1.0)
    assert growth_exponent(1e5, 2.0, 4e5, 32.0) == pytest.approx(2.0)
    assert growth_exponent(1e5, 0.0, 4e5, 8.0) is None and growth_exponent(1e5, 1.0, 1e5, 2.0) is None
    assert predict_peak_mib(200, 700, 1000, 4000) == 2200  # the part above start-up, x4
    assert predict_peak_mib(200, 150, 1000, 4000) == 200


def _row(name: str, wall: float, rss: float, **extra: object) -> dict:
    return {"name": name, "error": None, "wall_s": wall, "peak_rss_mib": rss, "work_s": wall - 2,
            "rss_above_import_mib": rss - 200, "required": name.startswith("reshard"), **extra}


def test_scale_checks_at_256_ranks(scripts: Path) -> None:
    from bench_scale import DRY_RUN, INSPECT_JSON, INSPECT_MESH, INSPECT_MESH_JSON, TORCH_READ, _ratios, scale_checks

    rows = [_row(TORCH_READ, 40, 1500), _row(INSPECT_JSON, 46, 1400), _row(INSPECT_MESH_JSON, 70, 1600),
            _row(INSPECT_MESH, 50, 1600), _row(DRY_RUN, 80, 2000)]
    _ratios(rows)
    failed = dict(_row("reshard inspect --json", 0, 0), error="exit 2: boom")
    checks = scale_checks([{"ranks": 256, "chunks": 873_216, "rows": rows},
                           {"ranks": 2048, "chunks": 6_985_728, "rows": [failed]}])
    verdict = {c["name"]: c["ok"] for c in checks}
    assert verdict[f"256 ranks: {INSPECT_JSON} wall / torch"] is True  # 1.15 <= 1.2
    assert verdict[f"256 ranks: {INSPECT_JSON} peak RSS / torch"] is True
    assert verdict[f"256 ranks: {INSPECT_MESH_JSON} wall / torch"] is False  # 1.75 > 1.5
    assert verdict[f"256 ranks: {INSPECT_MESH} wall / torch"] is True  # 1.25
    assert verdict["256 ranks: dry run"] is True
    assert verdict["2048 ranks completes"] is False


def test_text_check(scripts: Path, tmp_path: Path) -> None:
    from bench_scale import _text_check

    f = tmp_path / "x.json"
    f.write_text('{"tensors": []}\n')
    assert _text_check(f, starts="{", ends="}", contains='"tensors"') is None
    f.write_text("")
    assert "printed nothing" in _text_check(f, starts="{")
    f.write_text("reshard: error: boom")
    assert "not what was expected" in _text_check(f, starts="{", ends="}")


def test_paths_budget_heads_and_plan(scripts: Path) -> None:
    import fnmatch

    from bench_paths import budget_mib, dim1_plan, llama_heads
    from make_bench_ckpt import solve_dims, tensor_shapes

    assert budget_mib("256MiB") == 256 and budget_mib("256M") == 256 and budget_mib("1GiB") == 1024
    assert budget_mib("2GB") == pytest.approx(2e9 / 2**20) and budget_mib("1048576") == 1
    for size_mb in (8, 1536):
        d = solve_dims(size_mb)
        heads, kv = llama_heads(d.dim, d.kv_dim)
        assert d.dim % heads == 0 and (d.dim // heads) % 2 == 0 and d.kv_dim == kv * (d.dim // heads)
        plan = dim1_plan()
        for fqn, shape in tensor_shapes(d).items():  # every matrix on Shard(1), every pattern used
            hits = [p for p in plan["placements"] if fnmatch.fnmatchcase(fqn, p)]
            assert bool(hits) == (len(shape) == 2), fqn
        assert all(any(fnmatch.fnmatchcase(f, p) for f in tensor_shapes(d)) for p in plan["placements"])


def test_paths_checks(scripts: Path) -> None:
    from bench_paths import DIM0, DIM1, DTYPE, MOE, TORCH_CAST, Sources, path_checks, path_rows

    rows = path_rows(Sources(8, None))  # nothing is made until a row is built
    summary = [_row("import torch", 2, 200), _row(DTYPE, 10, 600), _row(TORCH_CAST, 20, 2000),
               _row(DIM0, 12, 500), _row(DIM1, 30, 500), _row(MOE, 10, 800)]
    verdict = {c["name"]: c["ok"] for c in path_checks(summary, rows, budget=256)}
    assert verdict[f"{DTYPE}: peak RSS above import torch"] is False  # 400 > 384
    assert verdict[f"{MOE}: peak RSS above import torch"] is True  # 600 <= 256 + 384
    assert verdict["dim-1 / dim-0 re-layout work"] is False  # 28 / 10
    assert f"{TORCH_CAST}: peak RSS above import torch" not in verdict  # peers have no target
    # --merge-lora runs at its own budget (a quarter of its model): its target follows it
    from bench_paths import MERGE_LORA

    merge = next(p for p in rows if p.row.name == MERGE_LORA)
    assert merge.target == "budget" and merge.budget_mib is not None
    assert replace(merge, budget_mib=lambda: 128).target_mib(256) == 128 + 384


def test_meta_ckpt_cached(scripts: Path, tmp_path: Path) -> None:
    from make_meta_ckpt import chunk_count, ensure_meta_checkpoint, tensors

    out = ensure_meta_checkpoint(tmp_path / "meta_3", 3, n_layers=2, quiet=True)
    marker = json.loads((tmp_path / "meta_3.marker.json").read_text())
    assert marker["chunks"] == chunk_count(3, 2) == 3 * len(tensors(2))
    stamp = (out / ".metadata").stat().st_mtime_ns
    assert ensure_meta_checkpoint(out, 3, n_layers=2, quiet=True) == out
    assert (out / ".metadata").stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_moe_names_are_torchtitan_qwen3(scripts: Path) -> None:
    from make_moe_ckpt import moe_config, moe_shapes, solve_moe_dims, total_bytes

    from reshard.features.keymap.lookup import PRESETS

    qwen3 = PRESETS["titan-to-hf"]().families["qwen3"]
    for size_mb in (16, 1536):
        d = solve_moe_dims(size_mb)
        assert abs(total_bytes(d) / 2**20 - size_mb) / size_mb < 0.1 and d.experts % 4 == 0
        assert moe_config(d)["num_experts"] == d.experts
        for name in moe_shapes(d):
            assert qwen3.route(name) is not None, name
    big = solve_moe_dims(1536)
    assert big.experts * big.ffn * big.dim * 4 > 256 * 2**20  # an expert slab is larger than the 256MiB budget


def test_fp8_plan(scripts: Path) -> None:
    import torch
    from make_fp8_ckpt import BLOCK, fp8_tensors, plan_shards, quantize, solve_fp8_dims, total_bytes

    for size_mb in (8, 1536):
        d = solve_fp8_dims(size_mb)
        assert abs(total_bytes(d) / 2**20 - size_mb) / size_mb < 0.1
    tensors = fp8_tensors(solve_fp8_dims(1536))
    weights = [(n, s) for n, s, k in tensors if k == "fp8"]
    assert sum(s[0] % BLOCK != 0 or s[1] % BLOCK != 0 for _, s in weights) > len(weights) / 2  # partial edge blocks
    shards = plan_shards(tensors, max_bytes=64 * 2**20)
    assert sorted(i for s in shards for i in s) == list(range(len(tensors)))
    where = {tensors[i][0]: k for k, s in enumerate(shards) for i in s}
    assert all(where[n] == where[n.removesuffix("weight") + "weight_scale_inv"] for n, _ in weights)
    w = torch.randn(300, 200)
    q, scale = quantize(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    back = q.float() * scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:300, :200]
    assert torch.allclose(back, w, rtol=0.07, atol=1e-3)


def test_bench_scale_smoke(scripts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    import bench
    import bench_scale

    monkeypatch.setattr(bench_scale, "default_meta_path", lambda n: tmp_path / f"meta_{n}")
    (tmp_path / "run" / "logs").mkdir(parents=True)
    args = bench.parse_args(["--scale", "--world-sizes", "2", "--repeats", "1"])
    report, code = bench_scale.run_scale(args, tmp_path / "run")
    out = capsys.readouterr().out
    assert code == 0, out
    for needle in ("2 ranks:", "torch read_metadata", "reshard inspect --to-mesh 32x8 --json", "growth with world size",
                   "PASS  2 ranks (6,822 chunks): every reshard row completes", "wrote nothing"):
        assert needle in out, f"{needle!r} missing from:\n{out}"
    rows = {r["name"]: r for r in report["sizes"][0]["rows"]}
    assert all(r["error"] is None for r in rows.values()), rows
    assert rows[bench_scale.INSPECT_JSON]["wall_over_torch"] > 0


def test_bench_paths_smoke(tmp_path: Path) -> None:
    out_json = tmp_path / "paths.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench.py"), "--paths", "--only", "dtype", "--size-mb", "8", "--repeats", "1",
         "--ckpt", str(tmp_path / "ckpt_8"), "--max-memory", "1MiB", "--json", str(out_json)],
        capture_output=True, text=True, timeout=HANG_GUARD,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for needle in ("memory paths | --max-memory 1MiB", "reshard --dtype bfloat16 -> dcp", "target MiB",
                   "peak RSS above import torch =", "scripts/bench_load.py"):
        assert needle in proc.stdout, f"{needle!r} missing from:\n{proc.stdout}"
    rows = {r["name"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {"import torch", "reshard --dtype bfloat16 -> dcp"}
    assert rows["reshard --dtype bfloat16 -> dcp"]["error"] is None
    assert rows["reshard --dtype bfloat16 -> dcp"]["target_mib"] == 384


def test_meta_ckpt_matches_torch(scripts: Path) -> None:
    from make_meta_ckpt import check

    check(ranks=3, n_layers=2)
    check(ranks=2048, n_layers=1)  # empty pieces: records of their own, as torch writes them


def _load_records(walls: dict[tuple[str, str, str], float], added: float = 10.0, checksum: float = 1.0) -> list[dict]:
    return [{"cache": c, "round": 1, "source": s, "row": r, "wall_s": w, "added_mib": added, "over_shard_mib": added,
             "checksum": checksum} for (c, s, r), w in walls.items()]


def test_load_bench_targets(scripts: Path) -> None:
    from bench_load import DCP, HF, PARALLEL, RANK0, READER, TORCH, checks, report, summarize

    walls = {("warm", DCP, TORCH): 1.0, ("warm", DCP, PARALLEL): 0.7, ("warm", DCP, RANK0): 1.3,
             ("warm", DCP, READER): 0.9, ("warm", HF, TORCH): 1.0, ("warm", HF, PARALLEL): 1.1,
             ("warm", HF, RANK0): 2.5, ("cold", DCP, TORCH): 2.0, ("cold", DCP, PARALLEL): 2.2,
             ("cold", HF, TORCH): 1.0, ("cold", HF, PARALLEL): 0.9}
    by_n = {2: summarize(_load_records(walls)), 3: summarize(_load_records(walls, added=300.0, checksum=2.0)
                                                            + _load_records({("warm", DCP, TORCH): 1.0}, checksum=3.0))}
    verdict = {c["text"].rsplit(": ", 1)[0]: c["ok"] for c in checks(by_n, 256.0, big=True)}
    assert verdict["warm, DCP onto 2 ranks: reshard.load_state_dict / dcp.load FileSystemReader"] is True  # 0.7 <= 0.8
    assert verdict["warm, HF onto 2 ranks: reshard.load_state_dict / dcp.load HuggingFaceStorageReader"] is False
    assert verdict["warm, DCP onto 2 ranks: rank0 mode / parallel mode"] is True  # 1.3 / 0.7
    assert verdict["warm, HF onto 2 ranks: rank0 mode / parallel mode"] is False  # 2.5 / 1.1
    assert verdict["warm, DCP onto 2 ranks: dcp.load reshard.StorageReader / dcp.load FileSystemReader"] is None
    assert verdict["warm, DCP onto 3 ranks: reshard.load_state_dict / dcp.load FileSystemReader"] is None  # 2 ranks only
    assert verdict["cold, DCP onto 2 ranks: reshard.load_state_dict / dcp.load FileSystemReader"] is False  # big: 1.1
    assert verdict["cold, HF onto 3 ranks: reshard.load_state_dict / dcp.load HuggingFaceStorageReader"] is True
    rss = {c["text"].split(":")[0]: c["ok"] for c in checks(by_n, 256.0, big=True) if "peak RSS" in c["text"]}
    assert rss == {"2 ranks": True, "3 ranks": False}  # 300 MiB added > 256
    same = [c for c in checks(by_n, 256.0, big=True) if "same values" in c["text"]]
    assert [c["ok"] for c in same] == [True, False]  # 3 ranks: a round that loaded other values
    assert "cold" not in " ".join(c["text"] for c in checks(by_n, 256.0, big=False) if c["ok"] is not None)
    lines = report(by_n, {2: [1.0, 1.0], 3: [1.0, 1.0, 1.0]})
    assert lines[0].startswith("row") and any(line.startswith("DCP dcp.load FileSystemReader") for line in lines)
    assert any("0.70" in line and "reshard parallel" in line for line in lines)


def test_load_bench_smoke(tmp_path: Path) -> None:
    out_json = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_load.py"), "--size-mb", "4", "--rounds", "1", "--nprocs", "2",
         "--cache", "warm,cold", "--cache-dir", str(tmp_path / "cache"), "--json", str(out_json)],
        capture_output=True, text=True, timeout=HANG_GUARD,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for needle in ("DCP saved by 4 ranks", "HF folder", "DCP dcp.load FileSystemReader", "HF reshard rank0",
                   "HF dcp.load reshard.StorageReader", "load average", "cold, HF onto 2 ranks",
                   "2 ranks: every row and round loaded the same values (1 distinct checksum)"):
        assert needle in proc.stdout, f"{needle!r} missing from:\n{proc.stdout}"
    report = json.loads(out_json.read_text())
    assert len(report["records"]["2"]) == 16 and all(r["wall_s"] > 0 for r in report["records"]["2"])
