"""The built-in example: a small sharded training checkpoint written by torch, then resharded.

No downloads. Trains the project's small Llama-style model (reshard/train/) for two AdamW
steps with FSDP2 on 2 gloo ranks; torch's own ``dcp.save`` writes the checkpoint. It lands in
the current folder as ``ckpt/``, beside ``cfg/`` (its model's HF config.json) and ``tok/`` (a
small tokenizer for its vocabulary), so the README's commands run on them as written. Then
the main job: inspect, convert to safetensors, to an HF folder and to a torch file, lay it
out for a 3-rank mesh, and verify each against the source; those outputs go to a temporary
folder, named at the end.

What is already in the current folder is used as it is: a second run reuses its ``ckpt/``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SPECIAL = ("<unk>", "<s>", "</s>")


def run(*args: str) -> None:
    """``reshard ARGS``, shown as typed; a failure stops the example with reshard's own line."""
    print("$ reshard", " ".join(args), flush=True)
    code = subprocess.run([sys.executable, "-m", "reshard", *args]).returncode
    if code:
        sys.exit(code)


def make_checkpoint(ckpt: Path) -> None:
    """``reshard train``'s checkpoint of 2 steps on 2 ranks, renamed into place at ``ckpt``."""
    staging = Path(tempfile.mkdtemp(prefix=".reshard-example-", dir=ckpt.parent))
    try:
        print(f"making {ckpt.name}/: 2 FSDP2 + AdamW steps on 2 gloo ranks, saved by torch's dcp.save", flush=True)
        run("train", "--to-mesh", "2", "--steps", "2", "--ckpt-dir", str(staging), "--quiet")
        (staging / "step-2").rename(ckpt)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_tokenizer(tok: Path, vocab_size: int, max_len: int) -> None:
    """A word-level tokenizer (tokenizers' JSON, which transformers' AutoTokenizer loads) whose
    ids are the model's vocabulary: <unk>, <s>, </s>, then the words w3, w4, ..."""
    vocab = {t: i for i, t in enumerate(SPECIAL)} | {f"w{i}": i for i in range(len(SPECIAL), vocab_size)}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in enumerate(SPECIAL)]
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                 "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
              "eos_token": "</s>", "model_max_length": max_len}
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps(tokenizer, indent=1))
    (tok / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def main() -> None:
    here = Path.cwd()
    ckpt, cfg, tok = here / "ckpt", here / "cfg", here / "tok"
    work = Path(tempfile.mkdtemp(prefix="reshard-example-"))
    if ckpt.exists():
        print(f"using the {ckpt.name}/ already in {here}", flush=True)
    else:
        make_checkpoint(ckpt)
    run("inspect", "ckpt/")
    run("convert", "ckpt/", str(work / "model.safetensors"), "--only", "model")
    run("convert", "ckpt/", str(work / "hf"), "--to", "hf")  # config.json built from the run's own model config
    if not cfg.exists():
        cfg.mkdir()
        shutil.copy(work / "hf" / "config.json", cfg / "config.json")
    if not tok.exists():
        config = json.loads((cfg / "config.json").read_text())
        write_tokenizer(tok, config["vocab_size"], config["max_position_embeddings"])
    run("convert", "ckpt/", str(work / "full.pt"), "--max-memory", "1MiB")
    run("verify", "ckpt/", str(work / "full.pt"))
    run("inspect", "ckpt/", "--to-mesh", "3")  # what each of 3 ranks would hold
    run("convert", "ckpt/", str(work / "ckpt_3"), "--to-mesh", "3")
    run("verify", "ckpt/", str(work / "ckpt_3"))
    run("verify", "--quick", str(work / "ckpt_3"))
    print(f"done: ckpt/, cfg/ (its config.json) and tok/ (a tokenizer) are in {here}, for the README's commands; "
          f"this run's outputs are in {work}")


if __name__ == "__main__":
    main()
