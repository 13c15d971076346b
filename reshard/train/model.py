"""The Llama-style decoder the project trains to validate round trips.

Small enough to read in one sitting, with torchtitan's parameter names so that its
checkpoints look like real ones (and map to HF Llama by the ``titan-to-hf`` key map):
RMSNorm, rotary embeddings (Meta style: interleaved pairs rotated as complex numbers),
grouped-query attention through ``F.scaled_dot_product_attention``, a SwiGLU MLP, and
optionally an output projection tied to the embedding.

The model is meant to be built on the meta device, sharded, then materialized with
``to_empty`` + ``init_weights``. ``init_weights`` draws every parameter's *full* value from a
generator seeded by the parameter's name and copies in only the local shard, so a run on 2
ranks, on 3, or on a 2-D mesh starts from bit-identical weights: the premise of comparing a
resumed run with an uninterrupted one.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from reshard.core.errors import UsageError

__all__ = ["ModelConfig", "Transformer", "TransformerBlock", "RMSNorm", "precompute_freqs_cis"]


@dataclass
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise UsageError(f"model dim {self.dim} must split into {self.n_heads} heads of an even size")
        if self.n_heads % self.n_kv_heads:
            raise UsageError(f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """``tiny`` (CI: ~20k parameters, milliseconds a step on CPU), ``small`` (~4M) or
        ``100m`` (~100M parameters, for GPUs)."""
        if name not in _PRESETS:
            raise UsageError(f"unknown model config {name!r}; pick one of {', '.join(_PRESETS)}")
        return cls(**_PRESETS[name])

    @property
    def num_params(self) -> int:
        hd = self.head_dim
        attn = self.dim * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        block = attn + 3 * self.dim * self.ffn_dim + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * block + self.dim + head


_PRESETS: dict[str, dict] = {
    # Shapes chosen so 3 ranks shard unevenly (64 rows: 22, 22, 20; 48: 16 each; 8 kv rows...).
    "tiny": dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16),
    "small": dict(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, max_seq_len=256),
    "100m": dict(vocab_size=16384, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, max_seq_len=1024),
}


def precompute_freqs_cis(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    """Rotations e^(i m theta_k) for positions m and frequency pairs k: [seq_len, head_dim/2]."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32)[: head_dim // 2] / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[..., 0::2], x[..., 1::2]) of ``x`` [B, T, H, D] as complex
    numbers, in fp32 whatever the compute dtype (Meta's original Llama, torchtitan)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = xc * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, xc.shape[-1])
    return torch.view_as_real(rotated).flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rotary_emb(self.wq(x).view(b, t, self.n_heads, self.head_dim), freqs_cis)
        k = apply_rotary_emb(self.wk(x).view(b, t, self.n_kv_heads, self.head_dim), freqs_cis)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        rep = self.n_heads // self.n_kv_heads  # query head h reads kv head h // rep, as HF's repeat_kv
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """``forward(tokens[B, T]) -> logits[B, T, vocab]``, causal."""

    freqs_cis: torch.Tensor  # a buffer (register_buffer below)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed "0", "1"... as torchtitan: names stay stable if layers are dropped.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: derived from the config, so checkpoints hold only learned values.
        self.register_buffer("freqs_cis", precompute_freqs_cis(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise UsageError(f"sequence of {tokens.shape[1]} tokens is longer than max_seq_len {self.cfg.max_seq_len}")
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h)).float()

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> Transformer:
        """As ``nn.Module.to_empty``, keeping a tied output projection tied: on a plain module
        it replaces each module's tensors one by one, which would untie it (under FSDP2 the
        shared parameter is swapped in place and stays tied)."""
        super().to_empty(device=device, recurse=recurse)
        if self.cfg.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        return self

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Fill every parameter (and the rotary buffer) after ``to_empty``, identically on any mesh.

        Each parameter's full value comes from its own generator, seeded by ``seed`` and the
        parameter's name; a sharded (DTensor) parameter keeps only its local shard of it. Every
        rank thus computes each full tensor once, transiently: fine up to the ~100M configs
        this model is for, and the reason runs on different meshes start identical.
        """
        from torch.distributed.tensor import DTensor, distribute_tensor

        buf = self.freqs_cis
        self.freqs_cis = precompute_freqs_cis(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta).to(buf.device)
        depth_scale = 1.0 / math.sqrt(2 * self.cfg.n_layers)  # residual projections, as GPT-2
        for name, param in self.named_parameters():  # a tied weight appears once
            full = _initial_value(name, tuple(param.shape), seed, depth_scale)
            if isinstance(param, DTensor):
                # src_data_rank=None: every rank holds the same full value, so each cuts its own
                # shard by DTensor's rules with no communication.
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                param.to_local().copy_(local)
            else:
                param.copy_(full)


def _initial_value(name: str, shape: tuple[int, ...], seed: int, depth_scale: float) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    std = 0.02 * (depth_scale if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else 1.0)
    return torch.empty(shape).normal_(0.0, std, generator=gen)
