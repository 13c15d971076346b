"""A real accelerate ``save_state`` folder (tests/data/accelerate: FSDP1 SHARDED_STATE_DICT of a
tiny transformers Llama on 2 gloo ranks, written by accelerate 1.15 itself) read as one
checkpoint: every part equals what torch's and accelerate's own readers make of it, the model
exports to a folder transformers loads, and ``load_model`` resumes it on 3 FSDP2 ranks with
weights, Adam moments, step and lr exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import reshard
from tests.dist import HANG_GUARD, run_world
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as run_cli

transformers = pytest.importorskip("transformers")

DATA = Path(__file__).resolve().parents[1] / "data" / "accelerate"
CKPT = DATA / "ckpt"


def _torch_reading(folder: Path, out: Path) -> dict:
    """torch's own single-process reader of one DCP folder."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("accelerate_ref")
    ref = {**_torch_reading(CKPT / "pytorch_model_fsdp_0", tmp / "m.pt"),
           **_torch_reading(CKPT / "optimizer_0", tmp / "o.pt")}
    torch.save(ref, tmp / "ref.pt")
    ref["path"] = tmp / "ref.pt"
    return ref


def _same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, where


def test_save_state_folder_is_one_checkpoint(reference: dict, tmp_path: Path) -> None:
    cat = reshard.inspect(CKPT)
    assert cat.format == "accelerate" and cat.facts.source_world_size == 2
    from reshard.core.conventions import detect_layout

    layout = detect_layout(cat)
    assert layout.name == "accelerate"
    assert layout.place("optimizer.state.model.layers.0.mlp.up_proj.weight.exp_avg").fqn == "model.layers.0.mlp.up_proj.weight"
    assert layout.role("random_states_1.torch_manual_seed") == "per_rank"
    assert layout.role("scheduler.last_epoch") == "other"

    # Every part as the library that wrote it reads it back: torch's DCP reader for the two
    # folders, torch.load for accelerate's scheduler and RNG files.
    out = tmp_path / "all.pt"
    assert run_cli("convert", CKPT, out, "--quiet").returncode == 0
    got = torch.load(out, weights_only=False)  # our own output: RNG states hold numpy arrays
    _same(got["model"], reference["model"], "model")
    _same(got["optimizer"], reference["optimizer"], "optimizer")
    _same(got["scheduler"], torch.load(CKPT / "scheduler.bin", weights_only=True), "scheduler")
    for r in (0, 1):
        theirs = torch.load(CKPT / f"random_states_{r}.pkl", weights_only=False)
        assert torch.equal(got[f"random_states_{r}"]["torch_manual_seed"], theirs["torch_manual_seed"])
        assert got[f"random_states_{r}"]["random_state"] == theirs["random_state"]
        assert (got[f"random_states_{r}"]["numpy_random_seed"][1] == theirs["numpy_random_seed"][1]).all()
    assert run_cli("verify", CKPT, out).returncode == 0

    # --to-mesh 3: the moments are cut like their parameters; per-rank RNG state is named, not carried.
    result = reshard.convert(CKPT, tmp_path / "mesh3", to_mesh="3", quiet=True)
    assert any("random_states_0" in n for n in result.notices)
    laid = reshard.inspect(tmp_path / "mesh3")
    for name, entry in laid.tensors.items():
        if name.startswith("optimizer.state.") and entry.shape:
            fqn = name.removeprefix("optimizer.state.").rpartition(".")[0]
            assert [c.box for c in entry.chunks] == [c.box for c in laid.tensors[f"model.{fqn}"].chunks], name

    # A second model's folder makes the names ambiguous: one line naming what to do.
    bad = tmp_path / "two_models"
    bad.mkdir()
    for sub in ("pytorch_model_fsdp_0", "pytorch_model_fsdp_1"):
        (bad / sub).symlink_to(CKPT / "pytorch_model_fsdp_0", target_is_directory=True)
    assert_one_line_error(run_cli("inspect", bad), "pytorch_model_fsdp_1", "convert each folder on its own")


def test_model_exports_to_transformers(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    proc = run_cli("convert", CKPT, out, "--to", "hf", "--config", DATA / "config.json")
    assert proc.returncode == 0, proc.stderr
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    state = model.state_dict()
    assert state.keys() == reference["model"].keys()
    for k, v in reference["model"].items():
        assert torch.equal(state[k], v), k
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert run_cli("verify", "--quick", out).returncode == 0


def _fsdp_llama(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    config = transformers.LlamaConfig.from_pretrained(DATA)
    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _resume(rank: int, world: int, ref_path: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ref = torch.load(ref_path, weights_only=True)
    for mode in ("rank0", "parallel"):
        model = _fsdp_llama(world)
        opt = torch.optim.AdamW(model.parameters(), lr=0.5)
        result = reshard.load_model(model, CKPT, optimizer=opt, mode=mode, progress=False)
        assert result.missing == [] and result.unexpected == [], (result.missing, result.unexpected)
        for k, v in model.state_dict().items():
            assert torch.equal(v.full_tensor(), ref["model"][k]), (mode, k)
        _, osd = get_state_dict(model, opt)
        assert len(osd["state"]) == len(ref["model"])
        for fqn, state in osd["state"].items():
            for key, value in state.items():
                want = ref["optimizer"]["state"][fqn][key]
                got = value.full_tensor() if hasattr(value, "full_tensor") else value
                assert got.dtype == want.dtype and torch.equal(got, want), (mode, fqn, key)
        group = ref["optimizer"]["param_groups"][0]
        assert opt.param_groups[0]["lr"] == group["lr"] and opt.param_groups[0]["initial_lr"] == group["initial_lr"]
        assert opt.param_groups[0]["weight_decay"] == group["weight_decay"]


def test_load_model_resumes_on_three_ranks(reference: dict) -> None:
    run_world(_resume, 3, str(reference["path"]), timeout=HANG_GUARD)


def test_load_model_picks_one_model_of_a_multi_model_folder(reference: dict, tmp_path: Path) -> None:
    """Two prepared models: accelerate saves the second as ``pytorch_model_fsdp_1/`` (a DCP of
    ``{"model": state_dict}``, written here by torch's own ``dcp.save`` with different values) and
    its optimizer as ``optimizer_1/``. ``section=1`` loads that one; read whole, the folder is
    refused with the way out."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "two_models"
    folder.mkdir()
    for sub in ("pytorch_model_fsdp_0", "optimizer_0", "optimizer_1"):
        (folder / sub).symlink_to(CKPT / "optimizer_0" if sub == "optimizer_1" else CKPT / sub,
                                  target_is_directory=True)
    second = {k: v * 2 + 1 for k, v in reference["model"].items()}
    dcp.save({"model": second}, checkpoint_id=folder / "pytorch_model_fsdp_1")

    config = transformers.LlamaConfig.from_pretrained(DATA)
    for section, want in ((1, second), ("pytorch_model_fsdp_0", reference["model"])):
        model = transformers.LlamaForCausalLM(config)
        opt = torch.optim.AdamW(model.parameters(), lr=0.5)
        result = reshard.load_model(model, folder, optimizer=opt, section=section, progress=False)
        assert result.missing == [] and result.unexpected == [], (result.missing, result.unexpected)
        assert any(f"section={section!r}" in n for n in result.notices), result.notices
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[k]), (section, k)
        exp_avg = {n: opt.state[p]["exp_avg"] for n, p in model.named_parameters()}
        for fqn, value in exp_avg.items():
            assert torch.equal(value, reference["optimizer"]["state"][fqn]["exp_avg"]), (section, fqn)

    with pytest.raises(reshard.core.errors.UsageError, match="names no model"):
        reshard.load_model(transformers.LlamaForCausalLM(config), folder, section=2, progress=False)
    with pytest.raises(reshard.core.errors.UnsupportedFormatError, match=r"section=1"):
        reshard.load_model(transformers.LlamaForCausalLM(config), folder, progress=False)
