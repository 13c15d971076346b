"""What a checkpoint records about where it came from, so later exports need no flags.

An HF folder's ``config.json`` and ``generation_config.json`` travel inside every checkpoint
converted from it, as the string objects ``hf.config_json`` and ``hf.generation_config_json``
(strings, so every format can hold them: DCP, torch, safetensors metadata). A training
checkpoint of the project's model records its ``ModelConfig`` as ``train.model_config.*``.
Key maps read head counts from either; the HF writer rebuilds config.json from either.
"""

from __future__ import annotations

import json
from typing import Any

from reshard.core.catalog import Catalog
from reshard.core.errors import CorruptCheckpointError

__all__ = [
    "CONFIG_OBJECT", "GENERATION_OBJECT", "TRAIN_CONFIG_PREFIX",
    "hf_configs", "carry_hf_configs", "carried_notice", "training_config", "model_params",
]

CONFIG_OBJECT = "hf.config_json"
GENERATION_OBJECT = "hf.generation_config_json"
TRAIN_CONFIG_PREFIX = "train.model_config."


def _fact(catalog: Catalog, name: str) -> dict[str, Any] | None:
    """The fact an HF reader fills from the side file that object ``name`` carries."""
    return catalog.facts.hf_config if name == CONFIG_OBJECT else catalog.facts.hf_generation_config


def _carried(catalog: Catalog, name: str) -> dict[str, Any] | None:
    value = _fact(catalog, name)
    if value is None and name in catalog.objects:
        raw = catalog.objects[name]
        try:
            value = json.loads(raw) if isinstance(raw, str) else None
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise CorruptCheckpointError(f"{catalog.path}: object {name!r} is not a JSON object as reshard writes it")
    return value if isinstance(value, dict) else None


def hf_configs(catalog: Catalog) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(config.json, generation_config.json) of the HF model this checkpoint came from."""
    return _carried(catalog, CONFIG_OBJECT), _carried(catalog, GENERATION_OBJECT)


def carry_hf_configs(catalog: Catalog) -> list[str]:
    """Record an HF source's side files as objects, so they survive a conversion to any format;
    the names of the objects added."""
    added = []
    for name in (CONFIG_OBJECT, GENERATION_OBJECT):
        value = _fact(catalog, name)
        if isinstance(value, dict) and name not in catalog.objects:
            catalog.objects[name] = json.dumps(value, sort_keys=True)
            catalog.paths[name] = tuple(name.split("."))
            added.append(name)
    return added


def carried_notice(names: list[str]) -> str:
    """What the output holds beside the tensors, for users of torch's own tools, which show it."""
    files = " and ".join(n.removeprefix("hf.").removesuffix("_json") + ".json" for n in names)
    return (f"the source's {files} kept as text ({', '.join(names)}): torch's own readers (dcp_to_torch_save, "
            "torch.load) show it as a top-level 'hf' entry beside the tensors; a later --to hf rebuilds the file from it")


def training_config(catalog: Catalog) -> dict[str, Any] | None:
    """The project's ``ModelConfig`` as the training loop saved it (``train.model_config.*``)."""
    out = {n.removeprefix(TRAIN_CONFIG_PREFIX): catalog.objects[n] for n in catalog.objects if n.startswith(TRAIN_CONFIG_PREFIX)}
    return out or None


def model_params(catalog: Catalog) -> dict[str, int]:
    """Head counts (``n_heads``, ``n_kv_heads``) key maps need, from whichever config is there."""
    out: dict[str, int] = {}
    train = training_config(catalog) or {}
    if isinstance(train.get("n_heads"), int):
        out["n_heads"] = train["n_heads"]
        kv = train.get("n_kv_heads")
        out["n_kv_heads"] = kv if isinstance(kv, int) else train["n_heads"]
        return out
    config, _ = hf_configs(catalog)
    if config and isinstance(config.get("num_attention_heads"), int):
        out["n_heads"] = config["num_attention_heads"]
        kv = config.get("num_key_value_heads")
        out["n_kv_heads"] = kv if isinstance(kv, int) else config["num_attention_heads"]
    return out
