"""What a distributed load will move, decided before any live tensor is touched.

``make_load_plan`` matches the caller's names to the checkpoint's (exact name first, then the
parameter or optimizer state of the same FQN under the checkpoint's layout, whichever tool
wrote it: ``reshard.core.conventions``), refuses a mismatch with one error that names the
missing and unexpected tensors, and records for every tensor which distinct boxes the ranks
hold and which ranks hold each one. The plan is plain data with no file handles: rank 0
builds it and broadcasts it, and every rank then executes its part of the same value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Catalog, TensorEntry
from reshard.core.conventions import OPTIM_GROUP, OPTIM_STATE, PARAM, Layout, detect_layout, layout_notices
from reshard.core.errors import CorruptCheckpointError, UsageError
from reshard.pipeline.plan import covered_elements
from reshard.runtime.targets import SlotMeta

__all__ = ["StateDictMismatchError", "TransferItem", "LoadPlan", "make_load_plan", "SECTIONS", "LIVE_STATE"]

# Top-level sections of a get_state_dict-style checkpoint ({"model": ..., "optim": ...}) that a
# name may sit under when the caller's state dict is the section itself.
SECTIONS = ("model", "optim")
# How load_model names the live optimizer state it asks for: optim.state.<fqn>.<key>.
LIVE_STATE = "optim.state."
_SHOWN = 5
_CUTS = 256  # chunks of a tensor whose starts a plan carries (a plan is broadcast: its size counts)


class StateDictMismatchError(UsageError):
    """The checkpoint's names or shapes do not match the state dict being loaded."""


@dataclass(frozen=True)
class TransferItem:
    """One tensor to move: checkpoint ``source`` into the callers' ``target`` on each rank."""

    target: str
    source: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # as stored: bytes travel in this dtype and are cast where they land
    boxes: tuple[tuple[Box, tuple[int, ...]], ...]  # each distinct non-empty box and the ranks holding it
    broadcast: bool  # every rank holds the whole tensor (plain tensors, Replicate())
    # Where stored chunks start along dim 0 (0 left out; none for more than _CUTS chunks):
    # rank 0 cuts what it sends there, so each piece lies as one run of one file.
    cuts: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(b.numel for b, _ in self.boxes) * self.dtype.itemsize


@dataclass
class LoadPlan:
    items: list[TransferItem]
    slab_bytes: int
    missing: list[str] = field(default_factory=list)  # caller's names with nothing in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # checkpoint names nothing was loaded into
    objects: dict[str, Any] = field(default_factory=dict)  # the checkpoint's non-tensor objects
    # Optimizer hyper-parameters (lr, betas...) by param-group index (int) or by FQN (str), as
    # the checkpoint keys them; ``params`` lists left out.
    groups: dict[int | str, dict[str, Any]] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)  # the layout used, how optimizer state was matched

    @property
    def total_bytes(self) -> int:
        """Bytes rank 0 reads in ``rank0`` mode: each distinct box once."""
        return sum(i.nbytes for i in self.items)

    @property
    def loaded(self) -> list[str]:
        return [i.target for i in self.items]


def _section(catalog: Catalog, layout: Layout, name: str) -> tuple[str, str | None]:
    """The part of the checkpoint a name belongs to: its role, and for other state the first
    step of its nested path (so loading ``extra.scale`` expects the rest of ``extra``)."""
    role = layout.role(name)
    if role in (PARAM, OPTIM_STATE):
        return role, None
    path = catalog.nested_path(name)
    return role, str(path[0]) if len(path) > 1 else name.partition(".")[0]


class _Names:
    """The checkpoint's tensors by what they are, so a live name finds its stored one whatever
    the tool that wrote the checkpoint called it (``reshard.core.conventions``)."""

    def __init__(self, catalog: Catalog, layout: Layout, by_index: Mapping[str, str] | None = None) -> None:
        self.catalog = catalog
        self.params: dict[str, str] = {}
        self.state: dict[tuple[str, str], str] = {}
        for name in catalog.tensors:
            p = layout.place(name)
            if p.role == PARAM and p.fqn is not None:
                self.params.setdefault(p.fqn, name)
            elif p.role == OPTIM_STATE and p.fqn is not None and p.key is not None:
                fqn = by_index.get(p.fqn, p.fqn) if by_index else p.fqn
                self.state.setdefault((fqn, p.key), name)

    def resolve(self, name: str) -> str | None:
        """A live name (a model FQN, or ``optim.state.<fqn>.<key>`` as ``load_model`` names
        optimizer state) to the checkpoint's name for the same thing."""
        if name in self.catalog.tensors:
            return name
        if name.startswith(LIVE_STATE):
            fqn, _, key = name[len(LIVE_STATE):].rpartition(".")
            if (fqn, key) in self.state:
                return self.state[(fqn, key)]
        if name in self.params:
            return self.params[name]
        if name.startswith("model.") and name[len("model."):] in self.params:  # nested {"model": ...} vs a model file
            return self.params[name[len("model."):]]
        for s in SECTIONS:  # a caller's state dict nested like ours, against a flat checkpoint
            if f"{s}.{name}" in self.catalog.tensors:
                return f"{s}.{name}"
        return None


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _mismatch_message(source: str, missing: list[str], unexpected: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (in the state dict, not in the checkpoint): {_listing(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (in the checkpoint, not in the state dict): {_listing(unexpected)}")
    return (f"{source}: checkpoint does not match the state dict being loaded: {'; '.join(parts)}. "
            "Nothing was loaded. Pass keymap=... to rename the checkpoint's names, or strict=False to "
            "load the names that match")


def _union_names(metas: Sequence[Mapping[str, SlotMeta]]) -> dict[str, SlotMeta]:
    out: dict[str, SlotMeta] = {}
    for rank_metas in metas:
        for name, meta in rank_metas.items():
            seen = out.setdefault(name, meta)
            if seen.shape != meta.shape:
                raise UsageError(f"{name!r} has shape {list(seen.shape)} on one rank and {list(meta.shape)} on "
                                 "another; every rank must build the same model before loading")
    return out


def _alias_of(names: Mapping[str, SlotMeta], aliases: Sequence[Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """Each name's group of names sharing its memory (itself alone when untied)."""
    group: dict[str, set[str]] = {n: {n} for n in names}
    for tied in aliases:
        merged = set().union(*(group.get(n, {n}) for n in tied))
        for n in merged:
            group[n] = merged
    order = list(names)
    return {n: tuple(sorted(g, key=order.index)) for n, g in group.items() if n in names}


def _boxes(name: str, metas: Sequence[Mapping[str, SlotMeta]]) -> tuple[tuple[tuple[Box, tuple[int, ...]], ...], bool]:
    by_box: dict[Box, list[int]] = {}
    for rank, rank_metas in enumerate(metas):
        meta = rank_metas.get(name)
        for box in meta.boxes if meta is not None else ():
            by_box.setdefault(box, []).append(rank)
    whole = full_box(next(m[name].shape for m in metas if name in m))
    broadcast = len(metas) > 1 and list(by_box) == [whole] and len(by_box[whole]) == len(metas)
    boxes = tuple((b, tuple(r)) for b, r in sorted(by_box.items(), key=lambda kv: kv[0].offsets))
    return boxes, broadcast


def group_values(catalog: Catalog, layout: Layout) -> dict[int | str, dict[str, Any]]:
    """The checkpoint's param-group hyper-parameters, by group index or by parameter FQN."""
    out: dict[int | str, dict[str, Any]] = {}
    for name, value in catalog.objects.items():
        p = layout.place(name)
        if p.role == OPTIM_GROUP and p.key and p.key != "params":
            group = p.group if p.group is not None else p.fqn
            assert group is not None  # a layout places a group's value by its index or by its parameter
            out.setdefault(group, {})[p.key] = value
    return out


def _index_fqns(catalog: Catalog, layout: Layout, live_groups: Sequence[Sequence[str]]) -> dict[str, str]:
    """Optimizer state keyed by parameter index (``opt.state_dict()``) to parameter FQNs, the
    way torch's ``Optimizer.load_state_dict`` matches it: the saved param groups' ``params``
    id lists, in order, against the live optimizer's groups (``live_groups``: FQNs in the
    optimizer's order). Refused when the groups differ: an index is only a position."""
    saved: dict[int, Any] = {}
    for name in catalog.objects:
        p = layout.place(name)
        if p.role == OPTIM_GROUP and p.key == "params" and p.group is not None:
            saved[p.group] = catalog.objects[name]
    source = catalog.path
    if not saved:
        raise StateDictMismatchError(
            f"{source}: its optimizer state is keyed by parameter index (as opt.state_dict() saves it) and records no "
            "param_groups params lists to match the indexes to parameters. Nothing was loaded; save with torch's "
            "get_state_dict (keyed by FQN), or load without optimizer=")
    sizes = [len(saved[i]) if i in saved and isinstance(saved[i], (list, tuple)) else None for i in range(len(saved))]
    live = [len(g) for g in live_groups]
    if sizes != live:
        raise StateDictMismatchError(
            f"{source}: its optimizer state is keyed by parameter index (as opt.state_dict() saves it), in param groups "
            f"of {sizes} parameters, but the optimizer has groups of {live}: the indexes cannot be matched to "
            "parameters. Nothing was loaded; build the optimizer over the same parameters in the same groups and "
            "order, or save with torch's get_state_dict (keyed by FQN)")
    return {str(i): fqn for g, fqns in enumerate(live_groups) for i, fqn in zip(saved[g], fqns)}


def _cuts(entry: TensorEntry) -> tuple[int, ...]:
    offsets, _ = entry.columns
    if not entry.shape or not 1 < len(offsets) <= _CUTS:
        return ()
    return tuple(sorted(set(offsets[:, 0].tolist()) - {0}))


def make_load_plan(
    catalog: Catalog,
    metas: Sequence[Mapping[str, SlotMeta]],
    aliases: Sequence[Sequence[str]] = (),
    *,
    strict: bool = True,
    slab_bytes: int,
    layout: Layout | None = None,
    optimizer_groups: Sequence[Sequence[str]] | None = None,
) -> LoadPlan:
    """The plan that fills ``metas`` (one mapping per rank: name -> its part) from ``catalog``.
    ``optimizer_groups``: the live optimizer's param groups as FQN lists, in its order, for
    checkpoints whose optimizer state is keyed by parameter index.

    Raises ``StateDictMismatchError`` for names without a match (unless ``strict=False``) and
    always for shape mismatches, before anything is read or written.
    """
    source = str(catalog.path)
    layout = layout or detect_layout(catalog)
    notices = [*catalog.notices, *layout_notices(layout)]
    names = _union_names(metas)
    groups = _alias_of(names, aliases)
    wants_state = any(n.startswith(LIVE_STATE) for n in names)
    states = [p for n in catalog.tensors if (p := layout.place(n)).role == OPTIM_STATE]
    if wants_state and not states and strict:
        raise StateDictMismatchError(
            f"{source}: the checkpoint holds no optimizer state (layout {layout.name}), but an optimizer was given. "
            "Nothing was loaded; load without optimizer=, or pass strict=False to keep the optimizer's own state")
    by_index = None
    if wants_state and optimizer_groups is not None and states and all(p.fqn and p.fqn.isdigit() for p in states):
        try:
            by_index = _index_fqns(catalog, layout, optimizer_groups)
            notices.append(f"optimizer state keyed by parameter index matched to the optimizer's {len(by_index)} "
                           "parameters in order, as torch's Optimizer.load_state_dict does")
        except StateDictMismatchError as e:
            if strict:
                raise
            notices.append(str(e).replace("Nothing was loaded; ", "strict=False: its optimizer state was not loaded; "))
    lookup = _Names(catalog, layout, by_index)
    resolved = {n: c for n in names if (c := lookup.resolve(n)) is not None}
    missing = [n for n in names if not any(a in resolved for a in groups[n])]
    consumed = set(resolved.values())
    # Checkpoint tensors of the parts asked for and not loaded are "unexpected": the model's
    # when model names were asked, the optimizer's when an optimizer was (found or not).
    sections = {_section(catalog, layout, c) for c in consumed}
    if wants_state:
        sections.add((OPTIM_STATE, None))
    if any(not n.startswith(LIVE_STATE) for n in names):
        sections.add((PARAM, None))
    unexpected = [c for c in catalog.tensors
                  if c not in consumed and (not consumed or _section(catalog, layout, c) in sections)]
    wrong = [f"{n!r} is {list(catalog.tensors[c].shape)} in the checkpoint ({c!r}) but {list(names[n].shape)} here"
             for n, c in resolved.items() if catalog.tensors[c].shape != names[n].shape]
    if wrong:
        raise StateDictMismatchError(f"{source}: shapes differ: {'; '.join(wrong[:_SHOWN])}"
                                     + (f" and {len(wrong) - _SHOWN} more" if len(wrong) > _SHOWN else "")
                                     + ". Nothing was loaded; is this the checkpoint of this model?")
    if strict and (missing or unexpected):
        raise StateDictMismatchError(_mismatch_message(source, missing, unexpected))
    items, done = [], set()
    for name in names:
        group = groups[name]
        target = next((a for a in group if a in resolved), None)
        if target is None or group in done:
            continue
        done.add(group)
        entry = catalog.tensors[resolved[target]]
        boxes, broadcast = _boxes(target, metas)
        for box, _ in boxes:
            covered = covered_elements(entry, box)
            if covered != box.numel:
                raise CorruptCheckpointError(f"{source}: {entry.name!r} stores only {covered} of the {box.numel} "
                                             f"elements of box {box}; the checkpoint is incomplete")
        items.append(TransferItem(target, entry.name, entry.shape, entry.dtype.torch, boxes, broadcast, _cuts(entry)))
    return LoadPlan(items, slab_bytes, missing, unexpected, dict(catalog.objects), group_values(catalog, layout),
                    notices)
