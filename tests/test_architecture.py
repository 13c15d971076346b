"""An export is the model its config.json describes (reshard.features.architecture), decided as
transformers' own ``from_pretrained`` decides it: refused by ``convert --to hf``, ``push`` and
``verify --quick`` when it is not, written anyway only when asked, and said when it cannot be
checked."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard
from reshard.features.architecture import ArchitectureMismatchError, check_architecture
from tests.hf_models import save_tiny_llama
from tests.quant_models import save_fp8_deepseek, save_mxfp4_gpt_oss
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as run_cli

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tied tiny Llama saved by transformers (one safetensors file)."""
    return save_tiny_llama(tmp_path_factory.mktemp("arch") / "llama", tie=True, max_shard_size="5GB")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "")


def _mlp() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"emb.weight": torch.randn(64, 32, generator=g), "l1.weight": torch.randn(32, 32, generator=g),
            "l1.bias": torch.randn(32, generator=g)}


def test_an_mlp_under_a_llama_config_is_refused_by_convert_push_and_verify(llama: Path, tmp_path: Path, offline: None,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save(_mlp(), "mlp.pt")
    Path("cfg").mkdir()
    shutil.copy(llama / "config.json", "cfg/config.json")

    proc = run_cli("convert", "mlp.pt", "x_hf", "--to", "hf", "--config", "cfg")
    assert_one_line_error(proc, "x_hf: not the LlamaForCausalLM its config.json describes",
                          "21 of its 21 tensors missing (lm_head.weight, model.embed_tokens.weight",
                          "3 tensors it does not have (emb.weight, l1.bias, l1.weight)", "--keymap", "--config",
                          "--no-architecture-check")
    assert sorted(os.listdir(".")) == ["cfg", "mlp.pt"]  # no output, no staging left behind
    with pytest.raises(ArchitectureMismatchError, match="or pass architecture_check=False to write it anyway"):
        reshard.convert("mlp.pt", "x_hf", to="hf", config="cfg", quiet=True)

    # The same weights and config put together by hand: push refuses before anything is sent.
    Path("x_hf").mkdir()
    save_file(_mlp(), "x_hf/model.safetensors", metadata={"format": "pt"})
    shutil.copy("cfg/config.json", "x_hf/config.json")
    assert_one_line_error(run_cli("push", "x_hf", "me/x", "--dry-run"), "x_hf: not the LlamaForCausalLM",
                          "re-export it", "--no-architecture-check to push it anyway")
    with pytest.raises(ArchitectureMismatchError, match="architecture_check=False"):
        reshard.push("x_hf", "me/x", dry_run=True)
    assert run_cli("push", "x_hf", "me/x", "--dry-run", "--no-architecture-check").returncode == 0
    shutil.rmtree("x_hf")

    # Asked for: written, and the notice and the model card say it was not checked.
    proc = run_cli("convert", "mlp.pt", "x_hf", "--to", "hf", "--config", "cfg", "--no-architecture-check")
    assert proc.returncode == 0, proc.stderr
    assert "not checked against an architecture (--no-architecture-check)" in proc.stderr
    assert "| architecture check | not checked against an architecture (--no-architecture-check) |" in \
        Path("x_hf/README.md").read_text()
    quick = run_cli("verify", "--quick", "x_hf")
    assert quick.returncode == 1 and "DIFF config.json: architecture: not the LlamaForCausalLM" in quick.stdout
    assert "not the model its config.json describes" in quick.stdout

    # The outside reader agrees: transformers loads it as a Llama whose every weight is missing.
    _, info = transformers.AutoModelForCausalLM.from_pretrained("x_hf", output_loading_info=True)
    assert len(info["missing_keys"]) == 21 and set(info["unexpected_keys"]) == {"emb.weight", "l1.weight", "l1.bias"}


def test_an_export_that_loads_is_checked_and_says_so(llama: Path, tmp_path: Path, offline: None) -> None:
    result = reshard.convert(llama, tmp_path / "out", to="hf", quiet=True)
    said = [n for n in result.notices if n.startswith("checked against LlamaForCausalLM")]
    assert said == ["checked against LlamaForCausalLM built by transformers on the meta device: its 21 parameters and "
                    "buffers are all there, with their shapes and dtypes"]
    assert f"| architecture check | {said[0]} |" in (tmp_path / "out" / "README.md").read_text()
    assert reshard.push(tmp_path / "out", "me/x", dry_run=True).notices == said
    quick = run_cli("verify", "--quick", tmp_path / "out")
    assert quick.returncode == 0 and f"note: {said[0]}" in quick.stdout
    # What transformers itself reports for the same folder: nothing missing, nothing left over.
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_shapes_leftovers_and_dtypes_are_named(llama: Path, tmp_path: Path) -> None:
    config = json.loads((llama / "config.json").read_text())
    tensors = reshard.inspect(llama).tensors

    narrow = check_architecture({**config, "intermediate_size": 40}, tensors)
    assert narrow.checked and not narrow.ok and not narrow.missing and not narrow.unexpected
    assert narrow.mismatched[0] == ("model.layers.0.mlp.down_proj.weight", (32, 48), (32, 40))
    assert "6 of another shape (model.layers.0.mlp.down_proj.weight: [32, 48], the model's is [32, 40])" in narrow.problems()

    plus = load_file(llama / "model.safetensors")
    plus["extra.weight"] = torch.ones(3)
    (tmp_path / "plus").mkdir()
    save_file(plus, tmp_path / "plus" / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(llama / "config.json", tmp_path / "plus")
    with pytest.raises(ArchitectureMismatchError, match=re.escape(
            "1 tensor it does not have (extra.weight); leave out what the model does not have with "
            "exclude=['extra.weight'], or give")):
        reshard.convert(tmp_path / "plus", tmp_path / "out", to="hf", quiet=True)
    reshard.convert(tmp_path / "plus", tmp_path / "out", to="hf", exclude="extra.weight", quiet=True)

    # A training checkpoint ({"model": ...}): the export drops the section prefix, so the output's
    # name (freqs_cis) is not what --exclude matches; the hint names what to type.
    trained = tmp_path / "trained.pt"
    torch.save({"model": {**load_file(llama / "model.safetensors"), "freqs_cis": torch.ones(4, 2)}, "step": 3}, trained)
    from tests.test_cli import assert_one_line_error
    from tests.test_cli import reshard as cli

    proc = cli("convert", trained, tmp_path / "trained_hf", "--to", "hf", "--config", llama)
    assert_one_line_error(proc, "1 tensor it does not have (freqs_cis); leave out what the model does not have with "
                          "--exclude model.freqs_cis (the source's name), or give")
    proc = cli("convert", trained, tmp_path / "trained_hf", "--to", "hf", "--config", llama, "--exclude", "model.freqs_cis")
    assert proc.returncode == 0, proc.stderr

    # Raw float8 bytes where the model has a float parameter: transformers would cast them unscaled.
    fp8 = {n: (replace_dtype(t, "float8_e4m3fn") if n.endswith("q_proj.weight") else t) for n, t in tensors.items()}
    found = check_architecture(config, fp8)
    assert len(found.dtypes) == 2 and found.dtypes[0] == ("model.layers.0.self_attn.q_proj.weight: float8_e4m3fn, the "
                                                          "model's float32")
    # config.json's dtype is what the model computes in, never float8.
    assert "config.json says dtype 'float8_e4m3fn'" in check_architecture({**config, "dtype": "float8_e4m3fn"},
                                                                          tensors).problems()
    invalid = check_architecture({**config, "hidden_size": 33}, tensors)
    assert "transformers cannot read config.json" in invalid.problems() and "not a multiple" in invalid.problems()


def replace_dtype(entry: object, name: str) -> object:
    from dataclasses import replace

    from reshard.core.dtypes import by_name

    return replace(entry, dtype=by_name(name))


def test_an_architecture_that_cannot_be_checked_is_said(llama: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    config = json.loads((llama / "config.json").read_text())
    (tmp_path / "cfg.json").write_text(json.dumps({**config, "architectures": ["MadeUpForCausalLM"]}))
    result = reshard.convert(llama, tmp_path / "out", to="hf", config=tmp_path / "cfg.json", quiet=True)
    said = (f"not checked against an architecture: transformers {transformers.__version__} does not know the "
            "architecture 'MadeUpForCausalLM' (custom code is never run)")
    assert said in result.notices
    assert f"| architecture check | {said} |" in (tmp_path / "out" / "README.md").read_text()

    import transformers.core_model_loading as loading

    def moved(**kwargs: object) -> None:  # a later transformers whose loader takes other arguments
        raise TypeError("convert_and_load_state_dict_in_model() got an unexpected keyword argument 'model'")

    monkeypatch.setattr(loading, "convert_and_load_state_dict_in_model", moved)
    result = reshard.convert(llama, tmp_path / "out3", to="hf", quiet=True)
    assert any(n.startswith(f"not checked against an architecture: transformers {transformers.__version__}'s loader "
                            "did not take the check's call") for n in result.notices), result.notices
    monkeypatch.undo()

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    result = reshard.convert(llama, tmp_path / "out2", to="hf", quiet=True)
    assert "not checked against an architecture: transformers is not installed (pip install transformers)" in result.notices


# ------------------------------------------------------------------------- quantized releases


def test_quantized_releases_pass_as_their_quantizer_expects(tmp_path: Path) -> None:
    fp8 = save_fp8_deepseek(_mkdir(tmp_path / "fp8"))
    mx = save_mxfp4_gpt_oss(_mkdir(tmp_path / "mx"))
    for src, arch in ((fp8, "DeepseekV3ForCausalLM"), (mx, "GptOssForCausalLM")):
        result = reshard.convert(src, tmp_path / f"{src.name}_hf", to="hf", quiet=True)
        if arch == "GptOssForCausalLM" and _mxfp4_needs_kernels():
            # a CUDA build of torch brings triton, and then transformers' MXFP4 quantizer wants
            # the `kernels` package too: the check says so instead of passing or failing
            assert any(f"cannot build {arch} here" in n and "kernels" in n for n in result.notices), result.notices
            continue
        assert any(n.startswith(f"checked against {arch}") for n in result.notices), result.notices

    config = json.loads((fp8 / "config.json").read_text())
    tensors = reshard.inspect(fp8).tensors
    scale = "model.layers.0.mlp.down_proj.weight_scale_inv"
    without = check_architecture(config, {n: t for n, t in tensors.items() if n != scale})
    assert without.missing == [scale]  # FP8Linear, as on a GPU, wants every scale
    plain = check_architecture({k: v for k, v in config.items() if k != "quantization_config"}, tensors)
    assert len(plain.unexpected) == 28 and all(n.endswith("weight_scale_inv") for n in plain.unexpected)
    assert plain.dtypes and "float8_e4m3fn, the model's bfloat16" in plain.dtypes[0]


def _mxfp4_needs_kernels() -> bool:
    from transformers.utils import is_kernels_available, is_triton_available

    return is_triton_available("3.5.0") and not is_kernels_available()


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _hf_dcp_hf(src: Path, tmp_path: Path) -> Path:
    dcp = reshard.convert(src, tmp_path / f"{src.name}_dcp", quiet=True).dst
    return reshard.convert(dcp, tmp_path / f"{src.name}_back", to="hf", quiet=True).dst


def test_fp8_and_mxfp4_releases_round_trip_through_dcp_and_load(tmp_path: Path) -> None:
    """HF -> DCP -> HF of an FP8 and an MXFP4 release: the same bytes, config.json still says
    the compute dtype, no side file the source did not have, and transformers loads the result
    as it loads the source."""
    from transformers import FineGrainedFP8Config

    fp8 = save_fp8_deepseek(_mkdir(tmp_path / "fp8"))
    mx = save_mxfp4_gpt_oss(_mkdir(tmp_path / "mx"))
    for src in (fp8, mx):
        (src / "generation_config.json").unlink(missing_ok=True)  # a release without one
        back = _hf_dcp_hf(src, tmp_path)
        config = json.loads((back / "config.json").read_text())
        assert config["dtype"] == "bfloat16" and config["quantization_config"] == \
            json.loads((src / "config.json").read_text())["quantization_config"]
        assert not (back / "generation_config.json").exists()
        same = run_cli("verify", src, back)
        assert same.returncode == 0, same.stdout
        kwargs = {"quantization_config": FineGrainedFP8Config(dequantize=True)} if src is fp8 else {}
        theirs = transformers.AutoModelForCausalLM.from_pretrained(src, **kwargs).state_dict()
        ours = transformers.AutoModelForCausalLM.from_pretrained(back, **kwargs).state_dict()
        assert theirs.keys() == ours.keys()
        for name, value in theirs.items():
            assert ours[name].dtype == value.dtype and torch.equal(ours[name], value), name


# ------------------------------------------------------------------------- families transformers writes

_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32)
FAMILIES = {
    "Qwen3ForCausalLM": ("Qwen3Config", dict(head_dim=8)),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
    "MixtralForCausalLM": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "Phi3ForCausalLM": ("Phi3Config", dict(pad_token_id=0)),  # fused qkv_proj and gate_up_proj
    "GemmaForCausalLM": ("GemmaConfig", dict(head_dim=8)),  # tied embeddings, no lm_head stored
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                                       first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                                                       qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=1,
                                                       topk_group=1, num_key_value_heads=4)),
}


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_families_round_trip_through_dcp_checked_and_loaded(arch: str, tmp_path: Path) -> None:
    """Each family as transformers saves it -> DCP -> HF: checked against its architecture,
    equal to the source, and the same logits in transformers."""
    config_class, extra = FAMILIES[arch]
    torch.manual_seed(0)
    model = getattr(transformers, arch)(getattr(transformers, config_class)(**{**_SMALL, **extra}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(tmp_path / "src")
    dcp = reshard.convert(tmp_path / "src", tmp_path / "dcp", quiet=True).dst
    result = reshard.convert(dcp, tmp_path / "back", to="hf", quiet=True)
    assert any(n.startswith(f"checked against {arch} ") for n in result.notices), result.notices
    assert run_cli("verify", tmp_path / "src", tmp_path / "back").returncode == 0
    tokens = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    logits = []
    for folder in ("src", "back"):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(loaded(tokens).logits)
    assert torch.equal(logits[0], logits[1])
    # The config of a deeper model over the same weights: its last layer is missing.
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    per_layer = [k for k, v in config.items() if isinstance(v, list) and len(v) == 2 and k != "architectures"]
    deeper = {**{k: v for k, v in config.items() if k not in per_layer}, "num_hidden_layers": 3}
    deeper = check_architecture(deeper, reshard.inspect(tmp_path / "back").tensors)
    assert deeper.missing and all(".layers.2." in n for n in deeper.missing) and not deeper.unexpected
