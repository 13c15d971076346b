"""Is an HF folder the model its ``config.json`` describes? Asked of transformers itself.

Bytes can be exact and the export still wrong: an MLP's weights under a Llama config load as a
randomly initialised Llama, every parameter "missing" in a warning nobody reads. So before an
export appears (``--to hf``), before a push sends anything, and in ``verify --quick`` of an HF
folder, the folder's tensor names, shapes and dtypes are loaded the way ``from_pretrained``
loads them, on the meta device (no memory, no weights read):

1. the config class of ``model_type`` reads config.json, and the class its ``architectures``
   names is built on the meta device;
2. a quantized release's quantizer replaces the modules it quantizes, as on a GPU
   (``FP8Linear`` wants ``weight`` float8 + ``weight_scale_inv``), except where transformers
   only knows how to dequantize (MXFP4 without its kernels), whose load path is checked then;
3. transformers' own weight conversions (fused experts, renamed checkpoints) and its loader
   (``convert_and_load_state_dict_in_model``) take meta tensors of the folder's shapes and
   dtypes and say what is missing, unexpected or of another shape; tied weights are tied and
   the keys the model itself declares ignorable are ignored, as ``from_pretrained`` does.

On top, dtypes: a tensor whose bytes are not a compute float (float8, integers, packed
nibbles) must land on a parameter or buffer of that very dtype, or be consumed by the
release's quantizer, since anywhere else transformers would cast its raw values. And
config.json's ``dtype`` must be a compute dtype: it is what the model runs in, not what most
bytes happen to be (an FP8 release says ``bfloat16``).

Where transformers is not installed, or does not know the architecture, nothing can be
checked, and the caller says so in a notice: never a silent pass.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import shlex
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from reshard.core.dtypes import COMPUTE_DTYPES
from reshard.core.errors import CorruptCheckpointError, option
from reshard.core.log import LOGGER
from reshard.core.sizes import plural
from reshard.features.hf_options import ARCHITECTURE_CHECK
from reshard.pipeline.progress import status

__all__ = ["ArchitectureCheck", "ArchitectureMismatchError", "check_architecture", "require_architecture", "ExportCheck",
           "COMPUTE_DTYPES", "ModelFacts", "model_facts"]

_SHOWN = 3  # names shown per kind of problem


class ArchitectureMismatchError(CorruptCheckpointError):
    """The tensors are not the model config.json describes (exit 2)."""


@dataclass
class ArchitectureCheck:
    """What loading the tensors into the config's model found. ``checked`` is False where
    nothing could be checked (``reason`` says why); ``expected`` counts the model's own
    parameters and persistent buffers."""

    architecture: str | None
    checked: bool
    reason: str = ""
    expected: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # name, found, expected
    dtypes: list[str] = field(default_factory=list)  # one line per tensor whose dtype the model cannot take
    errors: list[str] = field(default_factory=list)  # config.json problems and conversion errors

    @property
    def ok(self) -> bool:
        return self.checked and not (self.missing or self.unexpected or self.mismatched or self.dtypes or self.errors)

    def problems(self) -> str:
        """The findings in one line: counts, then the first few names of each kind."""
        parts = list(self.errors[:1])
        if self.missing:
            parts.append(f"{len(self.missing)} of its {self.expected} tensors missing ({_names(self.missing)})")
        if self.unexpected:
            parts.append(f"{plural(len(self.unexpected), 'tensor')} it does not have ({_names(self.unexpected)})")
        if self.mismatched:
            name, found, want = self.mismatched[0]
            parts.append(f"{len(self.mismatched)} of another shape ({name}: {list(found)}, the model's is {list(want)})")
        if self.dtypes:
            parts.append(f"{len(self.dtypes)} of a dtype it would not read as stored ({self.dtypes[0]})")
        return "; ".join(parts)

    def hint(self, source_name: Callable[[str], str] | None = None) -> str:
        """The likely fix, from what was found; ``source_name`` gives the source's name of a
        tensor a key map or the export renamed (``--exclude`` matches those)."""
        config = "give the config of the model these weights are with --config CONFIG.json|HF_DIR|REPO_ID"
        if self.missing and self.unexpected:
            return f"rename the tensors to the model's names with --keymap PRESET|MAP.json, or {config}"
        if self.missing or self.mismatched or self.errors:
            return config
        if self.unexpected:
            names = [(source_name or str)(n) for n in self.unexpected]
            shown = names[:_SHOWN]
            what = option("--exclude " + " ".join(shlex.quote(n) for n in shown), f"exclude={shown!r}")
            renamed = " (the source's name" + ("s" if len(shown) > 1 else "") + ")" if names != self.unexpected else ""
            more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
            return f"leave out what the model does not have with {what}{renamed}{more}, or {config}"
        return config

    def notice(self) -> str:
        """What a successful or impossible check says in the result's notices."""
        if not self.checked:
            return f"not checked against an architecture: {self.reason}"
        return (f"checked against {self.architecture} built by transformers on the meta device: its {self.expected} "
                "parameters and buffers are all there, with their shapes and dtypes")


def _names(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")


def _compute_dtype_problem(config: Mapping[str, Any]) -> str | None:
    value = config.get("dtype", config.get("torch_dtype"))
    if value is None or value == "auto":
        return None
    name = str(value).removeprefix("torch.")
    if name not in {d.name for d in COMPUTE_DTYPES}:
        return (f"config.json says dtype {value!r}, which is not a dtype a model computes in "
                "(it is what from_pretrained makes the weights); float16, bfloat16 or float32")
    return None


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings and loading bars are about a load that never happens, and so are
    the bars a quantizer's own library draws while the model is built ("Applying quantization
    config", "Compressing model": compressed-tensors' tqdm bars, on ``sys.stderr``, with no
    switch to turn them off). transformers is told to be quiet; what is written to
    ``sys.stderr`` meanwhile is held back (the debug log has it: ``--debug``). reshard's own
    lines are unaffected: its log handler and bars hold the stream they were given."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
        if held.getvalue().strip():
            LOGGER.debug("held back from stderr while building the model on the meta device:\n%s", held.getvalue().rstrip())


def check_architecture(config: Mapping[str, Any], tensors: Mapping[str, Any]) -> ArchitectureCheck:
    """Load ``tensors`` (name -> anything with ``shape`` and ``dtype``) into the model that
    ``config`` (config.json as a dict) describes, on the meta device, as ``from_pretrained``
    would. Never raises for a mismatch: the result says what was found."""
    problem = _compute_dtype_problem(config)
    names = config.get("architectures")
    shown = names[0] if isinstance(names, list) and names and isinstance(names[0], str) else config.get("model_type", "model")
    # transformers and the model's module take seconds to import (a minute on a busy machine)
    with status(f"checking the tensors against {shown}: importing transformers, building it on the meta device"):
        return _checked(config, tensors, problem)


def _checked(config: Mapping[str, Any], tensors: Mapping[str, Any], problem: str | None) -> ArchitectureCheck:
    try:
        import transformers
    except ImportError:
        return ArchitectureCheck(None, False, "transformers is not installed (pip install transformers)")
    try:  # the loader of transformers 5 (weight conversions on load); 4.x loads another way
        from transformers.core_model_loading import convert_and_load_state_dict_in_model  # noqa: F401
    except ImportError:
        return ArchitectureCheck(None, False, f"transformers {transformers.__version__} is older than 5.0, whose "
                                              "loader the check runs (pip install -U transformers)")
    with _quiet_transformers():
        built = _build(config)
        if isinstance(built, ArchitectureCheck):
            if problem:
                built.errors.insert(0, problem)
            return built
        try:
            result = _load(built, tensors)
        except (TypeError, AttributeError, ImportError) as e:  # transformers' loader internals moved
            return ArchitectureCheck(built.architecture, False, f"transformers {transformers.__version__}'s loader did "
                                                                f"not take the check's call ({_first_line(e)})")
    if problem:
        result.errors.insert(0, problem)
    return result


def require_architecture(config: Mapping[str, Any], tensors: Mapping[str, Any], *, where: str, action: str,
                         fix: str | None = None, source_name: Callable[[str], str] | None = None) -> str:
    """The check's notice for a result, or ArchitectureMismatchError naming the first problems,
    the likely fix (``fix``, else a guess from the names, in the source's names where
    ``source_name`` gives them) and the flag that does ``action`` anyway."""
    check = check_architecture(config, tensors)
    if check.checked and not check.ok:
        raise ArchitectureMismatchError(
            f"{where}: not the {check.architecture} its config.json describes: {check.problems()}; "
            f"{fix or check.hint(source_name)}, "
            f"or pass {ARCHITECTURE_CHECK.named} to {action} anyway")
    return check.notice()


@dataclass(frozen=True)
class ExportCheck:
    """The check the HF writer runs before it lays out a file, as the export step records it
    (the ``hf_check`` fact: the writer, in ``formats/hf``, imports no feature): the tensors
    against the model config.json describes, or, when ``enabled`` is off
    (``--no-architecture-check``), the notice that says they were not checked. Called with
    (config.json, tensors, where, the source's name of a tensor); returns the notice."""

    enabled: bool = True

    def __call__(self, config: Mapping[str, Any], tensors: Mapping[str, Any], where: str,
                 source_name: Callable[[str], str]) -> str:
        if not self.enabled:
            return f"not checked against an architecture ({ARCHITECTURE_CHECK.named})"
        return require_architecture(config, tensors, where=where, action="write it", source_name=source_name)


@dataclass
class _Built:
    architecture: str
    model: Any
    quantizer: Any
    dtype: Any  # the torch compute dtype


def _model_class(config: Mapping[str, Any]) -> tuple[str | None, Any, str]:
    """(class name, class or None, why not) of the config's architecture."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    names = config.get("architectures")
    model_type = config.get("model_type")
    name: str | None
    if isinstance(names, list) and names and isinstance(names[0], str):
        name = names[0]
    elif isinstance(model_type, str):
        found = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_MAPPING_NAMES.get(model_type)
        name = found if isinstance(found, str) else None  # a few model types map to several classes: none is picked
    else:
        return None, None, "config.json names neither architectures nor model_type"
    cls = getattr(transformers, name, None) if name is not None else None
    if cls is None:
        return name, None, (f"transformers {transformers.__version__} does not know the architecture "
                            f"{name or model_type!r} (custom code is never run)")
    return name, cls, ""


def _build(config: Mapping[str, Any]) -> _Built | ArchitectureCheck:
    import torch
    import transformers
    from transformers import CONFIG_MAPPING

    name, cls, why = _model_class(config)
    if cls is None:
        return ArchitectureCheck(name, False, why)
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return ArchitectureCheck(name, False, f"transformers {transformers.__version__} does not know model_type {model_type!r}")
    try:
        hf_config = CONFIG_MAPPING[cast(str, model_type)].from_dict(dict(config))  # one of its keys (checked above)
    except Exception as e:  # noqa: BLE001 - any config transformers refuses is a config from_pretrained refuses
        return ArchitectureCheck(name, True, errors=[f"transformers cannot read config.json: {_first_line(e)}"])
    dtype = _torch_dtype(config)
    quantizer = None
    try:
        if getattr(hf_config, "quantization_config", None) is not None:
            from transformers.quantizers.auto import AutoHfQuantizer

            # As on a GPU: the quantized modules replaced (FP8Linear...), not dequantized, so
            # the names and dtypes of the release are what is expected.
            quantizer = AutoHfQuantizer.from_config(hf_config.quantization_config, pre_quantized=True)
            if type(quantizer).__name__ == "CompressedTensorsHfQuantizer":
                quantizer.validate_environment()  # as from_pretrained: picks its kernel path by the hardware
        from transformers.modeling_utils import local_torch_dtype

        with torch.device("meta"), local_torch_dtype(dtype, name):  # made in config.json's dtype, as from_pretrained does
            model = cls(hf_config)
            if quantizer is not None:
                quantizer.preprocess_model(model=model, dtype=dtype, device_map=None, checkpoint_files=None,
                                           use_kernels=False)
    except ImportError as e:  # the architecture or quantizer needs a package that is not installed
        return ArchitectureCheck(name, False, f"transformers cannot build {name} here: {_first_line(e)}")
    except Exception as e:  # noqa: BLE001 - from_pretrained would fail the same way
        return ArchitectureCheck(name, True, errors=[f"transformers cannot build {name} from config.json: {_first_line(e)}"])
    assert name is not None  # _model_class gives a class only with its name
    return _Built(name, model, quantizer, dtype)


@dataclass(frozen=True)
class ModelFacts:
    """What the model ``config`` describes says of its modules, read from it built on the meta
    device: ``linear`` maps every module name, in the model's own order, to whether it is an
    ``nn.Linear`` (transformers' quantizers replace those only: GPT-2's projections are
    ``Conv1D``, weights stored transposed); ``embed`` and ``head`` are the weights of
    ``get_input_embeddings`` and ``get_output_embeddings`` (``transformer.wte.weight`` for
    GPT-2, not Llama's ``model.embed_tokens.weight``); ``tied``: the config ties them, its class
    default included (Gemma's config.json may leave ``tie_word_embeddings`` out)."""

    linear: dict[str, bool]
    embed: str | None
    head: str | None
    tied: bool
    classes: dict[str, str] = field(default_factory=dict)  # module name -> its class's name (``Conv1D``...)
    # what a checkpoint name is called in the loaded model: transformers 5 renames on load
    # (Llava's ``language_model.model.layers`` -> ``model.language_model.layers``)
    loaded_name: Callable[[str], str] = str

    def loaded_names(self, names: Iterable[str]) -> dict[str, str]:
        """Checkpoint name -> the loaded model's name, for the ``names`` a rename changes."""
        out = {}
        for name in names:
            loaded = self.loaded_name(name)
            if loaded != name:
                out[name] = loaded
        return out


def model_facts(config: Mapping[str, Any]) -> ModelFacts | None:
    """``ModelFacts`` of the config's model; None where transformers cannot build it here."""
    import json

    return _model_facts(json.dumps(config, sort_keys=True, default=str))


@functools.lru_cache(maxsize=4)
def _model_facts(config_json: str) -> ModelFacts | None:
    import json

    import torch

    with _quiet_transformers():
        built = _build(json.loads(config_json))
    if isinstance(built, ArchitectureCheck):
        return None
    model = built.model
    names = {id(module): name for name, module in model.named_modules() if name}

    def weight_of(module: Any) -> str | None:
        return f"{names[id(module)]}.weight" if module is not None and id(module) in names else None

    try:
        embed, head = weight_of(model.get_input_embeddings()), weight_of(model.get_output_embeddings())
    except (NotImplementedError, AttributeError):
        embed = head = None
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    tied = bool(getattr(text, "tie_word_embeddings", getattr(model.config, "tie_word_embeddings", False)))
    modules = [(n, m) for n, m in model.named_modules() if n]
    return ModelFacts({n: isinstance(m, torch.nn.Linear) for n, m in modules}, embed, head, tied,
                      {n: type(m).__name__ for n, m in modules}, _renamer(model))


def _renamer(model: Any) -> Callable[[str], str]:
    """transformers' own renaming of checkpoint keys on load (``rename_source_key`` with the
    model's ``WeightRenaming`` rules; converters that merge tensors are left out: a LoRA delta
    targets one module's weight); the identity where this transformers has none."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    except (ImportError, AttributeError, TypeError):
        return str
    if not renamings:
        return str
    prefix = getattr(model, "base_model_prefix", None)
    known = dict.fromkeys(model.state_dict(), True)

    def loaded(name: str) -> str:
        return rename_source_key(name, renamings, [], prefix, known)[0]

    return loaded


def _torch_dtype(config: Mapping[str, Any]) -> Any:
    import torch

    value = str(config.get("dtype", config.get("torch_dtype")) or "float32").removeprefix("torch.")
    found = getattr(torch, value, None)
    return found if isinstance(found, torch.dtype) and found.is_floating_point and found.itemsize >= 2 else torch.float32


def _load(built: _Built, tensors: Mapping[str, Any]) -> ArchitectureCheck:
    import torch
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        convert_and_load_state_dict_in_model,
        rename_source_key,
    )
    from transformers.modeling_utils import LoadStateDictConfig

    model, quantizer = built.model, built.quantizer
    expected = {k: v.dtype for k, v in model.state_dict().items()}
    mapping = get_model_conversion_mapping(model, None, quantizer)
    # transformers' annotations disagree with each other: the mapping is typed list[WeightTransform],
    # the config's weight_mapping list[WeightConverter | WeightRenaming] (the subclasses it holds)
    load_config = LoadStateDictConfig(device_map={"": "meta"}, dtype=built.dtype, dtype_plan=model._get_dtype_plan(built.dtype),
                                      hf_quantizer=quantizer, weight_mapping=mapping)  # type: ignore[arg-type]
    state = {n: torch.empty(t.shape, dtype=t.dtype.torch, device="meta") for n, t in tensors.items()}
    info, _ = convert_and_load_state_dict_in_model(model=model, state_dict=state, load_config=load_config)
    model.mark_tied_weights_as_initialized(info)
    model.tie_weights(missing_keys=info.missing_keys, recompute_mapping=False)
    model._adjust_missing_and_unexpected_keys(info)

    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    wrong: list[str] = []
    for name, t in tensors.items():
        if name in info.unexpected_keys:
            continue
        target, converted = rename_source_key(name, renamings, converters, model.base_model_prefix, expected)
        want = expected.get(target)
        if want is None or want == t.dtype.torch or _computes(want) and _computes(t.dtype.torch):
            continue
        if converted is not None and quantizer is not None and _computes(want):
            continue  # the release's quantizer turns its own dtypes into the model's (MXFP4 dequantized on load)
        wrong.append(f"{name}: {t.dtype.name}, the model's {str(want).removeprefix('torch.')}")
    errors = [f"transformers could not convert {k}: {_last_line(v)}" for k, v in sorted(info.conversion_errors.items())]
    return ArchitectureCheck(
        built.architecture, True, expected=len(expected),
        missing=sorted(info.missing_keys, key=_natural), unexpected=sorted(info.unexpected_keys, key=_natural),
        mismatched=sorted(((k, tuple(a), tuple(b)) for k, a, b in info.mismatched_keys), key=lambda m: _natural(m[0])),
        dtypes=wrong, errors=errors + list(info.error_msgs))


def _computes(dtype: Any) -> bool:
    return dtype.is_floating_point and dtype.itemsize >= 2


def _natural(name: str) -> list[Any]:
    """``layers.2`` before ``layers.10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _first_line(e: BaseException) -> str:
    """An exception's text on one line (transformers' validation errors span several)."""
    text = " ".join(str(e).split())
    return (text[:300] + " ...") if len(text) > 300 else text or type(e).__name__


def _last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else "failed"

