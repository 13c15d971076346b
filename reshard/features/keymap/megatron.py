"""``megatron-to-hf``: Megatron-Core GPT names (Llama-style: RMSNorm, SwiGLU, RoPE, GQA) to HF's.

Two steps, each a plain ``KeyMap``:

1. ``decoder.layers.<module>`` tensors that ``torch_dist`` stores stacked along a leading
   layer dim become one tensor per layer, ``decoder.layers.<i>.<module>`` (``Unstack``: box
   arithmetic on the stored chunks, nothing read);
2. the table below renames each layer's tensors; the fused ``linear_qkv`` is cut into
   ``q_proj``, ``k_proj``, ``v_proj`` per query group (Megatron interleaves them:
   ``[g0: q heads, k, v | g1: ...]``), ``linear_fc1`` into ``gate_proj`` and ``up_proj``.

Megatron's RoPE (``rotary_interleaved=False``, the default) already rotates half against half
as HF does: no row permutation. Head counts come from ``--config`` (``num_attention_heads``,
``num_key_value_heads``) or, failing that, from the ``args`` Megatron-LM saves. Optimizer state
follows its parameter. A model tensor the table does not know (MoE experts, MTP layers) is an
error, not an export with Megatron names transformers would ignore.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from reshard.core.catalog import Catalog
from reshard.core.conventions import PARAM, detect_layout
from reshard.core.errors import ReshardError, UsageError
from reshard.features.keymap.maps import Drop, KeyMap, Rename, Rule, Split, Unstack
from reshard.features.keymap.patterns import Pattern, Replacement, template
from reshard.features.provenance import model_params

__all__ = ["MEGATRON_GPT", "MegatronToHF", "megatron_to_hf", "megatron_heads"]

_Q, _K, _V = ("model.layers.{}.self_attn.q_proj", "model.layers.{}.self_attn.k_proj", "model.layers.{}.self_attn.v_proj")

# (Megatron name, HF name(s) or None: dropped, transform). transform: None renames; "qkv" splits
# the fused projection per query group into (q, k, v); "gate_up" splits linear_fc1 in halves.
MEGATRON_GPT: tuple[tuple[str, str | tuple[str, ...] | None, str | None], ...] = (
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight", None),
    ("output_layer.weight", "lm_head.weight", None),
    ("decoder.final_layernorm.weight", "model.norm.weight", None),
    # Input norm: TransformerEngine fuses it into linear_qkv; the local spec keeps it apart.
    ("decoder.layers.{}.self_attention.linear_qkv.layer_norm_weight", "model.layers.{}.input_layernorm.weight", None),
    ("decoder.layers.{}.input_layernorm.weight", "model.layers.{}.input_layernorm.weight", None),
    ("decoder.layers.{}.self_attention.linear_qkv.weight", (_Q + ".weight", _K + ".weight", _V + ".weight"), "qkv"),
    ("decoder.layers.{}.self_attention.linear_qkv.bias", (_Q + ".bias", _K + ".bias", _V + ".bias"), "qkv"),
    ("decoder.layers.{}.self_attention.linear_proj.weight", "model.layers.{}.self_attn.o_proj.weight", None),
    ("decoder.layers.{}.self_attention.q_layernorm.weight", "model.layers.{}.self_attn.q_norm.weight", None),
    ("decoder.layers.{}.self_attention.k_layernorm.weight", "model.layers.{}.self_attn.k_norm.weight", None),
    ("decoder.layers.{}.mlp.linear_fc1.layer_norm_weight", "model.layers.{}.post_attention_layernorm.weight", None),
    ("decoder.layers.{}.pre_mlp_layernorm.weight", "model.layers.{}.post_attention_layernorm.weight", None),
    ("decoder.layers.{}.mlp.linear_fc1.weight", ("model.layers.{}.mlp.gate_proj.weight",
                                                 "model.layers.{}.mlp.up_proj.weight"), "gate_up"),
    ("decoder.layers.{}.mlp.linear_fc2.weight", "model.layers.{}.mlp.down_proj.weight", None),
    ("rotary_pos_emb.inv_freq", None, None),  # a buffer some versions persist; HF derives it
)

# A stacked layer tensor: ``decoder.layers.`` followed by a module name, not a layer number.
_STACKED = Unstack(Pattern(r"decoder\.layers\.([A-Za-z_][A-Za-z0-9_.]*)"), Replacement(r"decoder.layers.\2.\1"),
                   Replacement(r"decoder.layers.\1"))
_MEGATRON_PREFIXES = ("embedding.", "decoder.", "output_layer.", "rotary_pos_emb.", "mtp.")


def megatron_heads(catalog: Catalog) -> dict[str, int]:
    """Head counts from the ``args`` Megatron-LM saves (``n_heads``, ``n_kv_heads``); empty
    when there are none or they cannot be read."""
    try:
        args = catalog.objects["args"] if "args" in catalog.objects else None
    except ReshardError:  # args holding a class nobody allowed: no head counts from here
        return {}
    heads = getattr(args, "num_attention_heads", None)
    if not isinstance(heads, int):
        return {}
    groups = getattr(args, "num_query_groups", None)
    gqa = getattr(args, "group_query_attention", isinstance(groups, int))
    return {"n_heads": heads, "n_kv_heads": groups if gqa and isinstance(groups, int) else heads}


@dataclass(frozen=True)
class _WithArgs(KeyMap):
    """A key map whose head counts may also come from the ``args`` Megatron-LM saved."""

    def param(self, name: str, catalog: Catalog, found: dict[str, int]) -> int:
        if name not in self.params and name not in found:
            found.update({**megatron_heads(catalog), **model_params(catalog)})
        return super().param(name, catalog, found)


def _table() -> KeyMap:
    rules: list[Rule] = []
    for megatron, hf, transform in MEGATRON_GPT:
        pattern, _ = template(megatron)
        if hf is None:
            rules.append(Drop(pattern))
        elif transform == "qkv":
            parts = tuple(template(p)[1] for p in hf)
            rules.append(Split(pattern, parts, ("n_heads", "n_kv_heads", "n_kv_heads"), groups="n_kv_heads"))
        elif transform == "gate_up":
            rules.append(Split(pattern, tuple(template(p)[1] for p in hf), (1, 1)))
        else:
            rules.append(Rename(pattern, template(str(hf))[1]))
    return _WithArgs(tuple(rules), name="megatron-to-hf")


@dataclass(frozen=True)
class MegatronToHF:
    """The two steps as one map (``--keymap megatron-to-hf``)."""

    name: str = "megatron-to-hf"

    def apply(self, catalog: Catalog) -> Catalog:
        out = _table().apply(KeyMap((_STACKED,), name=self.name).apply(catalog))
        layout = detect_layout(out)
        left = [n for n in out.tensors if (p := layout.place(n)).role == PARAM and p.fqn
                and p.fqn.startswith(_MEGATRON_PREFIXES)]
        if left:
            raise UsageError(f"{catalog.path}: megatron-to-hf has no HF name for {left[0]!r}"
                             + (f" and {len(left) - 1} more" if len(left) > 1 else "")
                             + "; it maps dense GPT/Llama models (give a JSON key map for others)")
        return replace(out, facts=out.facts.but(hf_keymap=None))  # applied: not again on --to hf

    def map_name(self, fqn: str) -> list[str]:
        """HF name(s) of one unstacked Megatron name (``decoder.layers.3.mlp.linear_fc2.weight``)."""
        return _table().map_name(fqn)

    def inverse(self) -> KeyMap:
        raise UsageError("megatron-to-hf has no inverse preset: reshard reads Megatron checkpoints, it does not write them")


def megatron_to_hf() -> MegatronToHF:
    return MegatronToHF()
