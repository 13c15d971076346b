"""DeepSpeed ZeRO and universal checkpoints written by DeepSpeed 0.19.8 itself
(``tests/data/deepspeed/``, see its README), read without DeepSpeed installed.

The references are DeepSpeed's own answers, saved beside each checkpoint when it was written:
``get_fp32_state_dict_from_zero_checkpoint`` for the weights, the live engine's
``safe_get_full_optimizer_state`` for the Adam moments, its step and lr, and its bf16 params.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from reshard.formats.deepspeed.zero import zero3_params, zero12_params
from safetensors.torch import load_file

import reshard
from reshard.core.boxes import full_box
from reshard.core.chunk_reads import read_box
from reshard.core.conventions import OPTIM_GROUP, OTHER, PARAM, detect_layout
from reshard.core.errors import CorruptCheckpointError
from tests.schema import check
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as cli

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed"
ZERO3, ZERO2, UNIVERSAL, ODD = "zero3_bf16", "zero2_bf16", "zero3_bf16_universal", "zero3_fp32_3ranks"
# ZeRO-2 on 3 ranks (the last partition saved without its padding), two frozen parameters, tied embeddings.
FROZEN = "zero2_bf16_3ranks_frozen_tied"


def _ref(name: str) -> dict:
    return torch.load(DATA / name / "reference.pt", weights_only=True)


def _read(cat: reshard.Catalog, name: str) -> torch.Tensor:
    return read_box(cat.tensors[name], full_box(cat.tensors[name].shape))


@pytest.mark.parametrize("name, src", [
    (ZERO3, f"{ZERO3}/global_step2"), (ZERO3, ZERO3),  # the tag folder, and its parent through `latest`
    (ZERO2, f"{ZERO2}/global_step2"), (ZERO2, ZERO2),
    (ZERO3, f"{UNIVERSAL}/global_step2_universal"), (ZERO3, UNIVERSAL),  # ds_to_universal's output of ZERO3
    (ODD, f"{ODD}/global_step2"),  # 3 ranks: every parameter padded to a multiple of 3
    (FROZEN, FROZEN),
])
def test_convert_equals_deepspeeds_own_fp32_state_dict(name: str, src: str, tmp_path: Path) -> None:
    ref = _ref(name)["fp32"]
    # One file is what zero_to_fp32 writes: exactly DeepSpeed's dict, names and bits.
    proc = cli("convert", DATA / src, tmp_path / "model.safetensors", "--max-memory", "1MiB")
    assert proc.returncode == 0, proc.stderr
    assert "fp32 master weights only" in proc.stderr
    model = load_file(tmp_path / "model.safetensors")
    assert sorted(model) == sorted(ref) and all(model[k].dtype == v.dtype and torch.equal(model[k], v) for k, v in ref.items())
    # A DCP folder keeps everything: the Adam state too, and ZeRO-2's bf16 copies of the weights.
    proc = cli("convert", DATA / src, tmp_path / "all", "--max-memory", "1MiB", "--quiet")
    assert proc.returncode == 0, proc.stderr
    out = reshard.inspect(tmp_path / "all")
    for k, v in ref.items():  # DeepSpeed's own names, bit for bit
        assert out.tensors[k].dtype.torch == v.dtype and torch.equal(_read(out, k), v), k
    trained = _ref(name)["exp_avg"]  # frozen parameters have no optimizer state
    extra = {f"optimizer.state.{k}.{s}" for k in trained for s in ("exp_avg", "exp_avg_sq", "step")}
    copies = {f"module.{k}" for k in trained} if name.startswith("zero2") else set()
    assert {n for n in out.tensors if n not in ref} == extra | copies


@pytest.mark.parametrize("name, src", [(ZERO3, ZERO3), (ZERO2, ZERO2), (ZERO3, UNIVERSAL), (ODD, ODD), (FROZEN, FROZEN)])
def test_moments_step_lr_and_engine_state_are_deepspeeds(name: str, src: str) -> None:
    ref = _ref(name)
    cat = reshard.inspect(DATA / src)
    layout = detect_layout(cat)
    assert cat.format == "deepspeed" and layout.name == "deepspeed"
    for fqn in ref["exp_avg"]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_read(cat, f"optimizer.state.{fqn}.{key}"), ref[key][fqn]), (fqn, key)
        assert torch.equal(_read(cat, f"optimizer.state.{fqn}.step"), ref["step"])
        assert layout.place(f"optimizer.state.{fqn}.exp_avg").fqn == fqn and layout.role(fqn) == PARAM
    assert cat.objects["optimizer.param_groups.0.lr"] == ref["lr"]
    assert cat.objects["optimizer.param_groups.0.betas"] == (0.9, 0.95)
    assert cat.objects["optimizer.param_groups.0.params"] == list(ref["exp_avg"])  # FQNs, not DeepSpeed's [0]
    assert layout.role("optimizer.param_groups.0.lr") == OPTIM_GROUP
    # DeepSpeed's own classes and the client state, read as plain data.
    stage = 2 if name.startswith("zero2") else 3
    assert cat.objects["optimizer.zero_stage"] == stage and cat.objects["optimizer.loss_scaler.cur_scale"] == 1.0
    assert cat.objects["deepspeed.global_steps"] == 2 and cat.objects["deepspeed.ds_version"] == "0.19.8"
    args = cat.objects["deepspeed.args"]
    assert isinstance(args, argparse.Namespace) and args.zero_stage == stage
    assert layout.role("deepspeed.args") == OTHER and layout.role("optimizer.zero_stage") == OTHER
    doc = check(json.loads(cli("inspect", DATA / src, "--json").stdout))  # the documented schema
    assert doc["format"] == "deepspeed" and doc["layout"]["name"] == "deepspeed"


def test_model_dtype_weights_and_hf_export(tmp_path: Path) -> None:
    """ZeRO-2 keeps the bf16 weights beside the fp32 master (``module.<fqn>``, not a parameter);
    ``--dtype bfloat16`` of the master gives exactly those, and DeepSpeed's own bf16 params."""
    ref = _ref(ZERO2)
    cat = reshard.inspect(DATA / ZERO2)
    layout = detect_layout(cat)
    for fqn, bf16 in ref["model_dtype"].items():
        assert bf16.dtype == torch.bfloat16 and torch.equal(_read(cat, f"module.{fqn}"), bf16)
        assert layout.role(f"module.{fqn}") == OTHER
    assert not any(n.startswith("module.") for n in reshard.inspect(DATA / ZERO3).tensors)  # ZeRO-3 stores none
    for name in (ZERO2, ZERO3):
        out = tmp_path / f"{name}_hf"
        proc = cli("convert", DATA / name, out, "--to", "hf", "--dtype", "bfloat16", "--config",
                   DATA / name / "config.json", "--quiet")
        assert proc.returncode == 0, proc.stderr
        got = load_file(out / "model.safetensors")
        assert set(got) == set(_ref(name)["model_dtype"])
        assert all(torch.equal(got[k], v) for k, v in _ref(name)["model_dtype"].items())


def test_hf_export_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    ref = _ref(ZERO3)
    out = tmp_path / "hf"
    proc = cli("convert", DATA / ZERO3 / "global_step2", out, "--to", "hf", "--config", DATA / ZERO3 / "config.json")
    assert proc.returncode == 0, proc.stderr
    assert "optimizer state tensors left out" in proc.stdout + proc.stderr
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref["fp32"].items())
    expected = LlamaForCausalLM(LlamaConfig.from_json_file(DATA / ZERO3 / "config.json")).eval()
    expected.load_state_dict(ref["fp32"])
    tokens = ref["tokens"][0]
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, expected(input_ids=tokens).logits)


def test_to_mesh_shards_every_optimizer_tensor_like_its_parameter(tmp_path: Path) -> None:
    ref = _ref(ZERO3)
    proc = cli("convert", DATA / ZERO3, tmp_path / "mesh3", "--to-mesh", "3", "--quiet")
    assert proc.returncode == 0, proc.stderr
    cat = reshard.inspect(tmp_path / "mesh3")
    assert cat.format == "dcp" and detect_layout(cat).name == "deepspeed"  # recognized again from its names
    for fqn, value in ref["fp32"].items():
        boxes = [c.box for c in cat.tensors[fqn].chunks]
        assert len(boxes) == 3 and torch.equal(_read(cat, fqn), value)
        for key in ("exp_avg", "exp_avg_sq"):
            assert [c.box for c in cat.tensors[f"optimizer.state.{fqn}.{key}"].chunks] == boxes
            assert torch.equal(_read(cat, f"optimizer.state.{fqn}.{key}"), ref[key][fqn])
    # torch's own reader, without DeepSpeed: DeepSpeed's objects were handed on as plain data.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "mesh3", tmp_path / "mesh3.pt")
    full = torch.load(tmp_path / "mesh3.pt", weights_only=False)
    assert all(torch.equal(full[k], v) for k, v in ref["fp32"].items())
    assert full["optimizer"]["zero_stage"] == 3 and full["deepspeed"]["args"].zero_stage == 3
    assert torch.equal(full["optimizer"]["state"]["lm_head.weight"]["exp_avg"], ref["exp_avg"]["lm_head.weight"])


def test_flat_layouts_with_padding() -> None:
    """The partition arithmetic on the cases DeepSpeed pads: ZeRO-1/2 pads the group's end to
    2 x world and saves the last partition without it; ZeRO-3 pads each parameter."""
    shapes = [{"a": (5, 3), "b": (7,)}]  # 22 elements, 3 ranks: padded to 24 -> 8, 8, 6 saved
    files = ["r0", "r1", "r2"]
    a, b = zero12_params(shapes, [[8], [8], [6]], None, files)
    assert [(f.rank, f.begin, f.end, f.at) for f in a.fragments] == [(0, 0, 8, 0), (1, 8, 15, 0)]
    assert [(f.rank, f.begin, f.end, f.at) for f in b.fragments] == [(1, 0, 1, 7), (2, 1, 7, 0)]
    a, b = zero12_params(shapes, [[8], [8], [8]], [[1, 1]], files)  # one element of alignment after each
    assert [(f.rank, f.begin, f.end, f.at) for f in a.fragments] == [(0, 0, 8, 0), (1, 8, 15, 0)]
    assert [(f.rank, f.begin, f.end, f.at) for f in b.fragments] == [(2, 0, 7, 0)]
    with pytest.raises(CorruptCheckpointError, match="^r2: the 3 partitions of param group 0 hold 21"):
        zero12_params(shapes, [[8], [8], [5]], None, files)  # the last one cut short
    with pytest.raises(CorruptCheckpointError, match="^r1: "):
        zero12_params(shapes, [[8], [7], [6]], None, files)  # a middle one cut short
    a, b = zero3_params([{"a": (5,), "b": (2, 2)}], [5, 5], [5], files[:2])
    assert [(f.rank, f.begin, f.end, f.at) for f in a.fragments] == [(0, 0, 3, 0), (1, 3, 5, 0)]
    assert [(f.rank, f.begin, f.end, f.at) for f in b.fragments] == [(0, 0, 2, 3), (1, 2, 4, 3)]
    with pytest.raises(CorruptCheckpointError, match="^r1: holds a flat partition of 4 elements"):
        zero3_params([{"a": (5,), "b": (2, 2)}], [5, 4], [5], files[:2])


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(DATA / name, dst)
    return dst


def _rank_file(folder: Path, rank: int, kind: str = "optim") -> Path:
    return next(p for p in (folder / "global_step2").iterdir() if f"zero_pp_rank_{rank}_" in p.name and kind in p.name)


def test_broken_checkpoints_exit_2_naming_the_file(tmp_path: Path) -> None:
    z3 = _copy(ZERO3, tmp_path / "truncated")
    victim = _rank_file(z3, 1)
    os.truncate(victim, victim.stat().st_size // 2)
    assert_one_line_error(cli("convert", z3, tmp_path / "a.safetensors"), str(victim))

    z3 = _copy(ZERO3, tmp_path / "missing")
    victim = _rank_file(z3, 1)
    victim.unlink()
    assert_one_line_error(cli("convert", z3, tmp_path / "b.safetensors"), f"{victim}: missing", "one of 2 partitions")

    z3 = _copy(ZERO3, tmp_path / "extra")  # a third rank's files left over from another run
    for kind in ("model", "optim"):
        source = _rank_file(z3, 1, kind)
        shutil.copy(source, source.with_name(source.name.replace("rank_1_", "rank_2_")))
    extra = _rank_file(z3, 2)
    assert_one_line_error(cli("convert", z3, tmp_path / "c.safetensors"), str(extra), "one of 2 partitions")

    z2 = _copy(ZERO2, tmp_path / "swapped")  # rank 0's partition saved as rank 1's
    shutil.copy(_rank_file(z2, 0), _rank_file(z2, 1))
    assert_one_line_error(cli("convert", z2, tmp_path / "d.safetensors"), str(_rank_file(z2, 1)),
                          "do not belong to one checkpoint")

    (z2 / "latest").write_text("global_step9")
    assert_one_line_error(cli("inspect", z2), f"{z2 / 'latest'}: names 'global_step9'")
    (z2 / "latest").write_text("../../etc")
    assert_one_line_error(cli("inspect", z2), "not a checkpoint tag")

    tp = _copy(ZERO2, tmp_path / "tp")
    shutil.copy(_rank_file(tp, 0), tp / "global_step2" / _rank_file(tp, 0).name.replace("mp_rank_00", "mp_rank_01"))
    assert_one_line_error(cli("inspect", tp), "mp_rank_01", "tensor-parallel")
    uni = _copy(UNIVERSAL, tmp_path / "universal")
    zero = uni / "global_step2_universal" / "zero"
    (zero / "lm_head.weight" / "fp32.pt").unlink()
    assert_one_line_error(cli("convert", uni, tmp_path / "e.safetensors"), f"{zero / 'lm_head.weight' / 'fp32.pt'}: missing")
    shutil.rmtree(zero / "model.norm.weight")
    assert_one_line_error(cli("convert", uni, tmp_path / "f.safetensors"), f"{zero / 'model.norm.weight'}: missing")
    for path in tmp_path.glob("*.safetensors"):
        raise AssertionError(f"{path} written from a broken checkpoint")


def test_an_unrelated_folder_with_a_latest_file_is_not_deepspeed(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("whatever")
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    assert reshard.inspect(tmp_path / "model.pt").format == "torch"
    assert_one_line_error(cli("inspect", tmp_path), f"{tmp_path}: not a checkpoint reshard recognizes")
    (tmp_path / "zero_to_fp32.py").write_text("")  # what DeepSpeed copies beside `latest`: now it is one, broken
    assert_one_line_error(cli("inspect", tmp_path), f"{tmp_path / 'latest'}: names 'whatever', but")
