"""``--to hf`` and HF import: folders written by transformers go through DCP (and a mesh layout)
and come back as folders transformers' ``from_pretrained`` loads with identical logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

import reshard
from tests.dist import HANG_GUARD
from tests.hf_models import hf_logits, save_tiny_llama
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as run_cli


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny_llama(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bool]:
    tie = request.param
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", tie=tie), tie


def _weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def test_hf_dcp_mesh_hf_round_trip_gives_identical_logits(tiny_llama: tuple[Path, bool], tmp_path: Path) -> None:
    src, tie = tiny_llama
    assert len(set(_weight_map(src).values())) > 2  # transformers really sharded it
    reshard.convert(src, tmp_path / "dcp", quiet=True)
    imported = reshard.inspect(tmp_path / "dcp")
    assert set(imported.tensors) == set(_weight_map(src))  # HF names kept as they are
    assert json.loads(imported.objects["hf.config_json"]) == json.loads((src / "config.json").read_text())
    reshard.convert(tmp_path / "dcp", tmp_path / "mesh", to_mesh="2", quiet=True)
    assert reshard.inspect(tmp_path / "mesh").facts.source_world_size == 2
    result = reshard.convert(tmp_path / "mesh", tmp_path / "out", to="hf", max_shard_size="20KB", quiet=True)
    out = result.dst

    assert torch.equal(hf_logits(out), hf_logits(src))
    weight_map = _weight_map(out)
    assert ("lm_head.weight" in weight_map) is not tie  # tied weights written once, the HF way
    assert set(weight_map) == set(_weight_map(src))
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards == sorted(set(weight_map.values()))
    assert all(s.startswith("model-0000") and s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    for shard in shards:
        with safe_open(out / shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}
    config, original = (json.loads((d / "config.json").read_text()) for d in (out, src))
    assert {k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")} == \
        {k: v for k, v in original.items() if k != "dtype"}
    assert config["dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text()) == json.loads((src / "generation_config.json").read_text())
    card = (out / "README.md").read_text()
    params = sum(t.numel() for t in _load_all(src).values())
    assert f"{params:,}" in card and "float32" in card and "LlamaForCausalLM" in card and "`mesh`" in card


def _load_all(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_default_export_is_one_file_in_bfloat16(tiny_llama: tuple[Path, bool], tmp_path: Path) -> None:
    src, _ = tiny_llama
    proc = run_cli("convert", src, "--to", "hf", "--dtype", "bfloat16", "--quiet")
    assert proc.returncode == 0, proc.stderr
    out = src.with_name("tiny-llama_bfloat16_hf")  # default destination: {stem}_{dtype}_hf beside SRC
    try:
        # 5GB shards by default: one model.safetensors and, as save_pretrained does, no index.
        visible = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
        assert visible == ["README.md", "config.json", "generation_config.json", "model.safetensors"]
        assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
        assert {t.dtype for t in _load_all(out).values()} == {torch.bfloat16}
        ref = {n: t.to(torch.bfloat16) for n, t in _load_all(src).items()}
        assert all(torch.equal(t, ref[n]) for n, t in _load_all(out).items())
        assert "bfloat16" in (out / "README.md").read_text()
    finally:
        import shutil

        shutil.rmtree(out)


def _save_sectioned(folder: Path, model: dict[str, torch.Tensor], config: dict | None = None) -> None:
    """A get_state_dict-style checkpoint: a model section, optimizer state, other objects."""
    optim = {"state": {n: {"exp_avg": t * 0.1, "step": torch.tensor(3.0)} for n, t in model.items()},
             "param_groups": [{"lr": 0.1, "params": list(model)}]}
    state = {"model": model, "optim": optim, "extra": {"step": 3}}
    if config is not None:
        state["hf"] = {"config_json": json.dumps(config)}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=folder, no_dist=True)


def test_model_section_removed_optimizer_dropped_with_notices(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    model = {"model.embed_tokens.weight": torch.randn(8, 4, generator=g), "lm_head.weight": torch.randn(8, 4, generator=g)}
    _save_sectioned(tmp_path / "ckpt", model)
    # No config recorded and none given: refused (transformers could not load it), unless the
    # weights alone are asked for.
    assert_one_line_error(run_cli("convert", tmp_path / "ckpt", tmp_path / "out", "--to", "hf"),
                          "records no model config", "--config")
    proc = run_cli("convert", tmp_path / "ckpt", tmp_path / "out", "--to", "hf", "--weights-only")
    assert proc.returncode == 0, proc.stderr
    assert "optimizer state tensors left out" in proc.stderr and "non-tensor objects" in proc.stderr
    out = _load_all(tmp_path / "out")
    assert set(out) == set(model) and all(torch.equal(out[n], t) for n, t in model.items())
    assert not (tmp_path / "out" / "config.json").exists()


def test_tied_config_with_a_different_lm_head_is_refused(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    model = {"model.embed_tokens.weight": torch.randn(8, 4, generator=g), "lm_head.weight": torch.randn(8, 4, generator=g)}
    config = {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True}
    _save_sectioned(tmp_path / "bad", model, config)
    assert_one_line_error(run_cli("convert", tmp_path / "bad", tmp_path / "out", "--to", "hf"),
                          "tie_word_embeddings", "lm_head.weight differs")
    assert not (tmp_path / "out").exists()
    model["lm_head.weight"] = model["model.embed_tokens.weight"].clone()
    _save_sectioned(tmp_path / "good", model, config)
    proc = run_cli("convert", tmp_path / "good", tmp_path / "out", "--to", "hf")
    assert proc.returncode == 0, proc.stderr
    assert set(_load_all(tmp_path / "out")) == {"model.embed_tokens.weight"}
    # The head is left out as save_pretrained leaves it out, and the notices say so.
    assert ("notice: lm_head.weight left out: it equals model.embed_tokens.weight and config.json ties them "
            "(tie_word_embeddings), so transformers re-ties the head on load, as save_pretrained writes it") \
        in proc.stderr.splitlines(), proc.stderr
    result = reshard.convert(tmp_path / "good", tmp_path / "out2", to="hf", quiet=True)
    assert any(n.startswith("lm_head.weight left out") for n in result.notices), result.notices


def _fake_hub_cache(cache: Path, repo_id: str, files: Path) -> None:
    """The layout huggingface_hub's cache uses (blobs, refs/main, snapshots/<commit>/)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in files.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())


def test_hub_repo_id_source_offline_uses_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = save_tiny_llama(tmp_path / "saved", tie=False)
    _fake_hub_cache(tmp_path / "cache", "someone/tiny-llama", src)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "reshard", "convert"]
    proc = subprocess.run(cmd + ["someone/tiny-llama", "--quiet"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD)
    assert proc.returncode == 0, proc.stderr
    out = reshard.inspect(tmp_path / "tiny-llama_dcp")  # in the cwd, not inside the cache
    assert set(out.tensors) == set(_weight_map(src)) and "hf.config_json" in out.objects
    # In process (huggingface_hub read the environment at import, so set what it read).
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(run_cli("convert", "someone/not-cached"), "someone/not-cached", "not in the local cache")
