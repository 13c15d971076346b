"""How a flat name sits in its nested state dict, and what each container on the way is.

A flat name (``optim.state.0.exp_avg``) cannot say whether ``0`` is a list index or an int
key of a dict (a plain optimizer's ``state``), nor whether a sequence was a list or a tuple.
Catalogs keep each name's nested path (``catalog.paths``) and, for containers the keys alone
would rebuild wrongly, their kind (``catalog.facts.containers``: ``"dict"`` for an
int-keyed dict, ``"tuple"``). This module turns those into what other tools expect:
torch's DCP names dict keys ``str(key)`` and list items by int index, so an int-keyed dict
is written with string keys exactly as ``dcp.save`` would, and read back with its int keys
from the record reshard keeps beside it.
"""

from __future__ import annotations

from collections.abc import Mapping

from reshard.core.catalog import NestedPath
from reshard.core.errors import CorruptCheckpointError

__all__ = ["CONTAINERS_KEY", "Containers", "dcp_path", "from_dcp_path", "container_steps", "describe_steps",
           "containers_to_json", "containers_from_json"]

# ``Facts.containers``: {nested path of a container: "dict" | "tuple"} where the keys alone
# would rebuild the wrong type (int keys mean a list otherwise).
Containers = Mapping[NestedPath, str]
# Where formats that store JSON (safetensors metadata, zarr attributes) keep them.
CONTAINERS_KEY = "reshard.containers"


def dcp_path(path: NestedPath, containers: Containers) -> NestedPath:
    """``path`` as torch's ``dcp.save`` records it in ``planner_data``: every dict key a
    string (``traverse_state_dict`` uses ``str(key)``), list and tuple items by int index."""
    return tuple(str(key) if type(key) is int and containers.get(path[:i]) == "dict" else key
                 for i, key in enumerate(path))


def from_dcp_path(path: NestedPath, containers: Containers) -> NestedPath:
    """The inverse of ``dcp_path`` given the containers reshard recorded: the keys of an
    int-keyed dict back to ints."""
    out: list[str | int] = []
    for key in path:
        if isinstance(key, str) and containers.get(tuple(out)) == "dict" and key.lstrip("-").isdigit():
            out.append(int(key))
        else:
            out.append(key)
    return tuple(out)


def container_steps(path: NestedPath, containers: Containers) -> tuple[tuple[str, str | int], ...]:
    """Each step of ``path`` with the container it goes through: a str key of a ``dict``, an
    int key of a ``dict``, an index of a ``list`` or of a ``tuple``."""
    return tuple((containers.get(path[:i]) or ("list" if type(key) is int else "dict"), key)
                 for i, key in enumerate(path))


def describe_steps(steps: tuple[tuple[str, str | int], ...]) -> str:
    """``dict['optim'] > dict['state'] > dict[0]`` (an int key) or ``... > list[0]``."""
    return " > ".join(f"{kind}[{key!r}]" for kind, key in steps) or "(top level)"


def containers_to_json(containers: Containers) -> list[list]:
    """``[[path, kind], ...]``: JSON keeps a path's int and str keys apart."""
    return [[list(path), kind] for path, kind in containers.items()]


def containers_from_json(value: object, where: str) -> dict[NestedPath, str]:
    """The inverse of ``containers_to_json``; ``where`` names the file in the error."""
    if not (isinstance(value, list) and all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], list) and e[1] in ("dict", "tuple")
            and all(type(k) in (str, int) for k in e[0]) for e in value)):
        raise CorruptCheckpointError(f"{where}: {CONTAINERS_KEY} is not a list of [path, 'dict'|'tuple'] pairs")
    return {tuple(path): kind for path, kind in value}
