"""The side files of a Hugging Face model folder: ``config.json``, ``generation_config.json``
and the README model card.

A folder converted from HF gets back the config it came with (carried inside the checkpoint,
see ``reshard.provenance``); a checkpoint of the project's training model gets a
``LlamaForCausalLM`` config built from its ``ModelConfig``; any other checkpoint gets the one
``--config`` names. Keys are current transformers' (``rope_parameters``, ``dtype``), and the
dtype is always the one actually written, so ``--dtype bfloat16`` exports say bfloat16.
Tokenizer, chat template and generation files come from ``--hf-assets`` (or the source folder,
for HF -> HF).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from reshard.catalog import Target
from reshard.dtypes import DType
from reshard.errors import UnsupportedFormatError

__all__ = ["llama_config", "generation_config", "with_dtype", "model_card", "write_json", "compute_dtype", "export_config",
           "ASSET_FILES", "load_config", "find_assets", "read_json"]

# What an HF model folder holds beside its weights and config.json that users need to run
# the model: tokenizers (fast and sentencepiece), chat templates, generation defaults.
ASSET_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "spiece.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
    "generation_config.json", "preprocessor_config.json",
)
_MAX_JSON = 100_000_000


def read_json(path: Path, what: str) -> dict[str, Any]:
    from reshard.errors import CorruptCheckpointError, UsageError

    if not path.is_file():
        raise UsageError(f"{path}: no {what} there")
    if path.stat().st_size > _MAX_JSON:
        raise CorruptCheckpointError(f"{path}: {what} is larger than {_MAX_JSON} bytes")
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path}: {what} is not a JSON object")
    return doc


def load_config(spec: str | Path) -> dict[str, Any]:
    """``--config``: a config.json file, a folder holding one, or a Hub repo id (read from the
    local Hugging Face cache when offline)."""
    from reshard.hub import hub_files

    path = Path(spec)
    if path.is_file():
        return read_json(path, "config.json")
    if path.is_dir():
        return read_json(path / "config.json", "config.json")
    return read_json(hub_files(str(spec), ["config.json"], what="--config") / "config.json", "config.json")


def find_assets(spec: str | Path) -> dict[str, Path]:
    """``--hf-assets``: the tokenizer, chat template and generation files of a folder or Hub
    repo id (cache when offline), by name; an empty folder is an error, not a silent no-op."""
    from reshard.errors import UsageError
    from reshard.hub import hub_files

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


def compute_dtype(target: Target) -> DType | None:
    """The dtype config.json declares: the compute float (float16, bfloat16, float32, float64)
    most of the written bytes have. Never float8 or packed bytes: an FP8 release whose weights
    are mostly float8 computes in the dtype of the rest, and from_pretrained makes the model
    in what config.json says."""
    from reshard.architecture import COMPUTE_DTYPES

    counts: Counter[DType] = Counter()
    for name, t in target.tensors.items():  # FP8 scales (float32) are no compute tensors either
        if t.dtype in COMPUTE_DTYPES and not name.endswith("_scale_inv"):
            counts[t.dtype] += t.nbytes
    return counts.most_common(1)[0][0] if counts else None


def with_dtype(config: dict[str, Any], dtype: DType | None) -> dict[str, Any]:
    """The config with the dtype actually written, under transformers' current key ``dtype``
    (``torch_dtype`` is deprecated: dropped, not duplicated)."""
    out = {k: v for k, v in config.items() if k != "torch_dtype"}
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.")
    return out


def export_config(target: Target) -> dict[str, Any] | None:
    """config.json as the HF export writes it (and the architecture check reads it)."""
    config = target.attrs.get("hf_config")
    return with_dtype(config, compute_dtype(target)) if config is not None else None


def write_json(path: Path, doc: dict[str, Any]) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def model_card(name: str, target: Target, config: dict[str, Any] | None, source: str, files: int, *,
               checked: str | None = None) -> str:
    """README.md: what the weights were converted from, their dtype and parameter count, and
    whether they were checked against the architecture config.json names."""
    params = sum(t.nbytes // t.dtype.itemsize for t in target.tensors.values())
    dtype = compute_dtype(target)
    arch = ", ".join((config or {}).get("architectures") or []) or (config or {}).get("model_type") or "not recorded"
    return "\n".join([
        "---",
        "library_name: transformers",
        "tags:",
        "- reshard",
        "---",
        "",
        f"# {name}",
        "",
        f"Converted with reshard from {source}.",
        "",
        "| | |",
        "| --- | --- |",
        f"| architecture | {arch} |",
        f"| parameters | {params:,} ({_count(params)}) |",
        f"| dtype | {str(dtype).removeprefix('torch.') if dtype else 'n/a'} |",
        f"| weights | {files} safetensors file{'s' if files != 1 else ''} |",
        f"| architecture check | {checked or 'not checked against an architecture'} |",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("path/to/{name}")  # or its Hub repo id',
        "```",
        "",
    ])
