"""zarr rows for scripts/bench.py: write and read throughput of zarr stores next to DCP's.

* ``reshard -> zarr``: the benchmark's DCP checkpoint converted to an uncompressed zarr store
  (compare with ``reshard -> safetensors``: same source reads, another writer).
* ``reshard zarr -> safetensors``: a zarr store of the same checkpoint converted to
  safetensors (compare with ``reshard -> safetensors``: same writer, zarr reads instead of
  DCP's). The store is made once per benchmark run, beside the scratch dir, before the first
  measured run; it is not part of any measurement.
* ``tensorstore read zarr``: tensorstore alone reading every array of that store, an outside
  reader for scale (not required: skipped with a reason if tensorstore is missing).

Rows are ``Row``s of scripts/bench_harness.py, like every mode's; ``print_throughput`` adds MiB/s
of work time per row under the table.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_harness import MIB, Command, Context, Row

__all__ = ["ZARR_WRITE", "ZARR_READ", "zarr_rows", "print_throughput"]

ZARR_WRITE = "reshard -> zarr"
ZARR_READ = "reshard zarr -> safetensors"
TS_READ = "tensorstore read zarr"
_DCP_ROW = "reshard -> safetensors"

# Into torch tensors, as a PyTorch user would (zero-copy from numpy): the row then pays the
# same start-up as the reshard rows and "work" subtracts the same bare import torch.
_TS_SNIPPET = """\
import os, sys
import tensorstore as ts
import torch
root, total = sys.argv[1], 0
for name in sorted(os.listdir(root)):
    if os.path.isfile(os.path.join(root, name, "zarr.json")):
        arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(root, name)}}).result()
        total += torch.from_numpy(arr.read().result()).nbytes
print(total)
"""


def _store(ctx: Context) -> Path:
    """The zarr copy of the source, made once per run (the run's folder is removed at the end)."""
    store = ctx.scratch.parent / "source.zarr"
    if not (store / "zarr.json").is_file():
        subprocess.run([*ctx.reshard, "convert", str(ctx.src), str(store), "--max-memory", ctx.max_memory, "--quiet"],
                       check=True, capture_output=True, timeout=3600)
    return store


def zarr_rows() -> list[Row]:
    """The zarr rows of bench.py's default table."""

    def write(ctx: Context) -> Command:
        out = ctx.scratch / "out.zarr"
        return Command([*ctx.reshard, "convert", str(ctx.src), str(out), "--max-memory", ctx.max_memory, "--quiet"],
                       out / "zarr.json")

    def read(ctx: Context) -> Command:
        out = ctx.scratch / "out.safetensors"
        return Command([*ctx.reshard, "convert", str(_store(ctx)), str(out), "--max-memory", ctx.max_memory, "--quiet"],
                       out)

    def ts_read(ctx: Context) -> Command:
        return Command([ctx.python, "-c", _TS_SNIPPET, str(_store(ctx))])

    return [Row(ZARR_WRITE, write, required=True), Row(ZARR_READ, read, required=True), Row(TS_READ, ts_read)]


def print_throughput(summary: Sequence[dict[str, Any]], nbytes: int) -> list[dict[str, Any]]:
    """MiB/s of work time (start-up taken out) for the DCP and zarr rows; returns the rows."""
    wanted = {_DCP_ROW: "DCP read + safetensors write", ZARR_WRITE: "DCP read + zarr write",
              ZARR_READ: "zarr read + safetensors write", TS_READ: "zarr read by tensorstore"}
    out = []
    for r in summary:
        if r["name"] in wanted and r.get("error") is None and r.get("work_s"):
            out.append({"name": r["name"], "what": wanted[r["name"]], "mib_per_s": nbytes / MIB / r["work_s"]})
    if out:
        print("\nthroughput (checkpoint MiB / work s):")
        for t in out:
            print(f"  {t['name']:<28} {t['mib_per_s']:9.0f} MiB/s  ({t['what']})")
    return out
