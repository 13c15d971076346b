"""Many-tensor rows for scripts/bench.py (``--many``): a DCP of 103,680 small tensors.

Source: ``scripts/make_many_tensors_ckpt.py`` (a fine-grained MoE with AdamW state, saved by
2 ranks; its cost is names and chunks, not bytes), cached under ``.bench/many_103680``. Rows,
by bench.py's method (each its own child process, wall spawn to exit, peak RSS by ``wait4``,
warm cache, medians), with the peers in the same run:

* ``torch read_metadata``: ``FileSystemReader(SRC).read_metadata()``, what any DCP reader
  pays before it plans; the peer of ``reshard inspect --json``;
* ``reshard --to-mesh 4``: ``convert --to-mesh 4 --max-memory M``, peak RSS against the budget;
* ``reshard -> safetensors`` and its peer ``torch dcp_to_torch`` (everything in memory).

The issue's targets are checked: inspect within 1.0x read_metadata's wall, ``--to-mesh 4``
within 3x read_metadata's wall and ``--max-memory`` + 384 MiB above import torch, conversions
within torch's peak RSS. ``--only`` picks rows as in the default table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench_harness import (
    CP,
    IMPORT_TORCH,
    TORCH_DCP,
    Command,
    Context,
    Row,
    cp_command,
    environment,
    import_torch_command,
    measure,
    print_checks,
    print_table,
    reshard_argv,
    rss_probe,
    select_rows,
    summarize,
    torch_dcp_command,
    warm_read,
)
from bench_paths import budget_mib
from make_many_tensors_ckpt import default_many_path, ensure_many_tensors_checkpoint

__all__ = ["many_rows", "many_checks", "run_many"]

OVER_BUDGET_MIB = 384
MESH_OVER_READ_METADATA = 3.0
READ_METADATA = "torch read_metadata"
INSPECT = "reshard inspect --json"
MESH = "reshard --to-mesh 4"
TO_ST = "reshard -> safetensors"

_READ_METADATA = ("import sys; from torch.distributed.checkpoint import FileSystemReader; "
                  "FileSystemReader(sys.argv[1]).read_metadata()")


def many_rows() -> list[Row]:
    def read_metadata(c: Context) -> Command:
        return Command([c.python, "-c", _READ_METADATA, str(c.src)])

    def inspect(c: Context) -> Command:
        out = c.scratch / "inspect.json"
        return Command([*c.reshard, "inspect", str(c.src), "--json"], out, stdout=out)

    def mesh(c: Context) -> Command:
        out = c.scratch / "out_4"
        return Command([*c.reshard, "convert", str(c.src), str(out), "--to-mesh", "4", "--max-memory", c.max_memory,
                        "--quiet"], out / ".metadata")

    def to_st(c: Context) -> Command:
        out = c.scratch / "out.safetensors"
        return Command([*c.reshard, "convert", str(c.src), str(out), "--max-memory", c.max_memory, "--quiet"], out)

    return [Row(IMPORT_TORCH, import_torch_command), Row(CP, cp_command, kind="bytes"),
            Row(READ_METADATA, read_metadata), Row(INSPECT, inspect, required=True), Row(MESH, mesh, required=True),
            Row(TO_ST, to_st, required=True), Row(TORCH_DCP, torch_dcp_command)]


def many_checks(summary: list[dict[str, Any]], max_memory: str) -> list[dict[str, Any]]:
    ok = {r["name"]: r for r in summary if r["error"] is None}
    checks: list[dict[str, Any]] = []
    if INSPECT in ok and READ_METADATA in ok:
        x = ok[INSPECT]["wall_s"] / ok[READ_METADATA]["wall_s"]
        checks.append({"name": "inspect / read_metadata wall", "value": x, "target": 1.0, "ok": x <= 1.0,
                       "text": f"inspect --json wall / torch read_metadata wall = {x:.2f} (target <= 1.0)"})
    if MESH in ok and READ_METADATA in ok:
        x, limit = ok[MESH]["wall_s"] / ok[READ_METADATA]["wall_s"], MESH_OVER_READ_METADATA
        checks.append({"name": "--to-mesh 4 / read_metadata wall", "value": x, "target": limit, "ok": x <= limit,
                       "text": f"--to-mesh 4 wall / torch read_metadata wall = {x:.2f} (target <= {limit:g})"})
    if MESH in ok and ok[MESH]["rss_above_import_mib"] is not None:
        y, limit = ok[MESH]["rss_above_import_mib"], budget_mib(max_memory) + OVER_BUDGET_MIB
        checks.append({"name": "--to-mesh 4 peak RSS above import torch", "value": y, "target": limit, "ok": y <= limit,
                       "text": f"--to-mesh 4 peak RSS above import torch = {y:.0f} MiB (target <= {limit:.0f}: "
                               f"--max-memory + {OVER_BUDGET_MIB})"})
    if TORCH_DCP in ok:
        peer = ok[TORCH_DCP]["peak_rss_mib"]
        for name in (MESH, TO_ST):
            if name in ok:
                y = ok[name]["peak_rss_mib"]
                checks.append({"name": f"{name}: peak RSS vs torch dcp_to_torch", "value": y, "target": peer,
                               "ok": y <= peer, "text": f"{name}: peak RSS {y:.0f} MiB vs torch dcp_to_torch "
                                                        f"{peer:.0f} MiB (target <=)"})
    return checks


def run_many(args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], int]:
    src = ensure_many_tensors_checkpoint(default_many_path())
    nbytes = warm_read(src)
    ctx = Context(src, workdir / "scratch", sys.executable, reshard_argv(), args.max_memory, rss_probe())
    results = measure(select_rows(many_rows(), args.only), ctx, args.repeats, workdir / "logs")
    summary = summarize(results)
    print(f"\nDCP {src} (103,680 tensors, {nbytes / 2**20:.0f} MiB, 2 ranks) | WARM cache | median of "
          f"{args.repeats} run(s) | --max-memory {args.max_memory}")
    print_table(summary)
    checks = many_checks(summary, args.max_memory)
    print_checks(checks)
    failed = [m for m in results if m.required and not m.ok]
    for m in failed:
        print(f"\nreshard FAILED: {m.name}: {m.error}")
    missed = args.strict and not all(c["ok"] for c in checks)
    return {"mode": "many", "src": str(src), "env": environment(ctx, args.repeats), "rows": summary,
            "acceptance": checks}, 1 if failed or missed else 0
