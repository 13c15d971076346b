"""``--to hf``, the core's step: the catalog an HF folder is written from.

An HF folder holds less than a training checkpoint, and under other names, so before the HF
writer (``formats/hf``, which only writes the folder's files) lays anything out:

* ``export_catalog`` keeps the model tensors only (optimizer and training state are dropped,
  with a notice), removes the checkpoint's model section (whatever its tool calls it), maps
  torchtitan names to HF names when it finds them (the ``titan-to-hf`` key map of the model's
  family: q/k permutation, grouped experts, buffers HF lacks; or the map its reader recorded,
  ``megatron-to-hf`` for Megatron-Core), finds the config (``--config``, carried from an HF
  source, or built from ``train.model_config``; none is an error), the tokenizer and other
  side files (``--hf-assets``, or the source folder), and writes tied embeddings once, the HF
  way: ``lm_head.weight`` is left out when ``tie_word_embeddings`` is set, after checking it
  equals the embedding.
* ``prepare_hf`` (the registry entry's ``prepare``) adds what is asked for serving: a LoRA
  adapter merged in (``reshard.features.lora``) and quantized weights (``reshard.features.quantize``).

``load_config`` reads ``--config`` (a file, a folder or a Hub repo id) for key maps too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.core.catalog import Catalog, TensorEntry
from reshard.core.conventions import OPTIM_GROUP, OPTIM_STATE, PARAM, Layout, detect_layout
from reshard.core.dtypes import parse_dtype
from reshard.core.errors import UnsupportedFormatError, UsageError
from reshard.core.facts import Facts
from reshard.core.json_file import read_json
from reshard.core.sizes import plural
from reshard.core.values import same_values
from reshard.features.architecture import ExportCheck
from reshard.features.hf_options import ARCHITECTURE_CHECK, HF_ASSETS, MERGE_LORA, WEIGHTS_ONLY
from reshard.features.hub import hub_files
from reshard.features.keymap.lookup import load_keymap
from reshard.features.keymap.maps import titan_family
from reshard.features.provenance import hf_configs, training_config
from reshard.features.quantize.options import QUANTIZE
from reshard.pipeline.plan import DtypeKeep

if TYPE_CHECKING:
    from reshard.formats.options import ConvertOptions
    from reshard.pipeline.plan import DtypeKeep

__all__ = ["export_catalog", "prepare_hf", "load_config", "find_assets", "read_json", "llama_config", "generation_config",
           "ASSET_FILES"]

# What an HF model folder holds beside its weights and config.json that users need to run
# the model: tokenizers (fast and sentencepiece), chat templates, generation defaults.
ASSET_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "spiece.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
    "generation_config.json", "preprocessor_config.json",
)
def load_config(spec: str | os.PathLike) -> dict[str, Any]:
    """``--config``: a config.json file, a folder holding one, or a Hub repo id (read from the
    local Hugging Face cache when offline)."""
    path = Path(spec)
    if path.is_file():
        return read_json(path, "config.json")
    if path.is_dir():
        return read_json(path / "config.json", "config.json")
    return read_json(hub_files(str(spec), ["config.json"], what="--config") / "config.json", "config.json")


def find_assets(spec: str | Path) -> dict[str, Path]:
    """``--hf-assets``: the tokenizer, chat template and generation files of a folder or Hub
    repo id (cache when offline), by name; an empty folder is an error, not a silent no-op."""
    folder = Path(spec)
    if not folder.is_dir():
        folder = hub_files(str(spec), list(ASSET_FILES), what="--hf-assets")
    found = {name: folder / name for name in ASSET_FILES if (folder / name).is_file()}
    if not found:
        raise UsageError(f"--hf-assets {spec}: no tokenizer, chat template or generation config there "
                         f"(looked for {', '.join(ASSET_FILES[:4])} ...)")
    return found


def llama_config(train: dict[str, Any], *, tie: bool) -> dict[str, Any]:
    """config.json for the project's training model (``reshard.train.model.ModelConfig``)."""
    need = ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim")
    missing = [k for k in need if not isinstance(train.get(k), int)]
    if missing:
        raise UnsupportedFormatError(
            f"train.model_config lacks {missing[0]!r}; cannot write config.json (export with --to safetensors, "
            "or add a config.json to the output yourself)"
        )
    heads = train["n_heads"]
    kv = train.get("n_kv_heads") if isinstance(train.get("n_kv_heads"), int) else heads
    theta = float(train.get("rope_theta", 10000.0))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": train["vocab_size"],
        "hidden_size": train["dim"],
        "intermediate_size": train["ffn_dim"],
        "num_hidden_layers": train["n_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": train["dim"] // heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(train.get("max_seq_len", 2048)),
        "rms_norm_eps": float(train.get("norm_eps", 1e-5)),
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "tie_word_embeddings": tie,
        "use_cache": True,
    }


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """What transformers' ``GenerationConfig.from_model_config`` keeps from a model config."""
    out: dict[str, Any] = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            out[key] = config[key]
    return out


_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _model_tensors(catalog: Catalog, layout: Layout) -> tuple[dict[str, TensorEntry], list[str], dict[str, str]]:
    """(HF name -> entry) of the model's tensors, what was left out, in words, and the source's
    name of each HF name that differs from it."""
    kept: dict[str, TensorEntry] = {}
    origin: dict[str, str] = {}
    optim, other = 0, []
    for name, entry in catalog.tensors.items():
        p = layout.place(name)
        if p.role == PARAM and p.fqn is not None:
            kept[p.fqn] = entry.renamed(p.fqn)
            if catalog.source_name(name) != p.fqn:
                origin[p.fqn] = catalog.source_name(name)
        elif p.role in (OPTIM_STATE, OPTIM_GROUP):
            optim += 1
        else:
            other.append(name)
    notices = []
    if optim:
        notices.append(f"{plural(optim, 'optimizer state tensor')} left out: an HF folder holds model weights only")
    if other:
        notices.append(f"{plural(len(other), 'tensor')} outside the model section left out (e.g. {other[0]!r})")
    return kept, notices, origin


def _source_assets(catalog: Catalog) -> dict[str, Path]:
    """HF -> HF: the tokenizer and friends of the source folder travel by default."""
    folder = catalog.path if catalog.path.is_dir() else catalog.path.parent
    if not (folder / "config.json").is_file():
        return {}
    return {name: folder / name for name in ASSET_FILES if (folder / name).is_file()}


# Layouts whose parameters may carry torchtitan's names: its own, a plain model state dict (a
# torchtitan model's state_dict(), or our hf-to-titan output), and our training loop's.
_TITAN_LAYOUTS = ("torchtitan", "torchtitan-flat", "state-dict", "torch-optim")


def _titan_names(layout: str, fqns: list[str], titan: Any) -> str | None:
    """None when the ``titan-to-hf`` map applies on its own: the layout is one torchtitan names
    live in and the map knows every parameter. Otherwise why not, in words ("" when no name
    looks like torchtitan's)."""
    touched = [f for f in fqns if (r := titan.route(f)) is not None and r.names != (f,)]
    if not touched:
        return ""
    if layout not in _TITAN_LAYOUTS:
        return (f"titan-to-hf not applied: layout {layout} does not hold torchtitan's names, though {len(touched)} of "
                f"{len(fqns)} parameter names look like them (e.g. {touched[0]!r}); pass --keymap titan-to-hf to rename")
    unknown = [f for f in fqns if titan.route(f) is None]
    if unknown:
        return (f"titan-to-hf not applied: it knows {len(fqns) - len(unknown)} of the {len(fqns)} parameter names, "
                f"not {unknown[0]!r}; pass --keymap with a map that covers them all")
    return None


def export_catalog(catalog: Catalog, *, max_memory: int = 1 << 30, assets: str | None = None,
                   weights_only: bool = False, architecture_check: bool = True) -> Catalog:
    """The catalog an HF folder is written from: HF names, model tensors only, config and the
    side files (tokenizer, chat template, generation config) in its facts, with the check its
    writer runs before laying out a file (``ExportCheck``; ``architecture_check`` off: none,
    said in the model card).

    The config comes from ``--config`` (already in ``catalog.facts``, see ``convert``), the HF
    folder the checkpoint came from, or the project's training config; with none, the export
    is refused (a folder transformers cannot load is not an export) unless ``weights_only``.
    """
    train = training_config(catalog)
    config, gen = hf_configs(catalog)
    # An HF source's own side files travel as they were: no generation_config.json it never had.
    carried = config is not None and not catalog.facts.hf_config_given
    titan = load_keymap("titan-to-hf")
    notices: list[str] = []
    layout = detect_layout(catalog)
    fqns = [p.fqn for n in catalog.tensors if (p := layout.place(n)).role == PARAM and p.fqn is not None]
    preset = catalog.facts.hf_keymap  # the map to HF names a reader recorded (Megatron's)
    if isinstance(preset, str):
        catalog = load_keymap(preset).apply(catalog)
        notices.append(f"renamed {catalog.format} names to HF names ({preset} key map)")
        layout = detect_layout(catalog)
    elif (skip := _titan_names(layout.name, fqns, titan)) is None:
        catalog = titan.apply(catalog)  # torchtitan names (and our training model's): to HF names
        notices.append(f"renamed torchtitan names to HF names (titan-to-hf key map, {titan_family(catalog)} family)")
        layout = detect_layout(catalog)
    elif skip:
        notices.append(skip)
    tensors, dropped, origin = _model_tensors(catalog, layout)
    notices += dropped
    if config is None and train is not None:
        tie = bool(train.get("tie_embeddings", False))
        config = llama_config(train, tie=tie)
    left = [n for n in catalog.objects if not n.startswith(("hf.", "train.model_config."))]
    if left:
        notices.append(f"{plural(len(left), 'non-tensor object')} (step counters, optimizer settings...) left out")
    if config is None and not weights_only:
        raise UsageError(f"{catalog.path} records no model config, so transformers could not load the export: give "
                         "--config CONFIG.json|HF_DIR|REPO_ID (and --hf-assets DIR|REPO_ID for the tokenizer), "
                         "or --weights-only for the safetensors alone")
    if config is not None and config.get("tie_word_embeddings") and _EMBED in tensors and _HEAD in tensors:
        if not same_values(tensors[_EMBED], tensors[_HEAD], max_memory):
            raise UsageError(f"{catalog.path}: config ties the embeddings (tie_word_embeddings) but {_HEAD} differs "
                             f"from {_EMBED}; set tie_word_embeddings to false in the config or fix the checkpoint")
        del tensors[_HEAD]  # transformers re-ties it on load, as save_pretrained leaves it out
        notices.append(f"{_HEAD} left out: it equals {_EMBED} and config.json ties them (tie_word_embeddings), so "
                       "transformers re-ties the head on load, as save_pretrained writes it")
    files = find_assets(assets) if assets is not None else _source_assets(catalog)
    if config is not None and gen is None and not carried and "generation_config.json" not in files:
        gen = generation_config(config)
    if weights_only:
        config, gen, files = None, None, {}
    facts = Facts(hf_config=config, hf_generation_config=gen, hf_notices=notices, hf_assets=files,
                  hf_source=f"the {catalog.format} checkpoint `{catalog.path.name}`", hf_check=ExportCheck(architecture_check))
    return Catalog(catalog.format, catalog.path, tensors=tensors, facts=facts, notices=list(catalog.notices),
                   renamed_from=origin)



def prepare_hf(catalog: Catalog, opts: ConvertOptions, keep: DtypeKeep) -> tuple[Catalog, DtypeKeep]:
    """What ``--to hf`` writes: ``export_catalog``, then the adapter merged in and the weights
    quantized when asked; ``keep`` learns the tensors whose dtype quantization decided."""
    assets, adapter, scheme = opts.value(HF_ASSETS), opts.value(MERGE_LORA), opts.value(QUANTIZE)
    catalog = export_catalog(catalog, max_memory=opts.budget, assets=None if assets is None else str(assets),
                             weights_only=opts.value(WEIGHTS_ONLY), architecture_check=opts.value(ARCHITECTURE_CHECK))
    if adapter is not None:  # W + scaling * (B @ A), computed as the weights stream (reshard.features.lora)
        from reshard.features.lora import merged  # each feature's modules only when asked (start-up)

        catalog = merged(catalog, adapter)
    if scheme is not None:  # quantized values and their scales, computed as they stream (reshard.features.quantize)
        from reshard.features.quantize.weights import quantized

        plain = catalog.tensors
        catalog = quantized(catalog, scheme, keep, dtype=parse_dtype(opts.dtype))
        keep = DtypeKeep(keep.patterns, fixed=[n for n, t in catalog.tensors.items() if plain.get(n) is not t])
    return catalog, keep
