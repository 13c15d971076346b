"""Tiny Llama folders written by transformers itself, for the HF export / import / push tests."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["save_tiny_llama", "hf_logits", "TOKENS"]

# Every test compares logits on the same batch: 2 sequences of 10 tokens of a 64-token vocab.
TOKENS = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(7))


def save_tiny_llama(folder: Path, *, tie: bool, max_shard_size: str = "20KB") -> Path:
    """``LlamaForCausalLM.save_pretrained`` of a GQA model (4 heads, 2 kv heads), sharded into
    several files; tied or untied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # no two tensors equal by construction (norms start at ones)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def hf_logits(folder: Path, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(tokens).logits
