"""Quantized HF folders for the dequantization tests, saved with safetensors' own ``save_file``:

* a tiny DeepSeek-V3 (written by transformers, then its Linear weights re-saved as DeepSeek
  ships them: float8_e4m3fn + float32 ``weight_scale_inv`` per 128x128 block, edge blocks
  partial, ``quant_method: fp8``);
* gpt-oss MXFP4 experts (``*_blocks`` / ``*_scales`` bytes, ``quant_method: mxfp4``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["FP8_MAX", "fp8_block_quantize", "block_reference", "save_fp8_deepseek", "mxfp4_bytes", "save_mxfp4_gpt_oss"]

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
# Linear weights DeepSeek-V3 keeps in bf16: the router, embeddings, head, norms.
_KEPT = ("mlp.gate.weight", "embed_tokens.weight", "lm_head.weight", "norm.weight", "layernorm.weight")


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 values, float32 scale per block) with ``values * scale ~= w``; edge blocks partial."""
    (bo, bi), (r, c) = block, w.shape
    nr, nc = -(-r // bo), -(-c // bi)
    padded = torch.zeros(nr * bo, nc * bi)
    padded[:r, :c] = w.float()
    tiles = padded.view(nr, bo, nc, bi)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nr * bo, nc * bi)[:r, :c].contiguous(), scale


def block_reference(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` with the scale repeated over each block and cut at the edges, then cast."""
    r, c = q.shape[-2:]
    full = scale.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :r, :c]
    return (q.float() * full).to(dtype)


def deepseek_config() -> dict:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=300, hidden_size=200, intermediate_size=300, moe_intermediate_size=72,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                            n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=96,
                            kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=1,
                            topk_group=1, max_position_embeddings=64).to_dict()


def save_fp8_deepseek(folder: Path) -> Path:
    """A tiny ``DeepseekV3ForCausalLM`` as DeepSeek publishes V3: every Linear weight of the
    layers in FP8 with ``weight_scale_inv`` (300x200, 200x300: partial edge blocks; 96x96: less
    than one block), the rest bf16, ``quantization_config`` in config.json."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(deepseek_config()))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.to(torch.bfloat16).save_pretrained(folder)
    plain = load_file(folder / "model.safetensors")
    tensors: dict[str, torch.Tensor] = {}
    for name, t in plain.items():
        if t.ndim == 2 and name.endswith(".weight") and ".layers." in name and not name.endswith(_KEPT):
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = fp8_block_quantize(t)
        else:
            tensors[name] = t
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = FP8_CONFIG
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def mxfp4_bytes(shape: tuple[int, int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(blocks [E, out, in/32, 16], scales [E, out, in/32])`` for a ``[E, out, in]``
    expert weight: any nibbles, exponents 2**-10 .. 2**5 (a trained model's range)."""
    g = torch.Generator().manual_seed(seed)
    e, o, i = shape
    blocks = torch.randint(0, 256, (e, o, i // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(117, 133, (e, o, i // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def gpt_oss_config() -> dict:
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=131072, layer_types=["full_attention"]).to_dict()


def save_mxfp4_gpt_oss(folder: Path) -> Path:
    """A tiny ``GptOssForCausalLM`` whose experts are stored as gpt-oss ships them: MXFP4
    ``gate_up_proj_blocks`` [E, 2I, H/32, 16] and ``down_proj_blocks`` [E, H, I/32, 16] with
    their ``_scales``; biases, attention, router and embeddings bf16."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig.from_dict(gpt_oss_config())
    GptOssForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, i, o = tensors.pop(name).shape  # transformers keeps [E, in, out]; gpt-oss stores [E, out, in]
        tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4_bytes((e, o, i), seed=len(tensors))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder
