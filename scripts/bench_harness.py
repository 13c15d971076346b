"""The machinery every benchmark mode measures with (scripts/bench.py and the modules beside it).

A mode builds ``Row``s (a name and a builder turning a ``Context`` into the ``Command`` to run),
``measure`` runs them round-robin, each in its own child process under an RSS probe, and
``summarize`` / ``print_table`` / ``print_checks`` report medians and derived columns. The
method is described in full in scripts/bench.py's docstring (``--help``). This module imports
no other benchmark module: bench.py and every mode import it, never each other's machinery.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

MIB = 2**20
RESHARD_STARTUP = "reshard start-up (--help)"
IMPORT_TORCH = "import torch"
CP = "cp -r"
TORCH_DCP = "torch dcp_to_torch"


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



# -------------------------------------------------------------------- rows every mode has


def import_torch_command(c: Context) -> Command:
    return Command([c.python, "-c", "import torch"])


def cp_command(c: Context) -> Command:
    return Command(["cp", "-r", str(c.src), str(c.scratch / "copy")], c.scratch / "copy")



def torch_dcp_command(c: Context) -> Command:
    # torch's CLI prints "No checkpoint found" and exits 0 on a bad path: the output check catches it.
    out = c.scratch / "out2.pt"
    return Command([c.python, "-m", "torch.distributed.checkpoint.format_utils", "dcp_to_torch", str(c.src), str(out)],
                   out)


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


def measure(rows: Sequence[Row], ctx: Context, repeats: int, logdir: Path, paired: Sequence[str] = ()) -> list[Measurement]:
    """Run every row ``repeats`` times, each run in an emptied scratch dir.

    The rows named in ``paired`` (an acceptance pair: cp and the reshard row it is held to)
    run first, alternately, one after the other and nothing between (cp, reshard, cp,
    reshard...): each round's ratio then compares runs seconds apart, under the same
    write-back and the same neighbours. The other rows follow round-robin. A row that fails
    once is not run again; a required row's failure keeps its log tail.
    """
    results = [Measurement(r.name, r.kind, r.required) for r in rows]
    first = [(r, m) for r, m in zip(rows, results) if r.name in paired]
    rest = [(r, m) for r, m in zip(rows, results) if r.name not in paired]
    for group in (first, rest):
        for rep in range(repeats):
            for row, m in group:
                if m.error is None:
                    _run_once(row, m, ctx, rep, repeats, logdir)
    _clear(ctx.scratch)
    return results


def _run_once(row: Row, m: Measurement, ctx: Context, rep: int, repeats: int, logdir: Path) -> None:
    """One run of ``row`` from an emptied scratch dir and a warm source, added to ``m``."""
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
    print(f"  [{rep + 1}/{repeats}] {row.name:<26} {res.wall:7.2f}s {res.cpu:6.2f}s cpu {res.maxrss_kib / 1024:7.0f} MiB  "
          f"{state}", file=sys.stderr, flush=True)
    if m.error is not None and row.required:
        m.error += f"\n    log: {log}\n    " + "\n    ".join(res.log_tail.splitlines()[-15:])



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


def format_cell(x: float | None, spec: str) -> str:
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
            print(f"{r['name']:<{width}}" + "".join(f" {format_cell(r[k], s)}" for _, k, s in columns))



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


def select_rows(rows: Sequence[Row], only: str | None) -> list[Row]:
    """Rows whose name contains one of the comma-separated ``only`` words, plus the
    baselines the derived columns need (import torch, reshard's start-up, cp)."""
    if not only:
        return list(rows)
    words = [w.strip() for w in only.split(",") if w.strip()]
    return [r for r in rows if r.name in (IMPORT_TORCH, CP, RESHARD_STARTUP) or any(w in r.name for w in words)]
