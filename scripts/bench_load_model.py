#!/usr/bin/env python
"""Side-by-side benchmark of loading a checkpoint into a live FSDP2 model + AdamW.

Rows (each its own fresh gloo world of ``--nproc`` ranks, so peaks never mix):

* ``baseline``: the rank starts, imports torch, joins the gloo group and exits: what every
  row pays before loading anything.
* ``reshard rank0``: ``reshard.load_model(..., mode="rank0")``: rank 0 alone reads the DCP and
  sends each rank only its boxes, in slabs under ``--max-memory``.
* ``reshard parallel``: ``mode="parallel"``: every rank reads its own boxes.
* ``torch broadcast_from_rank0``: torch's own path: rank 0 holds the full state dict
  (``torch.load`` of the same checkpoint as one full file, made beforehand by
  ``reshard convert``) and calls ``set_model_state_dict`` / ``set_optimizer_state_dict`` with
  ``StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)``; the other ranks pass
  empty dicts.
* ``dcp.load FileSystemReader`` / ``dcp.load reshard.StorageReader``: torch's ``dcp.load`` of
  the DCP into ``get_state_dict``'s ``{"model", "optim"}`` (filled in place), through torch's
  own reader or ``reshard.StorageReader``.
* ``dcp.load HuggingFaceStorageReader`` / ``dcp.load reshard.StorageReader hf``: the model
  alone, from the same tensors as a safetensors folder (made beforehand by ``reshard convert
  --only model``), through torch's HF reader or ``reshard.StorageReader``; these rows' optimizer
  state stays the fresh one, so only their model checksum is compared.

Method
------
* Source: the llama-shaped fp32 DCP of ``scripts/make_bench_ckpt.py`` (params + exp_avg +
  exp_avg_sq, saved by 4 ranks, cached in ``.bench/``), loaded on ``--nproc`` ranks (3 by
  default: a different count, uneven shards).
* Every rank builds the same model on the meta device, ``fully_shard``s each layer and the
  root, materializes its shards with ``to_empty`` and makes a fresh AdamW whose state torch's
  ``get_state_dict`` creates before the clock starts, in all rows alike.
* Wall: barrier, load, barrier; the slowest rank's time. Peak RSS: ``VmHWM`` from
  ``/proc/self/status`` at the end, the high-water mark of that rank's own process since
  exec (``ru_maxrss`` would include the parent's pages copied at fork). "above base" is the
  peak minus the baseline row's peak for the same rank; "shard" is the rank's local bytes of
  parameters and optimizer state. "load peak - RSS before" restarts VmHWM (``clear_refs``)
  just before the load: what the load itself held on top of the model and optimizer.
* A checksum (sum of every loaded local tensor, reduced over ranks) must agree across rows,
  and one of the parameters alone across every row, the model-only rows too.
  The benchmark checkpoint has no ``step`` / param groups, so every path keeps the
  optimizer's own (reshard rows use ``strict=False`` and report the names they skipped; the
  ``dcp.load`` rows leave ``step`` out of the state dict they load).

    python scripts/bench_load_model.py                          # ~1.5 GB checkpoint, 3 ranks
    python scripts/bench_load_model.py --size-mb 64 --json load.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_bench_ckpt import default_ckpt_path, ensure_checkpoint, solve_dims, tensor_shapes  # noqa: E402

MIB = 2**20
RSS_ALLOWANCE_MIB = 384  # acceptance: rank 0 (rank0 mode) within max-memory + shard + this over baseline
BASELINE, RANK0, PARALLEL, TORCH = "baseline", "reshard rank0", "reshard parallel", "torch broadcast_from_rank0"
DCP_TORCH, DCP_RESHARD = "dcp.load FileSystemReader", "dcp.load reshard.StorageReader"
HF_TORCH, HF_RESHARD = "dcp.load HuggingFaceStorageReader", "dcp.load reshard.StorageReader hf"
DCP_ROWS = (DCP_TORCH, DCP_RESHARD, HF_TORCH, HF_RESHARD)
MODEL_ONLY = (HF_TORCH, HF_RESHARD)  # read from the model-only safetensors folder
ROWS = (BASELINE, RANK0, PARALLEL, TORCH, *DCP_ROWS)


# ----------------------------------------------------------------------------- in the ranks


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    """This process's own RSS high-water mark (VmHWM), in bytes."""
    return status_bytes("VmHWM")


def reset_peak_rss() -> bool:
    """Restart VmHWM from the current RSS (Linux >= 4.0), so the load's own peak shows."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def build_model(shapes: dict[str, tuple[int, ...]], nproc: int, tp: int = 1) -> Any:
    """A module tree with the checkpoint's parameter names, FSDP2-sharded, shards materialized.
    With ``tp`` > 1 the mesh is ``(nproc // tp, tp)`` and every matrix is first split by rows
    over ``tp`` (column-parallel, as TP does), so FSDP2 over it gives ``_StridedShard``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if tp > 1:
        mesh_2d = init_device_mesh("cpu", (nproc // tp, tp), mesh_dim_names=("dp_shard", "tp"))
    root = torch.nn.Module()
    for fqn, shape in shapes.items():
        *path, leaf = fqn.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        value = torch.empty(shape, device="meta")
        if tp > 1:
            rows = len(shape) == 2
            local = torch.empty((-(-shape[0] // tp), *shape[1:]) if rows else shape, device="meta")
            if rows and mesh_2d["tp"].get_local_rank() == tp - 1:
                local = torch.empty((shape[0] - (tp - 1) * local.shape[0], *shape[1:]), device="meta")
            value = DTensor.from_local(local, mesh_2d["tp"], [Shard(0) if rows else Replicate()], shape=shape,
                                       stride=torch.empty(shape, device="meta").stride(), run_check=False)
        mod.register_parameter(leaf, torch.nn.Parameter(value))
    mesh = mesh_2d["dp_shard"] if tp > 1 else init_device_mesh("cpu", (nproc,), mesh_dim_names=("dp_shard",))
    for layer in root.layers.children():
        fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)
    root.to_empty(device="cpu")
    return root


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _load_reshard(model: Any, opt: Any, src: str, mode: str, max_memory: str) -> dict[str, Any]:
    import reshard

    res = reshard.load_model(model, src, opt, mode=mode, strict=False, max_memory=max_memory, progress=False)
    return {"skipped": len(res.missing), "skipped_example": res.missing[:1], "unexpected": len(res.unexpected)}


def _load_torch(model: Any, opt: Any, full_pt: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    groups = get_state_dict(model, opt)[1]["param_groups"]  # also creates the optimizer state
    msd: dict[str, Any] = {}
    osd: dict[str, Any] = {}
    if dist.get_rank() == 0:
        full = torch.load(full_pt, weights_only=True)  # the whole checkpoint, in memory
        msd, osd = full["model"], {"state": full["optim"]["state"], "param_groups": groups}
    # Two calls, as torchtitan makes them: set_state_dict treats a rank with an empty model
    # state dict as "optimizer only" and would skip the model's broadcast on ranks 1..n.
    set_model_state_dict(model, msd, options=options)
    set_optimizer_state_dict(model, opt, osd, options=options)
    return {}


def _dcp_state(model: Any, opt: Any, model_only: bool) -> dict[str, Any]:
    """What the dcp.load rows fill in place: get_state_dict's model and optimizer state (the
    model's and optimizer's own tensors), without the step the benchmark checkpoint lacks."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    if model_only:
        return dict(msd)  # the safetensors folder holds the model under its FQNs
    state = {fqn: {k: v for k, v in s.items() if k != "step"} for fqn, s in osd["state"].items()}
    return {"model": msd, "optim": {"state": state}}


def _load_dcp(row: str, state: dict[str, Any], src: str, hf_dir: str, max_memory: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    import reshard

    reader: Any
    if row == DCP_TORCH:
        reader = dcp.FileSystemReader(src)
    elif row == HF_TORCH:
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        reader = HuggingFaceStorageReader(hf_dir)
    else:
        reader = reshard.StorageReader(hf_dir if row in MODEL_ONLY else src, max_memory=max_memory)
    dcp.load(state, storage_reader=reader)
    return {"model_only": row in MODEL_ONLY}


def run_row(rank: int, world: int, row: str, src: str, full_pt: str, max_memory: str, shapes: dict,
            outdir: str, tp: int = 1, hf_dir: str = "") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    record: dict[str, Any] = {"rank": rank}
    if row != BASELINE:
        model = build_model(shapes, world, tp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        # Optimizer state is created by torch's helper before the clock starts, in every row
        # alike (its zero-gradient step allocates gradients for a moment), so the load's own
        # peak below is the load's alone.
        from torch.distributed.checkpoint.state_dict import get_state_dict

        get_state_dict(model, opt)
        state = _dcp_state(model, opt, row in MODEL_ONLY) if row in DCP_ROWS else {}
        record["setup_peak_bytes"] = peak_rss_bytes()
        record["rss_before_load_bytes"] = status_bytes("VmRSS")
        dist.barrier()
        record["load_peak_measured"] = reset_peak_rss()
        start = time.perf_counter()
        if row == TORCH:
            record.update(_load_torch(model, opt, full_pt))
        elif row in DCP_ROWS:
            record.update(_load_dcp(row, state, src, hf_dir, max_memory))
        else:
            record.update(_load_reshard(model, opt, src, "rank0" if row == RANK0 else "parallel", max_memory))
        dist.barrier()
        record["wall_s"] = time.perf_counter() - start
        record["load_peak_bytes"] = peak_rss_bytes()
        params = [_local(p) for p in model.parameters()]
        tensors = params + [_local(v) for s in opt.state.values() for k, v in s.items() if k != "step"]
        record["shard_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
        checksum = torch.tensor([sum(float(t.detach().double().sum()) for t in tensors),
                                 sum(float(t.detach().double().sum()) for t in params)], dtype=torch.float64)
        dist.all_reduce(checksum)
        record["checksum"], record["model_checksum"] = float(checksum[0]), float(checksum[1])
    record["peak_rss_bytes"] = max(peak_rss_bytes(), record.get("setup_peak_bytes", 0))
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(record))


# ----------------------------------------------------------------------------- the driver


def ensure_full_file(ckpt: Path) -> Path:
    """The same checkpoint as one torch.save file, for torch's row (made once, cached)."""
    import reshard

    full = ckpt.with_name(ckpt.name + ".full.pt")
    marker = ckpt.with_name(ckpt.name + ".marker.json")
    if not full.is_file() or (marker.is_file() and marker.stat().st_mtime > full.stat().st_mtime):
        print(f"making {full} for torch's row (reshard convert)", file=sys.stderr)
        reshard.convert(ckpt, full, overwrite=True, quiet=True)
    return full


def ensure_hf_folder(ckpt: Path) -> Path:
    """The same model tensors as a safetensors folder, for the HF rows (made once, cached)."""
    import reshard

    folder = ckpt.with_name(ckpt.name + ".hf")
    marker = ckpt.with_name(ckpt.name + ".marker.json")
    if not folder.is_dir() or (marker.is_file() and marker.stat().st_mtime > folder.stat().st_mtime):
        print(f"making {folder} for the HF rows (reshard convert --only model)", file=sys.stderr)
        reshard.convert(ckpt, folder, to="safetensors", only="model", overwrite=True, quiet=True)
    return folder


def measure(row: str, args: argparse.Namespace, ckpt: Path, full_pt: Path, shapes: dict,
            hf_dir: Path | None = None) -> list[dict[str, Any]]:
    from reshard.runtime.world import run_world

    with tempfile.TemporaryDirectory(prefix="bench-load-") as out:
        run_world(run_row, args.nproc, row, str(ckpt), str(full_pt), args.max_memory, shapes, out, args.tp,
                  str(hf_dir or ""), timeout=args.timeout)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.nproc)]


def _load_delta(r: dict[str, Any]) -> float | None:
    """MiB the load itself added on top of the rank's RSS just before it (model, state, imports)."""
    if not r.get("load_peak_measured"):
        return None
    return (r["load_peak_bytes"] - r["rss_before_load_bytes"]) / MIB


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, ckpt_bytes: int) -> list[str]:
    from reshard.core.sizes import parse_size

    base = {r["rank"]: r["peak_rss_bytes"] for r in results.get(BASELINE, [])}
    lines = [f"{'row':<36} {'rank':>4} {'wall s':>7} {'peak MiB':>9} {'above base':>10} {'shard MiB':>9} "
             f"{'above base+shard':>16} {'load peak - RSS before':>22}"]
    for row, ranks in results.items():
        for r in ranks:
            peak = r["peak_rss_bytes"] / MIB
            above = (r["peak_rss_bytes"] - base[r["rank"]]) / MIB if r["rank"] in base else None
            shard = r.get("shard_bytes", 0) / MIB
            cells = [f"{row if r['rank'] == 0 else '':<36}", f"{r['rank']:>4}",
                     f"{r['wall_s']:7.2f}" if "wall_s" in r else f"{'':>7}", f"{peak:9.0f}",
                     f"{above:10.0f}" if above is not None and row != BASELINE else f"{'':>10}",
                     f"{shard:9.0f}" if row != BASELINE else f"{'':>9}",
                     f"{above - shard:16.0f}" if above is not None and row != BASELINE else f"{'':>16}",
                     f"{_load_delta(r):22.0f}" if _load_delta(r) is not None else f"{'':>22}"]
            lines.append(" ".join(cells))
    sums = {row: ranks[0]["checksum"] for row, ranks in results.items() if "checksum" in ranks[0] and row not in MODEL_ONLY}
    agree = len(set(sums.values())) <= 1
    lines.append(f"\nchecksums {'agree' if agree else 'DIFFER'}: " + ", ".join(f"{k}={v:.6g}" for k, v in sums.items()))
    models = {row: ranks[0]["model_checksum"] for row, ranks in results.items() if "model_checksum" in ranks[0]}
    agree = len(set(models.values())) <= 1
    lines.append(f"model checksums {'agree' if agree else 'DIFFER'}: "
                 + ", ".join(f"{k}={v:.6g}" for k, v in models.items()))
    if RANK0 in results and 0 in base:
        r0 = results[RANK0][0]
        above = (r0["peak_rss_bytes"] - base[0]) / MIB
        limit = parse_size(args.max_memory) / MIB + r0["shard_bytes"] / MIB + RSS_ALLOWANCE_MIB
        lines.append(f"{'PASS' if above <= limit else 'FAIL'}  rank 0 in rank0 mode: {above:.0f} MiB above baseline "
                     f"<= max-memory {args.max_memory} + shard {r0['shard_bytes'] / MIB:.0f} MiB + "
                     f"{RSS_ALLOWANCE_MIB} MiB = {limit:.0f} MiB")
    if TORCH in results and 0 in base:
        t0 = (results[TORCH][0]["peak_rss_bytes"] - base[0]) / MIB
        lines.append(f"      torch broadcast_from_rank0, rank 0: {t0:.0f} MiB above baseline; the full state dict "
                     f"alone is {ckpt_bytes / MIB:.0f} MiB")
    deltas = {row: _load_delta(ranks[0]) for row, ranks in results.items() if row != BASELINE}
    if any(d is not None for d in deltas.values()):
        lines.append("      rank 0, load peak - RSS before the load: " + ", ".join(
            f"{row} {d:.0f} MiB" for row, d in deltas.items() if d is not None))
    skipped = next((r for ranks in results.values() for r in ranks if r.get("skipped")), None)
    if skipped:
        lines.append(f"note: the benchmark checkpoint has no optimizer step / param groups: reshard rows skip "
                     f"{skipped['skipped']} names (e.g. {skipped['skipped_example'][0]!r}) with strict=False")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=1536.0, help="checkpoint size in MiB (default 1536)")
    ap.add_argument("--ckpt", type=Path, default=None, help="checkpoint dir (default .bench/ckpt_<size>, made if missing)")
    ap.add_argument("--nproc", type=int, default=3, help="ranks that load (default 3; the checkpoint was saved by 4)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel degree: load into a (nproc/tp, tp) TP+FSDP2 mesh, matrices row-split (default 1)")
    ap.add_argument("--max-memory", default="256MiB", help="reshard's max_memory (default 256MiB)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows (default: {','.join(ROWS)})")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per row (default 1800)")
    ap.add_argument("--json", type=Path, default=None, help="also write the per-rank results here")
    args = ap.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if args.tp < 1 or args.nproc % args.tp:
        ap.error(f"--tp {args.tp} must divide --nproc {args.nproc}")
    if unknown := [r for r in rows if r not in ROWS]:
        ap.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    ckpt = ensure_checkpoint(args.ckpt or default_ckpt_path(args.size_mb), args.size_mb)
    full_pt = ensure_full_file(ckpt) if TORCH in rows else ckpt
    hf_dir = ensure_hf_folder(ckpt) if set(rows) & set(MODEL_ONLY) else None
    shapes = tensor_shapes(solve_dims(args.size_mb))
    ckpt_bytes = sum(f.stat().st_size for f in ckpt.iterdir() if f.is_file())
    results: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        print(f"  {row} on {args.nproc} ranks ...", file=sys.stderr, flush=True)
        results[row] = measure(row, args, ckpt, full_pt, shapes, hf_dir)
    print(f"\nload {ckpt} ({ckpt_bytes / MIB:.0f} MiB) into FSDP2 + AdamW on {args.nproc} gloo ranks | "
          f"--max-memory {args.max_memory} | peak = VmHWM per rank"
          + (f" | mesh dp x tp = {args.nproc // args.tp} x {args.tp} (TP+FSDP2, _StridedShard)" if args.tp > 1 else "")
          + "\n")
    lines = report(results, args, ckpt_bytes)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "ckpt": str(ckpt),
                                         "ckpt_bytes": ckpt_bytes, "results": results, "report": lines}, indent=1))
    failed = any(line.startswith("FAIL") for line in lines) or "DIFFER" in "\n".join(lines)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
