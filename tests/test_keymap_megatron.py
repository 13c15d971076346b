"""Grouped splits (Megatron's per-query-group QKV) as key-map rules, and the megatron-to-hf table.

The real-checkpoint checks live in tests/formats/test_megatron.py; here the rule itself: its
chunks are views of the stored ones (nothing read), its inverse glues the parts back group by
group, bit for bit, and a stacked layer dim unstacks before the table renames.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import reshard
from reshard.core.boxes import full_box
from reshard.core.chunk_reads import read_box
from reshard.core.errors import UsageError
from reshard.core.regions import as_region
from reshard.features.keymap.maps import KeyMap, Split
from reshard.features.keymap.megatron import MegatronToHF
from reshard.features.keymap.patterns import Pattern, Replacement

HEADS, GROUPS, HD, DIM = 6, 2, 4, 5


def _read(cat: reshard.Catalog, name: str) -> torch.Tensor:
    return read_box(cat.tensors[name], full_box(cat.tensors[name].shape))


def _grouped() -> KeyMap:
    parts = tuple(Replacement(rf"l\1.{p}") for p in ("q", "k", "v"))
    return KeyMap((Split(Pattern(r"l(\d+)\.qkv"), parts, ("n_heads", "n_kv_heads", "n_kv_heads"), groups="n_kv_heads"),),
                  params={"n_heads": HEADS, "n_kv_heads": GROUPS})


def test_grouped_split_and_its_inverse_are_exact(tmp_path: Path) -> None:
    per = HEADS // GROUPS
    fused = torch.randn(GROUPS, per + 2, HD, DIM)  # [g: q heads of the group, k, v]
    save_file({"l0.qkv": fused.reshape(-1, DIM).contiguous()}, tmp_path / "a.safetensors")
    cat = reshard.inspect(tmp_path / "a.safetensors")
    out = _grouped().apply(cat)
    q, k, v = _read(out, "l0.q"), _read(out, "l0.k"), _read(out, "l0.v")
    assert torch.equal(q, fused[:, :per].reshape(-1, DIM))
    assert torch.equal(k, fused[:, per].reshape(-1, DIM)) and torch.equal(v, fused[:, per + 1].reshape(-1, DIM))
    # One chunk per group and part, each still the stored bytes (the engine can copy them as they are).
    assert len(out.tensors["l0.q"].chunks) == GROUPS and all(as_region(c.data) for c in out.tensors["l0.q"].chunks)
    back = _grouped().inverse().apply(out)
    assert list(back.tensors) == ["l0.qkv"] and torch.equal(_read(back, "l0.qkv"), fused.reshape(-1, DIM))
    odd = Split(Pattern(r"l(\d+)\.qkv"), (Replacement("q"), Replacement("k"), Replacement("v")), (6, 2, 2), groups=3)
    with pytest.raises(UsageError, match=r"parts of sizes \[24, 8, 8\] along dim 0 do not interleave in 3 groups"):
        KeyMap((odd,)).apply(cat)


def test_megatron_names_unstack_then_map_to_hf(tmp_path: Path) -> None:
    layers = 3
    stacked = {
        "embedding.word_embeddings.weight": torch.randn(7, DIM),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": torch.randn(layers, DIM),
        "decoder.layers.mlp.linear_fc1.weight": torch.randn(layers, 8, DIM),
        "decoder.final_layernorm.weight": torch.randn(DIM),
        "output_layer.weight": torch.randn(7, DIM),
    }
    save_file(stacked, tmp_path / "m.safetensors")
    out = MegatronToHF().apply(reshard.inspect(tmp_path / "m.safetensors"))
    assert sorted(out.tensors) == sorted(
        ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        + [f"model.layers.{i}.{n}" for i in range(layers)
           for n in ("input_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight")])
    fc1 = stacked["decoder.layers.mlp.linear_fc1.weight"]
    assert torch.equal(_read(out, "model.layers.2.mlp.gate_proj.weight"), fc1[2, :4])
    assert torch.equal(_read(out, "model.layers.1.mlp.up_proj.weight"), fc1[1, 4:])
    assert torch.equal(_read(out, "model.layers.1.input_layernorm.weight"),
                       stacked["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][1])
    assert MegatronToHF().map_name("decoder.layers.3.self_attention.linear_proj.weight") == [
        "model.layers.3.self_attn.o_proj.weight"]
    with pytest.raises(UsageError, match="no inverse"):
        MegatronToHF().inverse()
