"""Issue 5, acceptance 2: the project's training model, trained one step under FSDP2 on 3 gloo
ranks (uneven shards that do not line up with attention heads) and saved as a training
checkpoint, exports with `reshard convert CKPT OUT --to hf` to a folder transformers'
LlamaForCausalLM loads with the same logits; and HF weights come back to the training names."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import reshard
from reshard.train.model import ModelConfig, Transformer
from tests.dist import run_world
from tests.hf_models import TOKENS, hf_logits, save_tiny_llama
from tests.test_cli import reshard as run_cli

# Tied with the default RoPE base; untied with another base, so config.json must carry it.
CONFIGS = {"tied": replace(ModelConfig.preset("tiny"), tie_embeddings=True),
           "untied": replace(ModelConfig.preset("tiny"), rope_theta=500000.0)}


def _train_and_save(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from reshard.train.checkpoint import save_checkpoint

    mesh = init_device_mesh("cpu", (world_size,))
    for name, cfg in CONFIGS.items():
        with torch.device("meta"):
            model = Transformer(cfg)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        model.init_weights(seed=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(rank))
        torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        opt.step()
        sched.step()
        save_checkpoint(Path(root) / name, model, opt, sched, step=1, data_position=4, model_cfg=cfg)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, Path(root) / f"{name}.full.pt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("train")
    run_world(_train_and_save, 3, str(root))
    return root


def _reference(root: Path, name: str) -> Transformer:
    model = Transformer(CONFIGS[name])
    model.load_state_dict(torch.load(root / f"{name}.full.pt", weights_only=True))
    return model.eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_checkpoint_exports_to_transformers_with_the_same_logits(checkpoints: Path, name: str,
                                                                          tmp_path: Path) -> None:
    cfg = CONFIGS[name]
    ckpt = checkpoints / name
    assert reshard.inspect(ckpt).facts.source_world_size == 3
    proc = run_cli("convert", ckpt, tmp_path / "OUT", "--to", "hf")
    assert proc.returncode == 0, proc.stderr
    assert "optimizer state tensors left out" in proc.stderr and "titan-to-hf" in proc.stderr and "llama3" in proc.stderr
    out = tmp_path / "OUT"
    config = json.loads((out / "config.json").read_text())
    assert (config["tie_word_embeddings"], config["num_key_value_heads"], config["rope_parameters"]["rope_theta"]) == \
        (cfg.tie_embeddings, cfg.n_kv_heads, cfg.rope_theta)
    assert "torch_dtype" not in config and "rope_theta" not in config  # current transformers keys only
    with torch.no_grad():
        want = _reference(checkpoints, name)(TOKENS)
    torch.testing.assert_close(hf_logits(out), want, atol=1e-5, rtol=0)

    # And back: HF names to the training model's names, loaded into a fresh Transformer.
    reshard.convert(out, tmp_path / "titan", keymap="hf-to-titan", quiet=True)
    back = Transformer(cfg)
    names = set(reshard.inspect(tmp_path / "titan").tensors)
    expected = set(back.state_dict()) - ({"output.weight"} if cfg.tie_embeddings else set())
    assert names == expected  # tied: the folder holds the embedding once
    sd = {n: torch.empty_like(t) for n, t in back.state_dict().items() if n in names}
    dcp.load(sd, checkpoint_id=tmp_path / "titan", no_dist=True)
    back.load_state_dict(sd, strict=not cfg.tie_embeddings)
    ref = _reference(checkpoints, name).state_dict()
    assert all(torch.equal(t, ref[n]) for n, t in back.state_dict().items())


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_transformers_weights_load_into_the_training_model(tie: bool, tmp_path: Path) -> None:
    """The other direction: a folder transformers wrote, loaded with the ``hf-to-titan`` map
    (q/k rows permuted back), runs in the training model with transformers' logits."""
    src = save_tiny_llama(tmp_path / "hf", tie=tie)
    cfg = replace(ModelConfig.preset("tiny"), tie_embeddings=tie, norm_eps=1e-6)  # LlamaConfig's default eps
    model = Transformer(cfg)
    result = reshard.load_model(model, src, keymap="hf-to-titan", progress=False)
    assert not result.missing and not result.unexpected
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf_logits(src), atol=1e-5, rtol=0)
