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
  round's ratio (rows run round-robin, so a round's runs are seconds apart).
* Runs are WARM-CACHE: dropping the page cache needs root, so every source file is read
  before each measured run instead (once is not enough where the kernel pages out cold
  memory, as DAMON does on some VMs: the first row to touch an evicted source would pay
  for everyone). Rows run round-robin, ``--repeats`` times each, in an
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
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_bench_ckpt import WORLD_SIZE, default_ckpt_path, ensure_checkpoint  # noqa: E402

MIB = 2**20
WORK_TARGET = 1.5  # DCP -> safetensors work / cp wall
WHOLE_TARGET = 1.5  # DCP -> safetensors whole-process wall / cp wall, paired by round (torch not imported)
INSPECT_TARGET_S = 0.3  # reshard inspect of the source, whole process
RESHARD_INSPECT = "reshard inspect"
RESHARD_STARTUP = "reshard start-up (--help)"
RSS_TARGET_MIB = 384  # peak RSS above import torch
IMPORT_TORCH = "import torch"
CP = "cp -r"
TORCH_DCP = "torch dcp_to_torch"
RESHARD_ST = "reshard -> safetensors"
MESH_TARGET = 2.0  # DCP 4 ranks -> --to-mesh 4x8 work / cp wall
RESHARD_MESH = "reshard -> dcp 4x8"
RESHARD_MESH_2 = "reshard -> dcp 4x8 torchrun x2"

# ----------------------------------------------------------------------------- data model


@dataclass(frozen=True)
class RssProbe:
    """A small wrapper process that runs a command and writes its wait4 rusage to a file."""

    name: str
    prefix: Callable[[Path], list[str]]  # stats file -> argv to put before the command


@dataclass(frozen=True)
class Context:
    """What a row's command builder may use."""

    src: Path
    scratch: Path  # emptied before every run
    python: str
    reshard: tuple[str, ...]
    max_memory: str
    probe: RssProbe


@dataclass(frozen=True)
class Command:
    argv: list[str]
    output: Path | None = None  # must exist after a successful run (catches silent no-ops)
    stdout: Path | None = None  # the child's stdout goes here (stderr to the log); else both to the log
    sources: tuple[Path, ...] | None = None  # files/dirs read before the run to warm the cache; None: the
    #                                          context's source and the run's zarr stores
    check: Callable[[], str | None] | None = None  # after exit 0: why the output is wrong, or None


@dataclass(frozen=True)
class Row:
    name: str
    build: Callable[[Context], Command]
    kind: Literal["python", "bytes"] = "python"  # python rows get the start-up subtracted
    required: bool = False  # a failing required row (reshard) fails the benchmark


@dataclass(frozen=True)
class RunResult:
    wall: float
    cpu: float
    maxrss_kib: int
    returncode: int
    log_tail: str


@dataclass
class Measurement:
    """All runs of one row; medians are what the table shows."""

    name: str
    kind: str
    required: bool
    argv: list[str] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)
    rss_kib: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.walls)

    @property
    def wall(self) -> float:
        return statistics.median(self.walls)

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpus)

    @property
    def rss_mib(self) -> float:
        return statistics.median(self.rss_kib) / 1024


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


def _import_torch(c: Context) -> Command:
    return Command([c.python, "-c", "import torch"])


def _cp(c: Context) -> Command:
    return Command(["cp", "-r", str(c.src), str(c.scratch / "copy")], c.scratch / "copy")


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


def _torch_dcp_to_torch(c: Context) -> Command:
    # torch's CLI prints "No checkpoint found" and exits 0 on a bad path: the output check catches it.
    out = c.scratch / "out2.pt"
    return Command([c.python, "-m", "torch.distributed.checkpoint.format_utils", "dcp_to_torch", str(c.src), str(out)],
                   out)


def _hf_save_torch_state_dict(c: Context) -> Command:
    out = c.scratch / "hf"
    return Command([c.python, "-c", _HF_SNIPPET, str(c.src), str(out)], out / "model.safetensors")


ROWS: list[Row] = [
    Row(IMPORT_TORCH, _import_torch),
    Row(CP, _cp, kind="bytes"),
    Row(RESHARD_STARTUP, _reshard_startup, required=True),
    Row(RESHARD_INSPECT, _reshard_inspect, required=True),
    Row(RESHARD_ST, _reshard_to("safetensors", ".safetensors"), required=True),
    Row("reshard -> torch", _reshard_to("torch", ".pt"), required=True),
    Row(RESHARD_MESH, _reshard_to_mesh(1), required=True),
    Row(RESHARD_MESH_2, _reshard_to_mesh(2), required=True),
    Row(TORCH_DCP, _torch_dcp_to_torch),
    Row("hf save_torch_state_dict", _hf_save_torch_state_dict),
]
# zarr write and read rows, next to DCP's (scripts/bench_zarr.py)
from bench_zarr import print_throughput, zarr_rows  # noqa: E402

ROWS += zarr_rows(Row, Command)
FLAT_ROWS: list[Row] = [r for r in ROWS if r.name in (IMPORT_TORCH, RESHARD_ST)]


# -------------------------------------------------------------------------------- running

_LAUNCHER = """\
import os, sys, time
t = time.perf_counter()
pid = os.posix_spawnp(sys.argv[2], sys.argv[2:], os.environ)
_, status, ru = os.wait4(pid, 0)
wall = time.perf_counter() - t
with open(sys.argv[1], "w") as f:
    f.write(f"{wall} {ru.ru_utime + ru.ru_stime} {ru.ru_maxrss}\\n")
sys.exit(os.waitstatus_to_exitcode(status) % 256)
"""
_GNU_TIME = Path("/usr/bin/time")


def rss_probe() -> RssProbe:
    """``/usr/bin/time`` (~2 MiB of its own) where installed, else the python launcher
    (~8 MiB floor: only the ``cp`` row's figure notices)."""
    if _GNU_TIME.is_file() and os.access(_GNU_TIME, os.X_OK):
        return RssProbe("/usr/bin/time", lambda stats: [str(_GNU_TIME), "-f", "%e %U %S %M", "-o", str(stats)])
    return RssProbe("python -S wait4 launcher (apt-get install -y time for /usr/bin/time)",
                    lambda stats: [sys.executable, "-S", "-I", "-c", _LAUNCHER, str(stats)])


def _parse_stats(stats: Path, probe: RssProbe) -> tuple[float | None, float, int]:
    """(inner wall or None, cpu s, maxrss KiB) from the probe's last line; zeros if absent."""
    try:
        fields = stats.read_text().strip().splitlines()[-1].split()
        if probe.name == "/usr/bin/time":  # "%e %U %S %M"; %e has 10 ms resolution: not used
            return None, float(fields[1]) + float(fields[2]), int(fields[3])
        return float(fields[0]), float(fields[1]), int(fields[2])
    except (OSError, IndexError, ValueError):
        return None, 0.0, 0


def run_measured(argv: Sequence[str], cwd: Path, log: Path, probe: RssProbe, stdout: Path | None = None) -> RunResult:
    """Run ``argv`` to completion under ``probe``: wall time, CPU time and peak RSS.
    Its stdout goes to ``stdout`` when given (stderr still to ``log``), else to ``log``."""
    stats = log.with_suffix(".rusage")
    with open(log, "wb") as logf, open(stdout, "wb") if stdout else contextlib.nullcontext(logf) as outf:
        start = time.perf_counter()
        proc = subprocess.Popen([*probe.prefix(stats), *argv], cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=outf, stderr=logf if stdout else subprocess.STDOUT)
        try:
            returncode = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        wall = time.perf_counter() - start
    inner_wall, cpu, maxrss = _parse_stats(stats, probe)
    tail = log.read_bytes()[-4000:].decode(errors="replace").strip()
    return RunResult(wall if inner_wall is None else inner_wall, cpu, maxrss, returncode, tail)


def warm_read(path: Path) -> int:
    """Read every file under ``path`` once (the page cache cannot be dropped without root)."""
    total = 0
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(16 * MIB):
                total += len(chunk)
    return total


def _clear(d: Path) -> None:
    """Empty ``d`` and flush dirty pages, so no run pays for an earlier run's writeback."""
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    os.sync()


def _failure(res: RunResult, cmd: Command) -> str | None:
    last = res.log_tail.splitlines()[-1] if res.log_tail else "no output"
    if res.returncode != 0:
        return f"exit {res.returncode}: {last}"
    if cmd.output is not None and not cmd.output.exists():
        return f"exit 0 but wrote no {cmd.output.name} ({last})"
    why = cmd.check() if cmd.check is not None else None
    return None if why is None else f"exit 0 but {why}"


def _log_name(row: Row, rep: int) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in row.name) + f".{rep}.log"


def measure(rows: Sequence[Row], ctx: Context, repeats: int, logdir: Path) -> list[Measurement]:
    """Run every row ``repeats`` times, round-robin, each in an emptied scratch dir.

    A row that fails once is not run again; a required row's failure keeps its log tail.
    """
    results = [Measurement(r.name, r.kind, r.required) for r in rows]
    for rep in range(repeats):
        for row, m in zip(rows, results):
            if m.error is not None:
                continue
            _clear(ctx.scratch)
            cmd = row.build(ctx)
            sources = cmd.sources if cmd.sources is not None else (ctx.src, *ctx.scratch.parent.glob("*.zarr"))
            for warm in sources:
                warm_read(warm)  # again before each run: page-cache pages can be evicted meanwhile
            m.argv = cmd.argv
            log = logdir / _log_name(row, rep)
            res = run_measured(cmd.argv, ctx.scratch, log, ctx.probe, cmd.stdout)
            m.error = _failure(res, cmd)
            if m.error is None:
                m.walls.append(res.wall)
                m.cpus.append(res.cpu)
                m.rss_kib.append(res.maxrss_kib)
            state = "ok" if m.error is None else f"FAILED {m.error}"
            print(f"  [{rep + 1}/{repeats}] {row.name:<26} {res.wall:7.2f}s {res.maxrss_kib / 1024:7.0f} MiB  {state}",
                  file=sys.stderr, flush=True)
            if m.error is not None and row.required:
                m.error += f"\n    log: {log}\n    " + "\n    ".join(res.log_tail.splitlines()[-15:])
    _clear(ctx.scratch)
    return results


# ------------------------------------------------------------------------------ reporting


def work(m: Measurement, base: Measurement | None, own: Measurement | None = None) -> float | None:
    """The wall for byte copies; for Python rows the wall minus their start-up: reshard's own
    (``--help``: it imports torch only where a command casts or loads into a model) for
    reshard rows, the bare import-torch wall for the peers."""
    if m.kind == "bytes":
        return m.wall
    if m is own or m is base:
        return None
    start = own if m.name.startswith("reshard") else base
    return None if start is None else m.wall - start.wall


def rss_above(m: Measurement, base: Measurement | None) -> float | None:
    if m.kind == "bytes" or base is None or m is base:
        return None
    return m.rss_mib - base.rss_mib


def paired_over(m: Measurement, base: Measurement | None) -> float | None:
    """Median over rounds of ``m``'s wall / ``base``'s wall in the same round: rows run
    round-robin, so each ratio compares runs seconds apart (this VM's write-back varies cp's
    wall by several times between rounds, and a ratio of medians mixes rounds)."""
    if base is None or m is base:
        return None
    if len(m.walls) != len(base.walls):
        return m.wall / base.wall
    return statistics.median(a / b for a, b in zip(m.walls, base.walls))


def summarize(results: Sequence[Measurement]) -> list[dict[str, Any]]:
    """One JSON-ready dict per row: medians, derived columns and the raw runs."""
    ok = {m.name: m for m in results if m.ok}
    base, cp, tdcp, own = ok.get(IMPORT_TORCH), ok.get(CP), ok.get(TORCH_DCP), ok.get(RESHARD_STARTUP)
    tdcp_work = work(tdcp, base) if tdcp else None
    rows: list[dict[str, Any]] = []
    for m in results:
        row: dict[str, Any] = {"name": m.name, "argv": m.argv, "error": m.error}
        if m.ok:
            w = work(m, base, own)
            row.update(
                wall_s=m.wall, cpu_s=m.cpu, work_s=w, peak_rss_mib=m.rss_mib, rss_above_import_mib=rss_above(m, base),
                work_over_cp_wall=None if w is None or cp is None else w / cp.wall,
                wall_over_cp_paired=paired_over(m, cp),
                work_over_torch_dcp_work=None if w is None or not tdcp_work else w / tdcp_work,
                walls_s=m.walls, cpus_s=m.cpus, peak_rss_kib=m.rss_kib,
            )
        rows.append(row)
    return rows


def _fmt(x: float | None, spec: str) -> str:
    """``x`` formatted by ``spec`` (e.g. "8.2f"), or a dash of the same width."""
    return "-".rjust(int(spec.split(".")[0] or 0)) if x is None else format(x, spec)


# (header, summary key, format spec) for every numeric column, in order.
COLUMNS: list[tuple[str, str, str]] = [
    ("wall s", "wall_s", "8.2f"),
    ("cpu s", "cpu_s", "8.2f"),
    ("work s", "work_s", "8.2f"),
    ("peak RSS MiB", "peak_rss_mib", "13.0f"),
    ("RSS>torch MiB", "rss_above_import_mib", "14.0f"),
    ("work/cp", "work_over_cp_wall", "8.2f"),
    ("wall/cp", "wall_over_cp_paired", "8.2f"),
    ("vs torch dcp", "work_over_torch_dcp_work", "13.2f"),
]


def print_table(summary: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]] = COLUMNS,
                width: int = 26) -> None:
    """One line per row: its name in ``width`` characters, then ``columns`` (see COLUMNS)."""
    head = f"{'command':<{width}}" + "".join(f" {h:>{int(s.split('.')[0])}}" for h, _, s in columns)
    print(head)
    print("-" * len(head))
    for r in summary:
        if r["error"] is not None:
            print(f"{r['name']:<{width}} unavailable: {r['error'].splitlines()[0]}")
        else:
            print(f"{r['name']:<{width}}" + "".join(f" {_fmt(r[k], s)}" for _, k, s in columns))


def acceptance(summary: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, checked for every reshard conversion row that ran."""
    checks: list[dict[str, Any]] = []
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
                                   f"{len(r['walls_s'])} paired rounds (target <= {WHOLE_TARGET})"})
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


def print_checks(checks: Sequence[dict[str, Any]]) -> None:
    print("\nacceptance:")
    for c in checks:
        print(f"  {'INFO' if c['target'] is None else 'PASS' if c['ok'] else 'FAIL'}  {c['text']}")
    if not checks:
        print("  (no reshard row ran)")


def damon_pageout() -> bool:
    """Whether the kernel's DAMON is paging out cold memory (some VMs run it): then page-cache
    pages of the source can be evicted between runs, "warm cache" does not hold, and walls of
    every row (cp included) vary by several times from run to run."""
    root = Path("/sys/kernel/mm/damon/admin/kdamonds")
    try:
        return any((k / "state").read_text().strip() == "on"
                   and any(a.read_text().strip() == "pageout" for a in k.glob("contexts/*/schemes/*/action"))
                   for k in root.iterdir() if k.name.isdigit())
    except OSError:
        return False


def environment(ctx: Context, repeats: int) -> dict[str, Any]:
    import torch  # only for its version; every measured child imports its own

    return {
        "repeats": repeats, "statistic": "median", "max_memory": ctx.max_memory, "rss_probe": ctx.probe.name,
        "cache": "warm (source read once before measuring; page cache not dropped)",
        "work": "wall - wall(python -c 'import torch') for python rows; wall for cp",
        "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "platform": platform.platform(), "reshard": list(ctx.reshard), "damon_pageout": damon_pageout(),
    }


# ----------------------------------------------------------------------------------- main


def reshard_argv() -> tuple[str, ...]:
    """The console script beside this interpreter (a pyenv shim on PATH would add its own
    start-up to every run), else whatever ``reshard`` is on PATH."""
    beside = Path(sys.executable).parent / "reshard"
    if beside.is_file():
        return (str(beside),)
    found = shutil.which("reshard")
    if found is None:
        sys.exit("bench: no `reshard` command found (pip install -e .)")
    return (found,)


def _select(rows: Sequence[Row], only: str | None) -> list[Row]:
    """Rows whose name contains one of the comma-separated ``only`` words, plus the
    baselines the derived columns need (import torch, reshard's start-up, cp)."""
    if not only:
        return list(rows)
    words = [w.strip() for w in only.split(",") if w.strip()]
    return [r for r in rows if r.name in (IMPORT_TORCH, CP, RESHARD_STARTUP) or any(w in r.name for w in words)]


def _context(size_mb: float, ckpt: Path | None, workdir: Path, max_memory: str) -> tuple[Context, int]:
    src = ensure_checkpoint(ckpt or default_ckpt_path(size_mb), size_mb)
    t = time.perf_counter()
    nbytes = warm_read(src)
    print(f"warm-up: read {nbytes / MIB:.0f} MiB of {src} in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    return Context(src, workdir / "scratch", sys.executable, reshard_argv(), max_memory, rss_probe()), nbytes


def run_table(args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], int]:
    ctx, nbytes = _context(args.size_mb, args.ckpt, workdir, args.max_memory)
    results = measure(_select(ROWS, args.only), ctx, args.repeats, workdir / "logs")
    summary = summarize(results)
    checks = acceptance(summary)
    print(f"\nDCP {ctx.src} ({nbytes / MIB:.0f} MiB, {WORLD_SIZE} ranks, fp32) | WARM cache | "
          f"median of {args.repeats} run(s) | --max-memory {args.max_memory} | {os.cpu_count()} CPUs | "
          f"RSS via {ctx.probe.name}")
    print("work = wall - wall(python -c 'import torch') for peers, - wall(reshard --help) for reshard; cp: work = wall; "
          "wall/cp: whole process, median of the rounds' ratios")
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
    scripts/bench_load.py in its own process (it spawns its gloo worlds)."""
    print("\n-- load into a live FSDP2 model + AdamW (scripts/bench_load.py) --", flush=True)
    argv = [sys.executable, str(Path(__file__).with_name("bench_load.py")), "--ckpt", str(src),
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
              f"{_fmt(r['rss_above_import_mib'], '5.0f')} MiB, wall {r['wall_s']:.2f}s")
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
                         "reshard rank0 / parallel against torch's broadcast_from_rank0 (scripts/bench_load.py)")
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
    # Imported here: bench_scale and bench_paths import this module for its machinery.
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
