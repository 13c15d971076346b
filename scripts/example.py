"""The built-in example: make a small sharded checkpoint with torch itself, then reshard it.

No downloads. Trains a tiny model with FSDP2 on 2 gloo ranks for two AdamW steps, saves it
with torch.distributed.checkpoint, then runs the main job: inspect, convert to safetensors
and to a torch file, lay it out for a 3-rank mesh, and verify each against the source.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path


def run(*args: str) -> None:
    print("$", " ".join(args), flush=True)
    subprocess.run(args, check=True)


def main() -> None:
    from reshard.example import save_fsdp2_dcp

    work = Path(tempfile.mkdtemp(prefix="reshard-example-"))
    ckpt = work / "ckpt"
    print(f"making an FSDP2 + AdamW checkpoint on 2 gloo ranks in {ckpt}", flush=True)
    save_fsdp2_dcp(ckpt, world_size=2)
    run("reshard", "inspect", str(ckpt))
    run("reshard", "convert", str(ckpt), str(work / "model.safetensors"), "--only", "model")
    run("reshard", "convert", str(ckpt), str(work / "full.pt"), "--max-memory", "1MiB")
    run("reshard", "verify", str(ckpt), str(work / "full.pt"))
    run("reshard", "inspect", str(ckpt), "--to-mesh", "3")  # what each of 3 ranks would hold
    run("reshard", "convert", str(ckpt), "--to-mesh", "3")  # ckpt_3/, beside ckpt/
    run("reshard", "verify", str(ckpt), str(work / "ckpt_3"))
    run("reshard", "verify", "--quick", str(work / "ckpt_3"))
    print(f"done: outputs in {work}")


if __name__ == "__main__":
    main()
