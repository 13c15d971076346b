"""The options of an HF export (``reshard.features.hf_export``) and of what it does on the way
(a LoRA merge, ``reshard.features.lora``), declared here, apart from those modules, so that
``reshard --help`` builds its flags without importing them. The registry's ``hf`` entry takes
them; quantization declares its own (``reshard.features.quantize.options``)."""

from __future__ import annotations

import os

from reshard.pipeline.options import OutputOption

__all__ = ["HF_ASSETS", "WEIGHTS_ONLY", "ARCHITECTURE_CHECK", "MERGE_LORA"]

HF_ASSETS: OutputOption[str | os.PathLike | None] = OutputOption(
    "hf_assets", "--hf-assets", "With --to {takes:hf_assets}: copy the tokenizer, chat template and generation config "
    "of this folder or Hub repo id.", default=None, after="config")
WEIGHTS_ONLY: OutputOption[bool] = OutputOption(
    "weights_only", "--weights-only", "With --to {takes:weights_only}: write the safetensors only, without config.json "
    "(not loadable by from_pretrained as is).", default=False, type=bool, api="weights_only=True", after="hf_assets")
ARCHITECTURE_CHECK: OutputOption[bool] = OutputOption(
    "architecture_check", "--no-architecture-check", "With --to {takes:architecture_check}: write the export even if it "
    "is not the model its config.json describes (the model card says it was not checked).", default=True, type=bool,
    api="architecture_check=False", from_flag=lambda off: not off, after="weights_only")
MERGE_LORA: OutputOption[str | os.PathLike | None] = OutputOption(
    "merge_lora", "--merge-lora", "With --to {takes:merge_lora}: merge this PEFT LoRA adapter (folder or Hub repo id) "
    "into the weights, W + scaling * (B @ A) in float32, streamed.", default=None, metavar="ADAPTER", casts=False,
    after="architecture_check")
