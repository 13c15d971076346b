"""The quantization schemes ``--quantize`` takes, one row each: a new scheme is its module (a
``Scheme``: reshard.features.quantize.scheme) and its row here."""

from __future__ import annotations

from reshard.core.errors import UsageError, option
from reshard.features.quantize.deepseek_fp8 import DeepSeekFp8
from reshard.features.quantize.fp8_block import Fp8Block
from reshard.features.quantize.fp8_dynamic import Fp8Dynamic
from reshard.features.quantize.nvfp4 import Nvfp4
from reshard.features.quantize.scheme import Scheme

__all__ = ["SCHEMES", "scheme_named"]

SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    DeepSeekFp8(),  # fp8: DeepSeek-V3's weight_scale_inv per 128x128 block
    Fp8Dynamic(),  # fp8-dynamic: compressed-tensors FP8_DYNAMIC
    Fp8Block(),  # fp8-block: compressed-tensors FP8_BLOCK
    Nvfp4(),  # nvfp4: compressed-tensors NVFP4A16
)}


def scheme_named(name: str) -> Scheme:
    """The registered scheme ``name``; a usage error listing them when there is none."""
    found = SCHEMES.get(name)
    if found is None:
        listed = "; ".join(f"{s.name} ({s.summary})" for s in SCHEMES.values())
        raise UsageError(f"{option('--quantize', 'quantize=')} {name!r}: reshard writes {listed}")
    return found
