#!/usr/bin/env python
"""Make a synthetic, llama-shaped DCP checkpoint for benchmarks.

The checkpoint is written the way a real FSDP2 trainer writes one: a 4-rank gloo world
(``torch.multiprocessing`` spawn, ``file://`` rendezvous in a temp dir) where every rank holds
only its ``Shard(0)`` DTensor piece of each tensor and calls ``dcp.save``. It holds fp32
model parameters and AdamW-like ``exp_avg`` / ``exp_avg_sq`` of the same shapes::

    model.tok_embeddings.weight                         (vocab, dim)
    model.layers.{i}.attention.{wq,wk,wv,wo}.weight     (dim|kv_dim, dim)
    model.layers.{i}.feed_forward.{w1,w2,w3}.weight     (hidden, dim) / (dim, hidden)
    model.layers.{i}.{attention_norm,ffn_norm}.weight   (dim,)
    model.norm.weight, model.output.weight
    optim.state.<param fqn>.exp_avg / .exp_avg_sq       same shapes as the parameter

Dimensions are solved from ``--size-mb`` (MiB, all tensors together); ``vocab`` is odd and
``hidden`` is 2 mod 4, so those tensors shard unevenly over 4 ranks (torch.chunk semantics).
Data is ``torch.randn`` from a per-rank seeded generator, generated shard by shard: no
process ever builds a full tensor.

A finished checkpoint is cached: ``<out>.marker.json`` beside the directory records the
request, and a later call with the same request reuses it. The directory is written under a
temporary name and renamed into place, so an interrupted run never looks finished.

    python scripts/make_bench_ckpt.py --size-mb 1536 --out .bench/ckpt_1536
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["LlamaDims", "solve_dims", "tensor_shapes", "ensure_checkpoint", "default_ckpt_path", "SavedTensor",
           "model_state", "ensure_model_checkpoint",
           "save_world", "cached_build", "marker_path",
           "generator_args", "generate"]

REPO = Path(__file__).resolve().parent.parent
WORLD_SIZE = 4
N_LAYERS = 8
GENERATOR_VERSION = 1  # bump when the layout or the data recipe changes: invalidates caches
BYTES_PER_ELEMENT = 4  # fp32
STATE_COPIES = 3  # parameter, exp_avg, exp_avg_sq


@dataclass(frozen=True)
class LlamaDims:
    dim: int
    kv_dim: int
    hidden: int
    vocab: int
    n_layers: int


def _dims_for(dim: int, n_layers: int = N_LAYERS) -> LlamaDims:
    # hidden ~ 8/3 dim, forced to 2 mod 4; vocab ~ 8 dim, forced odd: both shard unevenly.
    hidden = (8 * dim // 3) // 4 * 4 + 2
    return LlamaDims(dim=dim, kv_dim=dim // 2, hidden=hidden, vocab=8 * dim + 3, n_layers=n_layers)


def tensor_shapes(d: LlamaDims) -> dict[str, tuple[int, ...]]:
    """Parameter FQNs (without the ``model.`` section) and their global shapes, in order."""
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (d.vocab, d.dim)}
    for i in range(d.n_layers):
        p = f"layers.{i}"
        shapes[f"{p}.attention.wq.weight"] = (d.dim, d.dim)
        shapes[f"{p}.attention.wk.weight"] = (d.kv_dim, d.dim)
        shapes[f"{p}.attention.wv.weight"] = (d.kv_dim, d.dim)
        shapes[f"{p}.attention.wo.weight"] = (d.dim, d.dim)
        shapes[f"{p}.feed_forward.w1.weight"] = (d.hidden, d.dim)
        shapes[f"{p}.feed_forward.w2.weight"] = (d.dim, d.hidden)
        shapes[f"{p}.feed_forward.w3.weight"] = (d.hidden, d.dim)
        shapes[f"{p}.attention_norm.weight"] = (d.dim,)
        shapes[f"{p}.ffn_norm.weight"] = (d.dim,)
    shapes["norm.weight"] = (d.dim,)
    shapes["output.weight"] = (d.vocab, d.dim)
    return shapes


def total_bytes(d: LlamaDims) -> int:
    return STATE_COPIES * BYTES_PER_ELEMENT * sum(math.prod(s) for s in tensor_shapes(d).values())


def solve_dims(size_mb: float) -> LlamaDims:
    """The llama dims (``dim`` a multiple of 4) whose checkpoint is closest to ``size_mb`` MiB."""
    target = size_mb * 2**20
    dim = 4
    while total_bytes(_dims_for(dim + 4)) <= target:
        dim += 4
    lo, hi = _dims_for(dim), _dims_for(dim + 4)
    return lo if target - total_bytes(lo) <= total_bytes(hi) - target else hi


def default_ckpt_path(size_mb: float) -> Path:
    return REPO / ".bench" / f"ckpt_{size_mb:g}"


# --------------------------------------------------------------------------------- world


def _shard_rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s Shard(0) piece of ``n`` rows, as torch.chunk cuts it."""
    step = -(-n // world) if n else 0
    start = min(n, rank * step)
    return start, max(0, min(n, start + step) - start)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


@dataclass(frozen=True)
class SavedTensor:
    """One tensor of a saved state dict: where it sits in the nested dict, its global shape,
    and the scale of its ``randn`` data."""

    path: tuple[str, ...]  # ("model", "layers.0.w"): state_dict["model"]["layers.0.w"]
    shape: tuple[int, ...]
    scale: float = 1.0
    dtype: str = "float32"  # torch's name; drawn in fp32, then cast


def llama_state(dims: LlamaDims) -> list[SavedTensor]:
    """The benchmark checkpoint: each parameter, then its exp_avg and exp_avg_sq (the order
    the ranks draw their random numbers in)."""
    out = []
    for fqn, shape in tensor_shapes(dims).items():
        out += [SavedTensor(("model", fqn), shape, 0.02), SavedTensor(("optim", "state", fqn, "exp_avg"), shape, 1e-3),
                SavedTensor(("optim", "state", fqn, "exp_avg_sq"), shape, 1e-6)]
    return out


def _rank_main(rank: int, world: int, store: str, out: str, spec: list[SavedTensor], objects: dict, seed: int,
               errdir: str) -> None:
    import traceback

    try:
        _save_rank(rank, world, store, out, spec, objects, seed)
    except BaseException:
        Path(errdir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _save_rank(rank: int, world: int, store: str, out: str, spec: list[SavedTensor], objects: dict,
               seed: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        gen = torch.Generator().manual_seed(seed * 1000 + rank)

        def shard(shape: tuple[int, ...], scale: float, dtype: str) -> DTensor:
            _, rows = _shard_rows(shape[0], rank, world)
            local = torch.randn((rows, *shape[1:]), generator=gen)
            if scale != 1.0:
                local.mul_(scale)
            local = local.to(getattr(torch, dtype))
            return DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False,
                shape=torch.Size(shape), stride=_contiguous_stride(shape),
            )

        state: dict = {}
        for t in spec:
            node = state
            for key in t.path[:-1]:
                node = node.setdefault(key, {})
            node[t.path[-1]] = shard(t.shape, t.scale, t.dtype)
        for key, value in objects.items():  # non-tensor sections (train_state, ...), the same on every rank
            state.setdefault(key, value)
        dcp.save(state, checkpoint_id=out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def save_world(out: Path, spec: list[SavedTensor], objects: dict, seed: int, timeout: float,
               world: int = WORLD_SIZE) -> None:
    """Save ``spec`` (plus ``objects``) to the DCP folder ``out`` from a ``world``-rank gloo
    world, every tensor ``Shard(0)``: each rank generates and holds only its own pieces."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="reshard-bench-world-") as tmp:
        args = (world, os.path.join(tmp, "store"), str(out), spec, objects, seed, tmp)
        ctx = mp.start_processes(_rank_main, args=args, nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=5.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {world}-rank save did not finish in {timeout:.0f}s")
        except mp.ProcessRaisedException as e:
            detail = "\n".join(p.read_text() for p in sorted(Path(tmp).glob("rank*.err"))) or str(e)
            raise RuntimeError(f"a rank failed while saving the benchmark checkpoint:\n{detail}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()


# ---------------------------------------------------------------------------------- cache


def marker_path(out: Path) -> Path:
    return out.with_name(out.name + ".marker.json")


def generator_args(doc: str, *, out_help: str, size_help: str | None = None, seed: bool = False,
                   formatter: type = argparse.HelpFormatter) -> argparse.ArgumentParser:
    """The options the generators share (``--out``, ``--force``, and where asked ``--size-mb``
    and ``--seed``); each adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=formatter)
    ap.add_argument("--out", type=Path, default=None, help=out_help)
    ap.add_argument("--force", action="store_true", help="rebuild even when a cached copy matches")
    if size_help:
        ap.add_argument("--size-mb", type=float, default=1536.0, help=size_help)
    if seed:
        ap.add_argument("--seed", type=int, default=0)
    return ap


def generate(out: Path, force: bool, ensure: Callable[[Path], Path]) -> int:
    """Build (or reuse) ``out`` with ``ensure`` and print where it is; ``force`` drops the
    marker first, so the cache is rebuilt."""
    out = out.resolve()
    if force:
        marker_path(out).unlink(missing_ok=True)
    print(ensure(out))
    return 0


def cached_build(out: Path, request: dict, build: Callable[[Path], dict], what: str, quiet: bool = False) -> Path:
    """``out`` made by ``build(tmp)`` unless the marker beside it records ``request`` (the
    generators' shared cache). ``build`` writes into a temporary sibling that is renamed into
    place once complete, so an interrupted build never looks finished; what it returns goes
    into the marker next to the request."""
    out = Path(out).resolve()
    marker = marker_path(out)
    try:
        if out.exists() and json.loads(marker.read_text()).get("request") == request:
            if not quiet:
                print(f"reusing cached {what} {out}", file=sys.stderr)
            return out
    except (OSError, ValueError):
        pass
    if not quiet:
        print(f"making {what} {out}: {request}", file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    started = time.perf_counter()
    try:
        info = build(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    on_disk = sum(f.stat().st_blocks * 512 for f in out.rglob("*") if f.is_file())
    seconds = time.perf_counter() - started
    marker.write_text(json.dumps({"request": request, **info, "bytes_on_disk": on_disk, "seconds": seconds},
                                 indent=1) + "\n")
    if not quiet:
        print(f"made {out} ({on_disk / 2**20:.0f} MiB on disk) in {seconds:.1f}s", file=sys.stderr)
    return out


def model_state(dims: LlamaDims, dtype: str = "float32") -> list[SavedTensor]:
    """A model's parameters alone, at the top level under their FQNs (``dcp.save`` of a plain
    model state dict, the names an HF-style safetensors folder of the same weights has)."""
    return [SavedTensor((fqn,), shape, 0.02, dtype) for fqn, shape in tensor_shapes(dims).items()]


def ensure_model_checkpoint(out: Path, dims: LlamaDims, dtype: str = "float32", seed: int = 0,
                            timeout: float = 3600.0, quiet: bool = False) -> Path:
    """``out`` holding ``model_state(dims, dtype)`` saved by ``WORLD_SIZE`` ranks, unless cached."""
    def build(tmp: Path) -> dict:
        save_world(tmp, model_state(dims, dtype), {}, seed, timeout)
        return {"tensors": len(tensor_shapes(dims))}

    request = {"dims": asdict(dims), "dtype": dtype, "ranks": WORLD_SIZE, "seed": seed, "version": GENERATOR_VERSION}
    return cached_build(out, request, build, f"model checkpoint ({WORLD_SIZE} ranks, {dtype})", quiet)


def _request(size_mb: float, seed: int) -> dict:
    return {"size_mb": size_mb, "ranks": WORLD_SIZE, "seed": seed, "version": GENERATOR_VERSION}


def ensure_checkpoint(out: Path, size_mb: float, seed: int = 0, timeout: float = 3600.0, quiet: bool = False) -> Path:
    """Return ``out`` holding the checkpoint for ``size_mb``, making it unless cached."""
    dims = solve_dims(size_mb)

    def build(tmp: Path) -> dict:
        save_world(tmp, llama_state(dims), {}, seed, timeout)
        return {"dims": asdict(dims), "tensor_bytes": total_bytes(dims)}

    return cached_build(out, _request(size_mb, seed), build, f"benchmark checkpoint ({WORLD_SIZE} ranks, fp32)", quiet)


def main(argv: list[str] | None = None) -> int:
    ap = generator_args(__doc__.split("\n\n")[0], out_help="output DCP dir (default .bench/ckpt_<size>)",
                        size_help="total tensor bytes in MiB (default 1536)", seed=True)
    args = ap.parse_args(argv)
    return generate(args.out or default_ckpt_path(args.size_mb), args.force,
                    lambda out: ensure_checkpoint(out, args.size_mb, args.seed))


if __name__ == "__main__":
    sys.exit(main())
