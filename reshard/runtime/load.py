"""Load any checkpoint straight into a live model, sharded or not, on any number of ranks.

The user story: a run saved on 64 GPUs resumes on 48; a model exported to the Hub starts a
new FSDP2 run; one ``model.pt`` on one node's disk feeds a 16-rank job. Nobody holds the
whole model: each rank receives exactly its boxes.

Lifecycle (every rank calls the same function, in the same order):

1. Each rank lists its live tensors and the box of the global tensor it holds
   (``runtime.targets``): DTensors by torch's own layout rule, plain tensors whole.
2. Mode: ``parallel`` when every rank sees the same source (shared storage), else
   ``rank0``; ``auto`` decides by comparing what each rank sees at the path.
3. The plan (``runtime.plan``) matches names and lists who needs which box. In ``rank0``
   mode rank 0 reads the catalog, builds the plan from every rank's boxes and broadcasts it;
   in ``parallel`` mode each rank builds it. A mismatch raises the same error on every rank
   before any live tensor is touched.
4. Bytes move (``runtime.transfer``): rank 0 streams slabs under ``max_memory`` and sends
   each to the ranks that hold it, or each rank reads its own.
5. ``load_model`` hands the filled state dicts back through torch's ``set_state_dict``
   helpers, with the checkpoint's optimizer hyper-parameters.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from reshard.core import errors
from reshard.core import torch_compat as _torch_compat
from reshard.core.catalog import Catalog, ObjectTable, object_loader
from reshard.core.dtypes import DType
from reshard.core.errors import ReshardError, UsageError
from reshard.core.gc_pause import paused_gc
from reshard.core.log import log_notices
from reshard.core.sizes import format_size, plural, preview
from reshard.formats.registry import detect_format, format_entry
from reshard.pipeline.options import LOAD_MODES, LoadOptions
from reshard.pipeline.parallel import world
from reshard.pipeline.progress import Progress
from reshard.runtime.load_plan import LIVE_STATE, LoadPlan, StateDictMismatchError, make_load_plan
from reshard.runtime.scatter import receive_boxes, send_boxes
from reshard.runtime.targets import Slot, make_slots, storage_aliases
from reshard.runtime.transfer import read_local
from reshard.safe_pickle.walk import find_in, replace_in
from reshard.sources.reading import given_config, given_layout

__all__ = ["load_model", "load_state_dict", "LoadOptions", "LoadResult", "StateDictMismatchError", "MODES"]

MODES = LOAD_MODES


@dataclass
class LoadResult:
    """What one rank loaded. ``objects`` are the checkpoint's non-tensor values (``train.step``,
    configs...), the same on every rank, as the types they were saved as (a ``torch.dtype``,
    ``torch.Size``, ``OrderedDict``, numpy scalar...), whichever format holds them."""

    source: Path
    mode: str  # "rank0", "parallel", or "local" (no process group)
    loaded: list[str]
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)
    bytes: int = 0  # bytes this rank read (parallel) or received; rank 0 in rank0 mode: read
    seconds: float = 0.0
    notices: list[str] = field(default_factory=list)  # the layout used and why, how optimizer state was matched

    def __repr__(self) -> str:
        """One screen, whatever the model's size: counts and the first few names."""
        return (f"LoadResult({str(self.source)!r}, mode={self.mode!r}, {len(self.loaded)} loaded, "
                f"missing={preview(self.missing)}, unexpected={preview(self.unexpected)}, "
                f"{len(self.objects)} objects, {format_size(self.bytes)} in {self.seconds:.2f}s, "
                f"notices={preview(self.notices, 2)})")


# ------------------------------------------------------------------------------ one world


def _comm_device() -> torch.device:
    """Where bytes travel: the GPU of this rank under NCCL (from LOCAL_RANK), else host memory."""
    if not (dist.is_available() and dist.is_initialized()) or "nccl" not in str(dist.get_backend()):
        return torch.device("cpu")
    if "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return torch.device("cuda", torch.cuda.current_device())


def _what_i_see(source: Path) -> tuple | None:
    """A cheap fingerprint of the source as this rank sees it; equal on all ranks means shared."""
    try:
        st = source.stat()
        if source.is_dir():
            return ("dir", tuple(sorted((e.name, e.stat().st_size if e.is_file() else -1)
                                        for e in os.scandir(source))))
        return ("file", st.st_size)
    except OSError:
        return None


def _choose_mode(mode: str, source: Path, world: int, tied: list[tuple[str, ...]]) -> tuple[str, list[Any] | None]:
    """The mode, and under ``auto`` every rank's ``tied`` names (gathered with what each rank
    sees at ``source``: one collective, which ``parallel`` mode needs anyway)."""
    if world == 1 and not (dist.is_available() and dist.is_initialized()):
        return "local", None
    if mode != "auto":
        return mode, None
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (_what_i_see(source), tied))
    seen = [g[0] for g in gathered]
    shared = seen[0] is not None and all(s == seen[0] for s in seen)
    return ("parallel" if shared else "rank0"), [g[1] for g in gathered]


_ERROR_TYPES = {c.__name__: c for c in [getattr(errors, n) for n in errors.__all__] + [StateDictMismatchError]}


def _shared_error(exc: BaseException, source: Path) -> tuple[str, str]:
    if isinstance(exc, ReshardError):
        return type(exc).__name__, str(exc)
    return "ReshardError", f"{source}: loading failed on another rank: {type(exc).__name__}: {exc}"


def _raise_shared(err: tuple[str, str]) -> NoReturn:
    raise _ERROR_TYPES.get(err[0], ReshardError)(err[1])


# ------------------------------------------------------------------------------ the plan


def _read_catalog(source: Path, opts: LoadOptions) -> Catalog:
    section = opts.section
    fmt = detect_format(source)
    if section is None:
        catalog = fmt.read(source)
    elif format_entry(fmt.name).model_sections:  # one model of several, with its optimizer
        index = _model_index(section)
        catalog = fmt.read(source, model_index=index)  # type: ignore[call-arg]  # model_sections says it takes it
        catalog.notices.append(f"section={section!r}: model {index} and its optimizer of {source}")
    else:
        catalog = _section_as_model(fmt.read(source), str(section))
    catalog = given_layout(given_config(catalog, opts.config), opts.layout)  # the config: head counts for a key map
    if opts.keymap is not None:
        from reshard.features.keymap.lookup import load_keymap  # its tables are imported when a load renames

        catalog = load_keymap(opts.keymap).apply(catalog)
    return catalog


def _model_index(section: str | int) -> int:
    """``1``, ``"1"`` or ``"pytorch_model_fsdp_1"``: the number accelerate gave the model."""
    text = str(section).rpartition("_")[2]
    if not text.isdigit():
        raise UsageError(f"section={section!r}: an accelerate folder's models are numbered: pass section=1 "
                         "for pytorch_model_fsdp_1/")
    return int(text)


def _section_as_model(catalog: Catalog, section: str) -> Catalog:
    """The tensors and objects under ``section.`` as the ``model.`` section (an EMA copy, a
    second model), in place of the checkpoint's own ``model.``; the other sections stay."""
    if not any(n.startswith(section + ".") for n in catalog.tensors):
        tops = sorted({n.split(".", 1)[0] for n in catalog.tensors if "." in n})
        raise UsageError(f"{catalog.path}: section={section!r} holds no tensors; its sections are {', '.join(tops)}")

    def moved(name: str) -> str | None:
        if name.startswith(section + "."):
            return "model." + name[len(section) + 1:]
        return None if name.startswith("model.") and section != "model" else name

    names = {n: moved(n) for n in [*catalog.tensors, *catalog.objects]}
    out = Catalog(format=catalog.format, path=catalog.path, facts=catalog.facts.copy(), notices=list(catalog.notices))
    out.tensors = {new: e.renamed(new) for n, e in catalog.tensors.items() if (new := names[n]) is not None}
    out.objects = ObjectTable({new: object_loader(catalog.objects, n) for n in catalog.objects
                               if (new := names[n]) is not None})
    out.paths = {new: ("model", *p[1:]) if new != n else p
                 for n, p in catalog.paths.items() if (new := names.get(n)) is not None}
    out.facts.layout = None  # what the reader took the names for no longer holds
    dropped = sum(1 for n in catalog.tensors if names[n] is None)
    out.notices.append(f"section={section!r}: its tensors are loaded as the model"
                       + (f"; the checkpoint's own model section ({plural(dropped, 'tensor')}) is not read" if dropped else ""))
    return out


@dataclass
class _Load:
    """A validated plan and what executing it needs on this rank."""

    source: Path
    mode: str
    plan: LoadPlan
    slots: dict[str, Slot]
    catalog: Catalog | None  # None on ranks that only receive

    def execute(self, progress: bool) -> int:
        rank, _ = world()
        if self.mode == "rank0":
            total = self.plan.total_bytes
        else:
            total = sum(self.slots[i.target].meta.numel * i.dtype.itemsize
                        for i in self.plan.items if i.target in self.slots)
        bar = Progress(total, f"loading {self.source.name}", enabled=progress and rank == 0)
        try:
            if self.mode != "rank0":
                assert self.catalog is not None  # every rank reads its own boxes
                return read_local(self.plan, self.catalog.tensors, self.slots, bar)
            if rank == 0:
                assert self.catalog is not None  # rank 0 reads for all
                return send_boxes(self.plan, self.catalog.tensors, self.slots, _comm_device(), bar)
            return receive_boxes(self.plan, self.slots, _comm_device())
        finally:
            bar.close()


def _anyone(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank: one small all_reduce, where gathering objects is two
    collectives and a pickle."""
    t = torch.tensor([int(flag)], device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _prepare(state_dict: Mapping[str, Any], source: str | os.PathLike, opts: LoadOptions,
             optimizer_groups: list[list[str]] | None = None) -> _Load:
    source = Path(source)
    strict = opts.strict
    slab_bytes = max(1, opts.budget // 4)  # a slab's reads; rank 0's messages in flight (scatter) hold as much
    slots = make_slots(state_dict)
    rank, size = world()
    mine = ({n: s.meta for n, s in slots.items()}, storage_aliases(slots))
    _comm_device()  # under NCCL, this rank's GPU before the first collective
    mode, tied = _choose_mode(opts.mode, source, size, mine[1])
    catalog: Catalog | None
    outcome: LoadPlan | tuple[str, str] | None  # the plan, or the error to raise on every rank
    if mode == "local":
        catalog = _read_catalog(source, opts)
        plan = make_load_plan(catalog, [mine[0]], mine[1], strict=strict, slab_bytes=slab_bytes,
                              optimizer_groups=optimizer_groups)
        return _Load(source, mode, plan, slots, catalog)
    if mode == "rank0":
        gathered: list[Any] | None = [None] * size if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    else:  # each rank plans only its own boxes; tied names still need everyone's view
        if tied is None:
            tied = [None] * size
            if _anyone(bool(mine[1])):
                dist.all_gather_object(tied, mine[1])
        gathered = [(mine[0], [a for t in tied if t for a in t])]
    catalog, outcome, failure = None, None, None
    if rank == 0 or mode == "parallel":
        try:
            catalog = _read_catalog(source, opts)
            assert gathered is not None  # rank 0 gathers in rank0 mode; every rank has its own otherwise
            metas = [g[0] for g in gathered]
            aliases = [a for g in gathered for a in g[1]]
            outcome = make_load_plan(catalog, metas, aliases, strict=strict, slab_bytes=slab_bytes,
                                     optimizer_groups=optimizer_groups)
        except BaseException as e:  # every rank must hear of it, or the others wait forever
            failure, outcome = e, _shared_error(e, source)
    if mode == "rank0":
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    elif _anyone(failure is not None):  # the errors themselves travel only when there is one
        outcomes: list[Any] = [None] * size
        dist.all_gather_object(outcomes, outcome if failure is not None else None)
        first = next((o for o in outcomes if o is not None), None)
        if first is not None and failure is None:
            _raise_shared(first)
    if failure is not None:
        raise failure
    if isinstance(outcome, tuple):
        _raise_shared(outcome)
    assert outcome is not None  # planned here, or by rank 0 and broadcast
    return _Load(source, mode, outcome, slots, catalog)


def _said(result: LoadResult) -> LoadResult:
    """``result``, its notices logged (once: every rank has the same)."""
    if world()[0] == 0:
        log_notices(result.notices)
    return result


def _result(load: _Load, nbytes: int, started: float) -> LoadResult:
    p = load.plan
    objects = {name: _as_saved(value) for name, value in p.objects.items()}
    return LoadResult(load.source, load.mode, p.loaded, list(p.missing), list(p.unexpected), objects,
                      nbytes, time.perf_counter() - started, list(p.notices))


def _as_saved(value: Any) -> Any:
    """An object as it was saved. Readers carry a saved ``torch.dtype`` as reshard's ``DType``
    (reading one needs no torch; a DCP byte object is already torch's), which user code
    compares with torch's (``== torch.bfloat16`` raises): here, every one is torch's again."""
    if find_in(value, lambda x: isinstance(x, DType)) is None:
        return value  # nothing to change (and an object that refers to itself is left as it is)
    return replace_in(value, lambda x: x.torch if isinstance(x, DType) else x)


# ------------------------------------------------------------------------------ public API


def _load_options(options: LoadOptions | None, **given: Any) -> LoadOptions:
    """The options of one load call, for both load functions: ``options`` with the arguments
    that differ from their defaults (``LoadOptions``'s, which the signatures repeat) put over
    its fields, or the arguments alone. Checked once, here, before any rank reads."""
    defaults = {f.name: f.default for f in fields(LoadOptions)}
    changed = {k: v for k, v in given.items() if not (v is defaults[k] or (type(v) is type(defaults[k]) and v == defaults[k]))}
    return LoadOptions.of(changed, options)


def load_state_dict(
    state_dict: Mapping[str, Any],
    source: str | os.PathLike,
    *,
    mode: str = "auto",
    keymap: Any = None,
    strict: bool = True,
    max_memory: str | int = "1GiB",
    progress: bool = True,
    layout: str | None = None,
    config: str | os.PathLike | None = None,
    section: str | int | None = None,
    options: LoadOptions | None = None,
) -> LoadResult:
    """Fill the tensors of ``state_dict`` (DTensors or plain, nested like DCP state dicts) in
    place from checkpoint ``source``, in any format reshard reads.

    Call it on every rank of an initialized process group, or in a single process without
    one. Names match exactly, then as the parameter (or its optimizer state) of the same FQN
    under the checkpoint's layout, whichever tool wrote it (``reshard.core.conventions``; ``layout``
    names one when detection is wrong); ``keymap`` (a preset name, a JSON path or a dict)
    renames the checkpoint's names first; ``config`` (a config.json, an HF folder or a Hub repo
    id) gives a key map the model's head counts when the checkpoint records none, as
    ``--config`` does on the CLI; ``section`` picks one model of an accelerate folder holding
    several (``1`` for ``pytorch_model_fsdp_1/`` and ``optimizer_1/``), or a section other
    than ``model`` to load as the model (``"ema"``).
    Values are cast to each tensor's dtype and device as they arrive. Non-tensor values are
    left alone; the checkpoint's objects come back in ``LoadResult.objects``.

    ``options`` (a ``LoadOptions``) gives these as one value, with ``allow_classes`` (classes
    read as inert data, for this call only); an argument given beside it with other than its
    default value overrides the field of the same name.

    >>> msd = get_model_state_dict(model)
    >>> reshard.load_state_dict(msd, "ckpt/", mode="rank0", max_memory="2GiB")
    >>> reshard.load_state_dict(msd, "ckpt/", options=LoadOptions(mode="rank0", keymap="hf-to-titan"))
    """
    started = time.perf_counter()
    opts = _load_options(options, mode=mode, keymap=keymap, strict=strict, max_memory=max_memory, progress=progress,
                         layout=layout, config=config, section=section)
    with opts.allowing(), paused_gc():  # the catalog and plan make many objects and no cycles
        load = _prepare(state_dict, source, opts)
        return _said(_result(load, load.execute(opts.progress), started))


def _param_groups(saved: Mapping[int | str, dict[str, Any]], live: list[dict[str, Any]], strict: bool,
                  source: Path) -> dict[int, dict]:
    """The checkpoint's hyper-parameters per live param group. Saved by group index (torch's
    ``state_dict``), they match by position; saved per parameter (torch's flattened optimizer
    state dict, as torchtitan saves it), a live group takes those of its parameters."""
    if not saved:
        return {}
    if all(isinstance(k, int) for k in saved):
        if len(saved) != len(live):
            if strict:
                raise StateDictMismatchError(
                    f"{source}: the checkpoint has {len(saved)} optimizer param groups, the optimizer {len(live)}. "
                    "Nothing was loaded. Build the optimizer with the same groups, or pass strict=False to keep "
                    "the optimizer's own hyper-parameters")
            return {}
        return {i: dict(saved[i]) for i in range(len(live)) if i in saved}
    out: dict[int, dict] = {}
    for i, group in enumerate(live):
        found = [saved[f] for f in group.get("params", []) if isinstance(f, str) and f in saved]
        if found:
            out[i] = dict(found[0])
        elif strict and group.get("params"):
            raise StateDictMismatchError(
                f"{source}: no saved hyper-parameters for the optimizer's param group {i} (its first parameter is "
                f"{group['params'][0]!r}). Nothing was loaded; pass strict=False to keep the optimizer's own")
    return out


def load_model(
    model: torch.nn.Module,
    source: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    mode: str = "auto",
    keymap: Any = None,
    strict: bool = True,
    max_memory: str | int = "1GiB",
    progress: bool = True,
    layout: str | None = None,
    config: str | os.PathLike | None = None,
    section: str | int | None = None,
    options: LoadOptions | None = None,
) -> LoadResult:
    """Load ``source`` into a plain, DDP or FSDP2 (``fully_shard``; 1-D, HSDP or TP+FSDP mesh) ``model``,
    and into ``optimizer`` when given: AdamW's exp_avg, exp_avg_sq and step resharded with
    their parameter, param-group hyper-parameters (lr, betas...) from the checkpoint. Any
    layout the common tools write is understood (``reshard.core.conventions``): ours and torch's
    ``{"model", "optim"}``, torchtitan's ``optimizer.state.<fqn>.<key>`` with per-parameter
    ``param_groups`` (model under ``model.`` or at the top level), plain model state dicts.

    An empty optimizer gets its state created first (torch's ``get_state_dict`` does this
    with a zero-gradient step at lr 0), so a fresh run can resume. Modes: ``rank0`` streams
    from rank 0, which alone reads ``source``; ``parallel`` lets every rank read its own
    boxes from shared storage; ``auto`` picks ``parallel`` when every rank sees the same
    source. Peak memory per rank is its shard plus about ``max_memory``. ``keymap``,
    ``config``, ``section``, ``layout`` and ``options`` are as in ``load_state_dict``.

    >>> model = Transformer(cfg); fully_shard(model, mesh=mesh); opt = AdamW(model.parameters())
    >>> reshard.load_model(model, "ckpt/step-1000", opt)   # saved on 64 GPUs, loaded on 48
    """
    started = time.perf_counter()
    opts = _load_options(options, mode=mode, keymap=keymap, strict=strict, max_memory=max_memory, progress=progress,
                         layout=layout, config=config, section=section)
    with opts.allowing(), paused_gc():
        return _load_model(model, source, optimizer, opts, started)


def _load_model(model: torch.nn.Module, source: str | os.PathLike, optimizer: torch.optim.Optimizer | None,
                opts: LoadOptions, started: float) -> LoadResult:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    strict = opts.strict
    optimizer, unwrapped = _inner_optimizer(optimizer)
    msd, osd, by_torch = _live_state(model, optimizer)
    targets: dict[str, Any] = dict(msd)
    if osd is not None:
        targets[LIVE_STATE.split(".")[0]] = {"state": osd["state"]}
    order = [[str(f) for f in g.get("params", [])] for g in osd["param_groups"]] if osd else None
    load = _prepare(targets, source, opts, order)
    groups = _param_groups(load.plan.groups, osd["param_groups"], strict, load.source) if osd else {}
    nbytes = load.execute(opts.progress)
    result = _result(load, nbytes, started)
    result.notices += unwrapped
    if by_torch:
        # The filled tensors are the model's and optimizer's own memory; these calls are what
        # makes that true for wrappers that hand out copies, and what torch expects.
        set_model_state_dict(model, msd)
        if osd is not None:
            assert optimizer is not None  # osd is its state
            for index, values in groups.items():
                osd["param_groups"][index].update(values)
            set_optimizer_state_dict(model, optimizer, osd)
        return _said(result)
    # The model's own state dict: its load hooks turn the names it saves back into its
    # parameters (torchtitan's FusedQKVLinear fuses wq/wk/wv into wqkv); the optimizer's
    # state tensors were filled in place.
    model.load_state_dict(msd, strict=False)
    if optimizer is not None:  # else no groups
        for index, values in groups.items():
            optimizer.param_groups[index].update(values)
    result.notices.append("loaded through the model's own state_dict and load_state_dict: torch's get_state_dict "
                          "cannot walk this model's state dict names to its parameters")
    return _said(result)


def _inner_optimizer(optimizer: torch.optim.Optimizer | None) -> tuple[torch.optim.Optimizer | None, list[str]]:
    """The optimizer that holds the state. torchtitan's ``OptimizersContainer`` is itself an
    ``Optimizer`` whose own ``state`` stays empty: its AdamW lives in ``.optimizers``, and
    state written into the container would be silently ignored by training."""
    inner = getattr(optimizer, "optimizers", None)
    if optimizer is None or not isinstance(inner, (list, tuple)) or not inner:
        return optimizer, []
    if not all(isinstance(o, torch.optim.Optimizer) for o in inner):
        return optimizer, []
    if len(inner) > 1:
        raise UsageError(f"optimizer is a {type(optimizer).__name__} of {len(inner)} optimizers (one per model part); "
                         "pass the model part and its own optimizer, one load_model call each")
    return inner[0], [f"optimizer: the {type(inner[0]).__name__} inside {type(optimizer).__name__} holds the state"]


def _live_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None, bool]:
    """(model state dict, optimizer state dict keyed by FQN, whether torch's helpers made them).

    torch's ``get_state_dict`` maps every state dict name back to a module attribute, which
    fails for modules whose state dict hooks save their parameters under other names (the
    stock names torchtitan's fused q/k/v projection writes). Those models are loaded the way
    their own trainer loads them: ``model.state_dict()`` to fill, ``load_state_dict`` to apply,
    and the optimizer's state keyed by the FQNs of ``named_parameters``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    try:
        if optimizer is None:
            return dict(get_model_state_dict(model)), None, True
        msd, osd = get_state_dict(model, optimizer)
        return dict(msd), osd, True
    except (AttributeError, KeyError) as e:
        if not _renamed_by_hooks(model):
            raise UsageError(f"torch's get_state_dict cannot read this model ({type(e).__name__}: {e}); pass its "
                             "state dict to reshard.load_state_dict instead") from e
    msd = dict(model.state_dict())
    if optimizer is None:
        return msd, None, False

    _torch_compat.init_optimizer_state(optimizer)
    fqn_of = {id(p): fqn for fqn, p in model.named_parameters(remove_duplicate=False)}
    missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in fqn_of]
    if missing:
        raise UsageError(f"the optimizer holds {len(missing)} parameters that are not the model's; pass the "
                         "optimizer built over model.parameters()")
    state = {fqn_of[id(p)]: optimizer.state[p] for g in optimizer.param_groups for p in g["params"] if p in optimizer.state}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn_of[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return msd, {"state": state, "param_groups": groups}, False


def _renamed_by_hooks(model: torch.nn.Module) -> bool:
    """Whether some module's state dict hooks change the names its parameters are saved under."""
    return any(getattr(m, "_state_dict_hooks", None) or getattr(m, "_state_dict_pre_hooks", None)
               for m in model.modules())
