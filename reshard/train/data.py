"""Deterministic synthetic tokens: no downloads, resumable at any position, mesh-independent.

Sample ``i`` of the stream is a function of ``(seed, i)`` alone: an arithmetic progression
modulo the vocabulary (random start and stride) with a few tokens replaced by noise, so a
model can learn it and the loss visibly falls. A step consumes one global batch of samples
``[position, position + global_batch)``; each rank takes its contiguous slice of it. The
global batch is thus the same on 1, 2, 3 or 4 ranks, and a run resumed at ``position`` on
another mesh sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reshard.core.errors import UsageError

__all__ = ["SyntheticTokens"]

_NOISE = 0.1  # share of tokens replaced by uniform noise
_MAX_STRIDE = 7


@dataclass(frozen=True)
class SyntheticTokens:
    vocab_size: int
    seq_len: int
    global_batch: int
    seed: int = 0

    def sample(self, index: int) -> torch.Tensor:
        """Sample ``index``: ``seq_len + 1`` tokens (inputs and the next-token labels)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_000_007 + index)
        start = int(torch.randint(self.vocab_size, (1,), generator=gen))
        stride = int(torch.randint(1, _MAX_STRIDE + 1, (1,), generator=gen))
        tokens = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        noisy = torch.rand(self.seq_len + 1, generator=gen) < _NOISE
        noise = torch.randint(self.vocab_size, (self.seq_len + 1,), generator=gen)
        return torch.where(noisy, noise, tokens)

    def local_batch(self, position: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of this rank, each [global_batch / world_size, seq_len], for the
        global batch that starts at sample ``position``."""
        if self.global_batch % world_size:
            raise UsageError(f"global batch {self.global_batch} does not split over {world_size} ranks; "
                             "pick a global batch divisible by the rank count (12 fits 1, 2, 3, 4 and 6)")
        per_rank = self.global_batch // world_size
        first = position + rank * per_rank
        rows = torch.stack([self.sample(i) for i in range(first, first + per_rank)])
        return rows[:, :-1], rows[:, 1:]
