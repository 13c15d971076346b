"""The round-trip contract: a real FSDP2 DCP checkpoint converted to every format, each output
read by the library that owns the format (safetensors, torch.load, torch's DCP loader), equal
to the original full tensors bit for bit, model and optimizer state."""

from __future__ import annotations

import json
import struct
from collections import Counter, OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file

import reshard
from reshard.core.errors import UsageError


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _load_sharded_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        out.update(load_file(folder / file))
    assert set(out) == set(index["weight_map"])
    return out


def _from_nested_torch(full: dict, name: str) -> torch.Tensor:
    parts = name.split(".")
    if parts[0] == "model":
        return full["model"][".".join(parts[1:])]
    if parts[0] == "optim":
        return full["optim"]["state"][".".join(parts[2:-1])][parts[-1]]
    return full[parts[0]][".".join(parts[1:])]


def test_dcp_to_every_format_is_exact(fsdp2_dcp, fsdp2_reference, tmp_path: Path) -> None:
    src = fsdp2_dcp[0]

    reshard.convert(src, tmp_path / "x.safetensors", quiet=True)
    single = load_file(tmp_path / "x.safetensors")
    assert set(single) == set(fsdp2_reference)
    assert all(_bits_equal(single[n], t) for n, t in fsdp2_reference.items())
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        assert f.metadata()["format"] == "pt"

    reshard.convert(src, tmp_path / "sharded", to="safetensors", max_shard_size="20KB", quiet=True)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    reshard.convert(src, tmp_path / "many", to="safetensors", max_shard_size="300B", quiet=True)
    many = _load_sharded_safetensors(tmp_path / "many")
    assert len(list((tmp_path / "many").glob("model-*-of-*.safetensors"))) > 2
    assert all(_bits_equal(many[n], t) for n, t in fsdp2_reference.items())

    reshard.convert(src, tmp_path / "x.pt", to="torch", quiet=True)
    full = torch.load(tmp_path / "x.pt", weights_only=True)
    assert all(_bits_equal(_from_nested_torch(full, n), t) for n, t in fsdp2_reference.items())
    assert full["optim"]["param_groups"][0]["betas"] == (0.9, 0.999) and full["extra"]["step"] == 2

    reshard.convert(src, tmp_path / "again", to="dcp", quiet=True)
    sd = {n: torch.empty_like(t) for n, t in fsdp2_reference.items()}
    dcp.load(sd, checkpoint_id=tmp_path / "again")
    assert all(_bits_equal(sd[n], t) for n, t in fsdp2_reference.items())


def test_chained_conversions_stay_exact(fsdp2_dcp, fsdp2_reference, tmp_path: Path) -> None:
    src = fsdp2_dcp[0]
    reshard.convert(src, tmp_path / "st", to="safetensors", max_shard_size="300B", quiet=True)
    reshard.convert(tmp_path / "st", tmp_path / "dcp", to="dcp", quiet=True)
    reshard.convert(tmp_path / "dcp", tmp_path / "final.pt", quiet=True)
    full = torch.load(tmp_path / "final.pt", weights_only=True)
    assert all(_bits_equal(_from_nested_torch(full, n), t) for n, t in fsdp2_reference.items())
    # Objects survived the safetensors hop, tuples included.
    assert full["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert full["optim"]["param_groups"][0]["params"][0] == "embed.weight"
    assert reshard.verify(src, tmp_path / "final.pt").equal
    # And back: a torch file converts to DCP that matches the source.
    reshard.convert(tmp_path / "final.pt", tmp_path / "back", quiet=True)
    assert reshard.verify(src, tmp_path / "back").equal


def test_model_export_with_cast_and_selection(fsdp2_dcp, fsdp2_reference, tmp_path: Path) -> None:
    """--only model writes the model's own state dict (section prefix dropped), which
    model.load_state_dict takes as it is; --dtype casts the model, nothing else."""
    from tests.fixtures import TinyNet

    src = fsdp2_dcp[0]
    reshard.convert(src, tmp_path / "m.safetensors", only="model", dtype="bfloat16", max_memory="1KiB", quiet=True)
    got = load_file(tmp_path / "m.safetensors")
    model = {n.removeprefix("model."): t for n, t in fsdp2_reference.items() if n.startswith("model.")}
    assert set(got) == set(model)
    assert all(_bits_equal(got[n], t.to(torch.bfloat16)) for n, t in model.items())
    TinyNet().to(torch.bfloat16).load_state_dict(got)  # strict: every key, no prefix
    reshard.convert(src, tmp_path / "m.pt", only="model", exclude="*norm*", quiet=True)
    kept = torch.load(tmp_path / "m.pt", weights_only=True)
    assert set(kept) == {n for n in model if "norm" not in n}
    assert all(_bits_equal(kept[n], model[n]) for n in kept)
    with pytest.raises(UsageError, match="nothing"):
        reshard.convert(src, tmp_path / "none.pt", only="nope", quiet=True)
    with pytest.raises(UsageError, match=r"exclude=\['nope'\] matches nothing"):
        reshard.convert(src, tmp_path / "none.pt", exclude="nope", quiet=True)


def test_dtype_casts_parameters_and_moments_never_step(fsdp2_dcp, fsdp2_reference, tmp_path: Path) -> None:
    """AdamW's float32 step (1001 would become 1000.0 in bf16) and non-model state keep their
    dtype; parameters and the moments shaped like them are cast."""
    reshard.convert(fsdp2_dcp[0], tmp_path / "all.pt", dtype="bfloat16", quiet=True)
    out = torch.load(tmp_path / "all.pt", weights_only=True)
    state = out["optim"]["state"]["embed.weight"]
    assert out["model"]["embed.weight"].dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert state["step"].dtype == torch.float32 and state["step"].dim() == 0
    assert torch.equal(state["step"], fsdp2_reference["optim.state.embed.weight.step"])
    assert out["extra"]["scale"].dtype == torch.float32


def _optimizer_checkpoints(tmp_path: Path, make: str) -> tuple[torch.nn.Module, dict[str, Path]]:
    """A tiny model after two steps of a real torch optimizer, saved three ways: torch's
    get_state_dict under DCP (state keyed by FQN), ``torch.save`` of ``opt.state_dict()`` beside
    the model (keyed by index) and alone. NAdam's ``mu_product`` is stored as ``(1,)`` for a
    (4, 3) weight (a value, not a moment) and for a (1,) bias (shaped like its parameter)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    opt = {"nadam": lambda p: torch.optim.NAdam(p, lr=0.1), "adam": lambda p: torch.optim.Adam(p, amsgrad=True),
           "adafactor": lambda p: torch.optim.Adafactor(p), "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)
           }[make](model.parameters())
    for _ in range(2):
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
    if make == "nadam":
        for p in (model[0].weight, model[1].bias):
            opt.state[p]["mu_product"] = opt.state[p]["mu_product"].reshape(1)
    paths = {"fqn": tmp_path / f"{make}_dcp", "index": tmp_path / f"{make}_index.pt", "alone": tmp_path / f"{make}_alone.pt"}
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=paths["fqn"], no_dist=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, paths["index"])
    torch.save(opt.state_dict(), paths["alone"])
    return model, paths


@pytest.mark.parametrize("make", ["nadam", "adam", "adafactor", "sgd"])
def test_dtype_casts_moments_and_keeps_every_other_optimizer_value(tmp_path: Path, make: str, capsys) -> None:
    """--dtype casts parameters and the optimizer tensors shaped like their parameter; every
    other optimizer value (step, mu_product whether 0-d or (1,), Adafactor's factored rows and
    columns) keeps its dtype and bits, whether the state is keyed by FQN, by index beside the
    model, or saved alone, and the notice names what it left. Read back by torch.load and by
    torch's own DCP reader."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from reshard.cli.app import main

    model, paths = _optimizer_checkpoints(tmp_path, make)
    params = dict(model.named_parameters())
    order = list(params)
    out = {"fqn": tmp_path / "fqn_bf16.pt", "index": tmp_path / "index_bf16", "alone": tmp_path / "alone_bf16.pt"}
    notices = reshard.convert(paths["fqn"], out["fqn"], dtype="bfloat16", quiet=True).notices
    reshard.convert(paths["index"], out["index"], to="dcp", dtype="bfloat16", quiet=True)
    dcp_to_torch_save(out["index"], tmp_path / "index_bf16.pt")
    assert main(["convert", str(paths["alone"]), str(out["alone"]), "--dtype", "bfloat16"]) == 0
    stderr = capsys.readouterr().err
    got = {"fqn": torch.load(out["fqn"], weights_only=True), "alone": torch.load(out["alone"], weights_only=True),
           "index": torch.load(tmp_path / "index_bf16.pt", weights_only=True)}
    saved_state = torch.load(paths["index"], weights_only=True)["optimizer"]["state"]  # keyed by index
    cast: set[tuple[str, str]] = set()
    for variant, full in got.items():
        state = full["optim" if variant == "fqn" else "optimizer"]["state"] if variant != "alone" else full["state"]
        if variant != "alone":
            section = full["model"]
            assert set(section) == set(params), variant
            assert all(_bits_equal(section[n], p.detach().to(torch.bfloat16)) for n, p in params.items()), variant
        for index, fqn in enumerate(order):
            values = state[{"fqn": fqn, "index": str(index), "alone": index}[variant]]  # DCP keys are strings
            saved = saved_state[index]
            assert set(values) == set(saved), (variant, fqn)
            for key, before in saved.items():
                moment = key != "step" and before.dim() > 0 and before.shape == params[fqn].shape
                want = before.to(torch.bfloat16) if moment else before
                assert _bits_equal(values[key], want), (make, variant, fqn, key, values[key].dtype)
                if moment:
                    cast.add((fqn, key))
    kept_words = [line for line in [*notices, *stderr.splitlines()] if "kept as saved" in line]
    if make == "nadam":
        # The (1,) mu_product of a (4, 3) weight is a value; of a (1,) bias, shaped like it.
        assert ("0.weight", "mu_product") not in cast and ("1.bias", "mu_product") in cast
        assert len(kept_words) == 2 and all("mu_product" in line for line in kept_words), kept_words
        assert ("kept as saved: 7 optimizer tensors (state.0.mu_product, state.1.mu_product, state.2.mu_product and 4 more; "
                "optimizer steps") in stderr, stderr
    if make == "adafactor":
        assert ("0.weight", "row_var") not in cast and ("0.bias", "variance") in cast
        assert all("row_var" in line for line in kept_words), kept_words
    if make == "sgd":
        assert cast == {(fqn, "momentum_buffer") for fqn in order} and not kept_words


def test_default_destination_is_beside_the_source(fsdp2_dcp, tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(fsdp2_dcp[0], src)
    before = {p.name: p.stat().st_mtime_ns for p in src.iterdir()}
    result = reshard.convert(src, to="torch", quiet=True, fsync=True)  # the durable path too
    assert result.dst == tmp_path / "ckpt.pt" and result.dst.is_file()
    assert reshard.verify(src, result.dst).equal
    result = reshard.convert(src, quiet=True)
    assert result.dst == tmp_path / "ckpt_dcp"
    assert {p.name: p.stat().st_mtime_ns for p in src.iterdir()} == before  # the source is untouched
    # Every default names what changed, so two different conversions never collide.
    dry = {args: reshard.convert(src, dry_run=True, quiet=True, **dict(args)).dst.name for args in (
        (("dtype", "bf16"),), (("mesh", "3"),), (("mesh", "3"), ("to", "torch")), (("to", "hf"), ("weights_only", True)),
        (("to", "safetensors"), ("max_shard_size", "1MB")), (("to", "zarr"), ("mesh", "2")))}
    assert list(dry.values()) == ["ckpt_bfloat16", "ckpt_3", "ckpt_3_torch", "ckpt_hf", "ckpt_safetensors", "ckpt_2.zarr"]
    assert not any((tmp_path / name).exists() for name in dry.values())  # a dry run writes nothing


@pytest.mark.parametrize("args, message", [
    (["out.onnx"], "reshard does not write .onnx files"),
    (["sh.safetensors", "--max-shard-size", "500KB"], "a sharded safetensors output is a folder"),
    (["x.pt", "--max-shard-size", "1MB"], "--max-shard-size applies to hf, safetensors and zarr outputs, not torch"),
    (["--keep-per-rank"], "--keep-per-rank applies with --to-mesh"),
    (["--max-memory", "10"], "--max-memory 10: 10 B is too small"),
    (["--to-mesh", "foo=2"], "unknown dimension 'foo'"),
    (["/proc/out.pt"], "/proc/out.pt: cannot write here"),
])
def test_surprising_outputs_and_options_are_one_line_errors(fsdp2_dcp, tmp_path: Path, args: list[str], message: str) -> None:
    from tests.test_cli import assert_one_line_error
    from tests.test_cli import reshard as run_cli

    args = [str(tmp_path / a) if a.endswith((".onnx", ".safetensors", ".pt")) and not a.startswith("/") else a
            for a in args]
    assert_one_line_error(run_cli("convert", fsdp2_dcp[0], *args, "--quiet"), message)
    assert [p for p in tmp_path.iterdir()] == []


def test_errors_name_options_the_way_the_caller_gives_them(fsdp2_dcp, tmp_path: Path) -> None:
    """From Python the advice is ``overwrite=True``, from the shell ``--overwrite``."""
    from reshard.core.errors import OutputExistsError
    from tests.test_cli import assert_one_line_error
    from tests.test_cli import reshard as run_cli

    out = tmp_path / "out.pt"
    reshard.convert(fsdp2_dcp[0], out, quiet=True)
    with pytest.raises(OutputExistsError, match=r"pass overwrite=True to replace it"):
        reshard.convert(fsdp2_dcp[0], out, quiet=True)
    with pytest.raises(UsageError, match=r"keep_per_rank=True applies with to_mesh="):
        reshard.convert(fsdp2_dcp[0], tmp_path / "x.pt", keep_per_rank=True, quiet=True)
    proc = run_cli("convert", fsdp2_dcp[0], out, "--quiet")
    assert_one_line_error(proc, "pass --overwrite to replace it")
    assert "overwrite=True" not in proc.stderr


def test_results_print_on_one_screen(fsdp2_dcp, tmp_path: Path) -> None:
    from reshard.cli.example import TinyNet

    result = reshard.convert(fsdp2_dcp[0], tmp_path / "out", to_mesh="3", quiet=True)
    text = repr(result)
    assert len(text) < 600 and f"{result.tensors} tensors" in text and "__0_0.distcp" in text, text
    loaded = reshard.load_model(TinyNet(), tmp_path / "out", progress=False)
    text = repr(loaded)
    assert len(text) < 600 and f"{len(loaded.loaded)} loaded" in text and "missing=[]" in text, text


def test_a_library_call_never_starts_a_process_group(fsdp2_dcp, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun's variables without a group, reshard.convert refuses (every rank would
    write the same output) instead of joining one behind the caller's back."""
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(UsageError, match="no process group is initialized: call torch.distributed.init_process_group"):
        reshard.convert(fsdp2_dcp[0], tmp_path / "out", quiet=True)
    assert not dist.is_initialized() and not (tmp_path / "out").exists()


def test_options_as_one_value_or_keywords(fsdp2_dcp, tmp_path: Path) -> None:
    """``ConvertOptions`` is what the CLI builds; keyword arguments override its fields, and a
    misspelt one is a usage error naming the real ones."""
    from reshard.formats.options import ConvertOptions

    opts = ConvertOptions(only="model", dtype="bfloat16", quiet=True)
    result = reshard.convert(fsdp2_dcp[0], tmp_path / "m.safetensors", options=opts)
    assert {v.dtype for v in load_file(result.dst).values()} == {torch.bfloat16}
    result = reshard.convert(fsdp2_dcp[0], tmp_path / "f.safetensors", options=opts, dtype=None)
    assert {v.dtype for v in load_file(result.dst).values()} == {torch.float32}
    with pytest.raises(UsageError, match="unknown conversion option 'dtpye'; the options are .*dtype"):
        reshard.convert(fsdp2_dcp[0], tmp_path / "x.pt", dtpye="bfloat16")


def _float_from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def test_float_objects_keep_their_bits_through_safetensors_and_zarr(tmp_path: Path) -> None:
    """Floats saved beside tensors (NaN payloads and signs, signed zeros, infinities) come back
    bit for bit from a safetensors or zarr hop, as torch.load reads the final file; an object
    JSON cannot hold exactly is named in a notice, never written as something close."""
    import zarr

    floats = {"nan_payload": _float_from_bits(0xFFF8000000000123), "signaling": _float_from_bits(0x7FF0000000000001),
              "neg_nan": _float_from_bits(0xFFF8000000000000), "nan": float("nan"), "neg_zero": -0.0,
              "inf": float("inf"), "neg_inf": float("-inf"), "tiny": 5e-324}
    src = {"w": torch.arange(4.0), **floats, "betas": (0.9, floats["nan_payload"]), "by_id": {0: -0.0},
           "ordered": OrderedDict(lr=0.1), "counts": Counter(a=2)}
    torch.save(src, tmp_path / "src.pt")
    st = reshard.convert(tmp_path / "src.pt", tmp_path / "x.safetensors", quiet=True)
    with safe_open(tmp_path / "x.safetensors", "pt") as f:  # safetensors' own reader takes the metadata
        stored = json.loads(f.metadata()["reshard.objects"])
    assert stored["nan_payload"] == {"__float__": "0xfff8000000000123"} and stored["inf"] == {"__float__": "inf"}
    assert st.notices == ["object 'counts' holds a value of type Counter, which safetensors metadata cannot "
                          "store; it is left out (write dcp or torch to keep it)"]
    assert stored["ordered"] == {"__odict__": [["lr", 0.1]]}
    reshard.convert(tmp_path / "src.pt", tmp_path / "x.zarr", quiet=True)
    attrs = zarr.open_group(tmp_path / "x.zarr", mode="r").attrs.asdict()  # zarr-python reads the attributes
    assert attrs["reshard.objects"]["signaling"] == {"__float__": "0x7ff0000000000001"}
    assert _bits(attrs["reshard.objects"]["neg_zero"]) == _bits(-0.0)
    for hop, kept in (("x.safetensors", set(src) - {"counts"}), ("x.zarr", set(src))):
        reshard.convert(tmp_path / hop, tmp_path / f"{hop}.pt", quiet=True)
        back = torch.load(tmp_path / f"{hop}.pt", weights_only=True)
        assert set(back) == kept, hop
        for name, value in floats.items():
            assert type(back[name]) is float and _bits(back[name]) == _bits(value), (hop, name)
        assert type(back["betas"]) is tuple and [_bits(x) for x in back["betas"]] == [_bits(0.9), _bits(floats["nan_payload"])]
        assert list(back["by_id"]) == [0] and _bits(back["by_id"][0]) == _bits(-0.0), hop
        assert type(back["ordered"]) is OrderedDict and back["ordered"] == OrderedDict(lr=0.1), hop
        if "counts" in kept:  # zarr keeps it in its torch.save side file
            assert type(back["counts"]) is Counter and back["counts"] == Counter(a=2)


def test_a_taken_output_fails_before_the_source_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """"out already exists; pass --overwrite" came after the whole read and plan (25 s of an HF
    export); it comes first now, for a DST given and for the default one, and --dry-run (which
    writes nothing) still runs."""
    import importlib

    from reshard.core.errors import OutputExistsError
    from tests.test_cli import reshard as cli

    src = tmp_path / "m.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2, 3)}, src)
    taken = tmp_path / "out.pt"
    taken.write_bytes(b"mine")
    module = importlib.import_module("reshard.commands.convert")
    read = module.resolve_source

    def never_read(*args, **kwargs):
        raise AssertionError("the source was read before the output was checked")

    monkeypatch.setattr(module, "resolve_source", never_read)
    with pytest.raises(OutputExistsError, match="out.pt already exists; pass overwrite=True"):
        reshard.convert(src, taken)
    proc = cli("convert", src, taken)
    assert proc.returncode == 2 and "out.pt already exists; pass --overwrite" in proc.stderr
    with pytest.raises(UsageError, match="parent folder"):
        reshard.convert(src, tmp_path / "missing" / "out.pt")
    monkeypatch.setattr(module, "resolve_source", read)
    assert reshard.convert(src, taken, dry_run=True).dry_run
    assert taken.read_bytes() == b"mine"
    reshard.convert(src, taken, overwrite=True)
    assert torch.equal(torch.load(taken, weights_only=True)["w"], torch.ones(2, 3))


def test_an_hf_sources_config_is_kept_and_said_to_be(tmp_path: Path) -> None:
    """torch's dcp_to_torch_save of reshard's DCP output shows a top-level 'hf' key (the config
    JSON as text): kept for a later --to hf, and the conversion now says so."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.test_cli import reshard as cli

    src = tmp_path / "hf"
    src.mkdir()
    from safetensors.torch import save_file

    save_file({"model.embed.weight": torch.ones(4, 2)}, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 2}))
    proc = cli("convert", src, tmp_path / "out", "--to", "dcp")
    assert proc.returncode == 0, proc.stderr
    assert "config.json kept as text (hf.config_json): torch's own readers" in proc.stderr
    assert "top-level 'hf' entry" in proc.stderr
    dcp_to_torch_save(tmp_path / "out", tmp_path / "theirs.pt")
    theirs = torch.load(tmp_path / "theirs.pt", weights_only=True)
    assert json.loads(theirs["hf"]["config_json"])["hidden_size"] == 2
    only = reshard.convert(src, tmp_path / "only.pt", only="model")
    assert not any("kept as text" in n for n in only.notices)
