"""Layer 6, the features: what a conversion can do beyond moving bytes.

The HF export (``hf_export``) and the architecture check (``architecture``), LoRA merges
(``lora``), quantization schemes (``quantize/``) beside the dequantization of quantized
releases (``dequantize``), key maps between naming schemes (``keymap/``), the HF configs a
checkpoint carries (``provenance``) and the Hub (``hub``). May import the layers below (core,
safe_pickle, pipeline) and the format registry, never a format itself; a format never imports
a feature (the HF writer runs the architecture check its export step recorded, ``hf_check``).
"""
