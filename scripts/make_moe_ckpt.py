#!/usr/bin/env python
"""Make a synthetic torchtitan-layout Qwen3-MoE DCP checkpoint, and the config.json that goes with it.

Written like ``make_bench_ckpt``'s (a 4-rank gloo world, every rank holding only its
``Shard(0)`` pieces and calling ``dcp.save``), with torchtitan's names for a qwen3 MoE model,
model tensors at the top level (as torchtitan's ``CheckpointManager`` flattens them) and its
``train_state`` / ``lr_scheduler`` sections::

    tok_embeddings.weight                          (vocab, dim)
    layers.{i}.attention.{wq,wk,wv,wo}.weight      (heads*hd | kv*hd, dim) / (dim, heads*hd)
    layers.{i}.attention.{q_norm,k_norm}.weight    (hd,)
    layers.{i}.{attention_norm,ffn_norm}.weight    (dim,)
    layers.{i}.moe.router.gate.weight              (experts, dim)
    layers.{i}.moe.experts.w1 / w3                 (experts, ffn, dim)   grouped experts
    layers.{i}.moe.experts.w2                      (experts, dim, ffn)
    norm.weight, output.weight

fp32 model tensors only (an export to HF reads nothing else). The number of experts is solved
from ``--size-mb``; with one layer (the default) each grouped expert tensor is about a third
of the checkpoint, so at the benchmark's 1.5 GB an expert slab (~450 MiB) is larger than a
256 MiB ``--max-memory``: an export that held a whole slab would show it.

``<out>.config/config.json`` beside the checkpoint is the transformers ``Qwen3MoeConfig`` of
the same model (``--config`` of ``reshard convert --to hf``). Cached like the other
generators' outputs (``<out>.marker.json``).

    python scripts/make_moe_ckpt.py --size-mb 1536         # .bench/moe_1536 and .bench/moe_1536.config
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_bench_ckpt import REPO, WORLD_SIZE, SavedTensor, cached_build, generate, generator_args, marker_path, save_world  # noqa: E402

__all__ = ["MoeDims", "solve_moe_dims", "moe_shapes", "moe_config", "ensure_moe_checkpoint", "default_moe_path"]

GENERATOR_VERSION = 1
HEAD_DIM = 64
N_LAYERS = 1


@dataclass(frozen=True)
class MoeDims:
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn: int  # moe_intermediate_size
    vocab: int
    experts: int
    n_layers: int


def _dims_for(dim: int, experts: int, n_layers: int) -> MoeDims:
    heads = max(1, dim // HEAD_DIM)
    return MoeDims(dim, heads, max(1, heads // 4), 3 * dim // 2, 16 * dim, experts, n_layers)


def moe_shapes(d: MoeDims) -> dict[str, tuple[int, ...]]:
    """torchtitan (<= 0.2) names of a qwen3 MoE model and their global shapes, in order."""
    q, kv = d.n_heads * HEAD_DIM, d.n_kv_heads * HEAD_DIM
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (d.vocab, d.dim)}
    for i in range(d.n_layers):
        p = f"layers.{i}"
        shapes |= {
            f"{p}.attention.wq.weight": (q, d.dim), f"{p}.attention.wk.weight": (kv, d.dim),
            f"{p}.attention.wv.weight": (kv, d.dim), f"{p}.attention.wo.weight": (d.dim, q),
            f"{p}.attention.q_norm.weight": (HEAD_DIM,), f"{p}.attention.k_norm.weight": (HEAD_DIM,),
            f"{p}.attention_norm.weight": (d.dim,), f"{p}.ffn_norm.weight": (d.dim,),
            f"{p}.moe.router.gate.weight": (d.experts, d.dim),
            f"{p}.moe.experts.w1": (d.experts, d.ffn, d.dim), f"{p}.moe.experts.w2": (d.experts, d.dim, d.ffn),
            f"{p}.moe.experts.w3": (d.experts, d.ffn, d.dim),
        }
    shapes["norm.weight"] = (d.dim,)
    shapes["output.weight"] = (d.vocab, d.dim)
    return shapes


def total_bytes(d: MoeDims) -> int:
    return 4 * sum(math.prod(s) for s in moe_shapes(d).values())


def solve_moe_dims(size_mb: float, n_layers: int = N_LAYERS) -> MoeDims:
    """``dim`` so the embeddings are at most a tenth of the checkpoint (64 to 1024), then the
    number of experts (a multiple of WORLD_SIZE) closest to ``size_mb`` MiB."""
    target = size_mb * 2**20
    dim = 64
    while dim < 1024 and 2 * 16 * (dim + 64) ** 2 * 4 <= target / 10:
        dim += 64
    best = None
    for experts in range(WORLD_SIZE, 100 * 1024 + 1, WORLD_SIZE):
        d = _dims_for(dim, experts, n_layers)
        if best is None or abs(total_bytes(d) - target) < abs(total_bytes(best) - target):
            best = d
        if total_bytes(d) > target:
            break
    assert best is not None
    return best


def moe_config(d: MoeDims) -> dict:
    """The transformers ``Qwen3MoeConfig`` of the same model, as config.json holds it."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": d.dim,
        "num_attention_heads": d.n_heads, "num_key_value_heads": d.n_kv_heads, "head_dim": HEAD_DIM,
        "num_hidden_layers": d.n_layers, "vocab_size": d.vocab, "num_experts": d.experts, "num_experts_per_tok": 2,
        "moe_intermediate_size": d.ffn, "intermediate_size": 3 * d.dim, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "float32",
    }


def default_moe_path(size_mb: float) -> Path:
    return REPO / ".bench" / f"moe_{size_mb:g}"


def config_dir(out: Path) -> Path:
    return out.with_name(out.name + ".config")


def ensure_moe_checkpoint(out: Path, size_mb: float, n_layers: int = N_LAYERS, seed: int = 0,
                          timeout: float = 3600.0, quiet: bool = False) -> Path:
    """Return ``out`` holding the MoE checkpoint (and ``<out>.config/config.json``), made unless cached."""
    dims = solve_moe_dims(size_mb, n_layers)
    out = Path(out).resolve()

    def build(tmp: Path) -> dict:
        spec = [SavedTensor((fqn,), shape, 0.02) for fqn, shape in moe_shapes(dims).items()]
        objects = {"train_state": {"step": 10}, "lr_scheduler": {"last_epoch": 10}}
        save_world(tmp, spec, objects, seed, timeout)
        cfg = config_dir(out)
        cfg.mkdir(parents=True, exist_ok=True)
        (cfg / "config.json").write_text(json.dumps(moe_config(dims), indent=2) + "\n")
        return {"dims": asdict(dims), "tensor_bytes": total_bytes(dims)}

    request = {"size_mb": size_mb, "layers": n_layers, "ranks": WORLD_SIZE, "seed": seed, "version": GENERATOR_VERSION}
    what = f"torchtitan MoE checkpoint ({dims.experts} experts, {n_layers} layer(s), fp32)"
    made = cached_build(out, request, build, what, quiet)
    if not (config_dir(made) / "config.json").is_file():  # removed by hand: rebuild both
        marker_path(made).unlink()
        return ensure_moe_checkpoint(out, size_mb, n_layers, seed, timeout, quiet)
    return made


def main(argv: list[str] | None = None) -> int:
    ap = generator_args(__doc__.split("\n\n")[0], out_help="output DCP dir (default .bench/moe_<size>)",
                        size_help="total tensor bytes in MiB (default 1536)")
    ap.add_argument("--layers", type=int, default=N_LAYERS, help=f"MoE layers (default {N_LAYERS})")
    args = ap.parse_args(argv)
    return generate(args.out or default_moe_path(args.size_mb), args.force,
                    lambda out: ensure_moe_checkpoint(out, args.size_mb, args.layers))


if __name__ == "__main__":
    sys.exit(main())
