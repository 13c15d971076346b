"""--merge-lora: a PEFT adapter merged while streaming equals PEFT's own ``merge_and_unload()``
(state dict and logits), under a budget far below one weight, for plain, rsLoRA with rank and
alpha patterns, modules_to_save, embedding adapters, tied embeddings and GPT-2's fan_in_fan_out;
what PEFT's plain merge would not give is refused with exit 2 naming the module. --keep-dtype
keeps the tensors it names in their source dtype under --dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import reshard
from reshard.cli.app import main
from reshard.core.errors import UsageError
from tests.hf_models import hf_logits, peft_merged, save_lora_adapter, save_tiny_llama

TARGETS = ["q_proj", "v_proj", "gate_proj", "embed_tokens"]
VARIANTS = {
    "plain": dict(r=8, lora_alpha=16, target_modules=TARGETS, modules_to_save=["lm_head"]),
    "rslora-patterns": dict(r=4, lora_alpha=8, target_modules=TARGETS, use_rslora=True,
                            rank_pattern={"layers.1.self_attn.q_proj": 2, "gate_proj": 6}, alpha_pattern={"v_proj": 3}),
}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("lora") / "base", tie=False)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_merge_equals_peft_merge_and_unload(base: Path, variant: str, tmp_path: Path, capsys) -> None:
    adapter = save_lora_adapter(base, tmp_path / "adapter", **VARIANTS[variant])
    out = tmp_path / "merged"
    assert main(["convert", str(base), str(out), "--to", "hf", "--merge-lora", str(adapter)]) == 0
    notices = capsys.readouterr().err
    expected, logits = peft_merged(base, adapter)
    got = _tensors(out)
    # 4KiB (the API takes it; the CLI asks for 1MiB): every adapted weight, 4 KiB and up, in row slabs
    reshard.convert(base, tmp_path / "slabs",
                    options=reshard.ConvertOptions(to="hf", merge_lora=adapter, max_memory="4KiB", quiet=True))
    assert all(torch.equal(t, got[n]) for n, t in _tensors(tmp_path / "slabs").items())
    assert sorted(got) == sorted(expected) and not any("lora_" in n for n in got)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        torch.testing.assert_close(got[name], t, rtol=0, atol=1e-6, msg=name)
    source = _tensors(base)
    changed = {n for n in got if not torch.equal(got[n], source[n])}
    adapted = {n for n in got if n.endswith(".weight") and n.split(".")[-2] in TARGETS}
    assert adapted <= changed and len(adapted) == 7  # the merge changed every targeted weight
    torch.testing.assert_close(hf_logits(out), logits, rtol=0, atol=1e-5)
    config, base_config = json.loads((out / "config.json").read_text()), json.loads((base / "config.json").read_text())
    assert {k: v for k, v in config.items() if k not in ("dtype", "transformers_version")} == \
        {k: v for k, v in base_config.items() if k not in ("dtype", "transformers_version")}
    assert "with the PEFT LoRA adapter `adapter` merged in" in (out / "README.md").read_text()
    assert "merged LoRA adapter adapter" in notices and "into 7 weights" in notices


def test_tied_embeddings_stay_tied(tmp_path: Path) -> None:
    base = save_tiny_llama(tmp_path / "tied", tie=True)
    adapter = save_lora_adapter(base, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"])
    out = tmp_path / "merged"
    reshard.convert(base, out, to="hf", merge_lora=adapter, max_memory="4KiB", quiet=True)
    expected, logits = peft_merged(base, adapter)
    got = _tensors(out)
    assert "lm_head.weight" not in got and json.loads((out / "config.json").read_text())["tie_word_embeddings"]
    assert torch.equal(expected["lm_head.weight"], expected["model.embed_tokens.weight"])  # PEFT's: one parameter
    for name, t in got.items():
        torch.testing.assert_close(t, expected[name], rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(hf_logits(out), logits, rtol=0, atol=1e-5)


def test_bin_adapter_and_dry_run(base: Path, tmp_path: Path) -> None:
    """An adapter saved as adapter_model.bin (torch.load with weights_only) merges the same."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(3)
    peft = get_peft_model(LlamaForCausalLM.from_pretrained(base),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False))
    peft.save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert (tmp_path / "bin" / "adapter_model.bin").is_file()
    dry = reshard.convert(base, tmp_path / "dry", to="hf", merge_lora=tmp_path / "bin", dry_run=True)
    assert not (tmp_path / "dry").exists() and any("into 2 weights" in n for n in dry.notices)
    reshard.convert(base, tmp_path / "out", to="hf", merge_lora=tmp_path / "bin", quiet=True)
    expected, _ = peft_merged(base, tmp_path / "bin")
    for name, t in _tensors(tmp_path / "out").items():
        torch.testing.assert_close(t, expected[name], rtol=0, atol=1e-6, msg=name)


def test_dcp_base_and_trained_biases(tmp_path: Path) -> None:
    """BASE may be any source with HF names: here a DCP folder converted from the HF folder
    (config.json carried inside); PEFT's ``bias="all"`` saves trained biases, loaded into
    the base's own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                 tie_word_embeddings=False)).save_pretrained(tmp_path / "hf")
    adapter = save_lora_adapter(tmp_path / "hf", tmp_path / "adapter", r=4, lora_alpha=8,
                                target_modules=["q_proj", "o_proj"], bias="all")
    with torch.no_grad():  # as if training had moved the biases: the adapter's must win
        from safetensors.torch import save_file

        saved = load_file(adapter / "adapter_model.safetensors")
        biases = [k for k in saved if k.endswith(".bias")]
        assert biases and any(".base_layer." not in k for k in biases)
        save_file({k: v + 1 if k in biases else v for k, v in saved.items()}, adapter / "adapter_model.safetensors")
    reshard.convert(tmp_path / "hf", tmp_path / "dcp", quiet=True)
    reshard.convert(tmp_path / "dcp", tmp_path / "out", to="hf", merge_lora=adapter, quiet=True)
    expected, logits = peft_merged(tmp_path / "hf", adapter)
    got = _tensors(tmp_path / "out")
    assert sorted(got) == sorted(expected)
    for name, t in got.items():
        torch.testing.assert_close(t, expected[name], rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(hf_logits(tmp_path / "out"), logits, rtol=0, atol=1e-5)


def test_fan_in_fan_out_gpt2(tmp_path: Path) -> None:
    """GPT-2's Conv1D stores weights [in, out]: the delta is (B @ A).T, as PEFT merges it."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)).save_pretrained(tmp_path / "gpt2")
    peft = get_peft_model(GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2"),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                                     init_lora_weights=False))
    peft.save_pretrained(tmp_path / "adapter")
    reshard.convert(tmp_path / "gpt2", tmp_path / "merged", to="hf", merge_lora=tmp_path / "adapter", max_memory="4KiB",
                    quiet=True)
    merged = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2"), tmp_path / "adapter")
    expected = merged.merge_and_unload().state_dict()
    got = _tensors(tmp_path / "merged")
    assert got and all("lora_" not in n for n in got)
    for name, t in got.items():
        torch.testing.assert_close(t, expected[name], rtol=0, atol=1e-6, msg=name)
    assert not torch.equal(got["transformer.h.0.attn.c_attn.weight"],
                           _tensors(tmp_path / "gpt2")["transformer.h.0.attn.c_attn.weight"])


def _edit_config(adapter: Path, **changes: object) -> None:
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_refusals_name_the_module(base: Path, tmp_path: Path, capsys) -> None:
    def refused(adapter: Path, *extra: str) -> str:
        capsys.readouterr()
        out = tmp_path / "out"
        assert main(["convert", str(base), str(out), "--to", "hf", "--merge-lora", str(adapter), *extra]) == 2
        assert not out.exists()
        return capsys.readouterr().err.strip()

    dora = save_lora_adapter(base, tmp_path / "dora", r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True)
    assert "DoRA" in refused(dora)
    _edit_config(dora, use_dora=False)  # the magnitude vectors are still there: refused by name
    err = refused(dora)
    assert "module 'model.layers.0.self_attn.q_proj'" in err and "DoRA magnitude vector" in err
    plain = save_lora_adapter(base, tmp_path / "plain", r=4, lora_alpha=8, target_modules=["q_proj"])
    _edit_config(plain, peft_type="IA3")
    assert "peft_type 'IA3'" in refused(plain)
    other = save_tiny_llama(tmp_path / "wider", tie=False)  # same names, another width
    cfg = json.loads((other / "config.json").read_text())
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(**{**cfg, "intermediate_size": 40})).save_pretrained(tmp_path / "narrow")
    wrong = save_lora_adapter(tmp_path / "narrow", tmp_path / "wrong", r=4, lora_alpha=8, target_modules=["gate_proj"])
    err = refused(wrong)
    assert "module 'model.layers.0.mlp.gate_proj'" in err and "[40, 32]" in err and "[48, 32]" in err
    assert "no adapter_config.json" in refused(tmp_path)
    with pytest.raises(UsageError, match="applies to hf outputs, not safetensors"):
        reshard.convert(base, tmp_path / "x.safetensors", merge_lora=plain)


def test_keep_dtype_with_dtype(base: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "bf16"
    assert main(["convert", str(base), str(out), "--to", "hf", "--dtype", "bfloat16", "--keep-dtype", "norm"]) == 0
    err = capsys.readouterr().err
    got, source = _tensors(out), _tensors(base)
    norms = [n for n in got if "norm" in n]
    assert len(norms) == 5 and f"kept {len(norms)} tensors in their source dtype (--keep-dtype norm)" in err
    for name, t in got.items():
        want = source[name] if "norm" in name else source[name].to(torch.bfloat16)
        assert t.dtype == want.dtype and torch.equal(t, want), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    for argv, message in ((["--keep-dtype", "norm"], "applies with --dtype or --quantize"),
                          (["--dtype", "bfloat16", "--keep-dtype", "nothing_matches"], "matches no tensor"),
                          (["--dtype", "bfloat16", "--keep-dtype", "norm("], "is not a regular expression")):
        assert main(["convert", str(base), str(tmp_path / "no"), "--to", "hf", *argv]) == 2
        assert message in capsys.readouterr().err
    # any output, through the API: a list of patterns
    reshard.convert(base, tmp_path / "m.safetensors", dtype="float16", keep_dtype=["embed", r"^lm_head\."], quiet=True)
    kept = load_file(tmp_path / "m.safetensors")
    assert {n for n, t in kept.items() if t.dtype == torch.float32} == {"model.embed_tokens.weight", "lm_head.weight"}


def _peft_state(cls, base: Path, adapter: Path, **load) -> dict[str, torch.Tensor]:
    from peft import PeftModel

    return PeftModel.from_pretrained(cls.from_pretrained(base, **load), adapter).merge_and_unload().state_dict()


def _bit_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got
    for name, t in got.items():
        assert t.dtype == expected[name].dtype and torch.equal(t, expected[name]), name


def test_merges_are_bit_equal_to_peft(tmp_path: Path) -> None:
    """PEFT's arithmetic, dtype by dtype: a bf16 base with an embedding adapter (PEFT rounds the
    delta to bf16 before adding it: 1 ulp off before), and a tied model with adapters on both
    embed_tokens and lm_head (one shared weight, the deltas in the model's module order: 1.9e-6
    off in float32 before)."""
    from transformers import LlamaForCausalLM

    untied = save_tiny_llama(tmp_path / "base", tie=False)
    bf16 = tmp_path / "bf16"
    LlamaForCausalLM.from_pretrained(untied, dtype=torch.bfloat16).save_pretrained(bf16)
    adapter = save_lora_adapter(bf16, tmp_path / "emb", r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"])
    reshard.convert(bf16, tmp_path / "bf16_merged", to="hf", merge_lora=adapter, max_memory="4KiB", quiet=True)
    _bit_equal(_tensors(tmp_path / "bf16_merged"), _peft_state(LlamaForCausalLM, bf16, adapter, dtype=torch.bfloat16))

    tied = save_tiny_llama(tmp_path / "tied", tie=True)
    both = save_lora_adapter(tied, tmp_path / "both", r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head"])
    reshard.convert(tied, tmp_path / "tied_merged", to="hf", merge_lora=both, max_memory="4KiB", quiet=True)
    _bit_equal(_tensors(tmp_path / "tied_merged"), _peft_state(LlamaForCausalLM, tied, both))


def test_no_false_refusals_where_peft_merges(tmp_path: Path) -> None:
    """GPT-2 with adapters on c_attn (Conv1D) and its tied lm_head: PEFT saves fan_in_fan_out
    false (it rewrote the shared flag at lm_head), and the embedding is transformer.wte, not
    model.embed_tokens; a Gemma config.json without tie_word_embeddings (its class ties by
    default). reshard refused both; now each merge is bit-equal to PEFT's."""
    from peft import LoraConfig, get_peft_model
    from transformers import GemmaConfig, GemmaForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)).save_pretrained(tmp_path / "gpt2")
    torch.manual_seed(1)
    get_peft_model(GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2"),
                   LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "lm_head"], fan_in_fan_out=True,
                              init_lora_weights=False)).save_pretrained(tmp_path / "gpt2_adapter")
    assert json.loads((tmp_path / "gpt2_adapter" / "adapter_config.json").read_text())["fan_in_fan_out"] is False
    reshard.convert(tmp_path / "gpt2", tmp_path / "gpt2_merged", to="hf", merge_lora=tmp_path / "gpt2_adapter", quiet=True)
    _bit_equal(_tensors(tmp_path / "gpt2_merged"), _peft_state(GPT2LMHeadModel, tmp_path / "gpt2", tmp_path / "gpt2_adapter"))

    torch.manual_seed(0)
    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=16))
    gemma.save_pretrained(tmp_path / "gemma")
    config = json.loads((tmp_path / "gemma" / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (tmp_path / "gemma" / "config.json").write_text(json.dumps(config))
    torch.manual_seed(1)
    get_peft_model(GemmaForCausalLM.from_pretrained(tmp_path / "gemma"),
                   LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
                   ).save_pretrained(tmp_path / "gemma_adapter")
    reshard.convert(tmp_path / "gemma", tmp_path / "gemma_merged", to="hf", merge_lora=tmp_path / "gemma_adapter", quiet=True)
    _bit_equal(_tensors(tmp_path / "gemma_merged"), _peft_state(GemmaForCausalLM, tmp_path / "gemma", tmp_path / "gemma_adapter"))


def test_only_modules_target_modules_names_are_merged(base: Path, tmp_path: Path) -> None:
    """target_modules ["q_proj", "v_projj"] beside v_proj LoRA weights: PEFT puts LoRA on q_proj
    only and never loads the v_proj pair; reshard merged both (logits 1.05 apart). It leaves the
    pair out now, says so, and equals PEFT's merge."""
    from transformers import LlamaForCausalLM

    adapter = save_lora_adapter(base, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    _edit_config(adapter, target_modules=["q_proj", "v_projj"])
    result = reshard.convert(base, tmp_path / "merged", to="hf", merge_lora=adapter, quiet=True)
    assert any("left out the LoRA weights of 2 modules target_modules does not name" in n for n in result.notices)
    got = _tensors(tmp_path / "merged")
    _bit_equal(got, _peft_state(LlamaForCausalLM, base, adapter))
    assert torch.equal(got["model.layers.0.self_attn.v_proj.weight"], _tensors(base)["model.layers.0.self_attn.v_proj.weight"])


def test_an_adapter_named_as_transformers_5_loads_the_model(tmp_path: Path) -> None:
    """A Llava adapter made with transformers 5 names `model.language_model.layers.0...` (the
    loaded model's names), while the checkpoint transformers 5 saves keeps
    `language_model.model.layers...`: reshard refused it ("the base has no ..."); the names go
    through transformers' own renaming on load now, and the merge equals PEFT's, saved."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    config = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                        num_attention_heads=2, image_size=28, patch_size=14,
                                                        projection_dim=32),
                         text_config=LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16),
                         image_token_index=63)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(tmp_path / "base")
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in _tensors(tmp_path / "base")
    torch.manual_seed(1)
    get_peft_model(LlavaForConditionalGeneration.from_pretrained(tmp_path / "base"),
                   LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)",
                              init_lora_weights=False)).save_pretrained(tmp_path / "adapter")
    reshard.convert(tmp_path / "base", tmp_path / "merged", to="hf", merge_lora=tmp_path / "adapter", quiet=True)
    peft = PeftModel.from_pretrained(LlavaForConditionalGeneration.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    peft.merge_and_unload().save_pretrained(tmp_path / "peft")
    expected, got = _tensors(tmp_path / "peft"), _tensors(tmp_path / "merged")
    assert sorted(got) == sorted(expected)
    _bit_equal(got, expected)
    assert not torch.equal(got["language_model.model.layers.1.self_attn.v_proj.weight"],
                           _tensors(tmp_path / "base")["language_model.model.layers.1.self_attn.v_proj.weight"])
