"""Applying a key map to a catalog: find every model FQN, route it, build the renamed entries.

The map itself (``reshard.keymap``) only says where one FQN goes (a ``Route``); this module
finds FQNs wherever a checkpoint keeps them (``model.<fqn>``, ``optim.state.<fqn>.<key>``,
``optim.param_groups.N.params`` lists, flat HF names) and makes every tensor stored under an
FQN follow it: the parameter and its optimizer state alike. 0-d state (``step``) is renamed
only; state shaped like its parameter is permuted, split or merged with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from reshard.catalog import Catalog, NestedPath, TensorEntry
from reshard.errors import UsageError
from reshard.keymap_chunks import gathered_entry, part_chunks, rope_rows, shifted_chunks

__all__ = ["Route", "Router", "apply_keymap", "located"]

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "step", "sum")


@dataclass(frozen=True)
class Route:
    """Where one FQN goes: ``kind`` is ``rename``, ``split`` or ``merge``; ``names`` the new
    FQN (or a split's parts); ``rope`` (heads param, to_halves) permutes q/k rows; a merge
    also says which ``part`` this FQN is of ``siblings``."""

    kind: str
    names: tuple[str, ...]
    rope: tuple[str, bool] | None = None
    ratio: tuple[int | str, ...] = ()
    dim: int = 0
    part: int = 0
    siblings: tuple[str, ...] = ()


class Router(Protocol):
    name: str

    def route(self, fqn: str) -> Route | None: ...

    def param(self, name: str, catalog: Catalog, found: dict[str, int]) -> int: ...


def located(name: str, path: NestedPath) -> tuple[NestedPath, str, NestedPath] | None:
    """(prefix, model FQN, suffix) of a catalog name, or None for names outside the model
    and optimizer state (``train.step``...). ``path`` is the name's nested path."""
    if len(path) >= 2 and path[0] == "model":
        return ("model",), ".".join(str(p) for p in path[1:]), ()
    if len(path) == 4 and path[:2] == ("optim", "state") and isinstance(path[2], str):
        return ("optim", "state"), path[2], (path[3],)
    if len(path) != 1:
        return None
    head, _, key = name.rpartition(".")
    if name.startswith("optim.state.") and key in _STATE_KEYS and len(head) > len("optim.state."):
        return ("optim", "state"), head.removeprefix("optim.state."), (key,)
    return (), name, ()


def _routed(km: Router, loc: tuple[NestedPath, str, NestedPath]) -> tuple[NestedPath, str, NestedPath, Route] | None:
    prefix, fqn, suffix = loc
    route = km.route(fqn)
    if route is None and prefix == () and fqn.startswith("model."):
        # A flat ``model.<fqn>`` (a format without nested paths): try it as a model section.
        prefix, fqn = ("model",), fqn.removeprefix("model.")
        route = km.route(fqn)
    return None if route is None else (prefix, fqn, suffix, route)


class _Builder:
    def __init__(self, km: Router, catalog: Catalog) -> None:
        self.km, self.src = km, catalog
        self.out = Catalog(catalog.format, catalog.path, attrs=dict(catalog.attrs))
        self.found: dict[str, int] = {}
        self.owner: dict[str, str] = {}
        self.merges: dict[tuple[Any, ...], dict[int, tuple[str, TensorEntry]]] = {}

    def emit(self, name: str, path: NestedPath | None, entry: TensorEntry | None, value: Any, src: str) -> None:
        if name in self.owner:
            raise UsageError(f"key map {self.km.name!r} sends both {self.owner[name]!r} and {src!r} to {name!r}")
        self.owner[name] = src
        if entry is not None:
            self.out.tensors[name] = entry
        else:
            self.out.objects[name] = value
        if path is not None:
            self.out.paths[name] = path

    def sizes(self, route: Route, entry: TensorEntry, src: str) -> list[int]:
        ratio = [self.km.param(r, self.src, self.found) if isinstance(r, str) else r for r in route.ratio]
        total = entry.shape[route.dim]
        if sum(ratio) <= 0 or total % sum(ratio):
            raise UsageError(f"{src}: dim {route.dim} of size {total} does not split in the ratio {ratio}")
        return [r * (total // sum(ratio)) for r in ratio]

    def tensor(self, name: str, entry: TensorEntry) -> None:
        path = self.src.nested_path(name)
        loc = located(name, path)
        hit = None if loc is None else _routed(self.km, loc)
        if hit is None:
            self.emit(name, self.src.paths.get(name), entry, None, name)
            return
        prefix, _, suffix, route = hit
        explicit = name in self.src.paths

        def where(fqn: str) -> tuple[str, NestedPath | None]:
            return ".".join(prefix + (fqn,) + suffix), (prefix + (fqn,) + suffix) if explicit else None

        if route.kind == "rename":
            new, new_path = where(route.names[0])
            renamed = TensorEntry(new, entry.shape, entry.dtype, entry.chunks)
            if route.rope is not None and entry.shape:
                heads = self.km.param(route.rope[0], self.src, self.found)
                renamed = gathered_entry(new, entry, rope_rows(entry.shape[0], heads, to_halves=route.rope[1]))
            self.emit(new, new_path, renamed, None, name)
        elif route.kind == "split":
            if len(entry.shape) <= route.dim:  # 0-d state (step) belongs to every part
                for part in route.names:
                    new, new_path = where(part)
                    self.emit(new, new_path, TensorEntry(new, entry.shape, entry.dtype, entry.chunks), None, name)
                return
            start = 0
            for part, size in zip(route.names, self.sizes(route, entry, name)):
                new, new_path = where(part)
                shape = tuple(size if d == route.dim else s for d, s in enumerate(entry.shape))
                self.emit(new, new_path, TensorEntry(new, shape, entry.dtype, part_chunks(entry, route.dim, start, size)), None, name)
                start += size
        else:
            key = (prefix, route.names[0], suffix, explicit, route.siblings, route.dim)
            self.merges.setdefault(key, {})[route.part] = (name, entry)

    def merge(self, key: tuple[Any, ...], parts: dict[int, tuple[str, TensorEntry]]) -> None:
        prefix, fused, suffix, explicit, siblings, dim = key
        missing = [s for k, s in enumerate(siblings) if k not in parts]
        first_name, first = parts[min(parts)]
        if missing:
            raise UsageError(f"{self.src.path}: merging into {fused!r} needs {missing[0]!r}, which the checkpoint lacks "
                             f"(it has {first_name!r})")
        name = ".".join(prefix + (fused,) + suffix)
        path = prefix + (fused,) + suffix if explicit else None
        if len(first.shape) <= dim:  # 0-d state: the parts share one step
            self.emit(name, path, TensorEntry(name, first.shape, first.dtype, first.chunks), None, first_name)
            return
        chunks, start = [], 0
        for k in range(len(siblings)):
            src, e = parts[k]
            other = tuple(s for d, s in enumerate(e.shape) if d != dim)
            if e.dtype != first.dtype or other != tuple(s for d, s in enumerate(first.shape) if d != dim):
                raise UsageError(f"{src}: {e.dtype} {list(e.shape)} cannot be merged with {first_name} "
                                 f"({first.dtype} {list(first.shape)}) along dim {dim}")
            chunks += shifted_chunks(e, dim, start)
            start += e.shape[dim]
        shape = tuple(start if d == dim else s for d, s in enumerate(first.shape))
        self.emit(name, path, TensorEntry(name, shape, first.dtype, chunks), None, first_name)

    def fqn_list(self, value: list[Any]) -> list[Any]:
        """An ``optim.param_groups.N.params`` list of FQNs, mapped the way the tensors were."""
        out: list[Any] = []
        for v in value:
            route = self.km.route(v) if isinstance(v, str) else None
            names = [v] if route is None else list(route.names)
            out += [n for n in names if n not in out]
        return out

    def obj(self, name: str, value: Any) -> None:
        path = self.src.nested_path(name)
        is_params = (len(path) == 4 and path[:2] == ("optim", "param_groups") and path[3] == "params") or (
            len(path) == 1 and name.startswith("optim.param_groups.") and name.endswith(".params"))
        if is_params and isinstance(value, list):
            value = self.fqn_list(value)
        loc = located(name, path)
        hit = None if loc is None or loc[0] != ("optim", "state") else _routed(self.km, loc)
        if hit is None:
            self.emit(name, self.src.paths.get(name), None, value, name)
            return
        prefix, _, suffix, route = hit
        if route.kind == "merge" and route.part:
            return  # a merged parameter keeps the state of its first part
        for fqn in route.names:
            new = ".".join(prefix + (fqn,) + suffix)
            self.emit(new, prefix + (fqn,) + suffix if name in self.src.paths else None, None, value, name)


def apply_keymap(km: Router, catalog: Catalog) -> Catalog:
    """``catalog`` with every tensor and object renamed (and transformed) by ``km``."""
    b = _Builder(km, catalog)
    for name, entry in catalog.tensors.items():
        b.tensor(name, entry)
    for key, parts in b.merges.items():
        b.merge(key, parts)
    for name, value in catalog.objects.items():
        b.obj(name, value)
    return b.out
