"""The catalog's cross-module facts are typed fields of ``reshard.core.facts.Facts``, read and
written as attributes: no module spells a fact's name as a string key (the dict of string keys
they replaced let a reader write ``"hf_source"`` and a writer look for ``"hf-source"``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from reshard.core.facts import Facts

ROOT = Path(__file__).resolve().parents[1]
ACCESSOR = ROOT / "reshard" / "core" / "facts.py"
# a catalog's or target's former dict, and the accessor's storage reached from outside
_FORBIDDEN_ATTRIBUTES = {"attrs", "_by_key"}


def string_keyed_lookups(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` reaches a fact by a string: ``x.attrs[...]``/``x.attrs.get(...)``,
    ``Catalog(..., attrs=...)``, the accessor's private dict, or ``getattr(facts, "name")``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and node.attr in _FORBIDDEN_ATTRIBUTES:
            found.append(f"{filename}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.keyword) and node.arg == "attrs":
            found.append(f"{filename}:{node.value.lineno}: attrs=")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
              and len(node.args) > 1 and "facts" in ast.unparse(node.args[0])):
            found.append(f"{filename}:{node.lineno}: {node.func.id}(facts, ...)")
    return found


def _sources() -> list[Path]:
    return [p for d in ("reshard", "formats", "tests", "scripts") for p in sorted((ROOT / d).rglob("*.py"))
            if p != ACCESSOR and p != Path(__file__).resolve()]


def test_no_string_keyed_fact_outside_the_accessor():
    found = [hit for path in _sources() for hit in string_keyed_lookups(path.read_text(), str(path.relative_to(ROOT)))
             if "zarr-python" not in _line(hit)]  # zarr-python's own attribute API (group.attrs), said so on the line
    assert not found, "reach catalog facts as typed attributes (reshard/core/facts.py):\n" + "\n".join(found)


def _line(hit: str) -> str:
    name, line, _ = hit.split(":", 2)
    return (ROOT / name).read_text().splitlines()[int(line) - 1]


@pytest.mark.parametrize("planted", [
    'layout = catalog.attrs.get("layout")',
    'catalog.attrs["hf_source"] = "x"',
    'out = Catalog("dcp", path, attrs={"layout": "accelerate"})',
    'value = catalog.facts._by_key["hf_config"]',
    'value = getattr(catalog.facts, "hf_config")',
])
def test_the_rule_fails_on_a_planted_string_lookup(planted):
    assert string_keyed_lookups(planted)


def test_the_typed_form_passes_the_rule():
    assert not string_keyed_lookups("catalog.facts.hf_config = {'a': 1}\nsize = catalog.facts.source_world_size\n"
                                    "out = Catalog('dcp', path, facts=catalog.facts.but(layout=None))")


def test_a_fact_is_none_until_known_and_none_forgets_it():
    facts = Facts(layout="accelerate", source_world_size=4)
    assert facts.layout == "accelerate" and facts.source_world_size == 4 and facts.hf_config is None
    facts.layout = None
    assert facts.layout is None and facts == Facts(source_world_size=4)
    changed = facts.but(hf_source="the dcp checkpoint `c`")
    assert changed.hf_source == "the dcp checkpoint `c`" and facts.hf_source is None  # a copy


def test_an_undeclared_fact_is_refused_naming_where_to_declare_it():
    with pytest.raises(TypeError, match="no fact 'hf_sauce'.*reshard/core/facts.py"):
        Facts(hf_sauce="x")
    with pytest.raises(TypeError, match="no fact"):
        Facts().but(hf_sauce="x")


def test_persisted_facts_keep_their_stored_names():
    """The zarr format stores ``persisted()`` under these names: they are on-disk keys, and a
    store written before the facts were typed reads back the same."""
    facts = Facts(layout="verl", source_world_size=2, containers={("optim", "state"): "dict"}, hf_config={"a": 1},
                  target_mesh={"shape": [2], "names": ["dp"]}, layout_given=True, deepspeed_zero_stage=2)
    assert facts.persisted() == {"layout": "verl", "hf_config": {"a": 1}, "deepspeed_zero_stage": 2}
    stored = {"layout": "verl", "hf_config": {"a": 1}, "torch_containers_written_by_a_later_reshard": 1}
    back = Facts()
    back.take_persisted(stored)
    assert back.layout == "verl" and back.hf_config == {"a": 1}
    assert back.persisted() == stored  # what no fact names is carried on as it was
