"""Key maps: rename a checkpoint's tensors (and reshape them where model families disagree),
as declarative tables with a derived inverse, applied lazily to a ``Catalog``.

A ``KeyMap`` first strips wrapper segments (``_orig_mod.``...), then gives each model name to
the first rule that matches it:

* ``Rename``: regex -> replacement, optionally with the q/k RoPE row permutation;
* ``Split``: one fused tensor (qkv, gate_up) -> its parts, cut along a dimension by a ratio;
* ``Merge``: the parts -> the fused tensor (the inverse of ``Split``).

Rules see model FQNs, wherever the checkpoint keeps them: ``model.<fqn>`` of a training
checkpoint, ``optim.state.<fqn>.<exp_avg|exp_avg_sq|step>``, the FQN lists of
``optim.param_groups.*.params``, or a flat HF name. Optimizer state follows its parameter
(renamed, permuted, split or merged the same way), so a renamed checkpoint still resumes.
Nothing is read here: renamed entries reuse the stored chunks, and transformed ones read their
source lazily, box by box (``keymap_chunks``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from reshard.catalog import Catalog
from reshard.errors import UsageError
from reshard.keymap_apply import Route, apply_keymap
from reshard.keymap_patterns import Pattern, Replacement, invert, template
from reshard.keymap_presets import HF_UNFUSE, TITAN_TO_HF, WRAPPERS
from reshard.provenance import model_params

__all__ = ["KeyMap", "Rename", "Split", "Merge", "Rope", "load_keymap", "keymap_from_json", "PRESETS"]


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
    pattern: Pattern
    parts: tuple[Replacement, ...]
    ratio: tuple[int | str, ...]
    dim: int = 0

    def inverse(self) -> Merge:
        inverted = [invert(self.pattern, part) for part in self.parts]
        fused = {r.text for _, r in inverted}
        if len(fused) != 1:
            raise UsageError(f"split rule {self.pattern.regex!r} cannot be inverted: its parts use the groups in different orders")
        return Merge(tuple(p for p, _ in inverted), inverted[0][1], self.ratio, self.dim)


@dataclass(frozen=True)
class Merge:
    parts: tuple[Pattern, ...]
    replacement: Replacement
    ratio: tuple[int | str, ...]
    dim: int = 0

    def inverse(self) -> Split:
        inverted = [invert(p, self.replacement) for p in self.parts]
        return Split(inverted[0][0], tuple(r for _, r in inverted), self.ratio, self.dim)


Rule = Rename | Split | Merge


@dataclass(frozen=True)
class KeyMap:
    rules: tuple[Rule, ...] = ()
    strip: tuple[tuple[str, bool], ...] = ()
    params: Mapping[str, int] = field(default_factory=dict)
    name: str = "keymap"

    def inverse(self) -> KeyMap:
        """The map that undoes this one, derived from its rules (never written by hand)."""
        if self.strip:
            raise UsageError(f"key map {self.name!r} strips wrapper prefixes, which cannot be put back; it has no inverse")
        return KeyMap(tuple(r.inverse() for r in self.rules), (), self.params, f"inverse of {self.name}")

    def route(self, fqn: str) -> Route | None:
        """Where ``fqn`` goes, or None when no rule and no wrapper touches it."""
        stripped = _strip(fqn, self.strip)
        for rule in self.rules:
            if isinstance(rule, Rename) and (g := rule.pattern.match(stripped)) is not None:
                rope = (rule.rope.heads, rule.rope.to_halves) if rule.rope else None
                return Route("rename", (rule.replacement.render(g),), rope=rope)
            if isinstance(rule, Split) and (g := rule.pattern.match(stripped)) is not None:
                return Route("split", tuple(p.render(g) for p in rule.parts), ratio=rule.ratio, dim=rule.dim)
            if isinstance(rule, Merge):
                for k, pattern in enumerate(rule.parts):
                    if (g := pattern.match(stripped)) is not None:
                        siblings = tuple(p.render(g) for p in rule.parts)
                        return Route("merge", (rule.replacement.render(g),), dim=rule.dim, part=k, siblings=siblings)
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
                f'give it in a JSON map: {{"params": {{"{name}": ...}}, "rules": ...}}'
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


def _titan_to_hf() -> KeyMap:
    rules: list[Rule] = []
    for titan, hf, heads in TITAN_TO_HF:
        pattern, _ = template(titan)
        _, replacement = template(hf)
        rules.append(Rename(pattern, replacement, Rope(heads, to_halves=True) if heads else None))
    return KeyMap(tuple(rules), name="titan-to-hf")


def _hf_unfuse() -> KeyMap:
    rules: list[Rule] = []
    for fused, parts, ratio in HF_UNFUSE:
        rules.append(Split(template(fused)[0], tuple(template(p)[1] for p in parts), ratio))
    return KeyMap(tuple(rules), name="hf-unfuse")


PRESETS: dict[str, Callable[[], KeyMap]] = {
    "titan-to-hf": _titan_to_hf,
    "hf-to-titan": lambda: replace(_titan_to_hf().inverse(), name="hf-to-titan"),
    "hf-unfuse": _hf_unfuse,
    "hf-fuse": lambda: replace(_hf_unfuse().inverse(), name="hf-fuse"),
    "strip-wrappers": lambda: KeyMap(strip=WRAPPERS, name="strip-wrappers"),
}


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


def load_keymap(spec: str | Path | dict | KeyMap) -> KeyMap:
    """A preset name (``titan-to-hf``, ``hf-to-titan``, ``hf-unfuse``, ``hf-fuse``,
    ``strip-wrappers``), a path to a JSON map, an already parsed JSON map, or a ``KeyMap``."""
    if isinstance(spec, KeyMap):
        return spec
    if isinstance(spec, dict):
        return keymap_from_json(spec, "key map")
    if str(spec) in PRESETS:
        return PRESETS[str(spec)]()
    path = Path(spec)
    if not path.is_file():
        raise UsageError(f"--keymap {spec}: neither a preset ({', '.join(PRESETS)}) nor a JSON file")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: key map is not valid JSON ({e})") from None
    return keymap_from_json(doc, str(path))
