"""Key maps: the Llama preset round-trips the training model's names (and q/k rows, and the
optimizer state) to HF and back exactly; every inverse is derived and undoes its map;
wrappers are stripped; user JSON maps; fused qkv / gate_up split and merged."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import reshard
from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Catalog, Chunk, TensorEntry
from reshard.core.chunk_reads import read_box
from reshard.core.errors import UsageError
from reshard.core.regions import StoredRegion
from reshard.features.keymap.lookup import PRESETS, load_keymap
from reshard.features.keymap.maps import Drop
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as run_cli

N_HEADS, N_KV, HD, DIM, FFN, VOCAB = 4, 2, 8, 32, 48, 64


def _titan_model(n_layers: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {"tok_embeddings.weight": torch.randn(VOCAB, DIM, generator=g), "norm.weight": torch.randn(DIM, generator=g),
          "output.weight": torch.randn(VOCAB, DIM, generator=g)}
    for i in range(n_layers):
        shapes = {"attention.wq.weight": (N_HEADS * HD, DIM), "attention.wk.weight": (N_KV * HD, DIM),
                  "attention.wv.weight": (N_KV * HD, DIM), "attention.wo.weight": (DIM, N_HEADS * HD),
                  "attention_norm.weight": (DIM,), "ffn_norm.weight": (DIM,), "feed_forward.w1.weight": (FFN, DIM),
                  "feed_forward.w3.weight": (FFN, DIM), "feed_forward.w2.weight": (DIM, FFN)}
        sd.update({f"layers.{i}.{k}": torch.randn(*s, generator=g) for k, s in shapes.items()})
    return sd


def _save_training_checkpoint(folder: Path, model: dict[str, torch.Tensor]) -> None:
    """The contract's layout: model, AdamW-shaped optimizer state keyed by FQN, train objects."""
    state = {n: {"exp_avg": t * 0.5, "exp_avg_sq": t.square(), "step": torch.tensor(7.0)} for n, t in model.items()}
    optim = {"state": state, "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": list(model)}]}
    config = {"vocab_size": VOCAB, "dim": DIM, "n_layers": 2, "n_heads": N_HEADS, "n_kv_heads": N_KV, "ffn_dim": FFN}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model, "optim": optim, "train": {"step": 7, "model_config": config}},
                 checkpoint_id=folder, no_dist=True)


def _to_halves(w: torch.Tensor, n: int) -> torch.Tensor:
    """The permutation of transformers' convert_llama_weights_to_hf.py, as the contract gives it."""
    return w.view(n, w.shape[0] // n // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape[0], w.shape[1])


def _load(folder: Path, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    sd = {n: torch.empty(s) for n, s in shapes.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=folder, no_dist=True)
    return sd


def test_titan_to_hf_and_back_is_exact_with_optimizer_state(tmp_path: Path) -> None:
    model = _titan_model()
    _save_training_checkpoint(tmp_path / "titan", model)
    reshard.convert(tmp_path / "titan", tmp_path / "hf", keymap="titan-to-hf", quiet=True)
    hf = reshard.inspect(tmp_path / "hf")
    assert hf.objects["optim.param_groups.0.params"][:3] == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert hf.objects["train.step"] == 7 and "model.model.layers.1.mlp.down_proj.weight" in hf.tensors

    expected: dict[str, torch.Tensor] = {}
    km = load_keymap("titan-to-hf")
    for fqn, w in model.items():
        (new,) = km.map_name(fqn)
        heads = N_HEADS if fqn.endswith("wq.weight") else N_KV if fqn.endswith("wk.weight") else None
        mapped = (lambda t: _to_halves(t, heads)) if heads else (lambda t: t)
        expected[f"model.{new}"] = mapped(w)
        expected[f"optim.state.{new}.exp_avg"] = mapped(w * 0.5)
        expected[f"optim.state.{new}.exp_avg_sq"] = mapped(w.square())
        expected[f"optim.state.{new}.step"] = torch.tensor(7.0)
    assert set(expected) == set(hf.tensors)
    got = _load(tmp_path / "hf", {n: t.shape for n, t in expected.items()})
    assert all(torch.equal(got[n], t) for n, t in expected.items())

    reshard.convert(tmp_path / "hf", tmp_path / "back", keymap="hf-to-titan", quiet=True)
    assert reshard.verify(tmp_path / "titan", tmp_path / "back").equal  # names, bits and objects
    assert reshard.inspect(tmp_path / "back").paths == reshard.inspect(tmp_path / "titan").paths


@dataclass(frozen=True)
class _Mem:
    t: torch.Tensor

    def read(self, box: Box) -> torch.Tensor:
        return self.t[box.as_slices()].clone()


def _chunked(name: str, t: torch.Tensor, rows: list[int]) -> TensorEntry:
    """``t`` stored as row chunks of the given sizes (uneven, not aligned with heads)."""
    chunks, at = [], 0
    for n in rows:
        box = Box((at,) + (0,) * (t.dim() - 1), (n,) + tuple(t.shape[1:]))
        chunks.append(Chunk(box, _Mem(t[box.as_slices()].clone())))
        at += n
    return TensorEntry(name, tuple(t.shape), t.dtype, chunks)


def test_rope_rows_are_read_box_by_box_across_uneven_chunks() -> None:
    w = torch.randn(N_HEADS * HD, DIM, generator=torch.Generator().manual_seed(3))
    cat = Catalog("mem", Path("mem"), objects={"train.model_config.n_heads": N_HEADS})
    cat.tensors["layers.0.attention.wq.weight"] = _chunked("layers.0.attention.wq.weight", w, [11, 11, 10])
    hf = load_keymap("titan-to-hf").apply(cat)
    entry = hf.tensors["model.layers.0.self_attn.q_proj.weight"]
    want = _to_halves(w, N_HEADS)
    for box in (full_box(want.shape), Box((5, 3), (13, 7)), Box((31, 0), (1, DIM)), Box((4, 0), (0, DIM))):
        assert torch.equal(read_box(entry, box), want[box.as_slices()])
    back = load_keymap("hf-to-titan").apply(hf).tensors["layers.0.attention.wq.weight"]
    assert torch.equal(read_box(back, full_box(w.shape)), w)


def test_every_preset_inverse_is_derived_and_undoes_it() -> None:
    names = [f"layers.{i}.{k}" for i in (0, 10) for k in ("attention.wq.weight", "feed_forward.w3.weight")]
    names += ["tok_embeddings.weight", "output.weight", "something.else"]
    for preset in ("titan-to-hf", "hf-unfuse"):
        km = load_keymap(preset)
        for one in getattr(km, "families", {"": km}).values():  # torchtitan presets: a map per model family
            kept = tuple(r for r in one.rules if not isinstance(r, Drop))  # what a Drop left out stays out
            assert one.inverse().inverse().rules == kept and one.inverse().rules != kept
    km = load_keymap("titan-to-hf")
    assert [load_keymap("hf-to-titan").map_name(km.map_name(n)[0]) for n in names] == [[n] for n in names]
    assert km.map_name("layers.12.attention.wk.weight") == ["model.layers.12.self_attn.k_proj.weight"]
    parts = load_keymap("hf-unfuse").map_name("model.layers.3.mlp.gate_up_proj.weight")
    assert parts == ["model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight"]
    assert set(PRESETS) >= {"titan-to-hf", "hf-to-titan", "strip-wrappers", "hf-unfuse", "hf-fuse"}


def test_wrapper_prefixes_stripped_and_not_invertible(tmp_path: Path) -> None:
    km = load_keymap("strip-wrappers")
    assert km.map_name("module._orig_mod.layers.0._fsdp_wrapped_module.attention.wq.weight") == ["layers.0.attention.wq.weight"]
    assert km.map_name("_orig_mod.block._checkpoint_wrapped_module.module.w") == ["block.module.w"]  # inner `module` is real
    with pytest.raises(UsageError, match="cannot be put back"):
        km.inverse()
    t = {"module._orig_mod.w": torch.ones(2), "module.b": torch.zeros(3)}
    save_file(t, tmp_path / "wrapped.safetensors")
    assert run_cli("convert", tmp_path / "wrapped.safetensors", tmp_path / "clean.safetensors",
                   "--keymap", "strip-wrappers", "--quiet").returncode == 0
    assert set(load_file(tmp_path / "clean.safetensors")) == {"w", "b"}


def test_user_json_map_with_two_numbers_round_trips(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(4)
    tensors = {f"enc.{i}.blk.{j}.w": torch.randn(3, generator=g) for i in (1, 12) for j in (0, 7)}
    save_file(tensors, tmp_path / "in.safetensors")
    forward = {r"enc\.(\d+)\.blk\.(\d+)\.w": r"blocks.\2.layers.\1.weight"}
    (tmp_path / "map.json").write_text(json.dumps(forward))
    assert run_cli("convert", tmp_path / "in.safetensors", tmp_path / "out.safetensors",
                   "--keymap", tmp_path / "map.json", "--quiet").returncode == 0
    out = load_file(tmp_path / "out.safetensors")
    assert torch.equal(out["blocks.7.layers.12.weight"], tensors["enc.12.blk.7.w"]) and len(out) == 4
    inverse = load_keymap(tmp_path / "map.json").inverse()
    assert inverse.map_name("blocks.7.layers.12.weight") == ["enc.12.blk.7.w"]
    with pytest.raises(UsageError, match="cannot be inverted"):
        load_keymap({r"enc\.(.*)": r"x.\1.\1"}).inverse()  # a group used twice
    with pytest.raises(UsageError, match="cannot be inverted"):
        load_keymap({r"enc.(\d+)": r"x.\1"}).inverse()  # an unescaped dot matches any character
    (tmp_path / "clash.json").write_text(json.dumps({r"enc\.\d+\.blk\.(\d+)\.w": r"b.\1"}))
    assert_one_line_error(run_cli("convert", tmp_path / "in.safetensors", tmp_path / "x.safetensors",
                                  "--keymap", tmp_path / "clash.json"), "sends both")
    (tmp_path / "broken.json").write_text("{not json")
    assert_one_line_error(run_cli("convert", tmp_path / "in.safetensors", tmp_path / "x.safetensors",
                                  "--keymap", tmp_path / "broken.json"), "broken.json", "not valid JSON")


def test_fused_qkv_and_gate_up_split_and_merge(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    fused = {"model.layers.0.self_attn.qkv_proj.weight": torch.randn((N_HEADS + 2 * N_KV) * HD, DIM, generator=g),
             "model.layers.0.mlp.gate_up_proj.weight": torch.randn(2 * FFN, DIM, generator=g),
             "model.norm.weight": torch.randn(DIM, generator=g)}
    (tmp_path / "phi").mkdir()
    save_file(fused, tmp_path / "phi" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "phi" / "config.json").write_text(json.dumps({"num_attention_heads": N_HEADS, "num_key_value_heads": N_KV}))
    result = reshard.convert(tmp_path / "phi", tmp_path / "split.safetensors", keymap="hf-unfuse", quiet=True)
    assert result.kernel_bytes > 0  # the parts are narrower views of the stored bytes
    split = load_file(tmp_path / "split.safetensors")
    q, k, v = fused["model.layers.0.self_attn.qkv_proj.weight"].split([N_HEADS * HD, N_KV * HD, N_KV * HD])
    gate, up = fused["model.layers.0.mlp.gate_up_proj.weight"].chunk(2)
    want = {"q_proj": q, "k_proj": k, "v_proj": v}
    assert all(torch.equal(split[f"model.layers.0.self_attn.{n}.weight"], t) for n, t in want.items())
    assert torch.equal(split["model.layers.0.mlp.gate_proj.weight"], gate)
    assert torch.equal(split["model.layers.0.mlp.up_proj.weight"], up)

    reshard.convert(tmp_path / "split.safetensors", tmp_path / "merged.safetensors", keymap="hf-fuse", quiet=True)
    merged = load_file(tmp_path / "merged.safetensors")
    assert set(merged) == set(fused) and all(torch.equal(merged[n], t) for n, t in fused.items())
    del split["model.layers.0.self_attn.v_proj.weight"]
    save_file(split, tmp_path / "partial.safetensors")
    with pytest.raises(UsageError, match="needs 'model.layers.0.self_attn.v_proj.weight'"):
        reshard.convert(tmp_path / "partial.safetensors", tmp_path / "m2.safetensors", keymap="hf-fuse", quiet=True)


def test_split_and_merge_carry_optimizer_state() -> None:
    g = torch.Generator().manual_seed(6)
    w = torch.randn(2 * FFN, DIM, generator=g)
    name = "model.layers.0.mlp.gate_up_proj.weight"
    cat = Catalog("mem", Path("mem"))
    for key, t in (("exp_avg", w * 2), ("step", torch.tensor(5.0))):
        full = f"optim.state.{name}.{key}"
        cat.tensors[full] = _chunked(full, t, [FFN + 5, FFN - 5]) if t.dim() else \
            TensorEntry(full, (), t.dtype, [Chunk(Box((), ()), _Mem(t))])
        cat.paths[full] = ("optim", "state", name, key)
    cat.objects["optim.param_groups.0.params"] = [name]
    split = load_keymap("hf-unfuse").apply(cat)
    gate = split.tensors["optim.state.model.layers.0.mlp.gate_proj.weight.exp_avg"]
    assert torch.equal(read_box(gate, full_box(gate.shape)), (w * 2)[:FFN])
    assert "optim.state.model.layers.0.mlp.up_proj.weight.step" in split.tensors
    assert split.objects["optim.param_groups.0.params"] == ["model.layers.0.mlp.gate_proj.weight",
                                                            "model.layers.0.mlp.up_proj.weight"]
    back = load_keymap("hf-fuse").apply(split)
    assert set(back.tensors) == set(cat.tensors) and back.objects == cat.objects and back.paths == cat.paths
    exp = back.tensors[f"optim.state.{name}.exp_avg"]
    assert torch.equal(read_box(exp, full_box(exp.shape)), w * 2)


def test_split_of_stored_rows_stays_a_stored_region(tmp_path: Path) -> None:
    t = torch.arange(24.0).view(6, 4)
    save_file({"model.layers.0.mlp.gate_up_proj.weight": t}, tmp_path / "f.safetensors")
    cat = load_keymap("hf-unfuse").apply(reshard.inspect(tmp_path / "f.safetensors"))
    up = cat.tensors["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(up.chunks[0].data, StoredRegion) and torch.equal(read_box(up, full_box((3, 4))), t[3:])


def _moe_titan(era: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A torchtitan qwen3 MoE layer in either era's names, and the grouped-expert names."""
    g = torch.Generator().manual_seed(3)
    names = {"v2": ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3", "attention.wq.weight"),
             "v3": ("moe.routed_experts.inner_experts.w1_EFD", "moe.routed_experts.inner_experts.w2_EDF",
                    "moe.routed_experts.inner_experts.w3_EFD", "attention.qkv_linear.wq.weight")}[era]
    w1, w2, w3, wq = (f"layers.0.{n}" for n in names)
    experts, hidden = 5, 6
    sd = {w1: torch.randn(experts, hidden, DIM, generator=g), w3: torch.randn(experts, hidden, DIM, generator=g),
          w2: torch.randn(experts, DIM, hidden, generator=g), wq: torch.randn(N_HEADS * HD, DIM, generator=g),
          "layers.0.moe.router.gate.weight": torch.randn(experts, DIM, generator=g),
          "layers.0.attention.q_norm.weight": torch.randn(HD, generator=g),
          "freqs_cis": torch.randn(16, 4, dtype=torch.complex64, generator=g)}
    return sd, {"w1": w1, "w2": w2, "w3": w3}


@pytest.mark.parametrize("era", ["v2", "v3"])
def test_grouped_experts_unstack_to_hf_and_stack_back(tmp_path: Path, era: str) -> None:
    """torchtitan's grouped MoE tensors <-> HF's expert per tensor, optimizer state following,
    freqs_cis left out (HF has no such buffer); streamed as views of the stored chunks."""
    model, grouped = _moe_titan(era)
    state = {n: {"exp_avg": t * 2, "step": torch.tensor(4.0)} for n, t in model.items() if not t.is_complex()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model, "optim": {"state": state, "param_groups": [{"lr": 0.1, "params": list(state)}]}},
                 checkpoint_id=tmp_path / "titan", no_dist=True)
    config = {"model_type": "qwen3_moe", "num_attention_heads": N_HEADS, "num_key_value_heads": N_KV}
    cat = reshard.inspect(tmp_path / "titan")
    cat.facts.hf_config = config
    hf = load_keymap("titan-to-hf").apply(cat)
    assert not any("freqs_cis" in n for n in hf.tensors) and any("freqs_cis" in n for n in hf.notices)
    for e in range(5):
        for part, key in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            fqn = f"model.layers.0.mlp.experts.{e}.{part}.weight"
            got = hf.tensors[f"model.{fqn}"]
            assert torch.equal(read_box(got, full_box(got.shape)), model[grouped[key]][e]), (fqn, era)
            moment = hf.tensors[f"optim.state.{fqn}.exp_avg"]
            assert torch.equal(read_box(moment, full_box(moment.shape)), model[grouped[key]][e] * 2)
            assert f"optim.state.{fqn}.step" in hf.tensors
    q = hf.tensors["model.model.layers.0.self_attn.q_proj.weight"]  # qwen3: HF's RoPE order already, no permutation
    assert torch.equal(read_box(q, full_box(q.shape)), next(v for k, v in model.items() if k.endswith("wq.weight")))
    assert "model.layers.0.mlp.experts.4.down_proj.weight" in hf.objects["optim.param_groups.0.params"]
    # Back to torchtitan's grouped tensors, bit for bit, in the era asked for.
    hf.facts.hf_config = config
    back = load_keymap("hf-to-titan" if era == "v2" else "hf-to-titan-0.3").apply(hf)
    for key, name in grouped.items():
        got = back.tensors[f"model.{name}"]
        assert got.shape == model[name].shape and torch.equal(read_box(got, full_box(got.shape)), model[name])
        step = back.tensors[f"optim.state.{name}.step"]
        assert step.shape == () and torch.equal(read_box(step, Box((), ())), torch.tensor(4.0))


def test_family_comes_from_the_config_or_the_names() -> None:
    from reshard.features.keymap.maps import titan_family

    def cat(names: list[str], config: dict | None = None) -> Catalog:
        c = Catalog("dcp", Path("x"))
        c.tensors = {n: TensorEntry(n, (2,), torch.float32) for n in names}
        if config:
            c.facts.hf_config = config
        return c

    assert titan_family(cat(["layers.0.attention.wq.weight"])) == "llama3"
    assert titan_family(cat(["layers.0.attention.q_norm.weight"])) == "qwen3"
    assert titan_family(cat(["layers.0.attention.wkv_a.weight"])) == "deepseek_v3"
    assert titan_family(cat(["layers.0.attention.wq.weight"], {"model_type": "qwen3"})) == "qwen3"
    with pytest.raises(UsageError, match="model_type 'gpt2' has no torchtitan key map"):
        titan_family(cat([], {"model_type": "gpt2"}))


def test_the_preset_names_help_lists_are_the_presets() -> None:
    from reshard.features.keymap.presets import PRESET_NAMES

    assert set(PRESET_NAMES) == set(PRESETS)
