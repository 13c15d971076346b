#!/usr/bin/env python
"""Resuming on another number of ranks: reshard's load beside torch's own readers.

A llama-shaped model (parameters only, every tensor ``Shard(0)``) saved as a DCP by 4 ranks
and, the same tensors, as an HF-style safetensors folder (``--shard-size`` shards, made by
``reshard convert``), is loaded into a state dict of ``Shard(0)`` DTensors on 2 and on 3
ranks (``--nprocs``). Rows, per source:

* DCP: torch's ``dcp.load`` with its ``FileSystemReader``; ``reshard.load_state_dict`` in
  ``parallel`` mode (each rank reads its own boxes) and in ``rank0`` mode (rank 0 reads,
  the others receive); ``dcp.load`` through ``reshard.StorageReader``.
* HF folder: ``dcp.load`` with torch's ``HuggingFaceStorageReader``; the same three reshard rows.

Method
------
* One gloo world per rank count runs every row: rounds (``--rounds``) alternate the rows,
  each round starting one row later; a row's figure is the median over rounds (round 1 is
  each library's first load in the process: reshard's and torch's module imports are done
  before it, what they import on first use is not). Before every load the state dict is
  zeroed and the page cache set (``--cache``): ``warm``: the row's source files read
  through; ``cold``: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every one of them.
* Wall: the load call only (barrier before it), the slowest rank. Peak RSS: ``VmHWM``
  restarted just before the call (``clear_refs``); "added" is the most any rank's peak rose
  above its RSS before the call, which holds its shard (the zeroed state dict): a rank's
  peak is its shard + "added" (+ what the process held before), the target holds "added"
  to ``--max-memory``.
* Values: a checksum of every rank's local tensors after every load (per tensor, a weighted
  float64 sum, reduced over ranks); every row and round must give the torch row's value.

Targets (``PASS``/``FAIL``; ``--strict``: exit 1 on a ``FAIL``): warm, reshard.load_state_dict
(parallel) <= 0.8x torch's dcp.load for the DCP onto 2 ranks and <= 1.0x torch's
HuggingFaceStorageReader for the HF folder onto 2 ranks; rank0 mode <= 2x parallel mode;
peak RSS per rank within its shard + the budget; with ``--big`` (112 layers, bf16, 4.4 GiB,
1,011 tensors) also cold: reshard.load_state_dict <= 1.0x torch in every row.

    python scripts/bench_load.py                    # 8 layers of dim 1024 / ffn 2816 / vocab 32000, fp32 (642 MiB)
    python scripts/bench_load.py --big              # >= 4 GB bf16, >= 1,000 tensors
    python scripts/bench_load.py --size-mb 16 --rounds 1 --nprocs 2 --cache warm     # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load_model import reset_peak_rss, status_bytes  # noqa: E402
from make_bench_ckpt import REPO, LlamaDims, ensure_model_checkpoint, marker_path, tensor_shapes  # noqa: E402

MIB = 2**20
DCP, HF = "DCP", "HF"
TORCH, PARALLEL, RANK0, READER = "torch", "reshard parallel", "reshard rank0", "dcp.load reshard.StorageReader"
ROW_NAMES = {(DCP, TORCH): "dcp.load FileSystemReader", (HF, TORCH): "dcp.load HuggingFaceStorageReader"}
ROWS = [(s, r) for s in (DCP, HF) for r in (TORCH, PARALLEL, RANK0, READER)]
DEFAULT_DIMS = LlamaDims(dim=1024, kv_dim=1024, hidden=2816, vocab=32000, n_layers=8)
BIG_DIMS = LlamaDims(dim=1280, kv_dim=1280, hidden=3584, vocab=32000, n_layers=112)


def row_name(source: str, row: str) -> str:
    return f"{source} {ROW_NAMES.get((source, row), row)}"


def dims_for(size_mb: float, dtype_bytes: int) -> LlamaDims:
    """8 layers, vocab 32000, ffn 2.75 x dim (multiples of 16), closest to ``size_mb`` MiB."""
    def total(d: int) -> int:
        dims = _dims(d)
        return dtype_bytes * sum(_numel(s) for s in tensor_shapes(dims).values())

    d = 16
    while total(d + 16) <= size_mb * MIB:
        d += 16
    return _dims(d) if size_mb * MIB - total(d) <= total(d + 16) - size_mb * MIB else _dims(d + 16)


def _dims(d: int) -> LlamaDims:
    return LlamaDims(dim=d, kv_dim=d, hidden=max(16, round(2.75 * d / 16) * 16), vocab=32000, n_layers=8)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ----------------------------------------------------------------------------- in the ranks


def _set_cache(files: list[str], cache: str) -> None:
    buf = bytearray(16 * MIB)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            if cache == "cold":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while os.readv(fd, [buf]):
                    pass
        finally:
            os.close(fd)


def _state(shapes: dict[str, list[int]], dtype: Any, world: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rank = mesh.get_local_rank()
    out = {}
    for name, shape in shapes.items():
        step = -(-shape[0] // world)
        start = min(shape[0], rank * step)
        local = torch.zeros((max(0, min(shape[0], start + step) - start), *shape[1:]), dtype=dtype)
        stride = [_numel(tuple(shape[i + 1:])) for i in range(len(shape))]
        out[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                       stride=tuple(stride))
    return out


def _checksum(state: dict[str, Any]) -> float:
    """Per tensor, its local shard's float64 sum plus its first and last rows', weighted by
    its place; the same arithmetic for every row, so equal values give equal sums."""
    total = 0.0
    for i, t in enumerate(state.values()):
        local = t.to_local()
        if not local.numel():
            continue
        flat = local.reshape(-1)
        s = sum(float(flat[a:a + (1 << 24)].double().sum()) for a in range(0, flat.numel(), 1 << 24))
        total += (i % 97 + 1) * (s + 3 * float(local[0].double().sum()) + 5 * float(local[-1].double().sum()))
    return total


def _load(source: str, row: str, state: dict[str, Any], path: str, max_memory: str) -> None:
    import torch.distributed.checkpoint as dcp

    import reshard

    if row == TORCH:
        from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader

        reader = FileSystemReader(path) if source == DCP else HuggingFaceStorageReader(path)
        dcp.load(state, storage_reader=reader)
    elif row == READER:
        dcp.load(state, storage_reader=reshard.StorageReader(path, max_memory=max_memory))
    else:
        reshard.load_state_dict(state, path, mode="rank0" if row == RANK0 else "parallel", max_memory=max_memory,
                                progress=False)


def run_ranks(rank: int, world: int, spec: dict[str, Any], out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401  # both libraries imported before any clock
    from torch.distributed.checkpoint import HuggingFaceStorageReader  # noqa: F401

    import reshard

    _ = (reshard.load_state_dict, reshard.StorageReader)  # resolve the lazy names: their modules load now
    torch.set_num_threads(1)
    base = status_bytes("VmRSS")
    state = _state(spec["shapes"], getattr(torch, spec["dtype"]), world)
    shard = sum(t.to_local().nbytes for t in state.values())
    rows = [tuple(r) for r in spec["rows"]]
    records = []
    for cache in spec["caches"]:
        for rnd in range(spec["rounds"]):
            for source, row in rows[rnd % len(rows):] + rows[:rnd % len(rows)]:
                for t in state.values():
                    t.to_local().zero_()
                if rank == 0:
                    _set_cache(spec["files"][source], cache)
                dist.barrier()
                before = status_bytes("VmRSS")
                reset_peak_rss()
                start = time.perf_counter()
                _load(source, row, state, spec["paths"][source], spec["max_memory"])
                wall = time.perf_counter() - start
                peak = status_bytes("VmHWM")
                mine = torch.tensor([wall, (peak - before) / MIB, (peak - base - shard) / MIB], dtype=torch.float64)
                dist.all_reduce(mine, op=dist.ReduceOp.MAX)
                checksum = torch.tensor([_checksum(state)], dtype=torch.float64)
                dist.all_reduce(checksum)
                records.append({"cache": cache, "round": rnd + 1, "source": source, "row": row, "wall_s": float(mine[0]),
                                "added_mib": float(mine[1]), "over_shard_mib": float(mine[2]),
                                "checksum": float(checksum[0])})
    shards = [0] * world
    dist.all_gather_object(shards, shard)
    if rank == 0:
        Path(out).write_text(json.dumps({"records": records, "shard_mib": [s / MIB for s in shards]}))


# ----------------------------------------------------------------------------- the driver


def ensure_sources(args: argparse.Namespace) -> tuple[dict[str, Path], LlamaDims, str]:
    """The DCP (4 ranks) and HF folder for the run, made once and cached in ``--cache-dir``."""
    import reshard

    dtype = "bfloat16" if args.big else args.dtype
    dims = BIG_DIMS if args.big else dims_for(args.size_mb, 2 if dtype == "bfloat16" else 4) if args.size_mb else \
        DEFAULT_DIMS
    tag = f"load_l{dims.n_layers}_d{dims.dim}_{dtype}"
    ckpt = ensure_model_checkpoint(args.cache_dir / tag, dims, dtype)
    hf = args.cache_dir / f"{tag}.hf_{args.shard_size}"
    if not (hf / "model.safetensors.index.json").is_file() or hf.stat().st_mtime < marker_path(ckpt).stat().st_mtime:
        print(f"making {hf} (reshard convert --to safetensors --max-shard-size {args.shard_size})", file=sys.stderr)
        reshard.convert(ckpt, hf, to="safetensors", max_shard_size=args.shard_size, overwrite=True, quiet=True)
    return {DCP: ckpt, HF: hf}, dims, dtype


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(records: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(cache, source, row) -> median wall, its rounds, the largest peaks, whether values agree."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in records:
        s = out.setdefault((r["cache"], r["source"], r["row"]), {"walls": [], "added": 0.0, "over_shard": 0.0,
                                                                  "sums": set()})
        s["walls"].append(r["wall_s"])
        s["added"] = max(s["added"], r["added_mib"])
        s["over_shard"] = max(s["over_shard"], r["over_shard_mib"])
        s["sums"].add(r["checksum"])
    for s in out.values():
        s["wall"] = median(s["walls"])
    return out


def checks(by_n: dict[int, dict[tuple[str, str, str], dict[str, Any]]], budget_mib: float, big: bool) -> list[dict[str, Any]]:
    """The targets, each ``{"text", "ok"}`` (``ok`` None: shown, no target)."""
    out: list[dict[str, Any]] = []

    def ratio(n: int, cache: str, source: str, row: str, over: str) -> float | None:
        s = by_n.get(n, {})
        a, b = s.get((cache, source, row)), s.get((cache, source, over))
        return a["wall"] / b["wall"] if a and b and b["wall"] > 0 else None

    def check(text: str, value: float | None, limit: float | None) -> None:
        if value is not None:
            out.append({"text": f"{text}: {value:.2f}x" + (f" (target <= {limit:.1f}x)" if limit else ""),
                        "ok": None if limit is None else value <= limit, "value": value, "limit": limit})

    for n in sorted(by_n):
        for cache in ("warm", "cold"):
            for source, limit in ((DCP, 0.8), (HF, 1.0)):
                target = limit if cache == "warm" and n == 2 else 1.0 if cache == "cold" and big else None
                check(f"{cache}, {source} onto {n} ranks: reshard.load_state_dict / {ROW_NAMES[(source, TORCH)]}",
                      ratio(n, cache, source, PARALLEL, TORCH), target)
                check(f"{cache}, {source} onto {n} ranks: rank0 mode / parallel mode", ratio(n, cache, source, RANK0, PARALLEL),
                      2.0 if cache == "warm" else None)
                check(f"{cache}, {source} onto {n} ranks: dcp.load reshard.StorageReader / {ROW_NAMES[(source, TORCH)]}",
                      ratio(n, cache, source, READER, TORCH), None)
        rows = by_n[n]
        added = max((s["added"] for (_, _, row), s in rows.items() if row != TORCH), default=None)
        if added is not None:
            out.append({"text": f"{n} ranks: peak RSS per rank, reshard rows: its shard + at most {added:.0f} MiB "
                                f"(target: shard + the budget, {budget_mib:.0f} MiB)",
                        "ok": added <= budget_mib, "value": added, "limit": budget_mib})
        sums = {v for s in rows.values() for v in s["sums"]}
        out.append({"text": f"{n} ranks: every row and round loaded the same values ({len(sums)} distinct checksum"
                            f"{'s' if len(sums) != 1 else ''})", "ok": len(sums) == 1})
    return out


def report(by_n: dict[int, dict[tuple[str, str, str], dict[str, Any]]], shard_mib: dict[int, list[float]]) -> list[str]:
    lines = []
    ns = sorted(by_n)
    head = f"{'row':<44} {'cache':<5}" + "".join(f" | {n} ranks: {'s':>6} {'x torch':>7} {'rounds s':>18} {'added MiB':>9}"
                                                    for n in ns)
    lines.append(head)
    keys = [k for k in next(iter(by_n.values()))]
    for cache, source, row in sorted(keys, key=lambda k: (k[0] != "warm", k[1], ROWS.index((k[1], k[2])))):
        cells = f"{row_name(source, row):<44} {cache:<5}"
        for n in ns:
            s, t = by_n[n].get((cache, source, row)), by_n[n].get((cache, source, TORCH))
            if s is None:
                cells += " | " + " " * 53
                continue
            x = f"{s['wall'] / t['wall']:7.2f}" if t and t["wall"] > 0 else f"{'':>7}"
            walls = " ".join(f"{w:.2f}" for w in s["walls"])
            cells += f" | {'':9}{s['wall']:6.3f} {x} {walls:>18} {s['added']:9.0f}"
        lines.append(cells)
    for n in ns:
        lines.append(f"shard per rank, {n} ranks: {', '.join(f'{m:.0f}' for m in shard_mib[n])} MiB")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big", action="store_true", help="112 layers of dim 1280 / ffn 3584, bf16: 4.4 GiB, 1,011 tensors")
    ap.add_argument("--size-mb", type=float, default=None, help="an 8-layer model of about this many MiB instead")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="without --big (default float32)")
    ap.add_argument("--nprocs", default="2,3", help="rank counts that load (default 2,3; the DCP was saved by 4)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per rank count (default 3)")
    ap.add_argument("--cache", default="warm,cold", help="page cache states, each its own rounds (default warm,cold)")
    ap.add_argument("--rows", default=None, help="comma-separated rows, e.g. 'DCP torch,DCP reshard parallel' (default all)")
    ap.add_argument("--max-memory", default="256MiB", help="reshard's max_memory (default 256MiB)")
    ap.add_argument("--shard-size", default="200MB", help="the HF folder's --max-shard-size (default 200MB)")
    ap.add_argument("--cache-dir", type=Path, default=REPO / ".bench", help="where sources are made and kept (.bench/)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per world (default 3600)")
    ap.add_argument("--json", type=Path, default=None, help="also write every round's figures here")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args(argv)
    caches = [c.strip() for c in args.cache.split(",") if c.strip()]
    if not caches or any(c not in ("warm", "cold") for c in caches):
        ap.error("--cache takes warm, cold or both")
    rows = ROWS if args.rows is None else [(s, r) for s, r in ROWS if f"{s} {r}" in [x.strip() for x in args.rows.split(",")]]
    if not rows:
        ap.error(f"--rows: choose from {', '.join(f'{s} {r}' for s, r in ROWS)}")
    from reshard.core.sizes import parse_size
    from reshard.runtime.world import run_world

    paths, dims, dtype = ensure_sources(args)
    shapes = {n: list(s) for n, s in tensor_shapes(dims).items()}
    files = {k: sorted(str(f) for f in p.iterdir() if f.is_file()) for k, p in paths.items()}
    nbytes = sum(os.path.getsize(f) for f in files[DCP])
    spec = {"shapes": shapes, "dtype": dtype, "rows": rows, "rounds": args.rounds, "caches": caches,
            "paths": {k: str(p) for k, p in paths.items()}, "files": files, "max_memory": args.max_memory}
    load_before = os.getloadavg()
    by_n, shard_mib, raw = {}, {}, {}
    for n in [int(x) for x in args.nprocs.split(",")]:
        print(f"  {n} ranks: {len(rows)} rows x {args.rounds} rounds x {'/'.join(caches)} ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
            out = Path(tmp, "out.json")
            run_world(run_ranks, n, spec, str(out), timeout=args.timeout)
            got = json.loads(out.read_text())
        raw[n], shard_mib[n] = got["records"], got["shard_mib"]
        by_n[n] = summarize(got["records"])
    load_after = os.getloadavg()
    import torch

    print(f"\nload {dims.n_layers} layers of dim {dims.dim} / ffn {dims.hidden} / vocab {dims.vocab}, {dtype}, "
          f"{len(shapes)} tensors ({nbytes / MIB:.0f} MiB): {paths[DCP].name} (DCP saved by 4 ranks) and "
          f"{paths[HF].name} (HF folder, {len(files[HF]) - 1} files) into Shard(0) DTensors")
    print(f"median of {args.rounds} alternating round(s), the load call only, slowest rank | --max-memory "
          f"{args.max_memory} | {os.cpu_count()} CPUs, load average {load_before[0]:.1f} before, {load_after[0]:.1f} "
          f"after | torch {torch.__version__}\n")
    lines = report(by_n, shard_mib)
    print("\n".join(lines) + "\n")
    verdicts = checks(by_n, parse_size(args.max_memory) / MIB, args.big)
    for c in verdicts:
        print(f"  {'INFO' if c['ok'] is None else 'PASS' if c['ok'] else 'FAIL'}  {c['text']}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "load_average":
                                         [load_before, load_after], "records": {str(n): r for n, r in raw.items()},
                                         "shard_mib": {str(n): s for n, s in shard_mib.items()}, "report": lines,
                                         "checks": verdicts}, indent=1))
    agree = all(c["ok"] for c in verdicts if "checksum" in c["text"])
    missed = any(c["ok"] is False for c in verdicts)
    return 1 if not agree or (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
