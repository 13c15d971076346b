#!/usr/bin/env python
"""Make a DCP checkpoint of many small tensors: a fine-grained MoE (every expert's projections
their own parameters, as per-expert ``nn.Linear`` MoE layers save them) with AdamW state,
saved by 2 ranks, every tensor ``Shard(0)``::

    model.layers.{i}.moe.experts.{e}.{w1,w2,w3}.weight         (ROWS, COLS) fp32
    optim.state.layers.{i}.moe.experts.{e}.{w1,w2,w3}.weight.{exp_avg,exp_avg_sq}

72 layers x 160 experts x 3 projections x (param + 2 moments) = 103,680 tensors of 512 bytes
(53 MB of data, ~180k chunks): the cost of a checkpoint is then its names and chunks, not its
bytes, which is what the scale rows of ``scripts/bench.py`` measure. Cached like the other
generators (``<out>.marker.json``); building takes a few minutes on 2 cores.

    python scripts/make_many_tensors_ckpt.py                 # .bench/many_103680
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_bench_ckpt import REPO, SavedTensor, cached_build, generate, generator_args, save_world  # noqa: E402

__all__ = ["many_tensors_state", "ensure_many_tensors_checkpoint", "default_many_path"]

GENERATOR_VERSION = 1
LAYERS, EXPERTS, ROWS, COLS, RANKS = 72, 160, 16, 8, 2


def many_tensors_state(layers: int = LAYERS, experts: int = EXPERTS) -> list[SavedTensor]:
    out = []
    for i in range(layers):
        for e in range(experts):
            for w in ("w1", "w2", "w3"):
                fqn = f"layers.{i}.moe.experts.{e}.{w}.weight"
                out += [SavedTensor(("model", fqn), (ROWS, COLS), 0.02),
                        SavedTensor(("optim", "state", fqn, "exp_avg"), (ROWS, COLS), 1e-3),
                        SavedTensor(("optim", "state", fqn, "exp_avg_sq"), (ROWS, COLS), 1e-6)]
    return out


def default_many_path(layers: int = LAYERS, experts: int = EXPERTS) -> Path:
    return REPO / ".bench" / f"many_{layers * experts * 9}"


def ensure_many_tensors_checkpoint(out: Path, layers: int = LAYERS, experts: int = EXPERTS, seed: int = 0,
                                   timeout: float = 3600.0, quiet: bool = False) -> Path:
    """Return ``out`` holding the checkpoint, made unless cached."""
    request = {"layers": layers, "experts": experts, "rows": ROWS, "cols": COLS, "ranks": RANKS, "seed": seed,
               "version": GENERATOR_VERSION}

    def build(tmp: Path) -> dict:
        spec = many_tensors_state(layers, experts)
        save_world(tmp, spec, {"train_state": {"step": 10}}, seed, timeout, world=RANKS)
        return {"tensors": len(spec)}

    return cached_build(out, request, build, f"many-tensor checkpoint ({layers * experts * 9} tensors)", quiet)


def main(argv: list[str] | None = None) -> int:
    ap = generator_args(__doc__.split("\n\n")[0], out_help="output folder (default .bench/many_<tensors>)")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--experts", type=int, default=EXPERTS)
    args = ap.parse_args(argv)
    out = args.out or default_many_path(args.layers, args.experts)
    return generate(out, args.force, lambda o: ensure_many_tensors_checkpoint(o, args.layers, args.experts))


if __name__ == "__main__":
    sys.exit(main())
