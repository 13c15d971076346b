#!/usr/bin/env python
"""DeepSpeed ZeRO-3 -> safetensors: reshard beside DeepSpeed's own ``zero_to_fp32``.

Source: a real ZeRO-3 checkpoint of a Llama (default ~99M parameters, fp32 master + AdamW
moments: ~1.2 GB) written by DeepSpeed itself on 2 gloo CPU ranks (one training step, then
``engine.save_checkpoint``), made with DeepSpeed's venv python (``--deepspeed-python``) and
cached under ``.bench/deepspeed_zero3_<h>x<layers>/`` (git-ignored). The machinery (child
processes, ``wait4`` peak RSS, warm cache, medians) is ``scripts/bench.py``'s, from
``scripts/bench_harness.py``; rows:

* ``import torch``: the start-up every Python row pays (the baseline of "RSS>torch");
* ``reshard --only model``: ``reshard convert global_stepN/ out.safetensors --only model
  --max-memory 256MiB``, the same file DeepSpeed's function gives;
* ``reshard (all state)``: the same without ``--only``: weights and Adam moments (3x the bytes);
* ``deepspeed get_fp32+save``: ``get_fp32_state_dict_from_zero_checkpoint`` then
  ``safetensors.torch.save_file``, with DeepSpeed's venv python;
* ``cp -r``: copying the tag folder (the bytes alone);
* ``deepspeed zero_to_fp32 cli``: DeepSpeed's own CLI path,
  ``convert_zero_checkpoint_to_fp32_state_dict(..., safe_serialization=True)`` (its
  memory-saving lazy mode, PR #6658).

After the table, reshard's output is compared tensor by tensor with DeepSpeed's (bit equality),
and the issue's bound is checked: reshard's peak RSS above ``import torch`` stays within
``--max-memory`` + 384 MiB.

    python scripts/bench_deepspeed.py                        # make (once) and measure, 1 repeat
    python scripts/bench_deepspeed.py --repeats 3 --json ds.json
    python scripts/bench_deepspeed.py --hidden 512 --layers 4  # a smaller checkpoint

From Python: ``bench_deepspeed.run(hidden=768, layers=8, repeats=1)`` returns the report dict.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_harness import (  # noqa: E402
    CP,
    IMPORT_TORCH,
    MIB,
    Command,
    Context,
    Row,
    measure,
    reshard_argv,
    rss_probe,
    summarize,
    warm_read,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DS_PYTHON = os.environ.get("DS_PYTHON", "/tmp/realtools/venv-deepspeed/bin/python")
RSS_SLACK_MIB = 384  # the bound: peak RSS <= --max-memory + 384 MiB above import torch

# Run by DeepSpeed's python under torchrun: writes <out>/latest and <out>/global_step1/.
_WRITER = """\
import os, sys, torch, deepspeed
from transformers import LlamaConfig, LlamaForCausalLM
out, hidden, layers, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                  num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 192 or 1,
                  max_position_embeddings=128, tie_word_embeddings=False)
model = LlamaForCausalLM(cfg)
config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
          "zero_optimization": {"stage": 3}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
engine.backward(engine(input_ids=ids, labels=ids).loss)
engine.step()
engine.save_checkpoint(out)
torch.distributed.barrier()
engine.destroy()
torch.distributed.destroy_process_group()
"""

_DS_GET_AND_SAVE = """\
import sys, contextlib, io
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from safetensors.torch import save_file
with contextlib.redirect_stdout(io.StringIO()):
    sd = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])
save_file({k: v.contiguous() for k, v in sd.items()}, sys.argv[2])
"""

_DS_CLI = """\
import sys, contextlib, io
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
with contextlib.redirect_stdout(io.StringIO()):
    convert_zero_checkpoint_to_fp32_state_dict(sys.argv[1], sys.argv[2], safe_serialization=True)
"""


def checkpoint_path(hidden: int, layers: int) -> Path:
    return REPO / ".bench" / f"deepspeed_zero3_{hidden}x{layers}"


def ensure_checkpoint(path: Path, hidden: int, layers: int, vocab: int, ds_python: str) -> Path:
    """The ZeRO-3 tag folder under ``path``, written by DeepSpeed on 2 CPU ranks when missing."""
    tag = path / "global_step1"
    if (path / "latest").is_file() and tag.is_dir():
        return tag
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = path.parent / "_ds_writer.py"
    writer.write_text(_WRITER)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".bench" / "torch_extensions"))
    print(f"writing a DeepSpeed ZeRO-3 checkpoint (hidden {hidden}, {layers} layers) to {path} ...", file=sys.stderr)
    subprocess.run([ds_python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(writer),
                    str(path), str(hidden), str(layers), str(vocab)], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return tag


def _rows(ds_python: str) -> list[Row]:
    def reshard(only: bool):
        def build(c: Context) -> Command:
            out = c.scratch / "out.safetensors"
            extra = ["--only", "model"] if only else []
            return Command([*c.reshard, "convert", str(c.src), str(out), *extra, "--max-memory", c.max_memory,
                            "--quiet"], out)
        return build

    def deepspeed(snippet: str, out_name: str, check_file: str):
        def build(c: Context) -> Command:
            out = c.scratch / out_name
            return Command([ds_python, "-c", snippet, str(c.src.parent), str(out)], out / check_file if check_file else out)
        return build

    return [
        Row(IMPORT_TORCH, lambda c: Command([c.python, "-c", "import torch"])),
        Row(CP, lambda c: Command(["cp", "-r", str(c.src), str(c.scratch / "copy")], c.scratch / "copy"), kind="bytes"),
        Row("reshard --only model", reshard(True), required=True),
        Row("reshard (all state)", reshard(False), required=True),
        Row("deepspeed get_fp32+save", deepspeed(_DS_GET_AND_SAVE, "ds.safetensors", "")),
        Row("deepspeed zero_to_fp32 cli", deepspeed(_DS_CLI, "ds_out", "model.safetensors")),
    ]


def same_tensors(a: Path, b: Path) -> str | None:
    """None when two safetensors files hold the same tensors bit for bit (one at a time)."""
    import torch
    from safetensors import safe_open

    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        if set(fa.keys()) != set(fb.keys()):
            return f"names differ: {sorted(set(fa.keys()) ^ set(fb.keys()))[:3]}"
        for k in fa.keys():
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            if x.dtype != y.dtype or not torch.equal(x, y):
                return f"{k} differs"
    return None


def run(*, hidden: int = 768, layers: int = 8, vocab: int = 32000, repeats: int = 1, max_memory: str = "256MiB",
        ds_python: str = DEFAULT_DS_PYTHON, ckpt: Path | None = None) -> dict[str, Any]:
    """Make (once) the checkpoint, measure every row, compare outputs; returns the report."""
    from reshard.core.sizes import parse_size

    tag = ensure_checkpoint(ckpt or checkpoint_path(hidden, layers), hidden, layers, vocab, ds_python)
    nbytes = warm_read(tag)
    workdir = Path(tempfile.mkdtemp(prefix="run-", dir=tag.parent.parent))
    (workdir / "logs").mkdir()
    try:
        ctx = Context(tag, workdir / "scratch", sys.executable, reshard_argv(), max_memory, rss_probe())
        rows = _rows(ds_python)
        results = measure(rows, ctx, repeats, workdir / "logs")
        summary = summarize(results)
        # One more run of each side, kept, to compare the files bit for bit.
        check = workdir / "check"
        check.mkdir()
        mine = check / "reshard.safetensors"
        subprocess.run([*ctx.reshard, "convert", str(tag), str(mine), "--only", "model", "--quiet"], check=True)
        theirs = check / "ds.safetensors"
        same = None
        if subprocess.run([ds_python, "-c", _DS_GET_AND_SAVE, str(tag.parent), str(theirs)],
                          capture_output=True).returncode == 0:
            same = same_tensors(mine, theirs) or "bit-identical"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    budget = parse_size(max_memory) / MIB
    checks = [{"name": r["name"], "rss_above_import_mib": r["rss_above_import_mib"],
               "bound_mib": budget + RSS_SLACK_MIB, "ok": r["rss_above_import_mib"] <= budget + RSS_SLACK_MIB}
              for r in summary if r["name"].startswith("reshard") and r.get("rss_above_import_mib") is not None]
    return {"src": str(tag), "src_bytes": nbytes, "max_memory": max_memory, "repeats": repeats, "rows": summary,
            "outputs": same, "checks": checks}


def print_report(report: dict[str, Any]) -> None:
    print(f"\nDeepSpeed ZeRO-3 {report['src']} ({report['src_bytes'] / MIB:.0f} MiB, 2 ranks) | WARM cache | "
          f"median of {report['repeats']} run(s) | reshard --max-memory {report['max_memory']} | "
          f"{os.cpu_count()} CPUs")
    print("work = wall - wall(python -c 'import torch') (cp: its wall); RSS>torch = peak RSS - its peak RSS\n")
    columns = (("wall s", "wall_s"), ("cpu s", "cpu_s"), ("work s", "work_s"), ("peak RSS MiB", "peak_rss_mib"),
               ("RSS>torch MiB", "rss_above_import_mib"))
    head = f"{'command':<28}" + "".join(f" {h:>13}" for h, _ in columns)
    print(head)
    print("-" * len(head))
    for r in report["rows"]:
        if r["error"] is not None:
            print(f"{r['name']:<28} unavailable: {r['error'].splitlines()[0]}")
            continue
        cells = ["-" if r[k] is None else f"{r[k]:.{0 if 'mib' in k else 2}f}" for _, k in columns]
        print(f"{r['name']:<28}" + "".join(f" {c:>13}" for c in cells))
    print(f"\nreshard --only model vs DeepSpeed's get_fp32_state_dict_from_zero_checkpoint: {report['outputs']}")
    for c in report["checks"]:
        print(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['name']}: peak RSS above import torch "
              f"{c['rss_above_import_mib']:.0f} MiB (bound: --max-memory + {RSS_SLACK_MIB} = {c['bound_mib']:.0f} MiB)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=768, help="model width (default 768: ~99M parameters, ~1.2 GB)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-memory", default="256MiB")
    ap.add_argument("--deepspeed-python", default=DEFAULT_DS_PYTHON,
                    help="a python with deepspeed installed (default $DS_PYTHON or the realtools venv)")
    ap.add_argument("--ckpt", type=Path, default=None, help="where the checkpoint is (made there if missing)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    report = run(hidden=args.hidden, layers=args.layers, vocab=args.vocab, repeats=args.repeats,
                 max_memory=args.max_memory, ds_python=args.deepspeed_python, ckpt=args.ckpt)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    failed = [r for r in report["rows"] if r["name"].startswith("reshard") and r["error"] is not None]
    return 1 if failed or not all(c["ok"] for c in report["checks"]) or report["outputs"] not in (None, "bit-identical") else 0


if __name__ == "__main__":
    sys.exit(main())
