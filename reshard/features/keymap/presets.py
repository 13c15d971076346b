"""The preset key maps, as tables: read them to see the whole mapping at a glance.

``{}`` stands for a number (a layer, an expert); everything else is literal. Inverse presets
(``hf-to-titan``, ``hf-fuse``) are not written here: ``reshard.features.keymap.maps`` derives them from these
tables.
"""

from __future__ import annotations

__all__ = ["TITAN_FAMILIES", "HF_FAMILY", "HF_UNFUSE", "WRAPPERS", "TitanRow"]

# One row: (torchtitan name, HF name, transform, torchtitan era).
#
# transform:
#   None              the tensor is renamed;
#   "rope:<param>"    renamed, and its rows permuted per head between torchtitan's interleaved
#                     RoPE pairs and HF's rotate-half order (<param> gives the head count);
#   "experts"         torchtitan keeps a MoE layer's experts in one grouped tensor
#                     [num_experts, ...]; HF keeps one tensor per expert, numbered by the HF
#                     name's last {} (the expert index);
#   "drop"            a buffer HF models do not have (HF name None): left out, with a notice.
# era: "v2" names of torchtitan <= 0.2 (and of this project's training model), "v3" names of
# torchtitan >= 0.3 (attention.qkv_linear.*, lm_head, routed_experts.inner_experts.*_EFD),
# "*" both. torchtitan -> HF accepts either; HF -> torchtitan writes one era's names.
TitanRow = tuple[str, str | None, str | None, str]

_ATTENTION_NORMS: tuple[TitanRow, ...] = (
    ("tok_embeddings.weight", "model.embed_tokens.weight", None, "*"),
    ("layers.{}.attention_norm.weight", "model.layers.{}.input_layernorm.weight", None, "*"),
    ("layers.{}.attention.wo.weight", "model.layers.{}.self_attn.o_proj.weight", None, "*"),
    ("layers.{}.ffn_norm.weight", "model.layers.{}.post_attention_layernorm.weight", None, "*"),
    ("norm.weight", "model.norm.weight", None, "*"),
    ("output.weight", "lm_head.weight", None, "v2"),
    ("lm_head.weight", "lm_head.weight", None, "v3"),
    ("freqs_cis", None, "drop", "*"),  # complex64 RoPE table, persisted by some torchtitan versions
)

_DENSE_FFN: tuple[TitanRow, ...] = (
    ("layers.{}.feed_forward.w1.weight", "model.layers.{}.mlp.gate_proj.weight", None, "*"),
    ("layers.{}.feed_forward.w3.weight", "model.layers.{}.mlp.up_proj.weight", None, "*"),
    ("layers.{}.feed_forward.w2.weight", "model.layers.{}.mlp.down_proj.weight", None, "*"),
)


def _qkv(rope: bool) -> tuple[TitanRow, ...]:
    """q/k/v in both eras; torchtitan's llama3 rotates interleaved pairs (rows permuted for
    HF), its qwen3 and deepseek_v3 already use HF's order."""
    rows: list[TitanRow] = []
    for era, prefix in (("v2", "layers.{}.attention."), ("v3", "layers.{}.attention.qkv_linear.")):
        rows += [
            (prefix + "wq.weight", "model.layers.{}.self_attn.q_proj.weight", "rope:n_heads" if rope else None, era),
            (prefix + "wk.weight", "model.layers.{}.self_attn.k_proj.weight", "rope:n_kv_heads" if rope else None, era),
            (prefix + "wv.weight", "model.layers.{}.self_attn.v_proj.weight", None, era),
        ]
    return tuple(rows)


def _experts(hf_router: str) -> tuple[TitanRow, ...]:
    """Grouped experts [E, F, D] (w1, w3) and [E, D, F] (w2): expert e is HF's [F, D] / [D, F]."""
    rows: list[TitanRow] = []
    for era, w1, w2, w3 in (("v2", "moe.experts.w1", "moe.experts.w2", "moe.experts.w3"),
                            ("v3", "moe.routed_experts.inner_experts.w1_EFD", "moe.routed_experts.inner_experts.w2_EDF",
                             "moe.routed_experts.inner_experts.w3_EFD")):
        rows += [
            ("layers.{}." + w1, "model.layers.{}.mlp.experts.{}.gate_proj.weight", "experts", era),
            ("layers.{}." + w3, "model.layers.{}.mlp.experts.{}.up_proj.weight", "experts", era),
            ("layers.{}." + w2, "model.layers.{}.mlp.experts.{}.down_proj.weight", "experts", era),
        ]
    rows.append(("layers.{}.moe.router.gate.weight", hf_router, None, "*"))
    return tuple(rows)


_SHARED_EXPERTS: tuple[TitanRow, ...] = (
    ("layers.{}.moe.shared_experts.w1.weight", "model.layers.{}.mlp.shared_experts.gate_proj.weight", None, "*"),
    ("layers.{}.moe.shared_experts.w3.weight", "model.layers.{}.mlp.shared_experts.up_proj.weight", None, "*"),
    ("layers.{}.moe.shared_experts.w2.weight", "model.layers.{}.mlp.shared_experts.down_proj.weight", None, "*"),
)

# torchtitan model family -> its table (torchtitan's own state_dict_adapter.py, per model).
TITAN_FAMILIES: dict[str, tuple[TitanRow, ...]] = {
    "llama3": _ATTENTION_NORMS + _qkv(rope=True) + _DENSE_FFN,
    "qwen3": _ATTENTION_NORMS + _qkv(rope=False) + _DENSE_FFN + (
        ("layers.{}.attention.q_norm.weight", "model.layers.{}.self_attn.q_norm.weight", None, "*"),
        ("layers.{}.attention.k_norm.weight", "model.layers.{}.self_attn.k_norm.weight", None, "*"),
        # Load-balancing bias of torchtitan's router: HF's qwen3_moe has none.
        ("layers.{}.moe.expert_bias", None, "drop", "v2"),
        ("layers.{}.moe.expert_bias_E", None, "drop", "v3"),
    ) + _experts("model.layers.{}.mlp.gate.weight"),
    "deepseek_v3": _ATTENTION_NORMS + _DENSE_FFN + _SHARED_EXPERTS + (
        ("layers.{}.attention.wq.weight", "model.layers.{}.self_attn.q_proj.weight", None, "*"),
        ("layers.{}.attention.wq_a.weight", "model.layers.{}.self_attn.q_a_proj.weight", None, "*"),
        ("layers.{}.attention.q_norm.weight", "model.layers.{}.self_attn.q_a_layernorm.weight", None, "*"),
        ("layers.{}.attention.wq_b.weight", "model.layers.{}.self_attn.q_b_proj.weight", None, "*"),
        ("layers.{}.attention.wkv_a.weight", "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight", None, "*"),
        ("layers.{}.attention.kv_norm.weight", "model.layers.{}.self_attn.kv_a_layernorm.weight", None, "*"),
        ("layers.{}.attention.wkv_b.weight", "model.layers.{}.self_attn.kv_b_proj.weight", None, "*"),
        ("layers.{}.moe.expert_bias", "model.layers.{}.mlp.gate.e_score_correction_bias", None, "v2"),
        ("layers.{}.moe.expert_bias_E", "model.layers.{}.mlp.gate.e_score_correction_bias", None, "v3"),
    ) + _experts("model.layers.{}.mlp.gate.weight"),
}

# config.json ``model_type`` -> torchtitan family (torchtitan ships no llama4 model since 0.3).
HF_FAMILY: dict[str, str] = {
    "llama": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3", "deepseek_v3": "deepseek_v3",
}

# Fused projections (Phi-3 and others store q, k, v and gate, up as one tensor each) -> the
# separate Llama ones: (fused name, part names, relative sizes of the parts along dim 0).
# A size is a number or the parameter that gives it.
HF_UNFUSE: tuple[tuple[str, tuple[str, ...], tuple[int | str, ...]], ...] = (
    (
        "model.layers.{}.self_attn.qkv_proj.weight",
        ("model.layers.{}.self_attn.q_proj.weight", "model.layers.{}.self_attn.k_proj.weight",
         "model.layers.{}.self_attn.v_proj.weight"),
        ("n_heads", "n_kv_heads", "n_kv_heads"),
    ),
    (
        "model.layers.{}.mlp.gate_up_proj.weight",
        ("model.layers.{}.mlp.gate_proj.weight", "model.layers.{}.mlp.up_proj.weight"),
        (1, 1),
    ),
)

# Name segments that wrappers insert: (segment, removed anywhere in a name?). torch.compile's
# ``_orig_mod`` and FSDP1 / activation-checkpointing wrappers nest at any depth; DDP's and
# DataParallel's ``module`` is only ever the first segment (a real submodule may be called
# ``module`` deeper down).
WRAPPERS: tuple[tuple[str, bool], ...] = (
    ("_orig_mod", True),
    ("_fsdp_wrapped_module", True),
    ("_checkpoint_wrapped_module", True),
    ("module", False),
)

# The names ``load_keymap`` knows (``keymap.lookup.PRESETS`` builds each), here without imports
# so that ``--help`` can list them without loading torch.
PRESET_NAMES = ("titan-to-hf", "hf-to-titan", "hf-to-titan-0.3", "megatron-to-hf", "hf-unfuse", "hf-fuse",
                "strip-wrappers")
