"""Key maps: rename a checkpoint's tensors (and reshape them where model families disagree),
as declarative tables with a derived inverse, applied lazily to a ``Catalog``.

A ``KeyMap`` first strips wrapper segments (``_orig_mod.``...), then gives each model name to
the first rule that matches it:

* ``Rename``: regex -> replacement, optionally with the q/k RoPE row permutation;
* ``Split``: one fused tensor (qkv, gate_up) -> its parts, cut along a dimension by a ratio;
* ``Merge``: the parts -> the fused tensor (the inverse of ``Split``);
* ``Unstack``: a stacked tensor (torchtitan's grouped MoE experts ``[E, ...]``) -> one tensor
  per index (HF's ``experts.{e}``); ``Stack`` is its inverse;
* ``Drop``: a tensor the other side does not have (torchtitan's ``freqs_cis``), left out.

The torchtitan presets are one table per model family (``keymap.presets``); which family a
checkpoint is comes from its config (``model_type``) or, failing that, from its names.

Rules see model FQNs, wherever the checkpoint keeps them: ``model.<fqn>`` of a training
checkpoint, ``optim.state.<fqn>.<exp_avg|exp_avg_sq|step>``, the FQN lists of
``optim.param_groups.*.params``, or a flat HF name. Optimizer state follows its parameter
(renamed, permuted, split or merged the same way), so a renamed checkpoint still resumes.
Nothing is read here: renamed entries reuse the stored chunks, and transformed ones read their
source lazily, box by box (``keymap.chunks``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from reshard.core.catalog import Catalog
from reshard.core.errors import UsageError
from reshard.features.keymap.apply import INDEX, Route, apply_keymap
from reshard.features.keymap.patterns import Pattern, Replacement, invert, template
from reshard.features.keymap.presets import HF_FAMILY, HF_UNFUSE, TITAN_FAMILIES, WRAPPERS
from reshard.features.provenance import hf_configs, model_params, training_config

__all__ = ["KeyMap", "FamilyKeyMap", "Rename", "Split", "Merge", "Unstack", "Stack", "Drop", "Rope",
           "keymap_from_json", "titan_family", "titan_to_hf", "hf_to_titan", "hf_unfuse"]


@dataclass(frozen=True)
class Rope:
    """The q/k RoPE row permutation; ``heads`` names the param giving the head count."""

    heads: str
    to_halves: bool

    def inverse(self) -> Rope:
        return Rope(self.heads, not self.to_halves)


@dataclass(frozen=True)
class Rename:
    pattern: Pattern
    replacement: Replacement
    rope: Rope | None = None

    def inverse(self) -> Rename:
        pattern, replacement = invert(self.pattern, self.replacement)
        return Rename(pattern, replacement, self.rope.inverse() if self.rope else None)


@dataclass(frozen=True)
class Split:
    """One fused tensor -> its parts, in the ``ratio`` along ``dim``. With ``groups`` (a number
    or the param giving it) the fused tensor interleaves the parts group by group, as
    Megatron's ``linear_qkv`` does per query group: ``[g0: q k v | g1: q k v | ...]``."""

    pattern: Pattern
    parts: tuple[Replacement, ...]
    ratio: tuple[int | str, ...]
    dim: int = 0
    groups: int | str | None = None

    def inverse(self) -> Merge:
        inverted = [invert(self.pattern, part) for part in self.parts]
        fused = {r.text for _, r in inverted}
        if len(fused) != 1:
            raise UsageError(f"split rule {self.pattern.regex!r} cannot be inverted: its parts use the groups in different "
                             f"orders")
        return Merge(tuple(p for p, _ in inverted), inverted[0][1], self.ratio, self.dim, self.groups)


@dataclass(frozen=True)
class Merge:
    parts: tuple[Pattern, ...]
    replacement: Replacement
    ratio: tuple[int | str, ...]
    dim: int = 0
    groups: int | str | None = None  # interleave the parts group by group (``Split.groups``)

    def inverse(self) -> Split:
        inverted = [invert(p, self.replacement) for p in self.parts]
        return Split(inverted[0][0], tuple(r for _, r in inverted), self.ratio, self.dim, self.groups)


@dataclass(frozen=True)
class Unstack:
    """``pattern`` names a tensor stacked along ``dim``; ``replacement`` names index ``e`` of it,
    its last group standing for ``e`` (one group more than ``pattern`` has)."""

    pattern: Pattern
    replacement: Replacement
    stacked: Replacement  # ``pattern``'s own text as a replacement, for the inverse
    dim: int = 0

    def inverse(self) -> Stack:
        return Stack(Pattern(_regex(self.replacement)), self.stacked, self.replacement, self.dim)


@dataclass(frozen=True)
class Stack:
    """Tensors whose names match ``pattern`` (last group: the index) -> one stacked tensor."""

    pattern: Pattern
    replacement: Replacement
    unstacked: Replacement  # ``pattern``'s own text as a replacement, for the inverse
    dim: int = 0

    def inverse(self) -> Unstack:
        return Unstack(Pattern(_regex(self.replacement)), self.unstacked, self.replacement, self.dim)


@dataclass(frozen=True)
class Drop:
    """A tensor with no counterpart on the other side (a derived buffer): left out."""

    pattern: Pattern


def _regex(replacement: Replacement) -> str:
    """The regex matching every output of a template's replacement (each group a number)."""
    return "".join(re.escape(p) if isinstance(p, str) else r"(\d+)" for p in replacement.parts)


Rule = Rename | Split | Merge | Unstack | Stack | Drop


@dataclass(frozen=True)
class KeyMap:
    rules: tuple[Rule, ...] = ()
    strip: tuple[tuple[str, bool], ...] = ()
    params: Mapping[str, int] = field(default_factory=dict)
    name: str = "keymap"

    def inverse(self) -> KeyMap:
        """The map that undoes this one, derived from its rules (never written by hand); what a
        ``Drop`` left out stays out."""
        if self.strip:
            raise UsageError(f"key map {self.name!r} strips wrapper prefixes, which cannot be put back; it has no inverse")
        rules = tuple(r.inverse() for r in self.rules if not isinstance(r, Drop))
        return KeyMap(rules, (), self.params, f"inverse of {self.name}")

    def route(self, fqn: str) -> Route | None:
        """Where ``fqn`` goes, or None when no rule and no wrapper touches it."""
        stripped = _strip(fqn, self.strip)
        for rule in self.rules:
            if isinstance(rule, Rename) and (g := rule.pattern.match(stripped)) is not None:
                rope = (rule.rope.heads, rule.rope.to_halves) if rule.rope else None
                return Route("rename", (rule.replacement.render(g),), rope=rope)
            if isinstance(rule, Split) and (g := rule.pattern.match(stripped)) is not None:
                return Route("split", tuple(p.render(g) for p in rule.parts), ratio=rule.ratio, dim=rule.dim,
                             groups=rule.groups)
            if isinstance(rule, Merge):
                for k, pattern in enumerate(rule.parts):
                    if (g := pattern.match(stripped)) is not None:
                        siblings = tuple(p.render(g) for p in rule.parts)
                        return Route("merge", (rule.replacement.render(g),), ratio=rule.ratio, dim=rule.dim, part=k,
                                     siblings=siblings, groups=rule.groups)
            if isinstance(rule, Unstack) and (g := rule.pattern.match(stripped)) is not None:
                return Route("unstack", (rule.replacement.render(g + (INDEX,)),), dim=rule.dim)
            if isinstance(rule, Stack) and (g := rule.pattern.match(stripped)) is not None:
                return Route("stack", (rule.replacement.render(g[:-1]),), dim=rule.dim, part=int(g[-1]))
            if isinstance(rule, Drop) and rule.pattern.match(stripped) is not None:
                return Route("drop", ())
        return Route("rename", (stripped,)) if stripped != fqn else None

    def map_name(self, fqn: str) -> list[str]:
        """The FQN(s) ``fqn`` becomes (several for a split; unchanged when nothing matches)."""
        r = self.route(fqn)
        return [fqn] if r is None else list(r.names)

    def apply(self, catalog: Catalog) -> Catalog:
        """A new catalog with every tensor and object renamed (and transformed) by this map."""
        return apply_keymap(self, catalog)

    def param(self, name: str, catalog: Catalog, found: dict[str, int]) -> int:
        """An integer a rule needs (a head count): the map's own ``params`` first, else the
        model config the checkpoint records (``found`` caches it across calls)."""
        if name in self.params:
            return int(self.params[name])
        if name not in found:
            found.update(model_params(catalog))
        if name not in found:
            raise UsageError(
                f"key map {self.name!r} needs {name!r} and {catalog.path} records no model config with it; "
                "give the model's config.json (--config on the CLI, config= in reshard.load_model and "
                f'load_state_dict) or a JSON map: {{"params": {{"{name}": ...}}, "rules": ...}}'
            )
        return found[name]


def _strip(fqn: str, strip: tuple[tuple[str, bool], ...]) -> str:
    if not strip:
        return fqn
    parts = fqn.split(".")
    keep = [p for i, p in enumerate(parts) if not any(p == seg and (anywhere or i == 0) for seg, anywhere in strip)]
    # A leading ``module`` may sit under another wrapper (``module._orig_mod.x``): strip again.
    out = ".".join(keep)
    return out if out == fqn else _strip(out, strip)


# ------------------------------------------------------------------------------ presets and JSON


def titan_to_hf() -> FamilyKeyMap:
    return FamilyKeyMap("titan-to-hf", {f: _titan_rules(f) for f in TITAN_FAMILIES})


def hf_to_titan(era: str = "v2") -> FamilyKeyMap:
    """HF names to torchtitan's: ``v2`` its 0.2 names, ``v3`` its 0.3 names."""
    name = "hf-to-titan" if era == "v2" else "hf-to-titan-0.3"
    return FamilyKeyMap(name, {f: _hf_rules(f, era) for f in TITAN_FAMILIES})


def _titan_rules(family: str) -> KeyMap:
    """torchtitan -> HF for one model family, accepting the names of every torchtitan era."""
    rules: list[Rule] = []
    for titan, hf, transform, _era in TITAN_FAMILIES[family]:
        pattern, own = template(titan)
        if transform == "drop":
            rules.append(Drop(pattern))
            continue
        _, replacement = template(hf or "")
        if transform == "experts":
            rules.append(Unstack(pattern, replacement, own))
        else:
            heads = transform.split(":", 1)[1] if transform and transform.startswith("rope:") else None
            rules.append(Rename(pattern, replacement, Rope(heads, to_halves=True) if heads else None))
    return KeyMap(tuple(rules), name=f"titan-to-hf ({family})")


def _hf_rules(family: str, era: str) -> KeyMap:
    """HF -> torchtitan for one family, writing one era's names (the inverse of the rows of
    that era, derived: a name torchtitan spells two ways maps back one way)."""
    forward = _titan_rules(family)
    kept = tuple(rule for rule, row in zip(forward.rules, TITAN_FAMILIES[family]) if row[3] in (era, "*"))
    return replace(KeyMap(kept).inverse(), name=f"hf-to-titan ({family})")


@dataclass(frozen=True)
class FamilyKeyMap:
    """A torchtitan preset: one ``KeyMap`` per model family, chosen per checkpoint from its
    config's ``model_type`` (``--config``, or the config it records), else from its names
    (q/k norms: qwen3; low-rank kv: deepseek_v3; neither: llama3)."""

    name: str
    families: Mapping[str, KeyMap]

    def for_catalog(self, catalog: Catalog) -> KeyMap:
        return self.families[titan_family(catalog)]

    def apply(self, catalog: Catalog) -> Catalog:
        return self.for_catalog(catalog).apply(catalog)

    def route(self, fqn: str) -> Route | None:
        """Where ``fqn`` goes under the first family whose table knows it."""
        for km in self.families.values():
            found = km.route(fqn)
            if found is not None:
                return found
        return None

    def map_name(self, fqn: str) -> list[str]:
        r = self.route(fqn)
        return [fqn] if r is None else list(r.names)

    def inverse(self) -> FamilyKeyMap:
        return FamilyKeyMap(f"inverse of {self.name}", {f: km.inverse() for f, km in self.families.items()})


_NAME_HINTS = (("deepseek_v3", ("wkv_a", "kv_a_proj_with_mqa")), ("qwen3", ("q_norm.weight", "moe.", "mlp.experts.")))


def titan_family(catalog: Catalog) -> str:
    """The torchtitan model family of a checkpoint (either side of the map)."""
    config, _ = hf_configs(catalog)
    model_type = (config or {}).get("model_type")
    if model_type is not None:
        if model_type not in HF_FAMILY:
            raise UsageError(f"{catalog.path}: its config's model_type {model_type!r} has no torchtitan key map; "
                             f"known: {', '.join(HF_FAMILY)} (or give a JSON key map)")
        return HF_FAMILY[model_type]
    if training_config(catalog) is not None:
        return "llama3"  # the project's training model
    names = " ".join(catalog.tensors)
    return next((family for family, hints in _NAME_HINTS if any(h in names for h in hints)), "llama3")


def hf_unfuse() -> KeyMap:
    rules: list[Rule] = []
    for fused, parts, ratio in HF_UNFUSE:
        rules.append(Split(template(fused)[0], tuple(template(p)[1] for p in parts), ratio))
    return KeyMap(tuple(rules), name="hf-unfuse")


def _ratio(value: Any, where: str) -> tuple[int | str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in value):
        raise UsageError(f"{where}: 'ratio' must be a list of numbers or param names")
    return tuple(value)


def _json_rule(rule: Any, where: str) -> Rule:
    if not isinstance(rule, dict):
        raise UsageError(f"{where}: a rule must be an object")
    texts = [rule.get(k) for k in ("from", "to", "split") if k in rule]
    texts += [v for k in ("into", "merge") for v in (rule[k] if isinstance(rule.get(k), list) else [rule.get(k)]) if k in rule]
    if not all(isinstance(t, str) for t in texts):
        raise UsageError(f"{where}: patterns and replacements must be strings")
    dim = rule.get("dim", 0)
    if "from" in rule and "to" in rule:
        rope = rule.get("rope")
        return Rename(Pattern(rule["from"]), Replacement(rule["to"]),
                      Rope(rope["heads"], bool(rope.get("to_halves", True))) if isinstance(rope, dict) else None)
    if "split" in rule and isinstance(rule.get("into"), list):
        n = len(rule["into"])
        return Split(Pattern(rule["split"]), tuple(Replacement(t) for t in rule["into"]),
                     _ratio(rule.get("ratio", [1] * n), where), dim)
    if isinstance(rule.get("merge"), list) and isinstance(rule.get("into"), str):
        n = len(rule["merge"])
        return Merge(tuple(Pattern(p) for p in rule["merge"]), Replacement(rule["into"]),
                     _ratio(rule.get("ratio", [1] * n), where), dim)
    raise UsageError(f"{where}: a rule is {{'from', 'to'}}, {{'split', 'into': [...]}} or {{'merge': [...], 'into'}}")


def keymap_from_json(doc: Any, where: str) -> KeyMap:
    """``{"regex": "replacement", ...}``, or ``{"rules": [...], "strip": true|[...], "params": {...}}``."""
    if not isinstance(doc, dict):
        raise UsageError(f"{where}: a key map is a JSON object")
    if "rules" not in doc and all(isinstance(v, str) for v in doc.values()):
        return KeyMap(tuple(Rename(Pattern(k), Replacement(v)) for k, v in doc.items()), name=where)
    unknown = sorted(set(doc) - {"rules", "strip", "params"})
    if unknown:
        raise UsageError(f"{where}: unknown key {unknown[0]!r}; a key map is {{regex: replacement}} or has "
                         "'rules', 'strip' and 'params'")
    rules = doc.get("rules", [])
    if not isinstance(rules, list):
        raise UsageError(f"{where}: 'rules' must be a list")
    strip = doc.get("strip", False)
    if strip is True:
        strip = WRAPPERS
    elif isinstance(strip, list) and all(isinstance(s, str) for s in strip):
        strip = tuple((s, True) for s in strip)
    elif strip is False:
        strip = ()
    else:
        raise UsageError(f"{where}: 'strip' must be true or a list of name segments")
    params = doc.get("params", {})
    if not isinstance(params, dict) or not all(isinstance(v, int) for v in params.values()):
        raise UsageError(f"{where}: 'params' must map names to integers")
    return KeyMap(tuple(_json_rule(r, f"{where} rule {i}") for i, r in enumerate(rules)), strip, params, where)
