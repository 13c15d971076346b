"""--quantize fp8-dynamic / fp8-block / nvfp4: compressed-tensors exports, checked three ways.

1. Bit for bit against a plain-torch reference written here from compressed-tensors' own
   definitions (``calculate_qparams``, ``_quantize``, ``pack_fp4_to_uint8``), always.
2. Bit for bit, tensors and ``quantization_config``, against llm-compressor's ``model_free_ptq``
   run on reshard's plain export with the same ``ignore`` list, where llm-compressor is installed
   (it pins transformers <= 5.17, so it lives in a venv of its own: scripts/peer_venvs.sh makes it;
   RESHARD_LLMCOMPRESSOR_PYTHON names another); skipped, saying so, elsewhere.
3. ``compressed_tensors`` itself (a test extra) validates each config (every field, as its
   pydantic model dumps it) and decompresses each export to values within the scheme's rounding
   of the source; transformers loads each export as the model its config describes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard.cli.app import main

E4M3 = torch.float8_e4m3fn
SCHEMES = {"fp8-dynamic": "FP8_DYNAMIC", "fp8-block": "FP8_BLOCK", "nvfp4": "NVFP4A16"}
PEER = Path(os.environ.get("RESHARD_LLMCOMPRESSOR_PYTHON",
                           Path.home() / ".cache" / "reshard-compat" / "llmc" / "bin" / "python"))


# --- the reference: compressed-tensors' arithmetic in plain torch ----------------------------------

def _scale(amax: torch.Tensor, q_max: float) -> torch.Tensor:
    """calculate_qparams, symmetric: amax / q_max in the weight's dtype; eps where 0."""
    s = amax / torch.tensor(q_max, dtype=amax.dtype)
    return torch.where(s == 0, torch.tensor(torch.finfo(s.dtype).eps, dtype=s.dtype), s)


def ref_fp8_dynamic(w: torch.Tensor) -> dict[str, torch.Tensor]:
    s = _scale(w.abs().amax(dim=1, keepdim=True), 448.0)
    return {"weight": torch.clamp(w / s, -448.0, 448.0).to(E4M3), "weight_scale": s}


def ref_fp8_block(w: torch.Tensor) -> dict[str, torch.Tensor]:
    r, c = w.shape
    blocks = w.reshape(r // 128, 128, c // 128, 128).transpose(1, 2)
    s = _scale(blocks.abs().amax(dim=(-1, -2)), 448.0)
    q = torch.clamp(blocks / s[..., None, None], -448.0, 448.0).to(E4M3).transpose(1, 2).reshape(r, c)
    return {"weight": q, "weight_scale": s}


def _fp4(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' cast_to_fp4 (CPU), sequential masks as written there."""
    sign, x = torch.sign(x), torch.abs(x).clone()
    x[(x >= 0.0) & (x <= 0.25)] = 0.0
    x[(x > 0.25) & (x < 0.75)] = 0.5
    x[(x >= 0.75) & (x <= 1.25)] = 1.0
    x[(x > 1.25) & (x < 1.75)] = 1.5
    x[(x >= 1.75) & (x <= 2.5)] = 2.0
    x[(x > 2.5) & (x < 3.5)] = 3.0
    x[(x >= 3.5) & (x <= 5.0)] = 4.0
    x[x > 5.0] = 6.0
    return x * sign


def _pack(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack_fp4_to_uint8 (CPU)."""
    sign = torch.signbit(x).to(torch.uint8)
    doubled = (x * 2).to(torch.int8).abs_()
    idx = torch.zeros_like(doubled, dtype=torch.uint8)
    for value, code in ((1, 1), (2, 2), (3, 3), (4, 4), (6, 5), (8, 6)):
        idx[doubled == value] = code
    idx[doubled >= 12] = 7
    idx = (idx | (sign << 3)).reshape(-1, 2)
    return (idx[:, 0] | (idx[:, 1] << 4)).reshape(x.shape[0], x.shape[1] // 2)


def ref_nvfp4(w: torch.Tensor, fused: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    absmax = torch.stack([f.abs().max() for f in fused]).max()
    m = torch.clamp(absmax.reshape(1), min=torch.finfo(absmax.dtype).tiny)
    gs = torch.nan_to_num(448.0 * 6.0 / m, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32)
    groups = w.unflatten(-1, (-1, 16))
    s = gs * (groups.abs().amax(-1) / torch.tensor(6.0, dtype=w.dtype))
    s = torch.clamp(s, -448.0, 448.0).to(E4M3).to(torch.float32)
    s = torch.where(s == 0, torch.tensor(0.125), s)
    q = _fp4(torch.clamp(groups / (s / gs)[..., None], -6.0, 6.0)).to(w.dtype).flatten(-2)
    return {"weight_packed": _pack(q), "weight_scale": s.to(E4M3), "weight_global_scale": gs}


_FUSED = (r"^(.+\.self_attn)\.(q_proj|k_proj|v_proj)\.weight$", r"^(.+\.mlp)\.(gate_proj|up_proj)\.weight$")


def reference(scheme: str, source: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """What ``scheme`` writes for the weight ``name`` of ``source``, named as in the output."""
    module = name.removesuffix(".weight")
    w = source[name]
    if scheme == "fp8-dynamic":
        parts = ref_fp8_dynamic(w)
    elif scheme == "fp8-block":
        parts = ref_fp8_block(w)
    else:
        fused = [w]
        for pattern in _FUSED:
            if (m := re.match(pattern, name)):
                fused = [t for n, t in source.items() if (o := re.match(pattern, n)) and o.group(1) == m.group(1)]
        parts = ref_nvfp4(w, fused)
    return {f"{module}.{k}": v for k, v in parts.items()}


# --- models ---------------------------------------------------------------------------------------

def _randomized(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.to(torch.bfloat16)


def llama(folder: Path, hidden: int = 256, inter: int = 512, tie: bool = False) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = _randomized(LlamaForCausalLM(LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, vocab_size=384, max_position_embeddings=32, tie_word_embeddings=tie)))
    with torch.no_grad():  # a zero block / group / channel: each scheme's eps case
        model.model.layers[0].mlp.up_proj.weight[:128, :128] = 0
    model.save_pretrained(folder)
    return folder


def qwen3_moe(folder: Path) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = _randomized(Qwen3MoeForCausalLM(Qwen3MoeConfig(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=384, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32)))
    model.save_pretrained(folder)
    return folder


MODELS = {"llama256": llama, "llama200": lambda f: llama(f, hidden=200, inter=300), "qwen3moe": qwen3_moe}


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each model, its plain export and its export by each scheme (under a 1 MiB budget)."""
    root = tmp_path_factory.mktemp("ct")
    out: dict[str, Path] = {}
    for model, make in MODELS.items():
        src = make(root / model)
        out[model] = src
        for scheme in ("plain", *SCHEMES):
            dst = root / f"{model}-{scheme}"
            quantize = [] if scheme == "plain" else ["--quantize", scheme]
            assert main(["convert", str(src), str(dst), "--to", "hf", "--max-memory", "1MiB", "-q", *quantize]) == 0
            out[f"{model}-{scheme}"] = dst
    return out


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def qconfig(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, dtype and shape included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# --- 1. the reference ----------------------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_bit_equal_to_the_reference(exports: dict[str, Path], model: str, scheme: str) -> None:
    source, got = tensors(exports[f"{model}-plain"]), tensors(exports[f"{model}-{scheme}"])
    ignore = set(qconfig(exports[f"{model}-{scheme}"])["ignore"])
    expected: dict[str, torch.Tensor] = {}
    quantized = 0
    for name, t in source.items():
        module = name.removesuffix(".weight")
        if t.ndim == 2 and module not in ignore and not any(module.startswith(i + ".") for i in ignore):
            expected.update(reference(scheme, source, name))
            quantized += 1
        else:
            expected[name] = t
    assert sorted(got) == sorted(expected)
    bad = [n for n in expected if not same(got[n], expected[n])]
    assert not bad, bad[:5]
    qc = qconfig(exports[f"{model}-{scheme}"])
    if model == "llama200" and scheme != "fp8-dynamic":  # no dim of hidden 200 fills a block of 128 / groups of 16
        assert quantized == 0 and qc["format"] == "dense"
    else:
        assert quantized >= 8  # attention and dense MLPs at least (experts too but for fp8-block)
    # embeddings, the head and router gates are never quantized; experts only where transformers loads them
    assert {"lm_head", "model.embed_tokens"} <= ignore
    if model == "qwen3moe":
        assert {"model.layers.0.mlp.gate", "model.layers.1.mlp.gate"} <= ignore
        assert ("model.layers.0.mlp.experts" in ignore) == (scheme == "fp8-block")


def test_the_config_is_compressed_tensors_own(exports: dict[str, Path]) -> None:
    """compressed-tensors' own pydantic model parses reshard's config with every field it knows
    and no other, to the values of its presets (the installed release's; the 0.19 JSON itself is
    compared with model_free_ptq's above)."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme, preset_name_to_scheme

    def plain(v: object) -> object:
        return getattr(v, "value", v) if not isinstance(v, (list, dict)) else v

    for scheme, preset in SCHEMES.items():
        qc = qconfig(exports[f"llama256-{scheme}"])
        assert set(qc) - {"version", "quant_method", "transform_config"} <= set(QuantizationConfig.model_fields), scheme
        parsed = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k in QuantizationConfig.model_fields})
        group, mine = parsed.config_groups[preset], qc["config_groups"][preset]
        assert set(mine) <= set(QuantizationScheme.model_fields), scheme
        for part in ("weights", "input_activations"):
            if mine[part] is None:
                assert getattr(group, part) is None
                continue
            assert set(mine[part]) == set(QuantizationArgs.model_fields), (scheme, part)
            for k, v in mine[part].items():
                if k == "zp_dtype":  # 0.19 writes null; 0.20's validator derives it from the type
                    continue
                got = plain(getattr(getattr(group, part), k))
                assert str(got) == str(v) if k == "scale_dtype" and v is not None else got == v, (scheme, part, k)
        want = preset_name_to_scheme(preset, ["Linear"])
        assert group.weights == want.weights and group.input_activations == want.input_activations, scheme
        assert parsed.ignore == qc["ignore"] and str(plain(parsed.quantization_status)) == "compressed"
    assert ct.__version__  # the release that parsed it


# --- 2. the peer ---------------------------------------------------------------------------------

@pytest.mark.skipif(not PEER.exists(), reason=f"llm-compressor's venv is absent ({PEER}): make it with "
                                                "scripts/peer_venvs.sh llmcompressor (it pins transformers <= 5.17)")
@pytest.mark.parametrize("model", MODELS)
def test_bit_equal_to_model_free_ptq(exports: dict[str, Path], model: str, tmp_path: Path) -> None:
    """model_free_ptq on reshard's plain export, with the ignore list reshard wrote, writes the
    same tensors and quantization_config, bit for bit (compressed-tensors' version included)."""
    script = ("import json, sys\nfrom llmcompressor import model_free_ptq\n"
              "model_free_ptq(sys.argv[1], sys.argv[2], scheme=sys.argv[3], ignore=json.loads(sys.argv[4]), device='cpu')\n")
    for scheme, preset in SCHEMES.items():
        mine = exports[f"{model}-{scheme}"]
        peer = tmp_path / scheme
        subprocess.run([str(PEER), "-c", script, str(exports[f"{model}-plain"]), str(peer), preset,
                        json.dumps(qconfig(mine)["ignore"])], check=True, capture_output=True, timeout=1200)
        a, b = tensors(mine), tensors(peer)
        assert sorted(a) == sorted(b), (scheme, set(a) ^ set(b))
        bad = [n for n in a if not same(a[n], b[n])]
        assert not bad, (scheme, bad[:5])
        assert qconfig(mine) == qconfig(peer), scheme


@pytest.mark.skipif(not PEER.exists(), reason=f"llm-compressor's venv is absent ({PEER})")
def test_model_free_ptq_with_only_lm_head_ignored(exports: dict[str, Path], tmp_path: Path) -> None:
    """The peer's own default (ignore=["lm_head"]) quantizes the embeddings too, which no reader
    loads as an embedding; every other tensor is what reshard writes. On hidden 200 it fails
    (FP8_BLOCK: a non-contiguous slice of the embeddings; NVFP4A16: 200 columns in groups of 16)."""
    script = ("import sys\nfrom llmcompressor import model_free_ptq\n"
              "model_free_ptq(sys.argv[1], sys.argv[2], scheme=sys.argv[3], ignore=['lm_head'], device='cpu')\n")
    peer = tmp_path / "peer"
    subprocess.run([str(PEER), "-c", script, str(exports["llama256-plain"]), str(peer), "FP8_DYNAMIC"], check=True,
                   capture_output=True, timeout=1200)
    a, b = tensors(exports["llama256-fp8-dynamic"]), tensors(peer)
    assert set(b) - set(a) == {"model.embed_tokens.weight_scale"} and b["model.embed_tokens.weight"].dtype == E4M3
    assert all(same(a[n], b[n]) for n in a if not n.startswith("model.embed_tokens"))
    for preset in ("FP8_BLOCK", "NVFP4A16"):
        failed = subprocess.run([str(PEER), "-c", script, str(exports["llama200-plain"]), str(tmp_path / preset), preset],
                                capture_output=True, text=True, timeout=1200)
        assert failed.returncode != 0 and "ValueError" in failed.stderr, preset


# --- 3. compressed-tensors decompresses, transformers loads -------------------------------------

@pytest.mark.parametrize("scheme", SCHEMES)
def test_compressed_tensors_decompresses_within_rounding(exports: dict[str, Path], scheme: str) -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    for model in ("llama256", "qwen3moe"):
        folder = exports[f"{model}-{scheme}"]
        qc, got, source = qconfig(folder), tensors(folder), tensors(exports[f"{model}-plain"])
        group = QuantizationScheme.model_validate(next(iter(qc["config_groups"].values())))
        compressor = BaseCompressor.get_value_from_registry(qc["format"])
        checked = 0
        for name, w in source.items():
            module = name.removesuffix(".weight")
            parts = {k.removeprefix(module + "."): v for k, v in got.items() if k.startswith(module + ".weight_")}
            if not parts:
                continue
            if "weight_packed" not in parts:
                parts["weight"] = got[name]
            back = compressor.decompress(parts, group)["weight"].float()
            w = w.float()
            if scheme == "nvfp4":  # half the widest step of E2M1 (4 -> 6) at each group's scale
                step = (got[module + ".weight_scale"].float() / got[module + ".weight_global_scale"]).repeat_interleave(16, 1)
                bound = step * 1.0 + w.abs() / 128  # and decompress rounds to bf16
            else:  # 3 mantissa bits: 1/16 relative, or a subnormal step of the scale
                scale = got[module + ".weight_scale"].float()
                per = scale.expand_as(w) if scheme == "fp8-dynamic" else scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
                bound = w.abs() / 16 + per / 256
            assert bool(((back - w).abs() <= bound * 1.01 + 1e-6).all()), (model, name)
            checked += 1
        assert checked >= 8, (model, scheme)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_transformers_loads_the_export(exports: dict[str, Path], scheme: str) -> None:
    """from_pretrained puts every tensor of the export, bit for bit, into the compressed-tensors
    module it belongs to, and the model computes logits near the bf16 model's (activations are
    quantized too, per token or group, so the tolerance is loose; the bytes are checked above)."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    folder = exports[f"llama256-{scheme}"]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    loaded = model.state_dict()
    written = tensors(folder)
    assert all(same(loaded[n], t) for n, t in written.items() if n != "lm_head.weight"), scheme
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear"
    assert str(model.model.layers[0].self_attn.q_proj.quantization_status) == "QuantizationStatus.COMPRESSED"
    tokens = torch.randint(0, 384, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(exports["llama256-plain"]).eval()(tokens).logits.float()
        quant = model(tokens).logits.float()
    assert torch.isfinite(quant).all()
    err = (quant - base).abs().max().item() / base.abs().max().item()
    assert 0 < err < (0.35 if scheme == "nvfp4" else 0.15), err


# --- what is refused, before anything is written ------------------------------------------------

@pytest.mark.parametrize("scheme", SCHEMES)
def test_non_finite_weight_refused_naming_it(exports: dict[str, Path], scheme: str, tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for f in exports["llama256-plain"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    weights = load_file(src / "model.safetensors")
    weights["model.layers.1.self_attn.q_proj.weight"][3, 7] = float("inf") if scheme != "nvfp4" else float("nan")
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "hf", "--quantize", scheme]) == 2
    err = capsys.readouterr().err
    assert "model.layers.1.self_attn.q_proj.weight" in err and ("inf" in err or "NaN" in err) and "--keep-dtype" in err
    assert not (tmp_path / "out").exists()


def test_compressed_tensors_prints_nothing_of_its_own(tmp_path: Path) -> None:
    """The architecture check builds the model with compressed-tensors, whose own progress bars
    ("Applying quantization config", "Compressing model") went to stderr: 4 lines under
    --quiet, and before the one line of a refusal. --quiet prints nothing now (a process of
    its own, as a user runs it), and a refusal is its one line."""
    pytest.importorskip("compressed_tensors")
    from tests.hf_models import save_tiny_llama
    from tests.test_cli import assert_one_line_error, reshard, reshard_process

    src = save_tiny_llama(tmp_path / "src", tie=False)
    proc = reshard_process("convert", src, tmp_path / "nvfp4", "--to", "hf", "--quantize", "nvfp4", "--quiet")
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout == "", proc.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    for f in sorted(bad.glob("*.safetensors")):
        weights = load_file(f)
        if "model.layers.1.self_attn.q_proj.weight" in weights:
            weights["model.layers.1.self_attn.q_proj.weight"][3, 7] = float("nan")
            save_file(weights, f, metadata={"format": "pt"})
    for scheme in ("fp8-dynamic", "nvfp4"):
        proc = reshard("convert", bad, tmp_path / f"refused-{scheme}", "--to", "hf", "--quantize", scheme)
        assert_one_line_error(proc, "model.layers.1.self_attn.q_proj.weight", "NaN")
        assert not (tmp_path / f"refused-{scheme}").exists()


def test_unknown_scheme_lists_them(tmp_path: Path, capsys) -> None:
    assert main(["convert", str(tmp_path / "nothing-read"), str(tmp_path / "out"), "--to", "hf", "--quantize", "int3"]) == 2
    err = capsys.readouterr().err
    assert "'int3'" in err and all(s in err for s in ("fp8 (", "fp8-dynamic (", "fp8-block (", "nvfp4 ("))


def test_tied_head_is_ignored_and_loads(tmp_path: Path) -> None:
    """A tied model: lm_head.weight is not written (transformers re-ties it), and lm_head is in
    ``ignore`` so compressed-tensors does not expect its scales."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    src = llama(tmp_path / "tied", tie=True)
    for scheme in SCHEMES:
        out = tmp_path / scheme
        assert main(["convert", str(src), str(out), "--to", "hf", "--quantize", scheme, "-q"]) == 0
        assert "lm_head" in qconfig(out)["ignore"] and "lm_head.weight" not in tensors(out)
        model = AutoModelForCausalLM.from_pretrained(out)
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), scheme
