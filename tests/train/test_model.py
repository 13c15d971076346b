"""The training model: the contract's names and shapes, causality, Meta-style RoPE, grouped
query attention, and an initialization that does not depend on how the model is sharded."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from reshard.core.errors import UsageError
from reshard.train.model import ModelConfig, Transformer, apply_rotary_emb, precompute_freqs_cis

TINY = ModelConfig.preset("tiny")


def _materialized(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """As the loop builds it: on the meta device, then to_empty + init_weights."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def test_parameter_names_and_shapes_follow_the_contract() -> None:
    c, hd = TINY, TINY.head_dim
    want = {"tok_embeddings.weight": [c.vocab_size, c.dim], "norm.weight": [c.dim], "output.weight": [c.vocab_size, c.dim]}
    for i in range(c.n_layers):
        p = f"layers.{i}."
        want.update({
            p + "attention_norm.weight": [c.dim], p + "ffn_norm.weight": [c.dim],
            p + "attention.wq.weight": [c.n_heads * hd, c.dim], p + "attention.wk.weight": [c.n_kv_heads * hd, c.dim],
            p + "attention.wv.weight": [c.n_kv_heads * hd, c.dim], p + "attention.wo.weight": [c.dim, c.n_heads * hd],
            p + "feed_forward.w1.weight": [c.ffn_dim, c.dim], p + "feed_forward.w3.weight": [c.ffn_dim, c.dim],
            p + "feed_forward.w2.weight": [c.dim, c.ffn_dim]})
    model = Transformer(TINY)
    assert {n: list(t.shape) for n, t in model.state_dict().items()} == want  # no biases, no rotary buffer
    assert sum(p.numel() for p in model.parameters()) == TINY.num_params
    for name in ("small", "100m"):
        cfg = ModelConfig.preset(name)
        with torch.device("meta"):
            assert sum(p.numel() for p in Transformer(cfg).parameters()) == cfg.num_params
    assert 90e6 < ModelConfig.preset("100m").num_params < 110e6


def test_tied_embeddings_share_one_parameter_through_meta_init() -> None:
    model = _materialized(replace(TINY, tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert [n for n, _ in model.named_parameters()].count("output.weight") == 0
    assert set(model.state_dict()) >= {"tok_embeddings.weight", "output.weight"}
    assert TINY.num_params - replace(TINY, tie_embeddings=True).num_params == TINY.vocab_size * TINY.dim


def test_bad_configs_are_refused() -> None:
    with pytest.raises(UsageError, match="unknown model config 'huge'"):
        ModelConfig.preset("huge")
    with pytest.raises(UsageError, match="multiple of n_kv_heads"):
        replace(TINY, n_kv_heads=3)
    with pytest.raises(UsageError, match="longer than max_seq_len"):
        Transformer(TINY)(torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))


def test_init_is_seeded_per_parameter_and_repeatable() -> None:
    a, b, c = _materialized(TINY), _materialized(TINY), _materialized(TINY, seed=1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa))
        else:
            assert not torch.equal(pa, pc), name
            assert 0.002 < float(pa.detach().std()) < 0.03, name
    assert torch.equal(a.freqs_cis, precompute_freqs_cis(TINY.head_dim, TINY.max_seq_len, TINY.rope_theta))


def test_forward_is_causal_fp32_and_learns() -> None:
    model = _materialized(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.max_seq_len), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, TINY.max_seq_len, TINY.vocab_size) and logits.dtype == torch.float32
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % TINY.vocab_size
    with torch.no_grad():
        again = model(changed)
    torch.testing.assert_close(again[:, :10], logits[:, :10].detach(), rtol=0, atol=0)
    assert not torch.allclose(again[:, 10:], logits[:, 10:].detach())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


def test_rope_rotates_interleaved_pairs_and_depends_on_distance_only() -> None:
    hd, t = 8, 6
    freqs = precompute_freqs_cis(hd, t, 10000.0)
    x = torch.randn(1, t, 2, hd, generator=torch.Generator().manual_seed(0))
    out = apply_rotary_emb(x, freqs)
    theta = 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(t).float()[:, None] * theta  # [t, hd/2]
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    torch.testing.assert_close(out[..., 0::2], even * cos - odd * sin)
    torch.testing.assert_close(out[..., 1::2], even * sin + odd * cos)
    # <rot(q, m), rot(k, n)> depends on m - n only.
    q, k = torch.randn(hd), torch.randn(hd)
    seq = torch.stack([q] * t)[None, :, None]
    kseq = torch.stack([k] * t)[None, :, None]
    rq, rk = apply_rotary_emb(seq, freqs)[0, :, 0], apply_rotary_emb(kseq, freqs)[0, :, 0]
    torch.testing.assert_close(rq[3] @ rk[1], rq[5] @ rk[3])


def test_grouped_query_attention_matches_explicit_heads() -> None:
    """Query head h reads kv head h // (n_heads / n_kv_heads), as HF's repeat_kv."""
    model = _materialized(TINY)
    att = model.layers["0"].attention
    x = torch.randn(1, 5, TINY.dim, generator=torch.Generator().manual_seed(3))
    freqs = model.freqs_cis
    hd, rep = TINY.head_dim, TINY.n_heads // TINY.n_kv_heads
    q = apply_rotary_emb(att.wq(x).view(1, 5, TINY.n_heads, hd), freqs)
    k = apply_rotary_emb(att.wk(x).view(1, 5, TINY.n_kv_heads, hd), freqs)
    v = att.wv(x).view(1, 5, TINY.n_kv_heads, hd)
    heads = []
    mask = torch.ones(5, 5).tril().bool()
    for h in range(TINY.n_heads):
        scores = (q[0, :, h] @ k[0, :, h // rep].T) / hd ** 0.5
        heads.append(scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[0, :, h // rep])
    want = att.wo(torch.cat(heads, dim=-1))[None]
    torch.testing.assert_close(att(x, freqs), want, atol=1e-6, rtol=1e-5)
