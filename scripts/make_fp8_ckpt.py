#!/usr/bin/env python
"""Make a synthetic DeepSeek-V3-style FP8 HF folder (block-quantized weights) for benchmarks.

Laid out as DeepSeek publishes V3/R1, at a smaller size: every Linear weight of the decoder
layers is ``float8_e4m3fn`` with a float32 ``weight_scale_inv`` per 128x128 block (the edge
blocks partial: most shapes are not multiples of 128), the router, norms, embeddings and head
are bf16, ``e_score_correction_bias`` float32; ``config.json`` is transformers'
``DeepseekV3Config`` plus ``quantization_config`` ``{"quant_method": "fp8",
"weight_block_size": [128, 128]}``; the tensors are split over ~256 MiB
``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``.

Layer 0 is dense (``first_k_dense_replace = 1``), the others MoE with per-expert tensors
(``mlp.experts.{e}.{gate,up,down}_proj``) and one shared expert; the number of layers is
solved from ``--size-mb`` (bytes on disk). Streamed: the shards are planned from the shapes
first, then each is generated, quantized and written on its own, so the process holds one
shard at a time. Cached like the other generators' outputs (``<out>.marker.json``).

    python scripts/make_fp8_ckpt.py --size-mb 1536         # .bench/fp8_1536
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_bench_ckpt import REPO, cached_build, generate, generator_args  # noqa: E402

__all__ = ["Fp8Dims", "solve_fp8_dims", "fp8_tensors", "plan_shards", "ensure_fp8_checkpoint", "default_fp8_path"]

GENERATOR_VERSION = 1
BLOCK = 128
SHARD_BYTES = 256 * 2**20
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
ITEMSIZE = {"fp8": 1, "bf16": 2, "f32": 4}


@dataclass(frozen=True)
class Fp8Dims:
    hidden: int
    heads: int
    q_lora: int
    kv_lora: int
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim
    v: int  # v_head_dim
    ffn: int  # intermediate_size (the dense layer)
    moe_ffn: int
    experts: int
    vocab: int
    layers: int


# The benchmark's proportions (hidden 1500: not a multiple of 128), and a tiny one for tests.
_BENCH = Fp8Dims(1500, 12, 600, 300, 64, 32, 64, 4000, 700, 32, 12000, 2)
_TINY = Fp8Dims(200, 4, 96, 64, 16, 8, 16, 300, 72, 4, 300, 2)


def fp8_tensors(d: Fp8Dims) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor, in order; kind "fp8" is a quantized Linear weight
    (its ``weight_scale_inv`` is listed right after it, as "f32")."""
    out: list[tuple[str, tuple[int, ...], str]] = []

    def linear(name: str, rows: int, cols: int) -> None:
        out.append((f"{name}.weight", (rows, cols), "fp8"))
        out.append((f"{name}.weight_scale_inv", (-(-rows // BLOCK), -(-cols // BLOCK)), "f32"))

    def mlp(prefix: str, ffn: int) -> None:
        linear(f"{prefix}.gate_proj", ffn, d.hidden)
        linear(f"{prefix}.up_proj", ffn, d.hidden)
        linear(f"{prefix}.down_proj", d.hidden, ffn)

    out.append(("model.embed_tokens.weight", (d.vocab, d.hidden), "bf16"))
    for i in range(d.layers):
        p = f"model.layers.{i}"
        out.append((f"{p}.input_layernorm.weight", (d.hidden,), "bf16"))
        linear(f"{p}.self_attn.q_a_proj", d.q_lora, d.hidden)
        out.append((f"{p}.self_attn.q_a_layernorm.weight", (d.q_lora,), "bf16"))
        linear(f"{p}.self_attn.q_b_proj", d.heads * (d.nope + d.rope), d.q_lora)
        linear(f"{p}.self_attn.kv_a_proj_with_mqa", d.kv_lora + d.rope, d.hidden)
        out.append((f"{p}.self_attn.kv_a_layernorm.weight", (d.kv_lora,), "bf16"))
        linear(f"{p}.self_attn.kv_b_proj", d.heads * (d.nope + d.v), d.kv_lora)
        linear(f"{p}.self_attn.o_proj", d.hidden, d.heads * d.v)
        out.append((f"{p}.post_attention_layernorm.weight", (d.hidden,), "bf16"))
        if i == 0:
            mlp(f"{p}.mlp", d.ffn)
            continue
        out.append((f"{p}.mlp.gate.weight", (d.experts, d.hidden), "bf16"))
        out.append((f"{p}.mlp.gate.e_score_correction_bias", (d.experts,), "f32"))
        for e in range(d.experts):
            mlp(f"{p}.mlp.experts.{e}", d.moe_ffn)
        mlp(f"{p}.mlp.shared_experts", d.moe_ffn)
    out.append(("model.norm.weight", (d.hidden,), "bf16"))
    out.append(("lm_head.weight", (d.vocab, d.hidden), "bf16"))
    return out


def total_bytes(d: Fp8Dims) -> int:
    return sum(ITEMSIZE[kind] * math.prod(shape) for _, shape, kind in fp8_tensors(d))


def solve_fp8_dims(size_mb: float) -> Fp8Dims:
    """The benchmark proportions (the tiny ones below 64 MiB) with the number of layers (at
    least 2: one dense, one MoE) whose folder is closest to ``size_mb`` MiB."""
    target = size_mb * 2**20
    base = _TINY if size_mb < 64 else _BENCH
    layers = 2
    while total_bytes(replace(base, layers=layers + 1)) <= target:
        layers += 1
    lo, hi = replace(base, layers=layers), replace(base, layers=layers + 1)
    return lo if target - total_bytes(lo) <= total_bytes(hi) - target else hi


def plan_shards(tensors: list[tuple[str, tuple[int, ...], str]], max_bytes: int = SHARD_BYTES) -> list[list[int]]:
    """Indices of ``tensors`` per shard, in order, each shard at most ``max_bytes`` unless one
    tensor alone is larger; a weight and its scale always share a shard."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (name, shape, kind) in enumerate(tensors):
        n = ITEMSIZE[kind] * math.prod(shape)
        starts_group = not name.endswith("_scale_inv")
        if starts_group and shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    return shards


def quantize(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, float32 scale per ``block`` x ``block`` tile) with values * scale ~= w."""
    import torch

    r, c = w.shape
    nr, nc = -(-r // block), -(-c // block)
    padded = torch.zeros(nr * block, nc * block)
    padded[:r, :c] = w
    tiles = padded.view(nr, block, nc, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    tiles.div_(scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    return padded[:r, :c].to(torch.float8_e4m3fn), scale


def config(d: Fp8Dims) -> dict:
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=d.vocab, hidden_size=d.hidden, intermediate_size=d.ffn, moe_intermediate_size=d.moe_ffn,
        num_hidden_layers=d.layers, num_attention_heads=d.heads, num_key_value_heads=d.heads, n_shared_experts=1,
        n_routed_experts=d.experts, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=d.q_lora,
        kv_lora_rank=d.kv_lora, qk_nope_head_dim=d.nope, qk_rope_head_dim=d.rope, v_head_dim=d.v, n_group=1,
        topk_group=1, max_position_embeddings=4096, tie_word_embeddings=False,
    ).to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [BLOCK, BLOCK]}
    return cfg


def _write(folder: Path, d: Fp8Dims, seed: int) -> dict:
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    folder.mkdir(parents=True)
    tensors = fp8_tensors(d)
    shards = plan_shards(tensors)
    weight_map: dict[str, str] = {}
    for s, indices in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        out: dict[str, torch.Tensor] = {}
        for i in indices:
            name, shape, kind = tensors[i]
            if kind == "f32" and name.endswith("_scale_inv"):
                continue  # made with its weight
            gen = torch.Generator().manual_seed(seed * 100_003 + i)  # per tensor: independent of the sharding
            if kind == "fp8":
                out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = quantize(
                    torch.randn(shape, generator=gen).mul_(0.02))
            elif name.endswith("norm.weight"):
                out[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                out[name] = torch.randn(shape, generator=gen).mul_(0.02).to(torch.bfloat16 if kind == "bf16" else
                                                                         torch.float32)
        save_file(out, str(folder / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(out, fname)
    index = {"metadata": {"total_size": total_bytes(d)}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(config(d), indent=2) + "\n")
    fp8 = sum(math.prod(shape) for _, shape, kind in tensors if kind == "fp8")
    return {"dims": asdict(d), "tensor_bytes": total_bytes(d), "fp8_weights": sum(k == "fp8" for *_, k in tensors),
            "fp8_bytes": fp8, "shards": len(shards)}


def default_fp8_path(size_mb: float) -> Path:
    return REPO / ".bench" / f"fp8_{size_mb:g}"


def ensure_fp8_checkpoint(out: Path, size_mb: float, seed: int = 0, quiet: bool = False) -> Path:
    """Return ``out`` holding the FP8 folder for ``size_mb``, making it unless cached."""
    dims = solve_fp8_dims(size_mb)
    request = {"size_mb": size_mb, "seed": seed, "version": GENERATOR_VERSION}
    what = f"DeepSeek-style FP8 folder ({dims.layers} layers, hidden {dims.hidden})"
    return cached_build(out, request, lambda tmp: _write(tmp, dims, seed), what, quiet)


def main(argv: list[str] | None = None) -> int:
    ap = generator_args(__doc__.split("\n\n")[0], out_help="output folder (default .bench/fp8_<size>)",
                        size_help="bytes on disk in MiB (default 1536)", seed=True)
    args = ap.parse_args(argv)
    return generate(args.out or default_fp8_path(args.size_mb), args.force,
                    lambda out: ensure_fp8_checkpoint(out, args.size_mb, args.seed))


if __name__ == "__main__":
    sys.exit(main())
