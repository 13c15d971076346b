"""The synthetic stream: the same global batch on any rank count, resumable at any position."""

from __future__ import annotations

import pytest
import torch

from reshard.core.errors import UsageError
from reshard.train.data import SyntheticTokens

DATA = SyntheticTokens(vocab_size=64, seq_len=16, global_batch=12, seed=0)


def test_each_rank_takes_its_slice_of_one_global_batch() -> None:
    whole_in, whole_lab = DATA.local_batch(24, 0, 1)
    assert whole_in.shape == whole_lab.shape == (12, 16)
    assert torch.equal(whole_in[:, 1:], whole_lab[:, :-1])  # labels are the next tokens
    for world in (2, 3, 4):
        parts = [DATA.local_batch(24, r, world) for r in range(world)]
        assert torch.equal(torch.cat([p[0] for p in parts]), whole_in)
        assert torch.equal(torch.cat([p[1] for p in parts]), whole_lab)


def test_stream_is_a_function_of_seed_and_position() -> None:
    assert torch.equal(DATA.sample(5), SyntheticTokens(64, 16, 4, seed=0).sample(5))
    assert not torch.equal(DATA.sample(5), DATA.sample(6))
    assert not torch.equal(DATA.sample(5), SyntheticTokens(64, 16, 12, seed=1).sample(5))
    # Position 12 starts where the batch at 0 ended: step 2 of a resumed run is step 2 of the original.
    assert torch.equal(DATA.local_batch(12, 0, 1)[0][0], DATA.sample(12)[:-1])
    tokens = torch.stack([DATA.sample(i) for i in range(50)])
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 64


def test_a_batch_that_does_not_split_is_refused() -> None:
    with pytest.raises(UsageError, match="global batch 12 does not split over 5 ranks"):
        DATA.local_batch(0, 0, 5)
