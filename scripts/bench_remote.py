"""Object-store rows for scripts/bench.py (``--remote``): the benchmark DCP on S3.

The store is moto's S3 server, started in this process on a free port (the test extra); the
rows reach it over HTTP through s3fs, with the endpoint in ``FSSPEC_S3_ENDPOINT_URL`` as a user
would set it. Rows, by bench.py's method (each its own child process, wall spawn to exit, peak
RSS by ``wait4``, medians), with the peers in the same run:

* ``s3 get -r``: fsspec's recursive download of the checkpoint, bytes only: the reference,
  as ``cp`` is for local rows;
* ``torch FsspecReader -> torch.save``: ``dcp_to_torch_save`` through torch's own fsspec
  reader (everything in memory), the peer;
* ``reshard s3 -> safetensors`` (a local file) and ``reshard s3 -> s3 --to-mesh 4x8``.

A local emulator measures the code path (ranged reads, streaming puts, requests per chunk),
not a real store's latency or bandwidth.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from bench_harness import (
    COLUMNS,
    IMPORT_TORCH,
    Command,
    Context,
    Row,
    import_torch_command,
    measure,
    print_checks,
    print_table,
    reshard_argv,
    rss_probe,
    summarize,
)
from make_bench_ckpt import default_ckpt_path, ensure_checkpoint

__all__ = ["remote_rows", "run_remote"]

S3_GET = "s3 get -r (bytes only)"
TORCH_FSSPEC = "torch FsspecReader -> .pt"
TO_ST = "reshard s3 -> safetensors"
TO_MESH = "reshard s3 -> s3 --to-mesh 4x8"
URL = "s3://bench/ckpt"

_S3_GET = "import sys, fsspec; fsspec.filesystem('s3').get('bench/ckpt/', sys.argv[1] + '/', recursive=True)"
_TORCH_FSSPEC = """\
import sys
import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

sd = {}  # torch's dcp_to_torch_save, with its fsspec reader instead of the local one
_load_state_dict(sd, storage_reader=FsspecReader(sys.argv[1]), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
torch.save(sd, sys.argv[2])
"""


def remote_rows() -> list[Row]:
    def s3_get(c: Context) -> Command:
        return Command([c.python, "-c", _S3_GET, str(c.scratch / "copy")], c.scratch / "copy" / ".metadata", sources=())

    def torch_fsspec(c: Context) -> Command:
        out = c.scratch / "out.pt"
        return Command([c.python, "-c", _TORCH_FSSPEC, URL, str(out)], out, sources=())

    def to_st(c: Context) -> Command:
        out = c.scratch / "out.safetensors"
        return Command([*c.reshard, "convert", URL, str(out), "--max-memory", c.max_memory, "--quiet"], out, sources=())

    def to_mesh(c: Context) -> Command:
        argv = [*c.reshard, "convert", URL, "s3://bench/out_4x8", "--to-mesh", "4x8", "--max-memory", c.max_memory,
                "--overwrite", "--quiet"]
        return Command(argv, None, sources=())

    return [Row(IMPORT_TORCH, import_torch_command), Row(S3_GET, s3_get, kind="bytes"),
            Row(TORCH_FSSPEC, torch_fsspec), Row(TO_ST, to_st, required=True), Row(TO_MESH, to_mesh, required=True)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3() -> Any:
    """moto's S3 server on a free port, and the environment pointing s3fs at it."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        raise SystemExit("bench --remote needs moto's server and s3fs: pip install -e '.[test]'") from None
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      FSSPEC_S3_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    return server


def run_remote(args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], int]:
    src = ensure_checkpoint(args.ckpt or default_ckpt_path(args.size_mb), args.size_mb)
    server = start_s3()
    try:
        import fsspec

        fs = fsspec.filesystem("s3", endpoint_url=os.environ["FSSPEC_S3_ENDPOINT_URL"])
        fs.mkdir("bench")
        started = time.perf_counter()
        fs.put(str(src) + "/", "bench/ckpt/", recursive=True)
        nbytes = sum(p.stat().st_size for p in src.iterdir())
        print(f"uploaded {nbytes / 2**20:.0f} MiB to {URL} in {time.perf_counter() - started:.1f}s", file=sys.stderr)
        ctx = Context(src, workdir / "scratch", sys.executable, reshard_argv(), args.max_memory, rss_probe())
        results = measure(remote_rows(), ctx, args.repeats, workdir / "logs")
    finally:
        server.stop()
    summary = summarize(results)
    print(f"\nDCP {src} on a local S3 emulator ({nbytes / 2**20:.0f} MiB) | median of {args.repeats} run(s) | "
          f"--max-memory {args.max_memory}")
    print_table(summary, COLUMNS[:5])
    ok = {r["name"]: r for r in summary if r["error"] is None}
    checks = []
    for name in (TO_ST, TO_MESH):
        if name in ok and S3_GET in ok and ok[name]["work_s"] is not None:
            x = ok[name]["work_s"] / ok[S3_GET]["wall_s"]
            checks.append({"name": f"{name}: work / s3 get wall", "value": x, "target": None, "ok": True,
                           "text": f"{name}: work / s3 get -r wall = {x:.2f}"})
        if name in ok and TORCH_FSSPEC in ok:
            a, b = ok[name], ok[TORCH_FSSPEC]
            checks.append({"name": f"{name} vs torch FsspecReader", "value": a["peak_rss_mib"], "target": b["peak_rss_mib"],
                           "ok": a["peak_rss_mib"] <= b["peak_rss_mib"],
                           "text": f"{name}: wall {a['wall_s']:.2f}s, peak RSS {a['peak_rss_mib']:.0f} MiB vs torch "
                                   f"FsspecReader {b['wall_s']:.2f}s, {b['peak_rss_mib']:.0f} MiB"})
    print_checks(checks)
    failed = [m for m in results if m.required and not m.ok]
    for m in failed:
        print(f"\nreshard FAILED: {m.name}: {m.error}")
    return {"mode": "remote", "src": str(src), "src_bytes": nbytes, "rows": summary, "acceptance": checks}, \
        1 if failed else 0
