"""reshard.features.dequantize: quantized weights found beside their scales and dequantized box by box,
bit for bit as transformers (and compressed-tensors' documented layout) dequantize them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard
from reshard.commands.convert import excluded
from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Catalog, Chunk, ChunkData, TensorEntry
from reshard.core.chunk_reads import read_box
from reshard.core.errors import CorruptCheckpointError, UnsupportedFormatError, UsageError
from reshard.core.facts import Facts
from reshard.features.dequantize import dequantized, find_quantized, quant_method, unpaired
from reshard.features.provenance import CONFIG_OBJECT, carry_hf_configs
from reshard.pipeline.assemble import assemble
from reshard.pipeline.plan import sources_for
from tests.hf_models import save_tiny_llama
from tests.quant_models import block_reference, fp8_block_quantize, save_fp8_deepseek, save_mxfp4_gpt_oss
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as run_cli

GATE = "model.layers.0.mlp.gate_proj.weight"  # 300x200: blocks of 128 leave partial edges
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fp8") / "deepseek"
    folder.mkdir()
    return save_fp8_deepseek(folder)


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("mxfp4") / "gpt-oss"
    folder.mkdir()
    return save_mxfp4_gpt_oss(folder)


def whole(entry: TensorEntry) -> torch.Tensor:
    return read_box(entry, full_box(entry.shape))


def write_folder(folder: Path, tensors: dict[str, torch.Tensor], config: dict | None) -> Path:
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def folder_catalog(folder: Path, tensors: dict[str, torch.Tensor], config: dict | None) -> Catalog:
    return reshard.inspect(write_folder(folder, tensors, config))


# ------------------------------------------------------------------------- block FP8 (DeepSeek)


def test_deepseek_fp8_pairs_every_quantized_weight(fp8_dir: Path) -> None:
    catalog = reshard.inspect(fp8_dir)
    schemes = find_quantized(catalog)
    fp8 = sorted(n for n, t in catalog.tensors.items() if t.dtype.torch == torch.float8_e4m3fn)
    assert sorted(schemes) == fp8 and len(fp8) == 28
    assert {s.label for s in schemes.values()} == {"fp8-block 128x128"}  # 96x96 too: a 1x1 grid is a block
    gate = schemes[GATE]
    assert (gate.scale, gate.output, gate.shape) == (GATE + "_scale_inv", GATE, (300, 200))
    assert quant_method(catalog) == "fp8" and unpaired(catalog) == []


def test_deepseek_fp8_dequantizes_as_transformers_does(fp8_dir: Path) -> None:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    catalog = reshard.inspect(fp8_dir)
    stored = load_file(fp8_dir / "model.safetensors")
    out = dequantized(catalog)
    assert not any("scale" in n for n in out.tensors)
    assert "quantization_config" not in out.facts.hf_config and out.facts.hf_config["model_type"] == "deepseek_v3"
    assert out.notices[-1].startswith("dequantized 28 fp8-block 128x128 weights to float32")
    for name, entry in out.tensors.items():
        if name not in find_quantized(catalog):
            assert entry is catalog.tensors[name]  # untouched: still kernel-copied
            continue
        q, s = stored[name], stored[name + "_scale_inv"]
        assert entry.dtype.torch == torch.float32 and entry.shape == tuple(q.shape)
        got = whole(entry).to(torch.bfloat16)
        assert torch.equal(got, block_reference(q, s, (128, 128), torch.bfloat16)), name
        theirs = _dequantize_fp8_weight(q, s, [128, 128], torch.float32).to(torch.bfloat16)
        assert torch.equal(got, theirs), name


def test_transformers_load_time_dequantize_agrees_on_whole_blocks(tmp_path: Path) -> None:
    """``Fp8Dequantize`` (what from_pretrained runs on CPU) derives the block from the scale
    grid, so it only agrees where blocks divide the weight; with E8M0 byte scales too."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(1)
    q, s = fp8_block_quantize(torch.randn(256, 384, generator=g))
    e8m0 = torch.randint(110, 140, (64, 3), generator=g, dtype=torch.uint8)
    q2 = (torch.randn(64, 96, generator=g) * 100).to(torch.float8_e4m3fn)
    for i, (values, scales, block) in enumerate(((q, s, [128, 128]), (q2, e8m0, [1, 32]))):
        config = {"model_type": "llama", "quantization_config": {"quant_method": "fp8", "weight_block_size": block}}
        catalog = folder_catalog(tmp_path / str(i), {"w.weight": values, "w.weight_scale_inv": scales}, config)
        assert find_quantized(catalog)["w.weight"].block == tuple(block)
        got = whole(dequantized(catalog).tensors["w.weight"])
        theirs = Fp8Dequantize(None)._dequantize_one(values, scales, output_dtype=torch.float32)
        assert torch.equal(got, theirs)


# ------------------------------------------------------------------------- bounded box reads


@dataclass
class Counting:
    """A ChunkData that records how many elements each read asked for."""

    data: ChunkData
    reads: list[int] = field(default_factory=list)

    def read(self, box: Box) -> torch.Tensor:
        self.reads.append(box.numel)
        return self.data.read(box)


def _counted(catalog: Catalog, names: list[str]) -> tuple[Catalog, dict[str, Counting]]:
    counters, tensors = {}, dict(catalog.tensors)
    for n in names:
        (chunk,) = catalog.tensors[n].chunks
        counters[n] = Counting(chunk.data)
        tensors[n] = replace(catalog.tensors[n], chunks=[Chunk(chunk.box, counters[n])])
    return replace(catalog, tensors=tensors), counters


def test_fp8_box_reads_touch_only_the_covering_values_and_blocks(fp8_dir: Path) -> None:
    catalog, counters = _counted(reshard.inspect(fp8_dir), [GATE, GATE + "_scale_inv"])
    entry = dequantized(catalog).tensors[GATE]
    full = whole(entry)
    for box, scales in ((Box((130, 5), (10, 15)), 1), (Box((120, 120), (20, 20)), 4), (Box((260, 0), (40, 200)), 2)):
        for c in counters.values():
            c.reads.clear()
        got = assemble(box, torch.bfloat16, sources_for(entry, box))  # the engine's one cast
        assert torch.equal(got, full[box.as_slices()].to(torch.bfloat16))
        assert counters[GATE].reads == [box.numel] and counters[GATE + "_scale_inv"].reads == [scales]


def test_fp8_random_boxes_equal_the_whole_tensor(fp8_dir: Path) -> None:
    entry = dequantized(reshard.inspect(fp8_dir)).tensors[GATE]
    full = whole(entry)
    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        r0, c0 = (int(torch.randint(0, n, (1,), generator=g)) for n in (300, 200))
        nr, nc = int(torch.randint(1, 301 - r0, (1,), generator=g)), int(torch.randint(1, 201 - c0, (1,), generator=g))
        box = Box((r0, c0), (nr, nc))
        assert torch.equal(entry.chunks[0].data.read(box), full[box.as_slices()])


def test_fp8_dequantized_in_bands_into_the_engines_slab(fp8_dir: Path, monkeypatch) -> None:
    """Values are dequantized a band of rows at a time (so no temporary is box-sized) and
    written straight into the slab the engine passes, in its dtype: bands that cut blocks and
    rows give the same bits as one pass, and the slab path (``assemble`` with scratch) the
    same bits as a float32 read cast afterwards."""
    import reshard.features.dequantize as quant

    entry = dequantized(reshard.inspect(fp8_dir)).tensors[GATE]
    full = whole(entry)
    monkeypatch.setattr(quant, "_BAND_BYTES", 700)  # 175 elements: bands of part of a row
    data = entry.chunks[0].data
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        r0, c0 = (int(torch.randint(0, n, (1,), generator=g)) for n in (300, 200))
        box = Box((r0, c0), (int(torch.randint(1, 301 - r0, (1,), generator=g)),
                             int(torch.randint(1, 201 - c0, (1,), generator=g))))
        assert torch.equal(data.read(box), full[box.as_slices()])
        scratch = torch.full((box.numel * 2 + 64,), 0xAB, dtype=torch.uint8)
        got = assemble(box, torch.bfloat16, sources_for(entry, box), into=scratch)
        assert got.data_ptr() == scratch.data_ptr()
        assert torch.equal(got, full[box.as_slices()].to(torch.bfloat16))


# ------------------------------------------------------------------------- compressed-tensors FP8


@pytest.mark.parametrize("strategy, scale_shape, extra, block", [
    ("tensor", (), {}, None), ("tensor", (1,), {}, None), ("channel", (150, 1), {}, (1, 70)),
    ("block", (2, 1), {"block_structure": [128, 128]}, (128, 128)), ("group", (150, 2), {"group_size": 35}, (1, 35)),
])
def test_compressed_tensors_fp8(tmp_path: Path, strategy: str, scale_shape: tuple[int, ...], extra: dict,
                                block: tuple[int, int] | None) -> None:
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(150, 70, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(scale_shape, generator=g) / 100
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, **extra}
    config = {"model_type": "llama", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}}}
    catalog = folder_catalog(tmp_path / "ct", {"l.weight": q, "l.weight_scale": scale, "l.input_scale": torch.tensor([0.5]),
                                               "norm.weight": torch.ones(70, dtype=torch.bfloat16)}, config)
    assert find_quantized(catalog)["l.weight"].kind == ("fp8-block" if strategy == "group" else f"fp8-{strategy}")
    out = dequantized(catalog)
    assert sorted(out.tensors) == ["l.weight", "norm.weight"]  # scale and activation scale gone
    # compressed-tensors' dequantize: x_q.to(scale.dtype) * scale, the scale spread over its block.
    want = block_reference(q, scale, block, torch.bfloat16) if block else (q.float() * scale).to(torch.bfloat16)
    assert torch.equal(whole(out.tensors["l.weight"]).to(torch.bfloat16), want)


# ------------------------------------------------------------------------- MXFP4 (gpt-oss)


def test_mxfp4_dequantizes_as_transformers_does(mxfp4_dir: Path) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    catalog = reshard.inspect(mxfp4_dir)
    stored = load_file(mxfp4_dir / "model.safetensors")
    schemes = find_quantized(catalog)
    assert sorted(s.output for s in schemes.values()) == [EXPERTS.replace("gate_up_proj", "down_proj"), EXPERTS]
    out = dequantized(catalog)
    assert not any(n.endswith(("_blocks", "_scales")) for n in out.tensors)
    assert "quantization_config" not in out.facts.hf_config
    for s in schemes.values():
        theirs = convert_moe_packed_tensors(stored[s.weight], stored[s.scale], dtype=torch.bfloat16)
        entry = out.tensors[s.output]
        assert entry.shape == tuple(theirs.shape) == s.shape  # [E, in, out]: transposed as GptOssExperts holds it
        assert torch.equal(whole(entry).to(torch.bfloat16), theirs), s.output


def test_mxfp4_box_reads_read_only_their_groups(mxfp4_dir: Path) -> None:
    blocks, scales = EXPERTS + "_blocks", EXPERTS + "_scales"
    catalog, counters = _counted(reshard.inspect(mxfp4_dir), [blocks, scales])
    entry = dequantized(catalog).tensors[EXPERTS]  # [4, 64, 192]: input rows in groups of 32
    full = whole(entry)
    box = Box((1, 33, 5), (2, 7, 4))  # odd start: a high nibble first; all inside group 1
    for c in counters.values():
        c.reads.clear()
    assert torch.equal(entry.chunks[0].data.read(box), full[box.as_slices()])
    assert counters[blocks].reads == [2 * 4 * 16] and counters[scales].reads == [2 * 4]
    g = torch.Generator().manual_seed(4)
    for _ in range(40):
        lo = [int(torch.randint(0, n, (1,), generator=g)) for n in entry.shape]
        size = [int(torch.randint(1, n - o + 1, (1,), generator=g)) for n, o in zip(entry.shape, lo)]
        box = Box(tuple(lo), tuple(size))
        assert torch.equal(entry.chunks[0].data.read(box), full[box.as_slices()])


# ------------------------------------------------------------------------- the dequantized output loads


def loaded(source: Path, model_class: str, tmp_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the dequantized tensors in bf16, the parameters transformers loads from them as an HF folder)."""
    import transformers

    out = dequantized(reshard.inspect(source))
    tensors = {n: whole(e).to(torch.bfloat16) if e.dtype.is_floating_point else whole(e) for n, e in out.tensors.items()}
    folder = write_folder(tmp_path / "hf", tensors, out.facts.hf_config)
    model, info = getattr(transformers, model_class).from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert getattr(model.config, "quantization_config", None) is None
    return tensors, dict(model.named_parameters())


def test_dequantized_deepseek_loads_in_transformers(fp8_dir: Path, tmp_path: Path) -> None:
    tensors, params = loaded(fp8_dir, "DeepseekV3ForCausalLM", tmp_path)
    assert torch.equal(params[GATE], tensors[GATE])
    experts = "model.layers.1.mlp.experts."  # transformers fuses the per-expert weights on load
    fused = torch.cat([tensors[experts + "2.gate_proj.weight"], tensors[experts + "2.up_proj.weight"]])
    assert torch.equal(params[experts + "gate_up_proj"][2], fused)


def test_dequantized_gpt_oss_loads_in_transformers(mxfp4_dir: Path, tmp_path: Path) -> None:
    tensors, params = loaded(mxfp4_dir, "GptOssForCausalLM", tmp_path)
    for name in (EXPERTS, EXPERTS.replace("gate_up_proj", "down_proj")):
        assert params[name].dtype == torch.bfloat16 and torch.equal(params[name], tensors[name])


# ------------------------------------------------------------------------- refusals and no-ops


def test_a_cast_without_the_scale_is_refused(fp8_dir: Path, mxfp4_dir: Path) -> None:
    catalog = excluded(reshard.inspect(fp8_dir), f"{GATE}_scale_inv")
    assert unpaired(catalog) == [GATE]
    with pytest.raises(UsageError) as e:
        dequantized(catalog)
    assert str(e.value) == (
        f"{fp8_dir}: cannot cast quantized tensor {GATE!r}: its scale {GATE + '_scale_inv'!r} is not in the checkpoint; "
        "keep each weight with its scale (check --exclude / --only) so --dtype dequantizes it, or convert without "
        "--dtype to copy the quantized bytes as they are")
    orphan = excluded(reshard.inspect(fp8_dir), GATE)
    assert unpaired(orphan) == [GATE + "_scale_inv"]
    assert unpaired(excluded(reshard.inspect(mxfp4_dir), "*gate_up_proj_scales")) == [EXPERTS + "_blocks"]


def test_a_scale_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    q, s = fp8_block_quantize(torch.randn(300, 200))
    config = {"model_type": "llama", "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}
    catalog = folder_catalog(tmp_path / "ckpt", {"w.weight": q, "w.weight_scale_inv": s}, config)
    assert find_quantized(catalog) == {} and unpaired(catalog) == ["w.weight"]
    with pytest.raises(UsageError, match=r"fits no scheme for \[300, 200\] \(blocks \[\(64, 64\)\]"):
        dequantized(catalog)


def test_block_size_comes_from_a_carried_config(tmp_path: Path) -> None:
    q, s = fp8_block_quantize(torch.randn(100, 70), (64, 32))
    config = {"model_type": "llama", "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 32]}}
    catalog = folder_catalog(tmp_path / "ckpt", {"w.weight": q, "w.weight_scale_inv": s}, config)
    carry_hf_configs(catalog)  # as a DCP converted from this folder holds it: an object, no facts
    catalog = replace(catalog, facts=Facts())
    out = dequantized(catalog)
    assert torch.equal(whole(out.tensors["w.weight"]), block_reference(q, s, (64, 32), torch.float32))
    assert json.loads(out.objects[CONFIG_OBJECT]) == {"model_type": "llama"}
    assert "quantization_config" in json.loads(catalog.objects[CONFIG_OBJECT])  # the source is not changed


def test_plain_checkpoints_pass_through(tmp_path: Path) -> None:
    plain = folder_catalog(tmp_path / "plain", {"a.weight": torch.randn(4, 4, dtype=torch.bfloat16),
                                                "b.weight": torch.randn(4, 4).to(torch.float8_e4m3fn)},
                           {"model_type": "llama"})
    # A float8 tensor with no scale in a checkpoint that says nothing of quantization is plain data.
    assert find_quantized(plain) == {} and unpaired(plain) == [] and dequantized(plain) is plain


def test_an_unsupported_quantization_is_refused(tmp_path: Path) -> None:
    config = {"model_type": "llama", "quantization_config": {"quant_method": "gptq", "bits": 4}}
    catalog = folder_catalog(tmp_path / "gptq", {"l.qweight": torch.zeros(4, 4, dtype=torch.int32)}, config)
    with pytest.raises(UnsupportedFormatError) as e:
        dequantized(catalog)
    assert str(e.value) == (f"{catalog.path}: quant_method 'gptq' (quantization_config in config.json) cannot be "
                            "dequantized by reshard, which dequantizes fp8 (DeepSeek), compressed-tensors FP8 and mxfp4 "
                            "checkpoints and copies others as they are; convert without --dtype to copy it as it is")


def test_nvfp4_is_refused_saying_what_reshard_does_with_it(tmp_path: Path) -> None:
    """reshard writes NVFP4 (--quantize nvfp4) and copies it, but does not dequantize it: the
    refusal of --dtype says that, not that reshard "reads compressed-tensors" (it does, FP8)."""
    src = save_tiny_llama(tmp_path / "src", tie=False)
    nvfp4 = tmp_path / "nvfp4"
    assert run_cli("convert", src, nvfp4, "--to", "hf", "--quantize", "nvfp4", "--quiet").returncode == 0
    proc = run_cli("convert", nvfp4, tmp_path / "f32", "--to", "hf", "--dtype", "float32")
    assert_one_line_error(proc, f"{nvfp4}: NVFP4 weights (compressed-tensors format 'nvfp4-pack-quantized' in "
                                "config.json's quantization_config) cannot be dequantized: reshard writes NVFP4 "
                                "(--quantize nvfp4) and copies NVFP4 checkpoints as they are, but does not dequantize "
                                "them; convert without --dtype to copy it as it is")
    assert not (tmp_path / "f32").exists()
    copied = tmp_path / "copied"  # what the message offers works
    assert run_cli("convert", nvfp4, copied, "--to", "hf", "--quiet").returncode == 0
    assert reshard.inspect(copied).tensors.keys() == reshard.inspect(nvfp4).tensors.keys()


def test_a_malformed_block_size_is_named(tmp_path: Path) -> None:
    q, s = fp8_block_quantize(torch.randn(8, 8))
    config = {"model_type": "llama", "quantization_config": {"quant_method": "fp8", "weight_block_size": [0, 128]}}
    catalog = folder_catalog(tmp_path / "bad", {"w.weight": q, "w.weight_scale_inv": s}, config)
    with pytest.raises(CorruptCheckpointError) as e:
        find_quantized(catalog)
    assert str(e.value) == (f"{catalog.path}: config's quantization_config weight_block_size [0, 128] is not two "
                            "positive integers (rows and columns per scale)")


def test_an_export_that_quantized_nothing_casts(tmp_path: Path) -> None:
    """--quantize fp8-block of a model with no 128x128 block writes compressed-tensors' "dense"
    format (nothing stored quantized); --dtype on it said reshard could not dequantize its
    own export. Nothing needs dequantizing: it casts, and the config drops quantization_config."""
    src = save_tiny_llama(tmp_path / "src", tie=False)
    dense = tmp_path / "dense"
    assert run_cli("convert", src, dense, "--to", "hf", "--quantize", "fp8-block", "--quiet").returncode == 0
    assert json.loads((dense / "config.json").read_text())["quantization_config"]["format"] == "dense"
    proc = run_cli("convert", dense, tmp_path / "f32", "--to", "hf", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert "quantization_config removed from the config" in proc.stderr
    assert "quantization_config" not in json.loads((tmp_path / "f32" / "config.json").read_text())
    back = {n: t for f in sorted((tmp_path / "f32").glob("*.safetensors")) for n, t in load_file(f).items()}
    plain = {n: t for f in sorted(src.glob("*.safetensors")) for n, t in load_file(f).items()}
    assert back.keys() == plain.keys() and all(torch.equal(back[n], plain[n].float()) for n in plain)
