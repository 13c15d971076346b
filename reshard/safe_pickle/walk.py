"""Walking the values an unpickled object holds, through every container the allow-list can
produce: dicts of any kind, lists, tuples, sets, deques, ``argparse.Namespace``, numpy object
arrays, stand-ins (``reshard.safe_pickle.inert``) and ``formats.torch.zip``'s records.

Readers ask whether an object hides something (a refused global, a tensor still on disk);
writers replace leaves (a tensor by its storage record). Both must see inside a stand-in's
arguments or a deque as they see inside a dict, or a tensor there would be pickled as a
reshard-internal object, or a refused global slip through.
"""

from __future__ import annotations

import argparse
import collections
import copy
from collections.abc import Callable
from typing import Any

from reshard.core.errors import UnsupportedFormatError

__all__ = ["find_in", "path_to", "replace_in"]


def _is_object_array(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray" and value.dtype.hasobject


def _children(value: Any) -> list[Any] | None:
    """The values directly inside ``value``; None for a leaf."""
    if isinstance(value, dict):
        return [x for kv in value.items() for x in kv]
    if type(value) in (list, tuple, set, frozenset, collections.deque):
        return list(value)
    if isinstance(value, argparse.Namespace):
        return [x for kv in vars(value).items() for x in kv]
    if hasattr(type(value), "walk_children"):  # reshard's stand-ins and records
        return value.walk_children()
    if _is_object_array(value):
        return list(value.flat)
    return None


def find_in(value: Any, match: Callable[[Any], bool]) -> Any | None:
    """The first value inside ``value`` (itself included) for which ``match`` is true."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if match(item):
            return item
        inner = _children(item)
        if inner is not None and id(item) not in seen:
            seen.add(id(item))
            stack.extend(reversed(inner))
    return None


def path_to(value: Any, match: Callable[[Any], bool]) -> tuple | None:
    """The keys and indices leading from ``value`` to the first value inside it for which
    ``match`` is true (``()`` for ``value`` itself), None when there is none. Containers
    without keys of their own (a stand-in's arguments, a set) add no step."""
    seen: set[int] = set()
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if match(item):
            return path
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            steps = [(v, path + (k,)) for k, v in item.items()]
        elif type(item) in (list, tuple, collections.deque):
            steps = [(v, path + (i,)) for i, v in enumerate(item)]
        else:
            steps = [(v, path) for v in _children(item) or ()]
        stack.extend(reversed(steps))
    return None


def replace_in(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with every leaf ``x`` replaced by ``leaf(x)``; containers are rebuilt, with
    their own type (a defaultdict keeps its factory, a deque its maxlen), only where
    something inside them changed, so untouched values are returned as they are."""
    active: set[int] = set()

    def go(item: Any) -> Any:
        inner = _children(item)
        if inner is None:
            return leaf(item)
        if id(item) in active:
            raise UnsupportedFormatError("an object refers to itself (a cycle), which reshard does not copy")
        active.add(id(item))
        try:
            return _rebuilt(item, go)
        finally:
            active.discard(id(item))

    try:
        return go(value)
    except RecursionError:
        raise UnsupportedFormatError("an object is nested too deeply to copy") from None


def _rebuilt(item: Any, go: Callable[[Any], Any]) -> Any:
    if isinstance(item, dict):
        values = {k: go(v) for k, v in item.items()}
        if all(values[k] is v for k, v in item.items()):
            return item
        if type(item) is dict:
            return values
        out = copy.copy(item)  # OrderedDict, defaultdict, Counter: keeps order, factory, attributes
        for k, v in values.items():
            out[k] = v
        return out
    if isinstance(item, argparse.Namespace):
        fields = {k: go(v) for k, v in vars(item).items()}
        if all(fields[k] is v for k, v in vars(item).items()):
            return item
        namespace = copy.copy(item)
        vars(namespace).update(fields)
        return namespace
    if hasattr(type(item), "walk_children"):
        return item.remade(go)
    if _is_object_array(item):
        flat = item.reshape(-1)
        cells = [go(x) for x in flat]
        if all(a is b for a, b in zip(cells, flat)):
            return item
        array = flat.copy()
        for i, v in enumerate(cells):
            array[i] = v
        return array.reshape(item.shape)
    elements = [go(x) for x in item]
    if all(a is b for a, b in zip(elements, item)):
        return item
    if isinstance(item, collections.deque):
        return collections.deque(elements, item.maxlen)
    return type(item)(elements)
