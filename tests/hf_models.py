"""Tiny Llama folders written by transformers itself, for the HF export / import / push tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["save_tiny_llama", "save_hf_names_dcp", "hf_logits", "save_lora_adapter", "peft_merged", "TOKENS", "assert_checked",
           "assert_refused_without_keymap"]

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


def assert_checked(said: str, architecture: str) -> None:
    """The export was checked against ``architecture`` (not merely "not checked")."""
    assert f"checked against {architecture} built by transformers on the meta device" in said, said


def assert_refused_without_keymap(src: Path, config: Path, tmp: Path) -> None:
    """The same model section under its own names, beside the same config.json (what an export
    without its key map would be): ``reshard push`` refuses it, naming what is missing."""
    import shutil

    from tests.test_cli import assert_one_line_error, reshard

    raw = tmp / "without_keymap"
    raw.mkdir()
    assert reshard("convert", src, raw / "model.safetensors", "--only", "model", "--quiet").returncode == 0
    shutil.copy(config, raw / "config.json")
    assert_one_line_error(reshard("push", raw, "someone/model", "--dry-run"), "its config.json describes", "tensors missing",
                          "tensors it does not have")


def save_lora_adapter(base: Path, folder: Path, *, seed: int = 1, **lora: Any) -> Path:
    """A PEFT LoRA adapter of the model saved at ``base``, written by PEFT's ``save_pretrained``
    with non-zero B (``init_lora_weights=False``) so merging changes every targeted weight."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base), LoraConfig(init_lora_weights=False, **lora))
    model.save_pretrained(folder)
    return folder


def peft_merged(base: Path, adapter: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """PEFT's own merge: ``merge_and_unload().state_dict()`` and the merged model's logits."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), adapter).merge_and_unload().eval()
    with torch.no_grad():
        return {k: v.clone() for k, v in model.state_dict().items()}, model(TOKENS).logits


def save_hf_names_dcp(hf_folder: Path, folder: Path) -> Path:
    """A DCP checkpoint of an HF model's state dict under its HF names, as a training loop of
    the user's own saves it (``dcp.save({"model": model.state_dict()})``): no config recorded."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_folder)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=folder, no_dist=True)
    return folder
