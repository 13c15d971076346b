"""Megatron-Core ``torch_dist`` checkpoints written by megatron-core 0.16.1 itself
(``tests/data/megatron/``, see its README): a GPT (Llama-style) model with tensor parallelism 2
on 2 ranks, read without Megatron installed, exported to HF and laid out for FSDP2 meshes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import reshard
from reshard.core.boxes import full_box
from reshard.core.chunk_reads import read_box
from reshard.core.conventions import OPTIM_GROUP, OPTIM_STATE, OTHER, PARAM, detect_layout
from reshard.core.errors import UsageError
from reshard.features.keymap.lookup import load_keymap
from tests.dist import HANG_GUARD, run_world
from tests.hf_models import assert_checked, assert_refused_without_keymap
from tests.schema import check
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as cli

ROOT = Path(__file__).resolve().parents[1] / "data" / "megatron" / "gpt_tp2"
ITER = ROOT / "iter_0000002"
CONFIG = ROOT / "config.json"
HEADS, GROUPS, HEAD_DIM, LAYERS = 4, 2, 8, 2


def _read(cat: reshard.Catalog, name: str) -> torch.Tensor:
    return read_box(cat.tensors[name], full_box(cat.tensors[name].shape))


def _logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = torch.load(ROOT / "reference.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ref["tokens"]).logits


def test_layout_stacked_layers_and_common_state() -> None:
    for source in (ITER, ROOT):  # the iteration folder, or its parent through latest_checkpointed_iteration.txt
        cat = reshard.inspect(source)
        assert cat.format == "megatron" and cat.path == ITER
    layout = detect_layout(cat)
    assert layout.name == "megatron"
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    assert cat.tensors[qkv].shape == (LAYERS, (HEADS + 2 * GROUPS) * HEAD_DIM, 32)
    assert layout.role(qkv) == PARAM
    place = layout.place(f"optimizer.state.exp_avg.{qkv}")
    assert (place.role, place.fqn, place.key) == (OPTIM_STATE, qkv, "exp_avg")
    assert layout.role("optimizer.param_groups.1.weight_decay") == OPTIM_GROUP
    assert cat.objects["optimizer.param_groups.1.weight_decay"] == 0.0  # Megatron's no-decay group
    assert cat.objects["iteration"] == 2 and cat.objects["args"].num_query_groups == GROUPS
    assert layout.role("args") == OTHER and layout.role("optimizer.state.common_step") == OTHER
    # Megatron keeps one step for all parameters (common.pt); each parameter gets it, as on load.
    assert torch.equal(_read(cat, f"optimizer.state.step.{qkv}"), torch.tensor(2.0))
    doc = check(json.loads(cli("inspect", ROOT, "--json").stdout))  # the documented schema
    assert doc["format"] == "megatron" and doc["layout"]["name"] == "megatron"


@pytest.mark.parametrize("how", ["auto", "preset"])
def test_hf_export_matches_megatrons_forward(how: str, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    extra = ["--keymap", "megatron-to-hf"] if how == "preset" else []
    proc = cli("convert", ROOT, out, "--to", "hf", "--config", CONFIG, *extra)
    assert proc.returncode == 0, proc.stderr
    assert_checked(proc.stderr, "LlamaForCausalLM")
    if how == "auto":
        assert_refused_without_keymap(ROOT, CONFIG, tmp_path)
    names = set(load_file(out / "model.safetensors"))
    assert "model.layers.1.self_attn.k_proj.weight" in names and not any("decoder" in n for n in names)
    ref = torch.load(ROOT / "reference.pt", weights_only=True)
    assert (_logits(out) - ref["logits"]).abs().max().item() < 1e-5


def test_qkv_is_split_per_query_group() -> None:
    """Megatron's fused rows are [group 0: q heads 0-1, k, v | group 1: q heads 2-3, k, v]; the
    head counts come from the ``args`` Megatron-LM saved when no config is given."""
    cat = reshard.inspect(ITER)
    hf = load_keymap("megatron-to-hf").apply(cat)
    fused = _read(cat, "decoder.layers.self_attention.linear_qkv.weight")[1].view(GROUPS, HEADS // GROUPS + 2, HEAD_DIM, -1)
    q = _read(hf, "model.layers.1.self_attn.q_proj.weight").view(GROUPS, HEADS // GROUPS, HEAD_DIM, -1)
    assert torch.equal(q, fused[:, : HEADS // GROUPS])
    assert torch.equal(_read(hf, "model.layers.1.self_attn.k_proj.weight").view(GROUPS, HEAD_DIM, -1), fused[:, -2])
    assert torch.equal(_read(hf, "model.layers.1.self_attn.v_proj.weight").view(GROUPS, HEAD_DIM, -1), fused[:, -1])
    # Optimizer state follows: split the same way, under the state's own prefix.
    moment = _read(cat, "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight")[0]
    want = moment.view(GROUPS, HEADS // GROUPS + 2, HEAD_DIM, -1)[:, -2].reshape(GROUPS * HEAD_DIM, -1)
    assert torch.equal(_read(hf, "optimizer.state.exp_avg.model.layers.0.self_attn.k_proj.weight"), want)
    fc1 = _read(cat, "decoder.layers.mlp.linear_fc1.weight")[0]
    assert torch.equal(_read(hf, "model.layers.0.mlp.up_proj.weight"), fc1[fc1.shape[0] // 2:])
    assert hf.facts.hf_keymap is None  # applied once: --to hf does not map the HF names again


def test_to_mesh_with_hf_names_keeps_optimizer_state_with_its_parameter(tmp_path: Path) -> None:
    proc = cli("convert", ROOT, tmp_path / "mesh", "--to-mesh", "3", "--keymap", "megatron-to-hf", "--config", CONFIG,
               "--quiet")
    assert proc.returncode == 0, proc.stderr
    cat, hf = reshard.inspect(tmp_path / "mesh"), load_keymap("megatron-to-hf").apply(reshard.inspect(ITER))
    assert cat.format == "dcp" and detect_layout(cat).name == "megatron"  # recognized again from its names
    name = "model.layers.0.mlp.gate_proj.weight"
    boxes = [c.box for c in cat.tensors[name].chunks]
    assert len(boxes) == 3
    for key in ("exp_avg", "exp_avg_sq"):
        state = f"optimizer.state.{key}.{name}"
        assert [c.box for c in cat.tensors[state].chunks] == boxes
        assert torch.equal(_read(cat, state), _read(hf, state))
    assert torch.equal(_read(cat, name), _read(hf, name))


def test_unknown_tensors_and_broken_folders_are_refused(tmp_path: Path) -> None:
    cat = reshard.inspect(ITER)
    moe = "decoder.layers.mlp.experts.linear_fc1.weight"
    cat.tensors[moe] = cat.tensors["decoder.layers.mlp.linear_fc1.weight"].renamed(moe)
    with pytest.raises(UsageError, match="no HF name for 'decoder.layers.0.mlp.experts.linear_fc1.weight'"):
        load_keymap("megatron-to-hf").apply(cat)

    copy = tmp_path / "gpt"
    shutil.copytree(ROOT, copy)
    (copy / "iter_0000002" / "__1_0.distcp").unlink()
    proc = cli("convert", copy, tmp_path / "a.safetensors")
    assert_one_line_error(proc, "__1_0.distcp")
    (copy / "latest_checkpointed_iteration.txt").write_text("7")
    assert_one_line_error(cli("inspect", copy), "names iteration 7", "iter_0000007 does not exist")
    meta = copy / "iter_0000002" / "metadata.json"
    meta.write_text(json.dumps({"sharded_backend": "zarr"}))
    assert_one_line_error(cli("inspect", copy / "iter_0000002"), f"{meta}: sharded backend 'zarr'")
    assert not (tmp_path / "a.safetensors").exists()


def test_load_model_resumes_an_hf_model_with_megatrons_optimizer_state() -> None:
    """One process, no process group: the HF model built from config.json takes Megatron's
    weights, moments, step and both param groups' hyper-parameters (decay, no decay)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig.from_json_file(CONFIG))
    decay = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay}], lr=0.5)
    result = reshard.load_model(model, ROOT, optimizer=opt, keymap="megatron-to-hf", progress=False)
    assert result.missing == [] and result.unexpected == []
    hf = load_keymap("megatron-to-hf").apply(reshard.inspect(ITER))
    for name, value in model.state_dict().items():
        assert torch.equal(value, _read(hf, name)), name
    names = {p: n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        assert torch.equal(state["exp_avg"], _read(hf, f"optimizer.state.exp_avg.{names[p]}")), names[p]
        assert state["step"].item() == 2.0
    cat = reshard.inspect(ITER)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert opt.param_groups[0]["lr"] == cat.objects["optimizer.param_groups.0.lr"] != 0.5


def _megatron_core_only(tmp: Path) -> Path:
    """The fixture as Megatron-Core alone saves it: ``dist_checkpointing.save`` of a state dict
    without Megatron-LM's ``args`` (common.pt holds what is not sharded, nothing else)."""
    copy = tmp / "mcore"
    shutil.copytree(ITER, copy)
    common = torch.load(copy / "common.pt", weights_only=False)  # our own fixture: an argparse.Namespace inside
    del common["args"]
    torch.save(common, copy / "common.pt")
    return copy


def _resume_mcore_only(rank: int, world: int, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    with pytest.raises(UsageError, match="config="):  # no head counts anywhere: the error says how to give them
        reshard.load_model(LlamaForCausalLM(LlamaConfig.from_json_file(CONFIG)), folder, keymap="megatron-to-hf",
                           progress=False)
    model = LlamaForCausalLM(LlamaConfig.from_json_file(CONFIG))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay}], lr=0.5)
    result = reshard.load_model(model, folder, optimizer=opt, keymap="megatron-to-hf", config=CONFIG, progress=False)
    assert result.missing == [] and result.unexpected == [], (result.missing, result.unexpected)
    ref = torch.load(ROOT / "reference.pt", weights_only=True)
    with torch.no_grad():
        logits = model.eval()(input_ids=ref["tokens"]).logits
    torch.testing.assert_close(logits, ref["logits"], atol=1e-5, rtol=0)
    assert all(s["step"].item() == 2.0 for s in opt.state.values())
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]


def test_megatron_core_only_checkpoint_loads_on_three_fsdp_ranks_with_config(tmp_path: Path) -> None:
    run_world(_resume_mcore_only, 3, str(_megatron_core_only(tmp_path)), timeout=HANG_GUARD)
