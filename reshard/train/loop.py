"""The FSDP2 training loop: one function every rank calls under an initialized process group.

Written to the FSDP2 contract (shared/seeds/fsdp2-usage-contract.txt): the device comes from
LOCAL_RANK; the model is built on the meta device, ``fully_shard`` is applied to each block
and then the root (on a 1-D mesh, or a 2-D ``dp_replicate x dp_shard`` mesh for HSDP), and
only then materialized (``to_empty`` + a mesh-independent ``init_weights``); AdamW is created
after sharding so it holds the DTensor parameters; the model is called as ``model(x)`` so the
hooks run; checkpoints go through DCP. Resuming goes through ``reshard.load_model``, so a run
restarts from a checkpoint in any format, saved on any mesh.

Everything that decides a step's numbers (init, data, schedule) is a function of the step
and the config alone, never of the mesh: a run resumed on another rank count reproduces the
uninterrupted run up to the order of fp32 reductions.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reshard.core.errors import UsageError
from reshard.core.log import LOGGER
from reshard.core.sharding import MeshSpec, parse_mesh
from reshard.train.checkpoint import latest_checkpoint, save_checkpoint, state_digest, train_objects
from reshard.train.data import SyntheticTokens
from reshard.train.model import ModelConfig, Transformer

__all__ = ["TrainConfig", "TrainResult", "WarmupCosine", "train", "check_config", "build_mesh", "train_device"]

TRAIN_LOG = LOGGER.getChild("train")  # per-step lines; reshard.train.launch shows them on stdout


@dataclass
class TrainConfig:
    """One run. ``steps`` is the step to stop at (a resumed run continues from its
    checkpoint's step); the LR schedule spans ``schedule_steps`` (default ``steps``) and is
    restored from the checkpoint on resume."""

    to_mesh: str = "1"  # the mesh to train on: --to-mesh, the flag that names a mesh in every command
    model: str = "tiny"  # a ModelConfig preset; a resumed run takes the checkpoint's config
    tie_embeddings: bool = False  # with a preset: share the embedding with the output projection
    steps: int = 10
    schedule_steps: int | None = None
    global_batch: int = 12
    seq_len: int | None = None  # default: the model's max_seq_len
    lr: float = 3e-3
    warmup: int = 2
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    seed: int = 0
    mixed_precision: bool = False  # bf16 parameters, fp32 gradient reduction
    ckpt_dir: str | None = None
    save_every: int = 0  # 0: only at the last step (when ckpt_dir is set)
    resume: str | None = None
    keymap: str | None = None  # for resuming from a checkpoint under other names (an HF folder)
    log: bool = True
    digest_at: tuple[int, ...] = ()  # steps after which to record state_digest (validate)


@dataclass
class TrainResult:
    start_step: int
    end_step: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> global mean loss
    checkpoints: list[str] = field(default_factory=list)
    digests: dict[int, str] = field(default_factory=dict)  # step -> state_digest (step 0..: after load)
    resumed_from: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainResult:
        out = cls(**{f.name: data[f.name] for f in fields(cls)})
        out.losses = {int(k): v for k, v in out.losses.items()}
        out.digests = {int(k): v for k, v in out.digests.items()}
        return out


class WarmupCosine:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine decay to ``min_ratio``
    at ``total``. A callable object (not a lambda) so that ``LambdaLR.state_dict`` saves its
    settings and a resumed run follows the schedule it started with."""

    def __init__(self, warmup: int, total: int, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def train_device() -> torch.device:
    """This rank's device: its GPU (from LOCAL_RANK) under NCCL, else the CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_config(cfg: TrainConfig, world: int | None = None) -> MeshSpec:
    """Refuse a run that cannot start, before any rank is spawned: the mesh's shape and size,
    and a global batch that splits over its ranks."""
    mesh = parse_mesh(cfg.to_mesh)
    if world is not None and mesh.world_size != world:
        raise UsageError(f"mesh {cfg.to_mesh!r} has {mesh.world_size} ranks but the job has {world}; "
                         f"launch {mesh.world_size} ranks (--nproc {mesh.world_size}) or change --to-mesh")
    if mesh.ndim > 2 or (mesh.ndim == 2 and mesh.names != ("dp_replicate", "dp_shard")):
        raise UsageError(f"mesh {cfg.to_mesh!r}: the training loop shards data-parallel only: give N (FSDP) "
                         "or RxS / dp_replicate=R,dp_shard=S (HSDP)")
    if cfg.global_batch % mesh.world_size:
        raise UsageError(f"--global-batch {cfg.global_batch} does not split over {mesh.world_size} ranks; "
                         "pick one divisible by the rank count (12 fits 1, 2, 3, 4 and 6)")
    ModelConfig.preset(cfg.model)  # an unknown preset
    if cfg.steps < 0 or cfg.save_every < 0:
        raise UsageError("--steps and --save-every cannot be negative")
    return mesh


def build_mesh(cfg: TrainConfig, device: torch.device) -> Any:
    """A DeviceMesh over all ranks: 1-D (FSDP) or ``dp_replicate x dp_shard`` (HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = check_config(cfg, dist.get_world_size() if dist.is_initialized() else 1)
    return init_device_mesh(device.type, mesh.shape, mesh_dim_names=mesh.names)


def _build(model_cfg: ModelConfig, cfg: TrainConfig, mesh: Any, device: torch.device) -> tuple:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = Transformer(model_cfg)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if cfg.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    model.to_empty(device=device)
    model.init_weights(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=cfg.weight_decay)
    total = cfg.schedule_steps or cfg.steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(cfg.warmup, total, cfg.min_lr_ratio))
    return model, opt, sched


def _source_config(source: Path, fallback: ModelConfig) -> tuple[ModelConfig, dict[str, Any], bool]:
    """(model config, train objects, whether the source holds optimizer state), read by rank 0
    from the source's metadata only and shared with every rank."""
    from reshard.sources.reading import read_catalog

    box: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            catalog = read_catalog(source)
            box[0] = (train_objects(catalog.objects), any(n.startswith("optim.") for n in catalog.tensors))
        except Exception as e:  # every rank must learn of it, or the others wait forever
            box[0] = e
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        raise box[0]
    train, has_optim = box[0]
    saved = train.get("model_config")
    model_cfg = ModelConfig(**saved) if isinstance(saved, dict) else fallback
    return model_cfg, train, has_optim


def _say(msg: str) -> None:
    """A line of the run's log, from rank 0 (``reshard.train`` logger: the launch shows it on stdout)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        TRAIN_LOG.info(msg)


def _resume(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LambdaLR,
            source: Path, train_state: dict[str, Any], has_optim: bool, cfg: TrainConfig) -> tuple[int, int]:
    """Load ``source`` into the sharded model (and optimizer); the (step, data position) to go on from.
    Weights without optimizer state start a new run from those weights, at step 0."""
    from reshard.runtime.load import load_model

    load_model(model, source, opt if has_optim else None, keymap=cfg.keymap, progress=False)
    if not has_optim:
        if cfg.log:
            _say(f"loaded weights from {source}; no optimizer state in it: new AdamW, schedule and data from step 0")
        return 0, 0
    if "scheduler" in train_state:
        sched.load_state_dict(train_state["scheduler"])
    step, position = int(train_state.get("step", 0)), int(train_state.get("data_position", 0))
    if cfg.log:
        _say(f"resumed from {source} at step {step} (data position {position})")
    return step, position


def train(cfg: TrainConfig) -> TrainResult:
    """Train on every rank of the current process group (or one process without one) until
    step ``cfg.steps``; returns the same result on every rank."""
    device = train_device()
    source = latest_checkpoint(Path(cfg.resume)) if cfg.resume else None
    train_state: dict[str, Any] = {}
    has_optim = False
    model_cfg = replace(ModelConfig.preset(cfg.model), tie_embeddings=cfg.tie_embeddings)
    if source is not None:
        model_cfg, train_state, has_optim = _source_config(source, model_cfg)
    mesh = build_mesh(cfg, device)
    model, opt, sched = _build(model_cfg, cfg, mesh, device)
    step, position = 0, 0
    if source is not None:
        step, position = _resume(model, opt, sched, source, train_state, has_optim, cfg)
    result = TrainResult(start_step=step, end_step=step, resumed_from=str(source) if source else None)
    if step in cfg.digest_at:
        result.digests[step] = state_digest(model, opt)
    data = SyntheticTokens(model_cfg.vocab_size, cfg.seq_len or model_cfg.max_seq_len, cfg.global_batch, cfg.seed)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    while step < cfg.steps:
        started = time.perf_counter()
        inputs, labels = (t.to(device) for t in data.local_batch(position, rank, world))
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step, position = step + 1, position + cfg.global_batch
        mean_loss = loss.detach().clone()
        if dist.is_initialized():  # gloo has no AVG: sum, then divide
            dist.all_reduce(mean_loss)
            mean_loss /= world
        result.losses[step] = float(mean_loss)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        tokens_per_s = cfg.global_batch * inputs.shape[1] / (time.perf_counter() - started)
        if cfg.log:
            _say(f"step {step:>5}/{cfg.steps}  loss {result.losses[step]:.6f}  lr {lr:.3e}  "
                 f"grad_norm {grad_norm:.3f}  {tokens_per_s:,.0f} tok/s")
        if cfg.ckpt_dir and ((cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps):
            path = save_checkpoint(Path(cfg.ckpt_dir) / f"step-{step}", model, opt, sched, step, position, model_cfg)
            result.checkpoints.append(str(path))
            if cfg.log:
                _say(f"saved checkpoint {path}")
        if step in cfg.digest_at:
            result.digests[step] = state_digest(model, opt)
    result.end_step = step
    return result
