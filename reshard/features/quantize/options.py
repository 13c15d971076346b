"""``--quantize``, declared apart from the schemes so that ``reshard --help`` builds its flags
without importing them; the registry's ``hf`` entry takes it."""

from __future__ import annotations

from reshard.pipeline.options import OutputOption

__all__ = ["QUANTIZE"]


def _known_scheme(name: str) -> None:
    """A scheme reshard does not write is refused before anything is read (the schemes'
    modules are imported only when one is asked for)."""
    from reshard.features.quantize.registry import scheme_named

    scheme_named(name)


QUANTIZE: OutputOption[str | None] = OutputOption(
    "quantize", "--quantize", "With --to {takes:quantize}: store the linear weights quantized: fp8 (DeepSeek-V3's "
    "float8_e4m3fn with float32 scales per 128x128 block), or compressed-tensors' fp8-dynamic (a scale per output "
    "channel), fp8-block (per 128x128 block) or nvfp4 (NVFP4A16), for vLLM, SGLang and transformers.", default=None,
    metavar="SCHEME", check=_known_scheme, casts=True, after="keep_dtype")
