"""The package's modules import each other without circles, counting the imports inside
functions too: a deferred import may save start-up time (torch, the CLI), never hide a circle.

The graph is read from the source (``ast``): ``import x``/``from x import y`` anywhere in a
module, ``__import__``/``import_module`` calls with a literal name, not counting a module
importing its own package's ``__init__`` (which every submodule import does anyway) when that
package is of the module's layer or below: the root package ``reshard`` (the public API, the
top layer) and any parent of a higher layer are counted, so ``import reshard`` in a command or
``import reshard.formats`` in the registry is an upward import like any other. Imports
under ``if TYPE_CHECKING:`` (annotations only) make no circle at run time and count only for
the layering rule, where a type named is a dependency too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ((ROOT / "reshard", "reshard"), (ROOT / "formats", "reshard.formats"))


def _modules() -> dict[str, Path]:
    found = {}
    for base, package in PACKAGES:
        for path in base.rglob("*.py"):
            parts = [package, *path.relative_to(base).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for child in node.body for n in ast.walk(child)}
    return skip


def _imported(module: str, path: Path, tree: ast.AST, annotations: bool) -> list[str]:
    names: list[str] = []
    skip = set() if annotations else _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            names += [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                "__import__", "import_module") and node.args and isinstance(node.args[0], ast.Constant):
            names.append(str(node.args[0].value))
    return names


def _edges(module: str, path: Path, tree: ast.AST, modules: dict[str, Path], annotations: bool) -> set[str]:
    """The package's modules that ``tree`` (module ``module``'s source) imports: each imported
    name trimmed to the module that holds it; its own package's ``__init__`` left out only
    when that package is not of a higher layer (the root package, the public API, never is)."""
    found = set()
    for name in _imported(module, path, tree, annotations):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        own_package = (module.startswith(name + ".") and modules[name].name == "__init__.py"
                       and layer_of(name) <= layer_of(module))
        if name and name != module and not own_package:
            found.add(name)
    return found


def import_graph(annotations: bool = False) -> dict[str, set[str]]:
    """Each module's imports of the package's modules; ``annotations``: those under ``if
    TYPE_CHECKING:`` too."""
    modules = _modules()
    return {module: _edges(module, path, ast.parse(path.read_text()), modules, annotations)
            for module, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_package_has_no_import_circles() -> None:
    graph = import_graph()
    assert len(graph) > 80 and graph["reshard.commands.convert"], "the scan found the package"
    assert circles(graph) == [], circles(graph)


def test_the_scan_sees_a_circle() -> None:
    """Not a rubber stamp: a circle hidden in a function is found."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    graph["reshard.core.sizes"].add("reshard.commands.convert")  # sizes is imported (indirectly) by convert
    assert any("reshard.core.sizes" in c for c in circles(graph))


# The registry, and the conversion's options built from what its formats declare.
REGISTRY = frozenset({"reshard.formats.registry", "reshard.formats.options"})


def format_imports_of_core(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(core module, format module) for every import of a format module by a module outside
    ``reshard.formats`` other than through the registry."""
    return sorted((module, name) for module, names in graph.items() if not module.startswith("reshard.formats")
                  for name in names if name.startswith("reshard.formats.") and name not in REGISTRY)


def test_the_core_reaches_formats_only_through_the_registry() -> None:
    """Formats build on the core, never the reverse: the core asks the registry for what a
    format can do (docs/architecture.md)."""
    assert format_imports_of_core(import_graph()) == []


def test_the_rule_sees_a_core_module_importing_a_format() -> None:
    assert format_imports_of_core({"reshard.commands.convert": {"reshard.formats.registry", "reshard.formats.hf.format"},
                                   "reshard.formats.hf.format": {"reshard.core.catalog", "reshard.formats.safetensors"}}) == [
        ("reshard.commands.convert", "reshard.formats.hf.format")]
    graph = import_graph()
    graph["reshard.commands.verify"].add("reshard.formats.zarr.meta")
    assert ("reshard.commands.verify", "reshard.formats.zarr.meta") in format_imports_of_core(graph)


# The catalog is the bottom layer: plain data that formats build and every other module reads.
# It builds on box arithmetic, dtypes and sizes (and the errors they raise), never on what
# builds on it (meshes, plans, the target an output will hold: reshard/core/target.py). Its
# facts (reshard/core/facts.py) are plain typed values too.
CATALOG_BUILDS_ON = {"reshard.core.boxes", "reshard.core.dtypes", "reshard.core.errors", "reshard.core.sizes",
                     "reshard.core.facts"}


def reached(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every module ``module`` imports, directly or through others."""
    seen: set[str] = set()
    work = [module]
    while work:
        for name in graph[work.pop()] - seen:
            seen.add(name)
            work.append(name)
    return seen - {module}


def test_the_catalog_imports_nothing_above_it() -> None:
    """Counting annotations: ``Target`` named ``MeshSpec`` under ``TYPE_CHECKING`` when it
    lived in catalog.py, and that was the one upward import in the package."""
    graph = import_graph(annotations=True)
    assert reached(graph, "reshard.core.catalog") - CATALOG_BUILDS_ON == set()
    assert graph["reshard.core.catalog"] >= {"reshard.core.boxes", "reshard.core.dtypes"}  # the scan sees its imports
    assert "reshard.core.sharding" in graph["reshard.core.target"]


def test_the_rule_sees_the_catalog_importing_upward() -> None:
    """Not a rubber stamp: an annotation-only import of a mesh, and an upward import reached
    through a module the catalog may import, are both found."""
    planted = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from reshard.core.sharding import MeshSpec\n")
    catalog = ROOT / "reshard" / "core" / "catalog.py"
    assert "reshard.core.sharding" in _imported("reshard.core.catalog", catalog, planted, annotations=True)
    assert "reshard.core.sharding" not in _imported("reshard.core.catalog", catalog, planted, annotations=False)
    graph = import_graph(annotations=True)
    graph["reshard.core.catalog"].add("reshard.core.sharding")
    assert reached(graph, "reshard.core.catalog") - CATALOG_BUILDS_ON == {"reshard.core.sharding"}
    graph = import_graph(annotations=True)
    graph["reshard.core.sizes"].add("reshard.pipeline.plan")  # plan reaches the mesh, conventions, pieces...
    assert {"reshard.pipeline.plan", "reshard.core.target", "reshard.core.sharding"} <= reached(graph, "reshard.core.catalog")


def script_graph() -> dict[str, set[str]]:
    """The benchmark scripts' imports of each other (scripts/ is on ``sys.path`` when they run,
    so they import by bare name)."""
    paths = {p.stem: p for p in (ROOT / "scripts").glob("*.py")}
    return {name: {n for n in _imported(name, path, ast.parse(path.read_text()), annotations=True) if n in paths}
            for name, path in paths.items()}


def test_the_bench_scripts_have_no_import_circle() -> None:
    """bench.py picks a mode and imports its module; every mode, and bench.py, measures with
    bench_harness, which imports no benchmark module: no mode imports bench.py back."""
    graph = script_graph()
    assert {"bench_scale", "bench_paths", "bench_many", "bench_zarr"} <= graph["bench"], "the scan sees the modes"
    assert circles(graph) == []
    assert [name for name, names in graph.items() if "bench" in names] == []
    assert graph["bench_harness"] == set()
    graph["bench_many"].add("bench")  # planted: a mode reaching into bench.py again
    assert circles(graph) == [["bench", "bench_many"]]


def _string_constants(path: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_convert_names_no_format() -> None:
    """What a format can do is its registry entry's: convert.py compares no format name."""
    from reshard.formats.registry import FORMATS

    names = {e.name for e in FORMATS}
    assert len(names) > 8
    assert _string_constants(ROOT / "reshard" / "commands" / "convert.py") & names == set()
    assert _string_constants(ROOT / "formats" / "registry.py") & names == names  # the scan sees the table's names


def print_calls(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"]


def test_the_library_prints_nothing() -> None:
    """What the library says goes to the ``reshard`` logger (reshard.core.log); printing is the
    CLI's job, through typer (and a launch's, through a handler it attaches)."""
    found = {str(path.relative_to(ROOT)): lines for path in _modules().values()
             if (lines := print_calls(ast.parse(path.read_text())))}
    assert found == {}
    assert print_calls(ast.parse("def f():\n    print('x', flush=True)\n")) == [2]  # the scan sees one


# The layers, bottom first: a module may import its own layer and those below, never above.
# ``reshard.formats.registry`` is the seam: the features and everything above ask it what a
# format can do, and a format is reached only through it. A format imports only the data
# model, safe unpickling, the pipeline and the registry: what the HF writer needs of the
# features (the architecture check) reaches it through the registry entry's ``prepare`` step
# (the export records the check in the target's facts). Annotations count: a type named is a
# dependency too.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("data model", ("reshard.core",)),
    ("safe unpickling", ("reshard.safe_pickle",)),
    ("pipeline", ("reshard.pipeline",)),
    ("format registry", ("reshard.formats.registry", "reshard.formats.options")),
    ("formats", ("reshard.formats",)),
    ("features", ("reshard.features",)),
    ("sources and runtime", ("reshard.sources", "reshard.runtime", "reshard.train")),
    ("commands", ("reshard.commands",)),
    ("command line", ("reshard.cli",)),
    ("public API", ("reshard",)),
)


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of the longest package prefix that holds ``module``."""
    best, found = -1, -1
    for i, (_, packages) in enumerate(LAYERS):
        for package in packages:
            if (module == package or module.startswith(package + ".")) and len(package) > best:
                best, found = len(package), i
    assert found >= 0, module
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({LAYERS[layer_of(m)][0]}) -> {n} ({LAYERS[layer_of(n)][0]})"
                  for m, names in graph.items() for n in names if layer_of(n) > layer_of(m))


def test_every_module_imports_only_its_layer_and_below() -> None:
    graph = import_graph(annotations=True)
    assert {layer_of(m) for m in graph} == set(range(len(LAYERS))), "every layer holds modules"
    assert upward_imports(graph) == []


def test_the_layer_rule_sees_an_upward_import() -> None:
    """Not a rubber stamp: a planted import of a feature by the engine, and one hidden in a
    function of the data model, are both found."""
    graph = import_graph(annotations=True)
    graph["reshard.pipeline.engine"].add("reshard.features.lora")
    planted = ast.parse("def f():\n    from reshard.commands.convert import convert\n")
    graph["reshard.core.sizes"] |= set(_imported("reshard.core.sizes", ROOT / "reshard" / "core" / "sizes.py", planted,
                                                 annotations=True)) & set(graph)
    assert upward_imports(graph) == [
        "reshard.core.sizes (data model) -> reshard.commands.convert (commands)",
        "reshard.pipeline.engine (pipeline) -> reshard.features.lora (features)"]


def test_nothing_below_the_api_imports_the_root_package() -> None:
    """``reshard`` (its ``__init__``) is the public API, the top layer: a command, the CLI, a
    format or the training loop calls the module that defines what it needs, never the root
    package (whose names are that module's, imported lazily)."""
    graph = import_graph(annotations=True)
    assert [m for m, names in graph.items() if "reshard" in names] == []
    assert "reshard.core.version" in graph["reshard"], "the scan sees the root's own imports"


def _planted(module: str, source: str) -> set[str]:
    """The edges of ``module`` with ``source`` added to its own."""
    modules = _modules()
    path = modules[module]
    tree = ast.parse(path.read_text() + "\n" + source)
    return _edges(module, path, tree, modules, annotations=True)


def test_the_layer_rule_sees_imports_of_the_root_and_of_a_higher_parent() -> None:
    """Not a rubber stamp: ``import reshard`` in a function of a command and of the training
    loop, ``from reshard import __version__`` in a format, and the registry importing its own
    parent package (``reshard.formats``, a layer above it) are each an upward import; a module
    importing its own package of the same layer (``reshard.core``) is not."""
    graph = import_graph(annotations=True)
    graph["reshard.commands.validate"] = _planted("reshard.commands.validate", "def f():\n    import reshard\n")
    graph["reshard.train.loop"] = _planted("reshard.train.loop", "def f():\n    import reshard\n    reshard.inspect('x')\n")
    graph["reshard.formats.dcp.metadata"] = _planted("reshard.formats.dcp.metadata", "from reshard import __version__\n")
    graph["reshard.formats.registry"] = _planted("reshard.formats.registry", "import reshard.formats\n")
    graph["reshard.core.sizes"] = _planted("reshard.core.sizes", "import reshard.core\nfrom reshard.core import errors\n")
    assert upward_imports(graph) == [
        "reshard.commands.validate (commands) -> reshard (public API)",
        "reshard.formats.dcp.metadata (formats) -> reshard (public API)",
        "reshard.formats.registry (format registry) -> reshard.formats (formats)",
        "reshard.train.loop (sources and runtime) -> reshard (public API)"]
    assert sorted(m for m, names in graph.items() if "reshard" in names) == [
        "reshard.commands.validate", "reshard.formats.dcp.metadata", "reshard.train.loop"]


FORMATS_BUILD_ON = ("reshard.core", "reshard.safe_pickle", "reshard.pipeline", "reshard.formats")


def format_imports_above_the_pipeline(graph: dict[str, set[str]]) -> list[str]:
    """``format module -> module`` for each import by a format of anything but the data model,
    safe unpickling, the pipeline and the formats (the registry among them)."""
    return sorted(f"{m} -> {n}" for m, names in graph.items() if m.startswith("reshard.formats.")
                  for n in names if not any(n == p or n.startswith(p + ".") for p in FORMATS_BUILD_ON))


def test_formats_import_only_the_core_safe_pickle_the_pipeline_and_the_registry() -> None:
    graph = import_graph(annotations=True)
    assert format_imports_above_the_pipeline(graph) == []
    assert {"reshard.core.dtypes", "reshard.formats.safetensors.format"} <= graph["reshard.formats.hf.files"] | graph[
        "reshard.formats.hf.format"], "the scan sees the HF writer's imports"


def test_the_rules_see_a_format_importing_a_feature_or_the_root() -> None:
    """Not a rubber stamp: the HF writer importing the architecture check (as it did, in a
    function here) and a DCP module importing the root package for its version are found,
    by this rule and by the layers."""
    graph = import_graph(annotations=True)
    graph["reshard.formats.hf.format"] = _planted(
        "reshard.formats.hf.format", "def f():\n    from reshard.features.architecture import require_architecture\n")
    graph["reshard.formats.dcp.metadata"] = _planted("reshard.formats.dcp.metadata", "from reshard import __version__\n")
    assert format_imports_above_the_pipeline(graph) == ["reshard.formats.dcp.metadata -> reshard",
                                                        "reshard.formats.hf.format -> reshard.features.architecture"]
    assert upward_imports(graph) == ["reshard.formats.dcp.metadata (formats) -> reshard (public API)",
                                     "reshard.formats.hf.format (formats) -> reshard.features.architecture (features)"]


def test_the_root_holds_only_the_api() -> None:
    """reshard/'s own modules are the package's ``__init__`` (the public API) and ``__main__``;
    every other module lives in the package of its layer, whose docstring names the layer."""
    assert sorted(p.name for p in (ROOT / "reshard").glob("*.py")) == ["__init__.py", "__main__.py"]
    for _, packages in LAYERS[:-1]:
        for package in packages:
            if package.startswith("reshard.formats"):
                continue
            init = ROOT / package.replace(".", "/") / "__init__.py"
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            assert "layer" in doc.lower(), f"{init}: its docstring does not name its layer"
