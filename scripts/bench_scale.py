"""Scale rows for scripts/bench.py (``--scale``): planning a checkpoint saved by 64 to 2048 ranks.

Source: the metadata-only Llama-3-405B DCP of ``scripts/make_meta_ckpt.py`` (the real
``.metadata`` of N ranks, sparse rank files), cached under ``.bench/meta_<N>``. Per world size,
in one run (bench.py's method: each row its own child process, wall spawn to exit, peak RSS by
``wait4``, warm cache, medians):

* ``torch read_metadata``: ``FileSystemReader(SRC).read_metadata()``, the peer: what any
  DCP reader (torch's own ``dcp.load``, ``dcp_to_torch_save``) pays before it plans;
* ``reshard inspect --json``, ``reshard inspect --to-mesh 32x8 --json`` and its table form;
* ``reshard convert --to-mesh 32x8 --dry-run``: planning and checking a re-layout, no output
  (the row fails if the output folder appears).

Only ``.metadata`` is read to warm the cache: the rank files are sparse, and reading them
would read terabytes of zeros. Before each world size the peak RSS of every row is predicted
from the previous size (linear in chunks); a row that would not fit in the memory available
is skipped with the figures, rather than sending the machine into the OOM killer.

The acceptance of the scale issue is checked at 256 ranks (reshard/torch wall and peak RSS);
at every other size the figures are printed, and at the largest "completes" is checked.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_harness import (
    IMPORT_TORCH,
    Command,
    Context,
    Measurement,
    Row,
    environment,
    format_cell,
    measure,
    print_checks,
    print_table,
    reshard_argv,
    rss_probe,
    summarize,
)
from make_meta_ckpt import chunk_count, default_meta_path, ensure_meta_checkpoint, tensors

__all__ = ["MESH", "scale_rows", "growth_exponent", "predict_peak_mib", "scale_checks", "run_scale"]

MESH = "32x8"
TORCH_READ = "torch read_metadata"
INSPECT_JSON = "reshard inspect --json"
INSPECT_MESH_JSON = f"reshard inspect --to-mesh {MESH} --json"
INSPECT_MESH = f"reshard inspect --to-mesh {MESH}"
DRY_RUN = f"reshard convert --to-mesh {MESH} --dry-run"
ACCEPT_RANKS = 256
JSON_WALL_TARGET = 1.2  # inspect --json wall / torch read_metadata wall
MESH_WALL_TARGET = 1.5  # inspect --to-mesh wall / torch read_metadata wall
BIG = 512  # from this world size up, rows run --big-repeats times
HEADROOM_MIB = 1024  # kept free when deciding whether a row fits
MIB = 2**20

_TORCH_SNIPPET = """\
import sys
from torch.distributed.checkpoint import FileSystemReader
md = FileSystemReader(sys.argv[1]).read_metadata()
with open(sys.argv[2], "w") as f:
    f.write(str(len(md.state_dict_metadata)))
"""


# ----------------------------------------------------------------------------------- rows


def _text_check(path: Path, *, starts: str = "", ends: str = "", contains: str = "") -> str | None:
    """Why ``path`` does not look like the expected output (head and tail only: the JSON of
    2048 ranks is hundreds of MB), or None."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(4096).decode(errors="replace")
            f.seek(max(0, size - 4096))
            tail = f.read().decode(errors="replace")
    except OSError as e:
        return f"no readable {path.name} ({e})"
    if size == 0:
        return f"printed nothing ({path.name} is empty)"
    if not head.lstrip().startswith(starts) or not tail.rstrip().endswith(ends):
        return f"{path.name} is not what was expected (starts {head[:40]!r}, ends {tail[-40:]!r})"
    if contains and contains not in head + tail:
        return f"{path.name} does not mention {contains!r}"
    return None


def _torch_read(n_tensors: int) -> Any:
    def build(c: Context) -> Command:
        out = c.scratch / "torch.txt"

        def check() -> str | None:
            got = out.read_text().strip()
            return None if got == str(n_tensors) else f"read {got} tensors, not {n_tensors}"

        return Command([c.python, "-c", _TORCH_SNIPPET, str(c.src), str(out)], out,
                       sources=(c.src / ".metadata",), check=check)

    return build


def _inspect(*extra: str, json_out: bool) -> Any:
    def build(c: Context) -> Command:
        out = c.scratch / ("inspect.json" if json_out else "inspect.txt")
        argv = [*c.reshard, "inspect", str(c.src), *extra, *(["--json"] if json_out else [])]

        def check() -> str | None:
            if json_out:
                return _text_check(out, starts="{", ends="}", contains='"tensors"')
            return _text_check(out, contains="imbalance" if extra else "")

        return Command(argv, out, stdout=out, sources=(c.src / ".metadata",), check=check)

    return build


def _dry_run(c: Context) -> Command:
    dst, out = c.scratch / f"out_{MESH}", c.scratch / "dry_run.txt"

    def check() -> str | None:
        if dst.exists():
            return f"--dry-run wrote {dst}"
        return _text_check(out, contains="dry run")

    argv = [*c.reshard, "convert", str(c.src), str(dst), "--to-mesh", MESH, "--dry-run"]
    return Command(argv, out, stdout=out, sources=(c.src / ".metadata",), check=check)


def scale_rows(n_tensors: int) -> list[Row]:
    return [
        Row(IMPORT_TORCH, lambda c: Command([c.python, "-c", "import torch"], sources=())),
        Row(TORCH_READ, _torch_read(n_tensors)),
        Row(INSPECT_JSON, _inspect(json_out=True), required=True),
        Row(INSPECT_MESH_JSON, _inspect("--to-mesh", MESH, json_out=True), required=True),
        Row(INSPECT_MESH, _inspect("--to-mesh", MESH, json_out=False), required=True),
        Row(DRY_RUN, _dry_run, required=True),
    ]


# ------------------------------------------------------------------------------- analysis


def growth_exponent(x0: float, y0: float, x1: float, y1: float) -> float | None:
    """``k`` in ``y ~ x**k`` through two points (1: linear in chunks), or None if undefined."""
    if min(x0, y0, x1, y1) <= 0 or x0 == x1:
        return None
    return math.log(y1 / y0) / math.log(x1 / x0)


def predict_peak_mib(base_mib: float, peak_mib: float, chunks: int, new_chunks: int) -> float:
    """Peak RSS at ``new_chunks``, the part above the bare start-up scaled linearly in chunks."""
    return base_mib + max(0.0, peak_mib - base_mib) * new_chunks / chunks


def mem_available_mib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _by_name(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in rows if r.get("error") is None}


def _ratios(rows: Sequence[dict[str, Any]]) -> None:
    """Add reshard/torch wall and peak-RSS ratios to every row (in place)."""
    torch_row = _by_name(rows).get(TORCH_READ)
    for r in rows:
        ok = r.get("error") is None and torch_row is not None
        r["wall_over_torch"] = r["wall_s"] / torch_row["wall_s"] if ok else None
        r["rss_over_torch"] = r["peak_rss_mib"] / torch_row["peak_rss_mib"] if ok else None


def scale_checks(per_size: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The scale issue's targets: ratios at 256 ranks, dry runs that write nothing, the largest
    world size completing."""
    checks: list[dict[str, Any]] = []

    def add(name: str, value: float | None, target: float | None, ok: bool, text: str) -> None:
        checks.append({"name": name, "value": value, "target": target, "ok": ok, "text": text})

    for entry in per_size:
        n, rows = entry["ranks"], _by_name(entry["rows"])
        if n == ACCEPT_RANKS or entry is per_size[-1]:
            for name, target in ((INSPECT_JSON, JSON_WALL_TARGET), (INSPECT_MESH_JSON, MESH_WALL_TARGET),
                                 (INSPECT_MESH, MESH_WALL_TARGET)):
                r = rows.get(name)
                if r is None or r["wall_over_torch"] is None:
                    continue
                x = r["wall_over_torch"]
                binding = n == ACCEPT_RANKS
                add(f"{n} ranks: {name} wall / torch", x, target if binding else None, x <= target or not binding,
                    f"{n} ranks: {name}: wall {r['wall_s']:.1f}s = {x:.2f}x torch read_metadata"
                    + (f" (target <= {target})" if binding else ""))
            r = rows.get(INSPECT_JSON)
            if r is not None and r["rss_over_torch"] is not None:
                torch_mib = r["peak_rss_mib"] / r["rss_over_torch"]
                binding = n == ACCEPT_RANKS
                add(f"{n} ranks: {INSPECT_JSON} peak RSS / torch", r["rss_over_torch"], 1.0 if binding else None,
                    r["rss_over_torch"] <= 1.0 or not binding,
                    f"{n} ranks: {INSPECT_JSON}: peak RSS {r['peak_rss_mib']:.0f} MiB vs torch {torch_mib:.0f} MiB "
                    f"({r['rss_over_torch']:.2f}x)" + (" (target <= torch's)" if binding else ""))
                if binding:
                    w = r["wall_over_torch"]
                    add("moonshot: inspect --json faster than torch", w, None, True,
                        f"moonshot: {INSPECT_JSON} {'IS' if w < 1 else 'is not'} faster than torch's read_metadata "
                        f"at {n} ranks ({w:.2f}x)")
        if DRY_RUN in rows:
            add(f"{n} ranks: dry run", 0, 0, True,  # the row fails if its output folder appears
                f"{n} ranks: convert --to-mesh {MESH} --dry-run printed the plan and wrote nothing "
                f"({rows[DRY_RUN]['wall_s']:.1f}s, {rows[DRY_RUN]['peak_rss_mib']:.0f} MiB)")
    last = per_size[-1] if per_size else None
    if last is not None:
        failed = [r["name"] for r in last["rows"] if r.get("required") and r.get("error") is not None]
        add(f"{last['ranks']} ranks completes", None, 0, not failed,
            f"{last['ranks']} ranks ({last['chunks']:,} chunks): every reshard row completes"
            + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return checks


# ------------------------------------------------------------------------------- printing


_COLUMNS = [("wall s", "wall_s", "8.2f"), ("cpu s", "cpu_s", "8.2f"), ("work s", "work_s", "8.2f"),
            ("peak RSS MiB", "peak_rss_mib", "13.0f"), ("RSS>torch MiB", "rss_above_import_mib", "14.0f"),
            ("wall/torch", "wall_over_torch", "11.2f"), ("RSS/torch", "rss_over_torch", "10.2f")]


def _print_size(entry: dict[str, Any], repeats: int) -> None:
    print(f"\n{entry['ranks']} ranks: {entry['src']} ({entry['chunks']:,} chunks, .metadata "
          f"{entry['metadata_bytes'] / MIB:.0f} MiB) | median of {repeats} run(s) | load average "
          f"{entry['load_before'][0]:.1f} before, {entry['load_after'][0]:.1f} after")
    print_table(entry["rows"], _COLUMNS, width=42)
    print("work = wall - wall(import torch); RSS>torch = peak RSS - import torch's; x/torch against torch "
          "read_metadata (wall and peak RSS, start-up included on both sides)")


def growth(per_size: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row: work and peak RSS at every world size, and how they grow with chunks
    (exponent k of work ~ chunks**k between the smallest and the largest size that ran; per
    million chunks between the two largest)."""
    names = [r["name"] for r in per_size[0]["rows"] if r["name"] != IMPORT_TORCH] if per_size else []
    out = []
    for name in names:
        points = [(e["chunks"], r) for e in per_size for r in e["rows"] if r["name"] == name and r["error"] is None]
        g: dict[str, Any] = {"name": name, "points": [{"chunks": c, "work_s": r["work_s"], "wall_s": r["wall_s"],
                                                       "peak_rss_mib": r["peak_rss_mib"],
                                                       "rss_above_import_mib": r["rss_above_import_mib"]}
                                                      for c, r in points]}
        if len(points) >= 2:
            (c0, r0), (c1, r1) = points[0], points[-1]
            (ca, ra), (cb, rb) = points[-2], points[-1]
            g["work_exponent"] = growth_exponent(c0, r0["work_s"] or 0, c1, r1["work_s"] or 0)
            g["rss_exponent"] = growth_exponent(c0, r0["rss_above_import_mib"] or 0, c1, r1["rss_above_import_mib"] or 0)
            g["work_s_per_mchunk"] = (rb["work_s"] - ra["work_s"]) / ((cb - ca) / 1e6)
            g["rss_mib_per_mchunk"] = (rb["peak_rss_mib"] - ra["peak_rss_mib"]) / ((cb - ca) / 1e6)
        out.append(g)
    return out


def _print_growth(per_size: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> None:
    print("\ngrowth with world size: work s / peak RSS MiB at each size; k in work ~ chunks^k (1 = linear), "
          "smallest to largest size; per 1M chunks between the two largest")
    head = f"{'command':<42}" + "".join(f" {str(e['ranks']) + ' ranks':>15}" for e in per_size) + \
        f" {'k work':>7} {'k RSS':>6} {'s/Mchunk':>9} {'MiB/Mchunk':>11}"
    print(head)
    print("-" * len(head))
    for g in rows:
        by_chunks = {p["chunks"]: p for p in g["points"]}
        cells = []
        for e in per_size:
            p = by_chunks.get(e["chunks"])
            cells.append(f" {'-':>15}" if p is None else f" {format_cell(p['work_s'], '6.1f')}s/{p['peak_rss_mib']:6.0f}")
        print(f"{g['name']:<42}" + "".join(cells)
              + f" {format_cell(g.get('work_exponent'), '7.2f')} {format_cell(g.get('rss_exponent'), '6.2f')}"
              + f" {format_cell(g.get('work_s_per_mchunk'), '9.1f')} {format_cell(g.get('rss_mib_per_mchunk'), '11.0f')}")


# ----------------------------------------------------------------------------------- main


def _fits(rows: list[Row], prev: dict[str, Any] | None, chunks: int) -> tuple[list[Row], list[Measurement]]:
    """The rows predicted to fit in available memory, and Measurements saying why others do not."""
    avail = mem_available_mib()
    if prev is None or avail is None:
        return rows, []
    ok = _by_name(prev["rows"])
    base = ok.get(IMPORT_TORCH)
    keep, skipped = [], []
    for row in rows:
        r = ok.get(row.name)
        if r is None or base is None:
            keep.append(row)
            continue
        need = predict_peak_mib(base["peak_rss_mib"], r["peak_rss_mib"], prev["chunks"], chunks)
        if need <= avail - HEADROOM_MIB:
            keep.append(row)
        else:
            m = Measurement(row.name, row.kind, row.required)
            m.error = (f"skipped: predicted peak RSS {need / 1024:.1f} GiB (from {r['peak_rss_mib'] / 1024:.1f} GiB at "
                       f"{prev['ranks']} ranks) > {avail / 1024:.1f} GiB available - {HEADROOM_MIB} MiB headroom")
            skipped.append(m)
    return keep, skipped


def world_sizes(spec: str) -> list[int]:
    sizes = sorted({int(s) for s in spec.split(",") if s.strip()})
    if not sizes or sizes[0] < 1:
        raise SystemExit(f"bench: --world-sizes {spec!r}: give positive rank counts, e.g. 64,256,512,2048")
    return sizes


def run_scale(args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], int]:
    sizes = world_sizes(args.world_sizes)
    n_tensors = len(tensors())
    probe, reshard = rss_probe(), reshard_argv()
    per_size: list[dict[str, Any]] = []
    env: dict[str, Any] = {}
    code = 0
    for n in sizes:
        src = ensure_meta_checkpoint(default_meta_path(n), n)
        chunks = chunk_count(n)
        ctx = Context(src, workdir / "scratch", sys.executable, reshard, args.max_memory, probe)
        repeats = args.big_repeats if n >= BIG else args.repeats
        rows, skipped = _fits(scale_rows(n_tensors), per_size[-1] if per_size else None, chunks)
        print(f"-- {n} ranks: {chunks:,} chunks, {len(rows)} rows x {repeats} run(s); "
              f"{(mem_available_mib() or 0) / 1024:.1f} GiB available", file=sys.stderr, flush=True)
        load_before, started = os.getloadavg(), time.perf_counter()
        (workdir / "logs" / f"ranks_{n}").mkdir(parents=True, exist_ok=True)
        results = measure(rows, ctx, repeats, workdir / "logs" / f"ranks_{n}") + skipped
        summary = summarize(results)
        for r, m in zip(summary, results):
            r["required"] = m.required
        _ratios(summary)
        code = code or int(any(m.required and not m.ok for m in results))
        entry = {"ranks": n, "chunks": chunks, "src": str(src), "metadata_bytes": (src / ".metadata").stat().st_size,
                 "repeats": repeats, "load_before": load_before, "load_after": os.getloadavg(),
                 "seconds": time.perf_counter() - started, "rows": summary}
        per_size.append(entry)
        _print_size(entry, repeats)
        env = environment(ctx, repeats)
    grown = growth(per_size)
    _print_growth(per_size, grown)
    checks = scale_checks(per_size)
    print_checks(checks)
    for entry in per_size:
        for r in entry["rows"]:
            if r.get("required") and r["error"] is not None:
                print(f"\nreshard FAILED at {entry['ranks']} ranks: {r['name']}: {r['error']}")
    env["repeats"] = {str(e["ranks"]): e["repeats"] for e in per_size}
    missed = args.strict and not all(c["ok"] for c in checks)
    return {"mode": "scale", "env": env, "sizes": per_size, "growth": grown, "acceptance": checks}, \
        1 if code or missed else 0
