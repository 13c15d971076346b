#!/usr/bin/env python
"""Side-by-side benchmark: reshard against the ways people convert DCP checkpoints today.

Method
------
* Source: a synthetic llama-shaped fp32 DCP checkpoint saved by 4 gloo ranks (params +
  AdamW-like exp_avg / exp_avg_sq), made by ``scripts/make_bench_ckpt.py`` and cached under
  ``.bench/ckpt_<size>`` (git-ignored).
* Every row is one command, run as its own child process. Wall time is spawn to exit. Peak
  RSS is ``ru_maxrss`` from ``wait4``, the number ``/usr/bin/time -v`` prints as "Maximum
  resident set size". It is collected by ``/usr/bin/time`` itself, or by a tiny
  ``python -S`` launcher when that is missing, never by this process: on Linux a child's
  ru_maxrss includes the high-water RSS of the process it was (v)forked from, so spawning
  from a big Python process would add that process's RSS to every figure.
* ``work = wall - wall(python -c "import torch")`` for the peers: the interpreter and torch
  start-up every Python tool pays is taken out; for reshard rows ``work = wall -
  wall(reshard --help)``, its own start-up (reshard imports torch only where a command casts,
  dequantizes or fills a model). For ``cp`` work = wall. "RSS above import torch" is peak RSS
  minus the bare import's peak RSS. ``wall/cp`` compares whole processes: the median of each
  round's ratio. ``cpu s`` is user + system CPU of the whole process (``wait4``'s rusage), the
  steadier figure on a busy machine.
* The acceptance pair, ``cp -r`` and ``reshard -> safetensors``, runs first and alternately
  (cp, reshard, cp, reshard... ``--repeats`` rounds, nothing between): each round's ratio
  compares two runs back to back. The other rows then run round-robin.
* Runs are WARM-CACHE: dropping the page cache needs root, so every source file is read
  before each measured run instead (once is not enough where the kernel pages out cold
  memory, as DAMON does on some VMs: the first row to touch an evicted source would pay
  for everyone). Every row runs ``--repeats`` times (in the order above), in an
  emptied scratch dir beside the source (same file system; ``sync`` before each run so
  none pays for an earlier run's writeback), and the table shows medians.
* A peer that fails is shown as "unavailable: reason" and skipped; a reshard row that
  fails makes the benchmark exit non-zero.

Adding a row: append a ``Row`` to ``ROWS`` (or ``FLAT_ROWS``) whose builder turns a
``Context`` into a ``Command`` (what to run, the output it must leave, what it reads).

Two more modes, same method, their rows in their own modules: ``--scale``
(scripts/bench_scale.py: planning a metadata-only Llama-405B DCP from 64 to 2048 ranks beside
torch's ``read_metadata``) and ``--paths`` (scripts/bench_paths.py: peak RSS of every memory
path, --dtype, re-layouts, key maps, zarr --compress, MoE and FP8 exports, against the budget).

    python scripts/bench.py                                # ~1.5 GB checkpoint, 3 repeats
    python scripts/bench.py --size-mb 64 --repeats 1 --json bench.json
    python scripts/bench.py --flat-check --size-mb 384     # reshard peak RSS at 384 MiB and 4x
    python scripts/bench.py --no-load                      # the conversion table only
    python scripts/bench.py --scale                        # metadata-only 405B DCP, 64..2048 ranks
    python scripts/bench.py --paths                        # peak RSS of each memory path at 256MiB
    python scripts/bench.py --many                         # 103,680 tensors: inspect, --to-mesh 4, memory
    python scripts/bench.py --remote --size-mb 256         # from and to s3:// (a local S3 emulator)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_harness import (  # noqa: E402
    CP,
    IMPORT_TORCH,
    MIB,
    RESHARD_STARTUP,
    TORCH_DCP,
    Command,
    Context,
    Row,
    cp_command,
    damon_pageout,
    environment,
    format_cell,
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
from bench_zarr import print_throughput, zarr_rows  # noqa: E402
from make_bench_ckpt import WORLD_SIZE, default_ckpt_path, ensure_checkpoint  # noqa: E402

WORK_TARGET = 1.5  # DCP -> safetensors work / cp wall
WHOLE_TARGET = 1.5  # DCP -> safetensors whole-process wall / cp wall, paired by round (torch not imported)
INSPECT_TARGET_S = 0.3  # reshard inspect of the source, whole process
RESHARD_INSPECT = "reshard inspect"
RSS_TARGET_MIB = 384  # peak RSS above import torch
RESHARD_ST = "reshard -> safetensors"
MESH_TARGET = 2.0  # DCP 4 ranks -> --to-mesh 4x8 work / cp wall
RESHARD_MESH = "reshard -> dcp 4x8"
RESHARD_MESH_2 = "reshard -> dcp 4x8 torchrun x2"


# ----------------------------------------------------------------------------------- rows

_HF_SNIPPET = """\
import os, sys
from collections.abc import Mapping
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from huggingface_hub import save_torch_state_dict

def flat(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, Mapping):
            yield from flat(v, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor):
            yield f"{prefix}{k}", v

sd = {}  # the whole checkpoint, loaded the way torch's dcp_to_torch_save does
_load_state_dict(sd, storage_reader=FileSystemReader(sys.argv[1]),
                 planner=_EmptyStateDictLoadPlanner(), no_dist=True)
os.makedirs(sys.argv[2], exist_ok=True)
save_torch_state_dict(dict(flat(sd)), sys.argv[2])
"""


def _reshard_startup(c: Context) -> Command:
    # Not a conversion: shows how much of reshard's work column is its own imports (typer, ...).
    return Command([*c.reshard, "--help"])


def _reshard_inspect(c: Context) -> Command:
    # The whole process: start-up, reading every rank's metadata, layout detection, the table.
    return Command([*c.reshard, "inspect", str(c.src)])


def _reshard_to(fmt: str, suffix: str) -> Callable[[Context], Command]:
    def build(c: Context) -> Command:
        out = c.scratch / f"out{suffix}"
        argv = [*c.reshard, "convert", str(c.src), str(out), "--to", fmt, "--max-memory", c.max_memory, "--quiet"]
        return Command(argv, out)

    return build


def _reshard_to_mesh(ranks: int) -> Callable[[Context], Command]:
    def build(c: Context) -> Command:
        out = c.scratch / "out_4x8"
        tail = ["convert", str(c.src), str(out), "--to-mesh", "4x8", "--max-memory", c.max_memory, "--quiet"]
        if ranks == 1:
            return Command([*c.reshard, *tail], out / ".metadata")
        # torchrun's --standalone picks a free port; each rank writes its share of the files.
        launch = [c.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
        return Command([*launch, "-m", "reshard", *tail], out / ".metadata")

    return build


def _hf_save_torch_state_dict(c: Context) -> Command:
    out = c.scratch / "hf"
    return Command([c.python, "-c", _HF_SNIPPET, str(c.src), str(out)], out / "model.safetensors")


ROWS: list[Row] = [
    Row(IMPORT_TORCH, import_torch_command),
    Row(CP, cp_command, kind="bytes"),
    Row(RESHARD_STARTUP, _reshard_startup, required=True),
    Row(RESHARD_INSPECT, _reshard_inspect, required=True),
    Row(RESHARD_ST, _reshard_to("safetensors", ".safetensors"), required=True),
    Row("reshard -> torch", _reshard_to("torch", ".pt"), required=True),
    Row(RESHARD_MESH, _reshard_to_mesh(1), required=True),
    Row(RESHARD_MESH_2, _reshard_to_mesh(2), required=True),
    Row(TORCH_DCP, torch_dcp_command),
    Row("hf save_torch_state_dict", _hf_save_torch_state_dict),
]
ROWS += zarr_rows()  # zarr write and read rows, next to DCP's (scripts/bench_zarr.py)
FLAT_ROWS: list[Row] = [r for r in ROWS if r.name in (IMPORT_TORCH, RESHARD_ST)]


def acceptance(summary: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, checked for every reshard conversion row that ran."""
    checks: list[dict[str, Any]] = []
    cp = next((r for r in summary if r["name"] == CP and r["error"] is None), None)
    for r in summary:
        if r["name"] == RESHARD_INSPECT and r["error"] is None:
            x = r["wall_s"]
            checks.append({"name": "reshard inspect wall", "value": x, "target": INSPECT_TARGET_S,
                           "ok": x <= INSPECT_TARGET_S,
                           "text": f"reshard inspect, whole process: {x:.3f}s (target <= {INSPECT_TARGET_S}s)"})
        if not r["name"].startswith("reshard ->") or r["error"] is not None:
            continue
        if r["name"] == RESHARD_ST and r["wall_over_cp_paired"] is not None:
            x = r["wall_over_cp_paired"]
            checks.append({"name": "DCP -> safetensors wall / cp wall", "value": x, "target": WHOLE_TARGET,
                           "ok": x <= WHOLE_TARGET,
                           "text": f"DCP -> safetensors whole process wall / cp wall = {x:.2f}, median of "
                                   f"{len(r['walls_s'])} alternating rounds (target <= {WHOLE_TARGET}); "
                                   f"{_wall_and_cpu(r, cp)}"})
        if r["name"] == RESHARD_ST and r["work_over_cp_wall"] is not None:
            x = r["work_over_cp_wall"]
            checks.append({"name": "DCP -> safetensors work / cp wall", "value": x, "target": WORK_TARGET,
                           "ok": x <= WORK_TARGET,
                           "text": f"DCP -> safetensors work / cp wall = {x:.2f} (target <= {WORK_TARGET})"})
        if r["name"] == RESHARD_MESH and r["work_over_cp_wall"] is not None:
            x = r["work_over_cp_wall"]
            checks.append({"name": "DCP -> --to-mesh 4x8 work / cp wall", "value": x, "target": MESH_TARGET,
                           "ok": x <= MESH_TARGET,
                           "text": f"DCP -> --to-mesh 4x8 work / cp wall = {x:.2f} (target <= {MESH_TARGET})"})
        if r["name"] == RESHARD_MESH_2:
            one = next((m for m in summary if m["name"] == RESHARD_MESH and m["error"] is None), None)
            if one is not None and r.get("wall_s"):
                checks.append({"name": "torchrun x2 speed-up", "value": one["wall_s"] / r["wall_s"], "target": None, "ok": True,
                               "text": f"torchrun with 2 ranks: wall {r['wall_s']:.2f}s vs {one['wall_s']:.2f}s in one "
                                       f"process (speed-up {one['wall_s'] / r['wall_s']:.2f}x; output byte-identical, "
                                       "see tests/test_mesh_convert.py)"})
        if r["rss_above_import_mib"] is not None:
            y = r["rss_above_import_mib"]
            checks.append({"name": f"{r['name']}: peak RSS above import torch", "value": y,
                           "target": RSS_TARGET_MIB, "ok": y <= RSS_TARGET_MIB,
                           "text": f"peak RSS above import torch = {y:.0f} MiB (target <= {RSS_TARGET_MIB})"
                                   f"  [{r['name']}]"})
    return checks


def _wall_and_cpu(r: dict[str, Any], cp: dict[str, Any] | None) -> str:
    """Medians of the reshard row beside cp's: wall and CPU seconds."""
    mine = f"reshard wall {r['wall_s']:.2f}s cpu {r['cpu_s']:.2f}s"
    return mine if cp is None else f"{mine}, cp wall {cp['wall_s']:.2f}s cpu {cp['cpu_s']:.2f}s"


# ----------------------------------------------------------------------------------- main


def _context(size_mb: float, ckpt: Path | None, workdir: Path, max_memory: str) -> tuple[Context, int]:
    src = ensure_checkpoint(ckpt or default_ckpt_path(size_mb), size_mb)
    t = time.perf_counter()
    nbytes = warm_read(src)
    print(f"warm-up: read {nbytes / MIB:.0f} MiB of {src} in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    return Context(src, workdir / "scratch", sys.executable, reshard_argv(), max_memory, rss_probe()), nbytes


def run_table(args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], int]:
    ctx, nbytes = _context(args.size_mb, args.ckpt, workdir, args.max_memory)
    results = measure(select_rows(ROWS, args.only), ctx, args.repeats, workdir / "logs", paired=(CP, RESHARD_ST))
    summary = summarize(results)
    checks = acceptance(summary)
    print(f"\nDCP {ctx.src} ({nbytes / MIB:.0f} MiB, {WORLD_SIZE} ranks, fp32) | WARM cache | "
          f"median of {args.repeats} run(s) | --max-memory {args.max_memory} | {os.cpu_count()} CPUs | "
          f"RSS via {ctx.probe.name}")
    print("work = wall - wall(python -c 'import torch') for peers, - wall(reshard --help) for reshard; cp: work = wall; "
          "wall/cp: whole process, median of the rounds' ratios (cp and reshard -> safetensors alternate); "
          "cpu s: user + system")
    if damon_pageout():
        print("NOTE: DAMON pageout is on (kdamond): it pages out cold memory, so sources are re-read before "
              "every run; walls still vary more than usual, so use more --repeats")
    print()
    print_table(summary)
    print_checks(checks)
    throughput = print_throughput(summary, nbytes)  # MiB/s of the DCP and zarr rows
    failed = [m for m in results if m.required and not m.ok]
    for m in failed:
        print(f"\nreshard FAILED: {m.name}: {m.error}")
    load_code = run_load(ctx.src, args) if args.load else 0
    report = {"mode": "table", "src": str(ctx.src), "src_bytes": nbytes, "env": environment(ctx, args.repeats),
              "rows": summary, "acceptance": checks, "throughput": throughput}
    missed = args.strict and not all(c["ok"] for c in checks)
    return report, 1 if failed or missed or load_code else 0


def run_load(src: Path, args: argparse.Namespace) -> int:
    """The runtime's side of the story: the same checkpoint loaded into live ranks, by
    scripts/bench_load_model.py in its own process (it spawns its gloo worlds)."""
    print("\n-- load into a live FSDP2 model + AdamW (scripts/bench_load_model.py) --", flush=True)
    argv = [sys.executable, str(Path(__file__).with_name("bench_load_model.py")), "--ckpt", str(src),
            "--size-mb", str(args.size_mb), "--max-memory", args.max_memory]
    return subprocess.run(argv, check=False).returncode


def run_flat_check(args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], int]:
    """reshard -> safetensors at SIZE and SIZE_FACTOR x SIZE: peak RSS should not grow."""
    sizes = [args.size_mb, args.size_mb * args.size_factor]
    per_size: list[dict[str, Any]] = []
    code, env = 0, {}
    for size in sizes:
        ctx, nbytes = _context(size, None, workdir, args.max_memory)
        results = measure(FLAT_ROWS, ctx, args.repeats, workdir / "logs")
        code = code or int(any(m.required and not m.ok for m in results))
        per_size.append({"size_mb": size, "src": str(ctx.src), "src_bytes": nbytes, "rows": summarize(results)})
        env = environment(ctx, args.repeats)
    print(f"\nflat-memory check: {RESHARD_ST} | WARM cache | median of {args.repeats} run(s) | "
          f"--max-memory {args.max_memory} | RSS via {env['rss_probe']}")
    peaks: list[float] = []
    for entry in per_size:
        r = next(r for r in entry["rows"] if r["name"] == RESHARD_ST)
        label = f"{entry['src_bytes'] / MIB:8.0f} MiB checkpoint"
        if r["error"] is not None:
            print(f"  {label}: reshard FAILED: {r['error']}")
            continue
        peaks.append(r["peak_rss_mib"])
        print(f"  {label}: peak RSS {r['peak_rss_mib']:6.0f} MiB, above import torch "
              f"{format_cell(r['rss_above_import_mib'], '5.0f')} MiB, wall {r['wall_s']:.2f}s")
    growth = peaks[1] - peaks[0] if len(peaks) == 2 else None
    if growth is not None:
        print(f"  peak RSS growth for {args.size_factor:g}x the data: {growth:+.0f} MiB")
    return {"mode": "flat-check", "size_factor": args.size_factor, "env": env, "sizes": per_size, "rss_growth_mib": growth}, code


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=1536.0, help="checkpoint size in MiB (default 1536)")
    ap.add_argument("--ckpt", type=Path, default=None,
                    help="checkpoint dir (default .bench/ckpt_<size>; made if missing, reused when its marker matches)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per row; the table shows medians (default 3)")
    ap.add_argument("--max-memory", default="256MiB", help="reshard --max-memory (default 256MiB)")
    ap.add_argument("--only", default=None,
                    help="comma-separated substrings of row names to run (import torch and cp always run)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--flat-check", action="store_true", help="reshard -> safetensors peak RSS at SIZE and SIZE_FACTOR x SIZE")
    mode.add_argument("--scale", action="store_true",
                      help="metadata-only Llama-405B DCP at --world-sizes ranks: inspect, inspect --to-mesh 32x8 and "
                           "convert --to-mesh 32x8 --dry-run beside torch's read_metadata (scripts/bench_scale.py)")
    mode.add_argument("--many", action="store_true",
                      help="a DCP of 103,680 small tensors: inspect beside torch's read_metadata, --to-mesh 4 against "
                           "the budget, -> safetensors beside torch's dcp_to_torch (scripts/bench_many.py)")
    mode.add_argument("--remote", action="store_true",
                      help="the checkpoint on a local S3 emulator (moto): reshard from and to s3:// beside torch's "
                           "FsspecReader and a plain download (scripts/bench_remote.py)")
    mode.add_argument("--paths", action="store_true",
                      help="one row per memory path (--dtype, dim-0/dim-1 re-layout, key maps, zarr --compress, MoE "
                           "and FP8 exports): peak RSS above import torch against the budget (scripts/bench_paths.py)")
    ap.add_argument("--size-factor", type=float, default=4.0, help="size factor for --flat-check (default 4)")
    ap.add_argument("--world-sizes", default="64,256,512,2048",
                    help="with --scale: comma-separated rank counts (default 64,256,512,2048)")
    ap.add_argument("--big-repeats", type=int, default=1,
                    help="with --scale: runs per row from 512 ranks up (default 1; --repeats below that)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument("--load", action=argparse.BooleanOptionalAction, default=True,
                    help="after the table, load the same checkpoint into a live FSDP2 model + AdamW on 3 ranks: "
                         "reshard rank0 / parallel against torch's broadcast_from_rank0 (scripts/bench_load_model.py)")
    ap.add_argument("--strict", action="store_true", help="also exit 1 when an acceptance target is missed")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if (args.flat_check or args.scale) and args.ckpt is not None:
        ap.error("--flat-check and --scale make their own checkpoints: drop --ckpt")
    if args.big_repeats < 1:
        ap.error("--big-repeats must be >= 1")
    return args


def _mode(args: argparse.Namespace) -> Callable[[argparse.Namespace, Path], tuple[dict[str, Any], int]]:
    # Imported when chosen: a mode's module brings its own checkpoint generators and peers.
    if args.scale:
        from bench_scale import run_scale
        return run_scale
    if args.paths:
        from bench_paths import run_paths
        return run_paths
    if args.many:
        from bench_many import run_many
        return run_many
    if args.remote:
        from bench_remote import run_remote
        return run_remote
    return run_flat_check if args.flat_check else run_table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = args.ckpt.resolve().parent if args.ckpt else default_ckpt_path(args.size_mb).parent
    root.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="run-", dir=root))  # beside the source: same file system
    (workdir / "logs").mkdir()
    try:
        report, code = _mode(args)(args, workdir)
    finally:
        shutil.rmtree(workdir / "scratch", ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    if code == 0:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"logs kept in {workdir / 'logs'}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
