"""How the common training tools lay out a checkpoint, as data, and which one a checkpoint follows.

A flat name alone does not say what a tensor is. ``model.layers.0.w`` is a parameter in
torch's ``{"model": ..., "optim": ...}`` tutorial layout (and ours); torchtitan keeps
the optimizer under ``optimizer.state.<fqn>.<key>`` and its hyper-parameters per parameter
(``optimizer.param_groups.<fqn>.lr``), and some of its versions put model tensors at the top
level; torch's ``get_optimizer_state_dict`` saved alone is ``state.<fqn>.<key>``; an HF
folder is all parameters. Every consumer (placements, ``inspect --to-mesh``, ``--dtype``,
``--only``, key maps, the runtime loader) asks the ``Layout`` of a catalog what each name is
instead of matching names of its own:

* ``param``: a model tensor, with its FQN;
* ``optim_state``: optimizer state of one parameter (``exp_avg``, ``step``), with FQN and key;
* ``optim_group``: a hyper-parameter of a param group (``lr``), by group index or by FQN;
* ``per_rank``: one rank's private state (data loader positions, RNG states);
* ``other``: anything else (step counters, schedulers, configs).

The table below is the whole knowledge; ``detect_layout`` picks the row that explains the
checkpoint by evidence, not by section names: optimizer state that finds its parameters
beats a marker section, and a layout that leaves tensors unexplained loses to one that does
not. Each row is named after what writes checkpoints that way (``torch-optim``: torch's
``get_state_dict`` saved as ``{model, optim}``), never after reshard, which only reads them.
When two rows explain a checkpoint about equally but disagree on what its tensors are,
detection refuses (``AmbiguousLayoutError``) and names the candidates; ``--layout NAME``
(``layout=`` in the API) settles it. ``Layout.reason`` says why a layout was chosen, and
``layout_notices`` is what every command prints about it. Optimizer state always follows its
parameter because both are found through the same FQN.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, NamedTuple

from reshard.core.errors import UsageError, option
from reshard.core.gc_pause import without_gc
from reshard.core.sizes import plural

if TYPE_CHECKING:
    from reshard.core.catalog import Catalog, NestedPath, TensorEntry

__all__ = ["Convention", "CONVENTIONS", "Place", "Layout", "detect_layout", "convention_named", "layout_notices",
           "AmbiguousLayoutError", "PARAM", "OPTIM_STATE", "OPTIM_GROUP", "PER_RANK", "OTHER", "rename_path", "is_per_rank"]

PARAM, OPTIM_STATE, OPTIM_GROUP, PER_RANK, OTHER = "param", "optim_state", "optim_group", "per_rank", "other"


@dataclass(frozen=True)
class Convention:
    """One tool's layout. Prefixes are flat-name prefixes ending in a dot; ``""`` for the model
    means the top level (every name outside the other sections)."""

    name: str
    writer: str  # who writes checkpoints this way
    model: str | None  # prefix of model tensors; None: no model tensors
    optimizer: str | None  # prefix before ``state.`` / ``param_groups.``; None: no optimizer
    groups: str  # "index": param_groups.<i>.<key>; "fqn": param_groups.<fqn>.<key>
    sections: tuple[str, ...] = ()  # other top-level sections (never parameters)
    per_rank: tuple[str, ...] = ()  # name globs of one rank's private state
    markers: tuple[str, ...] = ()  # sections whose presence identifies the tool (any one)
    # How optimizer state names its parameter: "fqn-key" (state.<fqn>.exp_avg, torch's and
    # most tools'), "key-fqn" (state.exp_avg.<fqn>, Megatron-Core's).
    state_order: str = "fqn-key"
    # False: only the tool's own reader records this layout (catalog.facts.layout); its
    # names alone are no evidence (verl's per-rank files look like torch's tutorial layout).
    detected: bool = True
    # What a one-file output (a .pt or .safetensors) keeps when no ``only`` is given, and the
    # notice that says so: the tool's own export of such a file, where it has one.
    one_file: tuple[str, str] | None = None


# A name part that says "this is one rank's" outside the model (rank3, dp_rank_3, rank-3,
# RNG states, data loader positions); matched per dotted component, so "rank" inside a word
# does not count.
_PER_RANK_PART = re.compile(
    r"^(?:(?:dp_|tp_|pp_|global_|local_)?rank[_-]?\d+|rng|rngs|rng_state|rng_states|random_state|random_states|"
    r"cuda_rng_state|torch_rng_state|numpy_rng_state|py_rng_state|dataloader|data_loader|dataloaders)$",
    re.IGNORECASE,
)

CONVENTIONS: tuple[Convention, ...] = (
    Convention("torchtitan", "torchtitan CheckpointManager (model under model.)", "model.", "optimizer.", "fqn",
               ("lr_scheduler.", "train_state.", "dataloader."), ("dataloader.*",), ("lr_scheduler", "train_state")),
    Convention("torchtitan-flat", "torchtitan CheckpointManager (model at the top level)", "", "optimizer.", "fqn",
               ("lr_scheduler.", "train_state.", "dataloader."), ("dataloader.*",), ("lr_scheduler", "train_state")),
    # torch's DCP tutorial (AppState: {"model", "optim"}), which our training loop follows too;
    # the sections users add beside them (train_state, extra...) are never parameters.
    Convention("torch-optim", "torch's get_state_dict saved as {model, optim, ...}: its DCP tutorial, reshard train",
               "model.", "optim.", "index",
               ("train.", "train_state.", "extra.", "lr_scheduler.", "scheduler.", "dataloader."), ()),
    Convention("torch-optimizer", "get_state_dict saved as {model, optimizer} (accelerate FSDP folders too)", "model.",
               "optimizer.", "index", ("lr_scheduler.", "scheduler.", "extra."), ()),
    # Recorded by the reader of verl's three sets of per-rank files, never guessed.
    Convention("verl", "verl per-rank model_/optim_/extra_state_ files", "model.", "optim.", "index", ("extra.",),
               ("extra.rng*",), detected=False),
    # Recorded by the reader of accelerate's save_state folders (formats/accelerate/format.py).
    Convention("accelerate", "accelerate save_state with FSDP SHARDED_STATE_DICT", "model.", "optimizer.", "index",
               ("scheduler.", "sampler."), ("random_states_*",), ("random_states_0",)),
    # Recorded by the DeepSpeed reader (formats/deepspeed/format.py): fp32 master weights at the top
    # level, model-dtype copies under module., engine state under deepspeed.
    Convention("deepspeed", "DeepSpeed ZeRO and universal checkpoints (global_stepN/)", "", "optimizer.", "index",
               ("module.", "deepspeed."), (), ("deepspeed",),
               # One file from a ZeRO run is what zero_to_fp32 writes: the fp32 master weights.
               one_file=("model", "wrote the fp32 master weights only, as DeepSpeed's zero_to_fp32 does; convert to a "
                                  "DCP folder to keep the optimizer state")),
    # Megatron-Core torch_dist (formats/megatron/format.py): model keys at the top level, optimizer
    # state as optimizer.state.<exp_avg|exp_avg_sq|param>.<key>, common.pt's entries beside.
    Convention("megatron", "Megatron-Core torch_dist (iter_N/ with metadata.json, common.pt)", "", "optimizer.",
               "index", ("args.", "rng_state.", "rerun_state_machine.", "opt_param_scheduler.", "checkpoint_version",
                         "iteration", "num_floating_point_operations_so_far", "content_metadata."),
               ("rng_state.*",), ("checkpoint_version", "opt_param_scheduler", "num_floating_point_operations_so_far"),
               state_order="key-fqn"),
    Convention("torch-optimizer-only", "get_optimizer_state_dict saved alone (state., param_groups.)", None, "",
               "fqn", ()),
    Convention("state-dict", "a model's state_dict(): HF, PEFT, torch.save(model.state_dict())", "", None, "index", ()),
)
_BY_NAME = {c.name: c for c in CONVENTIONS}
# Names layouts had before they were named after their writers: still taken by --layout, until
# reshard 0.4 removes them (``reshard.pipeline.options.FORMER_KEYWORDS_REMOVED_IN``).
_FORMER_NAMES = {"reshard": "torch-optim", "model": "state-dict"}
_FALLBACK = "a model state dict: no other layout explains its names"  # the only reading: nothing to say
_GIVEN, _RECORDED = "as given", "recorded by the checkpoint's reader"
# What reshard itself records beside the tensors (an HF source's config.json...): never a
# parameter, whatever the layout (reshard.features.provenance).
_PROVENANCE = ("hf.", "reshard.")


class Place(NamedTuple):
    """What a name is. ``prefix + fqn + suffix`` is the name when ``fqn`` is set. A tuple: a
    layout places every name of a checkpoint, 100k+ of them, for each candidate convention."""

    role: str
    fqn: str | None = None
    key: str | None = None  # optimizer state key (exp_avg), param-group key (lr)
    group: int | None = None  # param-group index (index-keyed groups)
    prefix: str = ""
    suffix: str = ""


@functools.lru_cache(maxsize=1 << 16)
def _per_rank_part(part: str) -> bool:
    return _PER_RANK_PART.match(part) is not None  # parts repeat (layers, 0, experts...): cached


@functools.lru_cache(maxsize=1 << 18)
def _has_per_rank_part(name: str) -> bool:
    return any(_per_rank_part(p) for p in name.split("."))  # asked once per convention: cached


@functools.lru_cache(maxsize=64)
def _globs_regex(globs: tuple[str, ...]) -> re.Pattern | None:
    return re.compile("|".join(fnmatch.translate(g) for g in globs)) if globs else None


def is_per_rank(name: str, globs: tuple[str, ...] = ()) -> bool:
    """Whether ``name`` holds one rank's private state (by a convention's globs or its parts)."""
    pattern = _globs_regex(globs)
    return (pattern is not None and pattern.match(name) is not None) or _has_per_rank_part(name)


@functools.lru_cache(maxsize=64)
def _section_test(sections: tuple[str, ...]) -> tuple[tuple[str, ...], frozenset[str]]:
    """(prefixes, whole names) of ``sections``: ``in_sections`` in two C calls, not a loop."""
    return sections, frozenset(s.rstrip(".") for s in sections)


def in_sections(name: str, sections: tuple[str, ...]) -> bool:
    """Whether ``name`` lies in one of ``sections`` (``"optim."`` holds ``optim.x`` and ``optim``)."""
    prefixes, whole = _section_test(sections)
    return name.startswith(prefixes) or name in whole


_OTHER, _PER_RANK = Place(OTHER), Place(PER_RANK)


def _broadcast(a: tuple[int, ...] | None, b: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape ``a`` and ``b`` broadcast to, as torch broadcasts; None where they do not
    (or ``a`` already did not)."""
    if a is None:
        return None
    if len(a) < len(b):
        a, b = b, a
    b = (1,) * (len(a) - len(b)) + b
    if any(x != y and 1 not in (x, y) for x, y in zip(a, b)):
        return None
    return tuple(y if x == 1 else x for x, y in zip(a, b))


class Layout:
    """A convention applied to one checkpoint's names."""

    def __init__(self, convention: Convention, names: Iterable[str], groups: str | None = None, *,
                 reason: str = _GIVEN, unexplained: tuple[str, ...] = (), label: str | None = None) -> None:
        self.convention = convention
        self.groups = groups or convention.groups
        self.reason = reason  # why this layout: as given, recorded by the reader, or the evidence
        # What messages call it: its name, or the source's layout this catalog was derived from
        # (the model section of a torch-optim checkpoint is a state dict, but the user was told
        # torch-optim).
        self.label = label or convention.name
        self.unexplained = unexplained  # non-scalar tensors it calls neither model nor optimizer state
        self._places: dict[str, Place] = {}
        self._names = list(names)
        # Asked for every name, for every candidate convention: worked out once.
        opt = convention.optimizer
        self._state = opt + "state." if opt is not None else None
        self._groups = opt + "param_groups." if opt is not None else None
        self._sections = convention.sections + ((opt,) if opt else ()) + _PROVENANCE
        self._model, self._key_fqn = convention.model, convention.state_order == "key-fqn"
        self._per_rank = _globs_regex(convention.per_rank)  # is_per_rank's test, looked up once

    @property
    def name(self) -> str:
        return self.convention.name

    def labelled(self, label: str) -> Layout:
        """The same layout, called ``label`` in messages."""
        return Layout(self.convention, self._names, self.groups, reason=self.reason, unexplained=self.unexplained,
                      label=label)

    def place(self, name: str) -> Place:
        found = self._places.get(name)
        if found is None:
            found = self._places[name] = self._place(name)
        return found

    def _place(self, name: str) -> Place:
        # Called for every name of every candidate convention: no keyword arguments to
        # Place, the convention's fields read once in __init__, shared tuples for bare roles.
        state, groups = self._state, self._groups
        if state is not None and groups is not None:
            if name.startswith(state):
                if self._key_fqn:
                    key, _, fqn = name[len(state):].partition(".")
                    return Place(OPTIM_STATE, fqn, key, None, f"{state}{key}.", "") if fqn else _OTHER
                fqn, _, key = name[len(state):].rpartition(".")
                return Place(OPTIM_STATE, fqn, key, None, state, "." + key) if fqn else _OTHER
            if name.startswith(groups):
                rest = name[len(groups):]
                if self.groups == "index":
                    index, _, key = rest.partition(".")
                    if index.isdigit() and key:
                        return Place(OPTIM_GROUP, None, key, int(index))
                    return _OTHER
                fqn, _, key = rest.rpartition(".")
                return Place(OPTIM_GROUP, fqn, key, None, groups, "." + key) if fqn else _OTHER
        model = self._model
        if model and name.startswith(model) and len(name) > len(model):
            return Place(PARAM, name[len(model):], None, None, model, "")
        pattern = self._per_rank
        if (pattern is not None and pattern.match(name) is not None) or _has_per_rank_part(name):
            return _PER_RANK
        if model != "" or in_sections(name, self._sections):
            return _OTHER
        return Place(PARAM, name)

    def role(self, name: str) -> str:
        return self.place(name).role

    def param_fqn(self, name: str) -> str | None:
        """The parameter a tensor belongs to (itself, or the one whose optimizer state it is)."""
        p = self.place(name)
        return p.fqn if p.role in (PARAM, OPTIM_STATE) else None

    def param_shapes(self, tensors: Mapping[str, TensorEntry]) -> dict[str, tuple[int, ...]]:
        """Each parameter's shape, for ``casts``: its model tensor's where the checkpoint holds
        it; otherwise (state keyed by index, an optimizer saved alone) the broadcast of its
        state tensors' shapes. An optimizer combines each state tensor elementwise with the
        gradient, so each broadcasts to the parameter: the moments have its shape, a value
        such as NAdam's ``mu_product`` saved as ``(1,)`` broadcasts into it, and Adafactor's
        ``(m, 1)`` rows and ``(1, n)`` columns give ``(m, n)``, which none of them is. Shapes
        that do not broadcast are no evidence: nothing of that parameter is cast."""
        shapes: dict[str, tuple[int, ...]] = {}
        state: dict[str, tuple[int, ...] | None] = {}
        for name, entry in tensors.items():
            p = self.place(name)
            if p.fqn is None:
                continue
            if p.role == PARAM:
                shapes[p.fqn] = entry.shape
            elif p.role == OPTIM_STATE and p.key != "step" and entry.dtype.is_floating_point:
                state[p.fqn] = _broadcast(state.get(p.fqn, ()), entry.shape)
        for fqn, shape in state.items():
            if fqn not in shapes and shape is not None:
                shapes[fqn] = shape
        return shapes

    def casts(self, name: str, shape: tuple[int, ...], param_shapes: dict[str, tuple[int, ...]]) -> bool:
        """Whether ``--dtype`` may cast this (floating) tensor: parameters, and the moments:
        optimizer state shaped like its parameter (``param_shapes``). Every other optimizer
        value keeps its dtype whatever its shape: ``step``, 0-d values, a ``(1,)``
        ``mu_product`` of a matrix."""
        p = self.place(name)
        if p.role == PARAM:
            return True
        if p.role != OPTIM_STATE or p.key == "step" or not shape:
            return False
        return p.fqn is not None and param_shapes.get(p.fqn) == shape

    def in_section(self, name: str, only: str) -> bool:
        """``--only model|optim|optimizer|PREFIX``: the model and optimizer by their role,
        whatever the tool calls their sections; anything else by name prefix."""
        if only == "model":
            return self.role(name) == PARAM
        if only in ("optim", "optimizer"):
            return self.role(name) in (OPTIM_STATE, OPTIM_GROUP) or (
                self.convention.optimizer is not None and name.startswith(self.convention.optimizer + "param_groups."))
        return name == only or name.startswith(only + ".")


class AmbiguousLayoutError(UsageError):
    """Two conventions explain a checkpoint about equally but disagree on what its tensors are."""


@dataclass(frozen=True)
class _Evidence:
    """What one convention makes of a checkpoint's names. Ranked by ``matched`` first (optimizer
    state that finds its parameter is the strongest evidence a layout can have), then by its
    ``criteria``: fewer tensors left unexplained, its model section being a real nested section
    of the checkpoint, a marker section present, optimizer state saved without a model."""

    convention: Convention
    groups: str
    params: int  # tensors it calls model tensors (parameters and buffers: a name does not say which)
    matched: int  # optimizer tensors whose FQN names a parameter (or a parameter index)
    by_index: bool  # the optimizer state is keyed by parameter index, not by FQN
    unexplained: tuple[str, ...]  # non-scalar tensors it can only call "other", outside its sections
    nested: bool
    markers: tuple[str, ...]  # its marker sections that the checkpoint has
    alone: int = 0  # optimizer tensors with no model beside them: weaker evidence, nothing to match

    @property
    def criteria(self) -> tuple[int, bool, bool, int]:
        return -len(self.unexplained), self.nested, bool(self.markers), self.alone

    def dominates(self, other: _Evidence) -> bool:
        mine, theirs = self.criteria, other.criteria
        return all(a >= b for a, b in zip(mine, theirs)) and mine != theirs

    def reason(self) -> str:
        c = self.convention
        where = f"under {c.model}" if c.model else "at the top level"
        parts = [plural(self.params, "tensor") + f" {where}"] if c.model is not None else []
        if self.matched:
            keyed = "keyed by parameter index" if self.by_index else "matching their parameters by FQN"
            parts.append(plural(self.matched, "optimizer tensor") + f" under {c.optimizer}state. {keyed}")
        if self.alone:
            parts.append(plural(self.alone, "optimizer tensor") + f" under {c.optimizer or ''}state. with no model beside them")
        if self.markers:
            parts.append("its sections " + ", ".join(self.markers))
        if self.nested and c.model:  # nested: under the model's section
            parts.append(f"{c.model[:-1]!r} saved as a section")
        return "; ".join(parts) or "no tensors"


def _heads(catalog: Catalog) -> set[str]:
    """The top-level sections of the catalog's names."""
    return {n.split(".", 1)[0] for n in (*catalog.tensors, *catalog.objects)}


def _evidence(convention: Convention, catalog: Catalog, heads: set[str] | None = None) -> _Evidence | None:
    """What ``convention`` explains of ``catalog``, or None when it cannot be the one: its
    markers are absent, its optimizer state finds no parameter, its optimizer keying contradicts
    the state's, or it would call ``model.`` a section although nothing says so (HF names start
    with ``model.`` too)."""
    tensors, objects = list(catalog.tensors), list(catalog.objects)
    heads = _heads(catalog) if heads is None else heads
    markers = tuple(m for m in convention.markers if m in heads)
    if convention.markers and not markers:
        return None
    nested = bool(convention.model and any(len(path) >= 2 and path[0] == convention.model[:-1]
                                           for path in catalog.paths.values()))
    state = convention.optimizer + "state." if convention.optimizer is not None else None
    if convention.model != "" and not nested and (state is None or not any(map(str.startswith, tensors, repeat(state)))):
        # No optimizer state, nothing nested: a convention with a model section explains
        # nothing the checks below would accept (and placing 100k names says so slowly).
        return None
    groups = _groups_style(convention, objects)
    layout = Layout(convention, tensors + objects, groups)
    places = [(n, layout._place(n)) for n in tensors]  # not kept: the layout chosen is made anew
    params = {p.fqn for _, p in places if p.role == PARAM}
    states = [p for _, p in places if p.role == OPTIM_STATE]
    matched = sum(1 for p in states if p.fqn in params)
    by_id = sum(1 for p in states if p.fqn and p.fqn.isdigit())  # a plain optimizer's state: int ids, no FQNs
    if by_id and convention.groups == "fqn" and convention.model is not None:
        return None  # the tool keys its optimizer state by FQN: index-keyed state is not its
    if convention.model is None:  # optimizer state saved alone: nothing to match, its groups say it is one
        has_groups = any(layout.place(n).role == OPTIM_GROUP for n in objects)
        if not states or not has_groups:
            return None
        return _Evidence(convention, groups, 0, 0, bool(by_id), (), False, markers, len(states))
    if states and not matched and not by_id and params:
        return None  # optimizer state that finds none of the parameters: wrong model prefix
    alone = len(states) if not params else 0  # optimizer state without a model beside it (accelerate's folder)
    if convention.model and not (nested or matched or by_id or alone):
        return None
    sections = convention.sections + _PROVENANCE
    unexplained = tuple(n for n, p in places if p.role == OTHER and catalog.tensors[n].shape
                        and not in_sections(n, sections))
    return _Evidence(convention, groups, len(params), matched + (by_id if params else 0), bool(by_id and not matched),
                     unexplained, nested, markers, alone)


def _groups_style(convention: Convention, objects: list[str]) -> str:
    """index-keyed groups carry a ``params`` list; torch's flattened groups do not."""
    if convention.optimizer is None:
        return convention.groups
    groups = convention.optimizer + "param_groups."
    keyed = [n[len(groups):] for n in objects if n.startswith(groups)]
    if any(k.split(".", 1)[0].isdigit() and k.endswith(".params") for k in keyed):
        return "index"
    if keyed and not any(k.split(".", 1)[0].isdigit() for k in keyed):
        return "fqn"
    return convention.groups


def _disagree(a: Layout, b: Layout, names: Iterable[str]) -> bool:
    """Whether two layouts call some tensor something different (role, or parameter FQN)."""
    for n in names:
        pa, pb = a.place(n), b.place(n)
        if pa.role != pb.role or (pa.role in (PARAM, OPTIM_STATE) and pa.fqn != pb.fqn):
            return True
    return False


def detect_layout(catalog: Catalog, override: str | None = None, *, refuse_ambiguous: bool = True) -> Layout:
    """The layout ``catalog`` follows: ``override`` (a convention name), else the one its reader
    recorded (``catalog.facts.layout``), else the convention that explains it best (a plain
    model state dict when nothing else fits). Raises ``AmbiguousLayoutError`` when another
    convention explains it about as well and calls some of its tensors something else, unless
    ``refuse_ambiguous`` is False (a caller whose result does not depend on the layout, such
    as a whole-tensor copy)."""
    # Every step of a conversion asks; the answer holds while the catalog's tables and layout
    # attributes are the ones it was computed from (steps make new catalogs, never edit one).
    key = (override, catalog.facts.layout, bool(catalog.facts.layout_given), refuse_ambiguous,
           id(catalog.tensors), len(catalog.tensors), id(catalog.objects), len(catalog.objects), id(catalog.paths))
    cache = catalog.detected_layouts
    if key not in cache:
        cache.clear()
        # the tables are held with the answer, so no other table can take their ids meanwhile
        cache[key] = (_detect(catalog, override, refuse_ambiguous), (catalog.tensors, catalog.objects, catalog.paths))
    return cache[key][0]


def convention_named(name: str) -> Convention:
    """The convention ``--layout NAME`` / ``layout=NAME`` names (or its former name); any other
    name is a usage error listing the known ones."""
    choice = _FORMER_NAMES.get(name, name)
    if choice not in _BY_NAME:
        raise UsageError(f"{option(f'--layout {choice!r}', f'layout={choice!r}')} is not one of: {', '.join(_BY_NAME)}")
    return _BY_NAME[choice]


@without_gc
def _detect(catalog: Catalog, override: str | None, refuse_ambiguous: bool) -> Layout:
    tensors, objects = list(catalog.tensors), list(catalog.objects)
    choice = override or catalog.facts.layout
    if choice is not None:
        c = convention_named(choice)
        how = _GIVEN if override or catalog.facts.layout_given else _RECORDED
        return Layout(c, tensors + objects, _groups_style(c, objects), reason=how)
    heads = _heads(catalog)
    found = [e for c in CONVENTIONS if c.detected and (e := _evidence(c, catalog, heads)) is not None]
    order = {c.name: i for i, c in enumerate(CONVENTIONS)}
    found.sort(key=lambda e: (-e.matched, tuple(-int(x) for x in e.criteria), order[e.convention.name]))
    best = found[0]
    only_model = len(found) == 1 and best.convention.name == "state-dict"
    layout = Layout(best.convention, tensors + objects, best.groups,
                    reason=_FALLBACK if only_model else best.reason(), unexplained=best.unexplained)
    for rival in found[1:] if refuse_ambiguous else ():
        if rival.matched != best.matched or best.dominates(rival):
            continue
        other = Layout(rival.convention, tensors + objects, rival.groups)
        if _disagree(layout, other, tensors):
            raise AmbiguousLayoutError(
                f"{catalog.path}: the layout is ambiguous: {_candidate(best)} or {_candidate(rival)}; pass "
                f"--layout {best.convention.name} or --layout {rival.convention.name} (layout= in Python)")
    return layout


def _candidate(e: _Evidence) -> str:
    c = e.convention
    what = f"{c.name} (model under {c.model}" if c.model else f"{c.name} (every tensor a parameter"
    if e.unexplained:
        what += f"; {_names_brief(e.unexplained)} not model or optimizer state"
    return what + ")"


def _names_brief(names: tuple[str, ...]) -> str:
    """``ema.* (12 tensors)``: names grouped by their first part."""
    heads: dict[str, int] = {}
    for n in names:
        head = n.split(".", 1)[0]
        heads[head] = heads.get(head, 0) + 1
    shown = [f"{h}.* ({k} tensors)" if k > 1 else h for h, k in list(heads.items())[:4]]
    return ", ".join(shown) + (f" and {len(heads) - 4} more sections" if len(heads) > 4 else "")


def layout_notices(layout: Layout) -> list[str]:
    """What a command says about the layout it used: which one and why, and which tensors it
    leaves as they are because they are neither model nor optimizer state."""
    if layout.reason == _FALLBACK:
        out = []
    elif layout.reason in (_GIVEN, _RECORDED):
        out = [f"layout {layout.name} ({layout.reason})"]
    else:
        out = [f"layout {layout.name} ({layout.reason}); {option('--layout NAME', 'layout=NAME')} overrides it"]
    if layout.unexplained:
        out.append(f"{_names_brief(layout.unexplained)} not model or optimizer state under layout {layout.name}: "
                   "kept as saved (not resharded, not cast)")
    return out


def rename_path(path: NestedPath, name: str, place: Place, new_fqn: str) -> NestedPath:
    """``path`` (the nested path of ``name``) with the FQN part replaced by ``new_fqn``: path
    steps wholly before or after the FQN stay; the steps the FQN touches become one step, with
    whatever text they held around the FQN (torchtitan's ``state.<fqn>.exp_avg``) kept."""
    start = len(place.prefix)
    end = start + len(place.fqn or "")
    head: list[str | int] = []
    middle: list[str] = []
    tail: list[str | int] = []
    at = 0
    for step in path:
        text = str(step)
        lo, hi = at, at + len(text)
        if hi <= start and not middle:
            head.append(step)
        elif lo >= end and middle:
            tail.append(step)
        else:
            middle.append(text)
        at = hi + 1  # the joining dot
    joined = ".".join(middle)
    offset = len(".".join(str(s) for s in head)) + (1 if head else 0)
    local_start, local_end = start - offset, end - offset
    return (*head, joined[:local_start] + new_fqn + joined[local_end:], *tail)
