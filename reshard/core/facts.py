"""What one module learns about a checkpoint that another needs later: the catalog's
cross-module facts, each a typed field here and nowhere else.

A reader records the mesh it found, the HF config beside the weights or the convention the
names follow; the planner, the writers and the HF export read them. They used to ride in a
dict of string keys that any module could spell (and misspell); now every fact is declared
once below, with its type, and read or written as an attribute (``catalog.facts.hf_config``).
tests/test_facts.py fails on a string-keyed lookup anywhere else.

A fact that is not known is ``None``: setting ``None`` forgets it. The zarr format keeps the
facts a store should carry (``persisted``) in its root attributes under the names below,
which are on-disk keys: renaming one is a format change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar, overload

__all__ = ["Facts"]

T = TypeVar("T")


class _Fact(Generic[T]):
    """One fact: its stored name (``key``) and whether a store keeps it (``persist``: the
    layout a store was written for is read from the store itself, not from this record)."""

    def __init__(self, key: str | None = None, *, persist: bool = True) -> None:
        self.key, self.persist = key or "", persist

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = self.key or name
        owner._declared[name] = self  # type: ignore[attr-defined]  # Facts._declared

    @overload
    def __get__(self, facts: None, owner: type) -> _Fact[T]: ...
    @overload
    def __get__(self, facts: Facts, owner: type) -> T | None: ...

    def __get__(self, facts: Facts | None, owner: type) -> _Fact[T] | T | None:
        if facts is None:
            return self
        return facts._by_key.get(self.key)

    def __set__(self, facts: Facts, value: T | None) -> None:
        if value is None:
            facts._by_key.pop(self.key, None)
        else:
            facts._by_key[self.key] = value


class Facts:
    """The facts of one catalog (or of the target planned from it), as typed attributes."""

    _declared: dict[str, _Fact[Any]] = {}

    # the convention the names follow (``reshard.core.conventions``) as the reader recorded it
    layout: _Fact[str] = _Fact()
    layout_given: _Fact[bool] = _Fact(persist=False)  # --layout said so, rather than the reader
    # the HF model's config.json / generation_config.json (beside the weights, or --config)
    hf_config: _Fact[dict[str, Any]] = _Fact()
    hf_config_given: _Fact[bool] = _Fact()  # from --config, not carried by the checkpoint
    hf_generation_config: _Fact[dict[str, Any]] = _Fact()
    # what an HF export adds: its notices, side files by name, where its weights came from
    hf_notices: _Fact[list[str]] = _Fact()
    hf_assets: _Fact[dict[str, Any]] = _Fact()
    hf_source: _Fact[str] = _Fact()
    hf_keymap: _Fact[str] = _Fact()  # the key map preset to HF names a reader recorded (Megatron's)
    # the check the HF writer runs before laying out a file, as the export step recorded it:
    # (config.json, tensors, where, a tensor's source name) -> its notice, or an error
    # (``reshard.features.architecture.ExportCheck``)
    hf_check: _Fact[Callable[[Mapping[str, Any], Mapping[str, Any], str, Callable[[str], str]], str]] = _Fact(persist=False)
    # how the source was sharded: its rank count, mesh ((shape) or {"shape", "names"}), its
    # dimension names and each tensor's placements
    source_world_size: _Fact[int] = _Fact(persist=False)
    source_mesh: _Fact[Any] = _Fact(persist=False)
    source_mesh_dim_names: _Fact[tuple[str, ...]] = _Fact()
    source_placements: _Fact[dict[str, Any]] = _Fact()
    # the mesh a target is laid out for, and each tensor's placements on it
    target_mesh: _Fact[dict[str, Any]] = _Fact(persist=False)
    target_placements: _Fact[dict[str, list[str]]] = _Fact(persist=False)
    # {nested path of a container: "dict" | "tuple"} where the keys alone rebuild the wrong type
    # (``reshard.core.structure``)
    containers: _Fact[dict[tuple[str | int, ...], str]] = _Fact("torch_containers", persist=False)
    safetensors_metadata: _Fact[dict[str, str]] = _Fact()  # a source file's own __metadata__
    zarr_attributes: _Fact[dict[str, Any]] = _Fact(persist=False)  # a foreign store's own root attributes
    deepspeed_universal: _Fact[bool] = _Fact()  # read from a DeepSpeed universal checkpoint
    deepspeed_zero_stage: _Fact[int] = _Fact()  # the ZeRO stage a DeepSpeed checkpoint was saved with

    def __init__(self, **values: Any) -> None:
        self._by_key: dict[str, Any] = {}
        self._set(values)

    def _set(self, values: Mapping[str, Any]) -> None:
        for name, value in values.items():
            if name not in self._declared:
                raise TypeError(f"Facts has no fact {name!r}; declare it in reshard/core/facts.py")
            setattr(self, name, value)

    def copy(self) -> Facts:
        out = Facts()
        out._by_key = dict(self._by_key)
        return out

    def but(self, **changes: Any) -> Facts:
        """A copy with ``changes`` (``None`` forgets a fact)."""
        out = self.copy()
        out._set(changes)
        return out

    def persisted(self) -> dict[str, Any]:
        """The facts a store keeps, under their stored names (and what an older store kept
        that no fact here names, carried on as it was)."""
        dropped = {f.key for f in self._declared.values() if not f.persist}
        return {k: v for k, v in self._by_key.items() if k not in dropped}

    def take_persisted(self, stored: Mapping[str, Any]) -> None:
        """Read back what ``persisted`` gave, over the facts known."""
        self._by_key.update(stored)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Facts) and self._by_key == other._by_key

    def __repr__(self) -> str:
        return f"Facts({', '.join(f'{k}={v!r}' for k, v in self._by_key.items())})"
