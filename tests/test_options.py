"""ConvertOptions is checked when it is built: the API and the CLI refuse the same options with
the same message (each naming the option as its caller writes it), before any source is read."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from reshard.formats.options import ConvertOptions

import reshard
from reshard.core.errors import UsageError
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as run_cli

CASES = [
    # (API keyword arguments, CLI flags, what both messages say)
    ({"mesh": "3x"}, ["--to-mesh", "3x"], "give the mesh as 8, 4x8 or dp_replicate=4,dp_shard=8"),
    ({"dtype": "float33"}, ["--dtype", "float33"], "float33"),
    ({"placements": "fsdp"}, ["--placements", "fsdp"], "needs"),
    ({"keep_per_rank": True}, ["--keep-per-rank"], "applies with"),
    ({"keep_dtype": ["norm"]}, ["--keep-dtype", "norm"], "(nothing is cast otherwise)"),
    ({"max_shard_size": "lots"}, ["--max-shard-size", "lots"], "cannot read size 'lots'"),
    ({"max_memory": "0"}, ["--max-memory", "0"], "must be positive"),
]


@pytest.mark.parametrize("given, flags, said", CASES)
def test_the_api_and_the_cli_refuse_the_same_options_before_reading(given: dict, flags: list[str], said: str,
                                                                     tmp_path: Path) -> None:
    missing = tmp_path / "no-such-checkpoint"  # never opened: the options are refused first
    with pytest.raises(UsageError, match=None) as api:
        ConvertOptions(**given)
    with pytest.raises(UsageError):
        reshard.convert(missing, tmp_path / "out", **given)
    assert said in str(api.value)
    proc = run_cli("convert", missing, tmp_path / "out", *flags)
    assert_one_line_error(proc, said)
    assert "no such file" not in proc.stderr


def test_options_are_named_as_their_caller_writes_them() -> None:
    with pytest.raises(UsageError, match=r"placements= needs to_mesh="):
        ConvertOptions(placements="fsdp")
    proc = run_cli("convert", "nowhere", "--placements", "fsdp")
    assert_one_line_error(proc, "--placements needs --to-mesh")
    # The command line's budget floor (a slip like 512 for 512MiB); the API moves data in any budget.
    assert ConvertOptions(max_memory="4KiB").budget == 4096
    assert_one_line_error(run_cli("convert", "nowhere", "--max-memory", "4KiB"), "--max-memory 4KiB: 4.0 KiB is too small")


# ------------------------------------------------------------------ SourceOptions and LoadOptions

SOURCE_CASES = [
    # (SourceOptions/LoadOptions arguments, the CLI command that takes the same value, what both say after the option)
    ({"layout": "nope"}, ["inspect", "--layout", "nope"], "'nope' is not one of: torchtitan, "),
    ({"allow_classes": ["os.system"]}, ["inspect", "--allow-class", "os.system"], "os.system can run code when loaded"),
    ({"allow_classes": ["Config"]}, ["verify", "--allow-class", "Config"], "expected a name such as module.ClassName"),
    ({"max_memory": "0"}, ["verify", "--max-memory", "0"], "size '0' must be positive"),
    ({"max_memory": "lots"}, ["verify", "--max-memory", "lots"], "cannot read size 'lots'"),
]


@pytest.mark.parametrize("given, flags, said", SOURCE_CASES)
def test_source_and_load_options_refuse_what_the_cli_refuses_when_built(given: dict, flags: list[str], said: str,
                                                                         tmp_path: Path) -> None:
    """Built, not when the source is opened: the CLI refuses before it looks for the (missing)
    checkpoint, with the message the API gives, each naming the option its own way."""
    from reshard.pipeline.options import LoadOptions, SourceOptions

    kinds = [LoadOptions] if "max_memory" in given else [SourceOptions, LoadOptions, ConvertOptions]
    for kind in kinds:
        with pytest.raises(UsageError) as api:
            kind(**given)
        assert said in str(api.value), kind
    missing = tmp_path / "no-such-checkpoint"
    command, *rest = flags
    proc = run_cli(command, missing, *([missing] if command == "verify" else []), *rest)
    assert_one_line_error(proc, said)
    assert said in proc.stderr and "no such file" not in proc.stderr.lower(), proc.stderr
    name = rest[0]  # the CLI names the flag, the API the keyword argument
    assert name in proc.stderr and name not in str(api.value)


def test_load_options_are_checked_once_and_both_loads_share_one_signature() -> None:
    """LoadOptions is what load_model and load_state_dict take: their shared parameters have
    LoadOptions' names and defaults, and a bad value is refused when the options are built."""
    import inspect

    from reshard.pipeline.options import LoadOptions

    defaults = {f.name: f.default for f in dataclasses.fields(LoadOptions)}
    for fn in (reshard.load_model, reshard.load_state_dict):
        params = inspect.signature(fn).parameters
        shared = {n: p.default for n, p in params.items() if n in defaults}
        assert shared == {n: defaults[n] for n in shared} and len(shared) == 8, fn
        assert params["options"].default is None and params["options"].kind is inspect.Parameter.KEYWORD_ONLY
    with pytest.raises(UsageError, match="mode 'broadcast' is not one of auto, rank0, parallel"):
        LoadOptions(mode="broadcast")
    with pytest.raises(UsageError, match="load_model and load_state_dict read local paths"):
        LoadOptions(storage_options={"anon": True})
    with pytest.raises(UsageError, match="unknown load option 'strictly'"):
        reshard.load_state_dict({}, "nowhere", options=LoadOptions.of({"strictly": False}))
    opts = LoadOptions(mode="rank0", keymap="strip-wrappers", allow_classes="a.B")
    assert opts.allow_classes == ("a.B",) and opts.source == reshard.SourceOptions(keymap="strip-wrappers",
                                                                                   allow_classes=("a.B",))
    assert ConvertOptions(layout="state-dict", to="dcp").source == reshard.SourceOptions(layout="state-dict")


def test_load_model_and_load_state_dict_take_options(tmp_path: Path) -> None:
    """``options=LoadOptions(...)``: its fields apply (a key map, strict), and an argument given
    beside it (other than its default) overrides the field of the same name. Checked against
    torch's own file."""
    import torch

    from reshard.pipeline.options import LoadOptions
    from reshard.runtime.load_plan import StateDictMismatchError

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    saved = {f"_orig_mod.{k}": torch.randn_like(v) for k, v in model.state_dict().items() if k != "1.bias"}
    torch.save(saved, tmp_path / "ckpt.pt")
    reference = torch.load(tmp_path / "ckpt.pt", weights_only=True)

    with pytest.raises(StateDictMismatchError):  # no key map: no name matches
        reshard.load_model(model, tmp_path / "ckpt.pt", progress=False)
    relaxed = LoadOptions(keymap="strip-wrappers", strict=False, progress=False)
    result = reshard.load_model(model, tmp_path / "ckpt.pt", options=relaxed)
    assert result.missing == ["1.bias"]
    for name, value in model.state_dict().items():
        if name != "1.bias":
            assert torch.equal(value, reference[f"_orig_mod.{name}"]), name

    live = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    renamed = LoadOptions(keymap="strip-wrappers", progress=False)  # strict, as by default
    with pytest.raises(StateDictMismatchError, match="1.bias"):
        reshard.load_state_dict(live, tmp_path / "ckpt.pt", options=renamed)
    result = reshard.load_state_dict(live, tmp_path / "ckpt.pt", strict=False, options=renamed)  # the argument wins
    assert result.missing == ["1.bias"] and torch.equal(live["0.weight"], reference["_orig_mod.0.weight"])


def test_allowed_classes_hold_for_one_call_only(tmp_path: Path) -> None:
    """``allow_classes`` of a call's options allow the class while that call runs (and for the
    objects of the catalog ``inspect`` returns), in that call's context: never process-wide,
    never after it, never in another thread meanwhile."""
    import sys
    import threading

    import torch

    from reshard.core.errors import UnsafeCheckpointError
    from reshard.pipeline.options import SourceOptions
    from reshard.safe_pickle.unpickler import allowed_classes, allowing
    from tests.formats.test_torch_save import save_unimportable

    save_unimportable(tmp_path / "in.pt", lambda m: {"model": {"w": torch.arange(4.0)}, "args": m.Config(3e-4, torch.ones(2))})
    trusted = ["no_such_pkg.conf.Config"]
    reshard.convert(tmp_path / "in.pt", tmp_path / "out", to="dcp", allow_classes=trusted, quiet=True)
    assert allowed_classes() == frozenset()
    with pytest.raises(UnsafeCheckpointError, match="no_such_pkg.conf.Config"):
        reshard.inspect(tmp_path / "in.pt").objects["args"]
    catalog = reshard.inspect(tmp_path / "out", options=SourceOptions(allow_classes=trusted))
    assert allowed_classes() == frozenset()
    assert type(catalog.objects["args"]).inert_qualname == "Config"  # a DCP object read after the call: still allowed
    with pytest.raises(UnsafeCheckpointError):
        reshard.inspect(tmp_path / "out").objects["args"]
    result = reshard.verify(tmp_path / "in.pt", tmp_path / "out", options=SourceOptions(allow_classes=trusted))
    assert result.equal and allowed_classes() == frozenset()
    seen: list[frozenset] = []
    with allowing(trusted):
        thread = threading.Thread(target=lambda: seen.append(allowed_classes()))
        thread.start()
        thread.join()
        assert allowed_classes() == frozenset(trusted)
    assert seen == [frozenset()] and allowed_classes() == frozenset()
    assert "no_such_pkg" not in sys.modules


def test_inspect_and_verify_take_source_options(tmp_path: Path) -> None:
    """One SourceOptions for both, as ``options=``: inspect shows the names a key map gives,
    verify compares across it; the keyword arguments they had still work, and so does the
    former name ``source_options=``, with a DeprecationWarning."""
    import torch
    from safetensors.torch import save_file

    from reshard.pipeline.options import SourceOptions

    tensors = {"_orig_mod.w": torch.arange(6.0).reshape(2, 3)}
    save_file(tensors, tmp_path / "a.safetensors")
    save_file({"w": tensors["_orig_mod.w"]}, tmp_path / "b.safetensors")
    renamed = SourceOptions(keymap="strip-wrappers", layout="state-dict")
    assert list(reshard.inspect(tmp_path / "a.safetensors", options=renamed).tensors) == ["w"]
    assert list(reshard.inspect(tmp_path / "a.safetensors", layout="state-dict").tensors) == ["_orig_mod.w"]
    assert reshard.verify(tmp_path / "a.safetensors", tmp_path / "b.safetensors", options=renamed).equal
    with pytest.warns(DeprecationWarning, match=r"reshard.inspect\(source_options=...\) is now reshard.inspect\(options=...\)"):
        assert list(reshard.inspect(tmp_path / "a.safetensors", source_options=renamed).tensors) == ["w"]
    with pytest.warns(DeprecationWarning, match="reshard.verify"):
        assert reshard.verify(tmp_path / "a.safetensors", tmp_path / "b.safetensors", source_options=renamed).equal
    with pytest.raises(UsageError, match="disagree"):
        reshard.verify(tmp_path / "a.safetensors", tmp_path / "b.safetensors", options=SourceOptions(), source_options=renamed)
    assert reshard.verify(tmp_path / "a.safetensors", tmp_path / "b.safetensors", keymap="strip-wrappers").equal
    assert not reshard.verify(tmp_path / "a.safetensors", tmp_path / "b.safetensors").ok


# (function, its inputs): every public function takes these positionally, then options by keyword.
PUBLIC_SHAPES = [
    ("reshard:inspect", ("path",)),
    ("reshard.commands.convert:convert", ("src", "dst")),
    ("reshard.commands.verify:verify", ("a", "b")),
    ("reshard.runtime.load:load_model", ("model", "source", "optimizer")),
    ("reshard.runtime.load:load_state_dict", ("state_dict", "source")),
    ("reshard.runtime.storage_reader:StorageReader", ("path",)),
    ("reshard.features.hub:push", ("folder", "repo_id")),
    ("reshard.commands.validate:validate", ("from_mesh", "to_mesh")),
]


def not_one_shape(function: object, inputs: tuple[str, ...]) -> list[str]:
    """The parameters of ``function`` that break the API's one shape: its inputs, then keyword
    options only."""
    import inspect as pyinspect

    params = list(pyinspect.signature(function).parameters.values())
    wrong = [f"input {p.name}" for p, want in zip(params, inputs) if p.name != want]
    return wrong + [f"{p.name} is positional" for p in params[len(inputs):] if p.kind not in (p.KEYWORD_ONLY, p.VAR_KEYWORD)]


@pytest.mark.parametrize("target, inputs", PUBLIC_SHAPES)
def test_every_public_function_takes_inputs_then_keyword_options(target: str, inputs: tuple[str, ...]) -> None:
    import importlib

    module, _, name = target.partition(":")
    assert not_one_shape(getattr(importlib.import_module(module), name), inputs) == []


def test_the_shape_rule_sees_a_positional_option() -> None:
    def load(model, source, optimizer=None, mode="auto", *, options=None): ...

    assert not_one_shape(load, ("model", "source", "optimizer")) == ["mode is positional"]


def test_validate_takes_the_mesh_as_convert_does() -> None:
    """``--to-mesh`` is ``to_mesh=`` in every command; the former ``mesh=`` still works, with
    a DeprecationWarning naming the release that removes it (checked before any rank is spawned)."""
    from reshard.commands.validate import validate

    with pytest.warns(DeprecationWarning, match=r"validate\(mesh=...\) is now validate\(to_mesh=...\); mesh= is removed in "
                                                r"reshard 0\.4"):
        with pytest.raises(UsageError, match="--via"):
            validate("2", mesh="3", via=())
    with pytest.raises(UsageError, match="validate needs to_mesh="):
        validate("2")


def test_convert_takes_the_keyword_its_flag_names(fsdp2_dcp, tmp_path) -> None:
    """``--to-mesh`` is ``to_mesh=``; ``mesh=`` still works, warning which release removes it."""
    import warnings

    from reshard.formats.options import ConvertOptions

    import reshard

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        four = reshard.convert(fsdp2_dcp[0], tmp_path / "out", to_mesh="4", quiet=True)
    assert (tmp_path / "out" / "__3_0.distcp").exists() and not (tmp_path / "out" / "__4_0.distcp").exists()
    assert four.ranks is None or len(four.ranks) == 4
    with pytest.warns(DeprecationWarning, match=r"reshard\.convert\(mesh=...\) is now reshard\.convert\(to_mesh=...\); "
                                                r"mesh= is removed in reshard 0\.4"):
        reshard.convert(fsdp2_dcp[0], tmp_path / "old", mesh="4", quiet=True)
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == sorted(p.name for p in (tmp_path / "out").iterdir())
    with pytest.warns(DeprecationWarning):
        assert ConvertOptions(mesh="2").to_mesh == "2"
    with pytest.raises(UsageError, match="disagree"):
        ConvertOptions(mesh="2", to_mesh="3")
