"""The preset key maps, as tables: read them to see the whole mapping at a glance.

``{}`` stands for a layer number; everything else is literal. Inverse presets (``hf-to-titan``,
``hf-fuse``) are not written here: ``reshard.keymap`` derives them from these tables.
"""

from __future__ import annotations

__all__ = ["TITAN_TO_HF", "HF_UNFUSE", "WRAPPERS"]

# The project's training model (torchtitan names) -> transformers' LlamaForCausalLM.
# The third column marks the q/k projections: HF Llama orders each head's rows for
# rotate-half RoPE, the training model for interleaved pairs, so those rows are permuted;
# it names the parameter that gives the number of heads (grouped-query attention: k has
# n_kv_heads of them).
TITAN_TO_HF: tuple[tuple[str, str, str | None], ...] = (
    ("tok_embeddings.weight", "model.embed_tokens.weight", None),
    ("layers.{}.attention_norm.weight", "model.layers.{}.input_layernorm.weight", None),
    ("layers.{}.attention.wq.weight", "model.layers.{}.self_attn.q_proj.weight", "n_heads"),
    ("layers.{}.attention.wk.weight", "model.layers.{}.self_attn.k_proj.weight", "n_kv_heads"),
    ("layers.{}.attention.wv.weight", "model.layers.{}.self_attn.v_proj.weight", None),
    ("layers.{}.attention.wo.weight", "model.layers.{}.self_attn.o_proj.weight", None),
    ("layers.{}.ffn_norm.weight", "model.layers.{}.post_attention_layernorm.weight", None),
    ("layers.{}.feed_forward.w1.weight", "model.layers.{}.mlp.gate_proj.weight", None),
    ("layers.{}.feed_forward.w3.weight", "model.layers.{}.mlp.up_proj.weight", None),
    ("layers.{}.feed_forward.w2.weight", "model.layers.{}.mlp.down_proj.weight", None),
    ("norm.weight", "model.norm.weight", None),
    ("output.weight", "lm_head.weight", None),
)

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
