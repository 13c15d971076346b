"""How the common training tools lay out a checkpoint, as data, and which one a checkpoint follows.

A flat name alone does not say what a tensor is. ``model.layers.0.w`` is a parameter in our
checkpoints and in torch's ``{"model": ..., "optim": ...}`` tutorial layout; torchtitan keeps
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
checkpoint (``--layout NAME`` overrides it). Optimizer state always follows its parameter
because both are found through the same FQN.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reshard.errors import UsageError

if TYPE_CHECKING:
    from reshard.catalog import Catalog, NestedPath

__all__ = ["Convention", "CONVENTIONS", "Place", "Layout", "detect_layout", "PARAM", "OPTIM_STATE", "OPTIM_GROUP",
           "PER_RANK", "OTHER", "rename_path", "is_per_rank"]

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
    Convention("reshard", "reshard train and torch's get_state_dict as {model, optim, ...}", "model.", "optim.", "index",
               ("train.", "extra."), ()),
    Convention("torch-optimizer", "get_state_dict saved as {model, optimizer} (accelerate FSDP folders too)", "model.",
               "optimizer.", "index", ("lr_scheduler.", "scheduler.", "extra."), ()),
    # Recorded by the reader of verl's three sets of per-rank files, never guessed.
    Convention("verl", "verl per-rank model_/optim_/extra_state_ files", "model.", "optim.", "index", ("extra.",),
               ("extra.rng*",)),
    # Recorded by the reader of accelerate's save_state folders (formats/accelerate.py).
    Convention("accelerate", "accelerate save_state with FSDP SHARDED_STATE_DICT", "model.", "optimizer.", "index",
               ("scheduler.", "sampler."), ("random_states_*",), ("random_states_0",)),
    # Recorded by the DeepSpeed reader (formats/deepspeed/format.py): fp32 master weights at the top
    # level, model-dtype copies under module., engine state under deepspeed.
    Convention("deepspeed", "DeepSpeed ZeRO and universal checkpoints (global_stepN/)", "", "optimizer.", "index",
               ("module.", "deepspeed."), (), ("deepspeed",)),
    # Megatron-Core torch_dist (formats/megatron.py): model keys at the top level, optimizer
    # state as optimizer.state.<exp_avg|exp_avg_sq|param>.<key>, common.pt's entries beside.
    Convention("megatron", "Megatron-Core torch_dist (iter_N/ with metadata.json, common.pt)", "", "optimizer.",
               "index", ("args.", "rng_state.", "rerun_state_machine.", "opt_param_scheduler.", "checkpoint_version",
                         "iteration", "num_floating_point_operations_so_far", "content_metadata."),
               ("rng_state.*",), ("checkpoint_version", "opt_param_scheduler", "num_floating_point_operations_so_far"),
               state_order="key-fqn"),
    Convention("torch-optimizer-only", "get_optimizer_state_dict saved alone (state., param_groups.)", None, "",
               "fqn", ()),
    Convention("model", "a model state dict: HF, PEFT, torch.save(model.state_dict())", "", None, "index", ()),
)
_BY_NAME = {c.name: c for c in CONVENTIONS}
# What reshard itself records beside the tensors (an HF source's config.json...): never a
# parameter, whatever the layout (reshard.provenance).
_PROVENANCE = ("hf.", "reshard.")


@dataclass(frozen=True)
class Place:
    """What a name is. ``prefix + fqn + suffix`` is the name when ``fqn`` is set."""

    role: str
    fqn: str | None = None
    key: str | None = None  # optimizer state key (exp_avg), param-group key (lr)
    group: int | None = None  # param-group index (index-keyed groups)
    prefix: str = ""
    suffix: str = ""


def is_per_rank(name: str, globs: tuple[str, ...] = ()) -> bool:
    """Whether ``name`` holds one rank's private state (by a convention's globs or its parts)."""
    return any(fnmatch.fnmatchcase(name, g) for g in globs) or any(_PER_RANK_PART.match(p) for p in name.split("."))


class Layout:
    """A convention applied to one checkpoint's names."""

    def __init__(self, convention: Convention, names: Iterable[str], groups: str | None = None) -> None:
        self.convention = convention
        self.groups = groups or convention.groups
        self._places: dict[str, Place] = {}
        self._names = list(names)

    @property
    def name(self) -> str:
        return self.convention.name

    def place(self, name: str) -> Place:
        found = self._places.get(name)
        if found is None:
            found = self._places[name] = self._place(name)
        return found

    def _place(self, name: str) -> Place:
        c = self.convention
        if c.optimizer is not None:
            state, groups = c.optimizer + "state.", c.optimizer + "param_groups."
            if name.startswith(state) and c.state_order == "key-fqn":
                key, _, fqn = name[len(state):].partition(".")
                return Place(OPTIM_STATE, fqn, key, prefix=f"{state}{key}.") if fqn else Place(OTHER)
            if name.startswith(state):
                fqn, _, key = name[len(state):].rpartition(".")
                return Place(OPTIM_STATE, fqn, key, prefix=state, suffix="." + key) if fqn else Place(OTHER)
            if name.startswith(groups):
                rest = name[len(groups):]
                if self.groups == "index":
                    index, _, key = rest.partition(".")
                    if index.isdigit() and key:
                        return Place(OPTIM_GROUP, key=key, group=int(index))
                    return Place(OTHER)
                fqn, _, key = rest.rpartition(".")
                return Place(OPTIM_GROUP, fqn, key, prefix=groups, suffix="." + key) if fqn else Place(OTHER)
        if c.model and name.startswith(c.model) and len(name) > len(c.model):
            return Place(PARAM, name[len(c.model):], prefix=c.model)
        if is_per_rank(name, c.per_rank):
            return Place(PER_RANK)
        if c.model != "":
            return Place(OTHER)
        sections = c.sections + ((c.optimizer,) if c.optimizer else ()) + _PROVENANCE
        if any(name.startswith(s) or name == s.rstrip(".") for s in sections):
            return Place(OTHER)
        return Place(PARAM, name)

    def role(self, name: str) -> str:
        return self.place(name).role

    def param_fqn(self, name: str) -> str | None:
        """The parameter a tensor belongs to (itself, or the one whose optimizer state it is)."""
        p = self.place(name)
        return p.fqn if p.role in (PARAM, OPTIM_STATE) else None

    def casts(self, name: str, shape: tuple[int, ...], param_shapes: dict[str, tuple[int, ...]]) -> bool:
        """Whether ``--dtype`` may cast this (floating) tensor: parameters, and optimizer state
        shaped like its parameter (the moments; a plain optimizer's int-keyed state has no
        parameter to compare with: any non-scalar state); never ``step`` or other scalars."""
        p = self.place(name)
        if p.role == PARAM:
            return True
        if p.role != OPTIM_STATE or p.key == "step" or not shape:
            return False
        return param_shapes.get(p.fqn, shape) == shape

    def in_section(self, name: str, only: str) -> bool:
        """``--only model|optim|optimizer|PREFIX``: the model and optimizer by their role,
        whatever the tool calls their sections; anything else by name prefix."""
        if only == "model":
            return self.role(name) == PARAM
        if only in ("optim", "optimizer"):
            return self.role(name) in (OPTIM_STATE, OPTIM_GROUP) or (
                self.convention.optimizer is not None and name.startswith(self.convention.optimizer + "param_groups."))
        return name == only or name.startswith(only + ".")

    def model_prefix(self) -> str:
        return self.convention.model


def _score(convention: Convention, catalog: Catalog) -> tuple[int, int] | None:
    """How well ``convention`` explains ``catalog`` (higher is better), or None when it cannot
    be the one: its markers are absent, its optimizer state finds no parameter, or it would
    call ``model.`` a section although nothing says so (HF names start with ``model.`` too)."""
    tensors, objects = list(catalog.tensors), list(catalog.objects)
    heads = {n.split(".", 1)[0] for n in tensors + objects}
    if convention.markers and not heads & set(convention.markers):
        return None
    layout = Layout(convention, tensors + objects, _groups_style(convention, objects))
    params = {p.fqn for n in tensors if (p := layout.place(n)).role == PARAM}
    states = [p for n in tensors if (p := layout.place(n)).role == OPTIM_STATE]
    matched = sum(1 for p in states if p.fqn in params)
    by_id = sum(1 for p in states if p.fqn and p.fqn.isdigit())  # a plain optimizer's state: int ids, no FQNs
    if convention.model is None:
        return (0, len(states)) if states else None
    if states and not matched and not by_id and params:
        return None  # optimizer state that finds none of the parameters: wrong model prefix
    alone = len(states) if not params else by_id  # optimizer-only (accelerate's folder) or keyed by id
    markers = 1 if convention.markers else 0
    if convention.model:
        nested = any(len(path) >= 2 and path[0] == convention.model[:-1] for path in catalog.paths.values())
        if not (nested or matched or alone):
            return None
        return (markers, 2 * matched + len(params) + alone)
    return (markers, 2 * matched + alone)


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


def detect_layout(catalog: Catalog, override: str | None = None) -> Layout:
    """The layout ``catalog`` follows: ``override`` (a convention name), else the one its reader
    recorded (``catalog.attrs["layout"]``), else the best explanation among ``CONVENTIONS``
    (a plain model state dict when nothing else fits)."""
    tensors, objects = list(catalog.tensors), list(catalog.objects)
    choice = override or catalog.attrs.get("layout")
    if choice is not None:
        if choice not in _BY_NAME:
            raise UsageError(f"--layout {choice!r} is not one of: {', '.join(_BY_NAME)}")
        c = _BY_NAME[choice]
        return Layout(c, tensors + objects, _groups_style(c, objects))
    scored = [(score, -i, c) for i, c in enumerate(CONVENTIONS) if (score := _score(c, catalog)) is not None]
    best = max(scored, key=lambda s: (s[0], s[1]))[2] if scored else _BY_NAME["model"]
    return Layout(best, tensors + objects, _groups_style(best, objects))


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
