"""Applying a key map to a catalog: find every model FQN, route it, build the renamed entries.

The map itself (``reshard.features.keymap.maps``) only says where one FQN goes (a ``Route``); this module
finds FQNs wherever the checkpoint's layout keeps them (``reshard.core.conventions``: ``model.<fqn>``,
``optim.state.<fqn>.<key>``, torchtitan's ``optimizer.state.<fqn>.<key>`` and
``optimizer.param_groups.<fqn>.<key>``, ``param_groups.N.params`` lists, flat HF names) and
makes everything stored under an FQN follow it: the parameter and its optimizer state alike. 0-d state (``step``) is renamed
only; state shaped like its parameter is permuted, split or merged with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from reshard.core.boxes import Box
from reshard.core.catalog import Catalog, Chunk, NestedPath, ObjectTable, TensorEntry, object_loader
from reshard.core.chunk_reads import gathered_entry, index_chunks, part_chunks, rope_rows, shifted_chunks, stacked_chunks
from reshard.core.conventions import OPTIM_GROUP, OPTIM_STATE, PARAM, Place, detect_layout, rename_path
from reshard.core.errors import UsageError
from reshard.core.sizes import plural

__all__ = ["INDEX", "Route", "Router", "apply_keymap"]

# Stands for the index in an unstacked tensor's name until the index is known.
INDEX = "\x00"


@dataclass(frozen=True)
class Route:
    """Where one FQN goes: ``kind`` is ``rename``, ``split``, ``merge``, ``unstack``, ``stack``
    or ``drop``; ``names`` the new FQN (a split's parts; an unstack's name with ``INDEX`` for
    the index); ``rope`` (heads param, to_halves) permutes q/k rows; a merge also says which
    ``part`` this FQN is of ``siblings``, a stack which index ``part`` it is."""

    kind: str
    names: tuple[str, ...]
    rope: tuple[str, bool] | None = None
    ratio: tuple[int | str, ...] = ()
    dim: int = 0
    part: int = 0
    siblings: tuple[str, ...] = ()
    groups: int | str | None = None  # a split's or merge's parts interleaved in this many groups


class Router(Protocol):
    @property
    def name(self) -> str: ...  # read-only: a KeyMap is frozen

    def route(self, fqn: str) -> Route | None: ...

    def param(self, name: str, catalog: Catalog, found: dict[str, int]) -> int: ...


def _routed(km: Router, place: Place) -> tuple[Place, Route] | None:
    """Where the FQN of ``place`` goes, or None when the map does not touch it."""
    if place.fqn is None:
        return None
    route = km.route(place.fqn)
    if route is None and not place.prefix and place.fqn.startswith("model."):
        # A flat ``model.<fqn>`` (no nesting to say whether model is a section): try it as one.
        fqn = place.fqn.removeprefix("model.")
        place = place._replace(fqn=fqn, prefix="model.")
        route = km.route(fqn)
    return None if route is None else (place, route)


class _Builder:
    def __init__(self, km: Router, catalog: Catalog) -> None:
        self.km, self.src = km, catalog
        self.layout = detect_layout(catalog)
        self.objects = ObjectTable()  # self.out's
        self.out = Catalog(catalog.format, catalog.path, objects=self.objects, facts=catalog.facts.copy(),
                           notices=list(catalog.notices))
        self.found: dict[str, int] = {}
        self.owner: dict[str, str] = {}
        self.merges: dict[tuple[Any, ...], dict[int, tuple[str, TensorEntry, Place]]] = {}
        self.merge_routes: dict[tuple[Any, ...], Route] = {}
        self.stacks: dict[tuple[Any, ...], dict[int, tuple[str, TensorEntry, Place]]] = {}
        self.dropped: list[str] = []

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

    def group_count(self, route: Route, sizes: list[int], src: str) -> int:
        """How many groups a split's parts interleave in (1: one block per part)."""
        if route.groups is None:
            return 1
        n = self.km.param(route.groups, self.src, self.found) if isinstance(route.groups, str) else route.groups
        if n <= 0 or any(s % n for s in sizes):
            raise UsageError(f"{src}: parts of sizes {sizes} along dim {route.dim} do not interleave in {n} groups")
        return n

    def split_part(self, entry: TensorEntry, route: Route, sizes: list[int], k: int, groups: int) -> list[Chunk]:
        """Part ``k``'s chunks: its block, or with groups its slice of every group, placed one
        after the other (box arithmetic on the stored chunks, nothing read)."""
        per_group, total = sum(sizes) // groups, sizes[k] // groups
        chunks = []
        for g in range(groups):
            start = g * per_group + sum(sizes[:k]) // groups
            for c in part_chunks(entry, route.dim, start, total):
                offsets = tuple(o + g * total if d == route.dim else o for d, o in enumerate(c.box.offsets))
                chunks.append(Chunk(Box(offsets, c.box.sizes), c.data))
        return chunks

    def where(self, name: str, place: Place, fqn: str) -> tuple[str, NestedPath | None]:
        """The new flat name and, when the source recorded one, nested path for ``fqn``."""
        path = self.src.paths.get(name)
        return place.prefix + fqn + place.suffix, None if path is None else rename_path(path, name, place, fqn)

    def tensor(self, name: str, entry: TensorEntry) -> None:
        place = self.layout.place(name)
        hit = _routed(self.km, place) if place.role in (PARAM, OPTIM_STATE) else None
        if hit is None:
            self.emit(name, self.src.paths.get(name), entry, None, name)
            return
        place, route = hit

        def where(fqn: str) -> tuple[str, NestedPath | None]:
            return self.where(name, place, fqn)

        if route.kind == "rename":
            new, new_path = where(route.names[0])
            renamed = entry.renamed(new)
            if route.rope is not None and entry.shape:
                heads = self.km.param(route.rope[0], self.src, self.found)
                renamed = gathered_entry(new, entry, rope_rows(entry.shape[0], heads, to_halves=route.rope[1]))
            self.emit(new, new_path, renamed, None, name)
        elif route.kind == "drop":
            self.dropped.append(name)
        elif route.kind == "unstack" and len(entry.shape) <= route.dim:  # 0-d state (step): every index's
            for fqn in self.targets(place.fqn or "", route):
                new, new_path = where(fqn)
                self.emit(new, new_path, entry.renamed(new), None, name)
        elif route.kind == "unstack":
            self.unstack(name, entry, route, where)
        elif route.kind == "stack":
            key: tuple[Any, ...] = (place.prefix, route.names[0], place.suffix, route.dim)
            parts = self.stacks.setdefault(key, {})
            if route.part in parts:
                raise UsageError(f"key map {self.km.name!r}: {parts[route.part][0]!r} and {name!r} are both index "
                                 f"{route.part} of {route.names[0]!r}")
            parts[route.part] = (name, entry, place)
        elif route.kind == "split":
            if len(entry.shape) <= route.dim:  # 0-d state (step) belongs to every part
                for part in route.names:
                    new, new_path = where(part)
                    self.emit(new, new_path, entry.renamed(new), None, name)
                return
            sizes = self.sizes(route, entry, name)
            groups = self.group_count(route, sizes, name)
            for k, (part, size) in enumerate(zip(route.names, sizes)):
                new, new_path = where(part)
                shape = tuple(size if d == route.dim else s for d, s in enumerate(entry.shape))
                self.emit(new, new_path, TensorEntry(new, shape, entry.dtype, self.split_part(entry, route, sizes, k, groups)),
                          None, name)
        else:
            key = (place.prefix, route.names[0], place.suffix, route.siblings, route.dim)
            self.merges.setdefault(key, {})[route.part] = (name, entry, place)
            self.merge_routes[key] = route

    def unstack(self, name: str, entry: TensorEntry, route: Route, where: Any) -> None:
        """One tensor per index along ``route.dim`` (grouped MoE experts -> one per expert),
        each a view of the stored chunks: nothing is read here, and an expert is never more
        than its own chunks' parts when the engine reads it."""
        for i in range(entry.shape[route.dim]):
            new, new_path = where(route.names[0].replace(INDEX, str(i)))
            shape = entry.shape[:route.dim] + entry.shape[route.dim + 1:]
            self.emit(new, new_path, TensorEntry(new, shape, entry.dtype, index_chunks(entry, route.dim, i)), None, name)

    def stack(self, key: tuple[Any, ...], parts: dict[int, tuple[str, TensorEntry, Place]]) -> None:
        _, stacked, _, dim = key
        missing = sorted(set(range(max(parts) + 1)) - set(parts))
        first_name, first, place = parts[min(parts)]
        if missing:
            raise UsageError(f"{self.src.path}: stacking into {stacked!r} needs index {missing[0]} (found "
                             f"{len(parts)} of {max(parts) + 1}, e.g. {first_name!r})")
        name, path = self.where(first_name, place, stacked)
        if not first.shape:  # 0-d state (step) of every index: one value stands for them all
            self.emit(name, path, TensorEntry(name, first.shape, first.dtype, first.chunks), None, first_name)
            return
        chunks = []
        for i in range(len(parts)):
            src, e, _ = parts[i]
            if (e.shape, e.dtype) != (first.shape, first.dtype):
                raise UsageError(f"{src}: {e.dtype} {list(e.shape)} cannot be stacked with {first_name} "
                                 f"({first.dtype} {list(first.shape)})")
            chunks += stacked_chunks(e, dim, i)
        shape = first.shape[:dim] + (len(parts),) + first.shape[dim:]
        self.emit(name, path, TensorEntry(name, shape, first.dtype, chunks), None, first_name)

    def merge(self, key: tuple[Any, ...], parts: dict[int, tuple[str, TensorEntry, Place]]) -> None:
        _, fused, _, siblings, dim = key
        missing = [s for k, s in enumerate(siblings) if k not in parts]
        first_name, first, place = parts[min(parts)]
        if missing:
            raise UsageError(f"{self.src.path}: merging into {fused!r} needs {missing[0]!r}, which the checkpoint lacks "
                             f"(it has {first_name!r})")
        name, path = self.where(first_name, place, fused)
        if len(first.shape) <= dim:  # 0-d state: the parts share one step
            self.emit(name, path, TensorEntry(name, first.shape, first.dtype, first.chunks), None, first_name)
            return
        for k in range(len(siblings)):
            src, e, _ = parts[k]
            other = tuple(s for d, s in enumerate(e.shape) if d != dim)
            if e.dtype != first.dtype or other != tuple(s for d, s in enumerate(first.shape) if d != dim):
                raise UsageError(f"{src}: {e.dtype} {list(e.shape)} cannot be merged with {first_name} "
                                 f"({first.dtype} {list(first.shape)}) along dim {dim}")
        sizes = [parts[k][1].shape[dim] for k in range(len(siblings))]
        groups = self.group_count(self.merge_routes[key], sizes, first_name)
        chunks, start = [], 0
        for g in range(groups):  # with groups: each part's slice of group g, one after the other
            for k in range(len(siblings)):
                e, n = parts[k][1], sizes[k] // groups
                chunks += shifted_chunks(TensorEntry(e.name, e.shape, e.dtype, part_chunks(e, dim, g * n, n)), dim, start)
                start += n
        shape = tuple(start if d == dim else s for d, s in enumerate(first.shape))
        self.emit(name, path, TensorEntry(name, shape, first.dtype, chunks), None, first_name)

    def targets(self, fqn: str, route: Route) -> list[str]:
        """The FQNs an object kept per parameter goes to: each part of a split, every index of
        an unstack (as many as the parameter has), the stacked tensor once, nothing for a drop."""
        if route.kind == "drop" or (route.kind in ("merge", "stack") and route.part):
            return []  # a merged or stacked parameter keeps the first part's
        if route.kind != "unstack":
            return list(route.names)
        entry = next((self.src.tensors[n] for n in self.src.tensors
                      if self.layout.place(n).role == PARAM and self.layout.place(n).fqn == fqn), None)
        if entry is None or len(entry.shape) <= route.dim:
            raise UsageError(f"key map {self.km.name!r}: {fqn!r} is unstacked, but the checkpoint has no such "
                             "parameter to count its parts")
        return [route.names[0].replace(INDEX, str(i)) for i in range(entry.shape[route.dim])]

    def fqn_list(self, value: list[Any]) -> list[Any]:
        """An ``optim.param_groups.N.params`` list of FQNs, mapped the way the tensors were."""
        out: list[Any] = []
        for v in value:
            route = self.km.route(v) if isinstance(v, str) else None
            names = [v] if route is None else self.targets(v, route)
            out += [n for n in names if n not in out]
        return out

    def obj(self, name: str) -> None:
        place = self.layout.place(name)
        if place.role not in (OPTIM_STATE, OPTIM_GROUP):  # untouched: passed on unread
            self.emit(name, self.src.paths.get(name), None, None, name)
            self.objects.set_lazy(name, object_loader(self.src.objects, name))
            return
        value = self.src.objects[name]
        if place.role == OPTIM_GROUP and place.key == "params" and isinstance(value, list):
            value = self.fqn_list(value)
        # Objects kept per parameter (non-tensor optimizer state, hyper-parameters keyed by FQN)
        # follow it like its tensors.
        hit = _routed(self.km, place)
        if hit is None:
            self.emit(name, self.src.paths.get(name), None, value, name)
            return
        place, route = hit
        for fqn in self.targets(place.fqn or "", route):
            new, new_path = self.where(name, place, fqn)
            self.emit(new, new_path, None, value, name)


def apply_keymap(km: Router, catalog: Catalog) -> Catalog:
    """``catalog`` with every tensor and object renamed (and transformed) by ``km``."""
    b = _Builder(km, catalog)
    for name, entry in catalog.tensors.items():
        b.tensor(name, entry)
    for key, parts in b.merges.items():
        b.merge(key, parts)
    for key, stacked in b.stacks.items():
        b.stack(key, stacked)
    if b.dropped:
        b.out.notices.append(f"left out {plural(len(b.dropped), 'tensor')} the other side's model does not have ({km.name}): "
                             + ", ".join(b.dropped[:4]) + (" ..." if len(b.dropped) > 4 else ""))
    for name in catalog.objects:
        b.obj(name)
    b.out.renamed_from = {new: catalog.source_name(src) for new, src in b.owner.items()
                          if new in b.out.tensors and catalog.source_name(src) != new}
    return b.out
