"""The side files the HF writer makes: ``config.json`` and the README model card.

Which config (carried from an HF source, ``--config``, or built from the training config) is
the export step's (``reshard.features.hf_export``); here it is written with current transformers' keys
(``dtype``, not ``torch_dtype``), the dtype being the compute dtype actually written, so
``--dtype bfloat16`` exports say bfloat16.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from reshard.core.dtypes import COMPUTE_DTYPES, DType
from reshard.core.target import Target

__all__ = ["with_dtype", "model_card", "write_json", "compute_dtype", "export_config"]


def compute_dtype(target: Target) -> DType | None:
    """The dtype config.json declares: the compute float (float16, bfloat16, float32, float64)
    most of the written bytes have. Never float8 or packed bytes: an FP8 release whose weights
    are mostly float8 computes in the dtype of the rest, and from_pretrained makes the model
    in what config.json says."""
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
    config = target.facts.hf_config
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
