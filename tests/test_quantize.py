"""--quantize fp8: DeepSeek-V3's block-scaled float8_e4m3fn, written while streaming, bit for bit
what a plain-torch reference quantizer gives (partial blocks on a ceil grid), read back the same
by reshard's dequantizer and by transformers' ``FineGrainedFP8Config(dequantize=True)``; and
composed with --merge-lora, --dtype and --keep-dtype in one pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import reshard
from reshard.cli.app import main
from tests.hf_models import save_lora_adapter

E4M3 = torch.float8_e4m3fn


def reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's quantizer as the issue defines it: per 128x128 block (a ceil grid, edge
    blocks partial) scale = amax(|block|) / 448 (1 for a zero block), values (block / scale)."""
    rows, cols = w.shape
    nr, nc = -(-rows // 128), -(-cols // 128)
    q, scale = torch.empty(rows, cols, dtype=E4M3), torch.empty(nr, nc)
    for i in range(nr):
        for j in range(nc):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            amax = block.abs().max()
            scale[i, j] = amax / 448 if amax > 0 else 1.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / scale[i, j]).to(E4M3)
    return q, scale


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= scale[i, j]
    return out


def _llama(folder: Path, tie: bool = False, **dims: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, tie_word_embeddings=tie, max_position_embeddings=16, **dims))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        model.model.layers[0].mlp.up_proj.weight[128:256, :128] = 0  # a block of zeros: scale 1
        if model.config.hidden_size >= 256:
            model.model.layers[0].self_attn.o_proj.weight[128:256, :128] = 0
    model.save_pretrained(folder, max_shard_size="200KB")
    return folder


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_fp8_whole_blocks_bit_exact_and_read_back(tmp_path: Path, capsys) -> None:
    """Weights whose dims are multiples of 128 are quantized bit for bit as the reference does;
    those with another dim (gate/up/down of intermediate 300) stay as they are, decided before
    writing, and are listed in modules_to_not_convert (partial blocks read back differently in
    transformers than by DeepSeek-V3's rule)."""
    base = _llama(tmp_path / "base", vocab_size=300, hidden_size=256, intermediate_size=300, num_attention_heads=2,
                  num_key_value_heads=1)  # q/o 256x256 and k/v 128x256 whole blocks; gate/up/down 300: partial
    out = tmp_path / "fp8"
    assert main(["convert", str(base), str(out), "--to", "hf", "--quantize", "fp8", "--max-memory", "1MiB"]) == 0
    notices = capsys.readouterr().err
    source, got = _tensors(base), _tensors(out)
    weights = [n for n in source if n.endswith(".weight") and n.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj")]
    partial = [n for n in source if n.endswith(".weight") and n.split(".")[-2] in ("gate_proj", "up_proj", "down_proj")]
    assert len(weights) == 8 and len(partial) == 6
    assert sorted(got) == sorted([*source, *(n + "_scale_inv" for n in weights)])
    for name, t in source.items():
        if name in weights:
            q, scale = reference(t)
            assert got[name].dtype == E4M3 and torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
            assert got[name + "_scale_inv"].dtype == torch.float32 and torch.equal(got[name + "_scale_inv"], scale), name
        else:  # embeddings, head, norms, weights of partial blocks: as they were
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert got["model.layers.0.self_attn.o_proj.weight_scale_inv"][1, 0] == 1.0
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32"
    qc = config["quantization_config"]
    assert {k: v for k, v in qc.items() if k != "modules_to_not_convert"} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert {"lm_head", "model.embed_tokens", "model.norm"} | {n.removesuffix(".weight") for n in partial} <= \
        set(qc["modules_to_not_convert"])
    assert "quantized 8 linear weights to float8_e4m3fn" in notices and "dims not multiples of 128 6" in notices
    # reshard's own dequantizer: exactly fp8.float() * scale per block
    back = tmp_path / "back"
    assert main(["convert", str(out), str(back), "--to", "hf", "--dtype", "float32"]) == 0
    plain = _tensors(back)
    assert sorted(plain) == sorted(source) and "quantization_config" not in json.loads((back / "config.json").read_text())
    for name in weights:
        assert torch.equal(plain[name], dequantized(got[name], got[name + "_scale_inv"])), name


@pytest.mark.parametrize("dims", [dict(hidden_size=200, intermediate_size=300, num_attention_heads=4),
                                  dict(hidden_size=256, intermediate_size=300, num_attention_heads=2)],
                         ids=["hidden200", "intermediate300"])
def test_fp8_loads_in_transformers_as_reshard_reads_it(tmp_path: Path, dims: dict) -> None:
    """hidden 200 / intermediate 300: the export followed DeepSeek-V3's ceil grid, and
    transformers' FineGrainedFP8Config(dequantize=True), deriving the block from the shapes
    (200 rows / 2 scale rows = 100), dequantized gate_proj with errors up to 0.020. Such weights
    are not quantized now (hidden 200: none is), and transformers' load equals reshard's reading
    of every tensor."""
    from transformers import FineGrainedFP8Config, LlamaForCausalLM

    base = _llama(tmp_path / "base", vocab_size=64, num_key_value_heads=dims["num_attention_heads"] // 2, **dims)
    out = tmp_path / "fp8"
    reshard.convert(base, out, to="hf", quantize="fp8", quiet=True)
    back = tmp_path / "back"
    reshard.convert(out, back, to="hf", dtype="float32", quiet=True)
    theirs = LlamaForCausalLM.from_pretrained(out, quantization_config=FineGrainedFP8Config(dequantize=True)).state_dict()
    ours = _tensors(back)
    assert sorted(ours) == sorted(theirs)
    for name, t in ours.items():
        assert torch.equal(theirs[name].float(), t), name


def test_fp8_of_ragged_moe_experts_is_decided_before_writing(tmp_path: Path) -> None:
    """Qwen3-MoE experts of 96 rows: reshard wrote the export, then its own check refused the
    fused experts' scales ("gate_up_proj_scale_inv: [4, 6, 2], the model's is [4, 5, 2]"), exit 2
    after the work. The experts stay as they are now (their experts module listed, so transformers
    fuses them unconverted); the rest is quantized, and transformers loads it as reshard reads it."""
    from transformers import FineGrainedFP8Config, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, moe_intermediate_size=96, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        max_position_embeddings=16, tie_word_embeddings=False))
    model.save_pretrained(tmp_path / "moe")
    out = tmp_path / "moe_fp8"
    result = reshard.convert(tmp_path / "moe", out, to="hf", quantize="fp8", quiet=True)
    assert any(n.startswith("checked against Qwen3MoeForCausalLM") for n in result.notices)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"} <= set(qc["modules_to_not_convert"])
    assert _tensors(out)["model.layers.0.self_attn.q_proj.weight"].dtype == E4M3
    reshard.convert(out, tmp_path / "back", to="hf", dtype="float32", quiet=True)
    theirs = Qwen3MoeForCausalLM.from_pretrained(out, quantization_config=FineGrainedFP8Config(dequantize=True)).state_dict()
    ours = _tensors(tmp_path / "back")
    for name in set(ours) & set(theirs):
        assert torch.equal(theirs[name].float(), ours[name]), name
    experts = theirs["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(experts[1].float(), torch.cat([ours["model.layers.0.mlp.experts.1.gate_proj.weight"],
                                                      ours["model.layers.0.mlp.experts.1.up_proj.weight"]]))


def test_fp8_multiples_of_128_match_transformers(tmp_path: Path) -> None:
    from transformers import FineGrainedFP8Config, LlamaForCausalLM

    base = _llama(tmp_path / "base", vocab_size=64, hidden_size=256, intermediate_size=384, num_attention_heads=2,
                  num_key_value_heads=1)
    out = tmp_path / "fp8"
    reshard.convert(base, out, to="hf", quantize="fp8", max_memory="64KiB", quiet=True)
    back = tmp_path / "back"
    reshard.convert(out, back, to="hf", dtype="float32", quiet=True)
    ours = _tensors(back)
    model = LlamaForCausalLM.from_pretrained(out, quantization_config=FineGrainedFP8Config(dequantize=True))
    theirs = model.state_dict()
    assert sorted(ours) == sorted(theirs)
    quantized = [n for n, t in _tensors(out).items() if t.dtype == E4M3]
    assert len(quantized) == 14
    for name, t in ours.items():
        assert torch.equal(theirs[name].float(), t), name


def test_merge_dtype_keep_quantize_in_one_pass(tmp_path: Path, capsys) -> None:
    base = _llama(tmp_path / "base", vocab_size=64, hidden_size=256, intermediate_size=384, num_attention_heads=2,
                  num_key_value_heads=1)
    adapter = save_lora_adapter(base, tmp_path / "adapter", r=4, lora_alpha=8,
                                target_modules=["q_proj", "v_proj", "gate_proj", "embed_tokens"])
    merged = tmp_path / "merged"  # the merge alone, in float32 (test_lora.py: equal to PEFT's)
    reshard.convert(base, merged, to="hf", merge_lora=adapter, quiet=True)
    out = tmp_path / "serve"
    assert main(["convert", str(base), str(out), "--to", "hf", "--merge-lora", str(adapter), "--dtype", "bfloat16",
                 "--keep-dtype", "norm", "--quantize", "fp8", "--max-memory", "1MiB"]) == 0
    notices = capsys.readouterr().err
    want, got = _tensors(merged), _tensors(out)
    for name, t in want.items():
        if name.split(".")[-2] in QUANTIZED:  # quantized from the merged float32 values, not from bf16
            q, scale = reference(t)
            assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(got[name + "_scale_inv"], scale), name
        elif "norm" in name:
            assert got[name].dtype == torch.float32 and torch.equal(got[name], t), name
        else:
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t.to(torch.bfloat16)), name
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["quantization_config"]["quant_method"] == "fp8"
    for decision in ("merged LoRA adapter adapter", "quantized 14 linear weights", "cast to bfloat16",
                     "kept 5 tensors in their source dtype (--keep-dtype norm)"):
        assert decision in notices, decision
    # --keep-dtype names a linear weight: it stays unquantized, listed in modules_to_not_convert
    kept = tmp_path / "kept"
    reshard.convert(base, kept, to="hf", quantize="fp8", keep_dtype=[r"layers\.0\.self_attn\.q_proj"], quiet=True)
    qc = json.loads((kept / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.self_attn.q_proj" in qc["modules_to_not_convert"]
    assert _tensors(kept)["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32


@pytest.mark.parametrize("argv, message", [
    (["--quantize", "int4"], "'int4': reshard writes fp8"),
    (["--quantize", "fp8", "--weights-only"], "writes none"),
])
def test_quantize_refusals(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    base = _llama(tmp_path / "base", vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=2)
    assert main(["convert", str(base), str(tmp_path / "out"), "--to", "hf", *argv]) == 2
    assert message in capsys.readouterr().err
    assert main(["convert", str(base), str(tmp_path / "o.safetensors"), "--quantize", "fp8"]) == 2
    assert "--quantize applies to hf outputs" in capsys.readouterr().err


def test_fp8_of_a_tied_model_writes_and_loads(tmp_path: Path) -> None:
    """Llama-3.2-1B, Qwen2.5-0.5B and Gemma tie the head to the embeddings: the export writes the
    head once (as the embedding), so lm_head was not in modules_to_not_convert and transformers'
    quantizer wanted an FP8 head with its scale ("1 of its 20 tensors missing
    (lm_head.weight_scale_inv)", exit 2). The head is not converted now, and transformers'
    dequantizing load equals reshard's reading."""
    from transformers import FineGrainedFP8Config, LlamaForCausalLM

    base = _llama(tmp_path / "tied", tie=True, vocab_size=64, hidden_size=256, intermediate_size=384,
                  num_attention_heads=2, num_key_value_heads=1)
    out = tmp_path / "tied_fp8"
    reshard.convert(base, out, to="hf", quantize="fp8", quiet=True)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "lm_head" in qc["modules_to_not_convert"]
    back = tmp_path / "back"
    reshard.convert(out, back, to="hf", dtype="float32", quiet=True)
    ours = _tensors(back)
    theirs = LlamaForCausalLM.from_pretrained(out, quantization_config=FineGrainedFP8Config(dequantize=True)).state_dict()
    for name, t in ours.items():
        assert torch.equal(theirs[name].float(), t), name
    assert torch.equal(theirs["lm_head.weight"], theirs["model.embed_tokens.weight"])


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_fp8_refuses_non_finite_weights(tmp_path: Path, bad: float) -> None:
    """One inf in q_proj made its whole 128x128 block NaN after dequantization, exit 0 and no
    word; a block holding a NaN got scale 1. Refused now, naming the tensor and the block."""
    from safetensors.torch import save_file

    from tests.test_cli import assert_one_line_error
    from tests.test_cli import reshard as cli

    base = _llama(tmp_path / "base", vocab_size=64, hidden_size=256, intermediate_size=384, num_attention_heads=2,
                  num_key_value_heads=1)
    weights = _tensors(base)
    weights["model.layers.1.self_attn.q_proj.weight"][130, 5] = bad
    for f in base.glob("*.safetensors*"):
        f.unlink()
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    proc = cli("convert", base, tmp_path / "fp8", "--to", "hf", "--quantize", "fp8")
    assert_one_line_error(proc, "model.layers.1.self_attn.q_proj.weight: block (1, 0) (rows 128-255, columns 0-127) "
                          f"holds {'inf' if bad == float('inf') else 'NaN'}", "--keep-dtype")
    assert not (tmp_path / "fp8").exists()


def test_fp8_leaves_modules_that_are_not_linear(tmp_path: Path) -> None:
    """GPT-2's projections are transformers' Conv1D (weights stored transposed), which its FP8
    quantizer does not replace: reshard quantized them, then its own check refused the export
    with a hint to use --keymap, which does not help. Decided before writing now, from the
    model the config describes: nothing there is nn.Linear but the tied head, so exit 2 says so."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.test_cli import assert_one_line_error
    from tests.test_cli import reshard as cli

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=2, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(tmp_path / "gpt2")
    proc = cli("convert", tmp_path / "gpt2", tmp_path / "fp8", "--to", "hf", "--quantize", "fp8")
    assert_one_line_error(proc, "found no nn.Linear weight to quantize", "8 2-D weights belong to modules that are "
                          "not nn.Linear (such as GPT-2's Conv1D)")
    assert "--keymap" not in proc.stderr and not (tmp_path / "fp8").exists()
