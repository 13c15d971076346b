"""Memory-path rows for scripts/bench.py (``--paths``): every way reshard moves bytes, at one budget.

One row per path, each a child process measured by bench.py's method (wall spawn to exit, peak
RSS by ``wait4``, warm cache, medians), at ``--max-memory`` (256MiB by default) on ~1.5 GB
sources, with its peak RSS above a bare ``import torch`` set against its target:

* ``--dtype bfloat16`` DCP -> DCP of the benchmark checkpoint: at most 384 MiB above import
  torch, whatever the budget below that (the scale issue's acceptance 3);
* every other path: at most the budget + 384 MiB (the HF-export issue's acceptance 5 for the
  MoE export, the quantized-checkpoints issue's acceptance 4 for the FP8 export):

  - ``--to-mesh 8`` from the 4-rank ``Shard(0)`` source: dim-0 re-layout, and the same with a
    PLAN.json that puts every matrix on ``Shard(1)``: dim-1 re-layout, whose work must stay
    within 2x of dim-0's;
  - key-map gathers: ``--keymap titan-to-hf`` (q/k rows permuted per head across the source's
    shards, head counts from a config.json) and ``--keymap hf-fuse`` (q/k/v and gate/up
    concatenated) on an HF-named DCP made from the source once per run;
  - zarr with ``--compress`` (zstd chunks), written from the source and read back into
    safetensors (the store is made once per run);
  - a torchtitan MoE checkpoint (grouped experts, ``scripts/make_moe_ckpt.py``) exported with
    ``--to hf --config``;
  - a DeepSeek-style FP8 folder (``scripts/make_fp8_ckpt.py``) dequantized with ``--to hf
    --dtype bfloat16``;
  - ``--quantize fp8-dynamic``: an HF export of the benchmark model (float32, over 1 GiB at the
    default size: ``Sources.serving``) written as compressed-tensors FP8_DYNAMIC, beside llm-compressor's
    ``model_free_ptq`` on the same folder (its venv: scripts/peer_venvs.sh);
  - ``--merge-lora``: the benchmark model exported to an HF folder once, and a PEFT-format
    LoRA adapter (r=16 on every q/v/gate projection) merged into it with ``--to hf`` at a
    budget of a quarter of the model (the serving issue's acceptance 1: a model 4x the budget).

Peers where one exists, written the way people do it today: torch loading the whole DCP,
casting and saving it with ``dcp.save``; the same full load, a hand-written torchtitan ->
HF rename with the experts split, and huggingface_hub's ``save_torch_state_dict`` (what
torchtitan's converter does); and DeepSeek's own recipe, dequantizing one safetensors shard
at a time. The runtime has its own benchmarks: scripts/bench_load.py (state dicts beside
torch's dcp.load) and scripts/bench_load_model.py (``reshard.load_model``, FSDP2 + AdamW).

Every row checks what it wrote (dtype and size of the output, files present), so a silent
no-op fails the row.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from bench_harness import (
    IMPORT_TORCH,
    Command,
    Context,
    Row,
    environment,
    measure,
    print_checks,
    print_table,
    reshard_argv,
    rss_probe,
    select_rows,
    summarize,
)
from make_bench_ckpt import default_ckpt_path, ensure_checkpoint, solve_dims
from make_fp8_ckpt import default_fp8_path, ensure_fp8_checkpoint
from make_moe_ckpt import config_dir, default_moe_path, ensure_moe_checkpoint

__all__ = ["PathRow", "path_rows", "budget_mib", "llama_heads", "dim1_plan", "path_checks", "run_paths",
           "ensure_lora_pair", "lora_budget_mib"]

MIB = 2**20
DTYPE_RSS_MIB = 384  # --dtype: peak RSS above import torch, whatever the budget
OVER_BUDGET_MIB = 384  # other paths: budget + this above import torch
DIM1_WORK_TARGET = 2.0  # dim-1 re-layout work / dim-0 re-layout work
MESH = "8"

DTYPE = "reshard --dtype bfloat16 -> dcp"
DIM0 = f"reshard --to-mesh {MESH} Shard(0)"
DIM1 = f"reshard --to-mesh {MESH} Shard(1)"
TITAN_TO_HF = "reshard --keymap titan-to-hf"
HF_FUSE = "reshard --keymap hf-fuse"
ZARR_WRITE = "reshard -> zarr --compress"
ZARR_READ = "reshard zarr(zstd) -> safetensors"
MOE = "reshard MoE -> hf"
FP8 = "reshard fp8 -> hf bf16"
MERGE_LORA = "reshard --merge-lora -> hf"
QUANTIZE = "reshard --quantize fp8-dynamic -> hf"
MODEL_FREE_PTQ = "llm-compressor quantize (model_free_ptq)"
# llm-compressor pins transformers <= 5.17: its venv is scripts/peer_venvs.sh's (the row says so when absent)
LLMC_PYTHON = Path(os.environ.get("RESHARD_LLMCOMPRESSOR_PYTHON",
                                  Path.home() / ".cache" / "reshard-compat" / "llmc" / "bin" / "python"))
LORA_RANK = 16
DEFAULT_SIZE_MB = 1536  # bench.py's --size-mb default
SERVING_CKPT_MB = 3200  # a checkpoint whose model is over 1 GiB (the serving issue's benchmark)
TORCH_CAST = "torch load, cast, dcp.save"
TORCH_MOE = "torch load, to_hf, hf save"
SHARD_DEQUANT = "per-shard fp8 dequant"


# ---------------------------------------------------------------------------------- sources


class Sources:
    """The checkpoints the rows read, made (or found cached in .bench/) on first use."""

    def __init__(self, size_mb: float, ckpt: Path | None) -> None:
        self.size_mb, self._ckpt = size_mb, ckpt

    @cached_property
    def dcp(self) -> Path:
        return ensure_checkpoint(self._ckpt or default_ckpt_path(self.size_mb), self.size_mb)

    @cached_property
    def moe(self) -> Path:
        return ensure_moe_checkpoint(default_moe_path(self.size_mb), self.size_mb)

    @cached_property
    def fp8(self) -> Path:
        return ensure_fp8_checkpoint(default_fp8_path(self.size_mb), self.size_mb)

    @cached_property
    def serving(self) -> Path:
        """The HF folder (float32) the ``--quantize`` rows read: the ``--merge-lora`` base of a
        benchmark checkpoint large enough that the model alone is over 1 GiB (3200 MiB of
        checkpoint: 1073 MiB of model), or of ``--size-mb`` when a smaller run is asked."""
        size = max(self.size_mb, SERVING_CKPT_MB) if self.size_mb >= DEFAULT_SIZE_MB else self.size_mb
        dcp = self.dcp if self._ckpt is not None or size == self.size_mb else ensure_checkpoint(default_ckpt_path(size), size)
        return ensure_lora_pair(dcp) / "base"

    @cached_property
    def lora(self) -> Path:
        """``base/`` (the benchmark model as an HF folder, float32) and ``adapter/`` (a LoRA
        adapter of it as PEFT saves one), made once beside the benchmark checkpoint."""
        return ensure_lora_pair(self.dcp)


def budget_mib(spec: str) -> float:
    """``--max-memory`` in MiB, read as reshard reads it (KiB/MiB/GiB and K/M/G binary, KB/MB/GB decimal)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*", spec, re.IGNORECASE)
    if m is None:
        raise SystemExit(f"bench: --max-memory {spec!r}: give a size like 256MiB")
    number, prefix, suffix = float(m[1]), m[2].upper(), m[3]
    power = "KMGT".index(prefix) + 1 if prefix else 0
    base = 1000 if suffix.upper() == "B" and prefix else 1024  # 2GB is decimal; 2G, 2GiB binary
    return number * base**power / MIB


def llama_heads(dim: int, kv_dim: int) -> tuple[int, int]:
    """(n_heads, n_kv_heads) for the benchmark checkpoint's dims: the smallest even head size of
    at least 32 that divides both (RoPE pairs need an even head size)."""
    for hd in range(32, kv_dim + 1, 2):
        if dim % hd == 0 and kv_dim % hd == 0:
            return dim // hd, kv_dim // hd
    raise ValueError(f"no even head size divides dim {dim} and kv_dim {kv_dim}")


def dim1_plan() -> dict[str, Any]:
    """PLAN.json putting every matrix of the benchmark checkpoint on ``Shard(1)`` (norms stay ``Shard(0)``)."""
    s1 = ["Shard(1)"]
    return {"placements": {"tok_embeddings.weight": s1, "output.weight": s1, "layers.*.attention.w*.weight": s1,
                           "layers.*.feed_forward.w*.weight": s1}, "default": ["Shard(0)"]}


def _tree_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _size_check(out: Path, src: Path, lo: float, hi: float) -> Callable[[], str | None]:
    """The output holds between ``lo`` and ``hi`` times the source's bytes."""

    def check() -> str | None:
        ratio = _tree_bytes(out) / max(1, _tree_bytes(src))
        return None if lo <= ratio <= hi else f"{out.name} holds {ratio:.2f}x the source's bytes, not {lo}-{hi}x"

    return check


def _derived(ctx: Context, name: str, source: Path, flags: list[str], done: str) -> Path:
    """A source made by reshard itself once per run, beside the scratch dir (not measured)."""
    out = ctx.scratch.parent / name
    if not (out / done).exists():
        argv = [*ctx.reshard, "convert", str(source), str(out), *flags, "--max-memory", ctx.max_memory, "--quiet"]
        subprocess.run(argv, check=True, capture_output=True, timeout=3600)
    return out


def _llama_config(ctx: Context, src: Path) -> Path:
    """config.json of the benchmark checkpoint as an HF Llama (head counts for titan-to-hf)."""
    return _write_llama_config(src, ctx.scratch.parent / "llama_config")


def _write_llama_config(src: Path, folder: Path) -> Path:
    d = solve_dims(json.loads(src.with_name(src.name + ".marker.json").read_text())["request"]["size_mb"])
    heads, kv = llama_heads(d.dim, d.kv_dim)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d.dim,
           "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": d.hidden,
           "num_hidden_layers": d.n_layers, "vocab_size": d.vocab, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


def ensure_lora_pair(dcp: Path) -> Path:
    """The HF base and LoRA adapter of ``--merge-lora``'s row (see ``Sources.lora``), cached."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = dcp.with_name(dcp.name + "_lora")
    if (out / "adapter" / "adapter_config.json").is_file():
        return out
    cfg = _write_llama_config(dcp, out / "cfg")
    subprocess.run([*reshard_argv(), "convert", str(dcp), str(out / "base"), "--to", "hf", "--config", str(cfg),
                    "--overwrite", "--quiet"], check=True, capture_output=True, timeout=3600)
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for f in sorted((out / "base").glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                module = name.removesuffix(".weight")
                if module.rsplit(".", 1)[-1] in ("q_proj", "v_proj", "gate_proj"):
                    rows, cols = st.get_slice(name).get_shape()
                    tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(LORA_RANK, cols, generator=generator) * 0.01
                    tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(rows, LORA_RANK, generator=generator) * 0.01
    (out / "adapter").mkdir(exist_ok=True)
    save_file(tensors, out / "adapter" / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": LORA_RANK, "lora_alpha": 2 * LORA_RANK,
              "target_modules": ["q_proj", "v_proj", "gate_proj"],
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}}
    (out / "adapter" / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def lora_budget_mib(base: Path) -> int:
    """``--max-memory`` of the ``--merge-lora`` row: a quarter of the model (1 MiB at least)."""
    return max(1, int(_tree_bytes(base) / 4 / MIB))


# ------------------------------------------------------------------------------------ rows


@dataclass(frozen=True)
class PathRow:
    row: Row
    needs: tuple[str, ...]  # Sources attributes it reads: "dcp", "moe", "fp8"
    target: str | None  # "dtype": DTYPE_RSS_MIB; "budget": budget + OVER_BUDGET_MIB; None: a peer
    what: str  # the issue and acceptance it measures
    budget_mib: Callable[[], float] | None = None  # the row's own --max-memory, when not the run's

    def target_mib(self, budget: float) -> float | None:
        if self.target is None:
            return None
        if self.target == "dtype":
            return DTYPE_RSS_MIB
        return (self.budget_mib() if self.budget_mib is not None else budget) + OVER_BUDGET_MIB


_TORCH_CAST = """\
import sys
import torch
from torch.distributed.checkpoint import FileSystemReader, save
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

def cast(d):
    for k, v in d.items():
        if isinstance(v, dict):
            cast(v)
        elif isinstance(v, torch.Tensor) and v.is_floating_point():
            d[k] = v.to(torch.bfloat16)

sd = {}  # the whole checkpoint, loaded the way torch's dcp_to_torch_save does
_load_state_dict(sd, storage_reader=FileSystemReader(sys.argv[1]), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
cast(sd)
save(sd, checkpoint_id=sys.argv[2], no_dist=True)
"""

# torchtitan's convert_to_hf, written out: the whole DCP in memory, its qwen3 adapter's renames
# with the grouped experts split, then huggingface_hub's save (experts cloned: they must not
# share storage in a safetensors file).
_TORCH_MOE = """\
import os, re, shutil, sys
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from huggingface_hub import save_torch_state_dict

RENAMES = [(r"tok_embeddings\\.weight", "model.embed_tokens.weight"), (r"norm\\.weight", "model.norm.weight"),
           (r"output\\.weight", "lm_head.weight"),
           (r"layers\\.(\\d+)\\.attention\\.w([qkvo])\\.weight", r"model.layers.\\1.self_attn.\\2_proj.weight"),
           (r"layers\\.(\\d+)\\.attention\\.([qk])_norm\\.weight", r"model.layers.\\1.self_attn.\\2_norm.weight"),
           (r"layers\\.(\\d+)\\.attention_norm\\.weight", r"model.layers.\\1.input_layernorm.weight"),
           (r"layers\\.(\\d+)\\.ffn_norm\\.weight", r"model.layers.\\1.post_attention_layernorm.weight"),
           (r"layers\\.(\\d+)\\.moe\\.router\\.gate\\.weight", r"model.layers.\\1.mlp.gate.weight")]
EXPERTS = re.compile(r"layers\\.(\\d+)\\.moe\\.experts\\.w([123])")
PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}
sd = {}
_load_state_dict(sd, storage_reader=FileSystemReader(sys.argv[1]), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
hf = {}
for name in [n for n, v in sd.items() if isinstance(v, torch.Tensor)]:
    t = sd.pop(name)
    m = EXPERTS.fullmatch(name)
    if m:
        for e in range(t.shape[0]):
            hf[f"model.layers.{m[1]}.mlp.experts.{e}.{PROJ[m[2]]}.weight"] = t[e].clone()
        del t
        continue
    for pattern, repl in RENAMES:
        if re.fullmatch(pattern, name):
            hf[re.sub(pattern, repl, name)] = t
            break
os.makedirs(sys.argv[2])
save_torch_state_dict(hf, sys.argv[2])
shutil.copy(os.path.join(sys.argv[3], "config.json"), sys.argv[2])
"""

# DeepSeek-V3's inference/fp8_cast_bf16.py on a CPU: one shard at a time, weight x scale per block.
_SHARD_DEQUANT = """\
import json, os, sys
import torch
from safetensors.torch import load_file, save_file

src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
cfg = json.load(open(os.path.join(src, "config.json")))
bo, bi = cfg.pop("quantization_config")["weight_block_size"]
weight_map = {}
for fname in sorted(set(json.load(open(os.path.join(src, "model.safetensors.index.json")))["weight_map"].values())):
    sd, out = load_file(os.path.join(src, fname)), {}
    for k, t in sd.items():
        if k.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s, (r, c) = sd[k[: -len("weight")] + "weight_scale_inv"], t.shape
            t = (t.float() * s.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:r, :c]).to(torch.bfloat16)
        out[k] = t
    save_file(out, os.path.join(dst, fname), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(out, fname))
    del sd, out
json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(dst, "model.safetensors.index.json"), "w"))
"""


def path_rows(src: Sources) -> list[PathRow]:
    def reshard(c: Context, source: Path, out: Path, *flags: str) -> list[str]:
        return [*c.reshard, "convert", str(source), str(out), *flags, "--max-memory", c.max_memory, "--quiet"]

    def dtype(c: Context) -> Command:
        out = c.scratch / "out_bf16"
        return Command(reshard(c, src.dcp, out, "--dtype", "bfloat16"), out / ".metadata", sources=(src.dcp,),
                       check=_size_check(out, src.dcp, 0.4, 0.6))

    def torch_cast(c: Context) -> Command:
        out = c.scratch / "torch_bf16"
        return Command([c.python, "-c", _TORCH_CAST, str(src.dcp), str(out)], out / ".metadata", sources=(src.dcp,),
                       check=_size_check(out, src.dcp, 0.4, 0.6))

    def relayout(dim: int) -> Callable[[Context], Command]:
        def build(c: Context) -> Command:
            out = c.scratch / f"out_dim{dim}"
            flags = ["--to-mesh", MESH]
            if dim == 1:
                plan = c.scratch.parent / "dim1_plan.json"
                plan.write_text(json.dumps(dim1_plan(), indent=1) + "\n")
                flags += ["--placements", str(plan)]
            size = _size_check(out, src.dcp, 0.8, 1.2)

            def check() -> str | None:
                files = len(list(out.glob("__*_0.distcp")))
                return size() or (None if files == int(MESH) else f"wrote {files} rank files, not {MESH}")

            return Command(reshard(c, src.dcp, out, *flags), out / ".metadata", sources=(src.dcp,), check=check)

        return build

    def titan_to_hf(c: Context) -> Command:
        out = c.scratch / "out_hf_names"
        flags = ["--keymap", "titan-to-hf", "--config", str(_llama_config(c, src.dcp))]
        return Command(reshard(c, src.dcp, out, *flags), out / ".metadata", sources=(src.dcp,),
                       check=_size_check(out, src.dcp, 0.8, 1.2))

    def hf_fuse(c: Context) -> Command:
        flags = ["--keymap", "titan-to-hf", "--config", str(_llama_config(c, src.dcp))]
        hf_named = _derived(c, "hf_named", src.dcp, flags, ".metadata")
        out = c.scratch / "out_fused"
        return Command(reshard(c, hf_named, out, "--keymap", "hf-fuse"), out / ".metadata", sources=(hf_named,),
                       check=_size_check(out, hf_named, 0.8, 1.2))

    def zarr_write(c: Context) -> Command:
        out = c.scratch / "out.zarr"
        return Command(reshard(c, src.dcp, out, "--to", "zarr", "--compress"), out / "zarr.json", sources=(src.dcp,),
                       check=_size_check(out, src.dcp, 0.5, 1.2))

    def zarr_read(c: Context) -> Command:
        store = _derived(c, "source_zstd.zarr", src.dcp, ["--to", "zarr", "--compress"], "zarr.json")
        out = c.scratch / "out.safetensors"
        return Command(reshard(c, store, out), out, sources=(store,), check=_size_check(out, src.dcp, 0.8, 1.2))

    def moe(c: Context) -> Command:
        out = c.scratch / "moe_hf"
        argv = reshard(c, src.moe, out, "--to", "hf", "--config", str(config_dir(src.moe)))
        return Command(argv, out / "config.json", sources=(src.moe,), check=_size_check(out, src.moe, 0.8, 1.2))

    def torch_moe(c: Context) -> Command:
        out = c.scratch / "torch_moe_hf"
        argv = [c.python, "-c", _TORCH_MOE, str(src.moe), str(out), str(config_dir(src.moe))]
        return Command(argv, out / "config.json", sources=(src.moe,), check=_size_check(out, src.moe, 0.8, 1.2))

    def fp8_check(out: Path) -> Callable[[], str | None]:
        size = _size_check(out, src.fp8, 1.6, 2.2)  # one byte -> two, scales dropped

        def check() -> str | None:
            if "quantization_config" in json.loads((out / "config.json").read_text()):
                return "config.json still has quantization_config"
            return size()

        return check

    def fp8(c: Context) -> Command:
        out = c.scratch / "fp8_hf"
        return Command(reshard(c, src.fp8, out, "--to", "hf", "--dtype", "bfloat16"), out / "config.json",
                       sources=(src.fp8,), check=fp8_check(out))

    def shard_dequant(c: Context) -> Command:
        out = c.scratch / "fp8_bf16"
        return Command([c.python, "-c", _SHARD_DEQUANT, str(src.fp8), str(out)], out / "config.json",
                       sources=(src.fp8,), check=fp8_check(out))

    def merge_lora(c: Context) -> Command:
        base, adapter, out = src.lora / "base", src.lora / "adapter", c.scratch / "merged_hf"
        argv = [*c.reshard, "convert", str(base), str(out), "--to", "hf", "--merge-lora", str(adapter),
                "--max-memory", f"{lora_budget_mib(base)}MiB", "--quiet"]
        size = _size_check(out, base, 0.95, 1.05)

        def check() -> str | None:  # a merge that changed nothing is a failed row
            from safetensors import safe_open

            name = "model.layers.0.self_attn.q_proj.weight"
            index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"] \
                if (base / "model.safetensors.index.json").is_file() else {name: "model.safetensors"}
            with safe_open(base / index[name], "pt") as a, safe_open(out / index[name], "pt") as b:
                same = bool((a.get_slice(name)[:8] == b.get_slice(name)[:8]).all())
            return size() or (f"{name} is unchanged: nothing was merged" if same else None)

        return Command(argv, out / "config.json", sources=(base, adapter), check=check)

    def quantize_check(out: Path, base: Path) -> Callable[[], str | None]:
        size = _size_check(out, base, 0.2, 0.7)  # float32 -> float8 linear weights; embeddings and head as they are

        def check() -> str | None:
            qc = json.loads((out / "config.json").read_text()).get("quantization_config", {})
            return size() or (None if qc.get("format") == "float-quantized" else "config.json says no FP8_DYNAMIC")

        return check

    def quantize(c: Context) -> Command:
        base, out = src.serving, c.scratch / "quantized_hf"
        return Command(reshard(c, base, out, "--to", "hf", "--quantize", "fp8-dynamic"), out / "config.json",
                       sources=(base,), check=quantize_check(out, base))

    def model_free_ptq(c: Context) -> Command:
        base, out = src.serving, c.scratch / "model_free_ptq_hf"
        if not LLMC_PYTHON.exists():
            argv = [c.python, "-c", f"raise SystemExit('llm-compressor venv absent ({LLMC_PYTHON}): "
                                    "bash scripts/peer_venvs.sh llmcompressor')"]
        else:  # the same ignore list reshard writes for this model
            argv = [str(LLMC_PYTHON), "-c", "import sys\nfrom llmcompressor import model_free_ptq\n"
                    "model_free_ptq(sys.argv[1], sys.argv[2], scheme='FP8_DYNAMIC', "
                    "ignore=['lm_head', 'model.embed_tokens'], device='cpu')", str(base), str(out)]
        return Command(argv, out / "config.json", sources=(base,), check=quantize_check(out, base))

    i15, i14, i18, i33, i40 = "issue 15", "issue 14", "issue 18", "issue 33", "issue 40"
    return [
        PathRow(Row(IMPORT_TORCH, lambda c: Command([c.python, "-c", "import torch"], sources=())), (), None,
                "baseline"),
        PathRow(Row(DTYPE, dtype, required=True), ("dcp",), "dtype", f"{i15} acc. 3: --dtype casting"),
        PathRow(Row(TORCH_CAST, torch_cast), ("dcp",), None, f"peer of {DTYPE}"),
        PathRow(Row(DIM0, relayout(0), required=True), ("dcp",), "budget", f"{i15} acc. 3: dim-0 re-layout"),
        PathRow(Row(DIM1, relayout(1), required=True), ("dcp",), "budget", f"{i15} acc. 3: dim-1 re-layout"),
        PathRow(Row(TITAN_TO_HF, titan_to_hf, required=True), ("dcp",), "budget", f"{i15} #4: key-map gather (RoPE)"),
        PathRow(Row(HF_FUSE, hf_fuse, required=True), ("dcp",), "budget", f"{i15} #4: key-map gather (fuse)"),
        PathRow(Row(ZARR_WRITE, zarr_write, required=True), ("dcp",), "budget", f"{i15} #4: zarr compressed write"),
        PathRow(Row(ZARR_READ, zarr_read, required=True), ("dcp",), "budget", f"{i15} #4: zarr compressed read"),
        PathRow(Row(MOE, moe, required=True), ("moe",), "budget", f"{i14} acc. 5: MoE export"),
        PathRow(Row(TORCH_MOE, torch_moe), ("moe",), None, f"peer of {MOE}"),
        PathRow(Row(FP8, fp8, required=True), ("fp8",), "budget", f"{i18} acc. 4: dequantizing export"),
        PathRow(Row(SHARD_DEQUANT, shard_dequant), ("fp8",), None, f"peer of {FP8}"),
        PathRow(Row(MERGE_LORA, merge_lora, required=True), ("lora",), "budget",
                f"{i33} acc. 1: LoRA merge, model 4x the budget",
                budget_mib=lambda: lora_budget_mib(src.lora / "base")),
        PathRow(Row(QUANTIZE, quantize, required=True), ("serving",), "budget", f"{i40}: compressed-tensors FP8 export"),
        PathRow(Row(MODEL_FREE_PTQ, model_free_ptq), ("serving",), None, f"peer of {QUANTIZE}"),
    ]


# -------------------------------------------------------------------------------- analysis

PEERS = {DTYPE: TORCH_CAST, MOE: TORCH_MOE, FP8: SHARD_DEQUANT, QUANTIZE: MODEL_FREE_PTQ}


def path_checks(summary: Sequence[dict[str, Any]], rows: Sequence[PathRow], budget: float) -> list[dict[str, Any]]:
    """Each reshard row's peak RSS above import torch against its target, and dim-1 / dim-0 work."""
    by_row = {p.row.name: p for p in rows}
    ok = {r["name"]: r for r in summary if r.get("error") is None}
    checks: list[dict[str, Any]] = []
    for r in summary:
        p = by_row.get(r["name"])
        if p is None or p.target is None or r["name"] not in ok or r["rss_above_import_mib"] is None:
            continue
        target = p.target_mib(budget)
        y = r["rss_above_import_mib"]
        checks.append({"name": f"{r['name']}: peak RSS above import torch", "value": y, "target": target,
                       "ok": y <= target, "text": f"{r['name']}: peak RSS above import torch = {y:.0f} MiB "
                                                  f"(target <= {target:.0f}; {p.what})"})
    d0, d1 = ok.get(DIM0), ok.get(DIM1)
    if d0 and d1 and d0["work_s"] is not None and d0["work_s"] > 0 and d1["work_s"] is not None:
        x = d1["work_s"] / d0["work_s"]
        checks.append({"name": "dim-1 / dim-0 re-layout work", "value": x, "target": DIM1_WORK_TARGET,
                       "ok": x <= DIM1_WORK_TARGET,
                       "text": f"dim-1 / dim-0 re-layout work = {d1['work_s']:.2f}s / {d0['work_s']:.2f}s = {x:.2f} "
                               f"(target <= {DIM1_WORK_TARGET})"})
    for name, peer in PEERS.items():
        a, b = ok.get(name), ok.get(peer)
        if a and b and min(a["work_s"] or 0, b["work_s"] or 0) > 0:  # start-up noise can make a tiny run's work <= 0
            checks.append({"name": f"{name} vs {peer}", "value": a["work_s"] / b["work_s"], "target": None, "ok": True,
                           "text": f"{name}: work {a['work_s'] / b['work_s']:.2f}x, peak RSS "
                                   f"{a['peak_rss_mib']:.0f} vs {b['peak_rss_mib']:.0f} MiB against {peer}"})
    return checks


def annotate(summary: Sequence[dict[str, Any]], rows: Sequence[PathRow], budget: float,
             src_bytes: dict[str, int]) -> None:
    """Add each row's target, source size and throughput (MiB of source per work second), in place."""
    by_row = {p.row.name: p for p in rows}
    for r in summary:
        p = by_row[r["name"]]
        r["target_mib"] = p.target_mib(budget)
        nbytes = sum(src_bytes[n] for n in p.needs)
        r["src_mib"] = nbytes / MIB if nbytes else None
        r["mib_per_s"] = nbytes / MIB / r["work_s"] if nbytes and r.get("work_s") else None


_COLUMNS = [("wall s", "wall_s", "8.2f"), ("cpu s", "cpu_s", "8.2f"), ("work s", "work_s", "8.2f"),
            ("peak RSS MiB", "peak_rss_mib", "13.0f"), ("RSS>torch MiB", "rss_above_import_mib", "14.0f"),
            ("target MiB", "target_mib", "11.0f"), ("src MiB", "src_mib", "8.0f"), ("MiB/s", "mib_per_s", "7.0f")]


def run_paths(args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Any], int]:
    src = Sources(args.size_mb, args.ckpt)
    every = path_rows(src)
    chosen = {r.name for r in select_rows([p.row for p in every], args.only)}
    rows = [p for p in every if p.row.name in chosen]
    needed = sorted({n for p in rows for n in p.needs})
    paths = {n: getattr(src, n) for n in needed}  # made or found cached before anything is measured
    src_bytes = {n: _tree_bytes(p) for n, p in paths.items()}
    probe, reshard = rss_probe(), reshard_argv()
    ctx = Context(paths.get("dcp", workdir), workdir / "scratch", sys.executable, reshard, args.max_memory, probe)
    budget = budget_mib(args.max_memory)
    load_before = os.getloadavg()
    results = measure([p.row for p in rows], ctx, args.repeats, workdir / "logs")
    load_after = os.getloadavg()
    summary = summarize(results)
    annotate(summary, rows, budget, src_bytes)
    checks = path_checks(summary, rows, budget)
    print(f"\nmemory paths | --max-memory {args.max_memory} | WARM cache | median of {args.repeats} run(s) | "
          f"{os.cpu_count()} CPUs | RSS via {probe.name} | load average {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after")
    for n, p in paths.items():
        print(f"  {n}: {p} ({src_bytes[n] / MIB:.0f} MiB)")
    print("work = wall - wall(python -c 'import torch'); target: peak RSS above import torch; MiB/s: source MiB / work s\n")
    print_table(summary, _COLUMNS, width=34)
    print_checks(checks)
    print("  INFO  runtime: python scripts/bench_load.py (load_state_dict beside torch's dcp.load, its own targets) and "
          "scripts/bench_load_model.py (load_model into FSDP2 + AdamW; run at the end of the default bench.py table)")
    failed = [m for m in results if m.required and not m.ok]
    for m in failed:
        print(f"\nreshard FAILED: {m.name}: {m.error}")
    env = environment(ctx, args.repeats)
    env["load_average"] = {"before": load_before, "after": load_after}
    missed = args.strict and not all(c["ok"] for c in checks)
    report = {"mode": "paths", "sources": {n: {"path": str(p), "bytes": src_bytes[n]} for n, p in paths.items()},
              "budget_mib": budget, "env": env, "rows": summary, "acceptance": checks}
    return report, 1 if failed or missed else 0
