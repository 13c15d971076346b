"""Which weights ``--quantize`` stores quantized, decided for every scheme alike before a byte
is written, and the export's catalog once they are.

A weight is quantized when it is a floating 2-D ``.weight`` of an ``nn.Linear`` module of the
model the config describes (transformers' and vLLM's quantizers replace those only: GPT-2's
``Conv1D`` is not one), not an embedding, the output head, a norm or a router gate (which every
shipped quantized model keeps in the compute dtype), not named by ``--keep-dtype``, and of a
shape the scheme writes the same way for every reader (``Scheme.refuses``). The others stay as
they are and the scheme's config lists their modules, so a reader does not expect scales for
them; a head tied to the embeddings (written once, as the embeddings) is listed too.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from reshard.core import dtypes
from reshard.core.catalog import Catalog, TensorEntry
from reshard.core.errors import UsageError, option
from reshard.core.sizes import preview
from reshard.features.architecture import model_facts
from reshard.features.quantize.registry import scheme_named
from reshard.features.quantize.scheme import Weight

__all__ = ["quantizes", "quantized"]

_HEADS = ("lm_head", "embed_out")
_HEAD_WEIGHT = "lm_head.weight"
_NOT_LINEAR = "modules that are not nn.Linear"
# The weights serving engines fuse into one matrix (vLLM's QKVParallelLinear, MergedColumnParallelLinear):
# a scale over the whole matrix (NVFP4's global scale) is shared by them. llm-compressor fuses the same sets.
_FUSED = (re.compile(r"^(.+\.(?:attn|attention|self_attn|self_attention))\.(q_proj|k_proj|v_proj)\.weight$"),
          re.compile(r"^(.+\.(?:attn|attention|self_attn))\.(wq_a|wkv_a_with_mqa)\.weight$"),
          re.compile(r"^(.+\.(?:mlp|feed_forward))\.(gate_proj|up_proj)\.weight$"),
          re.compile(r"^(.+)\.(w1|w3)\.weight$"))


def _excluded(module: str) -> str | None:
    """Why ``module`` is not quantized whatever its shape, or None."""
    last = module.rpartition(".")[2].lower()
    if "embed" in last or last in ("wte", "wpe"):
        return "embeddings"
    if last in _HEADS:
        return "output head"
    if "norm" in last or last.startswith("ln"):
        return "norms"
    if last == "gate" or last.endswith("_gate") or "router" in last:
        return "router gates"
    return None


def quantizes(name: str, entry: TensorEntry) -> bool:
    """Whether ``--quantize`` could store ``name``: a floating 2-D ``.weight`` of a module that
    is no embedding, head, norm or router gate (the scheme and the model decide the rest)."""
    return (name.endswith(".weight") and len(entry.shape) == 2 and entry.dtype.is_floating_point
            and _excluded(name.removesuffix(".weight")) is None)


def _partners(names: list[str]) -> dict[str, tuple[str, ...]]:
    """Each name's fused set among ``names`` (itself included), by ``_FUSED``."""
    sets: dict[tuple[int, str], list[str]] = {}
    for name in names:
        for i, pattern in enumerate(_FUSED):
            if (m := pattern.match(name)) is not None:
                sets.setdefault((i, m.group(1)), []).append(name)
                break
    return {n: tuple(group) for group in sets.values() for n in group}


def quantized(catalog: Catalog, scheme: str, keep: Callable[[str], bool] = lambda name: False,
              dtype: dtypes.DType | None = None) -> Catalog:
    """``catalog`` (as ``export_catalog`` leaves it, config in its facts) with every weight this
    module's rules choose replaced by ``scheme``'s tensors, and the config's
    ``quantization_config`` saying so; ``dtype``: what ``--dtype`` casts the weights to."""
    found = scheme_named(scheme)
    config = catalog.facts.hf_config
    if not isinstance(config, dict):
        raise UsageError(f"{option(f'--quantize {scheme}', 'quantize=')} writes its scheme into config.json; "
                         f"{option('--weights-only', 'weights_only=True')} writes none, so nothing could read the weights")
    facts = model_facts(config)
    linear = facts.linear if facts else {}  # a module the model lacks (or no model built): by its name alone
    chosen: list[str] = []
    left: dict[str, list[str]] = {}  # why -> names of floating weights left unquantized
    for name, entry in catalog.tensors.items():
        module = name.removesuffix(".weight")
        if not quantizes(name, entry):
            why = _excluded(module)
            if why is not None and name.endswith(".weight") and entry.dtype.is_floating_point:
                left.setdefault(why, []).append(name)
            continue
        why = ("--keep-dtype" if keep(name) else _NOT_LINEAR if linear.get(module, True) is False
               else found.refuses(name, entry.shape))
        if why is not None:
            left.setdefault(why, []).append(name)
        else:
            chosen.append(name)
    partial = [why for why in left if why not in ("--keep-dtype", _NOT_LINEAR, "embeddings", "output head", "norms",
                                                  "router gates")]  # what the scheme's refuses() said
    if not chosen and not partial:
        other = (f"; {len(left[_NOT_LINEAR])} 2-D weights belong to modules that are not nn.Linear (such as GPT-2's "
                 "Conv1D), which transformers' quantizers leave alone") if _NOT_LINEAR in left else ""
        raise UsageError(f"{catalog.path}: {option(f'--quantize {scheme}', 'quantize=')} found no nn.Linear weight to "
                         f"quantize (embeddings, the head, norms and router gates stay as they are{other})")
    tensors: dict[str, TensorEntry] = {}
    partners = _partners(chosen)
    picked = set(chosen)
    shared: dict[Any, Any] = {}  # what a scheme computes once per fused set (Weight.shared)
    for name, entry in catalog.tensors.items():  # in the catalog's order, each weight's scales after it
        if name not in picked:
            tensors[name] = entry
            continue
        weight = Weight(name, entry, dtype or entry.dtype,
                        tuple(catalog.tensors[p] for p in partners.get(name, (name,))), shared)
        written = found.tensors(weight)
        for out in written:
            if out != name and out in catalog.tensors:
                raise UsageError(f"{catalog.path}: {name} would be quantized, but the checkpoint already holds {out}")
        tensors.update(written)
    skipped = {n: catalog.tensors[n].shape for names in left.values() for n in names}
    if _HEAD_WEIGHT not in tensors:  # tied to the embeddings (the export wrote it once, as save_pretrained does)
        skipped[_HEAD_WEIGHT] = ()  # a quantizer would otherwise make a quantized head and want its scales
    qc = found.config(skipped, len(chosen))
    known = catalog.facts.but(hf_config={**config, "quantization_config": qc})
    kept = "; ".join(f"{why} {len(names)}" for why, names in left.items())
    if partial and found.partial_note:  # a model whose dims are not multiples of the block may have no weight left
        kept += f" ({found.partial_note})"
    notice = (f"quantized {len(chosen)} linear weights to {found.done}; left in the compute dtype: {kept or 'none'} "
              f"(quantization_config.{found.skipped_key}: {preview(qc[found.skipped_key])})")
    return replace(catalog, tensors=tensors, facts=known, notices=[*catalog.notices, notice])
