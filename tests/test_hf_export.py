"""--to hf for a user's own model: a transformers LlamaForCausalLM trained a step with FSDP2 on 2
gloo ranks and saved with torch's dcp.save (HF names, no config recorded) exports into a
folder that transformers loads with the live model's logits bit for bit, with the tokenizer it
was given, and that `verify --quick` and `verify --only model` accept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import reshard
from reshard.cli.app import main
from tests.dist import HANG_GUARD, run_world
from tests.hf_models import TOKENS

_CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False)


def _train_and_save(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**_CONFIG)
    model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=Path(root) / "ckpt")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        live = LlamaForCausalLM(config).eval()
        live.load_state_dict(full)
        with torch.no_grad():
            torch.save(live(TOKENS).logits, Path(root) / "logits.pt")
        config.architectures = ["LlamaForCausalLM"]
        config.save_pretrained(Path(root) / "cfg")
    dist.barrier()


def _tokenizer(folder: Path) -> None:
    """A real fast tokenizer with special tokens and a chat template, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(60)} | {"<unk>": 60, "<s>": 61, "</s>": 62, "<pad>": 63}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    fast.save_pretrained(folder)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf-export")
    run_world(_train_and_save, 2, str(root), timeout=HANG_GUARD)
    _tokenizer(root / "tok")
    return root


def test_fsdp2_checkpoint_of_an_hf_model_exports_completely(trained: Path, capsys) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    ckpt, out = trained / "ckpt", trained / "out"
    assert main(["convert", str(ckpt), str(out), "--to", "hf"]) == 2  # no config: refused, both options named
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--config" in err[0] and "--hf-assets" in err[0] and not out.exists()
    assert main(["convert", str(ckpt), str(out), "--to", "hf", "--config", str(trained / "cfg"),
                 "--hf-assets", str(trained / "tok"), "--quiet"]) == 0
    model = LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, torch.load(trained / "logits.pt"))
    ours, theirs = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(trained / "tok")
    text = "w1 w2 w59 nope"
    assert ours(text).input_ids == theirs(text).input_ids and ours.get_vocab() == theirs.get_vocab()
    messages = [{"role": "user", "content": "w3 w4"}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<s>", "</s>", "<pad>")
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and "torch_dtype" not in config and config["architectures"] == ["LlamaForCausalLM"]
    card = (out / "README.md").read_text()
    assert "LlamaForCausalLM" in card and "unknown" not in card
    assert main(["verify", "--quick", str(out)]) == 0
    assert main(["verify", str(ckpt), str(out), "--only", "model"]) == 0
    capsys.readouterr()


def test_weights_only_and_config_from_an_hf_folder(trained: Path) -> None:
    out = reshard.convert(trained / "ckpt", trained / "weights", to="hf", weights_only=True, quiet=True).dst
    assert not (out / "config.json").exists() and not (out / "tokenizer.json").exists()
    with pytest.raises(reshard.ReshardError, match="weights_only=True applies to hf outputs, not torch"):
        reshard.convert(trained / "ckpt", trained / "x.pt", weights_only=True, quiet=True)
    # HF -> HF: config, generation config and tokenizer of the source folder travel by default.
    full = trained / "full"
    reshard.convert(trained / "ckpt", full, to="hf", config=trained / "cfg", hf_assets=trained / "tok", quiet=True)
    again = reshard.convert(full, trained / "again", to="hf", dtype="bfloat16", quiet=True).dst
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (full / name).read_bytes(), name
    assert json.loads((again / "config.json").read_text())["dtype"] == "bfloat16"


def test_titan_to_hf_is_not_applied_to_a_model_it_does_not_know(tmp_path: Path, capsys) -> None:
    """torch's tutorial layout of a model that is not torchtitan's: one name (``norm.weight``)
    looks like torchtitan's, the others do not; --to hf renames nothing and says why, where it
    once renamed 1 of 6 tensors on its own."""
    import torch.distributed.checkpoint as dcp

    from reshard.cli.example import TinyNet

    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 11, (2, 5))).square().mean().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "train_state": {"step": 1}}, checkpoint_id=tmp_path / "ckpt",
             no_dist=True)
    out = tmp_path / "hf"
    assert main(["convert", str(tmp_path / "ckpt"), str(out), "--to", "hf", "--weights-only"]) == 0
    err = capsys.readouterr().err
    assert "notice: layout torch-optim (6 tensors under model." in err
    assert "titan-to-hf not applied: it knows 1 of the 6 parameter names" in err
    from safetensors.torch import load_file

    assert sorted(load_file(out / "model.safetensors")) == sorted(model.state_dict())


def test_a_config_that_contradicts_the_recorded_model_is_refused(tmp_path: Path) -> None:
    """The training checkpoint records n_heads=4, n_kv_heads=2; a --config saying 2 heads and 1
    KV head (head_dim 16, so every shape still agrees) passed the architecture check, and the
    export's weights, permuted for 4 heads, computed garbage under the config's 2. Refused now,
    naming both values; the recorded config, or one that agrees, still exports."""
    from reshard.train.checkpoint import save_checkpoint
    from reshard.train.model import ModelConfig, Transformer
    from tests.test_cli import assert_one_line_error
    from tests.test_cli import reshard as cli

    cfg = ModelConfig.preset("tiny")
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, opt, sched, step=1, data_position=0, model_cfg=cfg)
    recorded = reshard.convert(ckpt, tmp_path / "hf", to="hf", quiet=True).dst
    config = json.loads((recorded / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    for change, needle in (({"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16},
                            "num_attention_heads is 2, but"),
                           ({"num_hidden_layers": 3}, "num_hidden_layers is 3, but"),
                           ({"vocab_size": 65}, "vocab_size is 65, but")):
        other = tmp_path / f"cfg_{len(change)}_{next(iter(change))}"
        other.mkdir()
        (other / "config.json").write_text(json.dumps({**config, **change}))
        proc = cli("convert", ckpt, tmp_path / "out", "--to", "hf", "--config", other)
        assert_one_line_error(proc, needle, "(train.model_config)", "describes another model")
        assert not (tmp_path / "out").exists()
    agrees = tmp_path / "agrees"
    agrees.mkdir()
    (agrees / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    assert cli("convert", ckpt, tmp_path / "out", "--to", "hf", "--config", agrees).returncode == 0
