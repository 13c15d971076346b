"""``--merge-lora``: a PEFT LoRA adapter merged into its base model while streaming.

A merged weight is ``W + scaling * (B @ A)``, computed in float32 for whatever box the engine
asks (the box's rows of ``W`` and ``B``, the columns of ``A`` it needs; never the whole
weight) and cast once to the output dtype. The rules are PEFT's (peft/tuners/lora/layer.py,
``get_delta_weight`` of ``Linear`` and ``Embedding``; peft/tuners/lora/model.py for the
patterns):

* ``scaling = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``; ``r`` and
  ``lora_alpha`` per module from ``rank_pattern`` / ``alpha_pattern`` (a key matches a module
  name it ends with at a ``.`` boundary, as regex: ``peft.utils.other.get_pattern_key``);
* ``fan_in_fan_out`` (GPT-2's ``Conv1D``, weights stored ``[in, out]``) and embedding
  adapters (``lora_embedding_A`` ``[r, vocab]``, ``lora_embedding_B`` ``[dim, r]``) add the
  transpose: ``(B @ A).T``;
* tensors the adapter saves whole replace the base's: ``modules_to_save`` modules and the
  ``base_layer`` weights PEFT saves beside embedding adapters; LoRA then merges on top;
* a model whose config ties the output head to the embedding keeps one tensor: a delta for
  ``lm_head`` lands on the embedding, as it does on PEFT's shared parameter.

What PEFT's plain merge would not give (DoRA, LoRA biases, other adapter types, aLoRA, layer
replication, trainable tokens, conv layers) and adapters that do not fit the base (a module
the base lacks, shapes that differ) are refused, naming the module.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Catalog, Chunk, TensorEntry
from reshard.core.chunk_reads import float32_box
from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError, UsageError, option
from reshard.core.json_file import read_json
from reshard.core.regions import Banded
from reshard.core.sizes import preview
from reshard.features.architecture import model_facts
from reshard.features.hub import hub_files
from reshard.formats.registry import get_format

if TYPE_CHECKING:
    import torch

__all__ = ["Adapter", "LoraModule", "read_adapter", "merged"]

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"
# adapter_config.json keys whose truthy value means a merge PEFT's plain LoRA rule does not give.
_REFUSED_KEYS = {
    "use_dora": "DoRA (weight-decomposed LoRA: its magnitude vectors rescale each merged row)",
    "lora_bias": "LoRA biases (lora_bias)",
    "layer_replication": "layer replication (layer_replication)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "BD-LoRA (use_bdlora)",
}


@dataclass(frozen=True)
class LoraModule:
    """One adapted module: ``A`` ``[r, in]``, ``B`` ``[out, r]``, its scaling, and whether the
    delta is ``(B @ A).T`` (embeddings, ``fan_in_fan_out``)."""

    module: str
    a: TensorEntry
    b: TensorEntry
    scaling: float
    transposed: bool
    embedding: bool = False  # lora_embedding_A/B: PEFT rounds its delta to the weight's dtype before adding

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class Adapter:
    """A PEFT LoRA adapter: where it is, its config, the adapted modules and the tensors it
    saves whole (base name -> entry): ``modules_to_save`` copies, and ``base_layer`` weights
    (``base_layers`` names those: PEFT loads them into the base's own parameter)."""

    path: Path
    config: dict[str, Any]
    modules: dict[str, LoraModule]
    whole: dict[str, TensorEntry]
    base_layers: frozenset[str] = frozenset()

    @property
    def label(self) -> str:
        return self.path.name or str(self.path)


def _folder(spec: str | os.PathLike) -> Path:
    path = Path(spec)
    if path.is_file() and path.name in (CONFIG, *WEIGHTS):
        path = path.parent
    if path.is_dir():
        if not (path / CONFIG).is_file():
            raise UsageError(f"{path}: no {CONFIG} there; {option('--merge-lora', 'merge_lora=')} takes a PEFT adapter "
                             "folder (adapter_config.json + adapter_model.safetensors), as save_pretrained writes it")
        return path

    return hub_files(str(spec), [CONFIG, *WEIGHTS], what=option("--merge-lora", "merge_lora="))


def _config(folder: Path) -> dict[str, Any]:
    config = read_json(folder / CONFIG, CONFIG)
    where = folder / CONFIG
    if config.get("peft_type") != "LORA":
        raise UnsupportedFormatError(f"{where}: peft_type {config.get('peft_type')!r}; reshard merges LoRA adapters only")
    for key, what in _REFUSED_KEYS.items():
        if config.get(key):
            raise UnsupportedFormatError(f"{where}: {what} cannot be merged by reshard; merge with PEFT's "
                                         "merge_and_unload instead")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or isinstance(config.get(key), bool) or config[key] <= 0:
            raise CorruptCheckpointError(f"{where}: {key} is {config.get(key)!r}, not a positive number")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise CorruptCheckpointError(f"{where}: {key} is not an object of module pattern -> number")
    return config


def _weights(folder: Path) -> Catalog:
    for name, fmt in zip(WEIGHTS, ("safetensors", "torch")):
        if (folder / name).is_file():
            return get_format(fmt).read(folder / name)
    raise UsageError(f"{folder}: no {' or '.join(WEIGHTS)} beside {CONFIG}")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``get_pattern_key``: the first key that ends ``module`` at a ``.`` boundary."""
    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return patterns[key]
        except re.error as e:
            raise CorruptCheckpointError(f"{CONFIG}: pattern {key!r} is not a regular expression ({e})") from None
    return patterns.get(module, default)


def _scaling(config: dict[str, Any], module: str, rank: int, where: Path) -> float:
    r = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
    if r != rank:
        raise CorruptCheckpointError(f"{where}: module {module!r} has lora_A of rank {rank}, but the config says r={r}")
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


_LORA = re.compile(r"(?P<module>.+)\.(?:lora_(?P<ab>[AB])\.weight|lora_embedding_(?P<eab>[AB]))")


def read_adapter(spec: str | os.PathLike, classes: dict[str, str] | None = None) -> Adapter:
    """The adapter at ``spec`` (a folder, or a Hub repo id), every tensor sorted into LoRA pairs
    and whole tensors; anything else is refused, naming it. ``classes`` (module name -> class
    name, from the base's model) decides ``fan_in_fan_out`` module by module, as PEFT does when
    it loads the adapter: True on a ``Conv1D``, False on an ``nn.Linear``, whatever the saved
    config says (PEFT rewrites that one shared flag as it meets each kind: GPT-2 with adapters on
    ``c_attn`` and ``lm_head`` saves False)."""
    folder = _folder(spec)
    config = _config(folder)
    catalog = _weights(folder)
    keep = [m for m in config.get("modules_to_save") or [] if isinstance(m, str)]
    pairs: dict[str, dict[str, TensorEntry]] = {}
    kinds: dict[str, bool] = {}  # module -> embedding adapter
    whole: dict[str, TensorEntry] = {}
    base_layers: set[str] = set()
    for key, entry in catalog.tensors.items():
        if not key.startswith(_PREFIX):
            raise UnsupportedFormatError(f"{catalog.path}: tensor {key!r} is not under {_PREFIX!r}, as PEFT saves LoRA adapters")
        name = key[len(_PREFIX):]
        m = _LORA.fullmatch(name)
        if m is not None:
            module = m["module"]
            pairs.setdefault(module, {})[m["ab"] or m["eab"]] = entry
            kinds[module] = m["eab"] is not None
            continue
        plain = name.replace(".modules_to_save.", ".").replace(".base_layer.", ".")
        owner = plain.rpartition(".")[0]
        trained_bias = name.endswith(".bias") and config.get("bias") in ("all", "lora_only")  # PEFT's bias=
        if ".base_layer." in name or trained_bias or any(owner == k or owner.endswith("." + k) for k in keep):
            whole[plain] = entry
            if ".base_layer." in name:
                base_layers.add(plain)
            continue
        what = "DoRA magnitude vector" if "lora_magnitude_vector" in name else "tensor"
        raise UnsupportedFormatError(f"{catalog.path}: module {owner!r}: adapter {what} {key!r} is not one reshard "
                                     "merges (lora_A/lora_B, lora_embedding_A/B, modules_to_save); merge with PEFT instead")
    modules = {}
    transpose = bool(config.get("fan_in_fan_out"))
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise CorruptCheckpointError(f"{catalog.path}: module {module!r} has lora_{next(iter(ab))} but not its pair")
        a, b = ab["A"], ab["B"]
        if len(a.shape) != 2 or len(b.shape) != 2 or b.shape[1] != a.shape[0]:
            raise UnsupportedFormatError(f"{catalog.path}: module {module!r}: lora_A {list(a.shape)} and lora_B "
                                         f"{list(b.shape)} are not a linear or embedding LoRA pair (conv layers "
                                         "are not merged by reshard)")
        scaling = _scaling(config, module, a.shape[0], folder / CONFIG)
        kind = (classes or {}).get(module)
        fan_in_fan_out = kind == "Conv1D" if kind in ("Conv1D", "Linear") else transpose
        modules[module] = LoraModule(module, a, b, scaling, transposed=kinds[module] or fan_in_fan_out,
                                     embedding=kinds[module])
    return Adapter(folder, config, modules, whole, frozenset(base_layers))


@dataclass(frozen=True)
class _Merged(Banded):
    """``base + sum(scaling * (B @ A))`` in float32 for any box, a band of rows at a time
    (rounded once into the engine's slab)."""

    base: TensorEntry
    deltas: tuple[LoraModule, ...]

    def _band(self, box: Box) -> torch.Tensor:
        w = float32_box(self.base, box)
        if box.numel == 0:
            return w
        (r0, c0), (nr, nc) = box.offsets, box.sizes
        # PEFT merges into the weight in its own dtype, delta after delta: a bf16 weight is rounded
        # after each one (and an embedding's delta before it is added: Embedding.merge casts it).
        narrow = self.base.dtype.itemsize < 4 and self.base.dtype.is_floating_point
        own = self.base.dtype.torch if narrow else None
        for d in self.deltas:
            i0, ni = _aligned(r0, nr, self.base.shape[0])
            j0, nj = _aligned(c0, nc, self.base.shape[1])
            if d.transposed:  # delta[i, j] = (B @ A)[j, i]
                product = float32_box(d.b, Box((j0, 0), (nj, d.rank))) @ float32_box(d.a, Box((0, i0), (d.rank, ni)))
                product = product.T
            else:
                product = float32_box(d.b, Box((i0, 0), (ni, d.rank))) @ float32_box(d.a, Box((0, j0), (d.rank, nj)))
            delta = product[r0 - i0: r0 - i0 + nr, c0 - j0: c0 - j0 + nc] * d.scaling
            if own is not None and d.embedding:
                delta = delta.to(own).float()
            w.add_(delta)
            if own is not None:
                w = w.to(own).float()
        return w


_ALIGN = 64  # rows and columns of B @ A computed at a time, from a multiple of this


def _aligned(start: int, size: int, limit: int) -> tuple[int, int]:
    """``[start, start + size)`` widened to multiples of ``_ALIGN`` (cut at ``limit``).

    A matrix product's kernel rounds an element differently in the ragged edge of its tiles
    than inside them; PEFT multiplies whole matrices, so products over windows that start
    where its tiles start (any tile size dividing 64) give its bits, where a band of 3 rows
    would not."""
    lo = start // _ALIGN * _ALIGN
    return lo, min(limit, -(-(start + size) // _ALIGN) * _ALIGN) - lo


def _delta_shape(d: LoraModule) -> tuple[int, int]:
    out, into = d.b.shape[0], d.a.shape[1]
    return (into, out) if d.transposed else (out, into)


def _replaced(base: TensorEntry, new: TensorEntry, name: str, source: Path) -> TensorEntry:
    if new.shape != base.shape:
        raise UsageError(f"{source}: module {name.rpartition('.')[0]!r}: the adapter saves {name} as {list(new.shape)}, "
                         f"the base holds {list(base.shape)}; was the base resized for this adapter?")
    return TensorEntry(name, base.shape, base.dtype, new.chunks)  # cast to the base's dtype, as load_state_dict does


def _targeted(config: dict[str, Any], module: str) -> bool:
    """Whether PEFT puts a LoRA layer on ``module``: ``target_modules`` (a regex matched whole,
    or names a module name ends with at a ``.``; "all-linear" every linear layer) and not
    ``exclude_modules`` (peft.tuners.tuners_utils.check_target_module_exists). A LoRA pair saved
    for any other module is never loaded by PEFT, so never merged."""

    def names(patterns: Any) -> bool:
        if isinstance(patterns, str):
            return patterns == "all-linear" or re.fullmatch(patterns, module) is not None
        return any(module == p or module.endswith("." + p) for p in patterns or [] if isinstance(p, str))

    target = config.get("target_modules")
    return (target is None or names(target)) and not (config.get("exclude_modules") and names(config["exclude_modules"]))


def merged(catalog: Catalog, spec: str | os.PathLike) -> Catalog:
    """``catalog`` (HF names, as ``export_catalog`` leaves it) with the adapter at ``spec``
    merged: the adapted weights computed lazily, the saved modules in place of the base's.

    The embedding and head are the model's own (``get_input_embeddings`` and
    ``get_output_embeddings`` of the config's model built on the meta device: GPT-2's are
    ``transformer.wte`` and ``lm_head``), tied as its config class says, and deltas on one
    weight are added in the model's module order, as PEFT's ``merge_and_unload`` walks it."""
    config = catalog.facts.hf_config or {}
    facts = model_facts(config) if config else None
    adapter = read_adapter(spec, facts.classes if facts else None)
    tensors = dict(catalog.tensors)
    # PEFT names modules as the loaded model does; the checkpoint keeps its own names (transformers
    # 5 renames Llava's language_model.model.layers to model.language_model.layers on load)
    stored = {loaded: name for name, loaded in facts.loaded_names(tensors).items()} if facts else {}
    embed, head = (facts.embed or _EMBED, facts.head or _HEAD) if facts else (_EMBED, _HEAD)
    tied = (facts.tied if facts else bool(config.get("tie_word_embeddings"))) and stored.get(head, head) not in tensors
    order = {m: i for i, m in enumerate(facts.linear)} if facts else {}
    for name, entry in adapter.whole.items():
        if tied and name in (embed, head) and name not in adapter.base_layers:
            raise UsageError(f"{adapter.path}: module {name.rpartition('.')[0]!r} is saved whole (modules_to_save) but "
                             f"the base ties {head} to {embed}; the merged model would have to untie them: merge with "
                             "PEFT and save with tie_word_embeddings false")
        if name == head and tied:  # a base layer PEFT loads into the one shared parameter
            name = embed
        name = stored.get(name, name)
        if name not in tensors:
            raise UsageError(f"{adapter.path}: module {name.rpartition('.')[0]!r}: the adapter saves {name}, which the "
                             f"base {catalog.path} does not have")
        tensors[name] = _replaced(tensors[name], entry, name, adapter.path)
    deltas: dict[str, list[LoraModule]] = {}
    untargeted = [m for m in adapter.modules if not _targeted(adapter.config, m)]
    for module, d in adapter.modules.items():
        if module in untargeted:
            continue
        name = f"{module}.weight"
        if name == head and tied:
            name = embed  # one parameter in PEFT's model: both deltas land on it
        name = stored.get(name, name)
        base = tensors.get(name)
        if base is None:
            raise UsageError(f"{adapter.path}: module {module!r} is adapted, but the base {catalog.path} has no {name}")
        if base.shape != _delta_shape(d):
            raise UsageError(f"{adapter.path}: module {module!r}: lora_B @ lora_A gives {list(_delta_shape(d))}, the "
                             f"base weight {name} is {list(base.shape)}; is this the adapter of another model?")
        if not base.dtype.is_floating_point:
            raise UsageError(f"{adapter.path}: module {module!r}: the base weight {name} is {base.dtype}, not floating point")
        deltas.setdefault(name, []).append(d)
    for name, ds in deltas.items():
        base = tensors[name]
        ds.sort(key=lambda d: (order.get(d.module, len(order)), not d.embedding))  # PEFT's walk: the model's order
        tensors[name] = TensorEntry(name, base.shape, base.dtype, [Chunk(full_box(base.shape), _Merged(base, tuple(ds)))])
    kinds: dict[str, int] = {}
    for module in (m for m in adapter.modules if m not in untargeted):
        last = module.rpartition(".")[2]
        kinds[last] = kinds.get(last, 0) + 1
    c = adapter.config
    how = f"r={c['r']}, lora_alpha={c['lora_alpha']}" + (", rslora" if c.get("use_rslora") else "")
    if c.get("rank_pattern") or c.get("alpha_pattern"):
        how += ", rank/alpha patterns"
    notice = (f"merged LoRA adapter {adapter.label} ({how}) into {len(deltas)} weights in float32 "
              f"({', '.join(f'{k} {n}' for k, n in kinds.items())})")
    if untargeted:
        notice += (f"; left out the LoRA weights of {len(untargeted)} modules target_modules does not name, as PEFT "
                   f"never loads them: {preview(untargeted)}")
    if adapter.whole:
        notice += (f"; {len(adapter.whole)} tensors replaced by the ones the adapter saves (modules_to_save, base "
                   f"layers): {preview(list(adapter.whole))}")
    known = catalog.facts.copy()
    if known.hf_source is not None:
        known.hf_source = f"{known.hf_source}, with the PEFT LoRA adapter `{adapter.label}` merged in ({how})"
    return replace(catalog, tensors=tensors, facts=known, notices=[*catalog.notices, notice])
